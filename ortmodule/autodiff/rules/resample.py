"""Resampling and pixel rearrangement: Resize, GridSample, DepthToSpace, SpaceToDepth.

# NOTE [resize adjoint]: Resize is linear in X and separable: along each axis ``a`` it applies a
# fixed [out_a, in_a] matrix R_a (nearest: one 1 per row; linear / cubic / antialias: the taps'
# weights), so dX = dY contracted with R_a along every resized axis. Rather than re-deriving R_a from
# the coordinate-transformation mode, nearest rounding, cubic coefficient, exclude_outside and
# antialias (each a chance to disagree with the kernel by one index), the backward *asks the same
# kernel*: it runs the node's own Resize, with its attributes and its scale or size along ``a``, on a
# probe tensor:
# * nearest: a ramp 0..in_a-1 along ``a`` (ones elsewhere) comes back as the source index of every
#   output position (exact: whole numbers copied), and R_a = one_hot(index);
# * linear / cubic: the identity [in_a, in_a] laid along ``a`` and a second axis ``c`` that the probe
#   keeps at scale 1 comes back as R_a^T (one column per input position). A scale of 1 maps every
#   position onto itself in these modes (weight exactly 1 on the position, 0 on the other taps).
# R_a is then applied as a MatMul along ``a``. So the gradient is the adjoint of what ONNX Runtime
# computed in the forward, to summation order, for every configuration it supports. The cost is a
# dense [out_a, in_a] contraction per resized axis (out_a multiply-adds per element of dY, where the
# taps need 1-4): cheap for feature maps, and an axis the graph proves unchanged (scale 1, a size
# read from X's own shape, or not in ``axes``) is skipped. ``tf_crop_and_resize`` (it reads ``roi``
# and fills outside it with ``extrapolation_value``, not linear in X alone) and the aspect-ratio
# policies other than ``stretch`` have no rule.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ...runtime.torch_nodes import Arg
from ..registry import GradBuilder, attr, attr_str, input_or_none, register, register_check
from .indexing import concat_shape, const_array, const_ints, rank_of, shape_part

_I64 = ir.DataType.INT64


def _is_shape_of(v: ir.Value, x: ir.Value, d: int, k: int) -> bool:
    """Whether element ``k`` of the 1-D int64 value ``v`` is ``shape(x)[d]`` (by construction)."""
    p = v.producer()
    if p is None or p.domain not in ("", "ai.onnx"):
        return False
    if p.op_type == "Shape" and p.inputs[0] is x:
        start = attr(p, "start", 0)
        start = start + rank_of(x) if start < 0 else start
        return start + k == d
    if p.op_type == "Slice" and len(p.inputs) >= 3:
        starts, axes, steps = const_ints(p.inputs[1]), const_ints(input_or_none(p, 3)), const_ints(input_or_none(p, 4))
        if starts is None or len(starts) != 1 or (axes not in (None, [0])) or (steps not in (None, [1])):
            return False
        start = starts[0] + rank_of(x) if starts[0] < 0 else starts[0]
        return _is_shape_of(p.inputs[0], x, d, start + k)
    if p.op_type == "Unsqueeze" and k == 0:
        g = p.inputs[0].producer()
        if g is None or g.op_type != "Gather" or const_ints(g.inputs[1]) is None:
            return False
        (idx,) = const_ints(g.inputs[1])
        return _is_shape_of(g.inputs[0], x, d, idx)
    if p.op_type == "Cast":
        return _is_shape_of(p.inputs[0], x, d, k)
    if p.op_type == "Concat":
        offset = 0
        for piece in p.inputs:
            if piece is None or piece.shape is None or piece.shape.rank() != 1 or not isinstance(piece.shape[0], int):
                return False
            n = int(piece.shape[0])
            if k < offset + n:
                return _is_shape_of(piece, x, d, k - offset)
            offset += n
    return False


@register_check("Resize")
def _resize_refusal(node: ir.Node) -> str | None:
    if attr_str(node, "coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        return ("no gradient rule for coordinate_transformation_mode 'tf_crop_and_resize' (it reads roi and "
                "extrapolates outside it)")
    if attr_str(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        return "no gradient rule for keep_aspect_ratio_policy other than 'stretch'"
    return None


class _Resize:
    """The node's resizing, axis by axis (NOTE [resize adjoint])."""

    def __init__(self, g: GradBuilder, node: ir.Node) -> None:
        self.g, self.node = g, node
        self.x = node.inputs[0]
        self.rank = rank_of(self.x)
        self.mode = attr_str(node, "mode", "nearest")
        ctm = attr_str(node, "coordinate_transformation_mode", "half_pixel")
        where = f"Resize node {node.name!r}"
        why = _resize_refusal(node)
        if why is not None:
            raise NotImplementedError(f"{where}: {why}")
        axes = attr(node, "axes")
        self.axes = [a + self.rank if a < 0 else a for a in axes] if axes is not None else list(range(self.rank))
        scales, sizes = input_or_none(node, 2), input_or_none(node, 3)
        arr = const_array(scales)
        scale_vals = None if arr is None else [float(f) for f in arr.reshape(-1)]
        if scales is not None and scale_vals == []:
            scales, scale_vals = None, None
        size_vals = const_ints(sizes)
        if sizes is not None and size_vals == []:
            sizes, size_vals = None, None
        if (scales is None) == (sizes is None):
            raise ValueError(f"{where}: needs exactly one of scales and sizes that is known to be non-empty")
        self.scales, self.scale_vals, self.sizes, self.size_vals = scales, scale_vals, sizes, size_vals
        # Where a scale of 1 maps each position onto itself (every mode but these nearest roundings)
        self.one_is_identity = not (self.mode == "nearest" and ctm == "tf_half_pixel_for_nn" and attr_str(
            node, "nearest_mode", "round_prefer_floor") in ("ceil", "round_prefer_ceil"))

    def unchanged(self, d: int) -> bool:
        """Whether the graph proves axis ``d`` untouched (so its R is the identity)."""
        if d not in self.axes:
            return True
        if not self.one_is_identity:
            return False
        k = self.axes.index(d)
        if self.scales is not None:
            return self.scale_vals is not None and self.scale_vals[k] == 1.0
        static = self.x.shape[d] if self.x.shape is not None else None
        if self.size_vals is not None and isinstance(static, int) and self.size_vals[k] == static:
            return True
        return _is_shape_of(self.sizes, self.x, d, k)

    def _pick(self, v: ir.Value, k: int) -> ir.Value:
        return self.g.op("Slice", [v, self.g.ints([k]), self.g.ints([k + 1])], dtype=v.dtype)

    def probe(self, inp: ir.Value, a: int, c: int | None, n_a) -> ir.Value:
        """The node's Resize of ``inp`` (ones on every axis but ``a`` and ``c``) with the node's scale
        or size along ``a`` and scale 1 along ``c``."""
        g, k = self.g, self.axes.index(a)
        attrs = {key: v.value for key, v in self.node.attributes.items()
                 if key not in ("axes", "keep_aspect_ratio_policy")}
        if self.scales is not None:
            if self.scale_vals is not None:
                vals = [1.0] * self.rank
                vals[a] = self.scale_vals[k]
                scales = g.const(np.asarray(vals, dtype=np.float32))
            else:
                ones = lambda n: [g.const(np.ones(n, dtype=np.float32))] if n else []  # noqa: E731
                scales = g.op("Concat", [*ones(a), self._pick(self.scales, k), *ones(self.rank - a - 1)],
                              {"axis": 0}, dtype=ir.DataType.FLOAT)
            inputs = [inp, None, scales]
        else:
            parts: list = []
            for d in range(self.rank):
                if d == a:
                    parts.append([self.size_vals[k]] if self.size_vals is not None else self._pick(self.sizes, k))
                elif d == c:
                    parts.append(n_a)
                else:
                    parts.append([1])
            sizes = concat_shape(g, parts)
            inputs = [inp, None, None, sizes]
        return g.op("Resize", inputs, attrs, dtype=inp.dtype)  # opset >= 13 (OnnxModule upgrades older files)

    def matrix(self, a: int) -> ir.Value:
        """R_a, [out_a, in_a], in X's dtype."""
        g, x, dt = self.g, self.x, self.x.dtype
        n_a = shape_part(g, x, a, a + 1)
        n_val = g.ints(n_a) if isinstance(n_a, list) else n_a
        n_scalar = g.op("Squeeze", [n_val, g.ints([0])], dtype=_I64)
        positions = g.op("Range", [g.const(0), n_scalar, g.const(1)], dtype=_I64)  # [in_a]
        if self.mode == "nearest":
            ramp_shape = concat_shape(g, [n_a if d == a else [1] for d in range(self.rank)])
            ramp = g.op("Reshape", [g.op("Cast", [positions], {"to": int(dt)}, dtype=dt), ramp_shape], dtype=dt)
            index = g.op("Cast", [g.op("Reshape", [self.probe(ramp, a, None, n_a), g.ints([-1, 1])], dtype=dt)],
                         {"to": int(_I64)}, dtype=_I64)  # [out_a, 1]
            hit = g.op("Equal", [index, g.op("Unsqueeze", [positions, g.ints([0])], dtype=_I64)],
                       dtype=ir.DataType.BOOL)
            return g.op("Cast", [hit], {"to": int(dt)}, dtype=dt)
        c = a - 1 if a > 0 else 1
        square = concat_shape(g, [n_a, n_a])
        zero = ir.tensor(np.zeros(1, dtype=dt.numpy()))
        eye = g.op("EyeLike", [g.op("ConstantOfShape", [square], {"value": zero}, dtype=dt)], dtype=dt)
        eye = g.op("Reshape", [eye, concat_shape(g, [n_a if d in (a, c) else [1] for d in range(self.rank)])],
                   dtype=dt)
        out = self.probe(eye, a, c, n_a)  # R_a^T laid along (c, a) or, for c > a, R_a along (a, c)
        flat = g.op("Reshape", [out, concat_shape(g, [n_a, [-1]] if c < a else [[-1], n_a])], dtype=dt)
        return g.op("Transpose", [flat], {"perm": [1, 0]}, dtype=dt) if c < a else flat


