"""Indexing and data-movement ops: Gather*, Scatter*, Where, Tile, Slice, Concat, Split, TopK, Trilu.

Gradients that move values back to where they came from are scatters into zeros of the input's shape.
Ops that may read one element several times (Gather, GatherElements, GatherND) scatter with
``reduction='add'`` so that repeated indices (an embedding looked up twice) accumulate, always as a
``ScatterElements`` (NOTE [exact scatters]).

# NOTE [exact scatters]: a ScatterND with ``reduction='add'`` is never emitted. onnxruntime's CPU
# kernel runs its index rows in parallel with an unsynchronised ``+=``, so with repeated indices and
# more than one intra-op thread it drops contributions, differently from run to run (measured with
# onnxruntime 1.32, 2 threads: 20000 rows over 8000 -- max error 4.4; BERT's [30522, 256] word
# embedding, 4 threads -- errors of 60-160; 1 thread exact; upstream #23396, #18048). Every
# gradient that sums rows into a tensor (Gather on any axis, GatherND, the label-gradient fold, the
# sums the scatters are folded into) is a ``ScatterElements(reduction='add')`` with the index
# expanded to the update's shape instead: that kernel splits the work by the positions off the
# scatter axis, which no two threads share, and walks the scatter axis in order, so the sum is the
# same at any thread count (bit-equal across runs, exact against float64 up to float32 rounding).
# It costs more (BERT's word embedding at 2048 tokens, 2 threads: 21.8 vs 18.8 ms per run;
# benchmarks/bench_scatter.py). GatherND's k-tuples are linearised into one row index of the data
# viewed as [prod(D[:k]), *D[k:]]. tests/test_scatter_determinism.py scans the compiled models.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from ..registry import GradBuilder, attr, input_or_none, register, register_nondifferentiable, static_shape

# Ops with float outputs whose gradient is zero almost everywhere.
register_nondifferentiable("Hardmax")

# -- helpers shared with the other tensor-op families -------------------------------------------------

def rank_of(x: ir.Value, what: str = "input") -> int:
    if x.shape is None:
        raise ValueError(
            f"the rank of {what} {x.name!r} is unknown (run shape inference on the forward graph)"
        )
    return x.shape.rank()


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def const_array(v: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or a Constant output (any of its value attributes); ``None`` if not
    constant."""
    if v is None:
        return None
    t = v.const_value
    if t is not None:
        return np.asarray(t.numpy())
    p = v.producer()
    if p is None or p.op_type != "Constant" or p.domain not in ("", "ai.onnx"):
        return None
    for name in ("value", "value_ints", "value_int", "value_floats", "value_float"):
        a = p.attributes.get(name)
        if a is not None:
            return np.asarray(a.value.numpy() if name == "value" else a.value)
    return None


def const_ints(v: ir.Value | None) -> list[int] | None:
    """The values of an integer initializer or Constant output, flattened; ``None`` if not constant."""
    arr = const_array(v)
    if arr is None or arr.dtype.kind not in "iu":
        return None
    return [int(i) for i in arr.reshape(-1)]


def zeros_of(
    g: GradBuilder, shape: ir.Value, dtype: ir.DataType, like_shape: ir.Shape | None = None
) -> ir.Value:
    """``ConstantOfShape(shape)`` filled with zeros of ``dtype``."""
    value = ir.tensor(np.zeros((1,), dtype=dtype.numpy()))
    return g.op("ConstantOfShape", [shape], {"value": value}, dtype=dtype, shape=like_shape)


def zeros_like(g: GradBuilder, x: ir.Value) -> ir.Value:
    return zeros_of(g, g.shape_of(x), x.dtype or ir.DataType.FLOAT, x.shape)


def shape_part(g: GradBuilder, x: ir.Value, start: int, end: int) -> list[int] | ir.Value:
    """``shape(x)[start:end]``: a list where static, else a 1-D int64 value."""
    if x.shape is not None:
        dims = list(x.shape)[start:end]
        if all(isinstance(d, int) for d in dims):
            return [int(d) for d in dims]
    return g.op("Slice", [g.op("Shape", [x]), g.ints([start]), g.ints([end])], dtype=ir.DataType.INT64)


