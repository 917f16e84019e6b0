"""Verification mode (``ORTModule(m, verify=True)`` / ``ORTMODULE_VERIFY=1``): the safety net.

The first call of every newly compiled graph (a cache miss that built or reused a CompiledEntry,
not a fallback) also runs the wrapped module eagerly on the same inputs and compares: every tensor
output, every buffer update, and the gradients of every parameter and input that requires grad for a
fixed random cotangent. A difference beyond ``Options.verify_tolerance`` raises
:class:`~ortmodule.errors.VerificationError` naming the worst tensor.

# NOTE [verify leaves no trace]: the call's effects are those of an unverified call. Sequence:
#   begin:  snapshot buffers and the RNG state (``before``), just before the dropout masks are drawn
#   (the real ORT call runs: masks drawn, buffers written back, outputs returned)
#   finish: snapshot buffers and RNG (``after``: the real call's effect)
#           ORT gradients by torch.autograd.grad(retain_graph=True) on the call's own outputs
#           restore ``before``; eager forward (draws the same masks: NOTE [dropout masks]) and
#           torch.autograd.grad -- never .backward, so no ``.grad`` changes
#           compare; restore ``after`` (buffers as ORT left them, generator where the call left it)
# Buffers are restored through ``.data`` so that their autograd version counters do not move: a
# buffer saved by the ORT graph must still be usable by the user's backward. On a mismatch (or an
# eager error) the state is put back to ``before`` and the entry leaves the cache, so the next call
# verifies (and fails) again instead of silently reusing the graph.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .errors import VerificationError
from .options import VerifyTolerance, logger

_HALF = (torch.float16, torch.bfloat16)


class StateSnapshot:
    """The module's buffers (which tensor sits under which name, and its value) and the RNG states
    of the CPU and of the given CUDA devices; :meth:`restore` puts them back."""

    def __init__(self, module: nn.Module, devices: Sequence[torch.device] = ()) -> None:
        self.clones: dict[int, torch.Tensor] = {}
        self.names: dict[int, str] = {}  # a buffer's first name in named_buffers()
        self.slots: list[tuple[nn.Module, str, torch.Tensor]] = []
        self.unique: list[torch.Tensor] = []
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for key, buf in sub._buffers.items():
                if buf is None:
                    continue
                self.slots.append((sub, key, buf))
                if id(buf) not in self.clones:
                    self.unique.append(buf)
                    self.clones[id(buf)] = buf.detach().clone()
                    self.names[id(buf)] = f"{prefix}.{key}" if prefix else key
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d in {d for d in devices if d.type == "cuda"}]

    def value(self, buf: torch.Tensor) -> torch.Tensor:
        return self.clones[id(buf)]

    def restore(self) -> None:
        with torch.no_grad():
            for sub, key, buf in self.slots:
                if sub._buffers.get(key) is not buf:
                    sub._buffers[key] = buf
            for buf in self.unique:
                buf.data.copy_(self.clones[id(buf)])  # NOTE [verify leaves no trace]: no version bump
        torch.set_rng_state(self.cpu_rng)
        for d, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, d)


@dataclasses.dataclass
class Mismatch:
    what: str
    error: float  # relative error; inf for a structural difference
    detail: str

    def __str__(self) -> str:
        return f"{self.what}: {self.detail}"


def _leaves(obj: Any, path: str = "output") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a (nested) forward result: tensors and constants."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{path}.{f.name}")
    else:
        yield path, obj


def input_names(args: tuple, kwargs: dict) -> list[str]:
    """Readable names of the tensor leaves of ``(args, kwargs)``, in flatten_inputs order."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            head = "args" if path and getattr(path[0], "idx", 0) == 0 else "kwargs"
            names.append(head + pytree.keystr(path[1:]))
    return names


def compare(what: str, ort: torch.Tensor, eager: torch.Tensor, tol: VerifyTolerance,
            half: bool, scale: float = 0.0) -> tuple[float, Mismatch | None]:
    """(relative error, the mismatch or None) of ``ort`` against ``eager``; NaN/Inf must agree.

    NOTE [rounding-noise gradients]: a gradient that is exactly 0 in exact arithmetic (a conv bias
    before a train-mode BatchNorm) is rounding noise in eager and in ORT alike, so its relative
    error is ~1. It matches when every element is within ``max(atol, rtol * scale)``, ``scale``
    being the largest element of its sibling gradients (the same module's weight): noise of its
    size, not a wrong value. The returned error is 0 for such a tensor."""
    if ort.shape != eager.shape or ort.dtype != eager.dtype:
        return math.inf, Mismatch(what, math.inf, f"ORT gives {ort.dtype} {tuple(ort.shape)}, eager "
                                                  f"{eager.dtype} {tuple(eager.shape)}")
    if not (eager.is_floating_point() or eager.is_complex()):
        if torch.equal(ort, eager):
            return 0.0, None
        n = int((ort != eager).sum())
        return math.inf, Mismatch(what, math.inf, f"{n} of {eager.numel()} elements differ (exact compare)")
    a, b = ort.detach().double().cpu(), eager.detach().double().cpu()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa].nan_to_num(), b[~fb].nan_to_num()):
        return math.inf, Mismatch(what, math.inf, "NaN/Inf in different places than eager")
    a, b = a[fa], b[fb]
    if a.numel() == 0:
        return 0.0, None
    err = float((a - b).norm() / b.norm().clamp_min(1e-12))
    rtol, atol = (tol.half_rtol, tol.half_atol) if half or eager.dtype in _HALF else (tol.rtol, tol.atol)
    atol = max(atol, rtol * scale)
    if err <= rtol:
        return err, None
    abs_err = float((a - b).abs().max())
    if abs_err <= atol:
        return 0.0, None
    return err, Mismatch(what, err, f"relative error {err:.3g} > rtol {rtol:.3g} (max abs error {abs_err:.3g})")


