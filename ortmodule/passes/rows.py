"""Select rows before computing them: a Gather of a few rows moves up through row-wise ops.

# NOTE [rows nobody reads]: a sequence classifier reads one position of its last hidden state
# (BERT's pooler: ``hidden[:, 0]``, a Gather on the sequence axis), yet the graph computes the whole
# last layer's FFN, output projection, LayerNorms and dropouts for every position, and the backward
# runs them all again on a gradient that is zero everywhere but that position. Where a value is read
# only through Gathers of the same constant, distinct indices on one axis, and its producer is
# row-wise along that axis (elementwise with broadcasting, LayerNorm/Softmax over later axes, the
# rows of a MatMul or Gemm, a Transpose), the Gather moves onto the producer's inputs: the producer
# then computes only the selected rows, which are exactly the values the Gather read. It repeats
# until it reaches a value with other readers (the layer input, read by the K and V projections) or
# an op it cannot see through (a Reshape, whose target shape may be computed from other tensors).
# Values, outputs and gradients are unchanged: what is removed only ever fed rows nobody read.
# An input is read whole where it broadcasts along the axis (absent, or of static size 1); a
# symbolic size is taken to be the output's, as it was when the exporter traced the model.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

# Ops whose output element at an index reads only the inputs' elements at the broadcast index.
_ELEMENTWISE = frozenset({
    "Abs", "Add", "And", "Cast", "Ceil", "Celu", "Clip", "Cos", "Div", "Elu", "Equal", "Erf", "Exp",
    "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish", "Identity", "IsInf",
    "IsNaN", "LeakyRelu", "Less", "LessOrEqual", "Log", "Max", "Min", "Mish", "Mod", "Mul", "Neg", "Not",
    "Or", "Pow", "PRelu", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Softplus",
    "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh", "Where", "Xor",
})


def _attr(node: ir.Node, name: str, default):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _rank(v: ir.Value | None) -> int | None:
    return None if v is None or v.shape is None else v.shape.rank()


def _selection(node: ir.Node) -> tuple[int, np.ndarray, bool] | None:
    """``(axis, flat indices, scalar)`` of a Gather of constant, distinct indices; else None."""
    if node.op_type != "Gather" or node.domain != "" or len(node.inputs) != 2:
        return None
    data, indices = node.inputs
    rank = _rank(data)
    tensor = ir.convenience.get_const_tensor(indices) if indices is not None else None
    if not rank or tensor is None:
        return None
    arr = tensor.numpy()
    flat = arr.reshape(-1).astype(np.int64)
    if arr.ndim > 1 or len(set(flat.tolist())) != flat.size:
        return None
    axis = _attr(node, "axis", 0) % rank
    if data.shape[axis] == flat.size:
        return None  # every row: nothing to save
    return axis, flat, arr.ndim == 0


def _broadcast_axis(v: ir.Value | None, out_rank: int, axis: int) -> int | None | bool:
    """The axis of input ``v`` that broadcasts to output ``axis``: None where ``v`` is broadcast
    along it (absent or of static size 1), False where ``v``'s shape is unknown."""
    rank = _rank(v)
    if rank is None:
        return False
    a = axis - (out_rank - rank)
    if a < 0 or v.shape[a] == 1:
        return None
    return a


def _input_axes(node: ir.Node, axis: int, out_rank: int, opset: int) -> list[int | None] | None:
    """For each input of ``node``, the axis to select along (None: read whole), so that ``node`` on
    the selected inputs computes the selected rows of its output along ``axis``; None if it cannot."""
    op, inputs = node.op_type, list(node.inputs)
    if op in _ELEMENTWISE:
        axes = [None if v is None else _broadcast_axis(v, out_rank, axis) for v in inputs]
        return None if any(a is False for a in axes) else axes
    if op in ("LayerNormalization", "Softmax", "LogSoftmax"):
        default = -1 if op == "LayerNormalization" or opset >= 13 else 1
        # Rows are independent along axes before the normalised one (for opset < 13 Softmax too,
        # which flattens from its axis on).
        if axis >= _attr(node, "axis", default) % out_rank:
            return None
        return [axis] + [None] * (len(inputs) - 1)
    if op == "Transpose":
        perm = _attr(node, "perm", None) or list(reversed(range(out_rank)))
        return [list(perm)[axis]]
    if op == "MatMul":
        ra, rb = _rank(inputs[0]), _rank(inputs[1])
        if ra is None or rb is None or ra < 2 or rb < 2 or axis == out_rank - 1:
            return None
        if axis == out_rank - 2:
            return [ra - 2, None]
        axes = [_broadcast_axis(v, out_rank, axis) for v in inputs]  # a batch axis
        return None if any(a is False for a in axes) else axes
    if op == "Gemm":
        if axis != 0:
            return None
        axes: list[int | None] = [1 if _attr(node, "transA", 0) else 0, None]
        if len(inputs) > 2:
            c = inputs[2]
            if c is not None and _rank(c) is None:
                return None
            axes.append(None if c is None or _rank(c) != 2 or c.shape[0] == 1 else 0)
        return axes
    return None


