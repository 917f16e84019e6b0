"""Helpers for the passes that work on ``onnx.ModelProto`` graphs (after partition), and for
reading ONNX shape inference back into ``onnx_ir`` values."""

from __future__ import annotations

from collections.abc import Iterable

import onnx
import onnx_ir as ir


def apply_inferred_types(values: Iterable[ir.Value], inferred: onnx.ModelProto, *, refine: bool = False) -> None:
    """Give ``values`` the dtype and shape that ONNX shape inference wrote in ``inferred``.

    A value without a dtype or shape takes the inferred one. With ``refine``, a shape of the same
    rank keeps its known dims (the symbolic names the exporter chose) and takes the inferred ones
    only where a dim is unknown.
    """
    known = {vi.name: vi for vi in inferred.graph.value_info}
    for v in values:
        vi = known.get(v.name)
        if vi is None or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        if v.dtype is None and tt.elem_type:
            v.dtype = ir.DataType(tt.elem_type)
        if not tt.HasField("shape"):
            continue
        if v.shape is not None and not (refine and v.shape.rank() == len(tt.shape.dim)):
            continue
        old = list(v.shape) if v.shape is not None else [None] * len(tt.shape.dim)
        dims = []
        for d, o in zip(tt.shape.dim, old):
            if o is not None and (isinstance(o, int) or o.value is not None):
                dims.append(o)
            elif d.HasField("dim_value"):
                dims.append(d.dim_value)
            else:
                dims.append(d.dim_param or None)
        v.shape = ir.Shape(dims)


def node_attrs(node: onnx.NodeProto) -> dict:
    """A node's attributes as Python values (strings decoded)."""
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out
