"""Trace traps: what the TorchScript tracer would record wrongly without a word, caught during the trace.

# NOTE [trace traps]: the tracer runs the forward once and records the tensor ops it sees. These
# patterns would come out silently wrong in the graph, so the export watches for them:
#
# - Python reading a traced tensor (``bool(t)``, ``t.item()``, ``int(t)``, ``len(t)``, ``t.tolist()``
#   ...): the value is baked into the graph as a constant. Each conversion is classified by walking
#   the traced value's producers: reached from a user input's or a parameter's/buffer's DATA, it is
#   a "value" conversion and the graph is wrong as soon as the data changes, so the export fails
#   (fallback, naming the line); reached only from the SIZES of user inputs (``if x.shape[0] > 4``,
#   ``range(x.size(1))``), it is a "shape" conversion and the graph is valid for that exact input
#   shape only (NOTE [shape-conditional graphs]); from constants or parameter shapes, it is safe.
#   Conversions inside torch functions (e.g. F.batch_norm's size check) run below the mode and are
#   not seen; they depend on sizes the signature already fixes or on constants.
# - A custom ``torch.autograd.Function``: its forward runs without grad, so its ops are recorded
#   as if under ``no_grad`` and its backward is lost. The export fails naming the class, except
#   torch's reentrant checkpoint Function, which is traced as the plain call it recomputes.
# - An in-place op on a parameter inside forward (an EMA teacher update): the graph would compute
#   with the updated value but never write it. The op is refused before it runs (fallback).
# - ``x.data`` is invisible to the tracer, which would bake its value at export: it is traced as
#   ``x.detach()``, and an in-place op through it is refused.
# - Gradient hooks: ``tensor.register_hook`` / ``retain_grad`` inside forward and module backward
#   hooks would never see the gradients ORT computes (the trace's copies do not even require grad):
#   the export fails naming them.
# - ``index_add`` / ``index_put(accumulate=True)``: exported as a scatter without reduction, wrong
#   with duplicate indices. They are rewritten to ``scatter_add`` (ScatterElements, reduction=add).
# - ``//`` (``floor_divide``) on integers: exported as a truncating Div. Rewritten to
#   ``torch.div(..., rounding_mode="floor")``, which the exporter writes with the sign fix-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
from collections.abc import Iterator, Sequence

import torch

from ..errors import user_location
from ..runtime.torch_nodes import inside_call

logger = logging.getLogger("ortmodule")

CONSTANT, SHAPE, VALUE = 0, 1, 2

# Tensor -> Python conversions, and what they read: the tensor's value, or only its size.
_READS_VALUE = {
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.item: "tensor.item()",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "a tensor used as a Python index",
    torch.Tensor.tolist: "tensor.tolist()",
    torch.Tensor.numpy: "tensor.numpy()",
    torch.Tensor.__complex__: "complex(tensor)",
}
_GRAD_HOOKS = {
    torch.Tensor.register_hook: "tensor.register_hook()",
    torch.Tensor.retain_grad: "tensor.retain_grad()",
}
_READS_SIZE = {
    torch.Tensor.__len__: "len(tensor)",
    torch.Tensor.numel: "tensor.numel()",
}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One tensor -> Python conversion seen during the trace."""

    kind: int  # SHAPE or VALUE
    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


