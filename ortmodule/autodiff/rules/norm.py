"""Normalisation and regularisation layers: BatchNormalization, InstanceNormalization,
LayerNormalization, Dropout."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ...errors import GradientRuleError, node_location
from ...passes import BATCH_STATS_KEY
from ...runtime.torch_nodes import Arg
from ..registry import GradBuilder, attr, input_or_none, register, static_shape
from .aten import aten_kernels


def _rank(x: ir.Value, op_type: str) -> int:
    if x.shape is None:
        raise ValueError(f"{op_type} gradient needs the rank of its input (run shape inference first)")
    return x.shape.rank()


def _reduce_mean(g: GradBuilder, v: ir.Value, axes: list[int]) -> ir.Value:
    if g.opset >= 18:
        return g.op("ReduceMean", [v, g.ints(axes)], {"keepdims": 1}, dtype=v.dtype)
    return g.op("ReduceMean", [v], {"axes": axes, "keepdims": 1}, dtype=v.dtype)


def _normalized(g: GradBuilder, x: ir.Value, axes: list[int], eps: float):
    """``(x - mean) * invstd`` over ``axes`` (biased variance), with the centred x and invstd (kept dims)."""
    xc = g.op("Sub", [x, _reduce_mean(g, x, axes)], dtype=x.dtype)
    var = _reduce_mean(g, g.mul(xc, xc), axes)
    invstd = g.op("Reciprocal", [g.op("Sqrt", [g.add(var, g.scalar_like(eps, x))])], dtype=x.dtype)
    return g.mul(xc, invstd), xc, invstd


def _normalize_backward(g: GradBuilder, dxhat: ir.Value, xhat: ir.Value, invstd: ir.Value, axes: list[int]):
    """dX of ``xhat = (x - mean(x)) / sqrt(var(x) + eps)`` over ``axes``, given d xhat.

    # NOTE [normalisation backward]: with the statistics taken over the same axes,
    # dX = invstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)); the two means are the
    # gradients flowing through the batch mean and the batch variance.
    """
    inner = g.op("Sub", [dxhat, _reduce_mean(g, dxhat, axes)], dtype=dxhat.dtype)
    inner = g.op("Sub", [inner, g.mul(xhat, _reduce_mean(g, g.mul(dxhat, xhat), axes))], dtype=dxhat.dtype)
    return g.mul(invstd, inner)


def _per_channel(g: GradBuilder, p: ir.Value, rank: int) -> ir.Value:
    """A ``[C]`` parameter as ``[1, C, 1, ...]`` for broadcasting against ``[N, C, D...]``."""
    return g.op("Unsqueeze", [p, g.ints([0, *range(2, rank)])], dtype=p.dtype)


def _batch_stats_grads_aten(g: GradBuilder, node: ir.Node, dy: ir.Value, eps: float) -> list | None:
    """NOTE [ATen kernels]: the three gradients of a batch-statistics BN in one
    ``aten::native_batch_norm_backward`` call, from the saved batch mean and ``1 / sqrt(var + eps)``
    (a [C] Reciprocal in ORT)."""
    if "BatchNormalization" not in aten_kernels():
        return None
    x, scale, bias, mean, var = node.inputs[:5]
    need = [x in g.active, scale in g.active, bias in g.active]
    picks = [i for i, n in enumerate(need) if n]
    grads: list[ir.Value | None] = [None] * len(node.inputs)
    if not picks:
        return grads
    invstd = g.op("Reciprocal", [g.op("Sqrt", [g.add(var, g.scalar_like(eps, var))])], dtype=var.dtype)
    outs = g.aten("aten::native_batch_norm_backward.default", [dy, x, scale, mean, invstd],
                  [Arg(0), Arg(1), Arg(2), None, None, Arg(3), Arg(4), True, eps, need], picks)
    for i, out in zip(picks, outs):
        grads[i] = out
    return grads


def _batch_stats_grads(g: GradBuilder, node: ir.Node, dy: ir.Value, rank: int, axes: list[int], eps: float):
    """Train-mode BN gradients from the saved batch mean/var, with dX as a per-channel affine map.

    # NOTE [BN backward affine]: with xc = x - mean, M values per channel, k = scale * invstd,
    # S1 = sum(dY) and S2 = sum(dY * xc):  dX = k * dY - (k * invstd^2 * S2 / M) * xc - k * S1 / M,
    # dScale = invstd * S2, dB = S1. Six passes over [N, C, ...] (xc, dY*xc, two products, two adds)
    # instead of the nine of the generic normalisation backward; the per-channel factors are tiny.
    """
    x, scale, _bias, mean, var = node.inputs[:5]
    dt = x.dtype
    inv1 = g.op("Reciprocal", [g.op("Sqrt", [g.add(var, g.scalar_like(eps, var))])], dtype=var.dtype)  # [C]
    static = static_shape(x)
    if static is not None:
        m = g.scalar_like(1.0 / (np.prod(static) / static[1]), var)
    else:
        count = g.op("Div", [g.op("Size", [x], dtype=ir.DataType.INT64), g.op("Size", [mean], dtype=ir.DataType.INT64)],
                     dtype=ir.DataType.INT64)
        m = g.op("Reciprocal", [g.op("Cast", [count], {"to": int(dt)}, dtype=dt)], dtype=dt)
    xc = g.op("Sub", [x, _per_channel(g, mean, rank)], dtype=dt)
    s1 = g.reduce_sum(dy, axes, keepdims=False)
    s2 = g.reduce_sum(g.mul(dy, xc), axes, keepdims=False)
    k = g.mul(scale, inv1)
    kx = g.neg(g.mul(g.mul(k, g.mul(inv1, inv1)), g.mul(s2, m)))
    kc = g.neg(g.mul(k, g.mul(s1, m)))
    affine = g.add(g.mul(xc, _per_channel(g, kx, rank)), _per_channel(g, kc, rank))
    dx = g.add(g.mul(dy, _per_channel(g, k, rank)), affine)
    grads: list[ir.Value | None] = [None] * len(node.inputs)
    grads[0], grads[1], grads[2] = dx, g.mul(s2, inv1), s1
    return grads


@register("BatchNormalization")
def batch_norm_grad(g: GradBuilder, node: ir.Node, dys):
    """Gradients into Y only: running_mean/running_var outputs are buffer updates, not trained through."""
    x, scale, bias, mean, var = node.inputs[:5]
    dy = dys[0]
    grads: list[ir.Value | None] = [None] * len(node.inputs)
    if dy is None:
        return grads
    rank = _rank(x, "BatchNormalization")
    axes = [0, *range(2, rank)]
    eps = float(attr(node, "epsilon", 1e-5))
    scale_b = _per_channel(g, scale, rank)
    if node.metadata_props.get(BATCH_STATS_KEY):
        # NOTE [batch-stats BN]: mean/var are this batch's statistics (gradient-stopped, as torch's
        # batch norm treats them through the batch formula): read them instead of recomputing.
        fused = _batch_stats_grads_aten(g, node, dy, eps)
        return fused if fused is not None else _batch_stats_grads(g, node, dy, rank, axes, eps)
    elif int(attr(node, "training_mode", 0)):
        # Batch statistics: the input mean/var do not reach Y.
        xhat, _, invstd = _normalized(g, x, axes, eps)
        grads[0] = _normalize_backward(g, g.mul(dy, scale_b), xhat, invstd, axes)
    else:
        # Y = (x - mean) * invstd * scale + B with fixed running statistics: affine in x.
        invstd1 = g.op("Reciprocal", [g.op("Sqrt", [g.add(var, g.scalar_like(eps, var))])], dtype=var.dtype)
        invstd = _per_channel(g, invstd1, rank)
        xc = g.op("Sub", [x, _per_channel(g, mean, rank)], dtype=x.dtype)
        xhat = g.mul(xc, invstd)
        grads[0] = g.mul(dy, g.mul(scale_b, invstd))
        sum_dy = g.reduce_sum(dy, axes, keepdims=False)
        k = g.mul(scale, invstd1)  # d Y / d x per channel
        grads[3] = g.neg(g.mul(sum_dy, k))
        sum_dy_xc = g.reduce_sum(g.mul(dy, xc), axes, keepdims=False)
        d_invstd = g.mul(sum_dy_xc, scale)
        # d invstd / d var = -invstd^3 / 2
        grads[4] = g.mul(d_invstd, g.mul(g.mul(invstd1, g.mul(invstd1, invstd1)), g.scalar_like(-0.5, var)))
    grads[1] = g.reduce_sum(g.mul(dy, xhat), axes, keepdims=False)
    grads[2] = g.reduce_sum(dy, axes, keepdims=False)
    return grads


@register("InstanceNormalization")
def instance_norm_grad(g: GradBuilder, node: ir.Node, dys):
    x, scale, _bias = node.inputs
    dy = dys[0]
    rank = _rank(x, "InstanceNormalization")
    spatial = list(range(2, rank))
    eps = float(attr(node, "epsilon", 1e-5))
    xhat, _, invstd = _normalized(g, x, spatial, eps)
    dx = _normalize_backward(g, g.mul(dy, _per_channel(g, scale, rank)), xhat, invstd, spatial)
    axes = [0, *spatial]
    return [dx, g.reduce_sum(g.mul(dy, xhat), axes, keepdims=False), g.reduce_sum(dy, axes, keepdims=False)]


@register("LayerNormalization")
def layer_norm_grad(g: GradBuilder, node: ir.Node, dys):
    """Also takes gradients arriving at the optional Mean / InvStdDev outputs."""
    x, scale = node.inputs[0], node.inputs[1]
    bias = input_or_none(node, 2)
    y = node.outputs[0]
    rank = _rank(x, "LayerNormalization")
    axis = int(attr(node, "axis", -1)) % rank
    axes = list(range(axis, rank))
    eps = float(attr(node, "epsilon", 1e-5))
    saved = node.outputs[1:3] if len(node.outputs) == 3 else []
    if len(saved) == 2 and all(v.name and v.dtype == x.dtype for v in saved):
        # NOTE [save LN stats]: the forward's Mean / InvStdDev, not a recomputation
        mean, invstd = saved
        xc = g.op("Sub", [x, mean], dtype=x.dtype)
        xhat = g.mul(xc, invstd)
    else:
        xhat, xc, invstd = _normalized(g, x, axes, eps)
    dy = dys[0]
    grads: list[ir.Value | None] = [None] * len(node.inputs)
    dx = None
    if dy is not None:
        dx = _normalize_backward(g, g.mul(dy, scale), xhat, invstd, axes)
        grads[1] = g.reduce_to(g.mul(dy, xhat), scale, y.shape)
        if bias is not None:
            grads[2] = g.reduce_to(dy, bias, y.shape)
    d_mean = dys[1] if len(dys) > 1 else None
    d_inv = dys[2] if len(dys) > 2 else None
    if d_mean is not None or d_inv is not None:
        # Mean = mean(x); InvStdDev = (var + eps)^-1/2 with d var / d x = 2 (x - mean) / count.
        count = g.op(
            "Cast",
            [g.op("ReduceProd", [g.op("Slice", [g.op("Shape", [x]), g.ints([axis]), g.ints([rank])])],
                  {"keepdims": 0})],
            {"to": int(x.dtype)},
            dtype=x.dtype,
        )
        extra = None
        if d_mean is not None:
            extra = g.op("Div", [g.expand_like(d_mean, x), count], dtype=x.dtype)
        if d_inv is not None:
            cube = g.mul(invstd, g.mul(invstd, invstd))
            term = g.op("Div", [g.neg(g.mul(g.mul(d_inv, cube), xc)), count], dtype=x.dtype)
            extra = term if extra is None else g.add(extra, term)
        dx = extra if dx is None else g.add(dx, extra)
    grads[0] = dx
    return grads


def _const_bool(v: ir.Value | None) -> bool | None:
    """``False`` if omitted; the value if constant; ``None`` if only known at run time."""
    if v is None:
        return False
    t = ir.convenience.get_const_tensor(v)
    return None if t is None else bool(np.asarray(t.numpy()).reshape(-1)[0])


@register("Dropout")
def dropout_grad(g: GradBuilder, node: ir.Node, dys):
    """dX = dY * mask / (1 - ratio) in training, dY otherwise.

    # NOTE [dropout mask]: the random mask cannot be recomputed in the backward, so a training-mode
    # Dropout must output it. Exports that leave it out are rewritten to add the mask output before
    # the gradient is built; reaching this rule without one is an error, not a silent identity.
    """
    x = node.inputs[0]
    ratio = input_or_none(node, 1)
    training = input_or_none(node, 2)
    dy = dys[0]
    rest = [None] * (len(node.inputs) - 1)
    is_training = _const_bool(training)
    if is_training is False:
        return [dy, *rest]
    mask = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1].name else None
    if mask is None:
        raise GradientRuleError(
            f"Dropout in training mode has no mask output ({node_location(node)}), so its gradient "
            "cannot be recovered; the export must request the mask (the Dropout node needs a second "
            "output), which the dropout-mask graph rewrite adds before the gradient is built"
        )
    if ratio is None:
        scale = g.scalar_like(2.0, x)  # default ratio 0.5
    else:
        r = ratio if ratio.dtype == x.dtype else g.cast_like(ratio, x)
        scale = g.op("Reciprocal", [g.op("Sub", [g.scalar_like(1.0, x), r], dtype=x.dtype)], dtype=x.dtype)
    kept = g.mul(g.mul(dy, g.cast_like(mask, x)), scale)
    if is_training is None:  # decided at run time
        kept = g.op("Where", [training, kept, dy], dtype=x.dtype)
    return [kept, *rest]
