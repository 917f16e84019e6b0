"""Torch nodes: pieces of an ORT-run graph that run as torch calls (a custom ``autograd.Function``, or
an ATen op no ONNX translation or gradient rule covers), and their gradient nodes.

# NOTE [torch nodes]: the forward graph holds a ``pkg.ortmodule.torch::TorchCall`` node whose ``key``
# names a :class:`TorchCall` in this process's table: the callable, the call's non-tensor arguments
# (baked as the capture saw them, as every other constant of the graph) and its outputs. The
# executor (``runtime/segments.py``) runs the ORT segments around it and calls torch in between,
# zero-copy both ways (DLPack). In a training forward the call runs under ``enable_grad`` on detached
# copies of its inputs, so torch records its own backward (the Function's ``backward``, the ATen
# op's derivative) and keeps the ``ctx`` state it saves; the pair (inputs, outputs) goes into the
# run's state, which ``ORTFunction`` keeps on its ctx. The ``TorchCallGrad`` node of the backward
# graph reads that pair by the forward node's name and calls ``torch.autograd.grad``: the forward
# is not run again, and its random draws, saved tensors and ctx attributes are those of the
# forward run, as in eager. The state is dropped after the backward unless the graph is retained.
#
# The table is per process: a graph with torch nodes is never written to the persistent cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

TORCH_DOMAIN = "pkg.ortmodule.torch"
CALL_OP = "TorchCall"
GRAD_OP = "TorchCallGrad"
ATEN_OP = "ATen"  # NOTE [ATen kernels]: a stateless ATen call (a fused backward kernel)


@dataclasses.dataclass
class TorchCall:
    """One call that runs in torch: ``fn(*tensors)`` returns a tensor or a tuple of tensors."""

    fn: Callable
    what: str  # "custom autograd.Function 'GradReverse'" / "aten::upsample_bilinear2d.vec"
    reason: str  # why it runs in torch, for explain()
    where: str = ""  # the user's line or the torch module path
    n_outputs: int = 0  # known once the capture ran it (on fake tensors)
    single: bool = True  # fn returns one tensor, not a tuple
    writes_inputs: bool = False  # NOTE [dirty inputs]: it writes an input in place (ctx.mark_dirty)
    draw_index: int | None = None  # NOTE [draw order]: its place among the capture's drawing torch nodes
    custom_op: bool = False  # NOTE [custom ops]: a torch.library op, whose draws the capture cannot see
    # NOTE [torch node autocast]: a torch node runs with autocast off, as the capture ran it: its
    # kernel runs below the Autocast key (measured: a matmul inside a Function came out fp32 in the
    # capture under fp16 autocast), and the graph holds the casts of everything around it. A custom
    # Function under autocast therefore computes its own ops in its inputs' dtypes (eager would cast
    # a matmul inside it to half): more precise, never a different dtype than the graph states.


_table: dict[int, TorchCall] = {}
_keys = itertools.count()
_lock = threading.Lock()
_local = threading.local()


def register_call(call: TorchCall) -> int:
    with _lock:
        key = next(_keys)
        _table[key] = call
    return key


def lookup_call(key: int) -> TorchCall:
    call = _table.get(key)
    if call is None:
        raise RuntimeError(f"torch node {key} is not known in this process (NOTE [torch nodes]): a graph "
                           "with torch nodes cannot be loaded from another process")
    return call


def inside_call() -> bool:
    """Whether this thread is running a torch node's callable (a custom Function inside it is a
    plain call, not another torch node)."""
    return getattr(_local, "depth", 0) > 0


# torch's random builtins, by name: what a torch node's Python code calls when it draws
_RANDOM_BUILTINS = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_",
    "normal", "normal_", "uniform_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "multinomial", "poisson", "binomial", "dropout", "dropout_", "feature_dropout", "feature_dropout_",
    "alpha_dropout", "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout",
    "rrelu", "rrelu_", "rrelu_with_noise", "_standard_gamma", "_sample_dirichlet",
})


@contextlib.contextmanager
def _first_random_builtin() -> Iterator[list]:
    """The names of torch's random builtins called meanwhile on this thread (a profile hook: the
    capture runs a torch node on fake tensors inside a kernel, below every torch function and
    dispatch mode, and fake tensors draw nothing)."""
    seen: list = []
    previous = sys.getprofile()

    def hook(frame, event, arg):
        if event == "c_call" and not seen and getattr(arg, "__name__", None) in _RANDOM_BUILTINS:
            # torch.rand_like (module "torch"), Tensor.bernoulli_ (bound to a tensor); not random.random
            module = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__
            if module.startswith("torch"):
                seen.append(arg.__name__)
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


@contextlib.contextmanager
def watch_draws(count: Callable[[], int]) -> Iterator[list]:
    """NOTE [draws in torch nodes]: the graph's own random inputs (dropout masks and draws, in eager
    order; ``count()`` says how many the trace has met so far) are made before the run, and a torch
    node that draws does so during it. While a capture runs, each torch node is run once on fake
    tensors: the ones that draw are listed as (call, how many graph draws came before it, the op),
    so the capture can refuse a graph draw that eager makes after the node's. A custom Function with
    only draws before it in eager order keeps eager's stream."""
    found: list = []
    _local.draws = (count, found)
    try:
        yield found
    finally:
        _local.draws = None


