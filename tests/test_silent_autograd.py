"""Silent wrong gradients at the autograd seam and in the autodiff walk.

A. double backward (``create_graph=True``) must raise, not return gradients detached from the graph;
B. a parameter that only absent outputs reach keeps ``.grad is None``, as in eager; one that only
   zero-derivative ops (round, floor, sign, ...) reach gets a zero ``.grad``, as in eager;
C. values read only inside ``If``/``Loop`` subgraphs: constant ``If``s are inlined (``torch.tile``),
   what remains on a gradient path raises naming the op.
Every value is compared with eager PyTorch.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ortmodule import GradientRuleError, OnnxModule, ORTModule
from ortmodule.errors import ORTModuleError
from ortmodule.export import export_module
from ortmodule.io import flatten_inputs
from ortmodule.partition import build_training_graphs

from .helpers import TORCH_EXPORT, assert_close, train_side_by_side

RTOL = 1e-5


def _assert_grads_match(eager: nn.Module, wrapped: nn.Module, what: str) -> None:
    for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        if pe.grad is None:
            assert po.grad is None, f"{what}: {name}.grad should be None, got {po.grad}"
            continue
        assert po.grad is not None, f"{what}: {name}.grad is None"
        assert_close(po.grad, pe.grad, RTOL, f"{what}: {name}.grad")


# -- A. double backward ------------------------------------------------------------------------------
def _critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _normal_step_matches(eager: nn.Module, wrapped: nn.Module) -> None:
    """After the error, a plain first-order step still matches eager."""
    x = torch.randn(5, 4)
    for m in (eager, wrapped):
        m.zero_grad(set_to_none=True)
        m(x).pow(2).sum().backward()
    _assert_grads_match(eager, wrapped, "step after the double-backward error")


@pytest.mark.parametrize("how", ["autograd.grad", "backward"])
def test_create_graph_raises_and_module_keeps_working(how):
    eager = _critic()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    x = torch.randn(6, 4, requires_grad=True)
    out = wrapped(x)
    with pytest.raises(ORTModuleError, match=r"create_graph=True.*model\.module"):
        if how == "autograd.grad":
            # a WGAN-GP / R1 gradient penalty: built on d(out)/dx, then added to the loss
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            penalty = ((gx.norm(2, dim=1) - 1) ** 2).mean()
            (out.mean() + penalty).backward()
        else:
            out.sum().backward(create_graph=True)
    _normal_step_matches(eager, wrapped)


def test_hessian_raises_jacobian_matches():
    eager = _critic()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    x = torch.randn(3, 4)
    with pytest.raises(ORTModuleError, match="create_graph=True"):
        torch.autograd.functional.hessian(lambda t: wrapped(t).sum(), x)
    with pytest.raises(ORTModuleError, match="create_graph=True"):
        torch.autograd.functional.jacobian(lambda t: wrapped(t), x, create_graph=True)
    # first order: the Jacobian is the same as eager's
    j_o = torch.autograd.functional.jacobian(lambda t: wrapped(t), x)
    j_e = torch.autograd.functional.jacobian(lambda t: eager(t), x)
    assert_close(j_o, j_e, RTOL, "jacobian")
    _normal_step_matches(eager, wrapped)


# -- B. parameters that no present output reaches ----------------------------------------------------
class TwoHeads(nn.Module):
    """``shared`` feeds both outputs; ``head_a`` only ``a``; ``head_b`` only ``b``.

    ``b`` goes through a softmax, whose gradient the absent-gradient specialisation cannot skip
    (NOTE [absent output grads]): there the full backward runs on materialised zeros."""

    def __init__(self, softmax_b: bool = True) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 6)
        self.head_a = nn.Linear(6, 3)
        self.head_b = nn.Linear(6, 3)
        self.softmax_b = softmax_b

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        b = self.head_b(h)
        return self.head_a(h), torch.softmax(b, -1) if self.softmax_b else b


LOSSES = {
    "a": lambda out, batch: out[0].pow(2).sum(),
    "b": lambda out, batch: (out[1] * batch[1]).sum(),
    "both": lambda out, batch: out[0].pow(2).sum() + (out[1] * batch[1]).sum(),
}


@pytest.mark.parametrize("softmax_b", [True, False], ids=["softmax_b", "linear_b"])
@pytest.mark.parametrize("used", sorted(LOSSES))
def test_unreached_parameter_grad_is_none_under_adamw(used, softmax_b):
    torch.manual_seed(0)
    batches = [(torch.randn(5, 4), torch.randn(5, 3)) for _ in range(3)]
    wrapped = train_side_by_side(
        TwoHeads(softmax_b), batches, LOSSES[used], rtol=RTOL, kwargs_fn=lambda batch: {"x": batch[0]},
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    )
    assert wrapped._stats.fallbacks == 0
    if used == "a":  # weight decay did not move head_b (eager leaves its .grad None)
        assert wrapped.module.head_b.weight.grad is None
        assert wrapped.module.shared.weight.grad is not None


class Quantised(nn.Module):
    """A learned-step feature without a straight-through estimator (a common slip): ``step``'s only
    path to the loss is ``op``, whose derivative is zero. Eager gives ``step`` a zero ``.grad``, so
    AdamW still decays it; ``alone``: the output is ``op`` of a layer and nothing else."""

    OPS = {
        "round": torch.round, "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc,
        "sign": torch.sign, "div_floor": lambda h: torch.div(h, 0.3, rounding_mode="floor"),
    }

    def __init__(self, op: str, alone: bool) -> None:
        super().__init__()
        self.step = nn.Linear(16, 16)
        self.body = nn.Linear(16, 16)
        self.op, self.alone = self.OPS[op], alone

    def forward(self, x):
        q = self.op(self.step(x) * 4) / 4
        return q if self.alone else self.body(x) * 0.5 + q


@pytest.mark.parametrize("alone", [False, True], ids=["with_a_path", "alone"])
@pytest.mark.parametrize("op", sorted(Quantised.OPS))
def test_zero_derivative_ops_give_zero_grads_under_adamw(op, alone):
    """NOTE [zero derivatives]: before, ``step.grad`` was None (AdamW skipped it: step.weight 3.0e-3 off after 3
    steps), and a model whose output was only ``round(...)`` fell back (an empty backward graph)."""
    torch.manual_seed(0)
    batches = [(torch.randn(2048, 16),) for _ in range(3)]
    wrapped = train_side_by_side(
        Quantised(op, alone), batches, lambda out, batch: (out * out.detach().sign()).sum() + out.pow(2).mean(),
        rtol=RTOL, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    )
    # the TorchScript exporter has no symbolic for trunc: that one falls back there (with eager's numbers)
    assert wrapped._stats.fallbacks == (1 if op == "trunc" and not TORCH_EXPORT else 0)
    grad = wrapped.module.step.weight.grad
    assert grad is not None and not grad.any()


# -- C. values read inside If / Loop subgraphs -------------------------------------------------------
class Tiled(nn.Module):
    """``w`` and the activation ``h`` reach the loss both directly and through ``tile``
    (which the TorchScript exporter writes as ``If`` nodes reading them from the outer scope)."""

    def __init__(self, op: str = "tile") -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.randn(3, 3))
        self.op = op

    def forward(self, x):
        h = torch.tanh(self.lin(x))  # [N, 3]
        if self.op == "tile":
            hh, ww = h.tile((1, 2)), torch.tile(self.w, (2, 1))
        else:
            hh, ww = h.repeat(1, 2), self.w.repeat(2, 1)
        return (hh @ ww) * h + h @ self.w


@pytest.mark.parametrize("op", ["tile", "repeat"])
def test_tile_trains_like_eager(op):
    torch.manual_seed(0)
    batches = [(torch.randn(5, 4),) for _ in range(3)]
    wrapped = train_side_by_side(
        Tiled(op), batches, lambda out, batch: out.pow(2).sum(), rtol=RTOL,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    )
    assert wrapped._stats.fallbacks == 0


def test_tile_dynamic_batch_trains_like_eager():
    """A second batch size re-exports the graph with dynamic axes; the If conditions depend only on
    ranks there, and still inline."""
    torch.manual_seed(0)
    batches = [(torch.randn(n, 4),) for n in (5, 7, 3)]
    wrapped = train_side_by_side(Tiled(), batches, lambda out, batch: out.pow(2).sum(), rtol=RTOL)
    assert wrapped._stats.fallbacks == 0


def test_tile_ifs_are_inlined():
    torch.manual_seed(0)
    m = Tiled()
    x = torch.randn(5, 4)
    names = [[n] for n, _ in m.named_parameters()]
    for dynamic in (False, True):
        exported = export_module(m, flatten_inputs((x,), {}), list(m.parameters()), names, [], [],
                                 dynamic=dynamic)
        assert "If" in [n.op_type for n in exported.model.graph.node]  # what the exporter wrote
        graphs = build_training_graphs(exported, {n[0]: True for n in names})
        for model in (graphs.forward, graphs.backward):
            assert not [n.op_type for n in model.graph.node if n.op_type in ("If", "Loop")]
            onnx.checker.check_model(model)
        assert sorted(graphs.grad_targets) == sorted(n[0] for n in names)


# ONNX files with control flow reading the trainable initializer 'W' from the outer scope.
def _control_flow_model(kind: str) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32), "W")
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    inputs = [x_info]
    if kind == "loop":
        # y = x; repeat 3 times: y = tanh(y @ W)
        body = helper.make_graph(
            [helper.make_node("MatMul", ["y_in", "W"], ["mm"]),
             helper.make_node("Tanh", ["mm"], ["y_out"]),
             helper.make_node("Identity", ["cond_in"], ["cond_out"])],
            "body",
            [helper.make_tensor_value_info("i", TensorProto.INT64, []),
             helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
             helper.make_tensor_value_info("y_in", TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("y_out", TensorProto.FLOAT, [2, 3])],
        )
        nodes = [
            helper.make_node("Constant", [], ["trip"], value=numpy_helper.from_array(np.array(3, np.int64))),
            helper.make_node("Constant", [], ["true"], value=numpy_helper.from_array(np.array(True))),
            helper.make_node("Loop", ["trip", "true", "x"], ["y"], name="the_loop", body=body),
        ]
    else:
        # y = cond ? x @ W : x @ (W * W)
        then_g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"])], "then", [],
                                   [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])])
        else_g = helper.make_graph([helper.make_node("Mul", ["W", "W"], ["ww"]),
                                    helper.make_node("MatMul", ["x", "ww"], ["e"])], "else", [],
                                   [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3])])
        if kind == "if_input":  # a condition known only at run time
            inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
            nodes = []
        else:  # a condition computed from constants: Size(Shape(x)) > 3 is False
            nodes = [helper.make_node("Shape", ["x"], ["shp"]),
                     helper.make_node("Size", ["shp"], ["rank"]),
                     helper.make_node("Constant", [], ["three"],
                                      value=numpy_helper.from_array(np.array(3, np.int64))),
                     helper.make_node("Greater", ["rank", "three"], ["c"])]
        nodes.append(helper.make_node("If", ["c"], ["y"], name="the_if", then_branch=then_g, else_branch=else_g))
    graph = helper.make_graph(nodes, kind, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _torch_reference(kind: str, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if kind == "loop":
        y = x
        for _ in range(3):
            y = torch.tanh(y @ w)
        return y
    return x @ (w * w)  # the else branch: the condition is False (if_input is run with c=False)


@pytest.mark.parametrize("kind", ["if_input", "loop"])
def test_control_flow_on_gradient_path_raises_naming_the_op(kind):
    om = OnnxModule(_control_flow_model(kind))
    x = torch.randn(2, 3)
    args = (x, torch.tensor(False)) if kind == "if_input" else (x,)
    op, node = ("If", "the_if") if kind == "if_input" else ("Loop", "the_loop")
    with pytest.raises(GradientRuleError, match=rf"'{op}'.*'{node}'.*'W'"):
        om(*args).sum().backward()
    with torch.no_grad():  # no gradient needed: runs as before, and computes what torch computes
        w = om.W.detach()
        assert_close(om(*args), _torch_reference(kind, w, x), RTOL, "forward without grad")


def test_constant_if_is_inlined_and_trains_like_torch():
    om = OnnxModule(_control_flow_model("if_const"))
    w = om.W.detach().clone().requires_grad_(True)
    opt_o = torch.optim.AdamW(om.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW([w], lr=1e-2)
    for step in range(3):
        x = torch.randn(2, 3)
        opt_o.zero_grad(set_to_none=True)
        opt_e.zero_grad(set_to_none=True)
        om(x).pow(2).sum().backward()
        _torch_reference("if_const", w, x).pow(2).sum().backward()
        assert om.W.grad is not None, f"W.grad is None at step {step}"
        assert_close(om.W.grad, w.grad, RTOL, f"W.grad at step {step}")
        opt_o.step()
        opt_e.step()
        assert_close(om.W, w, RTOL, f"W after step {step}")


def test_value_read_only_inside_if_is_kept_in_the_forward_model():
    """An If off the gradient path, reading an outer intermediate only inside its branches: the
    partition's dead-code elimination keeps that intermediate's producer (NOTE [captured values])."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32), "W")
    f3 = [2, 3]
    then_g = helper.make_graph([helper.make_node("Identity", ["t"], ["zt"])], "then", [],
                               [helper.make_tensor_value_info("zt", TensorProto.FLOAT, f3)])
    else_g = helper.make_graph([helper.make_node("Neg", ["t"], ["ze"])], "else", [],
                               [helper.make_tensor_value_info("ze", TensorProto.FLOAT, f3)])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"]),
         helper.make_node("Abs", ["x"], ["t"]),
         helper.make_node("If", ["c"], ["z"], then_branch=then_g, else_branch=else_g)],
        "side_if",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, f3),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, f3),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, f3)],
        [w],
    )
    om = OnnxModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    x = torch.randn(2, 3)
    w_ref = om.W.detach().clone().requires_grad_(True)
    y, z = om(x, torch.tensor(False))
    assert_close(z, -x.abs(), RTOL, "z")
    (y.pow(2).sum() + z.sum()).backward()
    (x @ w_ref).pow(2).sum().backward()
    assert_close(om.W.grad, w_ref.grad, RTOL, "W.grad")
