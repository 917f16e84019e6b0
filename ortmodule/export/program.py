"""The torch.export front end (the default; ``frontend="torchscript"`` selects the legacy tracer).

# NOTE [torch.export front end]: the module is captured with ``torch.export.export(strict=False)``
# through the same flat wrapper as the TorchScript path (user tensors, parameters, buffers as
# inputs; cloned buffers returned when mutated), under the same ExportSemantics mode: dropout masks
# are ``ortmodule::dropout_mask`` placeholders, ``detach`` / ``no_grad`` results
# ``ortmodule::stop_gradient``, BatchNorm running stats explicit updates (NOTE [dropout masks],
# NOTE [batchnorm stats], NOTE [buffer writes]). The ATen graph is translated by torch.onnx's own
# translator with onnxscript's torchlib and translations of ours (``_custom_translations``): the
# two placeholders become ``ortmodule`` domain nodes that the shared post-processing turns into
# mask inputs and marked Identities, and a training ``batch_norm`` becomes
# ``BatchNormalization(training_mode=1)`` (torchlib writes every batch norm in inference mode).
# What torch.export handles itself: data-dependent Python (``.item()`` branches) makes it raise
# (a named fallback); sizes read from ``x.shape`` become symbolic expressions, and branches on them
# become guards (NOTE [shape guards]); in-place writes to inputs and parameters show in the graph
# signature once functionalized (NOTE [functional graphs]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import re
import threading
import warnings
from collections.abc import Sequence

import onnx
import torch
from torch import nn

from ..errors import MODULE_PATH_KEY, CaptureError, ExportError, traceback_location
from ..guards import (
    atomic_attributes,
    hook_managed,
    put_back_attributes,
    stored_names,
    stored_tensors_message,
    tensor_slots,
)
from ..io import FlatInputs
from ..runtime.torch_nodes import TORCH_DOMAIN, define_torch_call_op, watch_draws
from .draws import refuse_random_ops
from .semantics import define_mask_op, mark_grad_kinds, mark_stop_gradients, masks_to_inputs
from .torch_calls import nodes_without_rules, to_torch_calls, torch_only_nodes
from .torchscript import (
    WRAPPER_ATTR,
    ExportedModel,
    _Flat,
    _trace_copy,
    input_name,
    mask_name,
)
from .traps import TraceWatch, checkpoint_paths, input_write_message, parameter_write_message

OPSET = 20
_lock = threading.Lock()
_capture_lock = threading.RLock()
_registry: dict | None = None


def _custom_op(name: str, attrs: Sequence[str], any_type: bool = False):
    import onnxscript
    from onnx.defs import OpSchema

    from .semantics import MASK_DOMAIN

    schema = OpSchema(
        name, MASK_DOMAIN, 1,
        inputs=[OpSchema.FormalParameter("x", "T")],
        outputs=[OpSchema.FormalParameter("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]
                           + (["tensor(int64)", "tensor(int32)", "tensor(int16)", "tensor(int8)", "tensor(uint8)",
                               "tensor(bool)"] if any_type else []), "")],
        attributes=[OpSchema.Attribute(a, OpSchema.AttrType.INT, "") for a in attrs],
    )
    return onnxscript.values.Op(onnxscript.values.Opset(MASK_DOMAIN, 1), name, schema)


def _custom_translations() -> dict:
    """Our translations, beside torchlib's (built once per process)."""
    global _registry
    with _lock:
        if _registry is not None:
            return _registry
        from onnxscript import opset20 as op

        from .semantics import GRAD_KIND_OP, MASK_OP, RANDOM_OP, STOP_GRADIENT_OP

        define_mask_op()
        mask_op, stop_op = _custom_op(MASK_OP, ["index"]), _custom_op(STOP_GRADIENT_OP, [])
        kind_op = _custom_op(GRAD_KIND_OP, ["kind"])
        random_op = _custom_op(RANDOM_OP, ["index"], any_type=True)

        def random_value(like, k: int):
            return random_op(like, index=k)

        def grad_kind(x, kind: int):
            return kind_op(x, kind=kind)

        def dropout_mask(x, p: float, k: int):
            return mask_op(x, index=k)

        def stop_gradient(x):
            return stop_op(x)

        def batch_norm(input, weight=None, bias=None, running_mean=None, running_var=None, training=False,
                       momentum=0.1, eps=1e-5, cudnn_enabled=False):
            channels = op.Shape(input, start=1, end=2)
            one = op.CastLike(op.Constant(value_floats=[1.0]), input)
            zero = op.CastLike(op.Constant(value_floats=[0.0]), input)
            weight = op.Expand(one, channels) if weight is None else weight
            bias = op.Expand(zero, channels) if bias is None else bias
            onnx_momentum = 1.0 - (0.1 if momentum is None else momentum)
            if not training:
                return op.BatchNormalization(input, weight, bias, running_mean, running_var, epsilon=eps,
                                             momentum=onnx_momentum)
            # Training mode: Y reads the batch statistics only. They are the stat inputs, written as
            # the TorchScript exporter's batch mean and biased variance so that the batch-stats pass
            # makes this the affine node the gradient reuses them from (NOTE [batch-stats BN]).
            axes = op.Constant(value_ints=[0, *range(2, len(input.shape))])
            mean = op.ReduceMean(input, axes, keepdims=0)
            centred = op.Sub(input, op.ReduceMean(input, axes, keepdims=1))
            var = op.ReduceMean(op.Mul(centred, centred), axes, keepdims=0)
            y, _, _ = op.BatchNormalization(input, weight, bias, mean, var, epsilon=eps, momentum=onnx_momentum,
                                            training_mode=1)
            return y

        from onnxscript.function_libs.torch_lib.ops import core as torchlib

        def to(self, *args, dtype=None, **kwargs):
            # aten.to.dtype_layout / aten.to.device: NOTE [export time] (a cast, or nothing)
            return torchlib.aten__to_copy(self, dtype=-1 if dtype is None else dtype)

        def to_device(self, device=None, dtype=None, non_blocking=False, copy=False, memory_format=None):
            return to(self, dtype=dtype)

        def to_dtype(self, dtype=None, non_blocking=False, copy=False, memory_format=None):
            return to(self, dtype=dtype)

        def to_other(self, other, non_blocking=False, copy=False, memory_format=None):
            return op.CastLike(self, other)

        def batch_norm_no_stats(input, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
            # What functionalization makes of our stat-less training batch_norm (NOTE [batchnorm
            # stats] in semantics.py). The saved mean and rstd are written out in case something
            # reads them (unread, they are removed with the other unused values).
            y = batch_norm(input, weight, bias, None, None, training, momentum, eps)
            axes = op.Constant(value_ints=[0, *range(2, len(input.shape))])
            mean = op.ReduceMean(input, axes, keepdims=1)
            centered = op.Sub(input, mean)
            var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=0)
            eps_t = op.CastLike(op.Constant(value_float=eps), input)
            rstd = op.Reciprocal(op.Sqrt(op.Add(var, eps_t)))
            return y, op.ReduceMean(input, axes, keepdims=0), rstd

        def gelu(self, approximate: str = "none"):
            # NOTE [one Gelu]: torchlib writes GELU as its Erf (or Tanh) arithmetic, five elementwise
            # ops whose intermediates the backward saves; ONNX's Gelu (opset 20) is one ORT kernel, and
            # its gradient rule reads only the input, as eager's GELU backward does.
            return op.Gelu(self, approximate=approximate)

        def hypot(self, other):
            return op.Sqrt(op.Add(op.Mul(self, self), op.Mul(other, other)))

        def cumprod(self, dim: int, dtype=None):
            # Unrolled over the (static) scanned dim: products of running prefixes, exact for zeros
            # and negatives alike (exp(cumsum(log x)) is not). A symbolic dim has no translation.
            rank = len(self.shape)
            d = dim % rank
            size = self.shape[d]
            if not isinstance(size, int):
                raise NotImplementedError("cumprod over a dimension of symbolic size")
            if dtype is not None and dtype != -1:
                self = torchlib.common_ops.cast_to(self, dtype)
            axes = op.Constant(value_ints=[d])
            parts, running = [], None
            for i in range(size):
                piece = op.Slice(self, op.Constant(value_ints=[i]), op.Constant(value_ints=[i + 1]), axes)
                running = piece if running is None else op.Mul(running, piece)
                parts.append(running)
            return parts[0] if size == 1 else op.Concat(*parts, axis=d)

        from .torch_calls import torch_call_translation

        define_torch_call_op()
        aten = torch.ops.aten
        _registry = {
            torch.ops.ortmodule.torch_call.default: torch_call_translation,
            aten.hypot.default: hypot,
            aten.gelu.default: gelu,
            aten.cumprod.default: cumprod,
            aten._native_batch_norm_legit.no_stats: batch_norm_no_stats,
            aten.to.dtype_layout: to,
            aten.to.device: to_device,
            aten.to.dtype: to_dtype,
            aten.to.other: to_other,
            aten.__and__.Tensor: torchlib.aten_bitwise_and,
            aten.__or__.Tensor: torchlib.aten_bitwise_or,
            torch.ops.ortmodule.dropout_mask.default: dropout_mask,
            torch.ops.ortmodule.random_value.default: random_value,
            torch.ops.ortmodule.stop_gradient.default: stop_gradient,
            torch.ops.ortmodule.grad_kind.default: grad_kind,
            aten.batch_norm.default: batch_norm,
        }
        return _registry