def _contract(g: GradBuilder, t: ir.Value, r: ir.Value, a: int, rank: int) -> ir.Value:
    """``t`` with its axis ``a`` (of size out_a) contracted with R [out_a, in_a]."""
    dt = t.dtype
    if a == rank - 1:
        return g.op("MatMul", [t, r], dtype=dt)
    if a == rank - 2:
        return g.op("MatMul", [g.op("Transpose", [r], {"perm": [1, 0]}, dtype=dt), t], dtype=dt)
    perm = [d for d in range(rank) if d != a] + [a]
    inverse = [perm.index(d) for d in range(rank)]
    moved = g.op("MatMul", [g.op("Transpose", [t], {"perm": perm}, dtype=dt), r], dtype=dt)
    return g.op("Transpose", [moved], {"perm": inverse}, dtype=dt)


@register("Resize")
def resize_grad(g: GradBuilder, node: ir.Node, dys):
    """dX = dY contracted with each resized axis' matrix, probed from the node's own kernel
    (NOTE [resize adjoint]); roi, scales and sizes get no gradient."""
    r = _Resize(g, node)
    dx = dys[0]
    for a in reversed(range(r.rank)):  # last axes first: plain MatMuls for [.., H, W]
        if not r.unchanged(a):
            dx = _contract(g, dx, r.matrix(a), a, r.rank)
    dx.shape = r.x.shape
    return [dx] + [None] * (len(node.inputs) - 1)


