"""Backward-model passes other than the label fold: Sum lowered to Adds (NOTE [sum as adds]), scatters onto
zeros folded into the sum (NOTE [scatter into the sum]), sums over leading axes chained (NOTE [chained sums])."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from ortmodule.passes.backward import lower_sums, split_leading_sums


def _model(nodes, inputs, output="y"):
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, f, s) for n, s in inputs],
                              [helper.make_tensor_value_info(output, f, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_sum_becomes_adds_with_broadcasting():
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((4, 3, 5)), "b": rng.standard_normal((3, 1)), "c": rng.standard_normal((5,)),
             "d": rng.standard_normal((4, 3, 5))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    model = _model([helper.make_node("Sum", ["a", "b", "c", "d"], ["y"], name="acc")],
                   [(k, list(v.shape)) for k, v in feeds.items()])
    expected = _run(model, feeds)
    assert lower_sums(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Add", "Add", "Add"]
    np.testing.assert_allclose(_run(model, feeds), expected, rtol=1e-6)


def test_sum_with_a_gemm_stays_for_gemm_sum_fusion_and_single_input_sum_is_kept():
    nodes = [
        helper.make_node("Gemm", ["a", "b"], ["g"], transA=1),
        helper.make_node("Sum", ["g", "c"], ["s"]),
        helper.make_node("Sum", ["s"], ["y"]),
    ]
    model = _model(nodes, [("a", [3, 2]), ("b", [3, 4]), ("c", [2, 4])])
    assert lower_sums(model) == 0
    assert [n.op_type for n in model.graph.node] == ["Gemm", "Sum", "Sum"]


def _scatter_sum_model(reduction: str = "add", extra_reader: bool = False, op: str = "ScatterElements"):
    """``Sum(head_grad, scatter(zeros, idx, upd), other)``: an embedding gradient as the Gather rule
    writes it (ScatterElements along axis 0, the row index expanded to the update's shape)."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    zero = helper.make_tensor("zero", f, [1], [0.0])
    if op == "ScatterElements":
        scatter = [helper.make_node("Shape", ["upd"], ["upd_shape"]),
                   helper.make_node("Expand", ["idx", "upd_shape"], ["idx_e"]),
                   helper.make_node(op, ["zeros", "idx_e", "upd"], ["emb_grad"], axis=0, reduction=reduction)]
    else:
        scatter = [helper.make_node(op, ["zeros", "idx", "upd"], ["emb_grad"], reduction=reduction)]
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=zero),
        *scatter,
        helper.make_node("Sum", ["head_grad", "emb_grad", "other"], ["y"], name="acc"),
    ]
    outputs = [helper.make_tensor_value_info("y", f, [6, 3])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("emb_grad", f, [6, 3]))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("head_grad", f, [6, 3]), helper.make_tensor_value_info("other", f, [6, 3]),
         helper.make_tensor_value_info("idx", i64, [4, 1]), helper.make_tensor_value_info("upd", f, [4, 3])],
        outputs, [helper.make_tensor("shape", i64, [2], [6, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_scatter_onto_zeros_is_folded_into_the_sum():
    rng = np.random.default_rng(0)
    feeds = {"head_grad": rng.standard_normal((6, 3)).astype(np.float32),
             "other": rng.standard_normal((6, 3)).astype(np.float32),
             "idx": np.array([[1], [4], [1], [0]], dtype=np.int64),  # a repeated row accumulates
             "upd": rng.standard_normal((4, 3)).astype(np.float32)}
    model = _scatter_sum_model()
    expected = _run(model, feeds)
    assert lower_sums(model) == 1
    # no zeros, no Add over them; the scatter keeps its op and attributes (NOTE [exact scatters])
    assert [n.op_type for n in model.graph.node] == ["Shape", "Expand", "Add", "ScatterElements"]
    folded = model.graph.node[-1]
    assert folded.input[0] == "y/acc_1" and {a.name: a for a in folded.attribute}["axis"].i == 0
    np.testing.assert_allclose(_run(model, feeds), expected, rtol=1e-6)


def test_scatter_with_other_readers_or_no_reduction_is_not_folded():
    for model in (_scatter_sum_model(extra_reader=True), _scatter_sum_model(reduction="none")):
        assert lower_sums(model) == 1
        ops = [n.op_type for n in model.graph.node]
        assert ops == ["ConstantOfShape", "Shape", "Expand", "ScatterElements", "Add", "Add"]


def test_scatter_nd_add_is_not_folded():
    """The pass never writes a ScatterND(add) (it races in onnxruntime: NOTE [exact scatters])."""
    model = _scatter_sum_model(op="ScatterND")
    assert lower_sums(model) == 1
    assert [n.op_type for n in model.graph.node] == ["ConstantOfShape", "ScatterND", "Add", "Add"]


def test_leading_axes_sums_are_chained_one_axis_at_a_time():
    """NOTE [chained sums]: ReduceSum over (batch, seq) of [batch, seq, hidden] as a sum over seq, then
    batch: same values (closer to float64's), keepdims kept; other reductions are left alone."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 512, 64)) + 0.3).astype(np.float32)
    ints = lambda name, v: helper.make_node(  # noqa: E731
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(v)], v))
    nodes = [
        ints("lead", [1, 0]), ints("lead3", [0, 1, 2]), ints("inner", [0, 2]),
        helper.make_node("ReduceSum", ["x", "lead"], ["a"], keepdims=0),
        helper.make_node("ReduceSum", ["x", "lead"], ["b"], keepdims=1),
        helper.make_node("ReduceSum", ["x", "lead3"], ["c"], keepdims=0),
        helper.make_node("ReduceSum", ["x", "inner"], ["d"], keepdims=0),  # not leading: kept
        helper.make_node("Concat", ["a", "b_flat", "c_1", "d"], ["y"], axis=0),
        ints("flat", [-1]), ints("one", [1]),
        helper.make_node("Reshape", ["b", "flat"], ["b_flat"]),
        helper.make_node("Reshape", ["c", "one"], ["c_1"]),
    ]
    model = _model(nodes, [("x", list(x.shape))])
    expected = _run(model, {"x": x})
    assert split_leading_sums(model) == 3
    sums = [n for n in model.graph.node if n.op_type == "ReduceSum"]
    assert len(sums) == 2 + 2 + 3 + 1
    got = _run(model, {"x": x})
    exact = x.astype(np.float64)
    a = exact.sum((0, 1))
    reference = np.concatenate([a, a, [exact.sum()], exact.sum((0, 2))])
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    err_before = np.abs(expected[:64] - reference[:64]).max() / np.abs(reference[:64]).max()
    err_after = np.abs(got[:64] - reference[:64]).max() / np.abs(reference[:64]).max()
    assert err_after < 1e-6 and err_after <= err_before, (err_before, err_after)
