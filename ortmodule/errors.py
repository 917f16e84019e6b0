"""Exceptions, and the helper that says where in the user's model a graph node came from."""

from __future__ import annotations

import os
import sys

import onnx_ir as ir
import torch

MODULE_PATH_KEY = "pkg.ortmodule.module_path"


class ORTModuleError(RuntimeError):
    """Base class of ortmodule's errors."""


class ExportError(ORTModuleError):
    """The module could not be exported to ONNX."""


class CaptureError(ExportError):
    """The capture failed inside the module's own forward, for a reason that may be the user's
    (a wrong input shape) or the capture's (an op without a fake kernel): the eager forward
    decides. Raising, it gives the user eager PyTorch's own error; returning, it is the fallback."""


class GradientRuleError(ORTModuleError):
    """No gradient rule exists for an op, or a rule failed."""


class DoubleBackwardError(ORTModuleError):
    """A backward through ORTModule was asked to build a graph (``create_graph=True``)."""


class VerificationError(ORTModuleError):
    """Verification mode (``verify=True``) found ORT's outputs, buffer updates or gradients differ
    from eager PyTorch's on the same call."""


def node_location(node: ir.Node) -> str:
    """``node 'name', from torch module 'encoder.layer.3'`` — for error messages."""
    where = f"node '{node.name}'"
    path = node.metadata_props.get(MODULE_PATH_KEY)
    if path is not None:
        where += f", from torch module '{path}'" if path else ", from the top-level module"
    return where


def module_path_from_scope(node_name: str, wrapper_attr: str = "module") -> str | None:
    """Recover the torch module path from a TorchScript exporter node name.

    Names look like ``/module/blocks.0/seq/seq.1/Gemm``: scope segments, where a container's child
    repeats the container's name (``seq`` then ``seq.1``). Returns ``"blocks.0.seq.1"``.
    """
    if not node_name.startswith("/"):
        return None
    segs = node_name.split("/")[1:-1]
    if not segs or segs[0] != wrapper_attr:
        return None
    parts: list[str] = []
    for seg in segs[1:]:
        if parts and seg.startswith(parts[-1] + "."):
            parts[-1] = seg
        else:
            parts.append(seg)
    return ".".join(parts)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _in_torch_or_ortmodule(filename: str) -> bool:
    return filename.startswith((_TORCH_DIR, _OWN_DIR))


def _user_file(filename: str) -> bool:
    """A frame of the user's code: outside torch, ortmodule, contextlib and generated code."""
    return not (_in_torch_or_ortmodule(filename) or filename.startswith("<") or "contextlib" in filename)


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the innermost caller outside torch and ortmodule, so a
    warning points at the user's ``model(x)`` line, not at torch's ``_call_impl``."""
    frame, level = sys._getframe(1), 1  # level 1: the caller, which calls warnings.warn
    while frame is not None and _in_torch_or_ortmodule(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def user_location() -> str:
    """``file:line in function`` of the innermost frame outside torch, ortmodule and contextlib."""
    frame = sys._getframe(1)
    while frame is not None:
        f = frame.f_code.co_filename
        if _user_file(f):
            return f"{f}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown place"


def traceback_location(tb) -> str | None:
    """``file:line in function`` of the innermost user frame of a traceback (outside torch and
    ortmodule), or None."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if _user_file(code.co_filename):
            found = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return found
