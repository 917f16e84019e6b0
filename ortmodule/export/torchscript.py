"""The TorchScript-tracer exporter behind :func:`export_module`."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import onnx
import torch
from torch import nn

from ..errors import MODULE_PATH_KEY, ExportError, module_path_from_scope
from ..io import FlatInputs, OutputSpec, flatten_outputs, holds_tensors
from .draws import refuse_random_ops
from .semantics import (
    ExportSemantics,
    MaskSpec,
    define_mask_op,
    mark_grad_kinds,
    mark_stop_gradients,
    masks_to_inputs,
    route_nested_dropout,
)
from .traps import (
    TraceWatch,
    UnsupportedTrace,
    backward_hook_failure,
    checkpoint_paths,
    input_write_message,
    intercept_functions,
    watch_forward_hooks,
    watch_nested_fast_path,
)

if TYPE_CHECKING:
    from .program import ShapeGuard

DEFAULT_OPSET = 20
WRAPPER_ATTR = "module"  # the attribute name under which the user's module is traced


def input_name(i: int) -> str:
    return f"input:{i}"


def mask_name(i: int) -> str:
    return f"dropout:{i}"


def is_state_input(name: str) -> bool:
    """A graph input that is a parameter or buffer (not a user input nor a dropout mask)."""
    return not name.startswith(("input:", "dropout:"))


def _dynamic_axes(flat: FlatInputs, batch_only: bool) -> dict[str, dict[int, str]]:
    return {input_name(i): {d: f"input{i}_dim{d}" for d in range(min(t.dim(), 1) if batch_only else t.dim())}
            for i, t in enumerate(flat.tensors)}


@dataclasses.dataclass
class ExportedModel:
    """The forward graph and how its inputs/outputs map to the module's world.

    Graph inputs, in order: user tensors (``input:i``), parameters and buffers (by their names in
    ``named_parameters()`` / ``named_buffers()``), then dropout masks (``dropout:i``, see
    NOTE [dropout masks]); an input the graph does not use may be absent.
    Graph outputs: the user's tensor outputs, then the new values of the buffers the forward
    mutated (``mutated_buffers`` gives their indices).
    """

    model: onnx.ModelProto
    output_spec: OutputSpec
    num_user_outputs: int
    mutated_buffers: tuple[int, ...]
    opset: int
    masks: tuple[MaskSpec, ...] = ()
    dynamic: bool = False
    batch_only: bool = False  # dynamic in dim 0 of each user input only (NOTE [batch-dynamic graphs])
    input_shapes: tuple[tuple[int, ...], ...] = ()  # the user inputs' shapes at export time
    # Python read user input sizes during the trace (NOTE [shape-conditional graphs]): the graph
    # serves exactly the input shapes it was exported or verified at.
    shape_conditions: tuple[str, ...] = ()
    # Which user inputs and parameters required grad at export, where the graph depends on it (a
    # reentrant checkpoint: NOTE [trace traps]); None where it does not.
    grad_mask: tuple[bool, ...] | None = None
    # The torch.export front end: the input shapes the graph serves (NOTE [shape guards]).
    guard: ShapeGuard | None = None
    # The source files torch.export's stack traces name (NOTE [persistent cache]).
    source_files: tuple[str, ...] = ()
    # The persistent cache's key of this export, where one is in use (NOTE [persistent cache]).
    cache_key: str | None = None
    # The module paths the forward ran under torch.utils.checkpoint (NOTE [checkpoint regions]).
    checkpoint_regions: tuple[str, ...] = ()
    nested_fast_paths: tuple[str, ...] = ()  # NOTE [nested fast path]
    # NOTE [value checks]: where the forward checked values (torch.distributions' validation); where
    # there are any, one boolean output after the mutated buffers says whether all of them held.
    checks: tuple[str, ...] = ()
    # NOTE [stored tensors as outputs]: the (submodule path, attribute) slots the forward stores a tensor
    # in, returned as the last user outputs; provisional: one held no tensor before the trace
    stored: tuple[tuple[str, str], ...] = ()
    stored_provisional: bool = False


@contextlib.contextmanager
def swap_tensors(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily replace parameters/buffers (by qualified name) with the given tensors.

    # NOTE [swap, not functional_call]: torch.func.functional_call refuses to run under the
    # TorchScript tracer, so we swap the entries of ``_parameters``/``_buffers`` directly and restore
    # them afterwards, even when the forward raises.
    """
    saved = []
    try:
        for name, t in tensors.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            store = owner._parameters if leaf in owner._parameters else owner._buffers
            saved.append((store, leaf, store[leaf]))
            store[leaf] = t
        yield
    finally:
        for store, leaf, old in reversed(saved):
            store[leaf] = old


