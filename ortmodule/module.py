"""ORTModule: the transparent wrapper that routes a module's forward/backward to ONNX Runtime."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import onnx
import psutil
import torch
from torch import nn

from .errors import CaptureError, ExportError, GradientRuleError, ORTModuleError, user_stacklevel
from .export import export_module
from .export.draws import python_random_watch
from .export.dynamic import DynamicExport, non_batch_dims
from .export.program import export_program
from .export.torchscript import ExportedModel, grad_mask, input_name, mask_name
from .export.traps import nested_fast_path_reason
from .function import ORTFunction, ValueCheckFailed, check_values, functorch_level, write_back
from .guards import (
    atomic_attributes,
    buffer_slots,
    find_change,
    hook_managed,
    mark_stored,
    plain_tensors,
    put_back_attributes,
    reassigned,
    snapshot,
    stored_names,
    stored_tensors_message,
    tensor_slots,
    watch_buffer_rebinds,
)
from .io import flatten_inputs, make_signature
from .options import DebugOptions, FallbackPolicy, Options, VerifyTolerance, logger
from .runtime import disk_cache
from .runtime.cache import LRUCache
from .runtime.disk_cache import DiskCache
from .runtime.entry import CompiledEntry
from .runtime.segments import has_torch_nodes, torch_node_count
from .runtime.torch_nodes import UnseenDraws
from .verify import Verification

_CONSTANT_TYPES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, slice, type(...))
_FALLBACK = object()  # cache marker: this signature runs eagerly
_ORT_RUN_FAILURE = "Non-zero status code returned while running"  # onnxruntime's message for a failed node


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
    fallbacks: int = 0
    last_fallback_reason: str | None = None
    peak_rss_mb: float = 0.0  # sampled when graphs are built and every 64th cached call
    verifications: int = 0  # verify mode: first calls of new graphs checked against eager
    verify_s: float = 0.0
    disk_cache_hits: int = 0  # graphs loaded from the persistent cache (NOTE [persistent cache])
    disk_cache_stores: int = 0  # ... and written to it
    torch_nodes: int = 0  # torch nodes (NOTE [torch nodes]) in the forward graphs built so far

    @property
    def reexports(self) -> int:
        """Exports after the first one (a new signature, module layout or mode)."""
        return max(self.exports - 1, 0)

    def update_rss(self) -> None:
        rss = psutil.Process().memory_info().rss / 2**20
        self.peak_rss_mb = max(self.peak_rss_mb, rss)


def module_state(module: nn.Module):
    """(params, param_names, buffers, buffer_names) of ``module``: unique tensors, all their names."""
    params, param_names = _unique_with_names(module.named_parameters(remove_duplicate=False))
    buffers, buffer_names = _unique_with_names(module.named_buffers(remove_duplicate=False))
    return params, param_names, buffers, buffer_names


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


@contextlib.contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """NOTE [gc during compile]: an export allocates hundreds of thousands of objects (FX graphs, sympy
    expressions, ONNX IR), which trigger Python's full cyclic collections; each walks every object of
    the process (torch, transformers, ...). Measured on BERT's first call: two full collections took
    0.44 s of 2.76 s; without them the call took 2.28 s. The collector is paused while a graph is
    compiled and resumed after (if it was on): the cycles made meanwhile are collected later, as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_CHANGES_WARNED = 3

# NOTE [functorch transforms]: torch.func's grad / vmap / jacrev / jvp wrap the tensors and run the
# forward at a transform level; the ORT graph behind an autograd.Function cannot be seen through
# (torch raised "must override the setup_context staticmethod", which names no cause). Such a call runs
# the eager forward, which the transforms can trace, with one fallback warning; plain calls keep
# running in ORT. ``torch.func.functional_call`` alone is no transform: it swaps the parameters, which
# the module guard sees (NOTE [module guards]).
_FUNCTORCH = ("a torch.func transform (grad, vmap, jacrev, jvp, ...) is active: it cannot see through the "
              "ONNX Runtime graph, so this call runs the eager forward (plain calls stay in ORT)")



def _put_back_stored(module: nn.Module, before: dict, buffers: dict) -> tuple[list, list]:
    """Put back the tensors the trace stored on the module (``before``: a :func:`tensor_slots` of it) and
    the buffers it bound anew (``buffers``: a :func:`buffer_slots`); return both as (path, name) lists."""
    modules = dict(module.named_modules())
    rebound = reassigned(buffers, buffer_slots(module))
    for path, name in rebound:
        modules[path]._buffers[name] = buffers[(path, name)]
    now = tensor_slots(module)
    stored = stored_names(before, now)
    for path, name in stored:
        m, value = modules[path], now[(path, name)][0]
        if (path, name) in before:
            old, _, contents = before[(path, name)]
            if old is value and isinstance(value, list):
                value[:] = contents
            elif old is value and isinstance(value, dict):
                value.clear()
                value.update(contents)
            else:
                setattr(m, name, old)
        elif isinstance(value, dict):  # a container that was there without tensors: emptied of them
            for k in [k for k, x in value.items() if isinstance(x, torch.Tensor)]:
                del value[k]
        elif isinstance(value, list):
            value[:] = [x for x in value if not isinstance(x, torch.Tensor)]
        else:
            m.__dict__.pop(name, None)
    return stored, rebound


