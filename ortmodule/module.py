"""ORTModule: the transparent wrapper that routes a module's forward/backward to ONNX Runtime."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .export import export_module
from .export.torchscript import input_name, mask_name
from .function import ORTFunction
from .io import flatten_inputs, make_signature
from .runtime.cache import LRUCache
from .runtime.entry import CompiledEntry


@dataclasses.dataclass
class Stats:
    """Counters and timings of one ORTModule (what was built, how often, how long it took)."""

    exports: int = 0
    export_s: float = 0.0
    gradient_builds: int = 0
    gradient_build_s: float = 0.0
    session_create_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0


def _unique_with_names(named: Iterator[tuple[str, torch.Tensor]]):
    """Unique tensors in first-seen order, each with every name it goes by (tied weights)."""
    tensors: list[torch.Tensor] = []
    names: list[list[str]] = []
    index: dict[int, int] = {}
    for name, t in named:
        if t is None:
            continue
        k = id(t)
        if k not in index:
            index[k] = len(tensors)
            tensors.append(t)
            names.append([])
        names[index[k]].append(name)
    return tensors, names


class ORTModule(nn.Module):
    """Wrap ``module`` so that its forward and backward run in ONNX Runtime.

    The first call exports the forward to ONNX, builds the gradient graph and creates the sessions;
    later calls with the same input signature reuse them. Parameters stay owned by ``module``.
    """

    _own_attrs = frozenset({"_original_module", "_entries", "_exports", "_stats"})

    def __init__(self, module: nn.Module, *, cache_size: int = 8) -> None:
        super().__init__()
        if isinstance(module, ORTModule):
            raise TypeError("module is already an ORTModule")
        self._original_module = module
        self._entries: LRUCache[CompiledEntry] = LRUCache(cache_size)
        self._exports: LRUCache = LRUCache(cache_size)
        self._stats = Stats()

    # -- the wrapped module, transparently ------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped ``nn.Module``."""
        return self._modules["_original_module"]

    @property
    def stats(self) -> Stats:
        return self._stats

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_original_module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ORTModule._own_attrs or "_original_module" not in self.__dict__.get("_modules", {}):
            super().__setattr__(name, value)
        else:
            setattr(self._modules["_original_module"], name, value)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def named_children(self):
        return self.module.named_children()

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        return self.module.named_modules(memo, prefix, remove_duplicate)

    # -- the engine ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        flat = flatten_inputs(args, kwargs)
        params, param_names = _unique_with_names(module.named_parameters(remove_duplicate=False))
        buffers, buffer_names = _unique_with_names(module.named_buffers(remove_duplicate=False))
        sig = make_signature(flat, params, buffers, module.training)
        needs_grad = sig.grad_enabled and any(s.requires_grad for s in sig.inputs + sig.params)
        entry = self._entries.get(sig)
        if entry is None:
            self._stats.cache_misses += 1
            entry = self._compile(sig, flat, params, param_names, buffers, buffer_names, needs_grad)
            self._entries.put(sig, entry)
        else:
            self._stats.cache_hits += 1

        exported = entry.exported
        names = tuple(
            [input_name(i) for i in range(len(flat.tensors))]
            + [n[0] for n in param_names]
            + [n[0] for n in buffer_names]
            + [mask_name(i) for i in range(len(exported.masks))]
        )
        device = entry.device
        tensors = [*flat.tensors, *params, *buffers, *(spec.draw(device) for spec in exported.masks)]
        mutated = tuple(buffers[i] for i in exported.mutated_buffers)
        if needs_grad:
            outs = ORTFunction.apply(entry, names, mutated, *tensors)
        else:
            feeds = {n: t.detach() for n, t in zip(names, tensors)}
            results = entry.inference.run(feeds)
            n_user = exported.num_user_outputs
            with torch.no_grad():
                for buf, new in zip(mutated, results[n_user:]):
                    buf.copy_(new)
            outs = results[:n_user]
        return exported.output_spec.rebuild(outs)

    def _compile(self, sig, flat, params, param_names, buffers, buffer_names, needs_grad) -> CompiledEntry:
        key = sig.export_key()
        exported = self._exports.get(key)
        if exported is None:
            t0 = time.perf_counter()
            exported = export_module(self.module, flat, params, param_names, buffers, buffer_names)
            self._stats.export_s += time.perf_counter() - t0
            self._stats.exports += 1
            self._exports.put(key, exported)
        device = _device_of(flat.tensors, params)
        requires_grad = None
        if needs_grad:
            requires_grad = {input_name(i): s.requires_grad for i, s in enumerate(sig.inputs)}
            requires_grad.update({n[0]: s.requires_grad for n, s in zip(param_names, sig.params)})
            self._stats.gradient_builds += 1
        return CompiledEntry(exported, device, requires_grad, stats=self._stats)


def _device_of(inputs, params) -> torch.device:
    for t in list(params) + list(inputs):
        return t.device
    return torch.device("cpu")