def _invoke(call: TorchCall, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """``call.fn(*tensors)`` as a list of tensors, and whether it returned one tensor (not a tuple)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        out = call.fn(*tensors)
    finally:
        _local.depth -= 1
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out) if isinstance(out, (tuple, list)) else None
    if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
        raise TypeError(f"{call.what} returned {type(out).__name__}; a torch node must return a tensor or a "
                        "tuple of tensors")
    return outs, single


_defined: list = []


def define_torch_call_op() -> None:
    """``ortmodule::torch_call(Tensor[] xs, int key) -> Tensor[]``: the placeholder the capture records
    for a torch node (real kernel: the call; fake kernel: the call on fake tensors, which gives the
    output shapes)."""
    if _defined:
        return
    with _lock:
        if _defined:
            return
        lib = torch.library.Library("ortmodule", "FRAGMENT")
        lib.define("torch_call(Tensor[] xs, int key) -> Tensor[]")

        def real(xs, key):
            with torch.no_grad():
                return [t.clone() for t in _invoke(lookup_call(key), xs)[0]]

        def fake(xs, key):
            call = lookup_call(key)
            versions = [t._version for t in xs]
            watch = getattr(_local, "draws", None)
            random_calls = _first_random_builtin() if watch is not None else contextlib.nullcontext([])
            with torch._C.DisableTorchFunction(), torch.no_grad(), random_calls as seen:  # no capture-time modes
                outs, call.single = _invoke(call, xs)
            if seen:
                if call.draw_index is None:  # NOTE [draw order]: the trace runs in eager order
                    call.draw_index = len(watch[1])
                watch[1].append((call, watch[0](), seen[0]))
            call.writes_inputs = call.writes_inputs or any(t._version != v for t, v in zip(xs, versions))
            call.n_outputs = len(outs)
            # an output may not alias an input or another output: the op's schema says it returns new tensors
            return [t.clone() for t in outs]

        lib.impl("torch_call", real, "CompositeExplicitAutograd")
        lib.impl("torch_call", fake, "Meta")
        _defined.append(lib)
        # NOTE [fake kernels]: the capture runs a torch node on fake tensors for its output shapes; torch
        # has no fake kernel for ``_sample_dirichlet`` (Beta / Dirichlet ``rsample``, a custom Function
        # calling it), which made such a model fall back. Its output is its input's shape and dtype.
        try:
            torch.library.register_fake("aten::_sample_dirichlet")(
                lambda self, generator=None: torch.empty_like(self))
        except RuntimeError:  # a torch that has one
            pass


class UnseenDraws(Exception):
    """A custom op's torch node drew from torch's generator while the graph ran (NOTE [custom ops])."""


def _generator_state(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    device = inputs[0].device if inputs else torch.device("cpu")
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def run_forward(key: int, name: str, inputs: Sequence[torch.Tensor], grad_inputs: Sequence[int],
                state: dict | None) -> list[torch.Tensor]:
    """Run the forward torch node ``name``. With ``state`` (a training forward), the inputs at
    ``grad_inputs`` get gradients and torch keeps the call's backward for :func:`run_backward`."""
    call = lookup_call(key)
    if not call.custom_op:
        return _run_forward(call, name, inputs, grad_inputs, state)
    # NOTE [custom ops]: the capture ran its fake kernel, so a draw inside its real kernel was never
    # seen: it would take its numbers out of eager's order (after the dropout masks drawn before the
    # run). Seen drawing here, the call runs eagerly instead (ORTModule puts the generator back).
    before = _generator_state(inputs)
    outs = _run_forward(call, name, inputs, grad_inputs, state)
    if not torch.equal(before, _generator_state(inputs)):
        where = f" ({call.where})" if call.where else ""
        raise UnseenDraws(f"{call.what}{where} draws from torch's random generator inside its kernel, "
                          "which the capture cannot see (it runs the op's fake kernel): the graph would draw "
                          "out of eager's order; this input signature runs eagerly")
    return outs


def _run_forward(call: TorchCall, name: str, inputs: Sequence[torch.Tensor], grad_inputs: Sequence[int],
                 state: dict | None) -> list[torch.Tensor]:
    if state is None or not grad_inputs:
        with torch.no_grad(), _autocast_for(call, inputs):
            args = [t.clone() for t in inputs] if call.writes_inputs else inputs  # NOTE [dirty inputs]
            return _detached(_invoke(call, args)[0])
    leaves = list(inputs)
    for i in grad_inputs:
        leaves[i] = inputs[i].detach().requires_grad_(True)
    # NOTE [dirty inputs]: a Function that writes its input in place (``x.mul_(2); ctx.mark_dirty(x)``)
    # cannot write the leaf that collects its input's gradient (autograd refuses, after the kernel
    # wrote it): such a call, seen writing during the capture, gets copies whose gradient reaches the
    # leaves (the copy costs what the input weighs).
    with torch.enable_grad(), _autocast_for(call, inputs):  # (ORTFunction.forward runs without grad)
        args = _writable(leaves, grad_inputs) if call.writes_inputs else leaves
        outs, _ = _invoke(call, args)
    state[name] = ([leaves[i] for i in grad_inputs], outs)
    return _detached(outs)


def _writable(leaves: list[torch.Tensor], grad_inputs: Sequence[int]) -> list[torch.Tensor]:
    """The leaves at ``grad_inputs`` as non-leaf copies (their gradient still reaches the leaves)."""
    args = list(leaves)
    for i in grad_inputs:
        args[i] = leaves[i].clone()
    return args


def _autocast_for(call: TorchCall, inputs: Sequence[torch.Tensor]):
    """Autocast off for the call (NOTE [torch node autocast])."""
    return torch.autocast(inputs[0].device.type if inputs else "cpu", enabled=False)


def _detached(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach() for t in outs]


def run_backward(name: str, grads: Sequence[torch.Tensor | None], wanted: Sequence[bool],
                 state: dict | None, keep: bool) -> list[torch.Tensor | None]:
    """The gradients of forward node ``name``'s ``grad_inputs`` (those ``wanted``) given its output
    gradients (``None``: no gradient reaches that output)."""
    if state is None or name not in state:
        raise RuntimeError(f"the backward of torch node {name!r} found no forward state: was the forward run "
                           "without grad, or is this a second backward without retain_graph=True?")
    leaves, outs = state[name] if keep else state.pop(name)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    targets = [leaf for leaf, w in zip(leaves, wanted) if w]
    found: list = [None] * len(targets)
    if pairs and targets:
        with torch.enable_grad():
            found = list(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                             allow_unused=True, retain_graph=keep))
    it = iter(found)
    result: list[torch.Tensor | None] = []
    for leaf, w in zip(leaves, wanted):
        if not w:
            result.append(None)
            continue
        g = next(it)
        result.append(torch.zeros_like(leaf) if g is None else g)
    return result


