"""torch's own nn.TransformerEncoder / nn.MultiheadAttention train in ORT like eager (the Gather rows of
the packed in-projection, whose rank shape inference loses, used to make the model fall back)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

from .helpers import assert_close, train_side_by_side


def encoder(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor with norm_first=False
        return nn.Sequential(nn.TransformerEncoder(layer, 2), nn.Flatten(), nn.Linear(32 * 10, 3))


def test_transformer_encoder_with_dropout_draws_eager_masks():
    model = encoder(0.1)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model), fallback="raise")
    x = torch.randn(4, 10, 32)
    for seed in (3, 4):
        outs = []
        for m in (eager, wrapped):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            out = m(x)
            out.pow(2).sum().backward()
            outs.append(out)
        assert_close(outs[1], outs[0], 1e-5, "encoder output")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-4, f"{name}.grad", atol=1e-5)


def test_transformer_encoder_trains_like_eager():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 10, 32, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback
        # SGD: the key bias's gradient is 0 up to rounding (softmax ignores it), which AdamW amplifies.
        wrapped = train_side_by_side(encoder(0.0), batches, lambda out, b: F.cross_entropy(out, b[1]), rtol=1e-4,
                                     kwargs_fn=lambda b: {"input": b[0]},
                                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    assert wrapped.stats.fallbacks == 0


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_with_dropout_matches_eager_masks(batch_first, need_weights):
    """NOTE [nested dropout]: MHA's dropout runs inside F.multi_head_attention_forward (F.dropout with
    weights, the SDPA kernel's dropout without); its masks are drawn by torch like eager's."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, dropout=0.2, batch_first=batch_first)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model), fallback="raise")
    for seed in (1, 2):
        x = torch.randn(6, 5, 32, generator=torch.Generator().manual_seed(seed))
        outs = []
        for m in (eager, wrapped):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)  # the same dropout masks, drawn by torch in eager order
            out, weights = m(x, x, x, need_weights=need_weights)
            (out.pow(2).sum() + (weights.sum() if need_weights else 0)).backward()
            outs.append(out)
        assert_close(outs[1], outs[0], 1e-5, "attention output")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad")


class TextClassifier(nn.Module):
    """Token embeddings, torch's TransformerEncoder with a padding mask, mean over every position (as
    simple classifiers write it), a linear head."""

    def __init__(self, nested: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32, padding_idx=0)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.head = nn.Linear(32, 3)

    def forward(self, ids):
        h = self.enc(self.emb(ids), src_key_padding_mask=ids == 0)
        return self.head(h.mean(1))


def _padded_ids(n: int = 64, length: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 100, (n, length), generator=g)
    for i in range(n):  # right padding of different lengths (left-aligned tokens)
        ids[i, length - (i % length):] = 0
    return ids


@pytest.mark.parametrize("nested", [True, False], ids=["nested_default", "nested_off"])
def test_eval_with_a_padding_mask_matches_eager_nested_fast_path(nested):
    """NOTE [nested fast path]: eager's eval-mode, no-grad TransformerEncoder pads its result with 0 at
    the padded positions; the graph computed them, so the logits of a mean-pooling classifier were off
    eager's by a relative error of 2.0 in evaluation, without a word. Such calls now run eagerly (one
    warning); training, eval with gradients, and enable_nested_tensor=False stay in ORT."""
    torch.manual_seed(0)
    model = TextClassifier(nested)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    ids = _padded_ids()
    for m in (eager, wrapped):  # a training step first: it runs in ORT either way
        torch.manual_seed(1)
        m(ids).pow(2).mean().backward()
    assert wrapped.stats.fallbacks == 0
    eager.eval(), wrapped.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got, want = wrapped(ids), eager(ids)
        assert_close(got, want, 1e-5, "eval logits under no_grad")
        assert_close(wrapped(ids), eager(ids), 1e-5, "eval logits with grad enabled")  # no fast path in eager
    ours = [str(w.message) for w in caught if "ORTModule" in str(w.message)]
    if nested:
        assert wrapped.stats.fallbacks == 1 and len(ours) == 1 and "nested tensor" in ours[0], ours
    else:
        assert wrapped.stats.fallbacks == 0 and not ours, ours
    for p in (*eager.enc.parameters(), *wrapped.module.enc.parameters()):  # a frozen encoder in eval, head trained
        p.requires_grad_(False)
    outs = [m(ids) for m in (eager, wrapped)]
    assert_close(outs[1], outs[0], 1e-5, "eval logits of a frozen encoder with grad enabled")
    fallbacks = wrapped.stats.fallbacks
    torch.backends.mha.set_fastpath_enabled(False)  # the switch is read per call: eager's regular path, in ORT
    try:
        with torch.no_grad():
            assert_close(wrapped(ids), eager(ids), 1e-5, "eval logits with the MHA fast path off")
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert wrapped.stats.fallbacks == fallbacks
