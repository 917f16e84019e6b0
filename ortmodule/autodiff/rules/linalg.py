"""Matrix products: Gemm and (batched, broadcasting) MatMul."""

from __future__ import annotations

import onnx_ir as ir

from ..registry import GradBuilder, attr, input_or_none, register


def _gemm(g: GradBuilder, a, b, trans_a: int, trans_b: int, alpha: float, dtype) -> ir.Value:
    attrs = {"transA": trans_a, "transB": trans_b}
    if alpha != 1.0:
        attrs["alpha"] = alpha
    return g.op("Gemm", [a, b], attrs, dtype=dtype)


@register("Gemm")
def gemm_grad(g: GradBuilder, node: ir.Node, dys):
    a, b = node.inputs[0], node.inputs[1]
    c = input_or_none(node, 2)
    (y,), dy = node.outputs, dys[0]
    ta, tb = attr(node, "transA", 0), attr(node, "transB", 0)
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    # Y = alpha A' B' + beta C with A' = A^T if transA, B' = B^T if transB.
    if not ta:
        da = _gemm(g, dy, b, 0, 0 if tb else 1, alpha, a.dtype)  # dY B'^T
    else:
        da = _gemm(g, b, dy, 1 if tb else 0, 1, alpha, a.dtype)  # (dY B'^T)^T = B' dY^T
    if not tb:
        db = _gemm(g, a, dy, 0 if ta else 1, 0, alpha, b.dtype)  # A'^T dY
    else:
        db = _gemm(g, dy, a, 1, 1 if ta else 0, alpha, b.dtype)  # (A'^T dY)^T = dY^T A'
    grads: list[ir.Value | None] = [da, db]
    if c is not None:
        dc = dy if beta == 1.0 else g.mul(dy, g.scalar_like(beta, dy))
        grads.append(g.reduce_to(dc, c, y.shape))
    elif len(node.inputs) > 2:  # C given as "": still one entry per node input
        grads.append(None)
    return grads


def _swap_last(g: GradBuilder, x: ir.Value, rank: int) -> ir.Value:
    """``x`` with its last two axes swapped.

    # NOTE [transpose folding]: when ``x`` is itself such a Transpose (a Linear exports
    # ``MatMul(X, Transpose(W))``), the result is its input: the backward then reads the weight,
    # which is a graph input, instead of saving the transposed copy. With no other reader left, ORT
    # folds the forward Transpose into its MatMul (FusedMatMul), so the copy is neither made nor
    # kept (GPT-2's tied [50257, 128] embedding: 6 ms and 25 MB per step).
    """
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    producer = x.producer()
    if producer is not None and producer.op_type == "Transpose" and producer.domain == "":
        p = producer.attributes.get("perm")
        if p is not None and list(p.value) == perm:
            return producer.inputs[0]
    return g.op("Transpose", [x], {"perm": perm}, dtype=x.dtype)


@register("MatMul")
def matmul_grad(g: GradBuilder, node: ir.Node, dys):
    a, b = node.inputs
    (y,), dy = node.outputs, dys[0]
    if a.shape is None or b.shape is None or y.shape is None:
        raise ValueError("MatMul gradient needs the ranks of its inputs (run shape inference first)")
    ra, rb = a.shape.rank(), b.shape.rank()
    k, n = b.shape[0] if rb == 2 else None, b.shape[-1]
    if ra >= 3 and rb == 2 and isinstance(k, int) and isinstance(n, int):
        # NOTE [matmul weight grad]: X[..., K] @ W[K, N] (a Linear on a sequence): dW is one 2-D GEMM
        # over the flattened leading dims, not a batched MatMul summed over the batch afterwards
        # (that writes a [batch, K, N] intermediate and reads it again).
        x2 = g.op("Reshape", [a, g.ints([-1, k])], dtype=a.dtype)
        dy_2d = g.op("Reshape", [dy, g.ints([-1, n])], dtype=dy.dtype)
        db = g.op("Gemm", [x2, dy_2d], {"transA": 1}, dtype=b.dtype, shape=b.shape)
        da = g.op("MatMul", [dy, _swap_last(g, b, 2)], dtype=a.dtype, shape=a.shape)
        return [da, db]
    a2, b2, dy2 = a, b, dy
    a_dims, b_dims, y_dims = list(a.shape), list(b.shape), list(y.shape)
    # NOTE [matmul 1-D]: a 1-D operand is promoted to a matrix (A -> [1, K], B -> [K, 1]) and the
    # gradient of the promoted operand is squeezed back; dY gets the promoted axes too.
    if ra == 1:
        a2 = g.op("Unsqueeze", [a, g.ints([0])], dtype=a.dtype)
        a_dims = [1] + a_dims
        dy2 = g.op("Unsqueeze", [dy2, g.ints([-2 if rb > 1 else 0])], dtype=dy.dtype)
        y_dims = y_dims[:-1] + [1] + y_dims[-1:] if rb > 1 else [1] + y_dims
    if rb == 1:
        b2 = g.op("Unsqueeze", [b, g.ints([1])], dtype=b.dtype)
        b_dims = b_dims + [1]
        dy2 = g.op("Unsqueeze", [dy2, g.ints([-1])], dtype=dy.dtype)
        y_dims = y_dims + [1]
    r = max(len(a_dims), len(b_dims))
    batch = y_dims[:-2]
    da = g.op("MatMul", [dy2, _swap_last(g, b2, len(b_dims))], dtype=a.dtype)
    db = g.op("MatMul", [_swap_last(g, a2, len(a_dims)), dy2], dtype=b.dtype)
    del r
    da = g.reduce_to(da, _with_shape(a2, a_dims), ir.Shape(batch + a_dims[-2:]))
    db = g.reduce_to(db, _with_shape(b2, b_dims), ir.Shape(batch + b_dims[-2:]))
    if ra == 1:
        da = g.op("Squeeze", [da, g.ints([0])], dtype=a.dtype)
    if rb == 1:
        db = g.op("Squeeze", [db, g.ints([-1])], dtype=b.dtype)
    return [da, db]


def _with_shape(v: ir.Value, dims) -> ir.Value:
    if v.shape is None or list(v.shape) != list(dims):
        v.shape = ir.Shape(dims)
    return v
