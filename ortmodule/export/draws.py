"""Random tensors the forward draws (``torch.rand``, ``randn_like``, ``bernoulli``, ``normal_`` ...):
drawn by torch, in eager order, and fed to the graph as inputs.

# NOTE [random draws]: the exporters wrote ``torch.rand_like(x)`` as ONNX RandomUniformLike, drawn
# by ONNX Runtime's own generator: ``torch.manual_seed`` did not reproduce a run, and the values
# differed from eager PyTorch's (a diffusion model's noise, a VAE's reparameterisation, timm's
# drop-path, noise injection all trained on other numbers than the same seed gives in eager). Each
# draw is now a graph input, as the dropout masks are (NOTE [dropout masks]): during the trace a
# placeholder ``ortmodule::random_value(like, k)`` stands for draw k, and before each run the draws
# are made in torch, in trace order (the eager order, masks and draws in one list), by the call
# eager makes: ``empty(shape, dtype).<fill>_(*params)`` (``torch.rand`` is ``empty().uniform_()``,
# ``randn`` ``normal_()``, ``randint(lo, hi)`` ``random_(lo, hi)``, ``*_like`` the same in the
# template's memory order, NOTE [mask layout]), or ``torch.randperm``. What eager computes from a
# draw and tensors is written in the graph from the drawn input, as ATen does it:
# - ``bernoulli(p)`` with a tensor ``p`` is ``uniform < p`` (ATen's CPU kernel draws one uniform per
#   element in memory order and compares);
# - ``normal(mean, std)`` with a tensor is ``normal_(0, 1) * std + mean`` (``normal_(0, std) + mean``
#   for a float std), and has no gradient (eager's is zero).
# On CPU every draw is bit-identical to eager's (tests/test_random_draws.py). On CUDA the same calls
# draw from torch's CUDA generator (seeded, same distribution); ``bernoulli(p)`` with a tensor then
# takes other values than eager's kernel (as CUDA dropout masks do). A draw whose result depends on
# values inside the graph in another way (``multinomial``, ``poisson``, ``binomial``, the gamma and
# Dirichlet draws) runs as a torch node under the torch.export front end (NOTE [draws as torch nodes]
# in torch_calls.py), drawing during the run in eager's order; under the TorchScript one, and for
# ``rrelu`` in training or a call with its own ``generator=``, it is refused (fallback naming it); so
# is any random op that still reaches the ONNX graph (:func:`refuse_random_ops`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..errors import user_location
from .traps import UnsupportedTrace

RANDOM_OP = "RandomValue"

# in-place fills eager makes, by the function the forward calls
_INPLACE_FILLS = {
    torch.Tensor.uniform_: "uniform_", torch.Tensor.normal_: "normal_", torch.Tensor.random_: "random_",
    torch.Tensor.exponential_: "exponential_", torch.Tensor.geometric_: "geometric_",
    torch.Tensor.cauchy_: "cauchy_", torch.Tensor.log_normal_: "log_normal_", torch.Tensor.bernoulli_: "bernoulli_",
}
_FRESH = {torch.rand: "uniform_", torch.randn: "normal_"}
_LIKE = {torch.rand_like: "uniform_", torch.randn_like: "normal_", torch.randint_like: "random_"}
_REFUSED = {
    torch.multinomial: "multinomial", torch.Tensor.multinomial: "multinomial", torch.poisson: "poisson",
    torch.binomial: "binomial", torch._standard_gamma: "_standard_gamma", torch._sample_dirichlet: "_sample_dirichlet",
}
RANDOM_FUNCS = frozenset({*_INPLACE_FILLS, *_FRESH, *_LIKE, *_REFUSED, torch.randint, torch.randperm, torch.normal,
                          torch.bernoulli, torch.Tensor.bernoulli, F.gumbel_softmax, F.rrelu, F.rrelu_})
# random ONNX ops: what reaches the graph drew on ONNX Runtime's generator
_ONNX_RANDOM = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                          "Bernoulli"})


@dataclasses.dataclass(frozen=True)
class RandomSpec:
    """One random draw: ``empty(shape, dtype, device).<fill>(*params)`` (``fill`` "randperm":
    ``torch.randperm(shape[0])``). ``dims`` and ``order`` as in :class:`MaskSpec`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: str
    params: tuple = ()
    device: str | None = None  # the device eager draws on, if the call names one
    dims: tuple | None = None
    order: tuple[int, ...] | None = None

    def draw(self, device: torch.device, inputs=()) -> torch.Tensor:
        from .semantics import drawn_shape, strided_empty

        shape = drawn_shape(self.shape, self.dims, inputs)
        where = torch.device(self.device) if self.device is not None else device
        if self.fill == "randperm":
            out = torch.randperm(shape[0], dtype=self.dtype, device=where)
        else:
            out = strided_empty(shape, self.order, self.dtype, where)
            getattr(out, self.fill)(*self.params)
        return out.to(device).contiguous()