class _Flat(nn.Module):
    """Calls the user's module from flat tensors: user inputs, then parameters, then buffers."""

    def __init__(
        self,
        module: nn.Module,
        flat: FlatInputs,
        param_names: Sequence[Sequence[str]],
        buffer_names: Sequence[Sequence[str]],
    ) -> None:
        hooked = backward_hook_failure(module)  # either front end: checked before any capture
        if hooked is not None:
            raise ExportError(f"{type(module).__name__}: {hooked}")
        super().__init__()
        setattr(self, WRAPPER_ATTR, module)
        self.flat = flat
        self.param_names = param_names  # per unique parameter: every name it goes by (tied weights)
        self.buffer_names = buffer_names
        self.output_spec: OutputSpec | None = None
        self.num_user_outputs = 0
        self.mutated: tuple[int, ...] = ()
        self.checks: tuple[str, ...] = ()  # NOTE [value checks]
        self.semantics: ExportSemantics | None = None
        self.watch = TraceWatch()
        self.trainable: list[bool] = []  # per parameter: requires_grad (the trace sees detached copies)
        self.forward_error: Exception | None = None

    def forward(self, *tensors: torch.Tensor):
        n_in, n_p = len(self.flat.tensors), len(self.param_names)
        user, params, buffers = tensors[:n_in], tensors[n_in : n_in + n_p], tensors[n_in + n_p :]
        # Buffers are cloned so that in-place updates (running stats, counters) land on a graph
        # value we can return, and the module's own buffers stay untouched by the trace.
        clones = [b.clone() for b in buffers]
        versions = [c._version for c in clones]
        swap = {n: p for names, p in zip(self.param_names, params) for n in names}
        swap.update({n: b for names, b in zip(self.buffer_names, clones) for n in names})
        args, kwargs = self.flat.rebuild(user)
        module = getattr(self, WRAPPER_ATTR)
        grad_sources = [t for t in user if t.requires_grad]
        grad_sources += [p for p, trainable in zip(params, self.trainable) if trainable]
        self.watch.watch_inputs(user, [*params, *buffers], grad_sources)
        self.watch.watch_parameters(params, [names[0] for names in self.param_names])
        self.semantics = ExportSemantics(self.watch)
        with swap_tensors(module, swap), intercept_functions(self.watch), watch_nested_fast_path(module, self.watch), \
                watch_forward_hooks(module, self.watch), route_nested_dropout(self.semantics), self.semantics:
            try:
                out = module(*args, **kwargs)
            except UnsupportedTrace:
                raise
            except Exception as exc:
                if self.watch.failure() is None:
                    self.forward_error = exc
                raise
        outs, self.output_spec = flatten_outputs(out, user)
        # NOTE [opaque outputs]: an object the output holds that pytree cannot see into would come
        # back as the trace's own object, every call: its tensors fake or stale.
        opaque = sorted({type(x).__name__ for x in self.output_spec.template if holds_tensors(x)})
        if opaque:
            raise UnsupportedTrace(
                f"forward returns {', '.join(opaque)} holding tensors inside an object ortmodule cannot see "
                "into, so they would be the trace's, not this call's; register its type with "
                "torch.utils._pytree.register_pytree_node (or return its tensors)")
        self.num_user_outputs = len(outs)
        # NOTE [buffer writes]: under torch.export the BatchNorm statistics are new values, not
        # in-place writes (semantics.py), which spares the functionalizing re-trace.
        writes = self.semantics.buffer_writes
        if any(id(c) in writes and c._version != v for c, v in zip(clones, versions)):
            raise UnsupportedTrace("forward writes a BatchNorm's running statistics in place as well as through "
                                   "the BatchNorm: the graph could not tell their order")
        self.mutated = tuple(i for i, c in enumerate(clones) if c._version != versions[i] or id(c) in writes)
        checks = self.semantics.checks
        self.checks = tuple(where for _, where in checks)
        ok = (torch.stack([c.reshape(()) for c, _ in checks]).all(),) if checks else ()  # NOTE [value checks]
        return tuple(outs) + tuple(writes.get(id(clones[i]), clones[i]) for i in self.mutated) + ok


