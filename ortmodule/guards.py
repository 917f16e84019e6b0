"""Module guards: what, besides the inputs, decides what the wrapped module's forward computes.

# NOTE [module guards]: a compiled graph is the forward of the module AS IT WAS at export time. A
# Python attribute the forward branches on (``model.use_cache = False``), a submodule replaced
# (``model.act = nn.Tanh()``, which has no parameters, so the state layout does not change), a forward
# method patched on the instance, or a forward hook added or removed changes what eager PyTorch
# computes, so every call takes a cheap snapshot of the module tree and a changed snapshot drops the
# compiled graphs (the next call exports again). The snapshot holds, per submodule in ``modules()``
# order: its identity, each entry of its ``__dict__`` (the value of an int/float/bool/str/None/
# dtype/device or tuple of them, the identity of anything else), and the keys of its forward and
# backward hooks; plus the global module hooks. Attributes added after the export do not count unless they shadow
# a class attribute (``layer.forward = f``): the traced forward did not read them. Nor do tensors
# with a grad_fn (a loss stored on the model between steps). A plain object, dict or list held by a
# module with at most 256 entries counts by its atomic entries too (NOTE [config guards]:
# ``model.config.output_hidden_states = True`` after the first call was served by the stale graph).
# Globals count too (NOTE [global guards]). Not seen: entries of bigger containers, nested objects,
# attributes of imported modules (``cfg.FLAG``), methods patched on the class.
# Parameters and buffers are bound afresh on every call and their names/specs are in the signature;
# train/eval flags are in the signature too, so switching back and forth keeps both graphs.
"""

from __future__ import annotations

import contextlib
import dis
import enum
import inspect
import os
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

_ATOMIC = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
_SKIP = frozenset({
    "_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set",
    "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
})


_SMALL = 256
_MISSING = object()


def _atomic(v: Any) -> bool:
    return isinstance(v, _ATOMIC) or type(v) is tuple and all(isinstance(x, _ATOMIC) for x in v)


def _contents(v: Any) -> tuple | None:
    """NOTE [config guards]: the atomic entries of a small plain dict, list or object (an HF config,
    a dict of options), or None for anything else (modules, tensors, functions, big containers)."""
    if type(v) is dict:
        items = v.items() if len(v) <= _SMALL else None
    elif type(v) is list:
        return tuple(v) if len(v) <= _SMALL and all(_atomic(x) for x in v) else None
    elif isinstance(v, (nn.Module, torch.Tensor, type)) or callable(v) or not hasattr(v, "__dict__"):
        return None
    else:
        d = vars(v)
        items = d.items() if type(d) is dict and len(d) <= _SMALL else None
    if items is None:
        return None
    return tuple([(k, x) for k, x in items if _atomic(x) and _atomic(k)])


def _tensor_key(v: torch.Tensor) -> tuple:
    """NOTE [tensor constants]: a plain tensor attribute or global (not a parameter or buffer: a
    ``self.scale = torch.ones(4)`` that was never registered) is a constant of the graph, copied at
    export time; written in place afterwards (``model.scale.mul_(3)``, ``MASK[:, 0] = 0``) eager reads
    the new values and the graph kept the old ones. Its version counter (bumped by every in-place
    write) joins the key, so a write drops the graphs like a changed attribute. A forward that writes
    one itself, or one that needs a gradient (a tensor made with requires_grad=True, not an
    nn.Parameter), falls back naming it (ortmodule/module.py): a graph constant has no writes and no
    gradient."""
    if isinstance(v, nn.Parameter):  # bound afresh on every call; the optimizer writes it in place
        return ("id", id(v))
    return ("tensor", id(v), v._version)


def _value_key(v: Any, seen: dict[int, tuple | None]) -> Any:
    if isinstance(v, _ATOMIC):
        return v
    if isinstance(v, torch.Tensor):
        # a result kept on the module (``model.loss = ...``) is not an input of forward
        return None if v.grad_fn is not None else _tensor_key(v)
    if type(v) is tuple and all(isinstance(x, _ATOMIC) for x in v):
        return v
    key = id(v)
    if key not in seen:  # an object shared by many submodules (the config) is read once per snapshot
        seen[key] = _contents(v)
    contents = seen[key]
    # by content where it has one: torch.export puts containers back as copies after its trace
    return ("id", key) if contents is None else (type(v).__name__, contents)