def _refuse(what: str, why: str):
    raise UnsupportedTrace(f"{what} at {user_location()}: {why} (NOTE [random draws])")


def _sizes(args, kwargs) -> tuple:
    size = kwargs["size"] if "size" in kwargs else args
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = size[0]
    return tuple(size)


def _concrete(v):
    """A bound given as a SymInt (``randint(0, x.size(1), ...)``) as an int: torch.export guards
    that size (NOTE [shape guards])."""
    return int(v) if isinstance(v, torch.SymInt) else v


def _randint_args(args, kwargs):
    """(low, high, size) of ``torch.randint(high, size)`` / ``torch.randint(low, high, size)``."""
    pos = list(args)
    size = kwargs["size"] if "size" in kwargs else pos.pop()
    if len(pos) == 2:
        low, high = pos
    elif len(pos) == 1:
        low, high = kwargs.get("low", 0), pos[0]
    else:
        low, high = kwargs.get("low", 0), kwargs["high"]
    return _concrete(low), _concrete(high), tuple(size)


def random_call(semantics, func, args, kwargs):
    """The traced value of one random call (NOTE [random draws]); ``semantics`` is the tracing
    ExportSemantics, which owns the list of draws."""
    from .semantics import _memory_order, stop_gradient

    name = getattr(func, "__name__", str(func))
    if kwargs.get("generator") is not None:
        _refuse(name, "a call with its own generator= is not supported: ortmodule draws from torch's default one")
    if kwargs.get("out") is not None:
        _refuse(name, "a random call with out= is not supported")
    if func in _REFUSED:
        watch = semantics.watch
        if watch is not None and watch.torch_nodes:  # NOTE [draws as torch nodes]
            from .torch_calls import drawing_call

            watch.random_draws += 1
            out = drawing_call(func, args, kwargs, user_location())
            if out is not None:
                return out
        _refuse(name, "its values depend on tensors inside the graph, and ONNX has no op that draws them "
                "as torch does")
    if func in (F.rrelu, F.rrelu_):
        training = args[3] if len(args) > 3 else kwargs.get("training", False)
        if not training:
            return func(*args, **kwargs)
        _refuse(name, "in training it draws a slope for each negative element from torch's generator, "
                "which the graph cannot do")
    draw = semantics.random_draw
    if func in _FRESH or func is torch.randint:
        if func is torch.randint:
            low, high, size = _randint_args(args, kwargs)
            fill, params, dtype = "random_", (low, high), kwargs.get("dtype") or torch.int64
        else:
            size, fill, params = _sizes(args, kwargs), _FRESH[func], ()
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
        return draw(size, dtype, fill, params, kwargs.get("device"), None)
    if func is torch.randperm:
        n = args[0] if args else kwargs["n"]
        return draw((n,), kwargs.get("dtype") or torch.int64, "randperm", (), kwargs.get("device"), None)
    if func in _LIKE:
        like = args[0] if args else kwargs["input"]
        params = ()
        if func is torch.randint_like:
            rest = [_concrete(v) for v in args[1:]]
            low, high = (0, rest[0]) if len(rest) == 1 else rest[:2] if rest else (kwargs.get("low", 0), kwargs["high"])
            params = (_concrete(low), _concrete(high))
        fmt = kwargs.get("memory_format", torch.preserve_format)
        order = _memory_order(like) if fmt is torch.preserve_format else None
        if fmt not in (torch.preserve_format, torch.contiguous_format):
            _refuse(name, f"memory_format={fmt} is not supported")
        return draw(tuple(like.shape), kwargs.get("dtype") or like.dtype, _LIKE[func], params,
                    kwargs.get("device") or like.device, order)
    if func in _INPLACE_FILLS:
        target = args[0]
        fill, params = _INPLACE_FILLS[func], tuple(_concrete(v) for v in args[1:])
        params += tuple(_concrete(v) for k, v in kwargs.items() if k != "generator")
        if fill == "bernoulli_" and params and isinstance(params[0], torch.Tensor):
            u = draw(tuple(target.shape), target.dtype if target.is_floating_point() else torch.float32,
                     "uniform_", (), target.device, _memory_order(target))
            value = (u < params[0]).to(target.dtype)
        elif any(isinstance(p, torch.Tensor) for p in params):
            _refuse(name, "a tensor parameter is not supported")
        else:
            value = draw(tuple(target.shape), target.dtype, fill, params, target.device, _memory_order(target))
        return semantics.__torch_function__(torch.Tensor.copy_, (), (target, value), {})
    if func in (torch.bernoulli, torch.Tensor.bernoulli):
        names = ("input", "p")
        b = dict(zip(names, args))
        b.update({k: v for k, v in kwargs.items() if k != "generator"})
        x, p = b["input"], b.get("p")
        if p is not None:
            return draw(tuple(x.shape), x.dtype, "bernoulli_", (_concrete(p),), x.device, _memory_order(x))
        # bernoulli(probabilities): uniform < p, contiguous as eager's result
        u = draw(tuple(x.shape), x.dtype, "uniform_", (), x.device, None)
        out = stop_gradient((u < x).to(x.dtype))
        if x.requires_grad:
            # eager's backward gives the probabilities a gradient of zeros (not None: an optimizer's
            # weight decay and moments still step a parameter read only here)
            out = out + (x - stop_gradient(x)) * 0
        return out
    if func is torch.normal:
        return _normal(draw, stop_gradient, args, kwargs)
    if func is F.gumbel_softmax:
        return _gumbel_softmax(draw, stop_gradient, args, kwargs)
    raise AssertionError(f"no handling for {name}")  # RANDOM_FUNCS and the branches above disagree


