"""Issue 17's rough edges a new user hits: where the fallback warning points, and what stats say after
a fallback or a call that raised."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ortmodule import ORTModule

from .helpers import assert_close


class ReadsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * (2.0 if x.sum().item() > 0 else 1.0)


def test_fallback_warning_points_at_the_callers_line():
    wrapped = ORTModule(ReadsItem())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(torch.randn(2, 4))  # the line the warning must name
    (w,) = [w for w in caught if "falls back" in str(w.message)]
    assert w.filename == __file__, w.filename
    assert "wrapped(torch.randn(2, 4))" in open(__file__).read().splitlines()[w.lineno - 1]


def test_stats_after_a_fallback_and_after_a_call_that_raised():
    wrapped = ORTModule(ReadsItem())
    with pytest.warns(UserWarning, match="falls back"):
        wrapped(torch.randn(2, 4))
    assert wrapped.stats.fallbacks == 1 and wrapped.stats.cache_misses == 1
    assert wrapped.stats.peak_rss_mb > 0.0

    mlp = ORTModule(nn.Linear(4, 4))
    with pytest.raises(RuntimeError):
        mlp(torch.randn(2, 5))  # wrong feature size: eager's error, not a cache miss
    assert mlp.stats.cache_misses == 0 and mlp.stats.fallbacks == 0
    mlp(torch.randn(2, 4)).sum().backward()  # and the module keeps working
    assert mlp.stats.cache_misses == 1 and mlp.weight.grad is not None


def test_torch_compile_of_the_wrapper_is_a_clean_graph_break():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    eager = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    eager.load_state_dict(net.state_dict())
    wrapped = ORTModule(net)
    compiled = torch.compile(wrapped)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x).pow(2).sum().backward()
    assert not [w for w in caught if "Dynamo" in str(w.message) or "perf_counter" in str(w.message)]
    eager(x).pow(2).sum().backward()
    for pe, po in zip(eager.parameters(), wrapped.parameters()):
        assert torch.allclose(po.grad, pe.grad, rtol=1e-5, atol=1e-6)
    assert wrapped.stats.exports == 1 and wrapped.stats.fallbacks == 0


class Lookup(nn.Module):
    """An embedding (of the given kind) and a linear head."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb
        self.out = nn.Linear(emb.embedding_dim, 4)

    def forward(self, ids):
        return self.out(self.emb(ids))


def test_embedding_with_max_norm_falls_back_naming_it_and_renormalises_once():
    """Before: a fallback that named an AssertionError deep in torch.export's decomposition."""
    torch.manual_seed(0)
    eager = Lookup(nn.Embedding(50, 16, max_norm=1.0))
    wrapped = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(0, 50, (8, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for m in (eager, wrapped):
                m(ids).square().sum().backward()
    assert any("max_norm" in str(w.message) for w in caught)
    assert torch.equal(wrapped.module.emb.weight, eager.emb.weight)  # renormalised once per call
    assert torch.allclose(wrapped.module.out.weight.grad, eager.out.weight.grad)


def test_sparse_embedding_falls_back_naming_it_and_keeps_its_sparse_gradient():
    """Before: the gradient came back dense, and torch.optim.SparseAdam refused it on the first step."""
    torch.manual_seed(0)
    eager = Lookup(nn.Embedding(500, 16, sparse=True))
    wrapped = ORTModule(copy.deepcopy(eager))
    opts = [torch.optim.SparseAdam([m.emb.weight], lr=1e-2) for m in (eager, wrapped.module)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            ids = torch.randint(0, 500, (64, 128), generator=torch.Generator().manual_seed(step))
            for m, opt in zip((eager, wrapped), opts):
                opt.zero_grad()
                m(ids).square().sum().backward()
                opt.step()
    assert any("sparse=True" in str(w.message) for w in caught)
    assert wrapped.module.emb.weight.grad.is_sparse
    assert torch.allclose(wrapped.module.emb.weight, eager.emb.weight, rtol=1e-5, atol=1e-6)
    assert torch.allclose(wrapped.module.out.weight.grad, eager.out.weight.grad, rtol=1e-5, atol=1e-6)


def test_torch_func_transforms_run_eagerly_and_match():
    """NOTE [functorch transforms]: torch.func.grad of functional_call, vmap and jacrev through the
    wrapper give eager's numbers (the call runs eagerly, one warning); plain calls stay in ORT."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(32, 8)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def per_sample_grads(m):
        loss = lambda p, xi: torch.func.functional_call(m, p, (xi[None],)).pow(2).sum()  # noqa: E731
        return torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    with pytest.warns(UserWarning, match="torch.func transform"):
        got = per_sample_grads(wrapped)
    want = per_sample_grads(model)
    for k in want:
        assert_close(got[k], want[k], 1e-6, f"per-sample grad of {k}")
    jac = [torch.func.jacrev(m)(x[:3]) for m in (wrapped, model)]
    assert_close(jac[0], jac[1], 1e-6, "jacrev")
    fallbacks = wrapped.stats.fallbacks
    for m in (wrapped, model):  # a plain step afterwards runs in ORT, at eager's numbers
        m.zero_grad()
        m(x).pow(2).sum().backward()
    assert wrapped.stats.fallbacks == fallbacks and wrapped.stats.exports >= 1
    for (name, pe), (_, po) in zip(model.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad after the transforms")