def _module_key(m: nn.Module, seen: dict[int, tuple | None]) -> tuple:
    d = m.__dict__
    outputs = _STORED.get(m, ())
    attrs = tuple([(k, v if isinstance(v, _ATOMIC) else _value_key(v, seen)) for k, v in d.items()
                   if k not in _SKIP and k not in outputs])
    return (id(m), attrs, tuple(d["_forward_hooks"]), tuple(d["_forward_pre_hooks"]), tuple(d["_backward_hooks"]),
            tuple(d["_backward_pre_hooks"]))


def plain_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor, int]]:
    """(path, tensor, version) of every plain tensor attribute of ``module``'s submodules: not a
    parameter or buffer, and not a result with a grad_fn (NOTE [tensor constants])."""
    return [(f"{name}.{k}" if name else k, v, v._version) for name, m in module.named_modules()
            for k, v in m.__dict__.items()
            if k not in _SKIP and isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.grad_fn is None]


# NOTE [stored tensors]: a forward that stores a tensor it computes on the module (``self.last_attn =
# w.detach()`` for plots, ``self.aux_loss = ...`` that the training loop adds to the loss, a dict of
# metrics) sets it only while it is traced: under torch.export the attribute was left holding a
# FakeTensor (reading it raised an unrelated symbolic-shape error), under TorchScript the first call's
# value, logged as that step's every step after. The graph cannot set an attribute, so such a
# signature falls back naming the attribute, with what the trace stored put back first.
_CONTAINERS = (list, tuple, dict)


# NOTE [stored tensors as outputs]: under the torch.export front end, a tensor the forward stores in a
# plain attribute (``self.aux_loss = ...``, ``self.last_attn = w.detach()``) is returned by the graph
# after the user outputs, counted among them (a stored aux loss added to the loss gets its gradient),
# and set on the module after each run, as eager's forward sets it. Refused (a fallback naming it, as
# before): a container (a list appended to, a dict), and a slot whose previous tensor the graph reads
# (``self.stat = 0.9 * self.stat + ...`` as a plain attribute: the graph would keep the value it read;
# seen as that tensor among the program's lifted constants). A slot that held no tensor before the
# trace (None, absent: a cache built on the first call, ``if self.cache is None``) makes the graph
# this call's only, kept out of every cache: the next call traces again with the tensor in place,
# taking eager's branch. The slots the module guard then leaves out (they change on every call).
_STORED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # submodule -> attribute names


def mark_stored(module: nn.Module, slots) -> None:
    """Leave the ``(path, attribute)`` slots a graph sets after each run out of the module guard."""
    for path, name in slots:
        m = module.get_submodule(path)
        names = _STORED.get(m, frozenset())
        if name not in names:
            _STORED[m] = names | {name}


def tensor_slots(module: nn.Module) -> dict[tuple[str, str], tuple]:
    """(submodule path, attribute) -> (the value, its tensors' ids, a shallow copy), for every attribute
    that holds a tensor or a list / tuple / dict holding one (NOTE [stored tensors]). Parameters are
    not stored values, nor are buffers, nor what torch's own modules keep (``nn.LSTM._flat_weights`` lists its
    parameters, which the trace swaps for fakes)."""
    slots = {}
    for path, m in module.named_modules():
        if type(m).__module__.startswith("torch."):  # torch's own bookkeeping (nn.LSTM's _flat_weights)
            continue
        own = {id(t) for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}

        def stored(x, own=own) -> bool:
            return isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) and id(x) not in own

        for k, v in m.__dict__.items():
            if k in _SKIP_SLOTS:
                continue
            if stored(v):
                slots[(path, k)] = (v, (id(v),), v)
            elif isinstance(v, _CONTAINERS):
                items = v.values() if isinstance(v, dict) else v
                ids = tuple(id(x) for x in items if stored(x))
                if ids:
                    slots[(path, k)] = (v, ids, type(v)(v.items()) if isinstance(v, dict) else type(v)(v))
    return slots


_SKIP_SLOTS = frozenset({"_parameters", "_buffers", "_modules"})