def _sibling_scales(names: Sequence[str], grads: Sequence[torch.Tensor | None]) -> list[float]:
    """NOTE [rounding-noise gradients]: per gradient, the largest |element| among the gradients of
    the parameters of the same module (by name prefix); for inputs, among all gradients."""
    def group(name: str) -> str | None:
        if not name.startswith("parameter '"):
            return None
        return name[len("parameter '"):-1].rpartition(".")[0]

    peak = {id(g): float(g.detach().abs().max()) if g is not None and g.numel() and g.is_floating_point()
            else 0.0 for g in grads}
    by_group: dict[str | None, float] = {}
    for name, g in zip(names, grads):
        key = group(name)
        by_group[key] = max(by_group.get(key, 0.0), peak[id(g)])
    top = max(by_group.values(), default=0.0)
    return [by_group[group(n)] if group(n) is not None else top for n in names]


def _grads(outs: list[torch.Tensor], cots: list[torch.Tensor], wrt: list[torch.Tensor],
           retain: bool) -> Sequence[torch.Tensor | None]:
    if not outs or not wrt:
        return [None] * len(wrt)
    try:
        # retain_graph=True: a failure half-way (below) must leave the graph intact for the retry;
        # an eager reference graph is freed with its outputs anyway.
        return torch.autograd.grad(outs, wrt, cots, retain_graph=True, allow_unused=True)
    except RuntimeError as exc:
        if "use_reentrant=True" not in str(exc):
            raise
    # A reentrant torch.utils.checkpoint in the eager forward refuses autograd.grad: take the
    # gradients through .backward() and put every .grad back as it was (NOTE [verify leaves no trace]).
    saved = [t.grad for t in wrt]
    try:
        for t in wrt:
            t.grad = None
            if not t.is_leaf:
                t.retain_grad()
        torch.autograd.backward(outs, cots, retain_graph=retain)
        return [t.grad for t in wrt]
    finally:
        for t, g in zip(wrt, saved):
            t.grad = g


