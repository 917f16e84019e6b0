"""Shape and layout ops: Reshape, Flatten, (Un)Squeeze, Transpose, Expand, the non-differentiable ops
whose outputs are shapes, indices or booleans, and the ops whose derivative is zero."""

from __future__ import annotations

import onnx_ir as ir

from ..registry import GradBuilder, attr, register, register_nondifferentiable, register_zero_derivative

register_nondifferentiable(
    "Shape", "Size", "Constant", "ConstantOfShape", "Range", "NonZero", "EyeLike", "RandomNormalLike",
    "RandomUniformLike", "RandomNormal", "RandomUniform", "Bernoulli", "Multinomial",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "ArgMax", "ArgMin", "OneHot",
)


# NOTE [zero derivatives]: torch differentiates round, floor, ceil, trunc and sign (their outputs
# require grad; the backward is zeros), where a comparison or argmax ends the graph. The difference
# shows when nothing else reaches a parameter: eager gives it a zero ``.grad``, so AdamW decays it
# and advances its moments; a ``None`` grad would make AdamW skip it, a silent divergence. So these
# ops keep their outputs on the gradient path and contribute nothing; ``build_gradient`` gives a
# target that only such ops reach a zero gradient, and an output that only they reach is
# differentiable, as in eager. Upstream of such an op, a value gets the zero only through the inputs
# each rule differentiates (Resize's scales, say, get none).
register_zero_derivative("Sign", "Floor", "Ceil", "Round")


def _back_to_shape(g: GradBuilder, node: ir.Node, dys):
    """Ops that only change the shape: the gradient is dY reshaped to X's shape."""
    x = node.inputs[0]
    return [g.reshape_like(dys[0], x)] + [None] * (len(node.inputs) - 1)


for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
    register(_op)(_back_to_shape)


@register("Transpose")
def transpose_grad(g: GradBuilder, node: ir.Node, dys):
    (x,) = node.inputs
    perm = attr(node, "perm")
    if perm is None:
        perm = list(range(x.shape.rank()))[::-1]
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [g.op("Transpose", [dys[0]], {"perm": inverse}, dtype=x.dtype, shape=x.shape)]


@register("Expand")
def expand_grad(g: GradBuilder, node: ir.Node, dys):
    x = node.inputs[0]
    return [g.reduce_to(dys[0], x, node.outputs[0].shape), None]