def _refuse_stored_tensors(module: nn.Module, entry, before: dict, buffers: dict) -> object:
    """Put back what the trace stored on the module or bound to its buffers; a signature whose forward
    does either falls back naming them (NOTE [stored tensors], NOTE [buffer reassigned]), unless the
    graph returns them (NOTE [stored tensors as outputs])."""
    stored, rebound = _put_back_stored(module, before, buffers)
    outputs = set(entry.exported.stored) if isinstance(entry, CompiledEntry) else set()
    refused = [k for k in stored if k not in hook_managed(module) and k not in outputs]  # put back, but traced
    if isinstance(entry, ORTModuleError) or not (refused or rebound):
        return entry
    return ExportError(stored_tensors_message(type(module).__name__, refused, rebound))


def _put_back_tensors(tensors: list, saved: list) -> list[str]:
    """Undo the trace's in-place writes into plain tensor attributes; return their paths."""
    written = [(path, t, s) for (path, t, version), s in zip(tensors, saved) if t._version != version]
    with torch.no_grad():
        for _, t, s in written:
            t.copy_(s)
    return [path for path, _, _ in written]


def _refuse_grad_leaves(module: nn.Module, tensors: list) -> ExportError | None:
    """NOTE [tensor constants] (guards.py): a plain tensor attribute made with ``requires_grad=True``
    (not an nn.Parameter) is a constant of the graph, which has no gradient for it (the TorchScript
    tracer refuses it outright): the module falls back, naming it."""
    leaves = [path for path, t, _ in tensors if t.requires_grad]
    if not leaves:
        return None
    return ExportError(f"{type(module).__name__} holds the tensor attribute(s) {leaves} with requires_grad=True "
                       "that are not nn.Parameters: a compiled graph holds them as constants, without a gradient. "
                       "Wrap them in nn.Parameter (NOTE [tensor constants])")


def _refuse_written_tensors(module: nn.Module, entry, tensors: list, saved: list):
    """NOTE [tensor constants] (guards.py): a plain tensor attribute the forward writes in place (a
    counter or memory kept as ``self.count = torch.zeros(())``) was written by the trace as well as by
    eager's run after a fallback (twice on the first call), and a graph cannot replay the write: the
    trace's writes are undone and the signature falls back, naming the attribute."""
    written = _put_back_tensors(tensors, saved)
    if not written or isinstance(entry, ORTModuleError):
        return entry
    return ExportError(f"{type(module).__name__}.forward writes the plain tensor attribute(s) {written} in place; a "
                       "compiled graph holds them as constants and cannot replay the write. Register them with "
                       "register_buffer (NOTE [tensor constants])")


