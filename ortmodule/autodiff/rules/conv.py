"""Convolutions and padding: Conv, ConvTranspose, Pad.

Also the geometry helpers the pooling rules (``pool.py``) share: resolving ``auto_pad`` and the
"adjoint of a strided window op" as a ConvTranspose whose output has exactly the input's size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from ...runtime.torch_nodes import Arg
from ..registry import GradBuilder, attr, attr_str, input_or_none, register
from .aten import aten_kernels


@dataclasses.dataclass(frozen=True)
class WindowGeometry:
    """Per spatial dim: kernel size, stride, dilation, begin/end pads, input and output sizes."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    in_size: tuple[int, ...]
    out_size: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.kernel)


def spatial_dims(x: ir.Value, what: str, op_type: str) -> list[int]:
    """The static spatial sizes of an ``[N, C, D1, ...]`` value (the batch dim may be symbolic)."""
    if x.shape is None:
        raise ValueError(f"{op_type} gradient needs the shape of its {what} (run shape inference first)")
    dims = list(x.shape)[2:]
    if not all(isinstance(d, int) for d in dims):
        raise ValueError(
            f"{op_type} gradient needs static spatial dims of its {what}, got {x.shape}; "
            "export with fixed image sizes (only the batch dim may be dynamic)"
        )
    return [int(d) for d in dims]