def concat_shape(g: GradBuilder, parts: Sequence[list[int] | ir.Value]) -> ir.Value:
    """A 1-D int64 shape from static pieces (lists) and run-time pieces (values)."""
    if all(isinstance(p, list) for p in parts):
        return g.ints([d for p in parts for d in p])  # type: ignore[union-attr]
    values = [g.ints(p) if isinstance(p, list) else p for p in parts if not (isinstance(p, list) and not p)]
    if len(values) == 1:
        return values[0]
    return g.op("Concat", values, {"axis": 0}, dtype=ir.DataType.INT64)


def dim_of(g: GradBuilder, x: ir.Value, axis: int) -> ir.Value:
    """``shape(x)[axis]`` as a 0-d int64 value."""
    if x.shape is not None and isinstance(x.shape[axis], int):
        return g.const(int(x.shape[axis]))
    return g.op("Gather", [g.op("Shape", [x]), g.const(axis)], {"axis": 0}, dtype=ir.DataType.INT64)


def as_int64(g: GradBuilder, idx: ir.Value) -> ir.Value:
    if idx.dtype == ir.DataType.INT64:
        return idx
    return g.op("Cast", [idx], {"to": int(ir.DataType.INT64)}, dtype=ir.DataType.INT64, shape=idx.shape)


def nonneg_indices(g: GradBuilder, idx: ir.Value, dim: ir.Value) -> ir.Value:
    """Indices in ``[-dim, dim)`` mapped to ``[0, dim)`` (int64); skipped for non-negative constants.

    # NOTE [negative indices]: the gather ops accept negative indices; the scatters in their
    # gradients get normalised ones, so nothing depends on a kernel's handling of negative values.
    """
    known = const_ints(idx)
    idx = as_int64(g, idx)
    if known is not None and all(i >= 0 for i in known):
        return idx
    negative = g.op("Less", [idx, g.const(0)])
    return g.op("Where", [negative, g.op("Add", [idx, dim]), idx], dtype=ir.DataType.INT64, shape=idx.shape)


def _zero_scalar(g: GradBuilder, like: ir.Value) -> ir.Value:
    return g.scalar_like(0.0, like)


# -- gathers ------------------------------------------------------------------------------------------


@register("Gather")
def gather_grad(g: GradBuilder, node: ir.Node, dys):
    data, indices = node.inputs
    if data.shape is None and attr(node, "axis", 0) == 0:
        return [_gather_rows_grad_any_rank(g, data, indices, dys[0]), None]
    r = rank_of(data, "Gather data")
    axis = norm_axis(attr(node, "axis", 0), r)
    idx = nonneg_indices(g, indices, dim_of(g, data, axis))
    # dData[..., idx[q], ...] += dY[..., q, ...] (on axis 0: an embedding's rows): dY has shape
    # D[:a] + Q + D[a+1:]; Q is flattened to one axis and scattered along it (NOTE [exact scatters]).
    flat = concat_shape(g, [shape_part(g, data, 0, axis), [-1], shape_part(g, data, axis + 1, r)])
    dyf = g.op("Reshape", [dys[0], flat], dtype=dys[0].dtype)
    return [scatter_add_rows(g, zeros_like(g, data), idx, dyf, axis, r), None]


def _gather_rows_grad_any_rank(g: GradBuilder, data: ir.Value, indices: ir.Value, dy: ir.Value) -> ir.Value:
    """Gather on axis 0 where shape inference lost the data's rank (``nn.MultiheadAttention``'s
    ``proj[0]`` after an unflatten): the rows are scattered as a [D0, rest] matrix and reshaped back."""
    i64 = ir.DataType.INT64
    idx = g.op("Reshape", [nonneg_indices(g, indices, dim_of(g, data, 0)), g.ints([-1])], dtype=i64)  # [Q]
    rows = g.op("Reshape", [data, g.ints([0, -1])], dtype=data.dtype)  # [D0, rest]
    q = g.op("Shape", [idx], dtype=i64)
    dy2 = g.op("Reshape", [dy, g.op("Concat", [q, g.ints([-1])], {"axis": 0}, dtype=i64)], dtype=dy.dtype)
    dx = scatter_add_rows(g, zeros_like(g, rows), idx, dy2, 0, 2)
    return g.op("Reshape", [dx, g.op("Shape", [data], dtype=i64)], dtype=data.dtype)