class Verification:
    """One verified call: :meth:`begin` before the dropout masks are drawn, :meth:`finish` on the
    call's result (NOTE [verify leaves no trace])."""

    def __init__(self, wrapper: Any, sig: Any, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 param_names: Sequence[Sequence[str]], args: tuple, kwargs: dict, device: torch.device) -> None:
        self.t0 = time.perf_counter()
        self.wrapper, self.sig, self.args, self.kwargs, self.device = wrapper, sig, args, kwargs, device
        self.grad_enabled = torch.is_grad_enabled()
        wrt: dict[int, tuple[str, torch.Tensor]] = {}
        if self.grad_enabled:
            for names, p in zip(param_names, params):
                if p.requires_grad:
                    wrt.setdefault(id(p), (f"parameter '{names[0]}'", p))
            for name, t in zip(input_names(args, kwargs), inputs):
                if t.requires_grad:
                    wrt.setdefault(id(t), (f"input {name}", t))
        self.wrt = list(wrt.values())
        self.before = StateSnapshot(wrapper.module, [device])

    def finish(self, result: Any) -> None:
        """Run eager, compare, leave the state as the real call left it; raise on a mismatch."""
        wrapper = self.wrapper
        module = wrapper.module
        after = StateSnapshot(module, [self.device])
        ok = False
        try:
            mismatches, worst, counts = self._check(result, module, after)
            ok = not mismatches
        finally:
            if ok:
                after.restore()
            else:  # the call raises: no effect, and the graph is not reused unverified
                self.before.restore()
                wrapper._entries._data.pop(self.sig, None)
            dt = time.perf_counter() - self.t0
            wrapper.stats.verifications += 1
            wrapper.stats.verify_s += dt
        name = type(module).__name__
        if mismatches:
            mismatches.sort(key=lambda m: -m.error)
            others = "".join(f"\n  also {m}" for m in mismatches[1:6])
            more = f"\n  ... and {len(mismatches) - 6} more" if len(mismatches) > 6 else ""
            logger.info("verify %s: FAILED (%d mismatches) in %.3f s", name, len(mismatches), dt)
            raise VerificationError(
                f"ORTModule verification failed for {name} on the first call of a newly compiled graph: "
                f"ONNX Runtime disagrees with eager PyTorch on the same inputs.\n  worst: {mismatches[0]}"
                f"{others}{more}\nThis is a wrong result from ortmodule, not from your model: please report "
                "it with this message (ORTMODULE_SAVE_ONNX=<dir> saves the graphs). Until it is fixed, train "
                "this model eagerly (call the wrapped module, `model.module`); a fallback policy does not "
                "apply to this (the graph was built, it computes wrong numbers). If the difference is "
                "expected rounding (e.g. half precision), loosen verify_tolerance=VerifyTolerance(...) or "
                "turn verification off (verify=False / ORTMODULE_VERIFY=0)."
            )
        logger.info("verify %s: %d outputs, %d buffers, %d gradients match eager (worst relative error "
                    "%.2g at %s) in %.3f s", name, *counts, worst[0], worst[1], dt)

    def _check(self, result: Any, module: nn.Module, after: StateSnapshot):
        tol = self.wrapper.options.verify_tolerance
        half = bool(self.sig.autocast)
        ort_leaves = list(_leaves(result))
        ort_grads: Sequence[torch.Tensor | None] = []
        diff_paths: list[str] = []
        cots: list[torch.Tensor] = []
        wrt = [t for _, t in self.wrt]
        gen = torch.Generator().manual_seed(0)
        if self.grad_enabled and wrt:
            # Cotangents for the outputs that ORT says are differentiable; eager's are checked below.
            for path, t in ort_leaves:
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                    diff_paths.append(path)
                    # Unit norm per output, like the gradient of a mean loss: ~0 tensors (a conv bias
                    # before a train-mode BatchNorm) stay at rounding-noise size for ``atol``.
                    cot = torch.randn(t.shape, generator=gen, dtype=torch.float64)
                    cot = cot / cot.norm().clamp_min(1e-12)
                    cots.append(cot.to(t.dtype).to(t.device))
            by_path = dict(ort_leaves)
            ort_grads = _grads([by_path[p] for p in diff_paths], cots, wrt, retain=True)

        self.before.restore()  # NOTE [verify leaves no trace]: eager starts from the call's state
        with self.wrapper._autocast_for_export(self.sig, self.device):
            eager_result = module(*self.args, **self.kwargs)
        eager_leaves = list(_leaves(eager_result))
        eager_by_path = dict(eager_leaves)

        mismatches: list[Mismatch] = []
        worst = (0.0, "-")

        def note(err: float, m: Mismatch | None, what: str) -> None:
            nonlocal worst
            if m is not None:
                mismatches.append(m)
            elif err > worst[0]:
                worst = (err, what)

        ort_paths, eager_paths = [p for p, _ in ort_leaves], [p for p, _ in eager_leaves]
        if ort_paths != eager_paths:
            mismatches.append(Mismatch("output structure", math.inf, f"ORT returns {ort_paths}, eager {eager_paths}"))
            return mismatches, worst, (0, 0, 0)
        n_out = 0
        for (path, o), (_, e) in zip(ort_leaves, eager_leaves):
            if isinstance(e, torch.Tensor) != isinstance(o, torch.Tensor):
                detail = f"ORT gives {type(o).__name__}, eager {type(e).__name__}"
                note(math.inf, Mismatch(path, math.inf, detail), path)
                continue
            if not isinstance(e, torch.Tensor):
                if isinstance(e, (int, float, str, bool, type(None))) and o != e:
                    note(math.inf, Mismatch(path, math.inf, f"ORT gives {o!r}, eager {e!r}"), path)
                continue
            n_out += 1
            note(*compare(path, o, e, tol, half), path)
            if self.grad_enabled and wrt and e.is_floating_point() and e.requires_grad != o.requires_grad:
                side = "ORT" if o.requires_grad else "eager"
                note(math.inf, Mismatch(path, math.inf, f"only {side}'s output requires grad "
                                        f"(eager: {e.requires_grad}, ORT: {o.requires_grad})"), path)

        for buf in after.unique:
            what = f"buffer '{after.names[id(buf)]}' after the call"
            note(*compare(what, after.value(buf), buf.detach(), tol, half), what)
        n_buf = len(after.unique)

        if self.grad_enabled and wrt:
            e_paths = [p for p in diff_paths if eager_by_path[p].requires_grad]
            eager_grads = _grads([eager_by_path[p] for p in e_paths],
                                 [c for p, c in zip(diff_paths, cots) if p in set(e_paths)], wrt, retain=False)
            scales = _sibling_scales([w for w, _ in self.wrt], eager_grads)
            for (what, _), og, eg, scale in zip(self.wrt, ort_grads, eager_grads, scales):
                label = f"gradient of {what}"
                if (og is None) != (eg is None):
                    none, other = ("ORT", "eager") if og is None else ("eager", "ORT")
                    note(math.inf, Mismatch(label, math.inf, f"None in {none}, a tensor in {other} (eager "
                                            "semantics: None where no differentiable path reaches it)"), label)
                elif og is not None:
                    note(*compare(label, og, eg, tol, half, scale), label)
        return mismatches, worst, (n_out, n_buf, len(self.wrt) if self.grad_enabled else 0)


__all__ = ["StateSnapshot", "Verification", "VerificationError", "compare", "input_names"]
