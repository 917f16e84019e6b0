"""Worker for tests/test_distributed.py, launched by torchrun (gloo, CPU).

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_worker.py --out DIR --scenarios ddp,zero

Each scenario trains ``DDP(ORTModule(model))`` on this rank's shard of a fixed batch and writes what
the test compares (gradients, parameters, losses) to ``DIR/<scenario>_rank<r>.pt``. The model and
data builders are imported by the test for its single-process reference.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

BATCH = 16
IN, HIDDEN, OUT = 20, 32, 5


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def make_batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)) for _ in range(n)]


def shard(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    n = batch[0].shape[0] // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def make_regression(n: int = 256, d: int = 16, seed: int = 3):
    """Synthetic linear regression with a little noise (for the Adasum convergence comparison)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _wrap(model: nn.Module, hook=None, state=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ortmodule import ORTModule

    ddp = DDP(ORTModule(model))
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp


def scenario_ddp(rank, world):
    """Two SGD steps; gradients of each step."""
    ddp = _wrap(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = {}
    for step, batch in enumerate(make_batches(2)):
        x, y = shard(batch, rank, world)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        out[f"grads{step}"] = _grads(ddp.module)
        opt.step()
    out["params"] = _params(ddp.module)
    return out


def scenario_nosync(rank, world):
    """Gradient accumulation over two micro-batches, the first under no_sync()."""
    ddp = _wrap(make_model())
    b0, b1 = make_batches(2)
    with ddp.no_sync():
        x, y = shard(b0, rank, world)
        loss_fn(ddp(x), y).backward()
    local_after_first = _grads(ddp.module)  # not yet reduced
    x, y = shard(b1, rank, world)
    loss_fn(ddp(x), y).backward()
    return {"grads": _grads(ddp.module), "local_first": local_after_first}


def scenario_zero(rank, world):
    """ZeroRedundancyOptimizer(AdamW): parameters after 3 steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _wrap(make_model())
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    for batch in make_batches(3):
        x, y = shard(batch, rank, world)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
    return {"params": _params(ddp.module)}


def scenario_adasum(rank, world):
    """One backward with the Adasum hook: the reduced gradients."""
    from ortmodule.distributed import AdasumState, adasum_hook

    ddp = _wrap(make_model(), adasum_hook, AdasumState())
    x, y = shard(make_batches(1)[0], rank, world)
    loss_fn(ddp(x), y).backward()
    return {"grads": _grads(ddp.module)}


def scenario_fp16(rank, world):
    """One backward with torch's fp16_compress_hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    ddp = _wrap(make_model(), fp16_compress_hook, None)
    x, y = shard(make_batches(1)[0], rank, world)
    loss_fn(ddp(x), y).backward()
    return {"grads": _grads(ddp.module)}


def scenario_converge(rank, world, steps: int = 60, lr: float = 0.05):
    """Linear regression by SGD with allreduce-mean and with Adasum: full-data loss per step."""
    from ortmodule.distributed import AdasumState, adasum_hook

    x, y = make_regression()
    xs, ys = shard((x, y), rank, world)
    out = {}
    for name in ("mean", "adasum"):
        torch.manual_seed(0)
        model = nn.Linear(x.shape[1], 1)
        ddp = _wrap(model, adasum_hook if name == "adasum" else None, AdasumState() if name == "adasum" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        losses = []
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(steps):
            idx = torch.randint(0, xs.shape[0], (16,), generator=g)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(ddp(xs[idx]), ys[idx]).backward()
            opt.step()
            with torch.no_grad():
                losses.append(float(F.mse_loss(model(x), y)))
        out[name] = torch.tensor(losses)
    return out


SCENARIOS = {
    "ddp": scenario_ddp,
    "nosync": scenario_nosync,
    "zero": scenario_zero,
    "adasum": scenario_adasum,
    "fp16": scenario_fp16,
    "converge": scenario_converge,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in args.scenarios.split(","):
        t0 = time.perf_counter()
        result = SCENARIOS[name](rank, world)
        result["seconds"] = time.perf_counter() - t0
        torch.save(result, os.path.join(args.out, f"{name}_rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
