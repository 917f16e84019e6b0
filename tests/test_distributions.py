"""torch.distributions in forward (NOTE [value checks]): policy heads, likelihoods, VAEs train in ORT at
eager's numbers, and the argument / sample validation eager does still raises eager's ValueError."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributions as D
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule, explain

from .helpers import TORCH_EXPORT, assert_close, by_frontend, train_side_by_side

N_ROWS = 8192


class ActorCritic(nn.Module):
    """A PPO-style policy: a discrete and a continuous action head and a value head, BatchNorm and
    dropout in the body; the loss is the clipped-free surrogate of what PPO computes."""

    def __init__(self, n_obs: int = 24, n_act: int = 6, n_cont: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_obs, 128, bias=False), nn.BatchNorm1d(128), nn.Tanh(), nn.Dropout(0.1))
        self.pi = nn.Linear(128, n_act)
        self.mu = nn.Linear(128, n_cont)
        self.log_std = nn.Parameter(torch.full((n_cont,), -0.5))
        self.v = nn.Linear(128, 1)

    def forward(self, obs, action, cont, adv):
        h = self.body(obs)
        pi = D.Categorical(logits=self.pi(h))
        gauss = D.Normal(self.mu(h), self.log_std.exp())
        logp = pi.log_prob(action) + gauss.log_prob(cont).sum(-1)
        entropy = pi.entropy() + gauss.entropy().sum(-1)
        value = self.v(h).squeeze(-1)
        return -(logp * adv).mean() - 0.01 * entropy.mean() + 0.5 * (value - adv).pow(2).mean()


def _ppo_batch(seed: int, n: int = N_ROWS):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 24, generator=g), torch.randint(0, 6, (n,), generator=g),
            torch.randn(n, 3, generator=g), torch.randn(n, generator=g))


def _both(model: nn.Module):
    eager = copy.deepcopy(model)
    wrapped = ORTModule(copy.deepcopy(model))
    return eager, wrapped


def test_a_policy_with_distributions_trains_in_ort_like_eager():
    """Categorical and Normal heads (log_prob, entropy) with their validation on, as torch has it by
    default: every such model fell back to eager (the validation reads values into Python)."""
    torch.manual_seed(0)
    batches = [_ppo_batch(s) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback warning
        wrapped = train_side_by_side(ActorCritic(), batches, lambda loss, _: loss, rtol=2e-5, seed=100)
    assert wrapped.stats.fallbacks == 0


class Likelihood(nn.Module):
    """A head that parametrises a distribution and returns the mean negative log-likelihood of ``y``."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.form = form

    def forward(self, x, y):
        h = self.net(x)
        pos = F.softplus(h) + 1e-3
        return -LIKELIHOODS[self.form](h, pos, y).mean()


LIKELIHOODS = {
    # mixture density network: a Categorical over Normal components
    "mixture": lambda h, pos, y: D.MixtureSameFamily(D.Categorical(logits=h[:, :4]),
                                                     D.Normal(h[:, 4:8], pos[:, 8:12])).log_prob(y[:, 0]),
    # SAC's squashed Gaussian
    "tanh_normal": lambda h, pos, y: D.TransformedDistribution(
        D.Normal(h[:, :3], pos[:, 3:6]), [D.TanhTransform(cache_size=1)]).log_prob(torch.tanh(y[:, :3]) * 0.99).sum(-1),
    "independent": lambda h, pos, y: D.Independent(D.Normal(h[:, :8], pos[:, 8:]), 1).log_prob(y[:, :8]),
    "bernoulli": lambda h, pos, y: D.Bernoulli(logits=h).log_prob((y > 0).float()).sum(-1),
    "laplace": lambda h, pos, y: D.Laplace(h[:, :8], pos[:, 8:]).log_prob(y[:, :8]).sum(-1),
    "mvn_tril": lambda h, pos, y: D.MultivariateNormal(h[:, :8], scale_tril=torch.diag_embed(pos[:, 8:]))
    .log_prob(y[:, :8]),
    "low_rank": lambda h, pos, y: D.LowRankMultivariateNormal(h[:, :4], h[:, 4:12].reshape(-1, 4, 2),
                                                              pos[:, 12:]).log_prob(y[:, :4]),
    # lgamma / digamma: decomposed to prims nothing translates (NOTE [decomposed to nothing])
    "beta": lambda h, pos, y: D.Beta(pos[:, :4] + 1, pos[:, 4:8] + 1).log_prob(torch.sigmoid(y[:, :4])).sum(-1),
    "student_t": lambda h, pos, y: D.StudentT(3.0, h[:, :8], pos[:, 8:]).log_prob(y[:, :8]).sum(-1),
    "poisson": lambda h, pos, y: D.Poisson(pos).log_prob(y.abs().floor()).sum(-1),
    "dirichlet": lambda h, pos, y: D.Dirichlet(pos).log_prob(torch.softmax(y, -1)),
    "gamma": lambda h, pos, y: D.Gamma(pos[:, :8], pos[:, 8:]).log_prob(y[:, :8].abs() + 0.1).sum(-1),
}
# the TorchScript exporter has no atanh, xlogy, lgamma, diag_embed, mT: those fall back there, at eager's numbers
_TORCHSCRIPT_FALLS_BACK = {"tanh_normal", "mvn_tril", "low_rank", "beta", "student_t", "poisson", "dirichlet",
                           "gamma"}


@pytest.mark.parametrize("form", sorted(LIKELIHOODS))
def test_likelihoods_train_in_ort_like_eager(form):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(N_ROWS, 16, generator=g), torch.randn(N_ROWS, 16, generator=g)) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = train_side_by_side(Likelihood(form), batches, lambda loss, _: loss, rtol=2e-5, steps=3, seed=100)
    falls_back = not TORCH_EXPORT and form in _TORCHSCRIPT_FALLS_BACK
    assert wrapped.stats.fallbacks == int(falls_back)


