"""Shape and layout ops: Reshape, Flatten, (Un)Squeeze, Transpose, Expand, and the
non-differentiable ops whose outputs are shapes, indices or booleans."""

from __future__ import annotations

import onnx_ir as ir

from ..registry import GradBuilder, attr, register, register_nondifferentiable

register_nondifferentiable(
    "Shape", "Size", "Constant", "ConstantOfShape", "Range", "NonZero", "EyeLike", "RandomNormalLike",
    "RandomUniformLike", "RandomNormal", "RandomUniform", "Bernoulli", "Multinomial",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "ArgMax", "ArgMin", "Sign", "Floor", "Ceil", "Round", "OneHot",
)


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
