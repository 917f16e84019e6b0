"""Activations and normalising maps: Relu, Gelu, Tanh, Sigmoid, Softmax, LogSoftmax."""

from __future__ import annotations

import math

import onnx_ir as ir

from ..registry import GradBuilder, attr, register
from .elementwise import defunary

# Ops whose derivative is infinite at 0: fed a Relu's output, their gradient is inf where it is 0.
_INF_AT_ZERO = frozenset({"Sqrt", "Log", "Reciprocal", "Div", "Pow"})


def _relu_grad(g: GradBuilder, x, y, dy):
    # NOTE [relu mask]: dy * (y > 0) as a Mul by a cast mask: onnxruntime's CPU Where is ~8x slower
    # (2.2 ms against 0.27 on a 32x16x32x32 tensor, 2 threads). But inf * 0 is NaN where torch's
    # threshold_backward selects 0: sqrt(relu(x)) had NaN gradients where eager has zeros. Where the
    # output feeds an op whose derivative is infinite at 0, the gradient is a Where.
    positive = g.op("Greater", [y, g.scalar_like(0.0, y)])
    if any(use.node.op_type in _INF_AT_ZERO and use.node.domain == "" for use in y.uses()):
        return g.op("Where", [positive, dy, g.scalar_like(0.0, y)], dtype=y.dtype)
    return g.mul(dy, g.op("Cast", [positive], {"to": int(y.dtype)}, dtype=y.dtype))


def _tanh_grad(g: GradBuilder, x, y, dy):  # 1 - y^2
    return g.mul(dy, g.op("Sub", [g.scalar_like(1.0, y), g.mul(y, y)]))


def _sigmoid_grad(g: GradBuilder, x, y, dy):  # y (1 - y)
    return g.mul(dy, g.mul(y, g.op("Sub", [g.scalar_like(1.0, y), y])))


defunary("Relu", _relu_grad)
defunary("Tanh", _tanh_grad)
defunary("Sigmoid", _sigmoid_grad)


@register("Gelu")
def gelu_grad(g: GradBuilder, node: ir.Node, dys):
    (x,) = node.inputs
    dy = dys[0]
    c = lambda v: g.scalar_like(v, x)
    if attr(node, "approximate", "none") == "tanh":
        # y = 0.5 x (1 + t), t = tanh(k (x + a x^3)); dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2)
        k, a = math.sqrt(2.0 / math.pi), 0.044715
        x2 = g.mul(x, x)
        inner = g.mul(c(k), g.add(x, g.mul(c(a), g.mul(x2, x))))
        t = g.op("Tanh", [inner])
        one_plus_t = g.add(c(1.0), t)
        dinner = g.mul(c(k), g.add(c(1.0), g.mul(c(3.0 * a), x2)))
        sech2 = g.op("Sub", [c(1.0), g.mul(t, t)])
        d = g.add(g.mul(c(0.5), one_plus_t), g.mul(g.mul(c(0.5), x), g.mul(sech2, dinner)))
    else:
        # dy/dx = Phi(x) + x phi(x), Phi(x) = 0.5 (1 + erf(x / sqrt 2)), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
        cdf = g.mul(c(0.5), g.add(c(1.0), g.op("Erf", [g.mul(x, c(1.0 / math.sqrt(2.0)))])))
        pdf = g.mul(g.op("Exp", [g.mul(g.mul(x, x), c(-0.5))]), c(1.0 / math.sqrt(2.0 * math.pi)))
        d = g.add(cdf, g.mul(x, pdf))
    return [g.mul(dy, d)]


@register("Softmax")
def softmax_grad(g: GradBuilder, node: ir.Node, dys):
    (y,), dy = node.outputs, dys[0]
    axis = attr(node, "axis", -1)
    s = g.op("ReduceSum", [g.mul(dy, y), g.ints([axis])], {"keepdims": 1})
    return [g.mul(y, g.op("Sub", [dy, s]))]


@register("LogSoftmax")
def log_softmax_grad(g: GradBuilder, node: ir.Node, dys):
    (y,), dy = node.outputs, dys[0]
    axis = attr(node, "axis", -1)
    s = g.op("ReduceSum", [dy, g.ints([axis])], {"keepdims": 1})
    return [g.op("Sub", [dy, g.mul(g.op("Exp", [y]), s)])]