def _normal(draw, stop_gradient, args, kwargs):
    b = dict(zip(("mean", "std", "size"), args))
    b.update({k: v for k, v in kwargs.items() if k != "generator"})
    mean, std = b.get("mean", 0.0), b.get("std", 1.0)
    if not isinstance(mean, torch.Tensor) and not isinstance(std, torch.Tensor):
        return draw(tuple(b["size"]), b.get("dtype") or torch.get_default_dtype(), "normal_",
                    (float(mean), float(std)), b.get("device"), None)
    ref = mean if isinstance(mean, torch.Tensor) else std
    shape = torch.broadcast_shapes(mean.shape, std.shape) if isinstance(std, torch.Tensor) \
        and isinstance(mean, torch.Tensor) else ref.shape
    if isinstance(mean, torch.Tensor) and not isinstance(std, torch.Tensor):  # ATen: normal_(0, std) + mean
        return stop_gradient(draw(tuple(shape), ref.dtype, "normal_", (0.0, float(std)), ref.device, None) + mean)
    z = draw(tuple(shape), ref.dtype, "normal_", (0.0, 1.0), ref.device, None)
    return stop_gradient(z * std + mean)  # ATen: normal_(0, 1).mul_(std).add_(mean)


def _gumbel_softmax(draw, stop_gradient, args, kwargs):
    """F.gumbel_softmax as torch writes it, its exponential noise drawn by torch."""
    b = {"tau": 1.0, "hard": False, "eps": 1e-10, "dim": -1}
    b.update(zip(("logits", "tau", "hard", "eps", "dim"), args))
    b.update(kwargs)
    logits, dim = b["logits"], b["dim"]
    e = draw(tuple(logits.shape), logits.dtype, "exponential_", (), logits.device, None)
    y_soft = ((logits - e.log()) / b["tau"]).softmax(dim)
    if not b["hard"]:
        return y_soft
    index = y_soft.argmax(dim, keepdim=True)
    y_hard = torch.zeros_like(logits, memory_format=torch.legacy_contiguous_format).scatter_(dim, index, 1.0)
    return y_hard - stop_gradient(y_soft) + y_soft


def refuse_random_ops(model, name: str) -> None:
    """NOTE [random draws]: a random op in the ONNX graph would draw on ONNX Runtime's generator."""
    from ..errors import ExportError

    for node in model.graph.node:
        if node.domain == "" and node.op_type in _ONNX_RANDOM:
            where = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
            raise ExportError(
                f"{name}'s graph has a random op ({node.op_type}, node '{node.name}'"
                + (f", from {where}" if where else "") + "), which ONNX Runtime would draw with its own "
                "generator, not torch's as eager does; ortmodule draws torch.rand/randn/randint/*_like, "
                "bernoulli, normal, in-place fills and dropout itself (NOTE [random draws])")