def scatter_add_rows(
    g: GradBuilder, base: ir.Value, idx: ir.Value, updates: ir.Value, axis: int, rank: int
) -> ir.Value:
    """``base`` (of rank ``rank``) with ``updates[..., q, ...]`` added at ``base[..., idx[q], ...]``.

    ``idx`` is any-shaped, non-negative int64 (flattened to Q); ``updates`` has ``base``'s shape with
    Q in place of ``axis``. An exact, deterministic ScatterElements (NOTE [exact scatters]).
    """
    r = rank
    idx_f = g.op("Reshape", [idx, g.ints([1] * axis + [-1] + [1] * (r - axis - 1))], dtype=ir.DataType.INT64)
    idx_e = g.op("Expand", [idx_f, g.op("Shape", [updates], dtype=ir.DataType.INT64)], dtype=ir.DataType.INT64)
    return scatter_elements_add(g, base, idx_e, updates, axis, shape=base.shape)


def scatter_elements_add(g: GradBuilder, base: ir.Value, idx: ir.Value, updates: ir.Value, axis: int,
                         shape: ir.Shape | None = None) -> ir.Value:
    """``ScatterElements(base, idx, updates, reduction='add')``. onnxruntime's CPU kernel has no 'add'
    for half types (a run-time error in the backward under fp16 autocast, after the forward ran):
    there the sum is made in float32 and cast back, as torch's half index_add accumulates in float."""
    attrs = {"axis": axis, "reduction": "add"}
    if base.dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return g.op("ScatterElements", [base, idx, updates], attrs, dtype=base.dtype, shape=shape)
    f32 = ir.DataType.FLOAT
    out = g.op("ScatterElements", [g.op("Cast", [base], {"to": int(f32)}, dtype=f32), idx,
                                   g.op("Cast", [updates], {"to": int(f32)}, dtype=f32)], attrs, dtype=f32, shape=shape)
    return g.op("Cast", [out], {"to": int(base.dtype)}, dtype=base.dtype, shape=shape)


@register("GatherElements")
def gather_elements_grad(g: GradBuilder, node: ir.Node, dys):
    data, indices = node.inputs
    r = rank_of(data, "GatherElements data")
    axis = norm_axis(attr(node, "axis", 0), r)
    idx = nonneg_indices(g, indices, dim_of(g, data, axis))
    return [scatter_elements_add(g, zeros_like(g, data), idx, dys[0], axis), None]


def _full_nd_indices(g: GradBuilder, data: ir.Value, indices: ir.Value, batch_dims: int) -> ir.Value:
    """GatherND indices (batch dims ``b``, tuples of length ``k``) as non-negative, batch-free indices.

    Returns int64 indices of shape ``Q + [b + k]`` addressing ``data`` from its first axis, so that one
    ``ScatterND``/``GatherND`` without batch dims does what the batched op did.
    """
    ri = rank_of(indices, "GatherND indices")
    idx = as_int64(g, indices)
    # Normalise negative coordinates: coordinate j addresses axis b + j.
    known = const_ints(indices)
    if known is None or any(i < 0 for i in known):
        k = indices.shape[ri - 1]
        if not isinstance(k, int):
            raise ValueError("GatherND gradient needs the static length of the index tuples")
        dims = shape_part(g, data, batch_dims, batch_dims + k)
        dims_v = g.ints(dims) if isinstance(dims, list) else dims
        negative = g.op("Less", [idx, g.const(0)])
        idx = g.op("Where", [negative, g.op("Add", [idx, dims_v]), idx], dtype=ir.DataType.INT64)
    if batch_dims == 0:
        return idx
    # Prepend the batch coordinates: for batch axis j, Range(0, B_j) broadcast over Q + [1].
    q_shape = concat_shape(g, [shape_part(g, indices, 0, ri - 1), [1]])
    coords = []
    for j in range(batch_dims):
        rng = g.op("Range", [g.const(0), dim_of(g, indices, j), g.const(1)], dtype=ir.DataType.INT64)
        rng = g.op("Reshape", [rng, g.ints([1] * j + [-1] + [1] * (ri - 1 - j))], dtype=ir.DataType.INT64)
        coords.append(g.op("Expand", [rng, q_shape], dtype=ir.DataType.INT64))
    return g.op("Concat", [*coords, idx], {"axis": -1}, dtype=ir.DataType.INT64)


