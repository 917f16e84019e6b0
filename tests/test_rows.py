"""Gathers of constant rows moved up through row-wise ops (NOTE [rows nobody reads],
ortmodule/passes/rows.py): the rewritten graph computes what the original does, only the rows it
reads, and a sequence classifier trains like eager PyTorch."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from ortmodule import ORTModule
from ortmodule.passes.rows import select_rows_early
from ortmodule.runtime import entry as entry_module

from .helpers import module_path, train_side_by_side

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
B, S, E, H = 2, 6, 4, 8


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _vi(name, shape, dtype=F32):
    return helper.make_tensor_value_info(name, dtype, shape)


def _idx(values, scalar=False):
    arr = np.asarray(values, dtype=np.int64)
    return helper.make_tensor("idx", I64, [] if scalar else [arr.size], arr.reshape(-1).tolist())


def _rewrite(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    irm = ir.from_proto(onnx.shape_inference.infer_shapes(model))  # as the exporter's value_info
    n = select_rows_early(irm.graph)
    return ir.to_proto(irm), n


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _check(model, feeds, min_pushes):
    """The rewritten model gives the same outputs; returns it and its node list."""
    onnx.checker.check_model(model)
    rewritten, n = _rewrite(model)
    assert n >= min_pushes, f"expected at least {min_pushes} pushes, got {n}"
    for got, want in zip(_run(rewritten, feeds), _run(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return rewritten, list(rewritten.graph.node)


def _producer_of(nodes, name):
    return next(n for n in nodes if name in n.output)


def _rng_feeds(**shapes):
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("indices,scalar", [(0, True), (-1, True), ([0, 3], False), ([5, 1, 2], False)])
def test_layer_tail_computes_only_the_selected_positions(indices, scalar):
    """FFN + residual + LayerNorm, then hidden[:, i]: every op runs on the selected rows."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Gelu", ["hb"], ["g"]),
        helper.make_node("MatMul", ["g", "w2"], ["o"]),
        helper.make_node("Mul", ["o", "mask"], ["od"]),  # a dropout mask input, full size
        helper.make_node("Add", ["od", "x"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["ln"], axis=-1),
        helper.make_node("Gather", ["ln", "idx"], ["y"], axis=1),
    ]
    k = 1 if scalar else len(indices)
    model = _model(
        nodes,
        [_vi("x", [B, S, E]), _vi("w1", [E, H]), _vi("b1", [H]), _vi("w2", [H, E]), _vi("mask", [B, S, E]),
         _vi("gamma", [E]), _vi("beta", [E])],
        [_vi("y", [B, E] if scalar else [B, k, E])],
        [_idx(indices, scalar)],
    )
    feeds = _rng_feeds(x=(B, S, E), w1=(E, H), b1=(H,), w2=(H, E), mask=(B, S, E), gamma=(E,), beta=(E,))
    rewritten, nodes = _check(model, feeds, min_pushes=7)
    first = next(n for n in nodes if n.op_type == "MatMul")
    assert _producer_of(nodes, first.input[0]).op_type == "Gather", "the FFN must read the selected rows"
    gathered = sorted(n.input[0] for n in nodes if n.op_type == "Gather")
    # x read twice (FFN, residual), the weights whole; the output Gather picks from the k rows of ln
    assert gathered == ["ln", "mask", "x", "x"], gathered
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in onnx.shape_inference.infer_shapes(rewritten).graph.value_info}
    assert shapes["ln"] == [B, k, E] and shapes["g"] == [B, k, H]


def test_attention_rows_through_softmax_matmul_and_transpose():
    """softmax(Q K) of the selected query rows, with Q a transposed view: the Gather reaches Q's source."""
    nodes = [
        helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),  # [B, heads, S, D]
        helper.make_node("MatMul", ["q", "kt"], ["s"]),  # [B, heads, S, T]
        helper.make_node("Add", ["s", "bias"], ["sb"]),  # a [B, 1, 1, T] mask: broadcast on S
        helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
        helper.make_node("Gather", ["p", "idx"], ["y"], axis=2),
    ]
    model = _model(nodes, [_vi("q4", [B, S, 2, E]), _vi("kt", [B, 2, E, 5]), _vi("bias", [B, 1, 1, 5])],
                   [_vi("y", [B, 2, 2, 5])], [_idx([4, 1])])
    _, nodes = _check(model, _rng_feeds(q4=(B, S, 2, E), kt=(B, 2, E, 5), bias=(B, 1, 1, 5)), min_pushes=4)
    gather, last = [n for n in nodes if n.op_type == "Gather"]
    assert gather.input[0] == "q4" and helper.get_attribute_value(gather.attribute[0]) == 1
    assert last.input[0] == "p"