class VAE(nn.Module):
    """A VAE as written with torch.distributions: ``rsample`` (a draw made in torch's order) and
    ``kl_divergence`` against the prior; a Bernoulli decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(32, 2 * 8)
        self.dec = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x):
        mu, log_var = self.enc(x).chunk(2, -1)
        q = D.Normal(mu, (0.5 * log_var).exp())
        z = q.rsample()
        recon = D.Bernoulli(logits=self.dec(z)).log_prob(x).sum(-1)
        kl = D.kl_divergence(q, D.Normal(torch.zeros_like(mu), torch.ones_like(mu))).sum(-1)
        return (kl - recon).mean()


def test_a_vae_with_rsample_and_kl_trains_in_ort_like_eager():
    torch.manual_seed(0)
    batches = [((torch.rand(N_ROWS, 32) > 0.5).float(),) for _ in range(2)]
    eager, wrapped = VAE(), ORTModule(VAE())
    wrapped.module.load_state_dict(eager.state_dict())
    for step in range(3):
        (x,) = batches[step % 2]
        torch.manual_seed(10 + step)
        le = eager(x)
        le.backward()
        torch.manual_seed(10 + step)
        lo = wrapped(x)
        lo.backward()
        assert_close(lo, le, 1e-5, f"loss at step {step}")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad at step {step}")
    assert wrapped.stats.fallbacks == 0


@pytest.mark.parametrize("bad", ["nan_logits", "action_out_of_support", "eval_no_grad"])
def test_invalid_values_raise_eagers_error_and_the_module_keeps_working(bad):
    """A NaN in the logits (a diverged run) or an action outside the support: eager's validation raises a
    ValueError naming the parameter. The graph computes the check, and the call raises eager's error,
    with the BatchNorm statistics and the generator where eager leaves them; later calls train on."""
    torch.manual_seed(0)
    eager, wrapped = _both(ActorCritic())
    if bad == "eval_no_grad":
        eager.eval(), wrapped.eval()
    good = _ppo_batch(1, 4096)
    for m in (eager, wrapped):  # compile the graph first: the check runs in it
        torch.manual_seed(3)
        with torch.set_grad_enabled(bad != "eval_no_grad"):
            m(*good)
    obs, action, cont, adv = _ppo_batch(2, 4096)
    if bad in ("nan_logits", "eval_no_grad"):
        obs[17, 3] = float("nan")
        match = "Expected parameter logits"
    else:
        action[100] = 6  # of 6 classes
        match = "Expected value argument"
    states = []
    for m in (eager, wrapped):
        torch.manual_seed(4)
        with torch.set_grad_enabled(bad != "eval_no_grad"), pytest.raises(ValueError, match=match):
            m(obs, action, cont, adv)
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1]), "the generator moved other than in eager"
    for (name, be), (_, bo) in zip(eager.named_buffers(), wrapped.named_buffers()):  # NaN where eager's is
        torch.testing.assert_close(bo, be, rtol=1e-5, atol=1e-6, equal_nan=True, msg=f"buffer {name}")
    losses = []
    for m in (eager, wrapped):
        torch.manual_seed(5)
        with torch.set_grad_enabled(bad != "eval_no_grad"):
            losses.append(m(*good))
    assert_close(losses[1], losses[0], 1e-5, "loss after the failed call")
    assert wrapped.stats.fallbacks == 0


def _checks(wrapped: ORTModule) -> tuple[str, ...]:
    (entry,) = wrapped._entries._data.values()
    return entry.exported.checks


def test_validation_off_adds_no_check():
    """``validate_args=False`` (or the global default off) makes no check: the graph has no extra output."""
    batch = _ppo_batch(0, 1024)
    for validate in (True, False):
        torch.manual_seed(0)
        D.Distribution.set_default_validate_args(validate)
        try:
            eager, wrapped = _both(ActorCritic())
            for m in (eager, wrapped):
                torch.manual_seed(1)
                m(*batch).backward()
            report = str(explain(ActorCritic(), *batch))
        finally:
            D.Distribution.set_default_validate_args(True)
        # Categorical's logits, Normal's loc and scale, and the two samples (under TorchScript also the
        # samples' broadcast checks: traced sizes are tensors there)
        assert len(_checks(wrapped)) == (by_frontend(8, 5) if validate else 0)
        assert ("value checks computed in the graph" in report) == validate, report
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad")


def test_checks_hold_across_batch_sizes():
    """A new batch size exports a graph with symbolic sizes (NOTE [static first]); the value checks go with
    it: eager's numbers at every size, and a NaN at a size not seen before still raises eager's error."""
    torch.manual_seed(0)
    eager, wrapped = _both(ActorCritic())
    for step, n in enumerate((512, 384, 640, 384)):
        batch = _ppo_batch(step, n)
        losses = []
        for m in (eager, wrapped):
            torch.manual_seed(step)
            loss = m(*batch)
            loss.backward()
            losses.append(loss)
        assert_close(losses[1], losses[0], 1e-5, f"loss at batch {n}")
    # TorchScript: distributions' broadcast check reads traced sizes, so each shape gets its own graph
    assert wrapped.stats.fallbacks == 0 and wrapped.stats.exports <= by_frontend(5, 3)
    obs, action, cont, adv = _ppo_batch(9, 256)
    obs[0, 0] = float("nan")
    for m in (eager, wrapped):
        with pytest.raises(ValueError, match="Expected parameter logits"):
            m(obs, action, cont, adv)
    assert wrapped.stats.fallbacks == 0
