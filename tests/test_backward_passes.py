"""Backward-model passes other than the label fold: Sum lowered to Adds (NOTE [sum as adds])."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from ortmodule.passes.backward import lower_sums


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