# NOTE [buffer reassigned]: ``self.ema = 0.9 * self.ema + ...`` in forward binds a new tensor to the
# buffer, which no graph output wrote back (in-place writes are: NOTE [buffer writes]); the graph kept
# serving the old value (outputs 0.03-0.04 off eager from the second step, no warning, both front ends),
# and the trace left a FakeTensor in a buffer registered as None (a lazily built cache). While a forward
# is traced, a new tensor of the buffer's shape, dtype and device that needs no gradient is copied into
# the buffer instead (an in-place write, written back after each run: eager's values, the buffer object
# kept); any other rebinding (from None, another shape, a value with a gradient) falls back naming the
# buffer, which is put back. ``self.steps += 1`` rebinds the same tensor: an in-place write.
def buffer_slots(module: nn.Module) -> dict[tuple[str, str], Any]:
    """(submodule path, buffer name) -> the buffer (or None), for every registered buffer."""
    return {(path, k): v for path, m in module.named_modules() for k, v in m._buffers.items()}


@contextlib.contextmanager
def watch_buffer_rebinds(module: nn.Module) -> Iterator[list[tuple[str, str]]]:
    """The (path, name) of each buffer of ``module`` that code outside torch binds anew meanwhile and that
    cannot be written in place instead (NOTE [buffer reassigned]). Seen when it happens: torch.export swaps
    the buffers for fakes and back around the forward, which puts the original back over the new one."""
    found: list[tuple[str, str]] = []
    paths = {id(m): path for path, m in module.named_modules()}

    def hook(m, name, value):
        path = paths.get(id(m))
        old = m._buffers.get(name) if path is not None else None
        if path is None or name not in m._buffers or value is old:  # ``self.steps += 1``: the same one
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename == _MODULE_FILE:
            frame = frame.f_back
        if frame is None or frame.f_code.co_filename.startswith(_TORCH_DIR):
            return None
        from .export.traps import requires_grad_in_eager  # a detach in the trace still requires grad (lazy: a cycle)

        if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and not requires_grad_in_eager(value) \
                and value.dtype == old.dtype and value.device == old.device and value.shape == old.shape:
            with torch.no_grad():  # written back as an in-place write is (NOTE [buffer writes])
                old.copy_(value)
            return old
        found.append((path, name))
        return None

    handle = _nn_module.register_module_buffer_registration_hook(hook)
    try:
        yield found
    finally:
        handle.remove()


_MODULE_FILE = _nn_module.__file__
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def reassigned(before: dict, after: dict) -> list[tuple[str, str]]:
    """The buffers of :func:`buffer_slots` bound to another tensor in ``after``."""
    return [k for k, v in after.items() if k in before and v is not before[k]]