@register("DepthToSpace")
def depth_to_space_grad(g: GradBuilder, node: ir.Node, dys):
    """The inverse rearrangement of dY: SpaceToDepth for mode DCR; for CRD, dY split as
    [N, C, H, b, W, b] and put back as [N, C, b, b, H, W]."""
    (x,) = node.inputs
    b = int(attr(node, "blocksize"))
    dy = dys[0]
    if attr_str(node, "mode", "DCR") == "DCR":
        return [g.op("SpaceToDepth", [dy], {"blocksize": b}, dtype=x.dtype, shape=x.shape)]
    # CRD: X[n, c*b*b + i*b + j, h, w] = Y[n, c, h*b + i, w*b + j]
    n, c_out = shape_part(g, dy, 0, 1), shape_part(g, dy, 1, 2)
    h, w = shape_part(g, x, 2, 3), shape_part(g, x, 3, 4)
    split = g.op("Reshape", [dy, concat_shape(g, [n, c_out, h, [b], w, [b]])], dtype=dy.dtype)
    moved = g.op("Transpose", [split], {"perm": [0, 1, 3, 5, 2, 4]}, dtype=dy.dtype)
    return [g.reshape_like(moved, x)]


@register("SpaceToDepth")
def space_to_depth_grad(g: GradBuilder, node: ir.Node, dys):
    """SpaceToDepth is the inverse of DepthToSpace in DCR mode, so its gradient is that."""
    (x,) = node.inputs
    b = int(attr(node, "blocksize"))
    return [g.op("DepthToSpace", [dys[0]], {"blocksize": b, "mode": "DCR"}, dtype=x.dtype, shape=x.shape)]


