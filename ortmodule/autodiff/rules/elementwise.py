"""Elementwise arithmetic: broadcasting binary ops, unary math, Identity and Cast."""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx_ir as ir

from ..registry import GradBuilder, register
from .indexing import const_array

UnaryGrad = Callable[[GradBuilder, ir.Value, ir.Value, ir.Value], ir.Value]


def defunary(op_type: str, fn: UnaryGrad) -> None:
    """Register an elementwise unary op whose rule is ``dx = fn(g, x, y, dy)``."""

    def rule(g: GradBuilder, node: ir.Node, dys):
        (x,), (y,) = node.inputs, node.outputs
        return [fn(g, x, y, dys[0])]

    rule.__name__ = f"{op_type.lower()}_grad"
    register(op_type)(rule)


def _sqrt_grad(g, x, y, dy):  # d sqrt(x) = dy / (2 y)
    return g.op("Div", [dy, g.mul(y, g.scalar_like(2.0, y))])


def _erf_grad(g, x, y, dy):  # d erf(x) = 2/sqrt(pi) exp(-x^2)
    e = g.op("Exp", [g.neg(g.mul(x, x))])
    return g.mul(dy, g.mul(e, g.scalar_like(2.0 / math.sqrt(math.pi), x)))


defunary("Identity", lambda g, x, y, dy: dy)
defunary("Neg", lambda g, x, y, dy: g.neg(dy))
defunary("Exp", lambda g, x, y, dy: g.mul(dy, y))
defunary("Log", lambda g, x, y, dy: g.op("Div", [dy, x]))
defunary("Sqrt", _sqrt_grad)
defunary("Reciprocal", lambda g, x, y, dy: g.neg(g.mul(dy, g.mul(y, y))))
defunary("Abs", lambda g, x, y, dy: g.mul(dy, g.op("Sign", [x])))
defunary("Erf", _erf_grad)
defunary("Sin", lambda g, x, y, dy: g.mul(dy, g.op("Cos", [x])))
defunary("Cos", lambda g, x, y, dy: g.neg(g.mul(dy, g.op("Sin", [x]))))


@register("Cast")
def cast_grad(g: GradBuilder, node: ir.Node, dys):
    (x,) = node.inputs
    if not (x.dtype and x.dtype.is_floating_point()):
        return [None]
    return [g.cast_like(dys[0], x)]


@register("CastLike")
def cast_like_grad(g: GradBuilder, node: ir.Node, dys):
    """As Cast; the second input only names the dtype."""
    x = node.inputs[0]
    if not (x.dtype and x.dtype.is_floating_point()):
        return [None, None]
    return [g.cast_like(dys[0], x), None]


@register("Sum")
def sum_grad(g: GradBuilder, node: ir.Node, dys):
    """Variadic, broadcasting Add: dY reduced to each input's shape."""
    shape = node.outputs[0].shape
    return [g.reduce_to(dys[0], x, shape) for x in node.inputs]


@register("Mean")
def mean_grad(g: GradBuilder, node: ir.Node, dys):
    """Variadic, broadcasting mean: dY / n reduced to each input's shape."""
    shape, dy = node.outputs[0].shape, dys[0]
    share = g.op("Div", [dy, g.scalar_like(float(len(node.inputs)), dy)], dtype=dy.dtype)
    return [g.reduce_to(share, x, shape) for x in node.inputs]


@register("Add")
def add_grad(g: GradBuilder, node: ir.Node, dys):
    a, b = node.inputs
    shape = node.outputs[0].shape
    return [g.reduce_to(dys[0], a, shape), g.reduce_to(dys[0], b, shape)]


@register("Sub")
def sub_grad(g: GradBuilder, node: ir.Node, dys):
    a, b = node.inputs
    shape = node.outputs[0].shape
    return [g.reduce_to(dys[0], a, shape), g.reduce_to(g.neg(dys[0]), b, shape)]


@register("Mul")
def mul_grad(g: GradBuilder, node: ir.Node, dys):
    a, b = node.inputs
    shape, dy = node.outputs[0].shape, dys[0]
    return [g.reduce_to(g.mul(dy, b), a, shape), g.reduce_to(g.mul(dy, a), b, shape)]


@register("Div")
def div_grad(g: GradBuilder, node: ir.Node, dys):
    a, b = node.inputs
    (y,) = node.outputs
    dy = dys[0]
    da = g.op("Div", [dy, b])  # d(a/b)/da = 1/b
    db = g.neg(g.op("Div", [g.mul(dy, y), b]))  # d(a/b)/db = -a/b^2 = -y/b
    return [g.reduce_to(da, a, y.shape), g.reduce_to(db, b, y.shape)]


@register("Pow")
def pow_grad(g: GradBuilder, node: ir.Node, dys):
    a, b = node.inputs
    (y,) = node.outputs
    dy = dys[0]
    # d a^b / da = b a^(b-1); computed as b * a^(b-1) (not y/a, which breaks at a=0)
    b_cast = b if b.dtype == a.dtype else g.cast_like(b, a)
    exponent = const_array(b)
    if exponent is not None and exponent.size == 1 and float(exponent.reshape(-1)[0]) == 2.0:
        # x ** 2 (RMSNorm's variance, squared losses): a^1 is a itself, where onnxruntime's Pow with
        # exponent 1 runs the generic per-element pow (~1 ms on [8, 128, 256]; Mixtral-4L's backward
        # spent 8.8 ms in eight of them)
        da = g.mul(dy, g.mul(b_cast, a))
    else:
        b_minus_1 = g.op("Sub", [b_cast, g.scalar_like(1.0, a)])
        da = g.mul(dy, g.mul(b_cast, g.op("Pow", [a, b_minus_1])))
    if b.const_value is None:  # torch: 0 where b == 0 (0 * 0^-1 would be NaN at a == 0)
        b_zero = g.op("Equal", [b_cast, g.scalar_like(0.0, a)])
        da = g.op("Where", [b_zero, g.scalar_like(0.0, da), da], dtype=da.dtype)
    grads = [g.reduce_to(da, a, y.shape), None]
    if b.dtype is not None and b.dtype.is_floating_point() and b.const_value is None:
        # d a^b / db = y * log(a), 0 where a == 0 and b >= 0 as torch's pow_backward_exponent (0 * -inf
        # is NaN); a constant exponent gets no gradient, so no mask is paid for x ** 2.
        db = g.mul(dy, g.mul(y, g.op("Log", [a])))
        zero = g.scalar_like(0.0, db)
        at_zero = g.op("And", [g.op("Equal", [a, g.scalar_like(0.0, a)]),
                               g.op("GreaterOrEqual", [b_cast, g.scalar_like(0.0, a)])])
        grads[1] = g.reduce_to(g.op("Where", [at_zero, zero, db], dtype=db.dtype), b, y.shape)
    return grads
