"""Hugging Face Trainer with ORTModule: fine-tune a small BERT (built from a config, no download) on
a synthetic two-class task, save it with Trainer.save_model and reload it with from_pretrained.

    wrapped = ORTModule(model)
    trainer = ORTTrainer(model=wrapped, args=TrainingArguments(...), train_dataset=...)
    trainer.train()
    trainer.save_model(dir)               # config.json + weights, as for the plain model

``ORTTrainer`` (``ortmodule.integrations.transformers``) is ``transformers.Trainer`` except that it
saves the wrapped PreTrainedModel like the plain one (plain ``Trainer.save_model`` does not unwrap
ORTModule and writes only the state dict). Requires ``accelerate`` (Trainer needs it).

Run:  python examples/hf_trainer.py [--out hf_out/]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from transformers import TrainingArguments

from ortmodule import ORTModule
from ortmodule.integrations.transformers import ORTTrainer

VOCAB, SEQ = 1000, 32


class TwoTopics(torch.utils.data.Dataset):
    """Label 0: sentences drawn from the lower half of the vocabulary; label 1: the upper half,
    with a quarter of the tokens from the other half as noise, and right padding."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            label = i % 2
            ids = torch.randint(1 + VOCAB // 2 * label, VOCAB // 2 * (label + 1), (SEQ,), generator=g)
            noise = torch.rand(SEQ, generator=g) < 0.25
            ids[noise] = torch.randint(1, VOCAB, (int(noise.sum()),), generator=g)
            length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
            mask = (torch.arange(SEQ) < length).long()
            self.items.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.tensor(label)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def accuracy(model, data: TwoTopics) -> float:
    model.eval()
    batch = {k: torch.stack([d[k] for d in data.items]) for k in data.items[0]}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model.train()
    return float((logits.argmax(-1) == batch["labels"]).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="hf_out")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    out = Path(args.out)
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=SEQ, num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config)
    wrapped = ORTModule(model)
    train, test = TwoTopics(512, seed=1), TwoTopics(256, seed=2)
    print(f"test accuracy before: {accuracy(wrapped, test):.3f}")

    targs = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.steps, per_device_train_batch_size=16,
        learning_rate=1e-3, warmup_steps=5, logging_steps=10, report_to=[], use_cpu=True,
        save_strategy="no", eval_strategy="no", seed=0,
    )
    trainer = ORTTrainer(model=wrapped, args=targs, train_dataset=train)  # tqdm bar from the Trainer
    result = trainer.train()
    print(f"train loss {result.training_loss:.4f}; test accuracy after: {accuracy(wrapped, test):.3f}")
    print(f"ORTModule: {wrapped.stats.exports} export(s), {wrapped.stats.cache_hits} cache hits")

    trainer.save_model(str(out / "model"))
    reloaded = transformers.BertForSequenceClassification.from_pretrained(out / "model")
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    print(f"saved to {out / 'model'}; reloaded with from_pretrained, identical weights: {same}; "
          f"reloaded test accuracy {accuracy(reloaded, test):.3f}")


if __name__ == "__main__":
    main()
