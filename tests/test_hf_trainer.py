"""Issue 6: a wrapped BertForSequenceClassification trains under transformers.Trainer like the plain
model, and saves/reloads with save_pretrained/from_pretrained."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer requires it
from transformers import Trainer, TrainingArguments  # noqa: E402

from ortmodule import ORTModule  # noqa: E402

from .helpers import assert_close  # noqa: E402

transformers.utils.logging.set_verbosity_error()


def bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(cfg)


def dataset(n: int = 16, seq: int = 16) -> list[dict]:
    """Label 0: tokens from the lower half of the vocabulary, label 1: the upper half."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        label = i % 2
        ids = torch.randint(1 + 250 * label, 250 + 250 * label, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(label)})
    return out


def args(tmp_path, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=8, learning_rate=2e-3,
        report_to=[], use_cpu=True, save_strategy="no", eval_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def mean_loss(model, data) -> float:
    was = model.training
    model.eval()
    with torch.no_grad():
        batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
        loss = float(model(**batch).loss)
    model.train(was)
    return loss


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_wrapped_bert_like_eager(tmp_path):
    data = dataset()
    model = bert()
    eager = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = mean_loss(model, data)

    wrapped = ORTModule(model)
    trainer = Trainer(model=wrapped, args=args(tmp_path), train_dataset=data)
    trainer.train()
    assert trainer.model is wrapped
    assert wrapped.stats.exports == 1 and wrapped.stats.cache_hits == 5  # one export, reused
    ort_losses = losses(trainer)
    assert len(ort_losses) == 6
    end = mean_loss(model, data)
    print(f"\nTrainer + ORTModule: losses {[round(x, 4) for x in ort_losses]}, dataset loss {start:.4f} -> {end:.4f}")
    assert end < start
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())

    ref = Trainer(model=eager, args=args(tmp_path), train_dataset=data)
    ref.train()
    for step, (a, b) in enumerate(zip(ort_losses, losses(ref))):
        assert abs(a - b) <= 2e-3 * abs(b), f"loss at step {step}: ORTModule {a} vs eager {b}"
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close(p, q, 2e-3, n, atol=1e-4)

    # save_pretrained through the wrapper (attribute access reaches the HF model) and reload.
    wrapped.save_pretrained(tmp_path / "pretrained")
    reloaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "pretrained")
    assert list(reloaded.state_dict()) == list(model.state_dict())
    for (n, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), n

    # Trainer.save_model sees no PreTrainedModel (it does not unwrap ORTModule): it writes the state
    # dict only (model.safetensors, no config.json). The keys are the plain model's.
    trainer.save_model(str(tmp_path / "saved"))
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "saved" / "model.safetensors"))
    fresh = bert()
    fresh.load_state_dict(state)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n


def test_trainer_keeps_columns_named_by_wrapped_forward(tmp_path):
    """Trainer(remove_unused_columns=True, the default) keeps the batch keys named in
    inspect.signature(model.forward): the wrapper reports the wrapped forward's signature, so
    input_ids/attention_mask/labels survive and an extra column is dropped."""
    data = [dict(d, extra=torch.tensor(0)) for d in dataset(8)]
    wrapped = ORTModule(bert())
    trainer = Trainer(model=wrapped, args=args(tmp_path, max_steps=1), train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 1 and losses(trainer)


def test_ort_trainer_saves_checkpoints_like_the_plain_model(tmp_path):
    """ortmodule.integrations.transformers.ORTTrainer: save_model and the checkpoints write config.json
    and weights via save_pretrained, and from_pretrained reloads the trained weights."""
    from ortmodule.integrations.transformers import ORTTrainer

    data = dataset()
    model = bert()
    wrapped = ORTModule(model)
    trainer = ORTTrainer(model=wrapped, args=args(tmp_path, save_strategy="steps", save_steps=3), train_dataset=data)
    trainer.train()
    assert trainer.model is wrapped and wrapped.stats.fallbacks == 0
    trainer.save_model(str(tmp_path / "saved"))
    for folder in (tmp_path / "saved", tmp_path / "out" / "checkpoint-3"):
        assert (folder / "config.json").exists(), sorted(p.name for p in folder.iterdir())
        reloaded = transformers.BertForSequenceClassification.from_pretrained(folder)
        assert list(reloaded.state_dict()) == list(model.state_dict())
    final = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "saved")
    for (n, a), b in zip(model.state_dict().items(), final.state_dict().values()):
        assert torch.equal(a, b), n