# -- GridSample -------------------------------------------------------------------------------------
# NOTE [grid sample as torch]: ONNX GridSample was specified after torch's grid_sample, and
# onnxruntime's kernel computes what torch's does (measured: every mode, padding and align_corners
# within 1.5e-6 on random grids, and the same pixels at exact half positions, both rounding half to
# even). So its gradient is torch's own kernel, ``aten::grid_sampler_{2,3}d_backward``: dX and dGrid.
_GRID_MODES = {"bilinear": 0, "linear": 0, "nearest": 1, "bicubic": 2, "cubic": 2}
_GRID_PADDING = {"zeros": 0, "border": 1, "reflection": 2}


@register_check("GridSample")
def _grid_sample_refusal(node: ir.Node) -> str | None:
    mode = attr_str(node, "mode", "linear")  # opset 16 says "bilinear", 20 "linear": the same
    if mode not in _GRID_MODES:
        return f"no gradient rule for mode {mode!r}"
    x = node.inputs[0]
    rank = x.shape.rank() if x.shape is not None else None
    if rank not in (4, 5):
        return "no gradient rule for a GridSample of unknown rank or other than 4-d / 5-d"
    if rank == 5 and _GRID_MODES[mode] == 2:
        return "no gradient rule for a 5-d cubic GridSample (torch's 3-d sampler has none)"
    return None


@register("GridSample")
def grid_sample_grad(g: GradBuilder, node: ir.Node, dys):
    """dX and dGrid by torch's grid sampler backward (NOTE [grid sample as torch])."""
    why = _grid_sample_refusal(node)
    if why is not None:
        raise NotImplementedError(f"GridSample node {node.name!r}: {why}")
    x, grid = node.inputs
    mode = _GRID_MODES[attr_str(node, "mode", "linear")]
    padding = _GRID_PADDING[attr_str(node, "padding_mode", "zeros")]
    align = bool(attr(node, "align_corners", 0))
    op = "aten::grid_sampler_2d_backward" if x.shape.rank() == 4 else "aten::grid_sampler_3d_backward"
    dx, dgrid = g.aten(op, [dys[0], x, grid], [Arg(0), Arg(1), Arg(2), mode, padding, align, [True, True]], [0, 1])
    dx.dtype, dx.shape = x.dtype, x.shape
    dgrid.dtype, dgrid.shape = grid.dtype, grid.shape
    return [dx, dgrid]


@register("AffineGrid")
def affine_grid_grad(g: GradBuilder, node: ir.Node, dys):
    """AffineGrid is linear in theta: grid[n, ..., i] = sum_j theta[n, i, j] B[..., j], with B the base
    grid of homogeneous coordinates. B is probed from the node's own op (each basis row of theta, as in
    NOTE [resize adjoint]), then dtheta[n] = dgrid[n]^T B."""
    theta, size = node.inputs
    dt = theta.dtype
    if theta.shape is None or not isinstance(theta.shape[1], int) or not isinstance(theta.shape[2], int):
        raise ValueError(f"AffineGrid node {node.name!r}: its gradient needs theta's static [N, r, r + 1] shape")
    r, k = int(theta.shape[1]), int(theta.shape[2])  # 2-d: 2, 3; 3-d: 3, 4
    basis = np.zeros((k, r, k), dtype=dt.numpy())
    basis[np.arange(k), 0, np.arange(k)] = 1  # theta_j: row 0 = e_j, so grid[j, ..., 0] = B[..., j]
    probe_size = g.op("Concat", [g.ints([k]), g.op("Slice", [size, g.ints([1]), g.ints([2 + r])], dtype=_I64)],
                      {"axis": 0}, dtype=_I64)
    probe = g.op("AffineGrid", [g.const(basis, dt), probe_size], {"align_corners": attr(node, "align_corners", 0)},
                 dtype=dt)  # [k, *spatial, r]
    base = g.op("Reshape", [g.op("Gather", [probe, g.ints([0])], {"axis": -1}, dtype=dt), g.ints([k, -1])],
                dtype=dt)  # [k, prod(spatial)]
    base = g.op("Cast", [base], {"to": int(dt)}, dtype=dt)  # (onnx's reference AffineGrid returns float32)
    dgrid = g.op("Reshape", [dys[0], g.op("Concat", [g.op("Slice", [g.shape_of(theta), g.ints([0]), g.ints([1])],
                                                                dtype=_I64), g.ints([-1, r])], {"axis": 0},
                                                  dtype=_I64)], dtype=dt)  # [N, HW, r]
    dtheta = g.op("MatMul", [g.op("Transpose", [dgrid], {"perm": [0, 2, 1]}, dtype=dt),
                             g.op("Transpose", [base], {"perm": [1, 0]}, dtype=dt)], dtype=dt, shape=theta.shape)
    return [dtheta, None]
