"""Inline ``If`` nodes whose condition is known when the graph is built.

# NOTE [constant If]: the TorchScript exporter writes some ops with control flow on shapes:
# ``torch.tile`` becomes ``If(Size(Shape(x)) - len(dims) > 0)`` twice, the branches reading ``x`` from
# the outer scope. The gradient walk follows node inputs, and ONNX has no gradient for ``If``; yet the
# condition depends only on ranks and constants. Evaluated here, the chosen branch's nodes replace the
# ``If`` in the outer graph, and the gradient then flows through ordinary ops. A condition that
# depends on data or on a dynamic size stays an ``If``; on a gradient path it makes the gradient
# walk raise (NOTE [captured values] in autodiff/builder.py), never a silently dropped gradient.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from .proto import apply_inferred_types

_MAX_DEPTH = 32  # a condition is a few shape ops; deeper chains are not worth evaluating

_BINARY = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
    "Greater": np.greater, "Less": np.less, "GreaterOrEqual": np.greater_equal,
    "LessOrEqual": np.less_equal, "Equal": np.equal, "And": np.logical_and, "Or": np.logical_or,
    "Xor": np.logical_xor,
}
_UNARY = {"Identity": lambda a: a, "Not": np.logical_not, "Neg": np.negative, "Abs": np.abs}


def _static_dims(v: ir.Value) -> list[int] | None:
    """The sizes of ``v`` where they cannot change between runs: a graph input's declared shape."""
    if v.shape is None or not v.is_graph_input() or not all(isinstance(d, int) for d in v.shape):
        return None
    return [int(d) for d in v.shape]


def _constant(v: ir.Value | None, depth: int = 0) -> np.ndarray | None:
    """The value of ``v`` if it is the same at every run of the graph, else ``None``."""
    if v is None or depth > _MAX_DEPTH:
        return None
    if v.is_graph_input():
        return None  # fed at run time, even where it has an initializer as default
    tensor = ir.convenience.get_const_tensor(v)
    if tensor is not None:
        return tensor.numpy()
    node = v.producer()
    if node is None or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return None
    op = node.op_type
    if op in ("Shape", "Size"):
        x = node.inputs[0]
        if x is None:
            return None
        # NOTE [constant If]: the rank of a value never changes between runs; its sizes do, unless
        # the graph declares them (a graph input with a static shape).
        if op == "Size" and x.producer() is not None and x.producer().op_type == "Shape" \
                and x.producer().domain in ("", "ai.onnx"):
            src = x.producer()
            start, end = _shape_range(src)
            if src.inputs[0] is not None and src.inputs[0].shape is not None:
                rank = src.inputs[0].shape.rank()
                return np.array(len(range(rank)[slice(start, end)]), dtype=np.int64)
        if op == "Size":
            c = _constant(x, depth + 1)
            return None if c is None else np.array(c.size, dtype=np.int64)
        dims = _static_dims(x)
        if dims is None:
            return None
        start, end = _shape_range(node)
        return np.array(dims[slice(start, end)], dtype=np.int64)
    args = [_constant(i, depth + 1) for i in node.inputs]
    if any(a is None for a in args):
        return None
    if op in _BINARY and len(args) == 2:
        return np.asarray(_BINARY[op](args[0], args[1]))
    if op in _UNARY and len(args) == 1:
        return np.asarray(_UNARY[op](args[0]))
    if op == "Cast" and len(args) == 1:
        to = node.attributes.get("to")
        return None if to is None else args[0].astype(ir.DataType(to.value).numpy())
    return None


def _shape_range(node: ir.Node) -> tuple[int | None, int | None]:
    start, end = node.attributes.get("start"), node.attributes.get("end")
    return (0 if start is None else start.value), (None if end is None else end.value)


def _inline(graph: ir.Graph, node: ir.Node, branch: ir.Graph) -> None:
    """Replace ``node`` (an ``If``) by the nodes of ``branch``."""
    inner = list(branch)
    results = list(branch.outputs)
    branch.outputs.clear()
    for n in inner:
        branch.remove(n)
        for key, value in node.metadata_props.items():  # module path, stop-gradient mark
            n.metadata_props.setdefault(key, value)
    graph.insert_before(node, inner)
    produced = {o for n in inner for o in n.outputs}
    renamed: list[tuple[ir.Value, str]] = []
    for out, res in zip(node.outputs, results):
        if res not in produced:  # a branch output that is an outer value itself: keep a node
            ident = ir.node("Identity", [res], num_outputs=1, name=f"{node.name}/Identity_{out.name}",
                            metadata_props=dict(node.metadata_props))
            graph.insert_before(node, ident)
            res = ident.outputs[0]
            renamed.append((res, out.name))
        if res.dtype is None:
            res.dtype = out.dtype
        if res.shape is None and out.shape is not None:
            res.shape = out.shape
        out.replace_all_uses_with(res, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    for value, name in renamed:  # the If's output name, now free
        value.name = name


def _infer_shapes(graph: ir.Graph) -> None:
    """Fill in the types of values that were ``If`` outputs and of what reads them."""
    missing = [o for n in graph for o in n.outputs
               if o.dtype is None or o.shape is None or any(not isinstance(d, int) and d.value is None
                                                            for d in o.shape)]
    if not missing:
        return
    proto = ir.to_proto(ir.Model(graph, ir_version=10))
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # an op onnx cannot infer: the rules ask for what they miss, loudly
        return
    apply_inferred_types(missing, inferred, refine=True)


def inline_constant_ifs(graph: ir.Graph) -> int:
    """Inline every top-level ``If`` whose condition is a build-time constant (NOTE [constant If])."""
    changed = 0
    progress = True
    while progress:  # an inlined branch may hold further Ifs
        progress = False
        for node in list(graph):
            if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
                continue
            cond = _constant(node.inputs[0])
            if cond is None or cond.size != 1:
                continue
            attr = node.attributes.get("then_branch" if bool(cond.reshape(-1)[0]) else "else_branch")
            if attr is None:
                continue
            _inline(graph, node, attr.value)
            changed += 1
            progress = True
    if changed:
        _infer_shapes(graph)
    return changed
