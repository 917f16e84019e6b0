"""``ortmodule.explain``: will this model run in ORT? Which ops, which lack rules, what falls back."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any

import onnx_ir as ir
import torch
from torch import nn

from .autodiff.builder import differentiable_values
from .autodiff.registry import lookup
from .errors import MODULE_PATH_KEY
from .export.semantics import MaskSpec
from .export.torchscript import input_name
from .io import flatten_inputs
from .options import DebugOptions, FallbackPolicy, logger
from .recompute import RecomputePlan
from .runtime.torch_nodes import CALL_OP, TORCH_DOMAIN, lookup_call


@dataclasses.dataclass
class MissingRule:
    op_type: str
    node: str
    module_path: str | None

    def __str__(self) -> str:
        where = f" (torch module '{self.module_path}')" if self.module_path else ""
        return f"{self.op_type} at node '{self.node}'{where}"


@dataclasses.dataclass
class TorchNode:
    """A node of the graph that runs in torch (NOTE [torch nodes]): what it calls and why."""

    what: str
    reason: str
    node: str
    module_path: str | None

    def __str__(self) -> str:
        where = f" (torch module '{self.module_path}')" if self.module_path else ""
        return f"{self.what} at node '{self.node}'{where}: {self.reason}"


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` found; ``str()`` gives a readable report.

    ``would_fall_back`` / ``fallback_reason`` are what a call on the same inputs does: explain runs
    the same compile pipeline (export, training graphs when the call needs gradients, sessions).
    """

    model: str
    exports: bool
    export_error: str | None = None
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    missing_rules: list[MissingRule] = dataclasses.field(default_factory=list)
    dropout_masks: int = 0
    random_draws: int = 0  # other random tensors drawn by torch before each run (NOTE [random draws])
    mutated_buffers: list[str] = dataclasses.field(default_factory=list)
    needs_grad: bool = True
    falls_back: bool | None = None  # None: not run through the pipeline (built by hand)
    reason: str | None = None  # the call's Stats.last_fallback_reason
    call_error: str | None = None  # the call raises (not a fallback): e.g. ORT failed at run time
    recompute: RecomputePlan | None = None  # the training graphs' recompute plan (NOTE [recompute])
    torch_nodes: list[TorchNode] = dataclasses.field(default_factory=list)  # NOTE [torch nodes]
    value_checks: list[str] = dataclasses.field(default_factory=list)  # NOTE [value checks]: where each was made
    stored_outputs: list[str] = dataclasses.field(default_factory=list)  # NOTE [stored tensors as outputs]

    @property
    def would_fall_back(self) -> bool:
        if self.falls_back is not None:
            return self.falls_back
        return not self.exports or (self.needs_grad and bool(self.missing_rules))

    @property
    def fallback_reason(self) -> str | None:
        if self.falls_back is not None:
            return self.reason if self.falls_back else None
        if not self.exports:
            return f"export failed: {self.export_error}"
        if self.needs_grad and self.missing_rules:
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
        if self.random_draws:
            lines.append(f"  other random tensors drawn by torch per step: {self.random_draws}")
        if self.mutated_buffers:
            lines.append(f"  buffers updated each step: {', '.join(self.mutated_buffers)}")
        if self.stored_outputs:
            lines.append(f"  tensors the graph returns and sets on the module after each run: "
                         f"{', '.join(self.stored_outputs)}")
        if self.value_checks:
            lines.append(f"  value checks computed in the graph, eager's error raised where one fails "
                         f"({len(self.value_checks)}): {'; '.join(self.value_checks)}")
        if self.missing_rules:
            lines.append("  ops without a gradient rule (register one in ortmodule/autodiff/rules/):")
            lines.extend(f"    - {m}" for m in self.missing_rules)
            if not self.needs_grad:
                lines.append("  (this call needs no gradients, so they do not matter here)")
        if self.torch_nodes:
            lines.append(f"  nodes that run in torch inside the graph ({len(self.torch_nodes)}; the rest runs in ORT):")
            lines.extend(f"    - {t}" for t in self.torch_nodes)
        if self.recompute is not None:
            lines.extend("  " + line for line in self.recompute.table().splitlines())
        if self.call_error is not None:
            lines.append(f"  the call RAISES: {self.call_error}")
        elif self.would_fall_back:
            lines.append(f"  would fall back to eager PyTorch: {self.fallback_reason}")
        elif self.needs_grad:
            lines.append("  training graphs built and sessions created: training runs in ONNX Runtime")
        else:
            lines.append("  forward-only graph (no gradients needed) runs in ONNX Runtime")
        return "\n".join(lines)