_torchlib_index: dict | None = None


def _torchlib_names() -> dict:
    """torchlib's translations by qualified name (``aten::add.Tensor``), read once per process."""
    global _torchlib_index
    with _lock:
        if _torchlib_index is None:
            from torch.onnx._internal._lazy_import import onnxscript_apis

            index: dict = {}
            for meta in onnxscript_apis.get_torchlib_ops():
                index.setdefault(meta.qualified_name, []).append(meta)
            _torchlib_index = index
        return _torchlib_index


def _qualified_names(target) -> tuple[str, ...]:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._schema.name.split("::")[-1]
        overload = target._overloadname
        full = f"{ns}::{name}.{overload}"
        return (full, f"{ns}::{name}") if overload == "default" else (full,)
    module = getattr(target, "__module__", None)
    if module in ("_operator", "operator"):
        return (f"_operator::{target.__name__}",)
    if module == "math":
        return (f"math::{target.__name__}",)
    return ()


class Translatable:
    """The targets with a translation (torchlib's or ours), answered by name without building
    torch.onnx's whole registry (NOTE [export time]: 0.6 s)."""

    def __contains__(self, target) -> bool:
        if target in _custom_translations():
            return True
        names = _torchlib_names()
        return any(n in names for n in _qualified_names(target))


def onnx_registry(targets):
    """A torch.onnx registry holding the translations of ``targets``, ours first."""
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    registry = _registration.ONNXRegistry()
    for meta in _torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    names = _torchlib_names()
    custom = _custom_translations()
    for target in targets:
        for name in _qualified_names(target):
            for meta in names.get(name, ()):
                registry._register(target, _registration.OnnxDecompMeta(
                    onnx_function=meta.function, fx_target=target, signature=None, is_custom=False,
                    is_complex=meta.is_complex))
    registry._cleanup_registry_based_on_opset_version()
    for target in targets:
        if target in custom:
            registry.register_op(target, custom[target])
    return registry