class TraceWatch:
    """What the trace did that the graph cannot show: conversions and custom Functions."""

    def __init__(self, jit: bool = True) -> None:
        # ``jit``: the TorchScript tracer runs the forward (its value trace tells what a tensor came
        # from). False under torch.export (NOTE [torch.export front end]), which itself refuses
        # data-dependent Python and turns size reads into symbolic shapes with guards.
        self.jit = jit
        self.conversions: list[Conversion] = []
        self.functions: list[tuple[str, str]] = []  # (class name, where)
        self.other: list[str] = []  # other reasons the graph cannot be trusted
        self._user: set[int] = set()  # unique() of the traced values of user inputs
        self._state: set[int] = set()  # ... of parameters and buffers
        self._grad: set[int] = set()  # ... of the inputs that require grad in eager
        self.grad_sensitive = False  # the graph assumed which inputs require grad
        self._memo: dict[tuple[int, bool], int] = {}
        self._param_storage: dict[int, str] = {}
        self._data_views: dict[int, str] = {}  # storage of a traced ``x.data`` -> where it was read
        self.torch_nodes = False  # a custom Function becomes a torch node (NOTE [torch nodes])
        self.checkpoints: list[object] = []  # what each torch.utils.checkpoint call ran (NOTE [checkpoint regions])
        self.random_draws = 0  # dropout masks drawn so far (a checkpoint without preserve_rng_state watches it)
        self.nested_fast_paths: list[str] = []  # NOTE [nested fast path]: TransformerEncoders that may take it

    def watch_inputs(self, user: Sequence[torch.Tensor], state: Sequence[torch.Tensor],
                     grad_sources: Sequence[torch.Tensor] = ()) -> None:
        """The traced inputs; ``grad_sources``: those that require grad in eager (trainable
        parameters, user inputs with requires_grad), which the trace itself does not show."""
        if not self.jit:  # no value trace to read (reading one outside a JIT trace crashes)
            return
        self._user = {v for v in (_trace_id(t) for t in user) if v is not None}
        self._state = {v for v in (_trace_id(t) for t in state) if v is not None}
        self._grad = {v for v in (_trace_id(t) for t in grad_sources) if v is not None}
        self.grad_sensitive = False  # the graph assumed which inputs require grad

    def data_view(self, t: torch.Tensor, source: torch.Tensor) -> None:
        """``t`` stands for ``source.data``: an in-place op on it would not reach ``source``."""
        name = self._param_storage.get(_storage_ptr(source))
        what = f"parameter {name!r}" if name is not None else "a tensor"
        self._data_views[_storage_ptr(t)] = f"{what} (`.data` read at {user_location()})"

    def watch_parameters(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        """Parameters by storage: an in-place op on one (or on a view, ``.data``) is caught."""
        self._param_storage = {_storage_ptr(p): n for p, n in zip(params, names) if p.numel()}

    def tracing(self) -> bool:
        """Whether the forward runs under the capture this watch belongs to (this thread)."""
        return bool(torch._C._get_tracing_state()) if self.jit else True

    def requires_grad_in_eager(self, t: torch.Tensor) -> bool:
        """Whether ``t`` would require grad in eager PyTorch: it is computed from a grad source."""
        if not self.jit:  # torch.export traces with the eager requires_grad flags
            return bool(t.requires_grad)
        try:
            start = torch._C._get_value_trace(t)
        except RuntimeError:
            return False
        stack, seen = [start], set()
        while stack:
            v = stack.pop()
            if v.unique() in seen:
                continue
            seen.add(v.unique())
            if v.unique() in self._grad:
                return True
            node = v.node()
            if node.kind() in ("aten::size", "aten::detach", "ortmodule::stop_gradient"):
                continue
            stack.extend(node.inputs())
        return False

    # -- classification -------------------------------------------------------------------------
    def _depends(self, value, through_size: bool) -> int:
        """How ``value`` depends on the inputs: CONSTANT, SHAPE (user input sizes) or VALUE.

        An iterative walk over the traced producers (a deep model's graph would overflow recursion).
        Below an ``aten::size`` only the sizes of what it measures matter.
        """
        key = (value.unique(), through_size)
        if key in self._memo:
            return self._memo[key]
        result = CONSTANT
        stack = [(value, through_size)]
        seen: set[tuple[int, bool]] = set()
        while stack and result != VALUE:
            v, sized = stack.pop()
            k = (v.unique(), sized)
            if k in seen:
                continue
            seen.add(k)
            known = self._memo.get(k)
            if known is not None:
                result = max(result, known)
                continue
            if k[0] in self._user:
                result = max(result, SHAPE if sized else VALUE)
                continue
            if k[0] in self._state:
                result = max(result, CONSTANT if sized else VALUE)  # parameter shapes are in the signature
                continue
            node = v.node()
            if node.kind() in ("ortmodule::random_value", "ortmodule::dropout_mask") and not sized:
                result = VALUE  # NOTE [random draws]: a drawn value is data, whatever the placeholder holds
                continue
            if node.kind() in ("aten::size", "aten::numel", "aten::sym_size"):
                stack.extend((u, True) for u in list(node.inputs())[:1])
            else:
                stack.extend((u, sized) for u in node.inputs())
        self._memo[key] = result
        return result

    def classify(self, t: torch.Tensor, size_only: bool) -> int:
        if not self.jit or not torch._C._get_tracing_state():
            return CONSTANT
        try:
            value = torch._C._get_value_trace(t)
        except RuntimeError:
            return CONSTANT  # not traced: a constant tensor made during the forward
        return self._depends(value, size_only)

    def on_call(self, func, args) -> None:
        """Record ``func`` if it converts a traced tensor to Python or hooks into autograd."""
        if func in _GRAD_HOOKS:
            self.other.append(
                f"forward calls {_GRAD_HOOKS[func]} at {user_location()}: the hook would never run on the "
                "gradients computed in ONNX Runtime"
            )
            return
        if args and isinstance(args[0], torch.Tensor) and is_inplace(func) and self._data_views:
            where = self._data_views.get(_storage_ptr(args[0]))
            if where is not None:
                raise UnsupportedTrace(
                    f"forward modifies {where} in place through `.data` ({getattr(func, '__name__', func)} at "
                    f"{user_location()}): a graph run cannot write the tensor behind it"
                )
        if self._param_storage and args and isinstance(args[0], torch.Tensor) and is_inplace(func):
            name = self._param_storage.get(_storage_ptr(args[0]))
            if name is not None:
                # Raised before the op runs: the parameter is not changed by the export.
                raise UnsupportedTrace(
                    parameter_write_message(name, f"{getattr(func, '__name__', func)} at {user_location()}, ")
                )
        what = _READS_VALUE.get(func)
        size_only = False
        if what is None:
            what = _READS_SIZE.get(func)
            size_only = True
        if what is None or not args or not isinstance(args[0], torch.Tensor):
            return
        kind = self.classify(args[0], size_only)
        if kind != CONSTANT:
            self.conversions.append(Conversion(kind, what, user_location()))

    # -- results --------------------------------------------------------------------------------
    @property
    def shape_conditional(self) -> tuple[Conversion, ...]:
        return tuple(c for c in self.conversions if c.kind == SHAPE)

    def failure(self) -> str | None:
        """Why the traced graph cannot be trusted at all, or None."""
        if self.functions:
            names = ", ".join(f"'{n}' ({w})" for n, w in dict.fromkeys(self.functions))
            return (
                f"forward calls the custom torch.autograd.Function {names}: its forward is traced "
                "without its backward, so ortmodule cannot reproduce its gradient yet"
            )
        if self.other:
            return self.other[0]
        values = [c for c in self.conversions if c.kind == VALUE]
        if values:
            listed = "; ".join(str(c) for c in list(dict.fromkeys(values))[:3])
            return (
                f"forward reads tensor values into Python ({listed}): the graph would keep the "
                "value of the traced call for every later call. Keep the computation in tensor ops "
                "(e.g. torch.where instead of `if`), or run this module eagerly"
            )
        return None


_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}