def window_geometry(node: ir.Node, x: ir.Value, kernel: Sequence[int], y: ir.Value) -> WindowGeometry:
    """Resolve strides/dilations/pads (``auto_pad`` included) of a Conv or pooling node.

    The output sizes come from ``y``'s static shape where known (so ceil_mode is honoured), else from
    the floor formula.
    """
    in_size = spatial_dims(x, "input", node.op_type)
    r = len(in_size)
    strides = list(attr(node, "strides", None) or [1] * r)
    dilations = list(attr(node, "dilations", None) or [1] * r)
    auto_pad = attr_str(node, "auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for i in range(r):
            out = -(-in_size[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_size[i])
            small, big = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else big)
            end.append(big if auto_pad == "SAME_UPPER" else small)
    elif auto_pad == "VALID":
        begin, end = [0] * r, [0] * r
    else:
        pads = list(attr(node, "pads", None) or [0] * (2 * r))
        begin, end = pads[:r], pads[r:]
    out_size: list[int] = []
    y_dims = list(y.shape)[2:] if y.shape is not None else [None] * r
    for i in range(r):
        if isinstance(y_dims[i], int):
            out_size.append(int(y_dims[i]))
        else:
            span = in_size[i] + begin[i] + end[i] - (kernel[i] - 1) * dilations[i] - 1
            out_size.append(span // strides[i] + 1)
    return WindowGeometry(
        tuple(kernel), tuple(strides), tuple(dilations), tuple(begin), tuple(end), tuple(in_size),
        tuple(out_size),
    )


def window_adjoint(g: GradBuilder, dy: ir.Value, w: ir.Value, geo: WindowGeometry, group: int) -> ir.Value:
    """The adjoint of a strided window op (Conv with weight ``w``) applied to ``dy``, as a ConvTranspose.

    # NOTE [exact adjoint size]: ConvTranspose produces ``s (O-1) + op + (k-1) d + 1 - pb - pe``
    # elements per dim. The forward's input size D is recovered exactly by keeping ``pb`` and
    # choosing (pe', op) with ``pe' - op = s (O-1) + (k-1) d + 1 - pb - D``: a positive value crops
    # the end (positions the forward never read past D, e.g. ceil_mode windows), a negative one
    # appends ``op < s`` rows the forward's floor division skipped (their gradient is zero).
    """
    pads_end, out_pad = [], []
    for i in range(geo.rank):
        r = geo.strides[i] * (geo.out_size[i] - 1) + (geo.kernel[i] - 1) * geo.dilations[i] + 1
        r -= geo.pads_begin[i] + geo.in_size[i]
        pads_end.append(max(r, 0))
        out_pad.append(max(-r, 0))
    attrs: dict = {
        "strides": list(geo.strides),
        "dilations": list(geo.dilations),
        "pads": list(geo.pads_begin) + pads_end,
        "kernel_shape": list(geo.kernel),
    }
    if any(out_pad):
        attrs["output_padding"] = out_pad
    if group != 1:
        attrs["group"] = group
    return g.op("ConvTranspose", [dy, w], attrs, dtype=dy.dtype)


def _weight_grad(
    g: GradBuilder, x: ir.Value, dy: ir.Value, geo: WindowGeometry, group: int, c_in: int, c_out: int
) -> ir.Value:
    """d W of ``Y = Conv(X, W)``: ``dW[m, c, k] = sum_{n, o} dY[n, m, o] X[n, c, o s + k d - pb]``.

    # NOTE [weight grad as a conv]: with the batch moved into the channel axis this is itself a
    # Conv: input X^T ``[C/g, g*N, D]``, weight dY^T ``[M, N, O]``, ``group=g``, and the roles of
    # stride and dilation swapped. Its output ``[C/g, M, k]`` is transposed back to ``[M, C/g, k]``.
    """
    r = geo.rank
    spatial = list(range(2, 2 + r))
    dtype = x.dtype
    fast = _weight_grad_im2col(g, x, dy, geo, group, c_in, c_out)
    if fast is not None:
        return fast
    if group == 1:
        xt = g.op("Transpose", [x], {"perm": [1, 0, *spatial]}, dtype=dtype)
        dyt = g.op("Transpose", [dy], {"perm": [1, 0, *spatial]}, dtype=dtype)
    else:
        cg, mg = c_in // group, c_out // group
        d_in, d_out = list(geo.in_size), list(geo.out_size)
        spatial3 = [3 + i for i in range(r)]
        x5 = g.op("Reshape", [x, g.ints([0, group, cg, *d_in])], dtype=dtype)
        x5 = g.op("Transpose", [x5], {"perm": [2, 1, 0, *spatial3]}, dtype=dtype)  # [Cg, g, N, D]
        xt = g.op("Reshape", [x5, g.ints([cg, -1, *d_in])], dtype=dtype)
        dy5 = g.op("Reshape", [dy, g.ints([0, group, mg, *d_out])], dtype=dtype)
        dy5 = g.op("Transpose", [dy5], {"perm": [1, 2, 0, *spatial3]}, dtype=dtype)  # [g, Mg, N, O]
        dyt = g.op("Reshape", [dy5, g.ints([c_out, -1, *d_out])], dtype=dtype)
    pads_end, crop = [], False
    for i in range(r):
        # With the forward's pads this conv yields floor(span / d) + 1 >= k outputs; trim the end pad
        # to get exactly k, and crop what a too-small end pad leaves over.
        padded = geo.in_size[i] + geo.pads_begin[i] + geo.pads_end[i]
        span = padded - (geo.out_size[i] - 1) * geo.strides[i] - 1
        trim = min(span - (geo.kernel[i] - 1) * geo.dilations[i], geo.pads_end[i])
        pads_end.append(geo.pads_end[i] - trim)
        crop = crop or (span - trim) // geo.dilations[i] + 1 != geo.kernel[i]
    attrs: dict = {
        "strides": list(geo.dilations),
        "dilations": list(geo.strides),
        "pads": list(geo.pads_begin) + pads_end,
        "kernel_shape": list(geo.out_size),
    }
    if group != 1:
        attrs["group"] = group
    dw = g.op("Conv", [xt, dyt], attrs, dtype=dtype)  # [Cg, M, k + extra]
    if crop:
        dw = g.op("Slice", [dw, g.ints([0] * r), g.ints(list(geo.kernel)), g.ints(spatial)], dtype=dtype)
    return g.op("Transpose", [dw], {"perm": [1, 0, *spatial]}, dtype=dtype)


def _weight_grad_im2col(
    g: GradBuilder, x: ir.Value, dy: ir.Value, geo: WindowGeometry, group: int, c_in: int, c_out: int
) -> ir.Value | None:
    """dW of a 2-D, ungrouped, stride-1, undilated Conv as one GEMM over explicit columns, or None.

    # NOTE [wgrad im2col]: the Conv formulation above runs as many skinny GEMMs in onnxruntime (a
    # "kernel" the size of the image); here X^T [C, N, H, W] is padded, each of the kh*kw shifted
    # windows is a Slice, and they are stacked C-major to columns [C*kh*kw, N*Ho*Wo] without a
    # transpose of the big tensor, so dW = dY^T[M, N*Ho*Wo] @ cols^T. Measured for 32->64 channels,
    # 16x16, batch 32: 8.9 ms against 15.0 ms (torch/oneDNN: 6 ms).
    """
    if group != 1 or geo.rank != 2 or any(s != 1 for s in geo.strides) or any(d != 1 for d in geo.dilations):
        return None
    kh, kw = geo.kernel
    ho, wo = geo.out_size
    if kh * kw > 25:
        return None
    dtype = x.dtype
    xt = g.op("Transpose", [x], {"perm": [1, 0, 2, 3]}, dtype=dtype)  # [C, N, H, W]
    pads = [0, 0, geo.pads_begin[0], geo.pads_begin[1], 0, 0, geo.pads_end[0], geo.pads_end[1]]
    if any(pads):
        xt = g.op("Pad", [xt, g.ints(pads)], dtype=dtype)
    windows = []
    for i in range(kh):
        for j in range(kw):
            win = g.op("Slice", [xt, g.ints([i, j]), g.ints([i + ho, j + wo]), g.ints([2, 3])], dtype=dtype)
            windows.append(g.op("Unsqueeze", [win, g.ints([1])], dtype=dtype))
    cols = windows[0] if len(windows) == 1 else g.op("Concat", windows, {"axis": 1}, dtype=dtype)
    cols = g.op("Reshape", [cols, g.ints([c_in * kh * kw, -1])], dtype=dtype)  # [C*kh*kw, N*Ho*Wo]
    dyt = g.op("Transpose", [dy], {"perm": [1, 0, 2, 3]}, dtype=dtype)
    dyt = g.op("Reshape", [dyt, g.ints([c_out, -1])], dtype=dtype)  # [M, N*Ho*Wo]
    dw = g.op("Gemm", [dyt, cols], {"transB": 1}, dtype=dtype)  # [M, C*kh*kw]
    return g.op("Reshape", [dw, g.ints([c_out, c_in, kh, kw])], dtype=dtype)


def _static_dim(v: ir.Value, axis: int, what: str, op_type: str) -> int:
    if v.shape is None or not isinstance(v.shape[axis], int):
        raise ValueError(f"{op_type} gradient needs a static dim {axis} of its {what} (got {v.shape})")
    return int(v.shape[axis])


def _kernel(node: ir.Node, w: ir.Value) -> list[int]:
    k = attr(node, "kernel_shape")
    if k is not None:
        return list(k)
    if w.shape is None or not all(isinstance(d, int) for d in list(w.shape)[2:]):
        raise ValueError(f"{node.op_type} gradient needs kernel_shape or a static weight shape")
    return [int(d) for d in list(w.shape)[2:]]


def _bias_grad(g: GradBuilder, dy: ir.Value, rank: int) -> ir.Value:
    return g.reduce_sum(dy, [0, *range(2, rank + 2)], keepdims=False)


def _conv_grad_aten(g: GradBuilder, node: ir.Node, dys) -> list | None:
    """NOTE [ATen kernels]: the input and weight gradients in one ``aten::convolution_backward`` call
    (oneDNN), the bias gradient a ReduceSum in ORT. ``None`` where torch's symmetric padding cannot
    express the node (asymmetric pads, ``auto_pad``): the ONNX rule below serves it."""
    if "Conv" not in aten_kernels():
        return None
    x, w = node.inputs[0], node.inputs[1]
    b = input_or_none(node, 2)
    if attr_str(node, "auto_pad", "NOTSET") != "NOTSET":
        return None
    try:
        rank = len(_kernel(node, w))
    except ValueError:
        return None
    pads = list(attr(node, "pads", [0] * 2 * rank))
    if pads[:rank] != pads[rank:]:
        return None
    strides = list(attr(node, "strides", [1] * rank))
    dilations = list(attr(node, "dilations", [1] * rank))
    group = int(attr(node, "group", 1))
    need_x, need_w = x in g.active, w in g.active
    grads: list[ir.Value | None] = [None, None] + ([None] if b is not None else [])
    picks = [i for i, need in ((0, need_x), (1, need_w)) if need]
    if picks:
        args = [Arg(0), Arg(1), Arg(2), None, strides, pads[:rank], dilations, False, [0] * rank, group,
                [need_x, need_w, False]]
        # NOTE [grouped conv backward]: torch's grouped (depthwise) convolution backward is 2-3x
        # faster on channels-last tensors, the copies included; a dense one is level (see the kernel)
        kernel = "ortmodule::conv2d_backward_channels_last" if group > 1 and rank == 2 else \
            "aten::convolution_backward.default"
        outs = g.aten(kernel, [dys[0], x, w], args, picks)
        for i, out in zip(picks, outs):
            grads[i] = out
    if b is not None and b in g.active:
        grads[2] = _bias_grad(g, dys[0], rank)
    return grads


@register("Conv")
def conv_grad(g: GradBuilder, node: ir.Node, dys):
    fused = _conv_grad_aten(g, node, dys)
    if fused is not None:
        return fused
    x, w = node.inputs[0], node.inputs[1]
    b = input_or_none(node, 2)
    (y,), dy = node.outputs, dys[0]
    group = int(attr(node, "group", 1))
    geo = window_geometry(node, x, _kernel(node, w), y)
    c_in = _static_dim(x, 1, "input", "Conv")
    c_out = _static_dim(w, 0, "weight", "Conv")
    # ConvTranspose's weight layout [C_in, C_out/group, k] is exactly Conv's [M, C/group, k].
    dx = window_adjoint(g, dy, w, geo, group)
    dw = _weight_grad(g, x, dy, geo, group, c_in, c_out)
    grads: list[ir.Value | None] = [dx, dw]
    if b is not None:
        grads.append(_bias_grad(g, dy, geo.rank))
    return grads


def _conv_transpose_geometry(node: ir.Node, x: ir.Value, w: ir.Value, y: ir.Value) -> WindowGeometry:
    """ConvTranspose(X) is the adjoint of a Conv from Y's size to X's: return that Conv's geometry."""
    kernel = _kernel(node, w)
    d_in = spatial_dims(x, "input", "ConvTranspose")
    d_out = spatial_dims(y, "output", "ConvTranspose")
    r = len(d_in)
    strides = list(attr(node, "strides", None) or [1] * r)
    dilations = list(attr(node, "dilations", None) or [1] * r)
    out_pad = list(attr(node, "output_padding", None) or [0] * r)
    auto_pad = attr_str(node, "auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", "VALID") and attr(node, "output_shape") is None:
        pads = [0] * (2 * r) if auto_pad == "VALID" else list(attr(node, "pads", None) or [0] * (2 * r))
        begin, end = pads[:r], pads[r:]
    else:
        # Pads derived from output_shape / SAME_*: recover the total from the sizes. Only the split
        # between begin and end is convention-dependent; refuse rather than guess when it matters.
        totals = [strides[i] * (d_in[i] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1 - d_out[i]
                  for i in range(r)]
        if any(t != 0 for t in totals):
            raise NotImplementedError(
                f"ConvTranspose gradient: auto_pad={auto_pad!r} / output_shape with nonzero implied pads "
                f"{totals} is not supported; export with explicit pads"
            )
        begin, end = [0] * r, [0] * r
    for i in range(r):
        if out_pad[i] >= strides[i]:
            raise NotImplementedError(
                f"ConvTranspose gradient: output_padding {out_pad} must be smaller than strides {strides}"
            )
    return WindowGeometry(
        tuple(kernel), tuple(strides), tuple(dilations), tuple(begin), tuple(end), tuple(d_out), tuple(d_in)
    )


@register("ConvTranspose")
def conv_transpose_grad(g: GradBuilder, node: ir.Node, dys):
    x, w = node.inputs[0], node.inputs[1]
    b = input_or_none(node, 2)
    (y,), dy = node.outputs, dys[0]
    group = int(attr(node, "group", 1))
    geo = _conv_transpose_geometry(node, x, w, y)
    c_in = _static_dim(x, 1, "input", "ConvTranspose")  # the adjoint Conv's output channels
    c_out = _static_dim(y, 1, "output", "ConvTranspose")  # and its input channels
    attrs: dict = {
        "strides": list(geo.strides),
        "dilations": list(geo.dilations),
        "pads": list(geo.pads_begin) + list(geo.pads_end),
        "kernel_shape": list(geo.kernel),
    }
    if group != 1:
        attrs["group"] = group
    # Y = Conv_W^T X, so dX = Conv_W dY; W [C, M/g, k] is that Conv's weight as it stands.
    dx = g.op("Conv", [dy, w], attrs, dtype=x.dtype)
    # dW[c, m, k] = sum X[n, c, i] dY[n, m, i s + k d - pb]: the Conv weight grad with X as "dY".
    dw = _weight_grad(g, dy, x, geo, group, c_out, c_in)
    grads: list[ir.Value | None] = [dx, dw]
    if b is not None:
        grads.append(_bias_grad(g, dy, geo.rank))
    return grads


# -- Pad --------------------------------------------------------------------------------------------


def const_ints(v: ir.Value | None, what: str, op_type: str) -> list[int] | None:
    """The values of a constant int tensor (initializer or Constant), ``None`` if ``v`` is omitted."""
    if v is None:
        return None
    t = ir.convenience.get_const_tensor(v)
    if t is None:
        raise ValueError(f"{op_type} gradient needs a constant '{what}' input (it is computed at run time)")
    return [int(i) for i in np.asarray(t.numpy()).reshape(-1)]


def _slice_axis(g: GradBuilder, v: ir.Value, axis: int, start: int, end: int, step: int = 1) -> ir.Value:
    return g.op("Slice", [v, g.ints([start]), g.ints([end]), g.ints([axis]), g.ints([step])], dtype=v.dtype)


def _pad_axis(g: GradBuilder, v: ir.Value, axis: int, before: int, after: int) -> ir.Value:
    return g.op("Pad", [v, g.ints([before, after]), None, g.ints([axis])], dtype=v.dtype)


def _unpad_axis(g: GradBuilder, dy: ir.Value, axis: int, size: int, pb: int, pe: int, mode: str) -> ir.Value:
    """Adjoint of padding one axis of length ``size`` by (pb, pe) in a non-constant ``mode``."""
    out = _slice_axis(g, dy, axis, pb, pb + size)
    if mode == "edge":
        # Y[j] = X[0] for j < pb; Y[pb + size + j] = X[size - 1].
        if pb:
            left = g.reduce_sum(_slice_axis(g, dy, axis, 0, pb), [axis], keepdims=True)
            out = g.add(out, _pad_axis(g, left, axis, 0, size - 1))
        if pe:
            right = g.reduce_sum(_slice_axis(g, dy, axis, pb + size, pb + size + pe), [axis], keepdims=True)
            out = g.add(out, _pad_axis(g, right, axis, size - 1, 0))
    elif mode == "reflect":
        # Y[j] = X[pb - j] for j < pb (so X[1..pb] reversed); Y[pb + size + j] = X[size - 2 - j].
        if pb:
            left = _slice_axis(g, dy, axis, pb - 1, -(2**62), -1)  # dY[pb-1 .. 0] -> X[1 .. pb]
            out = g.add(out, _pad_axis(g, left, axis, 1, size - 1 - pb))
        if pe:
            # dY[pb+size+pe-1 .. pb+size] -> X[size-1-pe .. size-2]
            right = _slice_axis(g, dy, axis, pb + size + pe - 1, pb + size - 1, -1)
            out = g.add(out, _pad_axis(g, right, axis, size - 1 - pe, 1))
    elif mode == "wrap":
        # Y[j] = X[size - pb + j] for j < pb; Y[pb + size + j] = X[j].
        if pb:
            out = g.add(out, _pad_axis(g, _slice_axis(g, dy, axis, 0, pb), axis, size - pb, 0))
        if pe:
            right = _slice_axis(g, dy, axis, pb + size, pb + size + pe)
            out = g.add(out, _pad_axis(g, right, axis, 0, size - pe))
    return out


@register("Pad")
def pad_grad(g: GradBuilder, node: ir.Node, dys):
    x = node.inputs[0]
    dy = dys[0]
    mode = attr(node, "mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
    rank = x.shape.rank() if x.shape is not None else None
    if rank is None:
        raise ValueError("Pad gradient needs the rank of its input (run shape inference first)")
    pads = const_ints(node.inputs[1], "pads", "Pad")
    axes = const_ints(input_or_none(node, 3), "axes", "Pad")
    axes = [a % rank for a in axes] if axes is not None else list(range(rank))
    n = len(axes)
    if len(pads) != 2 * n:
        raise ValueError(f"Pad has {len(pads)} pads for {n} axes")
    begin, end = dict(zip(axes, pads[:n], strict=True)), dict(zip(axes, pads[n:], strict=True))
    grads: list[ir.Value | None] = [None] * len(node.inputs)
    if mode == "constant":
        # Crop what was padded (Slice), zero-fill what was cropped by negative pads (Pad).
        big = 2**62
        starts = [max(begin[a], 0) for a in axes]
        ends = [-end[a] if end[a] > 0 else big for a in axes]
        inner = g.op("Slice", [dy, g.ints(starts), g.ints(ends), g.ints(axes)], dtype=dy.dtype)
        refill = [max(-begin[a], 0) for a in axes] + [max(-end[a], 0) for a in axes]
        dx = inner
        if any(refill):
            dx = g.op("Pad", [inner, g.ints(refill), None, g.ints(axes)], dtype=dy.dtype)
        grads[0] = dx
        cv = input_or_none(node, 2)
        if cv is not None and cv.dtype is not None and cv.dtype.is_floating_point():
            # Every padded element is the constant: d c = sum(dY) - sum(dY over the copied region).
            total = g.op("ReduceSum", [dy], {"keepdims": 0}, dtype=dy.dtype)
            kept = g.op("ReduceSum", [inner], {"keepdims": 0}, dtype=dy.dtype)
            grads[2] = g.reshape_like(g.op("Sub", [total, kept], dtype=dy.dtype), cv)
        return grads
    if mode not in ("reflect", "edge", "wrap"):
        raise NotImplementedError(f"Pad gradient: unknown mode {mode!r}")
    sizes = x.shape
    dx = dy
    for a in axes:
        pb, pe = begin[a], end[a]
        if pb == 0 and pe == 0:
            continue
        if not isinstance(sizes[a], int):
            raise NotImplementedError(f"Pad gradient in mode {mode!r} needs a static size of padded axis {a}")
        size = int(sizes[a])
        limit = size - 1 if mode == "reflect" else size
        if pb < 0 or pe < 0 or pb > limit or pe > limit:
            raise NotImplementedError(
                f"Pad gradient in mode {mode!r}: pads ({pb}, {pe}) on axis {a} of size {size} are not "
                f"supported (need 0 <= pad <= {limit})"
            )
        dx = _unpad_axis(g, dx, a, size, pb, pe, mode)
    grads[0] = dx
    return grads
