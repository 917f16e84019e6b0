"""Reductions and contractions: Reduce* (axes as input or attribute), CumSum, Einsum."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..registry import GRAD_KIND_KEY, GradBuilder, attr, register, static_shape
from .indexing import const_ints, dim_of, norm_axis, rank_of, zeros_like, zeros_of

# -- Reduce* ------------------------------------------------------------------------------------------


class _Reduce:
    """How a Reduce* node reduced: the gradient helpers broadcast values of Y's shape back to X's.

    # NOTE [reduce axes]: ``axes`` is an input since opset 18 (13 for ReduceSum) and an attribute
    # before. With keepdims=0, Y is unsqueezed at ``axes``; Unsqueeze reads negative axes against the
    # output rank, which is X's rank, so the reduce's own axes can be reused as they are. Without axes
    # (or with empty constant axes) everything is reduced and Y broadcasts as it is, unless
    # ``noop_with_empty_axes=1`` made the op an identity.
    """

    def __init__(self, g: GradBuilder, node: ir.Node) -> None:
        self.g, self.node = g, node
        self.x = node.inputs[0]
        self.keepdims = attr(node, "keepdims", 1)
        self.noop = attr(node, "noop_with_empty_axes", 0)
        axes: ir.Value | None = node.inputs[1] if len(node.inputs) > 1 else None
        axes_attr = attr(node, "axes")
        if axes is None and axes_attr is not None:
            axes = g.ints(list(axes_attr))
        if axes is not None and const_ints(axes) == []:
            axes = None
        self.axes = axes
        self.identity = axes is None and self.noop == 1

    def keep(self, v: ir.Value) -> ir.Value:
        """``v`` (Y's shape) with the reduced axes kept as ones, so it broadcasts against X."""
        if self.keepdims or self.axes is None:
            return v
        return self.g.op("Unsqueeze", [v, self.axes], dtype=v.dtype)

    def expand(self, v: ir.Value) -> ir.Value:
        return self.g.expand_like(v, self.x)

    def sum_keep(self, v: ir.Value) -> ir.Value:
        """ReduceSum of an X-shaped ``v`` over the same axes, keeping dims."""
        inputs = [v] if self.axes is None else [v, self.axes]
        attrs = {"keepdims": 1, "noop_with_empty_axes": self.noop}
        return self.g.op("ReduceSum", inputs, attrs, dtype=v.dtype)


def _grads(node: ir.Node, dx: ir.Value) -> list[ir.Value | None]:
    return [dx] + [None] * (len(node.inputs) - 1)


@register("ReduceSum")
def reduce_sum_grad(g: GradBuilder, node: ir.Node, dys):
    r = _Reduce(g, node)
    if r.identity:
        return _grads(node, dys[0])
    return _grads(node, r.expand(r.keep(dys[0])))


@register("ReduceMean")
def reduce_mean_grad(g: GradBuilder, node: ir.Node, dys):
    r = _Reduce(g, node)
    if r.identity:
        return _grads(node, dys[0])
    x, (y,) = r.x, node.outputs
    xs, ys = static_shape(x), static_shape(y)
    if xs is not None and ys is not None:
        count = g.scalar_like(float(np.prod(xs, dtype=np.int64)) / float(np.prod(ys, dtype=np.int64)), x)
    else:
        to = {"to": int(x.dtype)}
        count = g.op("Div", [g.op("Cast", [g.op("Size", [x])], to), g.op("Cast", [g.op("Size", [y])], to)])
    return _grads(node, r.expand(g.op("Div", [r.keep(dys[0]), count], dtype=x.dtype)))


@register("ReduceSumSquare")
def reduce_sum_square_grad(g: GradBuilder, node: ir.Node, dys):
    r = _Reduce(g, node)
    x = r.x
    dy = dys[0] if r.identity else r.keep(dys[0])
    return _grads(node, g.mul(g.mul(dy, x), g.scalar_like(2.0, x)))


@register("ReduceL1")
def reduce_l1_grad(g: GradBuilder, node: ir.Node, dys):
    r = _Reduce(g, node)
    dy = dys[0] if r.identity else r.keep(dys[0])
    return _grads(node, g.mul(dy, g.op("Sign", [r.x])))


@register("ReduceL2")
def reduce_l2_grad(g: GradBuilder, node: ir.Node, dys):
    r = _Reduce(g, node)
    x, (y,) = r.x, node.outputs
    if r.identity:  # |x|
        return _grads(node, g.mul(dys[0], g.op("Sign", [x])))
    yk = r.keep(y)
    # x / ||x||, with zero where the norm is zero (as torch.linalg.vector_norm's backward does).
    zero = g.scalar_like(0.0, x)
    scale = g.op("Where", [g.op("Equal", [yk, zero]), zero, g.op("Div", [r.keep(dys[0]), yk])])
    return _grads(node, g.mul(x, scale))


@register("ReduceLogSumExp")
def reduce_log_sum_exp_grad(g: GradBuilder, node: ir.Node, dys):
    r = _Reduce(g, node)
    x, (y,) = r.x, node.outputs
    if r.identity:  # log(exp(x)) = x
        return _grads(node, dys[0])
    return _grads(node, g.mul(r.keep(dys[0]), g.op("Exp", [g.op("Sub", [x, r.keep(y)])])))


@register("ReduceLogSum")
def reduce_log_sum_grad(g: GradBuilder, node: ir.Node, dys):
    r = _Reduce(g, node)
    x, (y,) = r.x, node.outputs
    if r.identity:  # log(x)
        return _grads(node, g.op("Div", [dys[0], x]))
    # d log(sum x) / dx = 1 / sum x = exp(-y)
    return _grads(node, r.expand(g.mul(r.keep(dys[0]), g.op("Exp", [g.neg(r.keep(y))]))))


def _reduce_extremum_grad(g: GradBuilder, node: ir.Node, dys):
    # NOTE [extremum ties]: like torch.amax/amin, the gradient is split evenly between all the
    # elements equal to the extremum; torch.max/min(x, dim) give it to the index they return, the
    # first (NOTE [kinks as torch]: the node is marked ``first_index``), as ONNX's ArgMax picks it.
    r = _Reduce(g, node)
    x, (y,) = r.x, node.outputs
    if r.identity:
        return _grads(node, dys[0])
    axes = const_ints(r.axes) if r.axes is not None else None
    if node.metadata_props.get(GRAD_KIND_KEY) == "first_index" and axes is not None and len(axes) == 1:
        axis = norm_axis(axes[0], rank_of(x, f"{node.op_type} input"))
        arg = "ArgMax" if node.op_type == "ReduceMax" else "ArgMin"
        idx = g.op(arg, [x], {"axis": axis, "keepdims": 1, "select_last_index": 0}, dtype=ir.DataType.INT64)
        dy = r.keep(dys[0])
        return _grads(node, g.op("ScatterElements", [zeros_like(g, x), idx, dy], {"axis": axis}, dtype=x.dtype))
    mask = g.op("Cast", [g.op("Equal", [x, r.keep(y)])], {"to": int(x.dtype)}, dtype=x.dtype)
    share = g.op("Div", [r.keep(dys[0]), r.sum_keep(mask)], dtype=x.dtype)
    return _grads(node, g.mul(mask, share))


register("ReduceMax")(_reduce_extremum_grad)
register("ReduceMin")(_reduce_extremum_grad)


@register("ReduceProd")
def reduce_prod_grad(g: GradBuilder, node: ir.Node, dys):
    """d prod / dx_i = the product of the others.

    # NOTE [prod zeros]: eager's prod backward is ``dy * y / x`` where nothing is 0, which is 0/0 at
    # a zero. Here, per reduced group: no zero -> dy * y / x (eager's own form); one zero -> that
    # element gets dy * (the product of the rest), the others 0; two or more -> all 0. Eager takes
    # exclusive cumulative products for the whole tensor once any element is 0: the same values, to
    # rounding.
    """
    r = _Reduce(g, node)
    x, (y,) = r.x, node.outputs
    dy = r.keep(dys[0])
    if r.identity:
        return _grads(node, dys[0])
    dt = x.dtype
    is_zero = g.op("Equal", [x, g.scalar_like(0.0, x)], dtype=ir.DataType.BOOL)
    zeros = r.sum_keep(g.op("Cast", [is_zero], {"to": int(dt)}, dtype=dt))  # zeros per group
    safe = g.op("Where", [is_zero, g.scalar_like(1.0, x), x], dtype=dt)
    if r.axes is None:
        rest = g.op("ReduceProd", [safe], {"keepdims": 1}, dtype=dt)
    elif g.opset >= 18:
        rest = g.op("ReduceProd", [safe, r.axes], {"keepdims": 1}, dtype=dt)
    else:
        axes = const_ints(r.axes)
        if axes is None:
            raise ValueError(f"ReduceProd node {node.name!r}: its gradient needs constant axes below opset 18")
        rest = g.op("ReduceProd", [safe], {"keepdims": 1, "axes": axes}, dtype=dt)
    none_zero = g.op("Div", [g.mul(dy, r.keep(y)), x], dtype=dt)
    one_zero = g.op("Where", [is_zero, g.mul(dy, rest), g.scalar_like(0.0, x)], dtype=dt)
    dx = g.op("Where", [g.op("Equal", [zeros, g.scalar_like(0.0, x)], dtype=ir.DataType.BOOL), none_zero,
                        g.op("Where", [g.op("Equal", [zeros, g.scalar_like(1.0, x)], dtype=ir.DataType.BOOL),
                                       one_zero, g.scalar_like(0.0, x)], dtype=dt)], dtype=dt)
    return _grads(node, dx)


# -- CumSum -------------------------------------------------------------------------------------------


@register("CumSum")
def cumsum_grad(g: GradBuilder, node: ir.Node, dys):
    x, axis = node.inputs
    # y_i = sum_{j <= i} x_j  =>  dx_j = sum_{i >= j} dy_i: the same scan run the other way.
    attrs = {"exclusive": attr(node, "exclusive", 0), "reverse": 1 - attr(node, "reverse", 0)}
    return [g.op("CumSum", [dys[0], axis], attrs, dtype=x.dtype, shape=x.shape), None]


# -- Einsum -------------------------------------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _parse_einsum(equation: str, operands: list[ir.Value]) -> tuple[list[list[str]], list[str], list[str]]:
    """Operand and output subscripts with '...' spelled out as letters; also the unused letters.

    # NOTE [einsum broadcasting]: an ellipsis dim that is a static 1 in one operand but larger in
    # another is broadcast; that operand gets its own letter there, which makes the equation compute
    # the same thing (a size-1 letter summed away) and its gradient sum over the broadcast dim.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ValueError(
            f"einsum equation {equation!r} names {len(terms)} operands, the node has {len(operands)}"
        )
    free = [c for c in _LETTERS if c not in eq]
    ell_counts = []
    for t, v in zip(terms, operands, strict=True):
        if "..." in t:
            ell_counts.append(rank_of(v, "Einsum operand") - (len(t) - 3))
        else:
            ell_counts.append(0)
    n_ell = max(ell_counts, default=0)
    ell, free = free[:n_ell], free[n_ell:]
    parsed: list[list[str]] = []
    for t, c in zip(terms, ell_counts, strict=True):
        head, _, tail = t.partition("...")
        parsed.append(list(head) + (ell[n_ell - c :] if "..." in t else []) + list(tail))
    if arrow:
        head, _, tail = rhs.partition("...")
        out = list(head) + (ell if "..." in rhs else []) + list(tail)
    else:
        letters = [c for t in terms for c in t.replace("...", "")]
        out = ell + sorted(c for c in set(letters) if letters.count(c) == 1)
    # Broadcast ellipsis dims (static 1 against a larger static dim) get their own letter.
    for letter in ell:
        sizes = []
        for p, v in zip(parsed, operands, strict=True):
            for pos, c in enumerate(p):
                if c == letter and v.shape is not None:
                    sizes.append((p, pos, v.shape[pos]))
        biggest = max((d for _, _, d in sizes if isinstance(d, int)), default=1)
        if biggest > 1:
            for p, pos, d in sizes:
                if d == 1:
                    p[pos] = free.pop(0)
    return parsed, out, free


def _eye(g: GradBuilder, x: ir.Value, axis: int) -> ir.Value:
    """An identity matrix of size ``shape(x)[axis]`` and x's dtype."""
    if x.shape is not None and isinstance(x.shape[axis], int):
        return g.const(np.eye(int(x.shape[axis])), x.dtype)
    n = g.op("Reshape", [dim_of(g, x, axis), g.ints([1])], dtype=ir.DataType.INT64)
    square = zeros_of(g, g.op("Concat", [n, n], {"axis": 0}, dtype=ir.DataType.INT64), x.dtype)
    return g.op("EyeLike", [square], dtype=x.dtype)


@register("Einsum")
def einsum_grad(g: GradBuilder, node: ir.Node, dys):
    """The gradient of each operand is another Einsum: dY and the other operands, to its subscripts.

    Letters that only this operand has are summed in the forward, so its gradient is broadcast
    along them (Unsqueeze + Expand). A letter repeated within the operand (a diagonal, ``ii->i``)
    is renamed in the gradient's output and tied to the original by an identity-matrix operand.
    """
    operands = list(node.inputs)
    terms, out, free = _parse_einsum(attr(node, "equation"), operands)
    dy = dys[0]
    grads: list[ir.Value | None] = []
    for i, x in enumerate(operands):
        if x.dtype is None or not x.dtype.is_floating_point():
            grads.append(None)
            continue
        others = set(out).union(*(set(t) for j, t in enumerate(terms) if j != i))
        term = terms[i]
        inputs = [dy] + [v for j, v in enumerate(operands) if j != i]
        subs = ["".join(out)] + ["".join(t) for j, t in enumerate(terms) if j != i]
        target: list[str] = []
        lonely: list[int] = []
        seen: set[str] = set()
        fresh = list(free)
        for pos, c in enumerate(term):
            if c in seen:
                f = fresh.pop(0)
                inputs.append(_eye(g, x, pos))
                subs.append(c + f)
                target.append(f)
            elif c in others or term.count(c) > 1:
                seen.add(c)
                target.append(c)
            else:
                lonely.append(pos)
        eq = ",".join(subs) + "->" + "".join(target)
        dx = g.op("Einsum", inputs, {"equation": eq}, dtype=x.dtype)
        if lonely:
            dx = g.op("Unsqueeze", [dx, g.ints(lonely)], dtype=x.dtype)
            dx = g.expand_like(dx, x)
        grads.append(dx)
    return grads