@pytest.mark.parametrize("trans_a", [0, 1])
def test_gemm_rows_with_a_full_size_bias(trans_a):
    a_shape = [E, S] if trans_a else [S, E]
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["o"], transA=trans_a),
             helper.make_node("Relu", ["o"], ["r"]),
             helper.make_node("Gather", ["r", "idx"], ["y"], axis=0)]
    model = _model(nodes, [_vi("a", a_shape), _vi("b", [E, H]), _vi("c", [S, H])], [_vi("y", [2, H])],
                   [_idx([-1, 2])])
    _, nodes = _check(model, _rng_feeds(a=a_shape, b=(E, H), c=(S, H)), min_pushes=2)
    assert sorted(n.input[0] for n in nodes if n.op_type == "Gather") == ["a", "c", "r"]


def test_gemm_rows_without_a_bias():
    nodes = [helper.make_node("Gemm", ["a", "b", ""], ["o"]), helper.make_node("Gather", ["o", "idx"], ["y"], axis=0)]
    model = _model(nodes, [_vi("a", [S, E]), _vi("b", [E, H])], [_vi("y", [1, H])], [_idx([3])])
    _, nodes = _check(model, _rng_feeds(a=(S, E), b=(E, H)), min_pushes=1)
    assert [n.input[0] for n in nodes if n.op_type == "Gather"] == ["a", "o"]


def test_batch_axis_of_a_matmul_with_a_shared_weight():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["o"]), helper.make_node("Gather", ["o", "idx"], ["y"], axis=0)]
    model = _model(nodes, [_vi("x", [4, S, E]), _vi("w", [E, H])], [_vi("y", [H])], [_idx(3, scalar=True)])
    model.graph.output[0].CopyFrom(_vi("y", [S, H]))
    _, nodes = _check(model, _rng_feeds(x=(4, S, E), w=(E, H)), min_pushes=1)
    assert [n.op_type for n in nodes if n.op_type != "Constant"] == ["Gather", "MatMul", "Gather"]


def _unchanged(nodes, inputs, outputs, inits, feeds):
    model = _model(nodes, inputs, outputs, inits)
    rewritten, n = _rewrite(model)
    assert n == 0
    for got, want in zip(_run(rewritten, feeds), _run(model, feeds)):
        np.testing.assert_array_equal(got, want)