class ORTModule(nn.Module):
    """Wrap ``module`` so that its forward and backward run in ONNX Runtime.

    The first call exports the forward to ONNX, builds the gradient graph and creates the sessions;
    later calls with the same input signature reuse them. Parameters stay owned by ``module``.
    """

    # NOTE [own attributes]: every other attribute set on the wrapper goes to the wrapped module.
    _own_attrs = frozenset({"_original_module", "_entries", "_built", "_exports", "_dynamic", "_first_seen", "_stats",
                            "_options", "_lock", "_warned", "_guard", "_exported_guard", "_call",
                            "_recheck", "_changes"})

    def __init__(
        self,
        module: nn.Module,
        *,
        fallback: str | FallbackPolicy | None = None,
        cache_size: int | None = None,
        debug: DebugOptions | None = None,
        verify: bool | None = None,
        verify_tolerance: VerifyTolerance | None = None,
        frontend: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        memory_opt_level: int | None = None,
        memory_opt_config: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"ORTModule wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, ORTModule):
            raise TypeError("module is already an ORTModule")
        inner = _sharded_inside(module)
        if inner is not None:
            raise ValueError(_SHARDED_INSIDE.format(inner))
        self._original_module = module
        self._register_load_state_dict_pre_hook(ORTModule._unwrap_keys, with_module=True)
        self._options = Options.resolve(fallback, cache_size, debug, verify, verify_tolerance, frontend,
                                        cache_dir, memory_opt_level, memory_opt_config)
        self._init_runtime_state()
        self._expose_signature()

    def _expose_signature(self) -> None:
        """``inspect.signature(wrapper.forward)`` is the wrapped forward's (HF Trainer reads it to
        choose the batch columns). NOTE [own attributes]: stored in __dict__, rebuilt on unpickle."""
        module = self._modules["_original_module"]

        @torch.compiler.disable  # NOTE [graph break]
        def forward(*args: Any, **kwargs: Any) -> Any:
            return ORTModule.forward(self, *args, **kwargs)

        try:
            forward.__signature__ = inspect.signature(module.forward)
        except (TypeError, ValueError):
            pass
        forward.__doc__ = module.forward.__doc__
        self.__dict__["forward"] = forward

    def _init_runtime_state(self) -> None:
        self._entries: LRUCache = LRUCache(self._options.cache_size)  # full signature -> entry
        self._built: LRUCache = LRUCache(self._options.cache_size)  # (export, grad mask) -> entry
        self._exports: LRUCache = LRUCache(self._options.cache_size)  # export key -> ExportedModel
        self._dynamic: LRUCache = LRUCache(self._options.cache_size)  # shapeless key -> DynamicExport
        self._first_seen: LRUCache = LRUCache(self._options.cache_size)  # shapeless key -> first shapes
        self._stats = Stats()
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        # NOTE [side effects]: the module's plain attributes when this call's export began, and the
        # traces run since (an object: ints here would be counted as the module's own counters)
        self._call: _CallTraces | None = None
        self._recheck: set = set()  # signatures whose trace changed module attributes (NOTE [side effects])
        self._guard: tuple | None = None  # NOTE [module guards]: the last call's snapshot
        self._exported_guard: tuple | None = None  # ... and the one the compiled graphs stand for
        self._changes = 0  # module changes that dropped the compiled graphs

    # NOTE [pickling]: sessions cannot be pickled or deep-copied; a copy keeps the module and the
    # options and rebuilds its graphs on first use.
    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_entries", "_built", "_exports", "_dynamic", "_first_seen", "_stats", "_lock", "_warned", "_guard",
                  "_exported_guard", "forward"):
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime_state()
        self._expose_signature()

    @property
    def options(self) -> Options:
        return self._options

    def end_profiling(self) -> list[str]:
        """Stop ORT's profiler (``DebugOptions.profile_prefix``) on every session; the JSON files."""
        files = []
        with self._lock:
            for entry in self._built._data.values():
                files.extend(entry.end_profiling())
        return files

    def clear_cache(self) -> None:
        """Drop every compiled entry: the next call re-exports."""
        with self._lock:
            for cache in (self._entries, self._built, self._exports, self._dynamic, self._first_seen):
                cache.clear()

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
        # ``__class__`` too is the wrapper's: fully_shard(wrapper) makes it an FSDPModule subclass.
        if name in ORTModule._own_attrs or "_original_module" not in self.__dict__.get("_modules", {}) \
                or name in self.__dict__ or (name.startswith("__") and name.endswith("__")):
            super().__setattr__(name, value)
        else:
            setattr(self._modules["_original_module"], name, value)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    @staticmethod
    def _unwrap_keys(module, state_dict, prefix, *args) -> None:
        """NOTE [nested wrapper]: a module holding an ORTModule saves ``body.0.weight`` (state_dict goes
        through the wrapper), but torch's loader walks ``_modules`` and looks for
        ``body._original_module.0.weight``; this load pre-hook renames the keys under the wrapper."""
        inner = prefix + "_original_module."
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + key[len(prefix):]] = state_dict.pop(key)

    def _fqn_modifiers(self) -> dict[str, str]:
        """NOTE [nested wrapper]: torch.distributed.checkpoint's state-dict helpers (get_state_dict /
        set_state_dict, used with FSDP) name state by walking the module tree; this hides the
        ``_original_module`` level there as state_dict() and named_parameters() do."""
        return dict.fromkeys(self.module._modules, "_original_module")

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        """Registers on the wrapped module (the wrapper is transparent: named_buffers, state_dict)."""
        if "_original_module" not in self.__dict__.get("_modules", {}):
            return super().register_buffer(name, tensor, persistent)
        self.module.register_buffer(name, tensor, persistent)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Registers on the wrapped module, like :meth:`register_buffer`."""
        if "_original_module" not in self.__dict__.get("_modules", {}):
            return super().register_parameter(name, param)
        self.module.register_parameter(name, param)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    # -- the engine ------------------------------------------------------------------------------
    # NOTE [graph break]: under torch.compile the wrapper's call is one clean graph break: dynamo runs
    # it as it is instead of tracing into ortmodule's Python (timers, caches, ORT sessions).
    @torch.compiler.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if functorch_level() is not None:  # NOTE [functorch transforms]
            self._fall_back(ExportError(_FUNCTORCH))
            return module(*args, **kwargs)
        flat = flatten_inputs(args, kwargs)
        with self._lock:
            # Read under the lock: torch.export puts fake tensors in the module's parameters while
            # another thread captures it (NOTE [one capture at a time] in export/program.py).
            params, param_names, buffers, buffer_names = module_state(module)
            modes, guard = snapshot(module)
            layout = tuple(n for group in param_names + buffer_names for n in group)
            sig = make_signature(flat, params, buffers, layout, modes, _autocast_state())
            needs_grad = sig.grad_enabled and any(s.requires_grad for s in sig.inputs + sig.params)
            if guard != self._guard:  # NOTE [module guards]
                change = None if self._exported_guard is None else find_change(module, self._exported_guard, guard)
                if change is not None:
                    logger.info("module changed (%s): compiled graphs dropped, exporting again", change)
                    self.clear_cache()
                    self._exported_guard = None
                    self._changes += 1
                    if self._changes == _CHANGES_WARNED:
                        # NOTE [module guards]: each change is a new export (seconds); one made every
                        # step (a tensor attribute filled in place, a flag flipped) would be silent slowness
                        warnings.warn(
                            f"ORTModule: {type(module).__name__} changed between calls {self._changes} times "
                            f"(last: {change}); each change drops the compiled graphs and exports again. "
                            "Register tensors the forward reads with register_buffer (they are then inputs) "
                            "and keep flags fixed while training", UserWarning, stacklevel=user_stacklevel())
                self._guard = guard
            entry = self._entries.get(sig)
            fresh = entry is None  # verify mode checks a new graph's first call (ortmodule/verify.py)
            if entry is None:
                attrs = atomic_attributes(module)
                tensors = plain_tensors(module)
                saved = [t.detach().clone() for _, t, _ in tensors]
                slots, buffer_refs = tensor_slots(module), buffer_slots(module)
                refused = _refuse_grad_leaves(module, tensors)
                if refused is not None and self._options.fallback is FallbackPolicy.RAISE:
                    raise refused
                self._call = _CallTraces(attrs)
                try:
                    entry = refused or self._compile_or_fallback(sig, flat, params, param_names, buffers,
                                                                 buffer_names, needs_grad)
                except BaseException:
                    put_back_attributes(module, attrs)  # nothing ran: nothing was written
                    _put_back_tensors(tensors, saved)
                    _put_back_stored(module, slots, buffer_refs)
                    raise
                finally:
                    self._call = None
                refused = _refuse_stored_tensors(module, _refuse_written_tensors(module, entry, tensors, saved), slots,
                                                 buffer_refs)
                if refused is not entry and self._options.fallback is FallbackPolicy.RAISE:
                    raise refused
                entry = refused
                if isinstance(entry, CompiledEntry) and entry.exported.stored and not entry.exported.stored_provisional:
                    mark_stored(module, entry.exported.stored)  # before the guard's snapshot below
                if isinstance(entry, ORTModuleError):
                    put_back_attributes(module, attrs)  # the eager forward below makes the writes, once
                if not isinstance(entry, ORTModuleError):
                    self._stats.cache_misses += 1  # counted once built or fallen back: a call that raised is none
                    self._entries.put(sig, entry)
                # The trace ran the forward, which may set attributes (caches, counters): the graph
                # stands for the module as the trace left it.
                if not isinstance(entry, ORTModuleError) and _counts(attrs, atomic_attributes(module)):
                    self._recheck.add(sig)  # NOTE [side effects]
                self._guard = self._exported_guard = snapshot(module)[1]
            else:
                self._stats.cache_hits += 1
                if self._stats.cache_hits % 64 == 0:  # psutil costs ~20 us: sample, don't poll
                    self._stats.update_rss()
                if self._recheck and sig in self._recheck and entry is not _FALLBACK:
                    self._recheck.discard(sig)
                    return self._side_effect_check(sig, module, args, kwargs)
        if isinstance(entry, ORTModuleError):
            # Nothing could be compiled: the eager forward decides (NOTE [user errors]). An error it
            # raises is the user's (a wrong input), raised as eager raises it, and no fallback; if it
            # runs, this signature falls back, with one warning naming the cause.
            out = module(*args, **kwargs)
            with self._lock:
                self._stats.cache_misses += 1
                self._entries.put(sig, self._fall_back(entry))
                self._guard = self._exported_guard = snapshot(module)[1]
            return out
        if entry is _FALLBACK:
            out = module(*args, **kwargs)
            # What the eager forward itself changed is no change.
            self._guard = self._exported_guard = snapshot(module)[1]
            return out

        exported = entry.exported
        if exported.nested_fast_paths:
            why = nested_fast_path_reason(module, exported.nested_fast_paths)  # NOTE [nested fast path]
            if why is not None:
                self._fall_back(ExportError(why))
                return module(*args, **kwargs)
        names = tuple(
            [input_name(i) for i in range(len(flat.tensors))]
            + [n[0] for n in param_names]
            + [n[0] for n in buffer_names]
            + [mask_name(i) for i in range(len(exported.masks))]
        )
        device = entry.device
        check = None
        if fresh and self._options.verify:  # NOTE [verify leaves no trace]: before the masks are drawn
            check = Verification(self, sig, flat.tensors, params, param_names, args, kwargs, device)
        # NOTE [value checks], NOTE [run errors]: an eager forward that raises eager's error starts where
        # eager's would, the draws of the masks and of torch nodes undone (~1 us)
        rng = _rng_states(device) if exported.masks or exported.checks or entry.has_torch_nodes else None
        masks = [spec.draw(device, flat.tensors) for spec in exported.masks]
        tensors = [*flat.tensors, *params, *buffers, *masks]
        mutated = tuple(buffers[i] for i in exported.mutated_buffers)
        try:
            if needs_grad and entry.graphs is not None:  # NOTE [no float outputs]
                outs = ORTFunction.apply(entry, names, mutated, *tensors)
            else:
                feeds = {n: t.detach() for n, t in zip(names, tensors)}
                results = entry.inference.run(feeds)
                n_user = exported.num_user_outputs
                check_values(exported, results, len(mutated))
                write_back(mutated, results[n_user : n_user + len(mutated)])
                outs = results[:n_user]
        except (ValueCheckFailed, UnseenDraws) as exc:  # nothing was written back: eager runs this call
            _set_rng_states(rng)
            if isinstance(exc, UnseenDraws):  # NOTE [custom ops]: and the next ones
                with self._lock:
                    self._entries.put(sig, self._fall_back(ExportError(str(exc))))
            out = module(*args, **kwargs)  # NOTE [value checks]: raises eager's own error
            self._guard = self._exported_guard = snapshot(module)[1]
            return out
        except RuntimeError as exc:
            if _ORT_RUN_FAILURE not in str(exc):
                raise
            # NOTE [run errors]: an input the graph cannot take (an index out of range) fails inside
            # onnxruntime, with its node's message. Eager's own error names the user's line: the
            # eager forward runs on the same inputs and raises it. If eager runs, the failure is
            # ortmodule's and is raised as it is.
            _set_rng_states(rng)
            module(*args, **kwargs)
            raise
        if exported.stored:  # NOTE [stored tensors as outputs]
            n_user = exported.num_user_outputs
            for (path, name), t in zip(exported.stored, outs[n_user - len(exported.stored):n_user]):
                setattr(module.get_submodule(path), name, t)
            if exported.stored_provisional:
                self.clear_cache()
        result = exported.output_spec.rebuild(outs, flat.tensors)
        if check is not None:
            try:
                check.finish(result)
            finally:  # what the eager run itself changed is no change, as for a fallback
                self._guard = self._exported_guard = snapshot(module)[1]
        return result

    def _compile_or_fallback(self, sig, flat, params, param_names, buffers, buffer_names, needs_grad):
        try:
            bad = [type(x).__name__ for x in flat.template if not isinstance(x, _CONSTANT_TYPES)]
            if bad:
                raise ExportError(
                    f"unsupported input type(s) {sorted(set(bad))}: inputs must be tensors, Python "
                    "scalars/strings/None, or tuples, lists, dicts and dataclasses of them"
                )
            inner = _sharded_inside(self.module)
            if inner is not None:
                raise ExportError(_SHARDED_INSIDE.format(inner))
            if self._options.frontend == "torchscript" and _is_fsdp(self):
                raise ExportError("fully_shard(wrapper) needs the torch.export front end (frontend='export', the "
                                  "default): the TorchScript tracer cannot trace FSDP's gathered parameters")
            with _no_gc_pauses():
                entry = self._compile(sig, flat, params, param_names, buffers, buffer_names, needs_grad)
        except (ExportError, GradientRuleError) as exc:
            if self._options.fallback is FallbackPolicy.RAISE and not isinstance(exc, CaptureError):
                raise
            return exc  # the eager forward decides (see forward)
        self._stats.update_rss()
        return entry

    def _side_effect_check(self, sig, module: nn.Module, args, kwargs):
        """NOTE [side effects]: the trace changed a number the module holds. A warn-once flag or a
        label set once (HF's ``config.problem_type``) is not a number and is left alone; a counter
        (``self.step += 1``, read to anneal a temperature) changes on every call, which a graph cannot
        replay: the graph would keep the traced value and the counter would stop moving, without a
        word. So the second call of such a signature runs eagerly (as eager would) and watches: an
        attribute changed again makes the signature fall back, naming it."""
        before = snapshot(module)[1]
        out = module(*args, **kwargs)
        after = snapshot(module)[1]
        with self._lock:
            change = find_change(module, before, after) if after != before else None
            if change is not None:
                self._entries.put(sig, self._fall_back(ExportError(
                    f"{type(module).__name__}.forward changes {change} on every call (a Python side effect such "
                    "as a step counter), which a compiled graph cannot replay; this input signature runs eagerly")))
            self._guard = self._exported_guard = after
        return out

    def _fall_back(self, exc: ORTModuleError):
        """Record a fallback (one warning per cause), or raise ``exc`` under fallback='raise'."""
        if self._options.fallback is FallbackPolicy.RAISE:
            raise exc
        self._stats.fallbacks += 1
        self._stats.last_fallback_reason = str(exc)
        key = f"{type(exc).__name__}: {exc}"
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"ORTModule falls back to eager PyTorch for {type(self.module).__name__}: {key} "
                "(set fallback='raise' or ORTMODULE_FALLBACK=raise to make this an error)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        self._stats.update_rss()
        return _FALLBACK

    def _compile(self, sig, flat, params, param_names, buffers, buffer_names, needs_grad) -> CompiledEntry:
        args = (flat, params, param_names, buffers, buffer_names)
        exported = self._export_for(sig, *args)
        if exported.grad_mask is not None and exported.grad_mask != grad_mask(flat.tensors, params):
            raise ExportError(
                "the graph was exported with a reentrant torch.utils.checkpoint whose gradients depend on "
                "which inputs and parameters require grad, and that changed since; use use_reentrant=False"
            )
        device = _device_of(flat.tensors, params)
        requires_grad = None
        if needs_grad and not _float_outputs(exported):
            needs_grad = False  # NOTE [no float outputs]
        if needs_grad:
            requires_grad = {input_name(i): s.requires_grad for i, s in enumerate(sig.inputs)}
            requires_grad.update({n[0]: s.requires_grad for n, s in zip(param_names, sig.params)})
        key = (id(exported), None if requires_grad is None else tuple(sorted(requires_grad.items())))
        entry = self._built.get(key)
        if entry is not None:
            return entry
        try:
            entry = self._build(exported, device, requires_grad)
        except GradientRuleError:
            if not exported.dynamic:
                raise
            exported, entry = self._build_less_dynamic(sig, args, exported, device, requires_grad)
            self._exports.put(sig.export_key(), exported)
            key = (id(exported), key[1])
        self._built.put(key, entry)
        return entry

    def _build_less_dynamic(self, sig, args, failed, device, requires_grad) -> tuple[ExportedModel, CompiledEntry]:
        """A rule needs static sizes of ``failed`` (a dynamic graph): build a batch-dynamic graph
        (NOTE [batch-dynamic graphs]) or, if that fails too, a static one for this signature."""
        shapeless = sig.shapeless()
        if not failed.batch_only:
            exported = self._export(sig, *args, dynamic=True, batch_only=True)
            try:
                entry = self._build(exported, device, requires_grad)
            except GradientRuleError:
                pass
            else:
                dyn = self._dynamic.get(shapeless)
                if dyn is None or dyn.reference is failed:
                    # Under the shape-less key it marks the model batch-dynamic; under its sizes it
                    # serves (and is verified for) other batch sizes of them.
                    start = DynamicExport.start(exported, sig.shapes())
                    self._dynamic.put(shapeless, start)
                    self._dynamic.put((shapeless, non_batch_dims(sig.shapes())), start)
                return exported, entry
        dyn = self._dynamic.get(shapeless)
        if dyn is not None:
            dyn.static = True
        exported = self._export(sig, *args, dynamic=False)
        return exported, self._build(exported, device, requires_grad)

    def _disk_cache(self) -> DiskCache | None:
        folder = self._options.cache_dir
        return None if folder is None else DiskCache(folder)

    def _build(self, exported, device, requires_grad) -> CompiledEntry:
        disk = self._disk_cache() if exported.cache_key is not None and requires_grad is not None else None
        key = prebuilt = None
        if disk is not None:  # NOTE [persistent cache]
            key = disk_cache.training_key(exported, requires_grad, self._options.recompute)
            prebuilt = disk.load("training", key)
            if prebuilt is not None:
                self._stats.disk_cache_hits += 1
        if requires_grad is not None and prebuilt is None:
            self._stats.gradient_builds += 1
        try:
            entry = CompiledEntry(exported, device, requires_grad, stats=self._stats,
                                  profile_prefix=self._options.debug.profile_prefix, prebuilt=prebuilt,
                                  recompute=self._options.recompute)
        except ORTModuleError:
            raise
        except Exception as exc:  # partition/shape bookkeeping on a graph we did not foresee
            raise GradientRuleError(f"building the training graphs failed: {type(exc).__name__}: {exc}") from exc
        self._save_graphs(entry)
        forward = entry.graphs.forward if entry.graphs is not None else exported.model
        self._stats.torch_nodes += torch_node_count(forward)
        try:
            # Sessions are created now, not on first use, so that a graph onnxruntime cannot load
            # (e.g. no kernel for an op at this dtype) falls back here instead of failing mid-step.
            entry.create_sessions()
        except Exception as exc:
            raise ExportError(f"onnxruntime could not load the graph: {type(exc).__name__}: {exc}") from exc
        if key is not None and prebuilt is None and disk.store("training", key, (entry.graphs, entry.backward_model)):
            self._stats.disk_cache_stores += 1
        return entry

    def _export_for(self, sig, flat, params, param_names, buffers, buffer_names) -> ExportedModel:
        """The forward graph for ``sig``: cached, shared across shapes where verified, or new."""
        args = (flat, params, param_names, buffers, buffer_names)
        key = sig.export_key()
        exported = self._exports.get(key)
        if exported is not None:
            return exported
        shapeless, shapes = sig.shapeless(), sig.shapes()
        dkey = shapeless
        dyn = self._dynamic.get(dkey)
        batch_only = dyn is not None and dyn.batch_only
        if batch_only:  # NOTE [batch-dynamic graphs]: one graph per set of non-batch sizes
            dkey = (shapeless, non_batch_dims(shapes))
            dyn = self._dynamic.get(dkey)
        if dyn is not None and dyn.covers(shapes):
            exported = dyn.served(shapes)
        elif dyn is None and self._static_first(dkey, shapes):
            exported = self._export(sig, *args, dynamic=False)
        else:
            exported = self._export(sig, *args, dynamic=dyn is None or not dyn.static, batch_only=batch_only)
            if dyn is None:
                if exported.dynamic:
                    self._dynamic.put(dkey, DynamicExport.start(exported, shapes))
            elif dyn.verify(exported, shapes):
                logger.info("graph verified shape-generic for dims %s", sorted(dyn.verified))
                exported = dyn.served(shapes)
        self._exports.put(key, exported)
        return exported

    def _static_first(self, dkey, shapes) -> bool:
        """NOTE [static first]: with the torch.export front end, the first shapes of a signature get a
        static export; the first call at other shapes exports with symbolic sizes, whose guards then
        serve every shape they admit. Symbolic shapes made BERT's first export 2.1 s instead of 0.75 s
        (first call 4.0 s -> 2.5 s), and a training loop at one shape never needs them. The
        TorchScript front end has no guards: its dynamic graph serves other shapes only after a second
        export verified it (NOTE [dynamic shapes]), so it stays dynamic from the start."""
        if self._options.frontend != "export" or self._first_seen.get(dkey) is not None:
            return False
        self._first_seen.put(dkey, shapes)
        return True

    def _export(self, sig, flat, params, param_names, buffers, buffer_names, *, dynamic: bool,
                batch_only: bool = False) -> ExportedModel:
        args = (sig, flat, params, param_names, buffers, buffer_names)
        disk = self._disk_cache()
        if disk is None:
            return self._run_export(*args, dynamic=dynamic, batch_only=batch_only)
        # NOTE [persistent cache]: the key is taken before the export runs the forward (which may set
        # attributes), in every process alike.
        key = disk_cache.export_key(self.module, sig.export_key(), self._options.frontend,
                                       (dynamic, batch_only, self._options.torch_nodes))
        exported = disk.load("export", key)
        if exported is None:
            with disk.exclusive(key):
                exported = disk.load("export", key)  # another process may have built it meanwhile
                if exported is None:
                    exported = self._run_export(*args, dynamic=dynamic, batch_only=batch_only)
                    if has_torch_nodes(exported.model):  # NOTE [torch nodes]: a per-process table
                        logger.info("%s's graph holds torch nodes: not written to the compile cache",
                                    type(self.module).__name__)
                        return exported
                    if exported.stored_provisional:  # NOTE [stored tensors as outputs]: this call's only
                        return exported
                    exported.cache_key = key
                    sources = disk_cache.source_files(self.module, exported.source_files)
                    if disk.store("export", key, exported, sources):
                        self._stats.disk_cache_stores += 1
                    return exported
        disk_cache.register_output_types(exported.output_spec.spec)
        self._stats.disk_cache_hits += 1
        logger.info("loaded %s's graph from the compile cache %s", type(self.module).__name__, disk.folder)
        return exported

    def _run_export(self, sig, flat, params, param_names, buffers, buffer_names, *, dynamic: bool,
                    batch_only: bool = False) -> ExportedModel:
        t0 = time.perf_counter()
        if self._call is not None:  # NOTE [side effects]: a call's trace writes once
            if self._call.traces:
                put_back_attributes(self.module, self._call.attrs)
            self._call.traces += 1
        with python_random_watch(type(self.module).__name__), watch_buffer_rebinds(self.module) as rebinds, \
                self._autocast_for_export(sig, _device_of(flat.tensors, params)):
            if self._options.frontend == "export":
                exported = export_program(self.module, flat, params, param_names, buffers, buffer_names,
                                          dynamic=dynamic, batch_only=batch_only,
                                          torch_nodes=self._options.torch_nodes)
            else:
                exported = export_module(self.module, flat, params, param_names, buffers, buffer_names,
                                         dynamic=dynamic, batch_only=batch_only)
        if rebinds:  # NOTE [buffer reassigned]
            raise ExportError(stored_tensors_message(type(self.module).__name__, [], sorted(set(rebinds))))
        self._stats.export_s += time.perf_counter() - t0
        self._stats.exports += 1
        logger.info("exported %s in %.3f s", type(self.module).__name__, time.perf_counter() - t0)
        return exported

    def _autocast_for_export(self, sig, device: torch.device):
        """NOTE [autocast]: the trace runs in the caller's autocast context, so the graph gets its
        casts and computes in half precision, except where the execution provider has no kernels:
        onnxruntime's CPU provider has (almost) no bfloat16 kernels, so CPU bf16 autocast is turned
        off for the export, with one warning, and the model computes in fp32."""
        if device.type == "cpu" and ("cpu", torch.bfloat16) in sig.autocast:
            if "autocast-bf16" not in self._warned:
                self._warned.add("autocast-bf16")
                warnings.warn(
                    "ORTModule: onnxruntime's CPU provider has no bfloat16 kernels for MatMul/Gemm/Add/"
                    "Softmax; under torch.autocast('cpu', dtype=torch.bfloat16) the model runs in float32 "
                    "(use dtype=torch.float16 on CPU, or bf16 on CUDA)",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
            return torch.autocast("cpu", enabled=False)
        return contextlib.nullcontext()

    def _save_graphs(self, entry: CompiledEntry) -> None:
        folder = self._options.debug.save_onnx_dir
        if not folder:
            return
        os.makedirs(folder, exist_ok=True)
        n = self._stats.cache_misses + 1  # the miss being built
        base = os.path.join(folder, f"{type(self.module).__name__}_{n}")
        onnx.save(entry.exported.model, f"{base}_inference.onnx")
        if entry.graphs is not None:
            onnx.save(entry.graphs.forward, f"{base}_forward.onnx")
            onnx.save(entry.backward_model, f"{base}_backward.onnx")  # as its session runs it
        logger.info("saved graphs to %s_*.onnx", base)

    def export_onnx(self, path, *args: Any, dynamic_axes="auto", optimized_path=None, **kwargs: Any):
        """Write the wrapped module's EVAL-mode forward on ``args``/``kwargs`` to ``path`` for
        deployment with a plain ``onnxruntime.InferenceSession`` (weights as initializers; dynamic
        batch/sequence axes by default). See :func:`ortmodule.export.inference.export_inference`."""
        from .export.inference import export_inference

        return export_inference(
            self.module, path, args, kwargs, dynamic_axes=dynamic_axes, optimized_path=optimized_path
        )


# NOTE [FSDP order]: fully_shard's hooks all-gather a unit's parameters before its forward and free
# them after; inside the graph no submodule's forward runs, so its hooks would never fire. The
# wrapper is sharded instead: ORTModule(model) first, then fully_shard(wrapper) (README).
_SHARDED_INSIDE = (
    "submodule {!r} was sharded with fully_shard before ORTModule wrapped it: FSDP's hooks on it would "
    "never run inside the ONNX Runtime graph. Apply ORTModule first, then fully_shard the wrapper "
    "(model = ORTModule(model); fully_shard(model)), or put the ORTModule inside an eager FSDP root"
)


@dataclasses.dataclass
class _CallTraces:
    attrs: dict
    traces: int = 0


# NOTE [no float outputs]: a forward that returns only integers or booleans (``logits.argmax(-1)``, a
# mask) has nothing to differentiate, and eager's outputs do not require grad; its training graphs had
# an empty backward, which onnxruntime refused to load, and the model fell back to eager. Such a
# signature runs the inference graph, as under no_grad.
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                          onnx.TensorProto.BFLOAT16})


def _rng_states(device: torch.device) -> tuple:
    """The default generators' states the masks are drawn from (NOTE [value checks])."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), device, cuda


def _set_rng_states(states: tuple | None) -> None:
    """Put back what :func:`_rng_states` took (None: nothing was taken, the graph draws nothing)."""
    if states is None:
        return
    cpu, device, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _float_outputs(exported) -> bool:
    outputs = exported.model.graph.output[:exported.num_user_outputs]
    return any(o.type.tensor_type.elem_type in _FLOAT_TYPES for o in outputs)


def _counts(before: dict, after: dict) -> bool:
    """Whether an int or float attribute changed (NOTE [side effects]): what a counter looks like."""
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and before.get(k, _NOTHING) != v
               for k, v in after.items())


_NOTHING = object()


def _is_fsdp(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    return cls is not None and isinstance(module, cls)


def _sharded_inside(module: nn.Module) -> str | None:
    """The path of a submodule of ``module`` that fully_shard manages, if any (NOTE [FSDP order])."""
    if sys.modules.get("torch.distributed.fsdp") is None:
        return None
    for name, m in module.named_modules():
        if _is_fsdp(m) and not isinstance(m, ORTModule):
            return name or "<the module itself>"
    return None


def _autocast_state() -> tuple:
    """NOTE [autocast]: autocast changes the exported graph (casts, half-precision compute), so its
    state is part of the signature; the export trace runs inside the caller's autocast context."""
    state = []
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            state.append((dev, torch.get_autocast_dtype(dev)))
    return tuple(state)


def _device_of(inputs, params) -> torch.device:
    for t in list(params) + list(inputs):
        return t.device
    return torch.device("cpu")