def is_inplace(func) -> bool:
    """Whether ``func`` writes its first argument (``add_``, ``__iadd__``, ``__setitem__`` ...)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


def _storage_ptr(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (its StorageImpl: also for fake tensors, whose data_ptr is 0)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return -1


def _trace_id(t: torch.Tensor) -> int | None:
    try:
        return torch._C._get_value_trace(t).unique()
    except RuntimeError:
        return None


def _is_torch_hook(hook) -> bool:
    """torch's own hooks (weight_norm, spectral_norm, ...) compute what the forward then reads."""
    target = getattr(hook, "__func__", hook)
    mod = getattr(target, "__module__", None) or type(target).__module__
    return mod.startswith("torch.")


def _marks_requires_grad(hook) -> bool:
    """transformers' ``enable_input_require_grads`` hook (installed by gradient_checkpointing_enable):
    ``output.requires_grad_(True)`` on the input embeddings, so that a reentrant checkpoint gets an
    input that requires grad when they are frozen. It runs in the trace (the checkpoint trap sees
    its effect), and inside the graph gradients reach the trainable parameters without it."""
    return getattr(hook, "__qualname__", "").endswith("enable_input_require_grads.<locals>.make_inputs_require_grads")


# NOTE [nested fast path]: in eval mode, with a src_key_padding_mask and no gradient to record
# (grad disabled, or the first layer's weights and the input all frozen), ``nn.TransformerEncoder`` runs
# its layers on a nested tensor of the unpadded tokens and pads the result with zeros: the padded
# positions come out 0 (BERT-like mean pooling over them, or any later use, sees zeros), where the
# regular path (the one torch.export and the TorchScript tracer take, and the one eager takes with
# gradients) computes them. The kept positions agree to ~1e-6. Which path eager takes depends on the
# grad mode and on requires_grad at call time, and on the mask's values (left-aligned or not), which
# one graph cannot follow; so the trace notes the encoders whose call meets the static conditions,
# and ORTModule runs a call eagerly (one fallback warning) when eager may take the path
# (``nested_fast_path_reason``). Training and grad-enabled evaluation stay in ORT.
def _may_take_nested_path(encoder: torch.nn.Module, src, mask, padding_mask) -> bool:
    """Whether eager's TransformerEncoder may take the nested-tensor path, from what the trace can see
    (torch's own checks, less the data-dependent mask alignment, and the grad-mode and
    ``torch.backends.mha`` switches, which the call reads: ``nested_fast_path_reason``)."""
    first = encoder.layers[0] if len(encoder.layers) else None
    return (first is not None and getattr(encoder, "use_nested_tensor", False) and not first.training
            and padding_mask is not None and mask is None and isinstance(src, torch.Tensor) and src.dim() == 3
            and not src.is_nested and not torch.is_autocast_enabled()
            and src.device.type in ("cpu", "cuda", "xpu"))