def test_rows_read_elsewhere_are_not_moved():
    """A value that is also an output, or read by another op, keeps its producer on every row."""
    base = [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Gather", ["t", "idx"], ["y"], axis=1)]
    feeds = _rng_feeds(x=(B, S, E))
    _unchanged(base, [_vi("x", [B, S, E])], [_vi("y", [B, E]), _vi("t", [B, S, E])], [_idx(0, True)], feeds)
    other = [*base, helper.make_node("ReduceSum", ["t"], ["s"], keepdims=0)]
    _unchanged(other, [_vi("x", [B, S, E])], [_vi("y", [B, E]), _vi("s", [])], [_idx(0, True)], feeds)


@pytest.mark.parametrize("case", ["repeated_indices", "softmax_over_the_axis", "reshape", "unknown_rank"])
def test_not_row_wise_or_not_profitable_is_left_alone(case):
    idx, shape_x = _idx([1, 2]), [B, S, E]
    op = {"repeated_indices": helper.make_node("Relu", ["x"], ["t"]),
          "softmax_over_the_axis": helper.make_node("Softmax", ["x"], ["t"], axis=1),
          "reshape": helper.make_node("Reshape", ["x", "shape"], ["t"]),
          "unknown_rank": helper.make_node("Add", ["x", "z"], ["t"])}[case]
    if case == "repeated_indices":
        idx = _idx([2, 2])
    inits = [idx, helper.make_tensor("shape", I64, [3], [B, S, E])]
    inputs = [_vi("x", shape_x), _vi("z", None)]
    feeds = _rng_feeds(x=shape_x, z=(B, S, E))
    _unchanged([op, helper.make_node("Gather", ["t", "idx"], ["y"], axis=1)], inputs, [_vi("y", [B, 2, E])],
               inits, feeds)


def test_broadcast_inputs_are_read_whole():
    nodes = [helper.make_node("Add", ["x", "row"], ["t"]), helper.make_node("Gather", ["t", "idx"], ["y"], axis=1)]
    model = _model(nodes, [_vi("x", [B, S, E]), _vi("row", [B, 1, E])], [_vi("y", [B, E])], [_idx(2, True)])
    _, nodes = _check(model, _rng_feeds(x=(B, S, E), row=(B, 1, E)), min_pushes=1)
    assert [n.input[0] for n in nodes if n.op_type == "Gather"] == ["x", "t"]


# -- end to end: a sequence classifier trains like eager ------------------------------------------
class Tail(nn.Module):
    """A pre-LN block whose output is pooled at one position, like a [CLS] classifier."""

    def __init__(self, position: int, dropout: float):
        super().__init__()
        self.inp = nn.Linear(E, 16)
        self.ff = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Dropout(dropout))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)
        self.position = position

    def forward(self, x):
        h = self.inp(x)
        h = self.norm(h + self.ff(h))
        return self.head(torch.tanh(h[:, self.position]))


@pytest.mark.parametrize("position,dropout", [(0, 0.0), (-1, 0.0), (0, 0.2)])
def test_pooled_block_trains_like_eager(position, dropout):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    sizes = [(B, S), (B, S), (3, S), (B, 9)]  # the batch and the sequence length change: dynamic dims
    batches = [(torch.randn(b, s, E, generator=g), torch.randint(0, 3, (b,), generator=g)) for b, s in sizes]

    def loss_fn(out, batch):
        return nn.functional.cross_entropy(out, batch[1])

    calls = iter(range(100))

    def kwargs_fn(batch):  # called for eager, then ORT: both draw the same dropout masks
        torch.manual_seed(next(calls) // 2)
        return {"x": batch[0]}

    wrapped = train_side_by_side(Tail(position, dropout), batches, loss_fn, rtol=1e-4, kwargs_fn=kwargs_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    entry = [e for e in wrapped._built._data.values() if e.graphs is not None][-1]
    # The block is row-wise from its input on: the input is gathered, and the FFN sees one position.
    forward = onnx.shape_inference.infer_shapes(entry.graphs.forward)
    (x_rows,) = [n for n in forward.graph.node if n.op_type == "Gather" and "/rows/" in n.name
                 and n.input[0] == forward.graph.input[0].name]
    (ff_in,) = [n for n in forward.graph.node if n.op_type == "MatMul" and module_path(n) == "ff.0"]
    shapes = {v.name: v.type.tensor_type.shape.dim for v in [*forward.graph.value_info, *forward.graph.output]}
    assert shapes[ff_in.input[0]][1].dim_value == 1, "the FFN must run on the pooled position only"


def test_inference_computes_only_the_pooled_position(monkeypatch):
    """Under no_grad the inference session runs the pruned graph too, with eager's outputs."""
    run = []
    monkeypatch.setattr(entry_module, "optimize_inference",
                        lambda m, f=entry_module.optimize_inference: run.append(f(m)) or run[-1])
    torch.manual_seed(0)
    model = Tail(0, dropout=0.1).eval()
    wrapped = ORTModule(copy.deepcopy(model))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for b, s in [(B, S), (3, 9)]:
            x = torch.randn(b, s, E, generator=g)
            torch.testing.assert_close(wrapped(x), model(x), rtol=1e-5, atol=1e-6)
    entry = next(e for e in wrapped._built._data.values())
    assert entry.graphs is None
    assert run and all(any("/rows/" in n.name for n in m.graph.node) for m in run)
