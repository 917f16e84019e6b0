"""The cross-entropy label correction folded into the LM head's gradient products (NOTE [label grad
folding], ortmodule/passes/label_grad.py): the folded graph computes what the unfolded one does, and
language-model training matches eager PyTorch."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

from ortmodule import ORTModule
from ortmodule.passes.backward import lower_sums
from ortmodule.passes.label_grad import fold_label_grad
from ortmodule.runtime import entry as entry_module

from .helpers import train_side_by_side

V, E, B, S = 37, 8, 3, 5


def _head_backward(identity_view: bool, source: str = "Softmax") -> onnx.ModelProto:
    """The backward of ``loss = CE(reshape(X3 @ W^T), labels)`` as the rules and passes emit it:
    P from the saved scores (``Softmax``), or from saved log-probabilities (``Exp``)."""
    nodes = [
        helper.make_node("Softmax", ["scores"], ["prob"], axis=1) if source == "Softmax"
        else helper.make_node("Exp", ["scores"], ["prob"]),
        helper.make_node("Mul", ["prob", "coef"], ["scaled"]),
        helper.make_node("Neg", ["coef"], ["neg_coef"]),
        helper.make_node("ScatterElements", ["scaled", "index", "neg_coef"], ["dz"], axis=1, reduction="add"),
        helper.make_node("Reshape", ["dz", "logits_shape"], ["dz3"]),
    ]
    view = "dz3"
    if identity_view:  # a Sum left with one term by the zero-grad specialisation
        nodes.append(helper.make_node("Identity", ["dz3"], ["dz3i"]))
        view = "dz3i"
    nodes += [
        helper.make_node("MatMul", [view, "w"], ["dx"]),
        helper.make_node("Reshape", [view, "rows_shape"], ["dz2"]),
        helper.make_node("Reshape", ["x3", "x_rows_shape"], ["x2"]),
        helper.make_node("Gemm", ["x2", "dz2"], ["dwt"], transA=1),
        helper.make_node("Transpose", ["dwt"], ["dw"], perm=[1, 0]),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "head_backward",
        [helper.make_tensor_value_info("scores", f, ["N", V]),
         helper.make_tensor_value_info("coef", f, ["N", 1]),
         helper.make_tensor_value_info("index", TensorProto.INT64, ["N", 1]),
         helper.make_tensor_value_info("w", f, [V, E]),
         helper.make_tensor_value_info("x3", f, [B, S, E]),
         helper.make_tensor_value_info("logits_shape", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("dx", f, [B, S, E]), helper.make_tensor_value_info("dw", f, [V, E])],
        [helper.make_tensor("rows_shape", TensorProto.INT64, [2], [-1, V]),
         helper.make_tensor("x_rows_shape", TensorProto.INT64, [2], [-1, E])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("source", ["Softmax", "Exp"])
@pytest.mark.parametrize("identity_view", [False, True])
def test_folded_graph_computes_the_same_gradients(identity_view, source):
    rng = np.random.default_rng(0)
    n = B * S
    logits = rng.standard_normal((n, V)).astype(np.float32)
    log_prob = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    labels = rng.integers(0, V, (n, 1))
    labels[3] = labels[4]  # a repeated label: the correction accumulates
    feeds = {
        "scores": (logits if source == "Softmax" else log_prob).astype(np.float32),
        "coef": rng.uniform(0.0, 1.0, (n, 1)).astype(np.float32),
        "index": labels.astype(np.int64),
        "w": rng.standard_normal((V, E)).astype(np.float32),
        "x3": rng.standard_normal((B, S, E)).astype(np.float32),
        "logits_shape": np.array([B, S, V], dtype=np.int64),
    }
    model = _head_backward(identity_view, source)
    expected = _run(model, feeds)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    assert fold_label_grad(folded) == 1
    ops = [node.op_type for node in folded.graph.node]
    # the [N, V] correction is gone; the [V, E] one is an exact ScatterElements (NOTE [exact scatters])
    scatters = [n for n in folded.graph.node if n.op_type.startswith("Scatter")]
    assert [(n.op_type, n.attribute[0].name, n.attribute[0].i) for n in scatters] == [("ScatterElements", "axis", 0)]
    assert "Gather" in ops
    onnx.checker.check_model(folded)
    got = _run(folded, feeds)
    for name, e, g in zip(("dx", "dw"), expected, got, strict=True):
        assert e.shape == g.shape, name
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=name)


def test_fold_leaves_other_readers_alone():
    """dZ read by anything but the head products (here: it is a graph output) is not folded."""
    model = _head_backward(False)
    model.graph.output.append(helper.make_tensor_value_info("dz", TensorProto.FLOAT, ["N", V]))
    before = [n.op_type for n in model.graph.node]
    assert fold_label_grad(model) == 0
    assert [n.op_type for n in model.graph.node] == before


@pytest.fixture
def folds(monkeypatch) -> list[int]:
    """The number of folds of each backward model a session is created for, in order."""
    counts: list[int] = []

    def passes(model):
        counts.append(fold_label_grad(model))
        return lower_sums(model)

    monkeypatch.setattr(entry_module, "run_backward_passes", passes)
    return counts


class TinyLM(nn.Module):
    def __init__(self, tied: bool, ce: dict, return_logits: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.mix = nn.Linear(E, E)
        self.head = nn.Linear(E, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.ce = ce
        self.return_logits = return_logits

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.mix(self.emb(ids))))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), **self.ce)
        return (loss, logits) if self.return_logits else loss


def _lm_batches(k: int = 3, ignore_index: int = -100):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(k):
        ids = torch.randint(0, V, (B, S), generator=g)
        labels = torch.randint(0, V, (B, S), generator=g)
        labels[0, :2] = ignore_index  # ignored positions (-100: HF's padding label)
        out.append((ids, labels))
    return out


CE_VARIANTS = {
    "mean": {},
    "sum+weight": {"reduction": "sum", "weight": torch.linspace(0.5, 1.5, V)},
    "ignore_index=3": {"ignore_index": 3},
}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("ce", list(CE_VARIANTS))
def test_lm_training_matches_eager(tied, ce, folds):
    torch.manual_seed(0)
    model = TinyLM(tied, CE_VARIANTS[ce])
    # Only the loss is backpropagated: the logits' gradient is absent and the specialised backward
    # has the cross-entropy term alone, which the fold rewrites.
    batches = _lm_batches(ignore_index=CE_VARIANTS[ce].get("ignore_index", -100))
    train_side_by_side(model, batches, lambda out, b: out[0], rtol=1e-4)
    # The full backward (the logits' gradient summed in: left alone), then the specialised one, folded.
    assert folds == [0, 1], folds


def test_fold_applies_to_a_loss_only_model_and_matches_eager(folds):
    torch.manual_seed(0)
    model = TinyLM(tied=True, ce={})
    model.return_logits = False
    train_side_by_side(model, _lm_batches(2), lambda out, b: out, rtol=1e-4)
    assert folds == [1], folds  # the full backward (no absent gradients), folded once


@pytest.mark.parametrize("frozen", ["head", "body"])
def test_lm_with_frozen_parts_matches_eager(frozen):
    """Only one of the two head products is in the backward: the fold handles each alone."""
    torch.manual_seed(0)
    model = TinyLM(tied=False, ce={})
    frozen_params = [model.head.weight] if frozen == "head" else [*model.emb.parameters(), *model.mix.parameters()]
    for p in frozen_params:
        p.requires_grad_(False)
    train_side_by_side(model, _lm_batches(2), lambda out, b: out[0], rtol=1e-4)


def test_logits_gradient_used_too_matches_eager():
    """With the logits' gradient present, dZ is a sum the fold does not touch; results still match."""
    torch.manual_seed(0)
    model = TinyLM(tied=True, ce={})
    train_side_by_side(model, _lm_batches(2), lambda out, b: out[0] + 0.1 * out[1].square().mean(), rtol=1e-4)