@contextlib.contextmanager
def watch_nested_fast_path(module: torch.nn.Module, watch: TraceWatch) -> Iterator[None]:
    """Note which ``nn.TransformerEncoder`` of ``module`` is called the way eager's nested-tensor fast
    path needs (NOTE [nested fast path])."""
    paths = {id(m): name for name, m in module.named_modules() if isinstance(m, torch.nn.TransformerEncoder)}
    if not paths:
        yield
        return
    cls = torch.nn.TransformerEncoder
    original = cls.forward
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        if id(self) in paths:
            try:
                bound = signature.bind(self, *args, **kwargs)
            except TypeError:  # not torch's signature: let the original forward say so
                bound = None
            if bound is not None:
                bound.apply_defaults()
                a = bound.arguments
                if _may_take_nested_path(self, a.get("src"), a.get("mask"), a.get("src_key_padding_mask")):
                    watch.nested_fast_paths.append(paths[id(self)])
        return original(self, *args, **kwargs)

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original


def nested_fast_path_reason(module: torch.nn.Module, paths: Sequence[str]) -> str | None:
    """Why this call must run eagerly (NOTE [nested fast path]): an encoder the trace noted, whose first
    layer has no weight requiring grad where it matters (grad disabled, or all frozen); None otherwise."""
    if not torch.backends.mha.get_fastpath_enabled():
        return None
    for path in paths:
        try:
            first = module.get_submodule(path).layers[0]
        except (AttributeError, IndexError):
            continue
        if torch.is_grad_enabled() and any(p.requires_grad for p in first.parameters()):
            continue
        return (f"nn.TransformerEncoder {path or '<top>'!r} runs on a nested tensor in eager here (eval mode, a "
                "padding mask, no gradient to record), which gives 0 at the padded positions; the graph "
                "computes them, so this call runs eagerly (set enable_nested_tensor=False to run it in ORT)")
    return None


