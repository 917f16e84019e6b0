"""Export a (trained) module's eval-mode forward to an ONNX file for deployment.

The training graphs ortmodule builds take parameters as graph inputs and keep training semantics;
a deployment graph is the opposite: the EVAL-mode forward (Dropout off, BatchNorm on its running
statistics) with the current weights stored as initializers, runnable by a plain
``onnxruntime.InferenceSession`` with no torch and no ortmodule. ``ORTModule.export_onnx`` calls this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ExportError
from .program import exact_rewrite_rules

__all__ = ["export_inference"]

AUTO = "auto"


def _unwrap(module: nn.Module) -> nn.Module:
    from ..module import ORTModule  # local import: module.py imports this package

    return module.module if isinstance(module, ORTModule) else module


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode; restore each one's own flag afterwards."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


def _flatten_outputs(out: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Tensors of a (nested) output in order, each with a name: ``logits``, ``output_0``, ``a.1``."""
    if isinstance(out, torch.Tensor):
        return [(prefix or "output", out)]
    items: list[tuple[str, Any]]
    if isinstance(out, Mapping):  # dict, transformers' ModelOutput
        items = [(str(k), v) for k, v in out.items()]
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        items = [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    elif isinstance(out, (tuple, list)):
        items = [(str(i) if prefix else f"output_{i}", v) for i, v in enumerate(out)]
    else:
        return []  # None, numbers, strings: not graph outputs
    flat: list[tuple[str, torch.Tensor]] = []
    for key, value in items:
        flat += _flatten_outputs(value, f"{prefix}.{key}" if prefix else key)
    return flat


class _FlatIO(nn.Module):
    """Calls ``module`` with the tensor inputs as flat positional arguments; returns a flat tuple."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, tensor_slots: list) -> None:
        super().__init__()
        self.inner = module
        self.args, self.kwargs, self.slots = list(args), dict(kwargs), tensor_slots
        self.output_names: list[str] = []

    def forward(self, *tensors: torch.Tensor):
        args, kwargs = list(self.args), dict(self.kwargs)
        for (kind, key), t in zip(self.slots, tensors):
            if kind == "arg":
                args[key] = t
            else:
                kwargs[key] = t
        flat = _flatten_outputs(self.inner(*args, **kwargs))
        self.output_names = [n for n, _ in flat]
        return tuple(t for _, t in flat)


def _input_names(module: nn.Module, args: tuple, kwargs: dict) -> tuple[list, list[str], list[torch.Tensor]]:
    try:
        params = [
            p.name for p in inspect.signature(module.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    slots, names, tensors = [], [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            slots.append(("arg", i))
            names.append(params[i] if i < len(params) else f"input_{i}")
            tensors.append(a)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            slots.append(("kwarg", k))
            names.append(k)
            tensors.append(v)
    return slots, names, tensors


def _auto_axes(
    names: list[str], tensors: list[torch.Tensor], output_names: list[str]
) -> dict[str, dict[int, str]]:
    """Dim 0 of every input and output is ``batch``; dim 1 of 2-D+ integer inputs is ``sequence``."""
    axes: dict[str, dict[int, str]] = {}
    for name, t in zip(names, tensors):
        if t.dim() == 0:
            continue
        axes[name] = {0: "batch"}
        if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            axes[name][1] = "sequence"
    for name in output_names:
        axes[name] = {0: "batch"}
    return axes


def export_inference(
    module: nn.Module,
    path: str | os.PathLike,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic_axes: str | dict | None = None,
    optimized_path: str | os.PathLike | None = None,
    opset: int = 20,
    optimization_level: str = "extended",
    exporter: str = "torch.export",
) -> Path:
    """Write ``module``'s eval-mode forward on ``args``/``kwargs`` to ``path`` as ONNX.

    ``module`` may be an ``ORTModule`` (its wrapped module is exported) or any ``nn.Module``. The
    weights become initializers; the module's train/eval state is restored afterwards.

    ``dynamic_axes``: ``None`` (static shapes), ``"auto"`` (dim 0 of every input and output is
    ``batch``, dim 1 of integer inputs of rank >= 2 is ``sequence``), or a torch-style dict
    ``{name: {dim: "label"}}`` over the input names (the ``forward`` parameter names for positional
    tensors, the keys for keyword tensors) and output names (``output``, ``output_<i>``, or the keys
    of a dict / ``ModelOutput``).

    ``optimized_path``: also save the graph ONNX Runtime produces after its graph optimizations at
    ``optimization_level`` (``"basic"``, ``"extended"`` or ``"all"``; ``"all"`` adds layout
    transformations specific to this machine's CPU, so ``"extended"`` is the portable default).
    ``exporter``: ``"torch.export"`` (``torch.onnx.export(dynamo=True)``, the default) or
    ``"torchscript"`` (the legacy tracer, which torch deprecates).
    Returns ``path``.
    """
    inner = _unwrap(module)
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = dict(kwargs or {})
    slots, names, tensors = _input_names(inner, args, kwargs)
    wrapper = _FlatIO(inner, args, kwargs, slots)
    with _eval_mode(inner), torch.no_grad():
        # Output names first (one eager eval call), so that dynamic axes can name them.
        wrapper(*tensors)
        output_names = list(wrapper.output_names)
        if dynamic_axes == AUTO:
            axes = _auto_axes(names, tensors, output_names)
        elif dynamic_axes is None or isinstance(dynamic_axes, Mapping):
            axes = dict(dynamic_axes or {})
            unknown = set(axes) - set(names) - set(output_names)
            if unknown:
                raise ValueError(
                    f"dynamic_axes names {sorted(unknown)} are neither inputs {names} nor outputs {output_names}"
                )
        else:
            raise ValueError(f"dynamic_axes must be None, 'auto' or a dict, not {dynamic_axes!r}")
        if exporter == "torch.export":
            data = _export_dynamo(wrapper, tensors, names, output_names, axes, opset)
        elif exporter == "torchscript":
            data = _export_torchscript(wrapper, tensors, names, output_names, axes, opset)
        else:
            raise ValueError(f"exporter must be 'torch.export' or 'torchscript', not {exporter!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if optimized_path is not None:
        _save_optimized(path, Path(optimized_path), optimization_level)
    return path


def _export_dynamo(wrapper: nn.Module, tensors: list, names: list[str], output_names: list[str],
                   axes: dict, opset: int) -> bytes:
    """torch.onnx's torch.export-based exporter: the eval-mode program, weights as initializers."""
    dynamic_shapes = None
    if axes:
        dim = torch.export.Dim.DYNAMIC
        # one entry: the wrapper's ``*tensors``
        dynamic_shapes = (tuple({d: dim for d in axes.get(name, {})} or None for name in names),)
    try:
        with warnings.catch_warnings(), exact_rewrite_rules(training=False):  # NOTE [near-identity constants]
            warnings.simplefilter("ignore")
            program = torch.onnx.export(wrapper, tuple(tensors), dynamo=True, dynamic_shapes=dynamic_shapes,
                                        input_names=names, output_names=output_names, opset_version=opset,
                                        optimize=True, verbose=False, report=False)
    except Exception as exc:
        # e.g. Python that branches on a size marked dynamic: an error, never a graph that bakes it
        cause = exc.__cause__ or exc
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ExportError(
            f"exporting {type(wrapper.inner).__name__} for deployment with torch.export failed: "
            f"{type(cause).__name__}: {detail}. If the model specialises on a size marked dynamic, pass "
            "dynamic_axes=None (static shapes) or a dict without that axis"
        ) from exc
    model = program.model_proto
    # NOTE [inference axis names]: torch.export names dims s0, s1, ...; the graph keeps the caller's
    # labels ("batch", "sequence", or the dict's) where an input or output dim is one of them.
    labels = {}
    for value in model.graph.input:
        for d, dim_proto in enumerate(value.type.tensor_type.shape.dim):
            label = axes.get(value.name, {}).get(d)
            if label is not None and dim_proto.dim_param:
                labels.setdefault(dim_proto.dim_param, label)
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for d, dim_proto in enumerate(value.type.tensor_type.shape.dim):
            label = axes.get(value.name, {}).get(d) if value.name in output_names else None
            if dim_proto.dim_param in labels:
                dim_proto.dim_param = labels[dim_proto.dim_param]
            elif label is not None and dim_proto.dim_param:
                dim_proto.dim_param = label
    return model.SerializeToString()


def _export_torchscript(wrapper: nn.Module, tensors: list, names: list[str], output_names: list[str],
                        axes: dict, opset: int) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.onnx.export(
            wrapper,
            tuple(tensors),
            buf,
            dynamo=False,
            input_names=names,
            output_names=output_names,
            dynamic_axes=axes or None,
            opset_version=opset,
            training=torch.onnx.TrainingMode.EVAL,
            do_constant_folding=True,
            export_params=True,
            keep_initializers_as_inputs=False,
        )
    return buf.getvalue()


def _save_optimized(src: Path, dst: Path, level: str) -> None:
    """Let ONNX Runtime optimise ``src`` and write the optimised graph to ``dst``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    dst.parent.mkdir(parents=True, exist_ok=True)
    so.optimized_model_filepath = str(dst)
    so.log_severity_level = 3
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
