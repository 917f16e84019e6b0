"""Values and gradients at ties, kinks, exact zeros and extremes follow torch's own (NOTE [kinks as torch],
NOTE [tie order as torch], NOTE [as torch], NOTE [relu mask], NOTE [stable logsigmoid]): where one ONNX op
stands for torch functions whose backwards differ at equal values or bounds, or an ONNX form is not
torch's at 0, the graph gave other results than eager without a word, on values a quantised input, a
ReLU or a padding token hits exactly. Each case fails without its fix."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

from .helpers import TORCH_EXPORT, assert_close


def _grid(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values on a half-integer grid in [-8, 8]: every kink (0, +-1, +-3, 6) is hit thousands of times
    and rows hold ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-16, 17, shape, generator=g).float() / 2


def _step_both(eager: nn.Module, wrapped: nn.Module, x: torch.Tensor, w: torch.Tensor) -> list[tuple]:
    """(output, x.grad, scale.grad) of one forward and backward of ``sum(model(x) * w)``, per model."""
    results = []
    for m in (eager, wrapped):
        xx = x.clone().requires_grad_()
        y = m(xx)
        (y * w).sum().backward()
        results.append((y.detach(), xx.grad, m.scale.grad))
    return results


CASES = {
    # fn(x, lo, hi) -> tensor; lo/hi: tensor bounds on the grid (for clamp)
    "relu6": lambda x, lo, hi: F.relu6(x),
    "hardtanh": lambda x, lo, hi: F.hardtanh(x, -1.0, 1.0),
    "ReLU6_inplace": lambda x, lo, hi: nn.ReLU6(inplace=True)(x * 1.0),
    "hardswish": lambda x, lo, hi: F.hardswish(x),
    "prelu": lambda x, lo, hi: F.prelu(x, torch.tensor([0.25])),
    "max_dim": lambda x, lo, hi: x.max(dim=-1).values,
    "min_dim_keepdim": lambda x, lo, hi: torch.min(x, dim=0, keepdim=True).values,
    "max_dim_indices": lambda x, lo, hi: x.max(-1).values * x.max(-1).indices.float(),
    "clamp_tensor_bounds": lambda x, lo, hi: torch.clamp(x, lo, hi),
    "clamp_tensor_min": lambda x, lo, hi: x.clamp(min=lo),
    "sqrt_relu": lambda x, lo, hi: F.relu(x).sqrt(),
    "topk": lambda x, lo, hi: x.topk(4, dim=-1).values * x.topk(4, dim=-1).indices.float(),
}


class AtKinks(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.scale = nn.Parameter(torch.ones(()))  # exactly 1: the grid values reach fn unchanged
        self.register_buffer("lo", _grid(64, seed=1).clamp(max=0))
        self.register_buffer("hi", _grid(64, seed=2).clamp(min=0))

    def forward(self, x):
        return self.fn(x * self.scale, self.lo * self.scale, self.hi * self.scale)


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_at_ties_and_kinks_matches_eager(case):
    """Before: relu6 / hardtanh (strict bounds in torch, Clip's inclusive rule), hardswish at -3 and 3,
    prelu at 0, max/min(dim) ties (the index torch returns, not an even split), clamp with tensor bounds
    (ONNX Max/Min split ties), sqrt(relu) (NaN where eager has 0), topk ties (torch's own order) all
    differed from eager, with no fallback."""
    if case == "topk" and not TORCH_EXPORT:
        pytest.skip("the TorchScript front end has no torch nodes: topk falls back (tested below)")
    x = _grid(512, 64)
    w = torch.randn(CASES[case](x, x[0], x[0]).shape, generator=torch.Generator().manual_seed(3))
    model = AtKinks(CASES[case])
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    (ye, gxe, gse), (yo, gxo, gso) = _step_both(eager, wrapped, x, w)
    assert_close(yo, ye, 1e-6, "output")
    assert torch.isfinite(gxe).all()
    assert_close(gxo, gxe, 1e-6, "x.grad", atol=1e-6)  # elementwise: a tie sent elsewhere is off by O(1)
    assert_close(gso, gse, 1e-4, "scale.grad")  # a sum over 32k products: float32 summation order
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason


class Router(nn.Module):
    """A top-2 mixture-of-experts layer; padding tokens are all zeros, so their router logits tie and
    the experts they go to depend on topk's tie order."""

    def __init__(self, dim: int = 32, experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) * dim**-0.5)

    def forward(self, h):
        weights, chosen = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.einsum("td,tkde->tke", h, self.experts[chosen])
        return (out * weights.unsqueeze(-1)).sum(1) + h


def test_topk_ties_route_tokens_like_eager():
    torch.manual_seed(0)
    h = torch.randn(2048, 32)
    h[::3] = 0.0  # padding
    h[1::3, :8] = 0.0
    model = Router()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    if not TORCH_EXPORT:
        with pytest.warns(UserWarning, match="topk"):
            wrapped(h)
        assert "tie" in wrapped.stats.last_fallback_reason
        return
    outs = []
    for m in (eager, wrapped):
        hh = h.clone().requires_grad_()
        y = m(hh)
        y.pow(2).sum().backward()
        outs.append((y.detach(), hh.grad))
    assert_close(outs[1][0], outs[0][0], 1e-6, "output")
    assert_close(outs[1][1], outs[0][1], 1e-5, "h.grad")
    for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad")
    assert wrapped.stats.fallbacks == 0 and wrapped.stats.torch_nodes >= 1


# Inputs with exact zeros (whole rows too) and a few extreme values.
def _zeros_and_extremes(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 32, generator=g)
    x[torch.rand(256, 32, generator=g) < 0.2] = 0.0
    x[::17] = 0.0
    x[3, :4] = torch.tensor([-150.0, -110.0, 90.0, 120.0])
    return x


EDGE_CASES = {
    "cdist_zero_distance": lambda x: torch.cdist(x, x[:40]),  # the first 40 rows are at distance 0
    "atan2_at_origin": lambda x: torch.atan2(x, 0.5 * x),
    "sinc_at_zero": lambda x: torch.sinc(x),
    "pow_tensor_exponent_zero_base": lambda x: torch.pow(  # exponents 0 or >= 1: eager is finite at a zero base
        x.abs().clamp(max=3), torch.where(x.flip(0) == 0, 0 * x.flip(0), 1 + x.flip(0).abs().clamp(max=2))),
    "logsigmoid_extremes": lambda x: F.logsigmoid(x),
    "avg_pool_divisor_override": lambda x: F.avg_pool2d(x.view(8, 1, 32, 32), 3, 2, padding=1, divisor_override=4),
    "scatter_reduce_mean": lambda x: torch.zeros(256, 5).scatter_reduce(1, torch.arange(32).repeat(256, 1) % 5, x,
                                                                         "mean"),
    "scatter_reduce_amax": lambda x: torch.zeros(256, 5).scatter_reduce(1, torch.arange(32).repeat(256, 1) % 5, x,
                                                                         "amax", include_self=False),
    "log_erfc_tail": lambda x: torch.log(torch.erfc(x.clamp(max=9.0))),  # NOTE [erfc as torch]
    "log_ndtr_tail": lambda x: torch.special.log_ndtr(x),
}
_TORCH_ONLY = {"cdist_zero_distance", "atan2_at_origin", "sinc_at_zero", "avg_pool_divisor_override",
               "scatter_reduce_mean", "scatter_reduce_amax", "log_erfc_tail", "log_ndtr_tail"}


class Edge(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.fn(x * self.scale)


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_values_and_gradients_at_zeros_and_extremes_match_eager(case):
    """Before: NaN gradients where eager's are finite (cdist at zero distance, atan2 at the origin, sinc at
    0, pow's exponent gradient at a zero base), -inf for logsigmoid below -104, and wrong outputs without a
    fallback (avg_pool2d's divisor_override and scatter_reduce's mean were dropped). Under TorchScript the
    ops only torch computes this way fall back, naming the op."""
    x = _zeros_and_extremes()
    model = Edge(EDGE_CASES[case])
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    if not TORCH_EXPORT and case in _TORCH_ONLY:
        with pytest.warns(UserWarning, match="TorchScript front end"):
            wrapped(x)
        return
    w = torch.randn(model(x).shape, generator=torch.Generator().manual_seed(3))
    (ye, gxe, gse), (yo, gxo, gso) = _step_both(eager, wrapped, x, w)
    assert torch.isfinite(ye).all() and torch.isfinite(gxe).all()
    assert_close(yo, ye, 1e-6, "output")
    assert_close(gxo, gxe, 1e-5, "x.grad", atol=1e-5)
    assert_close(gso, gse, 1e-4, "scale.grad")
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason
    assert wrapped.stats.torch_nodes == (1 if case in _TORCH_ONLY else 0)