@contextlib.contextmanager
def watch_forward_hooks(module: torch.nn.Module, watch: TraceWatch) -> Iterator[None]:
    """NOTE [trace traps]: a forward hook on a submodule runs during the trace only. One that returns
    a value (a changed output or input) is in the graph; one that returns None acts by side effects
    alone (activations stored for a feature or distillation loss), which would hold traced tensors
    from the export and never run again: recorded as a failure."""
    saved = []

    def wrap(hook, where: str, kind: str):
        def run(*args, **kwargs):
            result = hook(*args, **kwargs)
            if result is None and not _is_torch_hook(hook) and not _marks_requires_grad(hook):
                name = getattr(hook, "__qualname__", type(hook).__qualname__)
                watch.other.append(
                    f"the forward {kind} {name!r} on {where} returns None (it acts by side effects, e.g. "
                    "storing activations): it would run once, at export, and never on later calls"
                )
            return result
        return run

    try:
        for name, m in module.named_modules():
            for kind, hooks in (("hook", m._forward_hooks), ("pre-hook", m._forward_pre_hooks)):
                if not hooks:
                    continue
                saved.append((hooks, dict(hooks)))
                for key, hook in list(hooks.items()):
                    hooks[key] = wrap(hook, f"submodule {name or '<top>'!r}", kind)
        yield
    finally:
        for hooks, original in saved:
            hooks.update(original)