def hook_managed(module: nn.Module) -> set[tuple[str, str]]:
    """The slots torch's own pre-hooks set from parameters on every call (``nn.utils.weight_norm`` /
    ``spectral_norm`` of the old API, ``nn.utils.prune``): traced into the graph, not stored state (NOTE
    [stored tensors])."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    kinds = (WeightNorm, SpectralNorm, BasePruningMethod)
    return {(path, getattr(hook, "_tensor_name", getattr(hook, "name", None)))
            for path, m in module.named_modules() for hook in m._forward_pre_hooks.values() if isinstance(hook, kinds)}


def stored_names(before: dict, after: dict, managed: set = frozenset()) -> list[tuple[str, str]]:
    """The (path, attribute) slots of :func:`tensor_slots` that hold other tensors in ``after``."""
    return [k for k, v in after.items() if (k not in before or before[k][1] != v[1]) and k not in managed]


def stored_tensors_message(name: str, stored: list[tuple[str, str]], buffers: list[tuple[str, str]] = (),
                           read: bool = False) -> str:
    def dotted(keys):
        return ", ".join(f"{path + '.' if path else ''}{attr}" for path, attr in keys)

    parts = []
    if stored and read:
        parts.append(f"{name}.forward reads and stores again the tensor attribute(s) {dotted(stored)}: the graph "
                     "would keep the value it read (NOTE [stored tensors as outputs]). Register it as a buffer and "
                     "update it in place under torch.no_grad() (self.stat.mul_(0.9).add_(...)), or return it")
    elif stored:
        parts.append(f"{name}.forward stores tensors it computes on the module ({dotted(stored)}): a compiled graph "
                     "cannot set them on later calls, which would keep the traced values (NOTE [stored tensors]). "
                     "Return them from forward instead")
    if buffers:
        parts.append(f"{name}.forward binds new tensors to the buffer(s) {dotted(buffers)}: a compiled graph writes "
                     "a buffer back only when it is updated in place (NOTE [buffer reassigned]). Update it in place "
                     "under torch.no_grad() (self.ema.mul_(0.9).add_(...), or .copy_(new))")
    return "; ".join(parts)


# NOTE [hooks put back]: a forward may register hooks once and flag it (transformers' output capturing:
# ``_output_capturing_hooks_installed``, then the hooks append each layer's output to a per-call list).
# Putting back a trace's attribute writes removed the flag and left the hooks, so the eager forward
# after a fallback registered them again: every output was collected twice and a layer picked by
# index was another layer's (silently; SegFormer's decode head raised). The hooks a trace added go
# with the attributes it wrote.
_HOOK_DICTS = {"_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
               "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",), "_backward_hooks": (),
               "_backward_pre_hooks": ()}


class AttributeSnapshot(dict):
    """:func:`atomic_attributes`' result: the attributes, and the keys of each submodule's hooks."""

    hooks: dict[tuple[int, str], frozenset] = {}


def atomic_attributes(module: nn.Module) -> AttributeSnapshot:
    """(submodule index in ``modules()`` order, name) -> value, for every plain int/float/bool/str ...
    attribute (what a forward may count or flag in); ``.hooks``: the hook keys (NOTE [hooks put back])."""
    modules = list(module.modules())
    snap = AttributeSnapshot({(i, k): v for i, m in enumerate(modules) for k, v in m.__dict__.items()
                              if k not in _SKIP and _atomic(v)})
    snap.hooks = {(i, name): frozenset(m.__dict__[name]) for i, m in enumerate(modules) for name in _HOOK_DICTS
                  if m.__dict__.get(name)}
    return snap


def _remove_added_hooks(modules: list[nn.Module], before: dict[tuple[int, str], frozenset]) -> None:
    for i, m in enumerate(modules):
        for name, companions in _HOOK_DICTS.items():
            hooks = m.__dict__.get(name)
            if not hooks:
                continue
            for key in [k for k in hooks if k not in before.get((i, name), ())]:
                del hooks[key]
                for companion in companions:
                    m.__dict__.get(companion, {}).pop(key, None)


def put_back_attributes(module: nn.Module, attrs: dict[tuple[int, str], Any]) -> None:
    """Set the plain attributes of ``module`` back to ``attrs`` (an :func:`atomic_attributes` of it),
    removing the ones added since, and the hooks registered since (NOTE [side effects]: a trace whose
    writes must not count; NOTE [hooks put back])."""
    if isinstance(attrs, AttributeSnapshot):
        _remove_added_hooks(list(module.modules()), attrs.hooks)
    now = atomic_attributes(module)
    if now == attrs:
        return
    modules = list(module.modules())
    for key in now.keys() - attrs.keys():
        i, name = key
        if i < len(modules) and name in modules[i].__dict__:
            delattr(modules[i], name)
    for (i, name), value in attrs.items():
        if i < len(modules) and ((i, name) not in now or now[(i, name)] is not value):
            setattr(modules[i], name, value)


# NOTE [global guards]: a forward that reads a module-level global (``if USE_FAST:``, ``x * SCALE``,
# ``CONFIG["dropout"]``) has the value of the traced call in its graph; setting the global later
# changed eager's result and not the graph's. The globals the forward can read are found once per
# set of module classes by walking the bytecode of each class's ``forward`` (through decorators'
# ``__wrapped__``), the methods it names and the plain functions it calls, to a bounded depth
# (torch's own code is skipped); their values (atomic, or a small plain dict/list by content) join
# the module snapshot, so a changed global drops the graphs like a changed attribute. Globals
# holding other objects (modules, loggers, classes) are not read: they are not flags.
_GLOBAL_READS: dict[frozenset, tuple] = {}
_UNSET = "<unset global>"
_MAX_CALL_DEPTH = 3


def _own_code(fn) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return not module.startswith(("torch.", "ortmodule.")) and module != "torch"


def _global_names(fn, cls: type | None, depth: int, found: dict, seen: set) -> None:
    """Collect into ``found`` the (globals dict, name) pairs ``fn`` and what it calls may read."""
    for f in {fn, inspect.unwrap(fn)}:
        code = getattr(f, "__code__", None)
        if code is None or code in seen or not _own_code(f):
            continue
        seen.add(code)
        g = f.__globals__
        codes = [code]
        while codes:
            c = codes.pop()
            codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
            for ins in dis.get_instructions(c):
                if ins.opname == "LOAD_GLOBAL":
                    v = g.get(ins.argval, _MISSING)
                    if isinstance(v, types.FunctionType):
                        if depth < _MAX_CALL_DEPTH:
                            _global_names(v, None, depth + 1, found, seen)
                    elif v is not _MISSING and (_atomic(v) or type(v) in (dict, list) or isinstance(v, torch.Tensor)):
                        found[(id(g), ins.argval)] = (g, ins.argval)
                elif cls is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and depth < _MAX_CALL_DEPTH:
                    method = inspect.getattr_static(cls, ins.argval, None)
                    method = getattr(method, "__func__", method)  # staticmethod / classmethod
                    if isinstance(method, types.FunctionType):
                        _global_names(method, cls, depth + 1, found, seen)


def _global_reads(classes: frozenset) -> tuple:
    reads = _GLOBAL_READS.get(classes)
    if reads is None:
        found: dict = {}
        seen: set = set()
        for cls in classes:
            forward = inspect.getattr_static(cls, "forward", None)
            if isinstance(forward, types.FunctionType):
                _global_names(forward, cls, 0, found, seen)
        reads = tuple(found.values())
        _GLOBAL_READS[classes] = reads
    return reads


def _global_key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):  # NOTE [tensor constants]
        return _tensor_key(v)
    if type(v) is dict:
        return ("dict", tuple(v.items())) if len(v) <= _SMALL and all(_atomic(x) for x in v.values()) else ("id", id(v))
    if type(v) is list:
        return ("list", tuple(v)) if len(v) <= _SMALL and all(_atomic(x) for x in v) else ("id", id(v))
    return v


def global_values(module: nn.Module, classes: frozenset | None = None) -> tuple:
    """NOTE [global guards]: ((module name, global name), value key) of each global the forward reads."""
    if classes is None:
        classes = frozenset(type(m) for m in module.modules())
    return ("globals", tuple([((g.get("__name__"), name), _global_key(g.get(name, _UNSET)))
                              for g, name in _global_reads(classes)]))


def snapshot(module: nn.Module) -> tuple[tuple[bool, ...], tuple]:
    """(train/eval flag of every submodule, the guard key of NOTE [module guards]) in one walk."""
    modes = []
    keys = []
    seen: dict[int, tuple | None] = {}
    classes = set()
    for m in module.modules():
        modes.append(m.training)
        keys.append(_module_key(m, seen))
        classes.add(type(m))
    keys.append(global_values(module, frozenset(classes)))
    keys.append((tuple(_nn_module._global_forward_hooks), tuple(_nn_module._global_forward_pre_hooks),
                 tuple(_nn_module._global_backward_hooks), tuple(_nn_module._global_backward_pre_hooks)))
    return tuple(modes), tuple(keys)


def find_change(module: nn.Module, old: tuple, new: tuple) -> str | None:
    """What changed from the export-time snapshot ``old`` to ``new`` that the graph may depend on, or
    None. Attributes that did not exist at export time are not read by the graph's forward (a loss
    stored on the model after the step), so only the attributes in ``old`` count."""
    mods = {id(m): (name or "<top>", m) for name, m in module.named_modules()}
    names = {k: v[0] for k, v in mods.items()}
    if len(old) != len(new):
        return "the submodule tree"
    for a, b in zip(old, new):
        if a == b:
            continue
        if len(a) == 4:
            return "the global module hooks"
        if a[0] == "globals":
            names = [f"{m}.{n}" for (m, n), v in a[1] if dict(b[1]).get((m, n), _MISSING) != v]
            return f"global(s) {names} read by forward"
        where = names.get(b[0], "?")
        if a[0] != b[0]:
            return f"submodule {where!r} (replaced)"
        if a[2:] != b[2:]:
            return f"the hooks of {where!r}"
        now, before = dict(b[1]), dict(a[1])
        changed = [k for k, v in a[1] if now.get(k, _MISSING) != v]
        cls = type(mods[b[0]][1]) if b[0] in mods else object
        changed += [k for k in now if k not in before and hasattr(cls, k)]  # shadows a method
        if changed:
            return f"attribute(s) {changed} of {where!r}"
    return None
