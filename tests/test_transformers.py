"""Issue 3: Hugging Face BERT and GPT-2, built from configs (no downloads), train in ORT like eager."""

import copy

import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.utils import logging as hf_logging  # noqa: E402

from ortmodule import ORTModule  # noqa: E402
from ortmodule.runtime import entry as entry_module  # noqa: E402

from .helpers import CallCounter, assert_close, by_frontend, module_path, train_side_by_side  # noqa: E402

hf_logging.set_verbosity_error()

# NOTE [AdamW eps]: some transformer gradients are exactly zero in exact arithmetic (the attention
# key bias shifts every score of a query row equally, and softmax ignores that), so eager and ORT
# both return rounding noise there. With AdamW's default eps=1e-8 noise of 1e-9 becomes a step of
# +-lr in a random direction; eps=1e-6 keeps such steps ~1e-3 lr and leaves real gradients alone.
ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6)  # noqa: E731


def bert(dropout: float = 0.0):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=128, num_labels=3,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    return transformers.BertForSequenceClassification(cfg).train()


def bert_batches(n=4, b=4, seq=32):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 1000, (b, seq), generator=g)
        mask = torch.ones(b, seq, dtype=torch.long)
        for i in range(b):  # right padding of different lengths
            mask[i, seq - 3 * i - 1 :] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (b,), generator=g)})
    return out


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=128, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg).train()


def gpt2_batches(n=4, b=4, seq=32):
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 1000, (b, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def test_bert_sequence_classification_parity():
    wrapped = train_side_by_side(
        bert(), bert_batches(), lambda out, b: out.loss, rtol=2e-3, optimizer=ADAMW, kwargs_fn=lambda b: b
    )
    out = wrapped(**bert_batches(1)[0])
    assert isinstance(out, transformers.modeling_outputs.SequenceClassifierOutput)
    assert out.logits.shape == (4, 3) and out.loss.requires_grad
    # NOTE [rows nobody reads]: the last layer's FFN runs on the [CLS] position only.
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    forward = onnx.shape_inference.infer_shapes(entry.graphs.forward)
    shapes = {v.name: v.type.tensor_type.shape.dim for v in [*forward.graph.value_info, *forward.graph.output]}
    ffn = {module_path(n): n.input[0] for n in forward.graph.node
           if n.op_type == "MatMul" and "intermediate" in (module_path(n) or "")}
    rows = {name: shapes[x][1].dim_value for name, x in ffn.items()}
    # every position in layers 0-2 (a symbolic length, 0, or under NOTE [static first] the batch's
    # length), one row in layer 3
    seq = bert_batches(1)[0]["input_ids"].shape[1]
    full = by_frontend(0, seq)
    assert sorted(rows.values()) == sorted([1, full, full, full]), rows
    assert [v for n, v in rows.items() if "layer.3" in n] == [1], rows
    counter = CallCounter(wrapped.module)
    wrapped(**bert_batches(1)[0]).loss.backward()
    assert counter.count == 0


def test_gpt2_lm_parity_with_tied_embeddings():
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    wrapped = train_side_by_side(
        model, gpt2_batches(), lambda out, b: out.loss, rtol=2e-3, optimizer=ADAMW, kwargs_fn=lambda b: b
    )
    m = wrapped.module
    assert m.lm_head.weight is m.transformer.wte.weight, "tied weights must stay tied"
    counter = CallCounter(m)
    wrapped(**gpt2_batches(1)[0]).loss.backward()
    assert counter.count == 0


def test_gpt2_past_key_values_are_each_calls_own():
    """NOTE [opaque outputs]: ``use_cache`` (GPT-2's default) returns a DynamicCache; its key/value
    tensors are graph outputs, not the trace's fake tensors kept in the output template."""
    model = gpt2()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model, fallback="raise")
    caches = []
    for batch in gpt2_batches(2):
        out, ref = wrapped(**batch), eager(**batch)
        assert type(out.past_key_values) is type(ref.past_key_values)
        for i, (a, b) in enumerate(zip(out.past_key_values.layers, ref.past_key_values.layers)):
            assert type(a.keys) is torch.Tensor and type(a.values) is torch.Tensor
            assert_close(a.keys, b.keys, 1e-4, f"layer {i} keys")
            assert_close(a.values, b.values, 1e-4, f"layer {i} values")
        out.loss.backward()
        caches.append(out.past_key_values)
    assert caches[0] is not caches[1]
    assert not torch.equal(caches[0].layers[0].keys, caches[1].layers[0].keys)


def _roberta():
    cfg = transformers.RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=40, pad_token_id=1)
    return transformers.RobertaForSequenceClassification(cfg)


def _distilbert():
    cfg = transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    return transformers.DistilBertForSequenceClassification(cfg)