def backward_hook_failure(module: torch.nn.Module) -> str | None:
    """NOTE [trace traps]: a module backward hook would never see the gradients ORT computes."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        return "a global module backward hook is registered (register_module_full_backward_hook)"
    for name, m in module.named_modules():
        if m._backward_hooks or m._backward_pre_hooks:
            return (
                f"submodule {name or '<top>'!r} has a backward hook (register_full_backward_hook): it would "
                "never see the gradients computed in ONNX Runtime"
            )
    return None


# -- rewrites of ops the exporter gets wrong ------------------------------------------------------

NOT_REWRITTEN = object()


def _bind(names: Sequence[str], defaults: dict, args, kwargs) -> dict:
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _index_add(self_: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, alpha=1) -> torch.Tensor:
    """``self.index_add(dim, index, source, alpha)`` as a scatter_add (exact with repeated indices)."""
    dim = dim + self_.dim() if dim < 0 else dim
    if self_.dim() == 0:
        return self_ + (source * alpha).sum()
    source = source * alpha if not (isinstance(alpha, (int, float)) and alpha == 1) else source
    if source.dim() == 0:
        source = source.reshape([1])
    shape = [1] * source.dim()
    shape[dim] = -1
    index = index.reshape(shape).expand_as(source)
    return self_.scatter_add(dim, index, source.to(self_.dtype))


def _index_put(self_: torch.Tensor, indices, values: torch.Tensor) -> torch.Tensor | object:
    """``self.index_put(indices, values, accumulate=True)`` for integer index tensors on leading dims."""
    indices = list(indices)
    if not indices or any(i is None or i.dtype in (torch.bool, torch.uint8) or i.is_floating_point()
                          for i in indices):
        return NOT_REWRITTEN
    k = len(indices)
    lead = self_.shape[:k]
    rest = self_.shape[k:]
    idx = torch.broadcast_tensors(*indices)
    linear = None
    for j, ij in enumerate(idx):
        size = lead[j]
        ij = torch.where(ij < 0, ij + size, ij)
        linear = ij if linear is None else linear * size + ij
    flat_idx = linear.reshape(-1)
    vals = values.to(self_.dtype).expand(tuple(idx[0].shape) + tuple(rest)).reshape((-1, *rest))
    flat = self_.reshape((-1, *rest))
    return _index_add(flat, 0, flat_idx, vals).reshape(self_.shape)


def requires_grad_in_eager(t: torch.Tensor) -> bool:
    """Whether ``t`` requires grad in eager: in the trace, ``.detach()`` and no_grad results are
    ortmodule's stop_gradient op (NOTE [stop gradient]), whose output still requires grad there; a
    path to a leaf that avoids them is eager's requires_grad."""
    if not t.requires_grad:
        return False
    stack, seen = [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "AccumulateGrad":
            return True
        if fn.name() == "torch::autograd::WarnNotImplemented":  # the stop_gradient op: no autograd of its own
            continue
        stack.extend(f for f, _ in fn.next_functions)
    return t.grad_fn is None  # a leaf that requires grad


def rewrite(func, args, kwargs, watch: TraceWatch | None = None):
    """The exact formulation of an op the exporter gets wrong, or ``NOT_REWRITTEN``."""
    if func in _GRAD_HOOKS:  # a failure recorded by on_call; in the trace there is nothing to hook
        return None if func is torch.Tensor.retain_grad else _NoHandle()
    # The TorchScript trace's copies do not require grad: its value trace tells what a tensor came from.
    needs_grad = watch.requires_grad_in_eager if watch is not None and watch.jit else requires_grad_in_eager
    if func in _NO_DERIVATIVE and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and needs_grad(t) for t in (*args, *kwargs.values())):
        # NOTE [no derivative]: eager's backward raises "derivative for aten::floor_divide is not
        # implemented" (heaviside alike); the graph would give zeros or None without a word
        name = getattr(func, "__name__", str(func)).strip("_").replace("rfloordiv", "floordiv")
        raise UnsupportedTrace(
            f"{name} at {user_location()} gets a tensor that requires grad, and torch has no derivative for it "
            "(eager's backward raises): compute it under torch.no_grad() or on .detach()ed values, or write the "
            "gradient you mean (a straight-through estimator: x + (f(x) - x).detach())")
    if func in _FLOOR_DIVIDE:
        a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
        if func in (torch.Tensor.__rfloordiv__,):
            a, b = b, a
        if not isinstance(a, torch.Tensor):  # ``7 // t``: torchlib's div takes tensors only
            a = torch.as_tensor(a, dtype=torch.result_type(a, b), device=b.device)
        out = torch.div(a, b, rounding_mode="floor")
        if func in (torch.Tensor.__ifloordiv__, torch.Tensor.floor_divide_):
            return args[0].copy_(out)
        return out
    if func in _INDEX_ADD:
        b = _bind(("self", "dim", "index", "source"), {"alpha": 1}, args, kwargs)
        out = _index_add(b["self"], b["dim"], b["index"], b["source"], b["alpha"])
        if func is torch.Tensor.index_add_:
            return b["self"].copy_(out)
        return out
    if func in _INDEX_PUT:
        b = _bind(("self", "indices", "values", "accumulate"), {"accumulate": False}, args, kwargs)
        if not b["accumulate"]:
            return NOT_REWRITTEN
        out = _index_put(b["self"], b["indices"], b["values"])
        if out is NOT_REWRITTEN:
            raise UnsupportedTrace(
                f"index_put_(accumulate=True) with boolean or None indices at {user_location()}: the "
                "exporter writes it as a scatter without accumulation"
            )
        if func is torch.Tensor.index_put_:
            return b["self"].copy_(out)
        return out
    return NOT_REWRITTEN


_FLOOR_DIVIDE = {torch.floor_divide, torch.Tensor.floor_divide, torch.Tensor.floor_divide_,
                 torch.Tensor.__floordiv__, torch.Tensor.__rfloordiv__, torch.Tensor.__ifloordiv__}