def _program_targets(ep) -> set:
    return {n.target for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"}


@dataclasses.dataclass(frozen=True)
class ShapeGuard:
    """NOTE [shape guards]: which user input shapes a torch.export graph serves.

    ``dims[i][j]`` is an int (the size is fixed), the name of a free symbol (any size in
    ``ranges[name]``, equal wherever the name recurs), or None: a size computed from other sizes,
    served only at its export-time value ``fixed[i][j]``. ``code`` holds torch.export's own guards
    (``L['tensors'][0].size()[1] > 5``), evaluated on every call's sizes.
    """

    dims: tuple[tuple[int | str | None, ...], ...]
    fixed: tuple[tuple[int, ...], ...]
    ranges: tuple[tuple[str, int, int | None], ...]
    code: tuple[str, ...]

    def __post_init__(self) -> None:
        source = " and ".join(f"({c})" for c in self.code) or "True"
        # torch writes guards with max/min (a conv's output size: ``max(1, s2 - 2)``)
        safe = {"__builtins__": {}, "max": max, "min": min, "abs": abs}
        object.__setattr__(self, "_check", eval(f"lambda L: {source}", safe))  # noqa: S307

    def __getstate__(self) -> dict:  # the compiled check is rebuilt (NOTE [persistent cache])
        return {k: v for k, v in self.__dict__.items() if k != "_check"}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        self.__post_init__()

    def covers(self, shapes: Sequence[Sequence[int]]) -> bool:
        """Whether the graph serves these user input shapes (parameters and buffers are fixed)."""
        shapes = [*shapes, *self.fixed[len(shapes):]]
        values: dict[str, int] = {}
        for dims, fixed, shape in zip(self.dims, self.fixed, shapes):
            if len(shape) != len(dims):
                return False
            for d, f, v in zip(dims, fixed, shape):
                if isinstance(d, str):
                    if values.setdefault(d, v) != v:
                        return False
                elif v != f:
                    return False
        for name, low, high in self.ranges:
            v = values.get(name)
            if v is not None and (v < low or (high is not None and v > high)):
                return False
        try:
            return bool(self._check({"tensors": [_Sizes(s) for s in shapes]}))
        except Exception:  # a guard on something else than sizes: not proven, not served
            return False


class _Sizes:
    __slots__ = ("shape",)

    def __init__(self, shape) -> None:
        self.shape = tuple(shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]


def _shape_guard(ep, n_all: int) -> ShapeGuard:
    users = set(ep.graph_signature.user_inputs)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in users]
    if len(placeholders) != n_all:
        raise ExportError(f"torch.export captured {len(placeholders)} inputs for {n_all} flat tensors")
    dims, fixed = [], []
    for node in placeholders:
        val = node.meta["val"]
        row, hint = [], []
        for s in val.shape:
            if isinstance(s, int):
                row.append(s)
                hint.append(s)
                continue
            expr = s.node.expr
            row.append(int(expr) if expr.is_Integer else str(expr) if expr.is_Symbol else None)
            hint.append(int(s.node.hint))
        dims.append(tuple(row))
        fixed.append(tuple(hint))
    ranges = []
    for sym, vr in ep.range_constraints.items():
        if not getattr(sym, "is_Symbol", False):
            continue
        ranges.append((str(sym), _bound(vr.lower, 0), _bound(vr.upper, None)))
    code = getattr(ep, "_guards_code", None)
    if code is None:
        # A torch without the recorded guard code (it arrived with the runtime guard checks of
        # ``ep.module()``): ranges alone would miss guards like ``s0 % 2 == 0``, so the graph
        # serves only its own shapes, never a guess.
        dims = [tuple(fixed_row) for fixed_row in fixed]
        return ShapeGuard(tuple(dims), tuple(fixed), (), ())
    return ShapeGuard(tuple(dims), tuple(fixed), tuple(ranges), tuple(code))


def _bound(value, unbounded):
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return unbounded  # +-oo (torch's int_oo)


def _mask_dims(semantics, guard: ShapeGuard, n_user: int):
    """Each mask dim as an int or ``(i, j)`` (a user input dim); None if one is neither."""
    where: dict[str, tuple[int, int]] = {}
    for i, row in enumerate(guard.dims[:n_user]):
        for j, d in enumerate(row):
            if isinstance(d, str):
                where.setdefault(d, (i, j))
    resolved = []
    for spec, sizes in zip(semantics.masks, semantics.mask_sizes):
        dims = []
        for s in sizes:
            if isinstance(s, int):
                dims.append(s)
                continue
            expr = s.node.expr
            if expr.is_Integer:
                dims.append(int(expr))
            elif expr.is_Symbol and str(expr) in where:
                dims.append(where[str(expr)])
            else:
                return None
        resolved.append(dataclasses.replace(spec, dims=tuple(dims)))
    return tuple(resolved)


def _module_path(node: onnx.NodeProto) -> str | None:
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = eval(prop.value, {"__builtins__": {}})  # noqa: S307 - a repr'd list of str
            except Exception:
                return None
            modules = [s for s in scopes[:-1] if s]
            if not modules or not modules[-1].startswith(WRAPPER_ATTR):
                return "" if not modules else None
            path = modules[-1][len(WRAPPER_ATTR):]
            return path[1:] if path.startswith(".") else path
    return None


_DROP_METADATA = ("pkg.torch.onnx.fx_node", "pkg.torch.onnx.stack_trace", "pkg.torch.onnx.class_hierarchy",
                  "namespace", "pkg.torch.onnx.name_scopes")


