"""Pooling: MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ...runtime.torch_nodes import Arg
from ..registry import GradBuilder, attr, attr_str, register, static_shape
from .aten import aten_kernels
from .conv import WindowGeometry, window_adjoint, window_geometry
from .indexing import scatter_elements_add


def _zeros_flat(g: GradBuilder, x: ir.Value) -> ir.Value:
    """A 1-D zero tensor with as many elements as ``x``."""
    static = static_shape(x)
    n = g.ints([int(np.prod(static))]) if static is not None else g.op(
        "Reshape", [g.op("Size", [x], dtype=ir.DataType.INT64), g.ints([1])], dtype=ir.DataType.INT64
    )
    zero = ir.tensor(np.zeros(1, dtype=x.dtype.numpy()))
    return g.op("ConstantOfShape", [n], {"value": zero}, dtype=x.dtype)


def _max_pool_grad_aten(g: GradBuilder, node: ir.Node, dy: ir.Value) -> ir.Value | None:
    """NOTE [ATen kernels]: a 2-d max pool's dX by torch's kernel (``ortmodule::max_pool2d_backward``),
    its arg-max recomputed on a channels-last copy; ``None`` where torch's pooling cannot express the
    node (asymmetric pads, ``auto_pad``, 1-d/3-d, a pad over half the kernel)."""
    if "MaxPool" not in aten_kernels():
        return None
    (x,) = node.inputs
    kernel = list(attr(node, "kernel_shape"))
    if len(kernel) != 2 or attr_str(node, "auto_pad", "NOTSET") != "NOTSET":
        return None
    pads = list(attr(node, "pads", None) or [0] * 4)
    if pads[:2] != pads[2:] or any(2 * p > k for p, k in zip(pads[:2], kernel)):
        return None
    strides = list(attr(node, "strides", None) or [1, 1])
    dilations = list(attr(node, "dilations", None) or [1, 1])
    ceil = bool(attr(node, "ceil_mode", 0))
    (dx,) = g.aten("ortmodule::max_pool2d_backward", [dy, x],
                   [Arg(0), Arg(1), kernel, strides, pads[:2], dilations, ceil], [0])
    return dx


@register("MaxPool")
def max_pool_grad(g: GradBuilder, node: ir.Node, dys):
    """Route dY to the arg-max of each window (the first one on ties, as torch); overlapping windows add up.

    # NOTE [maxpool indices]: the forward may not output Indices (or may use storage_order=1), so
    # the backward re-runs MaxPool on the saved input with an Indices output and storage_order=0:
    # indices are then flat offsets into the whole NCHW tensor, and dX is a 1-D ScatterElements
    # with reduction='add' (a value that is the max of several overlapping windows collects each
    # window's gradient), reshaped back to X.
    """
    (x,) = node.inputs
    dy = dys[0]
    fused = _max_pool_grad_aten(g, node, dy)
    if fused is not None:
        return [fused]
    indices = None
    if len(node.outputs) > 1 and node.outputs[1].name and int(attr(node, "storage_order", 0)) == 0:
        indices = node.outputs[1]
    if indices is None:
        attrs = {k: a.value for k, a in node.attributes.items() if k != "storage_order"}
        _, indices = g.op_multi("MaxPool", [x], attrs, num_outputs=2)
        indices.dtype = ir.DataType.INT64
    kernel = list(attr(node, "kernel_shape"))
    strides = list(attr(node, "strides", None) or [1] * len(kernel))
    dilations = list(attr(node, "dilations", None) or [1] * len(kernel))
    plain = attr(node, "auto_pad", "NOTSET") in ("NOTSET", "VALID") and not attr(node, "ceil_mode", 0)
    if plain and all(k <= s for k, s in zip(kernel, strides)) and all(d == 1 for d in dilations):
        # NOTE [maxpool unpool]: windows that do not overlap never share an arg-max, so dX is the
        # plain placement MaxUnpool does (an output_shape input makes its size exact); measured on the
        # CNN's pools: 3.0 vs 4.5 ms and 1.6 vs 2.4 ms against the ScatterElements below.
        unpool_attrs = {"kernel_shape": kernel, "strides": strides}
        if attr(node, "pads", None) is not None:
            unpool_attrs["pads"] = list(attr(node, "pads"))
        shape = g.op("Shape", [x], dtype=ir.DataType.INT64)
        return [g.op("MaxUnpool", [dy, indices, shape], unpool_attrs, dtype=x.dtype, shape=x.shape)]
    flat_idx = g.op("Reshape", [indices, g.ints([-1])], dtype=ir.DataType.INT64)
    flat_dy = g.op("Reshape", [dy, g.ints([-1])], dtype=dy.dtype)
    dx = scatter_elements_add(g, _zeros_flat(g, x), flat_idx, flat_dy, 0)
    return [g.reshape_like(dx, x)]


def _valid_counts(geo: WindowGeometry) -> np.ndarray:
    """Per output position, how many window taps fall inside the (unpadded) input."""
    per_dim = []
    for i in range(geo.rank):
        o = np.arange(geo.out_size[i])[:, None]
        pos = o * geo.strides[i] - geo.pads_begin[i] + np.arange(geo.kernel[i])[None, :] * geo.dilations[i]
        per_dim.append(((pos >= 0) & (pos < geo.in_size[i])).sum(axis=1))
    counts = per_dim[0]
    for c in per_dim[1:]:
        counts = np.multiply.outer(counts, c)
    return counts


@register("AveragePool")
def average_pool_grad(g: GradBuilder, node: ir.Node, dys):
    """dX = ConvTranspose(dY / divisor, ones) per channel.

    # NOTE [avgpool divisor]: the divisor of each window depends on count_include_pad, ceil_mode
    # and the runtime's reading of them at the edges. Rather than re-deriving it, the backward runs
    # the same AveragePool on ones: that yields ``valid_taps / divisor`` per window, and the number of
    # valid taps is known at build time, so ``1 / divisor = AveragePool(ones) / valid_taps``.
    """
    (x,), (y,) = node.inputs, node.outputs
    dy = dys[0]
    geo = window_geometry(node, x, list(attr(node, "kernel_shape")), y)
    dt = x.dtype
    one = ir.tensor(np.ones(1, dtype=dt.numpy()))
    ones = g.op("ConstantOfShape", [g.ints([1, 1, *geo.in_size])], {"value": one}, dtype=dt)
    attrs = {k: a.value for k, a in node.attributes.items()}
    avg_ones = g.op("AveragePool", [ones], attrs, dtype=dt)  # [1, 1, O...]
    counts = np.maximum(_valid_counts(geo), 1).astype(dt.numpy())
    inv_div = g.op("Div", [avg_ones, g.const(counts.reshape(1, 1, *counts.shape), dt)], dtype=dt)
    scaled = g.mul(dy, inv_div)
    per_channel = g.op("Reshape", [scaled, g.ints([-1, 1, *geo.out_size])], dtype=dt)
    kernel = g.const(np.ones((1, 1, *geo.kernel)), dt)
    dx = window_adjoint(g, per_channel, kernel, geo, group=1)
    return [g.reshape_like(dx, x)]


@register("GlobalAveragePool")
def global_average_pool_grad(g: GradBuilder, node: ir.Node, dys):
    (x,), (y,) = node.inputs, node.outputs
    dy = dys[0]
    dims = list(x.shape)[2:] if x.shape is not None else None
    if dims is not None and all(isinstance(d, int) for d in dims):
        inv = g.scalar_like(1.0 / float(np.prod(dims)), x)
    else:
        size = lambda v: g.op("Cast", [g.op("Size", [v])], {"to": int(x.dtype)}, dtype=x.dtype)
        inv = g.op("Div", [size(y), size(x)], dtype=x.dtype)
    return [g.expand_like(g.mul(dy, inv), x)]


@register("GlobalMaxPool")
def global_max_pool_grad(g: GradBuilder, node: ir.Node, dys):
    """dY goes to the first arg-max of each (n, c) plane, as torch's max pooling does."""
    (x,) = node.inputs
    dy = dys[0]
    planes = g.op("Reshape", [x, g.ints([0, 0, -1])], dtype=x.dtype)  # [N, C, S]
    idx = g.op("ArgMax", [planes], {"axis": 2, "keepdims": 1}, dtype=ir.DataType.INT64)  # [N, C, 1]
    zero = ir.tensor(np.zeros(1, dtype=x.dtype.numpy()))
    zeros = g.op("ConstantOfShape", [g.op("Shape", [planes], dtype=ir.DataType.INT64)], {"value": zero},
                 dtype=x.dtype)
    dy3 = g.op("Reshape", [dy, g.ints([0, 0, 1])], dtype=dy.dtype)
    dx = g.op("ScatterElements", [zeros, idx, dy3], {"axis": 2}, dtype=x.dtype)
    return [g.reshape_like(dx, x)]