# -- stateless ATen kernels -----------------------------------------------------------------------
# NOTE [ATen kernels]: a gradient rule may emit an ``ATen`` node instead of a chain of ONNX ops where
# torch has a fused kernel that is faster (measured per op: autodiff/rules/aten.py). The node names
# the ATen overload (``aten::convolution_backward.default``) and its arguments as JSON, tensors as
# ``{"t": i}`` (the node's input i): nothing refers to this process, so such graphs are written to
# the persistent cache like any other. It runs under ``no_grad``, its outputs are the returned
# tensors at ``outputs``.


class Arg:
    """The node's input ``i`` inside an ATen argument template."""

    def __init__(self, i: int) -> None:
        self.i = i


def encode_args(args) -> str:
    import json

    def enc(a):
        if isinstance(a, Arg):
            return {"t": a.i}
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        if type(a).__name__ == "DataType":  # an onnx_ir dtype: as torch's
            import numpy as np

            a = torch.from_numpy(np.empty(0, dtype=a.numpy())).dtype
        if isinstance(a, torch.dtype):
            return {"dtype": str(a).removeprefix("torch.")}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise TypeError(f"an ATen node argument cannot be {type(a).__name__}")

    return json.dumps([enc(a) for a in args])


def decode_args(text: str):
    """A function of the node's inputs that returns the call's positional arguments."""
    import json

    def dec(a):
        if isinstance(a, dict):
            if "t" in a:
                i = a["t"]
                return lambda ts: ts[i]
            dtype = getattr(torch, a["dtype"])
            return lambda ts: dtype
        if isinstance(a, list):
            parts = [dec(x) for x in a]
            return lambda ts: [p(ts) for p in parts]
        return lambda ts: a

    parts = [dec(a) for a in json.loads(text)]
    return lambda ts: [p(ts) for p in parts]