def export_program(
    module: nn.Module,
    flat: FlatInputs,
    params: Sequence[torch.Tensor],
    param_names: Sequence[Sequence[str]],
    buffers: Sequence[torch.Tensor],
    buffer_names: Sequence[Sequence[str]],
    *,
    opset: int = OPSET,
    dynamic: bool = False,
    batch_only: bool = False,
    torch_nodes: bool = True,
) -> ExportedModel:
    """Capture ``module`` with torch.export and translate it (NOTE [torch.export front end]); with
    ``torch_nodes``, custom Functions and ops without a gradient rule run in torch (NOTE [torch nodes])."""
    if opset != OPSET:
        raise ExportError(f"the torch.export front end writes opset {OPSET} graphs, not {opset}")
    name = type(module).__name__
    define_mask_op()
    wrapper = _Captured(module, flat, param_names, buffer_names)
    wrapper.watch = TraceWatch(jit=False)
    wrapper.watch.torch_nodes = torch_nodes
    wrapper.trainable = [p.requires_grad for p in params]
    user = tuple(_trace_copy(t) for t in flat.tensors)
    inputs = user + tuple(p.detach().requires_grad_(p.requires_grad) for p in params)
    inputs += tuple(b.detach() for b in buffers)
    n_user, n_all = len(user), len(inputs)
    dynamic_shapes = None
    if dynamic:
        auto = torch.export.Dim.AUTO
        dynamic_shapes = (tuple({d: auto for d in range(min(t.dim(), 1) if batch_only else t.dim())}
                                for t in user) + (None,) * (n_all - n_user),)
    try:
        # NOTE [one capture at a time]: while torch.export traces, the module's parameters are fake
        # tensors and some torch functions are patched process-wide; captures are serialised, and
        # ORTModule.forward reads the module's state under its lock.
        with _capture_lock, warnings.catch_warnings(), torch.enable_grad(), \
                watch_draws(lambda: len(wrapper.semantics.masks)) as node_draws:
            warnings.simplefilter("ignore")
            ep = torch.export.export(wrapper, inputs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:
        wrapper.restore(writes=False)  # the module runs eagerly instead: its own writes count once
        trap = wrapper.watch.failure()
        if trap is not None:
            raise ExportError(f"{name}: {trap}") from exc
        raise _capture_error(name, exc, wrapper.forward_error is not None) from exc
    wrapper.restore()
    trap = wrapper.watch.failure()
    if trap is not None:
        raise ExportError(f"{name}: {trap}")
    left = [k for k in getattr(wrapper, "tensor_stores", None) or () if k not in wrapper.stored]
    if left:
        raise ExportError(stored_tensors_message(name, left))
    read = [k for k, old in zip(wrapper.stored, wrapper.stored_before)
            if old is not None and any(c is old for c in ep.constants.values())]
    if read:  # NOTE [stored tensors as outputs]: the graph would keep the value it read
        raise ExportError(stored_tensors_message(name, read, read=True))
    _refuse_draws_before(node_draws, len(wrapper.semantics.masks), name)
    traced = _traced_files(ep)
    if wrapper.output_spec is None:
        raise ExportError(f"{name}.forward was not traced")
    if torch_nodes:  # NOTE [as torch]: before the decompositions (cdist's would hide it)
        to_torch_calls(ep, torch_only_nodes(ep))
    raw = ep
    ep = _prepared(raw, name)
    if torch_nodes:  # NOTE [decomposed to nothing]
        origins = _untranslatable_origins(ep, raw)
        if origins and to_torch_calls(raw, origins):
            ep = _prepared(raw, name)
    _refuse_mutated_inputs(ep, name, n_user, param_names)
    guard = _shape_guard(ep, n_all) if dynamic else None
    masks = tuple(wrapper.semantics.masks)
    if dynamic:
        resolved = _mask_dims(wrapper.semantics, guard, n_user)
        if resolved is None:  # a mask sized by an expression of the input sizes: one graph per shape
            wrapper.restore_module()  # NOTE [side effects]: traced again, its writes count once
            return export_program(module, flat, params, param_names, buffers, buffer_names, opset=opset,
                                  torch_nodes=torch_nodes)
        masks = resolved
    model = _translate_or_call(ep, name, n_user, param_names, buffer_names, torch_nodes)
    # NOTE [torch nodes]: the rest stays in ORT
    if torch_nodes and to_torch_calls(ep, nodes_without_rules(model)):
        model = _translate_or_call(ep, name, n_user, param_names, buffer_names, torch_nodes)
    masks_to_inputs(model, list(masks), mask_name, dynamic)
    refuse_random_ops(model, name)
    mark_stop_gradients(model)
    mark_grad_kinds(model)
    for node in model.graph.node:
        path = _module_path(node)
        keep = [p for p in node.metadata_props if p.key not in _DROP_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)
        if path is not None:
            node.metadata_props.add(key=MODULE_PATH_KEY, value=path)
    _refuse_racing_scatters(model, name)
    model = _own_batch_norm_stats(model)
    model = _reinfer_shapes(model)
    return ExportedModel(
        model=model,
        output_spec=wrapper.output_spec,
        num_user_outputs=wrapper.num_user_outputs,
        mutated_buffers=wrapper.mutated,
        checks=wrapper.checks,
        stored=wrapper.stored,
        stored_provisional=any(old is None for old in wrapper.stored_before),
        opset=opset,
        masks=masks,
        dynamic=dynamic,
        batch_only=dynamic and batch_only,
        input_shapes=tuple(tuple(t.shape) for t in flat.tensors),
        guard=guard,
        source_files=traced,
        checkpoint_regions=checkpoint_paths(module, wrapper.watch.checkpoints),
        nested_fast_paths=tuple(dict.fromkeys(wrapper.watch.nested_fast_paths)),
    )


_FILE_RE = re.compile(r'File "([^"]+)", line')


def _traced_files(ep) -> tuple[str, ...]:
    """The files the program's nodes' stack traces name (NOTE [persistent cache])."""
    files = set()
    for node in ep.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            files.update(_FILE_RE.findall(trace))
    return tuple(sorted(f for f in files if not f.startswith("<")))


def _refuse_draws_before(node_draws: list, n_draws: int, name: str) -> None:
    """NOTE [draws in torch nodes]: a torch node that draws is in eager's order only when every draw
    the graph makes before the run (a dropout mask, a ``rand_like``) comes before it in eager too."""
    for call, before, op in node_draws:
        if before < n_draws:
            raise ExportError(
                f"{name}: {call.what} at {call.where} draws random numbers ({op}) while it runs in torch, and "
                f"the forward draws {n_draws - before} more after it (dropout masks, rand ...), which the graph "
                "draws before the run: the streams would be swapped against eager's. Draw the numbers outside "
                "the Function and pass them in (NOTE [draws in torch nodes])")


class _Captured(_Flat):
    """The flat wrapper, keeping what its forward learns: torch.export puts back the attributes of
    the module it captures after the trace (containers included), so they go to a sink function."""

    _KEPT = ("output_spec", "num_user_outputs", "mutated", "checks", "semantics", "forward_error", "stored",
             "stored_before")

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.stored: tuple[tuple[str, str], ...] = ()  # NOTE [stored tensors as outputs]
        self.stored_before: tuple = ()
        record: dict = {}
        self._sink = record.update
        self._read = lambda: dict(record)

    def forward(self, *tensors: torch.Tensor):
        module = getattr(self, WRAPPER_ATTR)
        before = atomic_attributes(module)
        slots = tensor_slots(module)
        stores = None  # NOTE [stored tensors]: seen here, inside the trace: torch.export puts a list appended to back
        try:
            outs = super().forward(*tensors)
            now = tensor_slots(module)
            stores = stored_names(slots, now, hook_managed(module))
            user = tensors[:len(self.flat.tensors)]
            if stores and all(isinstance(now[k][0], torch.Tensor) and not any(now[k][0] is t for t in user)
                              for k in stores):  # an input stored as it is: refused (the exporter breaks)
                # NOTE [stored tensors as outputs]: after the user outputs, counted among them (a stored
                # aux loss gets its gradient), set on the module after each run
                n = self.num_user_outputs
                outs = outs[:n] + tuple(now[k][0] for k in stores) + outs[n:]
                self.num_user_outputs = n + len(stores)
                self.stored = tuple(stores)
                self.stored_before = tuple(slots[k][0] if k in slots and isinstance(slots[k][0], torch.Tensor)
                                           else None for k in stores)
            return outs
        finally:
            after = atomic_attributes(module)
            writes = {k: v for k, v in after.items() if k not in before or before[k] != v}
            if stores is None:  # the forward raised
                stores = stored_names(slots, tensor_slots(module), hook_managed(module))
            self._sink({**{k: getattr(self, k) for k in self._KEPT}, "attribute_writes": writes,
                        "attributes_before": before, "tensor_stores": stores})

    def restore(self, writes: bool = True) -> None:
        """Put back what the forward learnt, and the plain attributes it wrote in the module (NOTE [side
        effects]: as the TorchScript trace leaves them, so that a counter's move is seen)."""
        record = self._read()
        written = record.pop("attribute_writes", {})
        record.pop("attributes_before", None)
        for k, v in record.items():
            object.__setattr__(self, k, v)
        if writes and written:
            modules = list(getattr(self, WRAPPER_ATTR).modules())
            for (i, name), value in written.items():
                setattr(modules[i], name, value)

    def restore_module(self) -> None:
        """Set the module's plain attributes back to what they were before the trace."""
        before = self._read().get("attributes_before")
        if before is not None:
            put_back_attributes(getattr(self, WRAPPER_ATTR), before)


def _reinfer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference decides every value's shape; torch.onnx's annotations only name dims it
    left unknown.

    # NOTE [trusted shapes]: the translator annotates values from the FX node's metadata, and that
    # can be wrong: an ``aten.nll_loss_forward`` returns (loss, total_weight) and its [N] loss came
    # out annotated as a scalar, so the gradient of ``nll - x`` summed the incoming gradient over
    # the batch (a silently wrong gradient). Gradient rules read ranks and sizes, so the annotations
    # are dropped and the shapes inferred again by onnx; where both know a value with the same rank,
    # a dim onnx left unknown takes torch's symbolic name or size.
    """
    torch_shapes = {vi.name: vi.type.tensor_type.shape for vi in [*model.graph.value_info, *model.graph.output]
                    if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}
    # A torch node's outputs keep torch's types: onnx cannot infer them, and the fake run of the
    # call itself gave them (NOTE [torch nodes]); what reads them is inferred from there.
    torch_outputs = {o for n in model.graph.node if n.domain == TORCH_DOMAIN for o in n.output}
    kept = [vi for vi in model.graph.value_info if vi.name in torch_outputs]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    for out in model.graph.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    for vi in [*model.graph.value_info, *model.graph.output]:
        theirs = torch_shapes.get(vi.name)
        if theirs is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        ours = vi.type.tensor_type.shape
        if len(ours.dim) != len(theirs.dim):
            continue
        for d, t in zip(ours.dim, theirs.dim):
            if not d.HasField("dim_value") and not d.HasField("dim_param"):
                d.CopyFrom(t)
    return model


def _data_dependent_types() -> tuple[type, ...]:
    from torch._subclasses import fake_tensor
    from torch.fx.experimental import symbolic_shapes

    return tuple(t for t in (
        getattr(symbolic_shapes, "GuardOnDataDependentSymNode", None),
        getattr(fake_tensor, "DataDependentOutputException", None),
        getattr(fake_tensor, "DynamicOutputShapeException", None),
    ) if t is not None)


def _capture_error(name: str, exc: Exception, in_forward: bool) -> ExportError:
    """The fallback reason for a failed capture, naming the user's line where the trace shows it."""
    where = traceback_location(exc.__traceback__)
    at = f" at {where}" if where else ""
    if isinstance(exc, _data_dependent_types()):
        return ExportError(
            f"{name}.forward reads tensor values into Python{at} (data-dependent: {_first_line(exc)}): a graph "
            "would keep the value of the traced call for every later call. Keep the computation in tensor ops "
            "(e.g. torch.where instead of `if`), or run this module eagerly"
        )
    text = f"torch.export could not capture {name}{at}: {type(exc).__name__}: {_first_line(exc)}"
    return CaptureError(text) if in_forward else ExportError(text)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _own_batch_norm_stats(model: onnx.ModelProto) -> None:
    """NOTE [no writes into inputs] (semantics.py): ORT's training BatchNormalization may write its
    running-stat outputs into its running-stat inputs. Ours are placeholders (Y reads the batch
    statistics), but constant folding made them the very initializers an affine-less BN's scale and
    bias are (ones and zeros): the write changed the bias. Each training BN gets stat inputs of its
    own, computed from the input so that no pass folds them into shared constants again. Those fed
    the batch statistics become inference-mode nodes first (NOTE [batch-stats BN]), which write nothing."""
    import onnx_ir as ir

    from ..passes import batch_stats_batch_norm

    program = ir.serde.deserialize_model(model)
    if batch_stats_batch_norm(program.graph):
        model = ir.serde.serialize_model(program)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    shared = {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
    shared |= {o.name for o in model.graph.output}
    extra = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or not any(a.name == "training_mode" and a.i for a in node.attribute):
            extra.append(node)
            continue
        if all(n not in shared and readers.get(n) == 1 for n in node.input[3:5]):
            extra.append(node)  # computed for this node alone: it may write them
            continue
        x, base = node.input[0], node.name or node.output[0]
        mean, var = f"{base}/stat_mean", f"{base}/stat_var"
        zero = f"{base}/stat_zero"
        # mean = scale * 0 + 0 per channel, var = mean + 1: [C] values no constant folding can share
        extra.append(onnx.helper.make_node("Mul", [node.input[1], _scalar(model, zero, 0.0, x)], [mean],
                                           name=f"{base}/StatMean"))
        extra.append(onnx.helper.make_node("Add", [mean, _scalar(model, f"{base}/stat_one", 1.0, x)], [var],
                                           name=f"{base}/StatVar"))
        node.input[3], node.input[4] = mean, var
        extra.append(node)
    del model.graph.node[:]
    model.graph.node.extend(extra)
    return model


def _scalar(model: onnx.ModelProto, name: str, value: float, like: str) -> str:
    elem = next((vi.type.tensor_type.elem_type for vi in [*model.graph.value_info, *model.graph.input]
                 if vi.name == like), onnx.TensorProto.FLOAT)
    model.graph.initializer.append(onnx.helper.make_tensor(name, elem, [], [value]))
    return name


def _refuse_racing_scatters(model: onnx.ModelProto, name: str) -> None:
    """NOTE [exact scatters]: onnxruntime's CPU ScatterND(add) races on repeated indices, and torchlib
    writes ``index_put(accumulate=True)`` (and what decomposes to it, ``index_add``) with it. Our own
    rewrites route the usual calls to ScatterElements; any other route falls back, loudly."""
    for node in model.graph.node:
        if node.op_type == "ScatterND" and any(a.name == "reduction" and a.s not in (b"", b"none")
                                               for a in node.attribute):
            path = next((p.value for p in node.metadata_props if p.key == MODULE_PATH_KEY), None)
            where = f" (from torch module {path!r})" if path else ""
            raise ExportError(
                f"{name}: the graph accumulates with ScatterND{where}, which onnxruntime computes wrongly "
                "with duplicated values (indices) on more than one thread; use index_add / index_put on "
                "tensors (rewritten to an exact scatter) or torch.Tensor.scatter_add"
            )


def _refuse_mutated_inputs(ep, name: str, n_user: int, param_names) -> None:
    mutated = set(ep.graph_signature.user_inputs_to_mutate.values())
    if not mutated:
        return
    order = list(ep.graph_signature.user_inputs)
    positions = sorted(order.index(m) for m in mutated if m in order)
    params = [param_names[p - n_user][0] for p in positions if p >= n_user]
    if params:
        raise ExportError(f"{name}.{parameter_write_message(params[0])}")
    raise ExportError(f"{name}.{input_write_message([p for p in positions if p < n_user])}")


def _prepare(ep):
    """torch.onnx's preparation, decomposing only the ops torchlib has no translation for.

    # NOTE [export time]: torch.onnx re-traces the whole program through every decomposition that
    # applies (BERT-4L: ~2 s of a ~4.5 s export). Training-IR ops torchlib translates directly
    # (linear, layer_norm, embedding, sdpa ...) need none, so the program is re-traced only when an
    # op without a translation is present, with the decompositions of those ops alone.
    """
    from torch.onnx._internal.exporter import _decomp, _fx_passes

    ep._graph_module = _fx_passes.remove_assertion_nodes(ep.graph_module)
    registered = Translatable()
    mutating = _unsafe_mutation(ep)
    if not mutating:
        _rewrite_for_torchlib(ep.graph_module, registered)
    targets = {t for t in _program_targets(ep) if isinstance(t, torch._ops.OpOverload)}
    missing = {t for t in targets if t not in registered}
    # NOTE [functional graphs]: the training IR keeps in-place ops (``mul_``, ``copy_``); ONNX is
    # functional, so a value read after an in-place write would read the old value. A mutation that
    # cannot be written as a new value makes the program go through torch's functionalization.
    # NOTE [autocast capture]: the training IR is traced above the Autocast dispatch key, so an
    # autocast region of the caller leaves no casts in it (while the traced values are half
    # precision); the re-trace below the key writes them.
    autocast = any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        if missing or mutating or autocast:
            table = _decomp.create_onnx_friendly_decomposition_table(registered)
            ep = ep.run_decompositions({op: fn for op, fn in table.items() if op in missing})
            left = {t for t in _program_targets(ep) if isinstance(t, torch._ops.OpOverload) and t not in registered}
            if left & set(table):  # decompositions that produce ops needing their own
                ep = ep.run_decompositions(table)
            ep._graph_module = _fx_passes.remove_assertion_nodes(ep.graph_module)
        if torch.get_default_dtype() != torch.float32:
            _explicit_factory_dtypes(ep.graph_module)
        if _needs_type_promotion(ep.graph_module):
            _fx_passes.insert_type_promotion_nodes(ep.graph_module)
    return ep


def _explicit_factory_dtypes(gm) -> None:
    """NOTE [default dtype]: torchlib writes a factory call without ``dtype`` (``torch.ones(8)``) as
    float32, whatever ``torch.get_default_dtype()`` made it in the trace: under float64 the graph then
    mixed float and double and onnxruntime refused it. The dtype the trace recorded is made explicit."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
                    or node.kwargs.get("dtype") is not None or node.all_input_nodes:
                continue
            val = node.meta.get("val")
            names = [a.name for a in target._schema.arguments if a.kwarg_only]
            if "dtype" in names and isinstance(val, torch.Tensor):
                node.kwargs = {**node.kwargs, "dtype": val.dtype}
        module.recompile()


def _prepared(ep, name: str):
    """:func:`_prepare`, its failure an :class:`ExportError`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own deprecation warnings inside the re-trace
            return _prepare(ep)
    except Exception as exc:
        raise ExportError(f"decomposing {name}'s exported program failed: {type(exc).__name__}: "
                          f"{_first_line(exc)}") from exc


# NOTE [decomposed to nothing]: an ATen op torchlib has no translation for is decomposed first, and
# some decompositions end in ops nothing translates either: ``lgamma`` / ``digamma`` / ``i0`` /
# ``ndtri`` in prims (``prims.lgamma``, ``prims.signbit`` from ``copysign`` ...), ``linalg.inv`` /
# ``linalg.solve`` / ``cholesky`` in an effectful error check (``with_effects``). The translation then
# failed on a node that is no ATen op, so it could not become a torch node, and the whole model fell
# back (every ``Beta`` / ``Gamma`` / ``Dirichlet`` / ``StudentT`` / ``Poisson`` log-likelihood). Such a
# node's provenance (``from_node``) names the ATen call of the captured program it came from: that
# call runs in torch instead, with torch's autograd for its gradient, and the program is decomposed again.
def _untranslatable_origins(prepared, raw) -> dict[str, str]:
    """Names of ``raw``'s ATen calls whose decomposition in ``prepared`` left a node nothing translates."""
    if prepared is raw:
        return {}
    registered = Translatable()
    graph_id = id(raw.graph)
    calls = {n.name: n for n in raw.graph.nodes if n.op == "call_function"
             and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten"}
    found: dict[str, str] = {}
    for node in prepared.graph.nodes:
        target = node.target
        if node.op != "call_function" or target is operator.getitem:
            continue
        if isinstance(target, torch._ops.OpOverload) and (target.namespace == "aten" or target in registered):
            continue  # an ATen op without a translation becomes a torch node where it fails (_translate_or_call)
        if not isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            continue
        # an effectful error check (``_linalg_check_errors``) made by a second decomposition names no
        # origin: the call whose result it checks does
        origin = next((o for o in (_origin(n, graph_id) for n in (node, *node.all_input_nodes)) if o in calls), None)
        if origin is not None and origin not in found:
            what = getattr(target, "__name__", str(target))
            found[origin] = f"torch.onnx cannot translate {calls[origin].target.__name__} (it decomposes to {what})"
    return found


def _origin(node, graph_id: int) -> str | None:
    """The name of the node of graph ``graph_id`` that ``node`` was made from, by its ``from_node`` chain."""
    stack = list(node.meta.get("from_node") or ())
    while stack:
        src = stack.pop(0)
        if getattr(src, "graph_id", None) == graph_id:
            return src.name
        stack.extend(getattr(src, "from_node", None) or ())
    return None


def _needs_type_promotion(gm) -> bool:
    """Whether torch.onnx's type-promotion pass would insert a cast anywhere.

    # NOTE [export time]: the pass re-runs the whole graph on fake tensors (BERT-4L: 0.6 s) to find
    # the few mixed-dtype ops. The same rules, previewed on the dtypes the capture recorded, tell
    # whether there is any; only then does the pass run. A preview that fails runs it too.
    """
    from torch.onnx._internal.fx.passes import type_promotion as tp

    table = tp.TypePromotionTable()

    def value(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            rule = tp.get_type_promotion_rule(node, table)
            if rule is None:
                continue
            try:
                args = torch.fx.node.map_aggregate(node.args, value)
                kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
                info = rule.preview_type_promotion(args, kwargs)
            except Exception:
                return True
            wanted = [(node.args[i] if i < len(node.args) else None, d) for i, d in info.args_dtypes.items()]
            wanted += [(node.kwargs.get(k), d) for k, d in info.kwargs_dtypes.items()]
            for arg, dtype in wanted:
                if dtype is None or not isinstance(arg, torch.fx.Node):
                    continue
                val = arg.meta.get("val")
                if not isinstance(val, torch.Tensor) or val.dtype != dtype:
                    return True
    return False


def _rewrite_for_torchlib(gm, registered) -> None:
    """NOTE [export time]: training-IR ops torchlib has no translation for but an equal op it has,
    rewritten in place so that no re-trace is needed: a safe in-place op as its functional form
    (NOTE [functional graphs]) and a global ``adaptive_avg_pool2d`` as a mean."""
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        target = node.target
        if target in registered:
            continue
        name = target._schema.name.split("::")[-1]
        if target._schema.is_mutable and name.endswith("_") and not name.endswith("__"):
            packet = getattr(aten, name[:-1], None)
            functional = getattr(packet, target._overloadname, None) if packet is not None else None
            if functional is not None and functional in registered:
                node.target = functional
        elif target is aten.adaptive_avg_pool2d.default and list(node.args[1]) == [1, 1]:
            node.target, node.args = aten.mean.dim, (node.args[0], [-2, -1], True)
    gm.recompile()


def _aliases(target) -> bool:
    """Whether an op's output may alias an input (a view: ``view``, ``transpose``, ``select`` ...)."""
    schema = getattr(target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _unsafe_mutation(ep) -> bool:
    """Whether an in-place op (or a higher-order op) of the program needs torch's functionalization
    (NOTE [functional graphs]).

    A write is taken as the new value it returns only where that is exact: the written tensor is an
    intermediate (not an input, not inside a subgraph, where it would be one), made by an op that
    does not alias (not a view of something else), no view of it exists, and nothing reads it after
    the write (the traced code reads the in-place op's result from then on). ``x.add_(1)`` on a
    buffer's clone (``num_batches_tracked``) is such a write; anything else is re-traced.
    """
    for module in ep.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        nodes = list(module.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        for node in nodes:
            if node.op != "call_function":
                continue
            if isinstance(node.target, torch._ops.HigherOrderOperator):
                # ``with torch.no_grad():`` in forward (wrap_with_set_grad_enabled) and the like:
                # the translator takes them only once the re-trace has inlined them
                return True
            schema = getattr(node.target, "_schema", None)
            if schema is None:
                continue
            if not schema.is_mutable:
                continue
            if module is not ep.graph_module or node.kwargs:
                return True
            for arg, formal in zip(node.args, schema.arguments):
                if formal.alias_info is None or not formal.alias_info.is_write:
                    continue
                if not isinstance(arg, torch.fx.Node) or arg.op != "call_function" or _aliases(arg.target):
                    return True
                for user in arg.users:
                    if user is not node and (order[user] > order[node] or _aliases(user.target)):
                        return True
    return False


_UNTRANSLATED = re.compile(r"Error when translating node %(\S+) :")
_MAX_UNTRANSLATED = 16


def _translate_or_call(ep, name: str, n_user: int, param_names, buffer_names, torch_nodes: bool) -> onnx.ModelProto:
    """:func:`_translate`; with ``torch_nodes``, a node torch.onnx fails to translate (torchlib has no
    form for its arguments: ``amax`` over every dim, ``median.dim``, ``cummax``) runs in torch and the
    program is translated again, instead of the whole model falling back (NOTE [torch nodes])."""
    for attempt in range(_MAX_UNTRANSLATED + 1):
        try:
            return _translate(ep, onnx_registry(_program_targets(ep)), name, n_user, param_names, buffer_names)
        except ExportError as exc:
            match = _UNTRANSLATED.search(str(exc.__cause__ or ""))
            if not torch_nodes or match is None or attempt == _MAX_UNTRANSLATED:
                raise
            node = next((n for n in ep.graph.nodes if n.name == match.group(1)), None)
            what = getattr(getattr(node, "target", None), "__name__", match.group(1))
            reason = f"torch.onnx cannot translate {what} ({type(exc.__cause__).__name__})"
            if not to_torch_calls(ep, {match.group(1): reason}):
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


_rules_lock = threading.Lock()


@contextlib.contextmanager
def exact_rewrite_rules(training: bool = True):
    """onnxscript's default rewrite rules, less the ones that change what a graph computes.

    NOTE [near-identity constants]: its optimizer removes ``x * 1``, ``x + 0``, ``x - 0`` and
    ``x / 1`` by rules that match the constant with ``math.isclose(rel_tol=1e-5, abs_tol=1e-8)``:
    ``log(relu(h) + 1e-12)`` lost its epsilon (log(0) = -inf where eager gives -27.6),
    ``sqrt(x + 1e-10)`` and ``x * 0.9999999`` were changed too, silently. Those four rules are left
    out (an exact ``x * 1`` is rare and costs one elementwise op).

    NOTE [fused kinks]: for a training graph (``training``) the fusions of Min/Max chains into Clip
    and of Relu/Clip chains are left out too: they keep the values but not the gradient at the
    kinks, which the rules take from the ops the graph names (``minimum(maximum(x, 0), 1)`` splits a
    tie at 0 as torch.maximum does, its Clip would not; ``relu(clamp(x, -1, 1))`` has gradient 0 at
    x = 0, a Clip(0, 1) has 1). Constant folding and the other rules run as before."""
    import onnxscript
    import onnxscript.rewriter as rewriter

    try:
        from onnxscript.rewriter.rules.common import _fuse_relus_clips, _min_max_to_clip, _no_op

        left_out = {id(r) for r in _no_op.rules} - {id(_no_op.dropout_zero_rule), id(_no_op.dropout_inference_rule)}
        if training:
            left_out |= {id(r) for r in (*_fuse_relus_clips.rules, *_min_max_to_clip.rules)}
        rewriter._DEFAULT_REWRITE_RULES  # noqa: B018 (the table swapped below)
    except (ImportError, AttributeError) as exc:  # a newer onnxscript laid its rules out otherwise
        raise ExportError(
            f"onnxscript {onnxscript.__version__} keeps its rewrite rules elsewhere than ortmodule expects "
            f"({exc}); without leaving some out, its optimizer would change small constants and kink "
            "gradients (NOTE [near-identity constants]). Install the onnxscript version of ortmodule's "
            "CI (0.7.x)") from exc
    with _rules_lock:
        default = rewriter._DEFAULT_REWRITE_RULES
        rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in default if id(r) not in left_out)
        try:
            yield
        finally:
            rewriter._DEFAULT_REWRITE_RULES = default


def _translate(ep, registry, name: str, n_user: int, param_names, buffer_names) -> onnx.ModelProto:
    import onnx_ir as ir
    import onnxscript
    from torch.onnx._internal.exporter import _core

    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(None):
            warnings.simplefilter("ignore")
            program = _core._exported_program_to_onnx_program(ep, registry=registry).model
            # torchlib writes opset 18 with a few newer ops (Gelu-20) and local functions: inline
            # them, fold what is constant, then state the opset the graph uses (NOTE [torch.export
            # front end]).
            with exact_rewrite_rules():
                onnxscript.optimizer.optimize_ir(program)
            program = onnxscript.version_converter.convert_version(program, OPSET) or program
    except Exception as exc:
        raise ExportError(f"translating {name}'s exported program to ONNX failed: {type(exc).__name__}: "
                          f"{_first_line(exc)}") from exc
    names = [input_name(i) for i in range(n_user)]
    names += [n[0] for n in param_names] + [n[0] for n in buffer_names]
    renames = dict(zip(ep.graph_signature.user_inputs, names))
    graph = program.graph
    for value in graph.inputs:
        if value.name not in renames:
            raise ExportError(f"translating {name}: graph input {value.name!r} is not one of the flat tensors")
        value.name = renames[value.name]
    for i, value in enumerate(graph.outputs):
        if value.name in names:  # an input returned as is: give the output its own name
            ident = ir.node("Identity", [value])
            graph.append(ident)
            ident.outputs[0].name = f"output:{i}"
            ident.outputs[0].dtype, ident.outputs[0].shape = value.dtype, value.shape
            graph.outputs[i] = ident.outputs[0]
    return ir.serde.serialize_model(program)
