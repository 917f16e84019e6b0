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
# Not seen: entries of bigger containers, nested objects, globals, methods patched on the class.
# Parameters and buffers are bound afresh on every call and their names/specs are in the signature;
# train/eval flags are in the signature too, so switching back and forth keeps both graphs.
"""

from __future__ import annotations

import enum
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


def _value_key(v: Any, seen: dict[int, tuple | None]) -> Any:
    if isinstance(v, _ATOMIC):
        return v
    if isinstance(v, torch.Tensor):
        # a result kept on the module (``model.loss = ...``) is not an input of forward
        return None if v.grad_fn is not None else ("id", id(v))
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
    attrs = tuple([(k, v if isinstance(v, _ATOMIC) else _value_key(v, seen)) for k, v in d.items()
                   if k not in _SKIP])
    return (id(m), attrs, tuple(d["_forward_hooks"]), tuple(d["_forward_pre_hooks"]), tuple(d["_backward_hooks"]),
            tuple(d["_backward_pre_hooks"]))


def atomic_attributes(module: nn.Module) -> dict[tuple[int, str], Any]:
    """(submodule index in ``modules()`` order, name) -> value, for every plain int/float/bool/str ...
    attribute (what a forward may count or flag in)."""
    return {(i, k): v for i, m in enumerate(module.modules()) for k, v in m.__dict__.items()
            if k not in _SKIP and _atomic(v)}


def snapshot(module: nn.Module) -> tuple[tuple[bool, ...], tuple]:
    """(train/eval flag of every submodule, the guard key of NOTE [module guards]) in one walk."""
    modes = []
    keys = []
    seen: dict[int, tuple | None] = {}
    for m in module.modules():
        modes.append(m.training)
        keys.append(_module_key(m, seen))
    keys.append((tuple(_nn_module._global_forward_hooks), tuple(_nn_module._global_forward_pre_hooks),
                 tuple(_nn_module._global_backward_hooks), tuple(_nn_module._global_backward_pre_hooks)))
    return tuple(modes), tuple(keys)


_MISSING = object()


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