@register("GatherND")
def gather_nd_grad(g: GradBuilder, node: ir.Node, dys):
    """The k-tuples linearised to rows of data viewed as [prod(D[:k]), *D[k:]] (NOTE [exact scatters])."""
    data, indices = node.inputs
    batch_dims = attr(node, "batch_dims", 0)
    idx = _full_nd_indices(g, data, indices, batch_dims)  # Q + [k], k counting the batch axes
    ri, r = rank_of(indices, "GatherND indices"), rank_of(data, "GatherND data")
    k = indices.shape[ri - 1]
    if not isinstance(k, int):
        raise ValueError("GatherND gradient needs the static length of the index tuples")
    k += batch_dims
    i64 = ir.DataType.INT64
    lead = shape_part(g, data, 0, k)
    if k == 1:
        rows = idx
    else:
        if isinstance(lead, list):
            strides = g.ints([int(np.prod(lead[j + 1:])) for j in range(k)])
        else:
            parts = [g.op("ReduceProd", [g.op("Slice", [lead, g.ints([j + 1]), g.ints([k])], dtype=i64)],
                          {"keepdims": 1}, dtype=i64) for j in range(k - 1)]
            strides = g.op("Concat", [*parts, g.ints([1])], {"axis": 0}, dtype=i64)
        rows = g.op("ReduceSum", [g.op("Mul", [idx, strides], dtype=i64), g.ints([-1])], {"keepdims": 0}, dtype=i64)
    if isinstance(lead, list):
        n_rows: list[int] | ir.Value = [int(np.prod(lead))]
    else:
        n_rows = g.op("ReduceProd", [lead], {"keepdims": 1}, dtype=i64)
    trail = shape_part(g, data, k, r)
    static = isinstance(n_rows, list) and isinstance(trail, list)
    base = zeros_of(g, concat_shape(g, [n_rows, trail]), data.dtype or ir.DataType.FLOAT,
                    ir.Shape([*n_rows, *trail]) if static else None)  # type: ignore[misc]
    dyf = g.op("Reshape", [dys[0], concat_shape(g, [[-1], trail])], dtype=dys[0].dtype)
    dx = scatter_add_rows(g, base, rows, dyf, 0, 1 + r - k)
    return [g.reshape_like(dx, data), None]


# -- scatters -----------------------------------------------------------------------------------------


def _check_reduction(node: ir.Node) -> str:
    reduction = attr(node, "reduction", "none")
    if reduction not in ("none", "add"):
        raise ValueError(
            f"{node.op_type} with reduction={reduction!r} has no gradient rule (only 'none' and 'add')"
        )
    return reduction


@register("ScatterND")
def scatter_nd_grad(g: GradBuilder, node: ir.Node, dys):
    data, indices, updates = node.inputs
    reduction = _check_reduction(node)
    dy = dys[0]
    idx = _full_nd_indices(g, data, indices, 0)
    # reduction='none': the scattered positions were overwritten, so no gradient reaches data there.
    ddata = dy
    if reduction == "none":
        ddata = g.op("ScatterND", [dy, idx, zeros_like(g, updates)], dtype=data.dtype)
    dupdates = g.op("GatherND", [dy, idx], dtype=updates.dtype)
    return [ddata, None, dupdates]


@register("ScatterElements")
def scatter_elements_grad(g: GradBuilder, node: ir.Node, dys):
    data, indices, updates = node.inputs
    reduction = _check_reduction(node)
    axis = norm_axis(attr(node, "axis", 0), rank_of(data, "ScatterElements data"))
    dy = dys[0]
    idx = nonneg_indices(g, indices, dim_of(g, data, axis))
    ddata = dy
    if reduction == "none":
        ddata = g.op("ScatterElements", [dy, idx, zeros_like(g, updates)], {"axis": axis}, dtype=data.dtype)
    dupdates = g.op("GatherElements", [dy, idx], {"axis": axis}, dtype=updates.dtype)
    return [ddata, None, dupdates]


# -- selection and layout -----------------------------------------------------------------------------