def test_lm_with_changing_batch_and_sequence_sizes_matches_eager(folds):
    """Dynamic shapes: the views' target shapes are run-time values, and the fold still applies."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (b, s), generator=g), torch.randint(0, V, (b, s), generator=g))
               for b, s in ((3, 5), (2, 5), (3, 4), (2, 7))]
    train_side_by_side(TinyLM(tied=True, ce={}), batches, lambda out, b: out[0], rtol=1e-4)
    assert 1 in folds, folds


def test_lm_head_with_bias_is_left_alone_and_matches_eager(folds):
    """dZ also feeds the bias gradient (a ReduceSum): not one of the head products, so no fold."""
    torch.manual_seed(0)
    model = TinyLM(tied=False, ce={})
    model.head = nn.Linear(E, V, bias=True)
    train_side_by_side(model, _lm_batches(2), lambda out, b: out[0], rtol=1e-4)
    assert folds and not any(folds), folds


def test_lm_saves_neither_log_probs_nor_a_copy_of_the_logits():
    """NOTE [softmax from the scores] and NOTE [views are recomputed]: the forward returns the logits
    once; the backward reshapes them again and takes their softmax, so no [tokens, vocab] tensor is
    saved besides the logits the model returns anyway."""
    torch.manual_seed(0)
    wrapped = ORTModule(TinyLM(tied=True, ce={}))
    ids, labels = _lm_batches(1)[0]
    loss, logits = wrapped(ids, labels)
    loss.backward()
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    forward, backward = entry.graphs.forward.graph, entry.graphs.backward.graph
    big = {o.name for o in forward.output
           if [d.dim_value for d in o.type.tensor_type.shape.dim][-1:] == [V]}
    assert len(big) == 1, big  # the user's logits, nothing else of that size
    (logits_name,) = big
    assert any(n.op_type == "Reshape" and n.input[0] == logits_name for n in backward.node)


@pytest.mark.parametrize("ce", [{}, {"label_smoothing": 0.1}, {"weight": torch.linspace(0.5, 1.5, V)}])
@pytest.mark.parametrize("return_logits", [False, True])
def test_batch_with_every_label_ignored_keeps_eagers_zero_gradient(ce, return_logits):
    """NOTE [all ignored]: the loss of a batch whose labels are all -100 is 0/0 = NaN in eager too, but
    eager's gradient is 0 and AdamW's step stays finite; ours was NaN, and so was every weight after it."""
    torch.manual_seed(0)
    model = TinyLM(tied=True, ce=ce, return_logits=return_logits)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, wrapped)]
    batches = _lm_batches(3)
    batches[1] = (batches[1][0], torch.full_like(batches[1][1], -100))
    for step, (ids, labels) in enumerate(batches):
        losses = []
        for m, opt in zip((eager, wrapped), opts):
            opt.zero_grad()
            out = m(ids, labels)
            loss = out[0] if return_logits else out
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.isnan(losses[0]) == torch.isnan(losses[1]) == (step == 1)
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert torch.isfinite(po).all(), f"{name} after step {step}"
            assert torch.allclose(po, pe, rtol=1e-4, atol=1e-6), f"{name} after step {step}"