def _numpy_state():
    np = sys.modules.get("numpy")  # only where the process uses numpy: never imported for this
    return None if np is None else np.random.get_state()


def _same_numpy_state(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and a[2:] == b[2:] and bool((a[1] == b[1]).all())


def _torch_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.extend(torch.cuda.get_rng_state_all())
    return states


def _set_torch_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


# the functions that set a generator's state, by module (``torch.manual_seed is torch.random.manual_seed``)
_RNG_SETTERS = (("torch", "manual_seed"), ("torch", "seed"), ("torch", "set_rng_state"),
                ("torch.random", "manual_seed"), ("torch.random", "seed"), ("torch.random", "set_rng_state"),
                ("torch.cuda", "manual_seed"), ("torch.cuda", "manual_seed_all"), ("torch.cuda", "seed"),
                ("torch.cuda", "set_rng_state"), ("torch.cuda", "set_rng_state_all"))


@contextlib.contextmanager
def _rng_setter_calls() -> Iterator[list]:
    """The torch generator setters this thread calls meanwhile (``fork_rng`` puts the state back on
    exit, so a seed set inside it leaves no trace in the state itself)."""
    calls: list = []
    me = threading.get_ident()
    patched = []
    for modname, attr in _RNG_SETTERS:
        module = sys.modules.get(modname)
        fn = getattr(module, attr, None)
        if fn is None:
            continue

        def setter(*args, _fn=fn, _name=f"{modname}.{attr}", **kwargs):
            caller = sys._getframe(1)
            # torch's own save-and-restore (torch.export's preserve_rng_state) is no call of the
            # forward's; fork_rng is, on the forward's behalf
            inside = caller.f_globals.get("__name__", "").startswith(("torch", "ortmodule"))
            if threading.get_ident() == me and (not inside or caller.f_code.co_name == "fork_rng"):
                calls.append(_name)
            return _fn(*args, **kwargs)

        patched.append((module, attr, fn))
        setattr(module, attr, setter)
    try:
        yield calls
    finally:
        for module, attr, fn in patched:
            setattr(module, attr, fn)


@contextlib.contextmanager
def python_random_watch(name: str) -> Iterator[None]:
    """NOTE [python random]: ``random.random()`` or ``np.random.rand()`` in forward runs once, in
    the trace, and the graph keeps the drawn number for every later call (a LayerDrop coin, a random
    crop size, a noise scale): refused, naming the generator. The states are put back, so the
    eager forward the module falls back to draws what eager would. The same holds for torch's own
    generators: every torch draw of the forward is a placeholder in the trace (NOTE [random
    draws]), so a torch state that moved was set by the forward itself (``torch.manual_seed(0)``
    before drawing the same noise each call, ``set_rng_state``) or drawn by code the trace runs
    for real, and the graph's draws would not follow it."""
    py, npy, tch = random.getstate(), _numpy_state(), _torch_states()
    try:
        with _rng_setter_calls() as setters:
            yield
    finally:
        after = _torch_states()
        torch_moved = bool(setters) or len(after) != len(tch) or any(
            not torch.equal(a, b) for a, b in zip(tch, after))
        moved = [what for what, changed in (("random", random.getstate() != py),
                                            ("numpy.random", not _same_numpy_state(npy, _numpy_state())),
                                            ("torch", torch_moved))
                 if changed]
        if moved:
            random.setstate(py)
            if "numpy.random" in moved:
                sys.modules["numpy"].random.set_state(npy)
            if torch_moved and len(after) == len(tch):
                _set_torch_states(tch)
    if moved:
        from ..errors import ExportError

        if moved == ["torch"]:
            what = f"calls {setters[0]}" if setters else "sets or draws from torch's random state"
            raise ExportError(
                f"{name}.forward {what} while it is captured (torch.manual_seed, torch.random.fork_rng, "
                "torch.set_rng_state, or a draw the trace runs for real): the graph's draws are made before "
                "each call and would not follow it. Seed outside forward, before the call (NOTE [python random])")
        raise ExportError(
            f"{name}.forward draws from Python's {' and '.join(m for m in moved if m != 'torch')} generator: the "
            "graph would keep the number drawn while it was captured for every later call. Draw with torch "
            "(torch.rand, torch.randint ...), which ortmodule draws each call as eager does (NOTE [random draws])")
