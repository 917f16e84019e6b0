"""More activations (LeakyRelu, Elu, Selu, Celu, Hard*, Softplus, Softsign, Mish, PRelu, ...),
Min/Max/Clip, and the inverse and hyperbolic trigonometric functions.

At kinks the one-sided choice follows torch's backward (e.g. LeakyRelu takes the negative slope at
0, HardSigmoid is flat at the ends of its linear part).
"""

from __future__ import annotations

import onnx_ir as ir

from ...passes.precision import mark_precise, selu_constants
from ..registry import GRAD_KIND_KEY, GradBuilder, attr, input_or_none, register
from .elementwise import defunary


def _c(g: GradBuilder, value: float, like: ir.Value) -> ir.Value:
    return g.scalar_like(value, like)


def _where(g: GradBuilder, cond: ir.Value, a: ir.Value, b: ir.Value, like: ir.Value) -> ir.Value:
    return g.op("Where", [cond, a, b], dtype=like.dtype)


def _positive(g: GradBuilder, x: ir.Value) -> ir.Value:
    return g.op("Greater", [x, _c(g, 0.0, x)])


# -- unary activations with attributes ----------------------------------------------------------------


@register("LeakyRelu")
def leaky_relu_grad(g: GradBuilder, node: ir.Node, dys):
    (x,), dy = node.inputs, dys[0]
    alpha = attr(node, "alpha", 0.01)
    return [_where(g, _positive(g, x), dy, g.mul(dy, _c(g, alpha, x)), x)]


@register("Elu")
def elu_grad(g: GradBuilder, node: ir.Node, dys):
    (x,), (y,), dy = node.inputs, node.outputs, dys[0]
    alpha = attr(node, "alpha", 1.0)
    # x <= 0: y = alpha (e^x - 1), dy/dx = alpha e^x = y + alpha
    return [_where(g, _positive(g, x), dy, g.mul(dy, g.add(y, _c(g, alpha, y))), x)]


@register("Selu")
def selu_grad(g: GradBuilder, node: ir.Node, dys):
    (x,), (y,), dy = node.inputs, node.outputs, dys[0]
    alpha, gamma = selu_constants(attr(node, "alpha"), attr(node, "gamma"))  # NOTE [float64 kernels]
    # x <= 0: y = gamma alpha (e^x - 1), dy/dx = y + gamma alpha
    neg = g.mul(dy, g.add(y, _c(g, gamma * alpha, y)))
    return [_where(g, _positive(g, x), g.mul(dy, _c(g, gamma, x)), neg, x)]


@register("Celu")
def celu_grad(g: GradBuilder, node: ir.Node, dys):
    (x,), dy = node.inputs, dys[0]
    alpha = attr(node, "alpha", 1.0)
    # x <= 0: y = alpha (e^(x/alpha) - 1), dy/dx = e^(x/alpha)
    e = g.op("Exp", [g.mul(x, _c(g, 1.0 / alpha, x))])
    return [_where(g, _positive(g, x), dy, g.mul(dy, e), x)]


@register("ThresholdedRelu")
def thresholded_relu_grad(g: GradBuilder, node: ir.Node, dys):
    (x,), dy = node.inputs, dys[0]
    alpha = attr(node, "alpha", 1.0)
    return [_where(g, g.op("Greater", [x, _c(g, alpha, x)]), dy, _c(g, 0.0, x), x)]


@register("HardSigmoid")
def hard_sigmoid_grad(g: GradBuilder, node: ir.Node, dys):
    (x,), dy = node.inputs, dys[0]
    alpha, beta = attr(node, "alpha", 0.2), attr(node, "beta", 0.5)
    z = g.add(g.mul(x, _c(g, alpha, x)), _c(g, beta, x))
    inside = g.op("And", [g.op("Greater", [z, _c(g, 0.0, x)]), g.op("Less", [z, _c(g, 1.0, x)])])
    return [_where(g, inside, g.mul(dy, _c(g, alpha, x)), _c(g, 0.0, x), x)]


def _hard_swish_grad(g: GradBuilder, x, y, dy):
    # torch (measured, 2.13): 0 for x <= -3, x/3 + 1/2 for -3 < x < 3, 1 from 3 on.
    mid = g.add(g.mul(x, _c(g, 1.0 / 3.0, x)), _c(g, 0.5, x))
    d = _where(g, g.op("LessOrEqual", [x, _c(g, -3.0, x)]), _c(g, 0.0, x),
               _where(g, g.op("Less", [x, _c(g, 3.0, x)]), mid, _c(g, 1.0, x), x), x)
    return g.mul(dy, d)


def _softplus_grad(g: GradBuilder, x, y, dy):
    # sigmoid(x), exact in relative terms: log(softplus(x)) (a learnt scale's log) divides by the tiny
    # softplus of a very negative x (NOTE [precise sigmoid])
    s = g.op("Sigmoid", [x])
    mark_precise(s.producer(), x.dtype)
    return g.mul(dy, s)


def _softsign_grad(g: GradBuilder, x, y, dy):  # 1 / (1 + |x|)^2
    den = g.add(_c(g, 1.0, x), g.op("Abs", [x]))
    return g.op("Div", [dy, g.mul(den, den)])