@register("Where")
def where_grad(g: GradBuilder, node: ir.Node, dys):
    cond, a, b = node.inputs
    (y,), dy = node.outputs, dys[0]
    zero = _zero_scalar(g, y)
    da = g.op("Where", [cond, dy, zero], dtype=y.dtype)
    db = g.op("Where", [cond, zero, dy], dtype=y.dtype)
    return [None, g.reduce_to(da, a, y.shape), g.reduce_to(db, b, y.shape)]


@register("Tile")
def tile_grad(g: GradBuilder, node: ir.Node, dys):
    x, repeats = node.inputs
    r = rank_of(x, "Tile input")
    # Y viewed as [r0, d0, r1, d1, ...]: the gradient sums over every repeat axis.
    reps, dims = const_ints(repeats), static_shape(x)
    if reps is not None and dims is not None:
        view = g.ints([v for pair in zip(reps, dims, strict=True) for v in pair])
    else:
        pairs = g.op(
            "Concat",
            [
                g.op("Unsqueeze", [as_int64(g, repeats), g.ints([1])], dtype=ir.DataType.INT64),
                g.op("Unsqueeze", [g.op("Shape", [x]), g.ints([1])], dtype=ir.DataType.INT64),
            ],
            {"axis": 1},
            dtype=ir.DataType.INT64,
        )
        view = g.op("Reshape", [pairs, g.ints([-1])], dtype=ir.DataType.INT64)
    dyv = g.op("Reshape", [dys[0], view], dtype=x.dtype)
    repeat_axes = g.ints(list(range(0, 2 * r, 2)))
    dx = g.op("ReduceSum", [dyv, repeat_axes], {"keepdims": 0}, dtype=x.dtype, shape=x.shape)
    return [dx, None]


def _unit_steps(node: ir.Node) -> bool:
    steps_v = input_or_none(node, 4)
    if steps_v is None:
        return True
    steps = const_ints(steps_v)
    return steps is not None and all(st == 1 for st in steps)


def _static_slice_pads(node: ir.Node, data: ir.Value) -> list[int] | None:
    """Pads undoing a unit-step Slice, when its inputs and the sliced dims are constants; else None."""
    starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
    axes_v = input_or_none(node, 3)
    axes = const_ints(axes_v) if axes_v is not None else None
    if starts is None or ends is None or (axes_v is not None and axes is None) or data.shape is None:
        return None
    r = data.shape.rank()
    axes = list(range(len(starts))) if axes is None else [norm_axis(a, r) for a in axes]
    pads = [0] * (2 * r)
    for a, s, e in zip(axes, starts, ends, strict=True):
        d = data.shape[a]
        if not isinstance(d, int):
            return None
        s = min(max(s + d if s < 0 else s, 0), d)
        e = min(max(e + d if e < 0 else e, 0), d)
        pads[a], pads[r + a] = s, d - max(e, s)
    return pads


def _runtime_slice_pads(g: GradBuilder, node: ir.Node, data: ir.Value) -> ir.Value:
    """The same pads computed by the graph, for run-time starts/ends/axes or symbolic dims."""
    i64 = ir.DataType.INT64
    r = rank_of(data, "Slice data")
    starts, ends = as_int64(g, node.inputs[1]), as_int64(g, node.inputs[2])
    axes_v = input_or_none(node, 3)
    if axes_v is None:
        axes = g.op("Range", [g.const(0), g.op("Size", [starts]), g.const(1)], dtype=i64)
    else:
        axes = nonneg_indices(g, axes_v, g.const(r))
    dims = g.op("Gather", [g.op("Shape", [data]), axes], {"axis": 0}, dtype=i64)
    zero = g.const(0)

    def clamp(v: ir.Value) -> ir.Value:
        v = g.op("Where", [g.op("Less", [v, zero]), g.op("Add", [v, dims]), v], dtype=i64)
        return g.op("Min", [g.op("Max", [v, zero]), dims], dtype=i64)

    s, e = clamp(starts), clamp(ends)
    end_pads = g.op("Sub", [dims, g.op("Max", [e, s])], dtype=i64)
    where = g.op("Concat", [axes, g.op("Add", [axes, g.const(r)])], {"axis": 0}, dtype=i64)
    amounts = g.op("Concat", [s, end_pads], {"axis": 0}, dtype=i64)
    return g.op("ScatterElements", [g.ints([0] * (2 * r)), where, amounts], {"axis": 0}, dtype=i64)


