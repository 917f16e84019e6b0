"""Flatten user inputs/outputs to flat tensor lists, and the frozen signature used as cache key."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor, requires_grad: bool | None = None) -> TensorSpec:
        rg = t.requires_grad if requires_grad is None else requires_grad
        return TensorSpec(t.dtype, tuple(t.shape), t.device, bool(rg))


@dataclasses.dataclass(frozen=True)
class FlatInputs:
    """User ``(args, kwargs)`` split into tensor leaves and a template with the rest."""

    tensors: list[torch.Tensor]
    template: list[Any]  # every leaf; tensor positions hold None
    tensor_positions: tuple[int, ...]
    spec: pytree.TreeSpec
    structure: str = ""  # str(spec) where it is known already (the signature's ``structure``)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        leaves = list(self.template)
        for pos, t in zip(self.tensor_positions, tensors):
            leaves[pos] = t
        return pytree.tree_unflatten(leaves, self.spec)


def _is_hf_cache(cls: type) -> bool:
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(cls, type) and issubclass(cls, cache_utils.Cache)


def register_container(cls: type) -> bool:
    """Make ``cls`` a pytree node where ortmodule knows how: a user dataclass, or a transformers
    ``Cache`` (``past_key_values``; NOTE [opaque outputs]). Whether ``cls`` is a node now."""
    if cls in pytree.SUPPORTED_NODES:
        return True
    try:
        if dataclasses.is_dataclass(cls):
            pytree.register_dataclass(cls)
        elif _is_hf_cache(cls):
            from transformers.exporters.exporter_dynamo import register_pytree_node

            register_pytree_node(cls)
    except Exception:  # e.g. a dataclass with init=False fields, an older transformers: stays a leaf
        return False
    return cls in pytree.SUPPORTED_NODES


def _register_dataclasses(tree: Any) -> None:
    """Let pytree see inside user dataclasses and transformers caches (inputs or outputs holding
    tensors)."""
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            if register_container(type(x)):
                stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
        elif _is_hf_cache(type(x)):
            register_container(type(x))


def holds_tensors(x: Any, depth: int = 4) -> bool:
    """Whether the non-tensor leaf ``x`` keeps tensors in its attributes or containers."""
    if isinstance(x, torch.Tensor):
        return True
    if depth == 0 or isinstance(x, (str, bytes, int, float, bool, type(None), type)):
        return False
    if isinstance(x, (list, tuple, set, frozenset)):
        return any(holds_tensors(v, depth - 1) for v in list(x)[:64])
    if isinstance(x, dict):
        return any(holds_tensors(v, depth - 1) for v in list(x.values())[:64])
    attrs = getattr(x, "__dict__", None)
    return isinstance(attrs, dict) and any(holds_tensors(v, depth - 1) for v in list(attrs.values())[:64])


# NOTE [plain calls]: ``model(x)`` / ``model(x, y)`` (positional plain tensors, no keywords) is the
# common call; its spec depends only on the count, so it is made once. pytree's flatten and the
# spec's str took 80 and ~15 us of the ~370 us ORTModule spent before the forward run of an MLP step.
_PLAIN_SPECS: dict[int, tuple[pytree.TreeSpec, str]] = {}


def flatten_inputs(args: tuple, kwargs: dict) -> FlatInputs:
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        n = len(args)
        known = _PLAIN_SPECS.get(n)
        if known is None:
            spec = pytree.tree_flatten((tuple(range(n)), {}))[1]
            known = _PLAIN_SPECS[n] = (spec, str(spec))
        return FlatInputs(list(args), [None] * n, tuple(range(n)), known[0], known[1])
    _register_dataclasses((args, kwargs))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    tensors = [leaves[i] for i in positions]
    template = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    return FlatInputs(tensors, template, positions, spec)


def _constant_key(x: Any) -> Any:
    """Non-tensor leaves are graph constants; their value is part of the key."""
    try:
        hash(x)
        return (type(x), x)
    except TypeError:
        return (type(x), repr(x))


@dataclasses.dataclass(frozen=True)
class InputSignature:
    """Everything that changes the compiled graphs, and nothing else (STYLE.md §7)."""

    structure: str  # the pytree spec of (args, kwargs)
    constants: tuple  # non-tensor leaves
    inputs: tuple[TensorSpec, ...]
    params: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]
    names: tuple[str, ...]  # parameter then buffer names: a changed module layout re-exports
    modes: tuple[bool, ...]  # train/eval flag of every submodule
    autocast: tuple  # (enabled, dtype) per device type, see NOTE [autocast]
    grad_enabled: bool
    # NOTE [default dtype]: what ``torch.zeros(3)`` / ``torch.tensor(0.5)`` in forward make; a graph bakes
    # it (torch.set_default_dtype(torch.float64) after a first call gave float32 where eager gives float64)
    default_dtype: torch.dtype = torch.float32

    @property
    def training(self) -> bool:
        return self.modes[0]

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(s.shape for s in self.inputs)

    def shapeless(self) -> InputSignature:
        """The export key with the user inputs' sizes dropped (ranks kept): NOTE [dynamic shapes]."""
        key = self.export_key()
        return dataclasses.replace(
            key, inputs=tuple(dataclasses.replace(s, shape=(-1,) * len(s.shape)) for s in key.inputs)
        )

    def export_key(self) -> InputSignature:
        """The part that decides the forward graph: requires_grad and grad mode only change autodiff."""
        strip = lambda specs: tuple(dataclasses.replace(s, requires_grad=False) for s in specs)
        return dataclasses.replace(
            self,
            inputs=strip(self.inputs),
            params=strip(self.params),
            buffers=strip(self.buffers),
            grad_enabled=False,
        )


