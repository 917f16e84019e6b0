"""Standard ONNX ops defined as functions, written out as their function bodies where ortmodule has no
gradient rule of the op itself (OnnxModule).

# NOTE [function ops]: ONNX defines its newer composite ops (opset 21's GroupNormalization, opset 23's
# Attention, RMSNormalization and RotaryEmbedding, ...) as functions of simpler ops: the schema builds
# the body for the node's attributes and input types. torch.onnx writes them at opset 23 (an HF
# BERT's scaled_dot_product_attention becomes Attention, Llama's RMSNorm RMSNormalization), and such
# files were refused at load. A node of such an op without a rule of its own is replaced by the body
# ONNX gives for it, its values renamed apart; the rules differentiate the body's ops. The body is
# the op's definition, so the forward is the op's, to the kernels' rounding (onnxruntime runs its own
# fused kernel for the op; the test checks both agree, ``tests/test_contrib_ops.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import defs

_MAX_ROUNDS = 4  # bodies may hold function ops themselves
_FOLDABLE = {"Constant", "Cast", "Add", "Sub", "Mul", "Div", "Neg", "Range", "Concat", "Unsqueeze", "Squeeze",
             "Gather", "Reshape", "Equal", "Where", "Less", "Greater", "Size", "Slice", "Min", "Max",
             "ConstantOfShape", "Expand"}


def _types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    g = inferred.graph
    out = {vi.name: vi.type for vi in [*g.input, *g.value_info, *g.output]}
    for t in g.initializer:
        out.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return out


def _defined_as_function(op_type: str, opset: int) -> bool:
    try:
        schema = defs.get_schema(op_type, opset, "")
    except Exception:
        return False
    return schema.has_function or schema.has_context_dependent_function


def _body(node: onnx.NodeProto, opset: int, types: dict[str, onnx.TypeProto]) -> onnx.FunctionProto | None:
    try:
        schema = defs.get_schema(node.op_type, opset, node.domain)
    except Exception:
        return None
    if schema.has_function:
        return schema.function_body
    if not schema.has_context_dependent_function:
        return None
    empty = onnx.TypeProto()
    arg_types = [types.get(x, empty).SerializeToString() if x else empty.SerializeToString() for x in node.input]
    try:
        data = schema.get_context_dependent_function(node.SerializeToString(), arg_types)
    except Exception:
        return None
    if not data:
        return None
    body = onnx.FunctionProto()
    body.ParseFromString(data)
    return body if body.node else None


def _inline(node: onnx.NodeProto, body: onnx.FunctionProto, prefix: str) -> list[onnx.NodeProto]:
    """``body``'s nodes with its formal inputs / outputs bound to the node's and everything else renamed."""
    names = {f: (node.input[i] if i < len(node.input) else "") for i, f in enumerate(body.input)}
    names.update({f: (node.output[i] if i < len(node.output) else "") for i, f in enumerate(body.output)})
    attrs = {a.name: a for a in node.attribute}

    def rename(x: str) -> str:
        if not x:
            return x
        if x not in names:
            names[x] = f"{prefix}/{x}"
        return names[x]

    out = []
    for k, n in enumerate(body.node):
        new = onnx.NodeProto()
        new.CopyFrom(n)
        new.name = f"{prefix}/{n.name or n.op_type}_{k}"
        new.input[:] = [rename(x) if x else "" for x in n.input]
        new.output[:] = [rename(x) if x else "" for x in n.output]
        resolved = []
        for a in new.attribute:
            if a.ref_attr_name:
                if a.ref_attr_name in attrs:
                    b = onnx.AttributeProto()
                    b.CopyFrom(attrs[a.ref_attr_name])
                    b.name = a.name
                    resolved.append(b)
            else:
                resolved.append(a)
        del new.attribute[:]
        new.attribute.extend(resolved)
        out.append(new)
    return out


def _fold(nodes: list[onnx.NodeProto], types: dict[str, onnx.TypeProto]) -> list[onnx.NodeProto]:
    """The body's shape arithmetic as constants: a body computes reduction axes from the input's rank
    (``Range(Size(Shape(X)) + axis, Size(Shape(X)))``), which ONNX shape inference cannot follow, and
    the rules need the shapes after it. Nodes whose inputs are known (constants, a Shape of a static
    shape, a Size of a Shape of a known rank) become Constant nodes of their values."""
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    known: dict[str, np.ndarray] = {}
    rank_of: dict[str, int] = {}  # a Shape output -> the rank of its input

    def dims(name: str):
        t = types.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim]

    out: list[onnx.NodeProto] = []
    for node in nodes:
        values = None
        if node.op_type == "Shape" and len(node.attribute) == 0:
            d = dims(node.input[0])
            if d is not None and all(v is not None for v in d):
                values = [np.array(d, np.int64)]
            elif d is not None:
                rank_of[node.output[0]] = len(d)
        elif node.op_type == "Size" and node.input[0] in rank_of:
            values = [np.array(rank_of[node.input[0]], np.int64)]
        elif node.op_type in _FOLDABLE \
                and all(x in known for x in node.input if x):
            graph = onnx.helper.make_graph(
                [node], "fold", [onnx.helper.make_tensor_value_info(x, onnx.helper.np_dtype_to_tensor_dtype(
                    known[x].dtype), known[x].shape) for x in dict.fromkeys(node.input) if x],
                [onnx.helper.make_value_info(o, onnx.TypeProto()) for o in node.output])
            try:
                values = ReferenceEvaluator(onnx.helper.make_model(graph)).run(
                    None, {x: known[x] for x in node.input if x})
            except Exception:
                values = None
        if values is None:
            out.append(node)
            continue
        for name, v in zip(node.output, values):
            known[name] = np.asarray(v)
            out.append(onnx.helper.make_node("Constant", [], [name], name=f"{node.name}/folded",
                                             value=numpy_helper.from_array(np.asarray(v), name)))
    return out


def expand_function_ops(model: onnx.ModelProto, has_rule: Callable[[str, str], bool]) -> list[str]:
    """Replace, in place, the default-domain nodes of ``model``'s main graph whose op has no gradient rule
    (``has_rule(domain, op_type)``) and an ONNX function body by that body (NOTE [function ops]); the op
    types replaced."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    done: list[str] = []
    for rnd in range(_MAX_ROUNDS):
        nodes = list(model.graph.node)
        todo = {k for k, n in enumerate(nodes) if n.domain in ("", "ai.onnx") and not has_rule(n.domain, n.op_type)
                and _defined_as_function(n.op_type, opset)}
        if not todo:
            break  # (no shape inference of the whole model for nothing)
        types = _types(model)
        new_nodes: list[onnx.NodeProto] = []
        changed = False
        for k, node in enumerate(nodes):
            body = _body(node, opset, types) if k in todo else None
            if body is None:
                new_nodes.append(node)
                continue
            for imp in body.opset_import:
                if imp.domain not in ("", "ai.onnx") and not any(o.domain == imp.domain for o in model.opset_import):
                    model.opset_import.append(onnx.helper.make_opsetid(imp.domain, imp.version))
            new_nodes.extend(_fold(_inline(node, body, f"ortmodule_fn{rnd}_{k}_{node.op_type}"), types))
            done.append(node.op_type)
            changed = True
        del model.graph.node[:]
        model.graph.node.extend(new_nodes)
        if not changed:
            break
    return done
