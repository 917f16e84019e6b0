"""Helpers for the passes that work on ``onnx.ModelProto`` graphs (after partition)."""

from __future__ import annotations

import onnx


def node_attrs(node: onnx.NodeProto) -> dict:
    """A node's attributes as Python values (strings decoded)."""
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out
