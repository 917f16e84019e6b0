"""``ortmodule.explain``: will this model run in ORT? Which ops, which lack rules, what falls back."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import onnx_ir as ir
from torch import nn

from .autodiff.builder import differentiable_values
from .autodiff.registry import lookup
from .errors import MODULE_PATH_KEY
from .export import export_module
from .export.torchscript import input_name
from .io import flatten_inputs


@dataclasses.dataclass
class MissingRule:
    op_type: str
    node: str
    module_path: str | None

    def __str__(self) -> str:
        where = f" (torch module '{self.module_path}')" if self.module_path else ""
        return f"{self.op_type} at node '{self.node}'{where}"


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` found; ``str()`` gives a readable report."""

    model: str
    exports: bool
    export_error: str | None = None
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    missing_rules: list[MissingRule] = dataclasses.field(default_factory=list)
    dropout_masks: int = 0
    mutated_buffers: list[str] = dataclasses.field(default_factory=list)

    @property
    def would_fall_back(self) -> bool:
        return not self.exports or bool(self.missing_rules)

    @property
    def fallback_reason(self) -> str | None:
        if not self.exports:
            return f"export failed: {self.export_error}"
        if self.missing_rules:
            return "no gradient rule for " + ", ".join(str(m) for m in self.missing_rules)
        return None

    def __str__(self) -> str:
        lines = [f"ortmodule.explain({self.model})"]
        if not self.exports:
            lines.append(f"  export: FAILED: {self.export_error}")
            lines.append("  would fall back to eager PyTorch")
            return "\n".join(lines)
        total = sum(self.ops.values())
        lines.append(f"  export: ok, {total} nodes, {len(self.ops)} op types")
        lines.append("  ops: " + ", ".join(f"{k}x{v}" for k, v in sorted(self.ops.items())))
        if self.dropout_masks:
            lines.append(f"  dropout masks drawn by torch per step: {self.dropout_masks}")
        if self.mutated_buffers:
            lines.append(f"  buffers updated each step: {', '.join(self.mutated_buffers)}")
        if self.missing_rules:
            lines.append("  ops without a gradient rule (register one in ortmodule/autodiff/rules/):")
            lines.extend(f"    - {m}" for m in self.missing_rules)
            lines.append("  would fall back to eager PyTorch when gradients are needed")
        else:
            lines.append("  every op on a gradient path has a rule: training runs in ONNX Runtime")
        return "\n".join(lines)


def explain(model: nn.Module, *args: Any, **kwargs: Any) -> Explanation:
    """Export ``model`` on the given inputs (no training step, no state change) and report."""
    from .module import ORTModule, module_state

    module = model.module if isinstance(model, ORTModule) else model
    name = type(module).__name__
    flat = flatten_inputs(args, kwargs)
    params, param_names, buffers, buffer_names = module_state(module)
    try:
        exported = export_module(module, flat, params, param_names, buffers, buffer_names)
    except Exception as exc:
        return Explanation(model=name, exports=False, export_error=f"{type(exc).__name__}: {exc}")
    graph = ir.from_proto(exported.model).graph
    ops = collections.Counter(
        (f"{n.domain}::" if n.domain else "") + n.op_type for n in graph
    )
    trainable = {n[0] for n, p in zip(param_names, params) if p.requires_grad}
    trainable.update(input_name(i) for i, t in enumerate(flat.tensors) if t.requires_grad)
    wrt = [v for v in graph.inputs if v.name in trainable]
    active = differentiable_values(graph, wrt)
    missing = []
    for node in graph:
        if any(v in active for v in node.inputs if v is not None) and lookup(node.domain, node.op_type) is None:
            missing.append(MissingRule(node.op_type, node.name, node.metadata_props.get(MODULE_PATH_KEY)))
    return Explanation(
        model=name,
        exports=True,
        ops=dict(ops),
        missing_rules=missing,
        dropout_masks=len(exported.masks),
        mutated_buffers=[buffer_names[i][0] for i in exported.mutated_buffers],
    )


__all__ = ["Explanation", "MissingRule", "explain"]