def _mish_grad(g: GradBuilder, x, y, dy):
    # y = x tanh(sp), sp = softplus(x): dy/dx = tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x)
    t = g.op("Tanh", [g.op("Softplus", [x])])
    sech2 = g.op("Sub", [_c(g, 1.0, x), g.mul(t, t)])
    return g.mul(dy, g.add(t, g.mul(x, g.mul(sech2, g.op("Sigmoid", [x])))))


defunary("HardSwish", _hard_swish_grad)
defunary("Softplus", _softplus_grad)
defunary("Softsign", _softsign_grad)
defunary("Mish", _mish_grad)


@register("PRelu")
def prelu_grad(g: GradBuilder, node: ir.Node, dys):
    x, slope = node.inputs
    (y,), dy = node.outputs, dys[0]
    # torch: the slope applies from 0 down (x > 0 takes dy; at 0, dy * slope).
    positive = _positive(g, x)
    zero = _c(g, 0.0, x)
    dx = _where(g, positive, dy, g.mul(dy, slope), x)
    dslope = _where(g, positive, zero, g.mul(dy, x), x)
    return [g.reduce_to(dx, x, y.shape), g.reduce_to(dslope, slope, y.shape)]


# -- Min / Max / Clip ---------------------------------------------------------------------------------


def _extremum_grad(g: GradBuilder, node: ir.Node, dys):
    # NOTE [elementwise ties]: torch.maximum/minimum give each of two tied inputs half the gradient;
    # for n inputs we split it evenly between all those equal to the result (n = 2 matches torch).
    (y,), dy = node.outputs, dys[0]
    xs = list(node.inputs)
    if len(xs) == 1:
        return [dy]
    masks = [g.op("Cast", [g.op("Equal", [x, y])], {"to": int(y.dtype)}, dtype=y.dtype) for x in xs]
    share = g.op("Div", [dy, g.op("Sum", masks, dtype=y.dtype)], dtype=y.dtype)
    return [g.reduce_to(g.mul(share, m), x, y.shape) for m, x in zip(masks, xs, strict=True)]


register("Max")(_extremum_grad)
register("Min")(_extremum_grad)


@register("Clip")
def clip_grad(g: GradBuilder, node: ir.Node, dys):
    x = node.inputs[0]
    lo, hi = input_or_none(node, 1), input_or_none(node, 2)
    (y,), dy = node.outputs, dys[0]
    zero = _c(g, 0.0, x)
    # Like torch.clamp: x gets dy where lo <= x <= hi; a bound gets dy where it was the output.
    conds = []
    grads: list[ir.Value | None] = [None] * len(node.inputs)
    # NOTE [kinks as torch]: F.hardtanh / relu6 keep it strictly inside the bounds.
    strict = node.metadata_props.get(GRAD_KIND_KEY) == "strict_bounds"
    if lo is not None:
        conds.append(g.op("Greater" if strict else "GreaterOrEqual", [x, lo]))
        grads[1] = g.reduce_to(_where(g, g.op("Less", [x, lo]), dy, zero, x), lo, y.shape)
    if hi is not None:
        conds.append(g.op("Less" if strict else "LessOrEqual", [x, hi]))
        grads[2] = g.reduce_to(_where(g, g.op("Greater", [x, hi]), dy, zero, x), hi, y.shape)
    if not conds:
        grads[0] = dy
    else:
        keep = conds[0] if len(conds) == 1 else g.op("And", conds)
        grads[0] = _where(g, keep, dy, zero, x)
    return grads


# -- inverse and hyperbolic trigonometry --------------------------------------------------------------


def _one_minus_x2(g: GradBuilder, x):
    return g.op("Sub", [_c(g, 1.0, x), g.mul(x, x)])


defunary("Tan", lambda g, x, y, dy: g.mul(dy, g.add(_c(g, 1.0, y), g.mul(y, y))))
defunary("Atan", lambda g, x, y, dy: g.op("Div", [dy, g.add(_c(g, 1.0, x), g.mul(x, x))]))
defunary("Asin", lambda g, x, y, dy: g.op("Div", [dy, g.op("Sqrt", [_one_minus_x2(g, x)])]))
defunary("Acos", lambda g, x, y, dy: g.neg(g.op("Div", [dy, g.op("Sqrt", [_one_minus_x2(g, x)])])))
defunary("Sinh", lambda g, x, y, dy: g.mul(dy, g.op("Cosh", [x])))
defunary("Cosh", lambda g, x, y, dy: g.mul(dy, g.op("Sinh", [x])))
defunary("Asinh", lambda g, x, y, dy: g.op("Div", [dy, g.op("Sqrt", [g.add(g.mul(x, x), _c(g, 1.0, x))])]))
defunary("Acosh", lambda g, x, y, dy: g.op("Div", [dy, g.op("Sqrt", [g.neg(_one_minus_x2(g, x))])]))
defunary("Atanh", lambda g, x, y, dy: g.op("Div", [dy, _one_minus_x2(g, x)]))