_NO_DERIVATIVE = _FLOOR_DIVIDE | {torch.heaviside, torch.Tensor.heaviside, torch.Tensor.heaviside_}
_INDEX_ADD = {torch.index_add, torch.Tensor.index_add, torch.Tensor.index_add_}
_INDEX_PUT = {torch.index_put, torch.Tensor.index_put, torch.Tensor.index_put_, torch.index_put_}


def parameter_write_message(param: str, where: str = "") -> str:
    """Why a forward that writes a parameter in place falls back (``where``: ``"func at line, "``)."""
    return (
        f"forward modifies parameter {param!r} in place ({where}e.g. an EMA / momentum-encoder update): a graph "
        "run cannot write parameters. Update it outside forward (after optimizer.step()) to keep the module in "
        "ONNX Runtime"
    )


def input_write_message(positions: Sequence[int]) -> str:
    """Why a forward that writes its input tensors in place falls back (NOTE [inputs mutated in place])."""
    return (
        f"forward modifies its input tensor(s) {list(positions)} (positions among the tensors of the call) in "
        "place: eager PyTorch changes the caller's tensor, a graph run cannot. Write `x = x * 2` instead of "
        "`x.mul_(2)` to keep it in ONNX Runtime"
    )


class _NoHandle:
    def remove(self) -> None:
        pass


class UnsupportedTrace(Exception):
    """The forward did something the trace cannot capture exactly (raised inside the trace)."""


# -- custom autograd Functions -------------------------------------------------------------------

_local = threading.local()


_installed = threading.Lock()


def _no_preserve_message(where: str) -> str:
    return (f"torch.utils.checkpoint(preserve_rng_state=False) at {where} runs dropout: eager's recompute draws "
            "new masks (another gradient, and torch's generator moves on), ortmodule's recompute reuses the "
            "forward's; pass preserve_rng_state=True (the default)")


def _draws_refused(watch: TraceWatch, gen, where: str):
    """The non-reentrant checkpoint's generator, refusing a region that drew dropout masks when the RNG
    state is not preserved: the region runs between its two steps."""
    draws = watch.random_draws
    yield from gen
    if watch.random_draws > draws:
        watch.other.append(_no_preserve_message(where))


def _install_apply_hook() -> None:
    """Wrap ``torch.autograd.Function.apply`` once: a no-op unless this thread is tracing for us."""
    base = torch.autograd.Function
    with _installed:
        if getattr(base.apply, "_ortmodule_hook", False):
            return
        import torch.utils.checkpoint as checkpoint_module
        from torch.utils.checkpoint import CheckpointFunction

        original = base.__dict__["apply"].__func__
        generator = checkpoint_module._checkpoint_without_reentrant_generator

        def without_reentrant(function, *args, **kwargs):  # NOTE [checkpoint regions]
            watch = getattr(_local, "watch", None)
            if watch is not None and watch.tracing():
                watch.checkpoints.append(function)
                if not (args[0] if args else kwargs.get("preserve_rng_state", True)):
                    return _draws_refused(watch, generator(function, *args, **kwargs), user_location())
            return generator(function, *args, **kwargs)

        checkpoint_module._checkpoint_without_reentrant_generator = without_reentrant

        def apply(cls, *args, **kwargs):
            watch = getattr(_local, "watch", None)
            # NOTE [custom ops]: torch.library gives a custom op's autograd (register_autograd) as a Function
            # of its own: that is the op itself, which the trace records with its fake kernel
            if watch is not None and watch.tracing() and not cls.__module__.startswith("torch._library"):
                if cls is CheckpointFunction:
                    function, preserve_rng, *inputs = args
                    if not preserve_rng:
                        draws = watch.random_draws
                        out = function(*inputs)
                        if watch.random_draws > draws:
                            watch.other.append(_no_preserve_message(user_location()))
                        return out
                    watch.grad_sensitive = True
                    watch.checkpoints.append(function)
                    if not any(isinstance(t, torch.Tensor) and watch.requires_grad_in_eager(t) for t in inputs):
                        # Eager gives the checkpointed parameters no gradient then ("None of the
                        # inputs have requires_grad=True"), and which inputs require grad is not
                        # part of the export key: not reproduced.
                        watch.other.append(
                            f"torch.utils.checkpoint(use_reentrant=True) at {user_location()} gets no input "
                            "that requires grad, so eager PyTorch gives the parameters inside no gradient; "
                            "use use_reentrant=False"
                        )
                    return function(*inputs)
                if not watch.jit and watch.torch_nodes and not inside_call():  # NOTE [torch nodes]
                    from .torch_calls import function_call

                    out, refused = function_call(original, cls, args, kwargs, user_location())
                    if refused is None:
                        return out
                    watch.other.append(refused)
                else:
                    watch.functions.append((cls.__qualname__, user_location()))
            return original(cls, *args, **kwargs)

        apply._ortmodule_hook = True
        base.apply = classmethod(apply)