def explain(model: nn.Module, *args: Any, **kwargs: Any) -> Explanation:
    """What a call ``model(*args, **kwargs)`` would do, without changing the module's state.

    Runs one call through a fresh wrapper (NOTE [explain runs a call]) and reports its outcome with
    the forward graph's ops, the ops on a gradient path that lack a rule, masks and mutated buffers.
    """
    from .module import _FALLBACK, ORTModule, module_state
    from .verify import StateSnapshot

    wrapper = model if isinstance(model, ORTModule) else None
    module = wrapper.module if wrapper is not None else model
    name = type(module).__name__
    flat = flatten_inputs(args, kwargs)
    params, param_names, buffers, buffer_names = module_state(module)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in [*flat.tensors, *params])
    # NOTE [explain runs a call]: the same pipeline as a call, through a fresh wrapper so the real
    # one's caches and counters stay as they are: export (with its retries), training graphs when
    # the call needs gradients, session creation, one run. The state it changes is put back: buffers
    # and RNG (verify.StateSnapshot); .grad is untouched (no backward); graphs are not saved to disk.
    debug = wrapper.options.debug if wrapper is not None else DebugOptions.from_env()
    debug = dataclasses.replace(debug, save_onnx_dir=None, profile_prefix=None)
    level = logger.level
    devices = {t.device for t in [*flat.tensors, *params]}
    state = StateSnapshot(module, list(devices))
    probe = ORTModule(module, fallback=FallbackPolicy.FALLBACK, debug=debug, verify=False)
    if wrapper is not None:  # the wrapper's recompute policy, not the environment's
        probe._options = dataclasses.replace(probe._options, recompute=wrapper.options.recompute)
    call_error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe(*args, **kwargs)
            if not probe._entries._data and not probe.stats.fallbacks:
                probe(*args, **kwargs)  # NOTE [stored tensors as outputs]: the first graph was this call's only
    except Exception as exc:  # the call itself would raise this
        call_error = f"{type(exc).__name__}: {exc}"
    finally:
        state.restore()
        logger.setLevel(level)
    stats = probe.stats
    entries = [e for e in probe._entries._data.values() if e is not _FALLBACK]
    exports = [e.exported for e in entries] or list(probe._exports._data.values())
    if not exports:
        reason = stats.last_fallback_reason or call_error
        return Explanation(model=name, exports=False, export_error=reason, needs_grad=needs_grad,
                           falls_back=stats.fallbacks > 0, reason=stats.last_fallback_reason,
                           call_error=None if stats.fallbacks else call_error)
    exported = exports[-1]
    plans = [e.graphs.recompute for e in entries if getattr(e, "graphs", None) is not None]
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
    torch_nodes = []
    for node in graph:
        if node.domain == TORCH_DOMAIN and node.op_type == CALL_OP:
            call = lookup_call(node.attributes["key"].as_int())
            torch_nodes.append(TorchNode(call.what, call.reason, node.name, node.metadata_props.get(MODULE_PATH_KEY)))
    return Explanation(
        model=name,
        exports=True,
        torch_nodes=torch_nodes,
        ops=dict(ops),
        missing_rules=missing,
        dropout_masks=sum(isinstance(s, MaskSpec) for s in exported.masks),
        random_draws=sum(not isinstance(s, MaskSpec) for s in exported.masks),
        mutated_buffers=[buffer_names[i][0] for i in exported.mutated_buffers],
        value_checks=list(exported.checks),
        stored_outputs=[f"{path}.{name}" if path else name for path, name in exported.stored],
        needs_grad=needs_grad,
        falls_back=stats.fallbacks > 0,
        reason=stats.last_fallback_reason,
        call_error=call_error,
        recompute=plans[-1] if plans else None,
    )


__all__ = ["Explanation", "MissingRule", "TorchNode", "explain"]