@register("Slice")
def slice_grad(g: GradBuilder, node: ir.Node, dys):
    """Unit steps: Pad dY back to X's shape; other steps: scatter dY to the sliced positions."""
    data = node.inputs[0]
    dy = dys[0]
    none = [None] * (len(node.inputs) - 1)
    if _unit_steps(node):
        static = _static_slice_pads(node, data)
        pads = g.ints(static) if static is not None else _runtime_slice_pads(g, node, data)
        return [g.op("Pad", [dy, pads], dtype=data.dtype, shape=data.shape), *none]
    # NOTE [slice by index]: any Slice (negative or run-time steps, run-time starts/ends) is undone
    # by slicing a tensor of flat positions with the very same inputs, so the ONNX clamping rules are
    # applied by the Slice kernel itself, then scattering dY to those positions of a flat zero tensor.
    n = g.op("Size", [data], dtype=ir.DataType.INT64)
    shape = g.shape_of(data)
    positions = g.op("Range", [g.const(0), n, g.const(1)], dtype=ir.DataType.INT64)
    positions = g.op("Reshape", [positions, shape], dtype=ir.DataType.INT64)
    picked = g.op("Slice", [positions, *node.inputs[1:]], dtype=ir.DataType.INT64)
    flat_zero = zeros_of(g, g.op("Reshape", [n, g.ints([1])], dtype=ir.DataType.INT64), data.dtype)
    scattered = g.op(
        "ScatterElements",
        [
            flat_zero,
            g.op("Reshape", [picked, g.ints([-1])], dtype=ir.DataType.INT64),
            g.op("Reshape", [dy, g.ints([-1])], dtype=data.dtype),
        ],
        {"axis": 0},
        dtype=data.dtype,
    )
    return [g.op("Reshape", [scattered, shape], dtype=data.dtype, shape=data.shape), *none]


@register("Concat")
def concat_grad(g: GradBuilder, node: ir.Node, dys):
    (y,) = node.outputs
    xs = list(node.inputs)
    axis = norm_axis(attr(node, "axis"), rank_of(y, "Concat output"))
    static = [x.shape[axis] if x.shape is not None else None for x in xs]
    if all(isinstance(d, int) for d in static):
        sizes = g.ints(static)
    else:
        parts = [g.op("Gather", [g.op("Shape", [x]), g.ints([axis])], {"axis": 0}) for x in xs]
        sizes = g.op("Concat", parts, {"axis": 0}, dtype=ir.DataType.INT64)
    outs = g.op_multi("Split", [dys[0], sizes], {"axis": axis}, num_outputs=len(xs))
    for o, x in zip(outs, xs, strict=True):
        o.dtype, o.shape = x.dtype, x.shape
    return list(outs)


@register("Split")
def split_grad(g: GradBuilder, node: ir.Node, dys):
    x = node.inputs[0]
    axis = attr(node, "axis", 0)
    parts = [dy if dy is not None else zeros_like(g, out) for dy, out in zip(dys, node.outputs, strict=True)]
    dx = g.op("Concat", parts, {"axis": axis}, dtype=x.dtype, shape=x.shape)
    return [dx] + [None] * (len(node.inputs) - 1)


@register("TopK")
def topk_grad(g: GradBuilder, node: ir.Node, dys):
    x = node.inputs[0]
    values, indices = node.outputs
    axis = norm_axis(attr(node, "axis", -1), rank_of(x, "TopK input"))
    dv = dys[0]
    if dv is None:
        return [None] * len(node.inputs)
    # The k selected positions are distinct, so a plain scatter suffices.
    dx = g.op("ScatterElements", [zeros_like(g, x), indices, dv], {"axis": axis}, dtype=x.dtype)
    return [dx] + [None] * (len(node.inputs) - 1)


@register("Trilu")
def trilu_grad(g: GradBuilder, node: ir.Node, dys):
    x = node.inputs[0]
    k = input_or_none(node, 1)
    inputs = [dys[0]] if k is None else [dys[0], k]
    dx = g.op("Trilu", inputs, {"upper": attr(node, "upper", 1)}, dtype=x.dtype, shape=x.shape)
    return [dx] + [None] * (len(node.inputs) - 1)