def checkpoint_paths(root: torch.nn.Module, functions: Sequence[object]) -> tuple[str, ...]:
    """NOTE [checkpoint regions]: the module paths of the ``torch.utils.checkpoint`` calls of a
    trace. The checkpointed call is inlined into the graph (its gradient is the call's gradient); the
    region is then recomputed in the backward graph, like a level-1 block (``recompute.py``). A
    region is known by the module it runs (``checkpoint(block, x)``, ``checkpoint(block.forward,
    x)``, transformers' ``partial(layer.__call__, ...)``); a checkpointed plain function keeps
    its values saved (logged), as without checkpointing: the gradients are the same either way."""
    names = {id(m): n for n, m in root.named_modules()}
    paths = []
    for fn in functions:
        bound = None  # ``partial(Layer.forward, layer, ...)`` binds the module as the first argument
        while isinstance(fn, functools.partial):
            if fn.args and bound is None:
                bound = fn.args[0]
            fn = fn.func
        owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        if owner is None and isinstance(bound, torch.nn.Module):  # the region only chooses what is
            owner = bound  # recomputed: any choice of forward nodes recomputes exactly
        path = names.get(id(owner)) if isinstance(owner, torch.nn.Module) else None
        if path is None:
            logger.info("torch.utils.checkpoint of %r is not a submodule's call: its values are saved, not "
                        "recomputed (checkpoint a module, or use memory_opt_level=1)", fn)
        elif path not in paths:
            paths.append(path)
            _warn_batch_norm_in_checkpoint(owner, path)
    return tuple(paths)


def _warn_batch_norm_in_checkpoint(region: torch.nn.Module, path: str) -> None:
    norms = [n for n, m in region.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.training and m.track_running_stats]
    if norms:
        import warnings

        where = ".".join(p for p in (path, norms[0]) if p)
        warnings.warn(f"BatchNorm {where!r} runs under torch.utils.checkpoint: eager PyTorch updates its running "
                      "statistics twice per step (again in the recompute); ortmodule updates them once, as "
                      "without checkpointing (NOTE [checkpoint regions])", UserWarning, stacklevel=2)


@contextlib.contextmanager
def thread_value(local: threading.local, name: str, value) -> Iterator[None]:
    """Set ``local.name`` to ``value`` for the block (this thread only), then put back what was there."""
    outer = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, outer)


@contextlib.contextmanager
def intercept_functions(watch: TraceWatch) -> Iterator[None]:
    """Record every custom ``autograd.Function`` the forward applies (NOTE [trace traps]).

    torch's reentrant checkpoint runs as the plain call it wraps: its gradient is the gradient of
    that call (the recompute in the backward is an eager memory saving, not a different function).
    """
    _install_apply_hook()
    with thread_value(_local, "watch", watch):
        yield