def export_module(
    module: nn.Module,
    flat: FlatInputs,
    params: Sequence[torch.Tensor],
    param_names: Sequence[Sequence[str]],
    buffers: Sequence[torch.Tensor],
    buffer_names: Sequence[Sequence[str]],
    *,
    opset: int = DEFAULT_OPSET,
    dynamic: bool = False,
    batch_only: bool = False,
) -> ExportedModel:
    """Trace ``module`` on ``flat`` to an ONNX forward graph in the module's current train/eval mode.

    With ``dynamic``, every dim of every user tensor input is a symbolic axis: sizes the forward
    reads with ``x.shape`` become Shape ops; whether the graph really is shape-generic is checked by
    the caller (NOTE [dynamic shapes]). With ``batch_only`` as well, only dim 0 of each input is.
    """
    wrapper = _Flat(module, flat, param_names, buffer_names)
    wrapper.trainable = [p.requires_grad for p in params]
    # NOTE [inputs mutated in place]: the trace runs on copies of the user's tensors, so an in-place
    # op in forward does not change the caller's tensor at export time (then again in the run).
    user = tuple(_trace_copy(t) for t in flat.tensors)
    versions = [t._version for t in user]
    inputs = user + tuple(p.detach() for p in params) + tuple(b.detach() for b in buffers)
    names = [input_name(i) for i in range(len(flat.tensors))]
    names += [n[0] for n in param_names] + [n[0] for n in buffer_names]
    define_mask_op()
    buf = io.BytesIO()
    try:
        # The export is shared by grad and no-grad calls: trace with grad enabled so that only the
        # module's own no_grad blocks read as such (NOTE [stop gradient]).
        with warnings.catch_warnings(record=True) as caught, torch.enable_grad():
            warnings.simplefilter("always")
            torch.onnx.export(
                wrapper,
                inputs,
                buf,
                dynamo=False,
                input_names=names,
                opset_version=opset,
                # PRESERVE keeps each submodule's own train/eval flag (e.g. a frozen BatchNorm).
                training=torch.onnx.TrainingMode.PRESERVE,
                do_constant_folding=False,
                keep_initializers_as_inputs=False,
                dynamic_axes=_dynamic_axes(flat, batch_only) if dynamic else None,
            )
    except Exception as exc:
        if wrapper.forward_error is not None:
            # NOTE [user errors]: the module's own forward raised (wrong shape, dtype, ...): that is
            # the error eager PyTorch gives, so it is raised as is, never hidden by a fallback.
            raise wrapper.forward_error from None
        trap = wrapper.watch.failure() or (str(exc) if isinstance(exc, UnsupportedTrace) else None)
        if trap is not None:
            raise ExportError(f"{type(module).__name__}: {trap}") from exc
        raise ExportError(
            f"torch.onnx.export failed for {type(module).__name__}: {type(exc).__name__}: {exc}"
        ) from exc
    if wrapper.output_spec is None:
        raise ExportError(f"{type(module).__name__}.forward was not traced")
    trap = wrapper.watch.failure() or _wrong_graph_warning(caught)
    if trap is not None:
        raise ExportError(f"{type(module).__name__}: {trap}")
    mutated_inputs = [i for i, (t, v) in enumerate(zip(user, versions)) if t._version != v]
    if mutated_inputs:
        raise ExportError(f"{type(module).__name__}.{input_write_message(mutated_inputs)}")
    model = onnx.load_from_string(buf.getvalue())
    masks = tuple(wrapper.semantics.masks) if wrapper.semantics is not None else ()
    masks_to_inputs(model, list(masks), mask_name, dynamic)
    refuse_random_ops(model, type(module).__name__)
    mark_stop_gradients(model)
    mark_grad_kinds(model)
    for node in model.graph.node:
        path = module_path_from_scope(node.name, WRAPPER_ATTR)
        if path is not None:
            node.metadata_props.add(key=MODULE_PATH_KEY, value=path)
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    return ExportedModel(
        model=model,
        output_spec=wrapper.output_spec,
        num_user_outputs=wrapper.num_user_outputs,
        mutated_buffers=wrapper.mutated,
        checks=wrapper.checks,
        opset=opset,
        masks=masks,
        dynamic=dynamic,
        batch_only=dynamic and batch_only,
        input_shapes=tuple(tuple(t.shape) for t in flat.tensors),
        shape_conditions=tuple(dict.fromkeys(str(c) for c in wrapper.watch.shape_conditional)),
        grad_mask=grad_mask(flat.tensors, params) if wrapper.watch.grad_sensitive else None,
        checkpoint_regions=checkpoint_paths(module, wrapper.watch.checkpoints),
        nested_fast_paths=tuple(dict.fromkeys(wrapper.watch.nested_fast_paths)),
    )


# The exporter's own warnings that it wrote a graph that computes something else (NOTE [trace traps]:
# index_add is rewritten before the exporter sees it; this is the backstop for other routes to it).
_WRONG_GRAPH_WARNINGS = ("will cause the ONNX model to be incorrect",)


def _wrong_graph_warning(caught) -> str | None:
    for w in caught:
        text = str(w.message)
        if any(k in text for k in _WRONG_GRAPH_WARNINGS):
            return f"the exporter warned that its graph is wrong: {text}"
    return None


def grad_mask(inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """requires_grad of every user input and parameter (see ``ExportedModel.grad_mask``)."""
    return tuple(bool(t.requires_grad) for t in (*inputs, *params))


def _trace_copy(t: torch.Tensor) -> torch.Tensor:
    copy = t.detach().clone()
    return copy.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else copy