def _max_pool2d_backward(dy, x, kernel, stride, padding, dilation, ceil_mode):
    """dX of a 2-d max pool: the arg-max by torch's channels-last pooling, dX by its NCHW backward.

    torch's NCHW max_pool2d_with_indices is scalar (2.8 ms on [32, 32, 32, 32] here), its
    channels-last one vectorised (0.19 ms after a 1.0 ms copy to channels-last); ORT's MaxPool with
    an Indices output took 5.6 ms. The indices are offsets within each (n, c) plane in either
    layout, so the NCHW backward (0.16 ms) reads them once made contiguous (0.13 ms), and dX comes
    out NCHW without copying dY in and dX back (A/B, 2 threads, medians: [32, 32, 32, 32] 2.4-2.9 ->
    1.65 ms, [32, 64, 16, 16] 0.63-0.70 -> 0.47 ms; bit-identical)."""
    xc = x.contiguous(memory_format=torch.channels_last)
    _, indices = torch.ops.aten.max_pool2d_with_indices(xc, kernel, stride, padding, dilation, ceil_mode)
    return torch.ops.aten.max_pool2d_with_indices_backward(dy.contiguous(), x.contiguous(), kernel, stride,
                                                          padding, dilation, ceil_mode, indices.contiguous())


def _conv2d_backward_channels_last(dy, x, w, *args):
    """``aten::convolution_backward`` (same arguments) on channels-last copies of its tensors, the
    gradients returned contiguous. NOTE [grouped conv backward]: oneDNN's grouped and depthwise
    backward is much faster on channels-last tensors. A/B (2 threads, medians, a depthwise 7x7 with
    bias, batch 8, ConvNeXt's four stages): [32, 16x16] 1.65 -> 0.82 ms, [64, 8x8] 1.53 -> 0.51,
    [128, 4x4] 1.01 -> 0.37, [256, 2x2] 0.81 -> 0.35 (the copies in and out included); a dense 3x3
    conv was level (2.87 vs 2.73 ms before copies), so the rule uses it for ``group > 1`` only."""
    last = torch.channels_last
    outs = torch.ops.aten.convolution_backward(dy.contiguous(memory_format=last), x.contiguous(memory_format=last),
                                               w.contiguous(memory_format=last), *args)
    return tuple(o.contiguous() if o is not None else None for o in outs)