def make_signature(
    flat: FlatInputs,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    names: tuple[str, ...],
    modes: tuple[bool, ...],
    autocast: tuple = (),
) -> InputSignature:
    grad_enabled = torch.is_grad_enabled()
    return InputSignature(
        structure=flat.structure or str(flat.spec),
        constants=tuple(_constant_key(x) for x in flat.template if x is not None),
        inputs=tuple(TensorSpec.of(t, t.requires_grad and grad_enabled) for t in flat.tensors),
        params=tuple(TensorSpec.of(p, p.requires_grad and grad_enabled) for p in params),
        buffers=tuple(TensorSpec.of(b, False) for b in buffers),
        names=names,
        modes=modes,
        autocast=autocast,
        grad_enabled=grad_enabled,
        default_dtype=torch.get_default_dtype(),
    )


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """How to rebuild the user's output from the flat tensor outputs of the graph."""

    spec: pytree.TreeSpec
    template: tuple  # every leaf; tensor positions hold None
    tensor_positions: tuple[int, ...]
    # NOTE [output aliases]: per tensor leaf, where it comes from: ("graph", k) = graph output k,
    # ("input", i) = user input i returned as is. A tensor returned twice is one graph output used
    # twice, so the caller gets the same tensor object twice, as in eager PyTorch.
    sources: tuple[tuple[str, int], ...] | None = None  # None: graph outputs in order

    def rebuild(self, graph_outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = ()) -> Any:
        leaves = list(self.template)
        sources = self.sources or tuple(("graph", k) for k in range(len(self.tensor_positions)))
        for pos, (kind, k) in zip(self.tensor_positions, sources):
            leaves[pos] = graph_outputs[k] if kind == "graph" else inputs[k]
        return pytree.tree_unflatten(leaves, self.spec)


def flatten_outputs(out: Any, inputs: Sequence[torch.Tensor] = ()) -> tuple[list[torch.Tensor], OutputSpec]:
    """The unique tensors the graph must return, and how to rebuild ``out`` from them."""
    _register_dataclasses(out)
    leaves, spec = pytree.tree_flatten(out)
    positions = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    template = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
    input_ids = {id(t): i for i, t in enumerate(inputs)}
    unique: list[torch.Tensor] = []
    seen: dict[int, int] = {}
    sources = []
    for pos in positions:
        t = leaves[pos]
        if id(t) in input_ids:
            sources.append(("input", input_ids[id(t)]))
        elif id(t) in seen:
            sources.append(("graph", seen[id(t)]))
        else:
            seen[id(t)] = len(unique)
            sources.append(("graph", len(unique)))
            unique.append(t)
    return unique, OutputSpec(spec, template, positions, tuple(sources))
