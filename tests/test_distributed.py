"""Issue 6: DDP(ORTModule(model)) under torchrun (gloo, CPU) against single-process training.

One torchrun launch per world size runs every scenario of tests/dist_worker.py (startup dominates the
cost); each test then compares one scenario's results with a reference computed here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ortmodule import ORTModule
from ortmodule.distributed import adasum_pair

from . import dist_worker as W
from .helpers import assert_close

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable"),
              pytest.mark.processes]

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = WORKER.parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(nproc: int, out: Path, scenarios: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        str(WORKER), "--out", str(out), "--scenarios", scenarios,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen, what: str) -> None:
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        pytest.fail(f"{what} timed out:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{what} failed (rc={proc.returncode}):\n{log[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch the 2-rank (all scenarios) and 4-rank (Adasum) jobs side by side; results by world size."""
    out2, out4 = tmp_path_factory.mktemp("ddp2"), tmp_path_factory.mktemp("ddp4")
    p2 = _launch(2, out2, ",".join(W.SCENARIOS))
    p4 = _launch(4, out4, "adasum")
    _wait(p2, "torchrun --nproc_per_node=2")
    _wait(p4, "torchrun --nproc_per_node=4")
    return {2: out2, 4: out4}


def _load(runs, world: int, scenario: str) -> list[dict]:
    return [torch.load(runs[world] / f"{scenario}_rank{r}.pt") for r in range(world)]


def _same_on_every_rank(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    first = results[0][key]
    for r, res in enumerate(results[1:], 1):
        for name, t in res[key].items():
            assert torch.equal(t, first[name]), f"{key}[{name}] differs between rank 0 and rank {r}"
    return first


def _grads(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x, y = batch
    W.loss_fn(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_ddp_gradients_match_full_batch(runs):
    results = _load(runs, 2, "ddp")
    ref = ORTModule(W.make_model())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, batch in enumerate(W.make_batches(2)):
        expected = _grads(ref, batch)
        got = _same_on_every_rank(results, f"grads{step}")
        for name, g in expected.items():
            assert_close(got[name], g, 1e-5, f"{name}.grad at step {step}")
        opt.step()
    got = _same_on_every_rank(results, "params")
    for name, p in ref.named_parameters():
        assert_close(got[name], p, 1e-5, f"{name} after 2 steps")


def test_ddp_no_sync_gradient_accumulation(runs):
    results = _load(runs, 2, "nosync")
    ref = ORTModule(W.make_model())
    b0, b1 = W.make_batches(2)
    g0, g1 = _grads(ref, b0), _grads(ref, b1)
    got = _same_on_every_rank(results, "grads")
    for name in g0:
        assert_close(got[name], g0[name] + g1[name], 1e-5, f"accumulated {name}.grad")
    # Under no_sync() nothing was reduced: each rank held the gradient of its own shard only.
    for rank, res in enumerate(results):
        local = _grads(ref, W.shard(b0, rank, 2))
        for name, g in local.items():
            assert_close(res["local_first"][name], g, 1e-5, f"rank {rank} local {name}.grad under no_sync")


def test_zero_redundancy_adamw_matches_adamw(runs):
    results = _load(runs, 2, "zero")
    ref = ORTModule(W.make_model())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for batch in W.make_batches(3):
        opt.zero_grad(set_to_none=True)
        _grads(ref, batch)
        opt.step()
    got = _same_on_every_rank(results, "params")
    for name, p in ref.named_parameters():
        assert_close(got[name], p, 1e-5, f"{name} after 3 ZeRO-1 AdamW steps")


def test_fp16_compress_hook(runs):
    results = _load(runs, 2, "fp16")
    expected = _grads(ORTModule(W.make_model()), W.make_batches(1)[0])
    got = _same_on_every_rank(results, "grads")
    for name, g in expected.items():
        assert_close(got[name], g, 2e-3, f"{name}.grad through fp16_compress_hook", atol=1e-4)


def _direct_adasum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The pairwise formula, written out independently of ortmodule.distributed (float64)."""
    a, b = a.double(), b.double()
    dot = (a * b).sum()
    return (1 - dot / (2 * (a * a).sum())) * a + (1 - dot / (2 * (b * b).sum())) * b


def _direct_tree(gs: list[torch.Tensor]) -> torch.Tensor:
    while len(gs) > 1:
        gs = [_direct_adasum(gs[i], gs[i + 1]) for i in range(0, len(gs), 2)]
    return gs[0]


@pytest.mark.parametrize("world", [2, 4])
def test_adasum_hook_matches_pairwise_formula(runs, world):
    results = _load(runs, world, "adasum")
    batch = W.make_batches(1)[0]
    model = W.make_model()
    local = [_grads(model, W.shard(batch, r, world)) for r in range(world)]
    got = _same_on_every_rank(results, "grads")
    for name in local[0]:
        expected = _direct_tree([loc[name] for loc in local]).float()
        assert_close(got[name], expected, 1e-5, f"Adasum {name}.grad over {world} ranks")


def test_adasum_pair_properties():
    a = torch.randn(100)
    b = torch.randn(100)
    b_orth = b - (a @ b) / (a @ a) * a
    assert_close(adasum_pair(a, b_orth), a + b_orth, 1e-6, "orthogonal: sum")
    assert_close(adasum_pair(a, a), a, 1e-6, "parallel: average")
    assert_close(adasum_pair(a, torch.zeros(100)), a, 1e-6, "zero partner")
    # Per-layer splits: each slice combined on its own.
    both = adasum_pair(torch.cat([a, a]), torch.cat([b_orth, a]), splits=[100, 100])
    assert_close(both, torch.cat([a + b_orth, a]), 1e-6, "per-slice")


def test_adasum_converges_like_allreduce_mean(runs):
    res = _load(runs, 2, "converge")[0]
    mean, ada = res["mean"], res["adasum"]
    initial = float(mean[0])
    print(f"\nlinear regression, 2 ranks, SGD lr=0.05, 60 steps: full-data MSE "
          f"allreduce-mean {float(mean[-1]):.2e}, adasum {float(ada[-1]):.2e} (after step 1: {initial:.2f})")
    assert float(mean[-1]) < 1e-2 * initial and float(ada[-1]) < 1e-2 * initial