# NOTE [onnx rnn as torch]: ONNX LSTM / GRU / RNN nodes (files from either torch exporter) get their
# gradient from torch's own recurrent kernels: the backward re-runs the node's forward as
# ``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` with autograd on and differentiates it.
# ONNX keeps each direction's gate blocks in another order than torch (LSTM i o f c vs i f g o, GRU
# z r h vs r z n) and one bias [Wb, Rb]; a reverse-only direction is the forward pass over the
# time-flipped sequence. The recomputed forward equals onnxruntime's to rounding (its activations
# are MLAS's), so the gradient is taken at the values the forward returned, to float tolerance.
_RNN_GATES = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN_TANH": (0,), "RNN_RELU": (0,)}


def _onnx_rnn_forward(kind: str, hidden: int, direction: str, x, w, r, b, h0, c0):
    """Y, Y_h, Y_c (None for GRU / RNN) of the ONNX node (layout 0), computed by torch's recurrent kernel."""
    order = _RNN_GATES[kind]
    seq_first = x  # [seq, batch, input]
    n_dir, batch = w.shape[0], seq_first.shape[1]

    def gates(m):  # [n_gates * hidden, ...] in ONNX order -> torch's
        blocks = m.split(hidden, 0)
        return torch.cat([blocks[i] for i in order], 0)

    params = []
    for d in range(n_dir):
        params += [gates(w[d]), gates(r[d])]
        if b is not None:
            wb, rb = b[d].split(len(order) * hidden)
            params += [gates(wb), gates(rb)]

    def state(t):  # [n_dir, batch, hidden]
        return seq_first.new_zeros(n_dir, batch, hidden) if t is None else t

    if direction == "reverse":
        seq_first = seq_first.flip(0)
    args = (params, b is not None, 1, 0.0, True, direction == "bidirectional", False)
    y_c = None
    if kind == "LSTM":
        out, y_h, y_c = torch._VF.lstm(seq_first, (state(h0), state(c0)), *args)
    else:
        fn = {"GRU": torch._VF.gru, "RNN_TANH": torch._VF.rnn_tanh, "RNN_RELU": torch._VF.rnn_relu}[kind]
        out, y_h = fn(seq_first, state(h0), *args)
    if direction == "reverse":
        out = out.flip(0)
    y = out.reshape(out.shape[0], batch, n_dir, hidden).transpose(1, 2)  # [seq, n_dir, batch, hidden]
    return y, y_h, y_c


def _onnx_rnn_backward(kind, hidden, direction, x, w, r, b, h0, c0, dy, dy_h, dy_c):
    """dX, dW, dR, dB, d initial_h, d initial_c of an ONNX recurrent node (None where the node has no
    such input), by torch's autograd through its own kernel (NOTE [onnx rnn as torch])."""
    named = {"x": x, "w": w, "r": r, "b": b, "h0": h0, "c0": c0}
    leaves = {k: t.detach().requires_grad_() for k, t in named.items() if t is not None}
    with torch.enable_grad():
        outs = _onnx_rnn_forward(kind, hidden, direction, *(leaves.get(k) for k in named))
        pairs = [(o, g) for o, g in zip(outs, (dy, dy_h, dy_c)) if o is not None and g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()), [g for _, g in pairs],
                                    allow_unused=True)
    found = dict(zip(leaves, grads))
    return tuple(None if k not in leaves else (torch.zeros_like(leaves[k]) if found[k] is None else found[k])
                 for k in named)


# Kernels of our own, by name (portable as the ATen ones): compositions of ATen calls.
OWN_KERNELS = {"ortmodule::max_pool2d_backward": _max_pool2d_backward,
               "ortmodule::conv2d_backward_channels_last": _conv2d_backward_channels_last,
               "ortmodule::onnx_rnn_backward": _onnx_rnn_backward}


def resolve_aten(name: str):
    """``aten::convolution_backward.default`` -> the OpOverload (or one of :data:`OWN_KERNELS`)."""
    if name in OWN_KERNELS:
        return OWN_KERNELS[name]
    ns, rest = name.split("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload or "default")


def run_aten(op, build_args, pick: Sequence[int], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = op(*build_args(inputs))
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return [outs[i] for i in pick]
