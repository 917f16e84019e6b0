"""Random tensors the forward draws come from torch, in eager order (NOTE [random draws]); Python's and
numpy's generators are refused (NOTE [python random]); globals the forward reads guard the graph
(NOTE [global guards]). Before, ``torch.rand_like`` & co. were drawn by ONNX Runtime's generator (no
run reproducible, other values than eager's), and ``random.random()`` or a global was baked into the
graph: every case here gave other numbers than eager without a word."""

from __future__ import annotations

import copy
import math
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

from .helpers import TORCH_EXPORT, assert_close

B, D = 64, 96


class Draws(nn.Module):
    """A linear layer, then ``fn(h)`` with random draws, then a linear head."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.inp = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.fn(self.inp(x)))


def _drop_path(h, p=0.3):
    """timm's DropPath: one keep/drop coin per sample, drawn into a fresh tensor in place."""
    keep = h.new_empty((h.shape[0],) + (1,) * (h.dim() - 1)).bernoulli_(1 - p)
    return h * keep.div_(1 - p)


CASES = {
    "rand_like": lambda h: h * torch.rand_like(h),
    "randn_like_t": lambda h: h + torch.randn_like(h.t()).t(),  # memory order of a transposed template
    "randn_varargs": lambda h: h + torch.randn(h.shape[0], h.shape[1], device=h.device),
    "randn_size": lambda h: h + 0.5 * torch.randn((h.shape[0], 1)),
    "rand_fp64": lambda h: h * torch.rand(h.shape, dtype=torch.float64).float(),
    "randint": lambda h: h * torch.randint(0, 3, h.shape).float(),
    "randint_high_only": lambda h: h * torch.randint(5, (h.shape[0], 1)).to(h.dtype),
    "randint_like": lambda h: h * torch.randint_like(h, 1, 4),
    "randperm": lambda h: h[torch.randperm(h.shape[0])],
    "bernoulli_tensor": lambda h: h * torch.bernoulli(torch.sigmoid(h)),
    "bernoulli_p": lambda h: h * torch.bernoulli(h.detach(), 0.3),
    "bernoulli_method": lambda h: h * torch.sigmoid(h).bernoulli(),
    "bernoulli_inplace_tensor": lambda h: h * torch.empty_like(h).bernoulli_(torch.sigmoid(h)),
    "drop_path": _drop_path,
    "normal_tensors": lambda h: h + torch.normal(h, torch.sigmoid(h)),
    "normal_tensor_float": lambda h: h * torch.normal(h, 0.5),
    "normal_float_tensor": lambda h: h * torch.normal(0.5, torch.sigmoid(h)),
    "normal_floats": lambda h: h + torch.normal(1.0, 2.0, size=h.shape),
    "normal_": lambda h: h + torch.empty_like(h).normal_(0.0, 0.1),
    "uniform_": lambda h: h * h.new_empty(h.shape).uniform_(-1.0, 2.0),
    "exponential_": lambda h: h * torch.empty_like(h).exponential_(2.0),
    "random_": lambda h: h * torch.empty(h.shape, dtype=torch.int64).random_(1, 5).float(),
    "gumbel_softmax": lambda h: F.gumbel_softmax(h, tau=0.7),
    "gumbel_softmax_hard": lambda h: F.gumbel_softmax(h, tau=0.7, hard=True),
    "with_dropout": lambda h: F.dropout(h, 0.2) * torch.rand_like(h) + F.dropout(h, 0.4),  # one eager order
    # torch.distributions: Uniform(tiny, 1 - eps) under Gumbel's transforms; the factor high - low = 1 - eps
    # was taken for 1 by onnxscript's optimizer (NOTE [near-identity constants]): 0.027 off near u = 1
    "gumbel_distribution": lambda h: h + torch.distributions.Gumbel(0.0, 1.0).rsample(h.shape),
    "vae_reparameterise": lambda h: h[:, : D // 2].repeat(1, 2)
    + torch.exp(0.5 * h[:, D // 2:]).repeat(1, 2) * torch.randn_like(h),
}


def _steps(eager: nn.Module, wrapped: nn.Module, batches, seed: int = 10):
    """Train both with the same seed before each step; compare output, gradients and parameters."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, wrapped)]
    for step, x in enumerate(batches):
        outs = []
        for m, opt in zip((eager, wrapped), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(seed + step)
            y = m(x)
            (y * y).mean().backward()
            opt.step()
            outs.append(y.detach())
        assert_close(outs[1], outs[0], 1e-5, f"output at step {step}")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-4, f"{name}.grad at step {step}")
            assert_close(po, pe, 1e-5, f"{name} after step {step}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_draws_match_eager(case):
    torch.manual_seed(0)
    model = Draws(CASES[case])
    wrapped = ORTModule(copy.deepcopy(model))
    xs = [torch.randn(B, D) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback
        _steps(model, wrapped, xs)
    assert wrapped.stats.fallbacks == 0


def test_draws_are_fresh_each_call_and_follow_the_seed():
    wrapped = ORTModule(Draws(CASES["randn_size"]))
    x = torch.randn(B, D)
    torch.manual_seed(1)
    a, b = wrapped(x), wrapped(x)
    torch.manual_seed(1)
    c = wrapped(x)
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


def test_draws_follow_the_batch_size():
    """The draws' shapes follow the inputs' (NOTE [dynamic shapes]): a new batch size draws its own."""
    torch.manual_seed(0)
    model = Draws(lambda h: h * torch.rand(h.shape[0], 1) + torch.randn_like(h)[torch.randperm(h.shape[0])])
    wrapped = ORTModule(copy.deepcopy(model))
    _steps(model, wrapped, [torch.randn(n, D) for n in (64, 48, 80, 48)])


class Denoiser(nn.Module):
    """A diffusion model's training step as users write it: timesteps and noise drawn in forward, the
    noise returned beside the prediction for the loss."""

    def __init__(self, dim: int = 64, steps: int = 100) -> None:
        super().__init__()
        betas = torch.linspace(1e-4, 0.02, steps)
        self.register_buffer("abar", torch.cumprod(1 - betas, 0))
        self.t_embed = nn.Embedding(steps, dim)
        self.net = nn.Sequential(nn.Linear(dim, 256), nn.SiLU(), nn.Dropout(0.1), nn.Linear(256, dim))
        self.steps = steps

    def forward(self, x0):
        t = torch.randint(0, self.steps, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        a = self.abar[t].unsqueeze(-1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        return self.net(xt + self.t_embed(t)), noise


def test_diffusion_training_step_matches_eager():
    torch.manual_seed(0)
    model = Denoiser()
    wrapped = ORTModule(copy.deepcopy(model))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, wrapped)]
    for step in range(4):
        x0 = torch.randn(256, 64)
        losses = []
        for m, opt in zip((model, wrapped), opts):
            opt.zero_grad()
            torch.manual_seed(100 + step)
            pred, noise = m(x0)
            loss = F.mse_loss(pred, noise)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert_close(losses[1], losses[0], 1e-5, f"loss at step {step}")
        for (name, pe), (_, po) in zip(model.named_parameters(), wrapped.named_parameters()):
            assert_close(po, pe, 1e-5, f"{name} after step {step}")
    assert wrapped.stats.fallbacks == 0


class LayerDrop(nn.Module):
    """HF-style LayerDrop: a torch coin decides in Python whether a layer runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = torch.relu(layer(x))
        return x


def test_a_python_branch_on_a_torch_coin_is_never_baked():
    """The coin is data: the branch cannot be one graph (both front ends fall back, naming it, or
    the result is eager's)."""
    torch.manual_seed(0)
    model = LayerDrop()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(B, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(6):
            torch.manual_seed(step)
            ye = model(x)
            torch.manual_seed(step)
            yo = wrapped(x)
            assert torch.equal(yo, ye), f"step {step}"


@pytest.mark.parametrize("case", ["multinomial", "generator", "rrelu"])
def test_draws_the_graph_cannot_make_fall_back_naming_them(case):
    gen = torch.Generator().manual_seed(3)
    fns = {
        "multinomial": lambda h: h[torch.multinomial(torch.softmax(h[:, 0], 0), h.shape[0], replacement=True)],
        "generator": lambda h: h * torch.rand(h.shape, generator=gen),
        "rrelu": lambda h: F.rrelu(h, training=True),
    }
    torch.manual_seed(0)
    model = Draws(fns[case])
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(B, D)
    # NOTE [draws as torch nodes]: under torch.export, multinomial runs in torch, in eager's order
    in_torch = case == "multinomial" and TORCH_EXPORT
    with pytest.warns(UserWarning, match=r"NOTE \[random draws\]") if not in_torch else warnings.catch_warnings():
        if in_torch:
            warnings.simplefilter("error", UserWarning)
        torch.manual_seed(5)
        yo = wrapped(x)
    gen.manual_seed(3)
    torch.manual_seed(5)
    assert torch.equal(yo, model(x))
    assert wrapped.stats.fallbacks == int(not in_torch)


@pytest.mark.parametrize("source", ["random", "numpy.random"])
def test_python_random_in_forward_falls_back_and_keeps_the_draws(source):
    """NOTE [python random]: the coin would be baked; the fallback's eager forward draws what eager would."""
    draw = random.random if source == "random" else np.random.rand

    model = Draws(lambda h: h * 2.0 if draw() < 0.5 else h)
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(B, D)
    for step in range(4):
        random.seed(step)
        np.random.seed(step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yo = wrapped(x)
        if step == 0:
            assert any(source in str(w.message) for w in caught), [str(w.message) for w in caught]
        random.seed(step)
        np.random.seed(step)
        assert torch.equal(yo, model(x)), f"step {step}"


class SeedsItself(nn.Module):
    """Fixed noise each call: the forward seeds torch before drawing (seen in eval-time augmentation)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        torch.manual_seed(1234)
        return self.lin(x) + torch.randn_like(x)


def test_torch_seed_in_forward_falls_back_and_keeps_the_draws():
    """NOTE [python random]: the graph draws before each call, from wherever the generator stands; a
    forward that seeds torch would get other noise than eager's (the same noise every call)."""
    model = SeedsItself()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(B, D)
    with pytest.warns(UserWarning, match="forward calls torch.manual_seed"):
        torch.manual_seed(0)
        yo = wrapped(x)
    after_o = torch.rand(3)
    torch.manual_seed(0)
    ye = model(x)
    after_e = torch.rand(3)
    assert torch.equal(yo, ye)
    assert torch.equal(after_o, after_e)  # the generator stands where eager leaves it
    assert torch.equal(wrapped(x), ye)
    assert wrapped.stats.fallbacks == 1


class ForksTheGenerator(nn.Module):
    """Draws inside ``torch.random.fork_rng``: the state is put back on exit, so only the call shows."""

    def __init__(self, seeded: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.seeded = seeded

    def forward(self, x):
        with torch.random.fork_rng():
            if self.seeded:
                torch.manual_seed(7)  # fixed augmentation noise
            look_ahead = torch.randn_like(x)  # must not move the stream
        return self.lin(x + look_ahead) + torch.rand_like(x)


@pytest.mark.parametrize("seeded", [False, True])
def test_fork_rng_in_forward_falls_back_and_keeps_the_draws(seeded):
    """NOTE [python random]: eager draws the look-ahead from a forked state and then the next draw
    from the state before it; the graph would draw both from the stream, one after the other."""
    model = ForksTheGenerator(seeded)
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(B, D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            torch.manual_seed(step)
            yo = wrapped(x)
            torch.manual_seed(step)
            assert torch.equal(yo, model(x)), f"step {step}"
    assert wrapped.stats.fallbacks == 1
    assert any("manual_seed" in str(w.message) or "set_rng_state" in str(w.message) for w in caught)


SCALE = 2.0
OPTIONS = {"act": "relu", "scale": 1.0}


def _scaled(h):
    return h * SCALE


class ReadsGlobals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = self.lin(x)
        h = torch.relu(h) if OPTIONS["act"] == "relu" else torch.tanh(h)
        return _scaled(h) * OPTIONS["scale"]


@pytest.mark.filterwarnings("ignore:ORTModule.*changed between calls")  # it changes the global on purpose
def test_a_changed_global_drops_the_graph():
    """NOTE [global guards]: a global scalar read by a helper, and a global options dict."""
    global SCALE
    model = ReadsGlobals()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(B, D)
    try:
        for scale, act, factor in [(2.0, "relu", 1.0), (3.0, "relu", 1.0), (3.0, "tanh", 1.0), (3.0, "tanh", 0.5),
                                   (3.0, "tanh", 0.5)]:
            SCALE, OPTIONS["act"], OPTIONS["scale"] = scale, act, factor
            assert_close(wrapped(x), model(x), 1e-6, f"{scale, act, factor}")
        assert wrapped.stats.exports == 4
    finally:
        SCALE, OPTIONS["act"], OPTIONS["scale"] = 2.0, "relu", 1.0


def test_draw_specs_keep_their_order_and_kind():
    """Masks and draws share one list in trace order: the eager order of the calls."""
    wrapped = ORTModule(Draws(CASES["with_dropout"]))
    wrapped(torch.randn(B, D))
    entry = next(iter(wrapped._entries._data.values()))
    kinds = [type(s).__name__ for s in entry.exported.masks]
    assert kinds == ["MaskSpec", "RandomSpec", "MaskSpec"]
    assert math.isclose(entry.exported.masks[2].p, 0.4)


class LearnedCoin(nn.Module):
    """A keep probability read only through torch.bernoulli: eager gives its logit a zero gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.logit = nn.Parameter(torch.zeros(D))

    def forward(self, x):
        h = self.lin(x)
        return h * torch.bernoulli(torch.sigmoid(self.logit).expand_as(h))


@pytest.mark.skipif(not TORCH_EXPORT, reason="the TorchScript exporter folds the zero term away (None, not zeros)")
def test_probabilities_read_only_by_bernoulli_get_zero_gradients():
    # before: logit.grad was None where eager's is zeros, so AdamW's weight decay skipped the logit
    torch.manual_seed(0)
    model = LearnedCoin()
    wrapped = ORTModule(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _steps(model, wrapped, [torch.randn(B, D) for _ in range(2)])
    assert wrapped.logit.grad is not None and not wrapped.logit.grad.any()
