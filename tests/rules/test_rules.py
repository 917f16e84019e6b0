"""The rule tests: every row of every ``tests/rules/table_*.py`` (STYLE.md §8), plus coverage.

One torch-parity test and one float64 finite-difference test per row (ids = the row name); rows with
``xfail`` are strict expected failures. ``test_every_rule_has_a_row`` fails listing each registered
differentiable op that no table covers.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortmodule.autodiff import build_gradient, differentiable_values, registered_ops
from ortmodule.autodiff.registry import lookup
from ortmodule.autodiff.rules.aten import KERNELS
from ortmodule.runtime.torch_nodes import TORCH_DOMAIN

from .harness import check_finite_differences, check_torch_parity
from .opinfo import OpCase


def _collect() -> list[OpCase]:
    cases: list[OpCase] = []
    pkg = __name__.rpartition(".")[0]
    for mod in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if mod.name.startswith("table_"):
            cases.extend(importlib.import_module(f"{pkg}.{mod.name}").CASES)
    return cases


CASES = _collect()


def _params(fd: bool) -> list:
    out = []
    for c in CASES:
        if fd and not c.fd_check:
            continue
        marks = [pytest.mark.xfail(reason=c.xfail, strict=True)] if c.xfail else []
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


def test_row_names_are_unique():
    seen: dict[str, int] = {}
    for c in CASES:
        seen[c.name] = seen.get(c.name, 0) + 1
    dups = [n for n, k in seen.items() if k > 1]
    assert not dups, f"duplicate row names (ids must be unique): {dups}"


@pytest.mark.parametrize("case", _params(fd=False))
def test_torch_parity(case: OpCase):
    check_torch_parity(case)


@pytest.mark.parametrize("case", [p for p in _params(fd=False) if p.values[0].op_type in KERNELS])
def test_torch_parity_of_the_onnx_rule_behind_an_aten_kernel(case: OpCase, monkeypatch):
    """The ONNX rule still serves what the ATen kernel cannot (asymmetric pads) and
    ORTMODULE_ATEN_KERNELS=0 (NOTE [ATen kernels]): every row of such an op, with kernels off."""
    monkeypatch.setenv("ORTMODULE_ATEN_KERNELS", "0")
    check_torch_parity(case)


@pytest.mark.parametrize("case", _params(fd=True))
def test_finite_differences(case: OpCase, monkeypatch):
    # the ONNX rules, independently of torch: an ATen kernel is torch's own derivative
    monkeypatch.setenv("ORTMODULE_ATEN_KERNELS", "0")
    check_finite_differences(case)


def test_every_rule_has_a_row():
    covered = {("" if c.domain == "ai.onnx" else c.domain, c.op_type) for c in CASES}
    missing = [
        f"{d + '::' if d else ''}{op}"
        for d, op in registered_ops()
        if lookup(d, op).fn is not None and (d, op) not in covered and d != TORCH_DOMAIN
    ]  # a torch node's gradient is torch's own: tests/test_torch_nodes.py runs it end to end
    assert not missing, (
        f"{len(missing)} registered gradient rule(s) have no row in tests/rules/table_*.py: "
        + ", ".join(missing)
    )


def test_no_gradient_through_nondifferentiable_ops():
    """y = x * Cast(Shape(x)[-1]) + x * Sign(x) * Cast(x > 0): Shape and Greater carry no gradient,
    Sign's derivative is zero, so dy/dx = v * (shape[-1] + sign(x) * (x > 0))."""
    x = np.array([[1.5, -0.5, 2.0], [-1.0, 0.25, -3.0]], dtype=np.float32)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], start=-1),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "sf"], ["a"]),
        helper.make_node("Sign", ["x"], ["sg"]),
        helper.make_node("Constant", [], ["zero"], value=onnx.numpy_helper.from_array(np.float32(0.0))),
        helper.make_node("Greater", ["x", "zero"], ["pos"]),
        helper.make_node("Cast", ["pos"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["sg", "posf"], ["m"]),
        helper.make_node("Mul", ["x", "m"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "nondiff",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    model = ir.from_proto(proto)
    g = model.graph
    (xv,), (yv,) = g.inputs, g.outputs
    values = {v.name: v for n in g for v in n.outputs}
    active = differentiable_values(g, [xv])
    for name in ("s", "sf", "pos", "posf"):
        assert values[name] not in active, f"{name} should carry no gradient"
    # NOTE [zero derivatives]: torch's sign(x) requires grad (its backward is zeros)
    assert values["sg"] in active and values["m"] in active

    gg = build_gradient(g, wrt=[xv], outputs=[yv], opset=20)
    dx = gg.input_grads[xv]
    g.extend(gg.nodes)
    g.inputs.append(gg.grad_outputs[0])
    ident = ir.Node("", "Identity", [dx], num_outputs=1)
    ident.outputs[0].name, ident.outputs[0].dtype, ident.outputs[0].shape = "dx", xv.dtype, xv.shape
    g.append(ident)
    g.outputs.append(ident.outputs[0])
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    v = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    _, got = sess.run(None, {"x": x, gg.grad_outputs[0].name: v})
    want = v * (x.shape[-1] + np.sign(x) * (x > 0))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_zero_derivative_reaches_only_what_rules_differentiate():
    """NOTE [zero derivatives]: y = Resize(Round(x * w), scales=s) + Resize(x, scales=s). ``w`` reaches y only
    through Round: a zero gradient, as torch's round gives. ``s`` (Resize's scales) has no gradient in
    either Resize's rule: None, not a zero (OnnxModule trains float initializers: AdamW would decay a
    zero-gradient scales tensor, and a cubic Resize refuses scales off 1 on the outer axes)."""
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Round", ["h"], ["q"]),
        helper.make_node("Resize", ["q", "", "s"], ["r1"], mode="linear"),
        helper.make_node("Resize", ["x", "", "s"], ["r2"], mode="linear"),
        helper.make_node("Add", ["r1", "r2"], ["y"]),
    ]
    shape = [1, 2, 3, 3]
    graph = helper.make_graph(
        nodes, "zero",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "w")]
        + [helper.make_tensor_value_info("s", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])],
    )
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    g = ir.from_proto(proto).graph
    x, w, s = g.inputs
    gg = build_gradient(g, wrt=[x, w, s], outputs=[g.outputs[0]], opset=20)
    assert gg.input_grads[s] is None
    assert gg.input_grads[x] is not None and gg.input_grads[x].producer().op_type != "ConstantOfShape"
    zero = gg.input_grads[w]
    assert zero is not None and zero.producer().op_type == "ConstantOfShape"
    assert not onnx.numpy_helper.to_array(ir.serde.serialize_tensor(zero.producer().attributes["value"].value)).any()


def test_failure_message_names_the_row():
    bad = OpCase("Neg", "Neg_wrong_reference", [np.ones((2, 2), np.float32)], torch_fn=lambda x: x)
    with pytest.raises(AssertionError, match=r"Neg row 'Neg_wrong_reference'.*forward output y0"):
        check_torch_parity(bad)