@pytest.mark.parametrize("build", [_roberta, _distilbert], ids=["roberta", "distilbert"])
def test_other_encoder_classifiers_compute_the_pooled_row_only(build):
    """NOTE [rows nobody reads] on other [CLS]-pooling classifiers (dropout on, same masks as eager)."""
    torch.manual_seed(0)
    model = build().train()
    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randint(2, 100, (3, 12), generator=g), "labels": torch.tensor([0, 1, 1])}
               for _ in range(2)]
    calls = iter(range(100))

    def kwargs_fn(batch):  # eager, then ORT: the same dropout masks
        torch.manual_seed(next(calls) // 2)
        return batch

    wrapped = train_side_by_side(model, batches, lambda out, b: out.loss, rtol=2e-3, optimizer=ADAMW,
                                 kwargs_fn=kwargs_fn)
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    assert sum("/rows/" in n.name for n in entry.graphs.forward.graph.node) >= 5


@pytest.mark.parametrize("build,batches", [(gpt2, gpt2_batches), (bert, bert_batches)], ids=["gpt2", "bert"])
def test_evaluation_runs_the_optimized_inference_graph(build, batches, monkeypatch):
    """eval + no_grad: the inference session gets the inference passes and the lowered cross-entropy
    (GPT-2: no SoftmaxCrossEntropyLoss function body, no Cast copy of the logits; BERT: the pooled
    rows), with eager's loss and logits."""
    built = []
    monkeypatch.setattr(entry_module, "optimize_inference",
                        lambda m, f=entry_module.optimize_inference: built.append(f(m)) or built[-1])
    model = build().eval()
    wrapped = ORTModule(copy.deepcopy(model))
    with torch.no_grad():
        for batch in batches(2):
            want, got = model(**batch), wrapped(**batch)
            assert_close(got.loss, want.loss, 1e-5, "loss")
            assert_close(got.logits, want.logits, 1e-4, "logits")
    (graph,) = [m.graph for m in built]
    ops = [n.op_type for n in graph.node]
    assert "SoftmaxCrossEntropyLoss" not in ops and "LogSoftmax" in ops, ops
    if build is gpt2:
        assert not any(n.op_type == "Cast" and n.output[0] in {o.name for o in graph.output} for n in graph.node)
    else:
        assert any("/rows/" in n.name for n in graph.node)


def test_bert_with_dropout_learns_and_is_reproducible():
    data = bert_batches(n=2)

    def train(seed):
        model = ORTModule(bert(dropout=0.1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(seed)
        losses = []
        for step in range(6):
            loss = model(**data[step % 2]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    a, b, c = train(0), train(0), train(1)
    assert a == b, "the same seed must reproduce the run exactly"
    assert a != c, "another seed must draw other dropout masks"
    assert sum(a[-2:]) < sum(a[:2]), f"loss did not decrease: {a}"


def test_bert_dropout_matches_eager_masks():
    model = bert(dropout=0.1)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    batch = bert_batches(1)[0]
    for m in (eager, wrapped):
        torch.manual_seed(5)
        m.loss_ = m(**batch).loss
        m.loss_.backward()
    assert_close(wrapped.loss_, eager.loss_, 2e-3, "loss")
    for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        if pe.grad is not None:
            assert_close(po.grad, pe.grad, 2e-3, f"{n}.grad")


@pytest.mark.parametrize("arch", ["llama", "gpt-neox"])
def test_left_padded_causal_lm_trains_like_eager(arch):
    """NOTE [fully masked rows]: with left padding the pad positions before a row's first token attend to
    nothing; torch's SDPA returns 0 there, and the last pad position predicts the first token, so it is in
    the loss. The graph's plain softmax averaged the values instead: loss 1e-4 off, grads ~10% off, no
    fallback. Right-padded batches were right before and stay so."""
    torch.manual_seed(0)
    t = transformers
    small = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, use_cache=False, max_position_embeddings=128)
    model = (t.LlamaForCausalLM(t.LlamaConfig(num_key_value_heads=2, **small)) if arch == "llama"
             else t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**small)))
    g = torch.Generator().manual_seed(1)
    batches = []
    for left in (True, True, False):
        ids = torch.randint(3, 200, (4, 48), generator=g)
        mask = torch.ones(4, 48, dtype=torch.long)
        for row, n in enumerate((0, 5, 24, 41)):  # pad lengths, one row nearly all padding
            if left:
                mask[row, :n] = 0
            else:
                mask[row, 48 - n:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        batches.append((ids, mask, labels))
    wrapped = train_side_by_side(
        model, batches, lambda out, b: out.loss, rtol=2e-5, optimizer=ADAMW,
        kwargs_fn=lambda b: dict(input_ids=b[0], attention_mask=b[1], labels=b[2]))
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason


class PaddedAttention(torch.nn.Module):
    """Attention users write with a key-padding mask: nn.MultiheadAttention (a -inf float mask inside),
    and F.scaled_dot_product_attention with a bool or a -inf causal mask."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x, pad):
        if self.kind == "mha":
            return self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        b, n = x.shape[:2]
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        allowed = ~pad[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
        mask = allowed if self.kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("kind", ["mha", "bool", "neg_inf"])
def test_fully_masked_attention_rows_are_zero_like_eager(kind):
    """A fully padded sample (MHA: NaN outputs in the graph, 0 in eager) and rows masked by a causal mask
    and left padding (25% off before) match eager."""
    torch.manual_seed(0)
    model = PaddedAttention(kind)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(8, 20, 32)
    pad = torch.zeros(8, 20, dtype=torch.bool)
    pad[2], pad[3, :5], pad[4, 10:] = True, True, True
    w = torch.randn(8, 20, 32, generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (eager, wrapped):
        xx = x.clone().requires_grad_()
        y = m(xx, pad)
        (y * w).sum().backward()
        outs.append((y.detach(), xx.grad))
    assert torch.isfinite(outs[0][0]).all()
    assert_close(outs[1][0], outs[0][0], 1e-6, "output")
    assert_close(outs[1][1], outs[0][1], 1e-6, "x.grad")
    for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        if pe.grad is not None:
            assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad")
    assert wrapped.stats.fallbacks == 0