def _int_const(values: np.ndarray, name: str) -> ir.Node:
    node = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(values.astype(np.int64)))], name=name)
    node.outputs[0].dtype, node.outputs[0].shape = ir.DataType.INT64, ir.Shape(values.shape)
    return node


def _with_dim(v: ir.Value, axis: int, size: int) -> ir.Shape | None:
    if v.shape is None:
        return None
    dims = list(v.shape)
    dims[axis] = size
    return ir.Shape(dims)


def _push(graph: ir.Graph, y: ir.Value, axis: int, idx: np.ndarray, opset: int) -> list[ir.Node] | None:
    """Move the Gathers reading ``y`` onto the inputs of ``y``'s producer, if all of ``y``'s readers are
    such Gathers and the producer is row-wise along ``axis``; return the new Gathers."""
    node = y.producer()
    outputs = set(graph.outputs)
    if node is None or node.domain != "" or y in outputs or y.shape is None:
        return None
    if any(o is not y and (o.uses() or o in outputs) for o in node.outputs):
        return None
    readers = [(u.node, _selection(u.node)) for u in y.uses()]
    for r, sel in readers:
        if sel is None or r.inputs[0] is not y or sel[0] != axis or not np.array_equal(sel[1], idx):
            return None
    axes = _input_axes(node, axis, y.shape.rank(), opset)
    if axes is None or all(a is None for a in axes):
        return None
    base = node.name or node.op_type
    index = _int_const(idx, f"{base}/rows/indices")
    new_nodes = [index]
    for i, a in enumerate(axes):
        if a is None:
            continue
        v = node.inputs[i]
        gather = ir.Node("", "Gather", [v, index.outputs[0]], [ir.AttrInt64("axis", a)],
                         name=f"{base}/rows/Gather_{i}", metadata_props=dict(node.metadata_props))
        out = gather.outputs[0]
        out.dtype, out.shape = v.dtype, _with_dim(v, a, idx.size)
        node.replace_input_with(i, out)
        new_nodes.append(gather)
    graph.insert_before(node, new_nodes)
    y.shape = _with_dim(y, axis, idx.size)
    positions: dict[bool, ir.Node] = {}
    for r, (_, _, scalar) in readers:
        if scalar or r.outputs[0] in outputs:
            # The reader now picks its rows of the selection (a Gather of k rows: its output value,
            # and so a graph output's name, stays); a scalar index (k = 1) still drops the axis.
            if scalar not in positions:
                rows = np.arange(idx.size).reshape(() if scalar else -1)
                positions[scalar] = _int_const(rows, f"{base}/rows/positions")
                graph.insert_before(node, positions[scalar])
            r.replace_input_with(1, positions[scalar].outputs[0])
        else:
            r.outputs[0].replace_all_uses_with(y)
            graph.remove(r, safe=True)
    return new_nodes[1:]


def select_rows_early(graph: ir.Graph) -> int:
    """Move Gathers of constant rows up through row-wise producers (NOTE [rows nobody reads])."""
    opset = graph.opset_imports.get("", 17)
    changed = 0
    work = list(graph)
    while work:
        node = work.pop()
        sel = _selection(node) if node.graph is graph else None  # None: removed by a push
        if sel is None:
            continue
        new = _push(graph, node.inputs[0], sel[0], sel[1], opset)
        if new is not None:
            changed += 1
            work.extend(new)  # the Gathers now on the producer's inputs may move on
    return changed
