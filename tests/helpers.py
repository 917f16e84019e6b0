"""Shared test helpers: run the same model and data through eager PyTorch and ORTModule."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ortmodule import ORTModule
from ortmodule.options import Options

# The front end the suite runs under (ORTMODULE_FRONTEND): torch.export's guards serve new shapes
# without the TorchScript path's verification exports, so a few counts differ (NOTE [shape guards]).
TORCH_EXPORT = Options.resolve().frontend == "export"


def module_path(node) -> str | None:
    """The torch module an exported ONNX node (NodeProto) came from (both front ends record it)."""
    from ortmodule.errors import MODULE_PATH_KEY

    return next((p.value for p in node.metadata_props if p.key == MODULE_PATH_KEY), None)


def by_frontend(torchscript, export):
    """What a test expects under the TorchScript front end, and under the torch.export one."""
    return export if TORCH_EXPORT else torchscript


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (2-norm over the whole tensor): the relative error the tolerances refer to.

    # NOTE [relative error]: a norm, not an elementwise max. Adam's first step moves each weight by
    # about lr * sign(grad); where a gradient is ~1e-8 (a dead unit), float32 rounding in any other
    # implementation flips that sign and one weight differs by 2 * lr, while the tensor as a whole
    # (and every gradient, checked at the same tolerance) agrees to ~1e-7.
    """
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str, atol: float = 1e-6) -> None:
    """Relative error <= rtol, or every element within ``atol`` (for tensors that are ~0, e.g. the
    gradient of a conv bias followed by a train-mode BatchNorm, exactly 0 up to rounding)."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = rel_err(a, b)
    if err <= rtol:
        return
    abs_err = float((a.detach().double() - b.detach().double()).abs().max())
    assert abs_err <= atol, f"{what}: relative error {err:.3g} > {rtol:.3g} (max abs error {abs_err:.3g})"


class CallCounter:
    """Counts runs of a module's Python forward.

    The module's class is swapped for a subclass whose forward counts: a forward hook would itself
    be a module change that re-exports (NOTE [module guards]), which is not what these tests count.
    """

    def __init__(self, module: nn.Module) -> None:
        self.count = 0
        counter, base = self, type(module)

        def forward(self, *args, **kwargs):
            counter.count += 1
            return base.forward(self, *args, **kwargs)

        module.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})


def train_side_by_side(
    model: nn.Module,
    batches: list[tuple],
    loss_fn: Callable,
    *,
    rtol: float,
    steps: int | None = None,
    optimizer: Callable = lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    kwargs_fn: Callable | None = None,
    atol: float = 1e-6,
    seed: int | None = None,
) -> ORTModule:
    """Train copies of ``model`` eagerly and through ORTModule; compare loss, every .grad and parameter.
    ``seed``: each forward draws from ``torch.manual_seed(seed + step)``, so dropout masks are eager's."""
    eager = copy.deepcopy(model)
    wrapped = ORTModule(copy.deepcopy(model))
    opt_e, opt_o = optimizer(eager.parameters()), optimizer(wrapped.parameters())
    steps = steps or len(batches)
    for step in range(steps):
        batch = batches[step % len(batches)]
        outs = []
        for m, opt in ((eager, opt_e), (wrapped, opt_o)):
            opt.zero_grad(set_to_none=True)
            if seed is not None:
                torch.manual_seed(seed + step)
            out = m(**kwargs_fn(batch)) if kwargs_fn else m(*batch)
            loss = loss_fn(out, batch)
            loss.backward()
            outs.append(loss)
        assert_close(outs[1], outs[0], rtol, f"loss at step {step}")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            if pe.grad is None:
                assert po.grad is None, f"{name}.grad should be None at step {step}"
                continue
            assert po.grad is not None, f"{name}.grad is None at step {step}"
            assert_close(po.grad, pe.grad, rtol, f"{name}.grad at step {step}", atol)
        opt_e.step()
        opt_o.step()
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po, pe, rtol, f"{name} after step {step}", atol)
        for (name, be), (_, bo) in zip(eager.named_buffers(), wrapped.named_buffers()):
            if be.is_floating_point():
                assert_close(bo, be, rtol, f"buffer {name} after step {step}")
            else:
                assert torch.equal(bo, be), f"buffer {name} after step {step}: {bo} != {be}"
    return wrapped


class NoSymbolic(nn.Module):
    """torch.fft has no ONNX export in the TorchScript exporter: falls back at export. torch.export
    and torchlib write it as DFT, which has no gradient rule: falls back when gradients are needed."""

    MATCH = "fft|DFT"

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.fft.rfft(self.lin(x)).abs()


class NoRule(nn.Module):
    """Exports fine, but ONNX Det has no gradient rule: falls back when gradients are needed (under
    torch.export with torch nodes off, the ``ort_only`` fixture; on, Det runs in torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x):
        return torch.linalg.det(self.proj(x))
