"""Worker for tests/test_fsdp.py, launched by torchrun (gloo, CPU): FSDP2 (``fully_shard``) over
ORTModule, written in the order the README documents: wrap first, then shard the wrapper.

    python -m torch.distributed.run --nproc_per_node=2 tests/fsdp_worker.py --out DIR

Each scenario trains on this rank's shard of fixed batches and writes, per step, the mean loss over
the ranks, the full (all-gathered) gradients after the reduce-scatter and the full parameters after
the AdamW step to ``DIR/<scenario>_rank<r>.pt``. The builders are imported by the test for its
single-process reference on the full batch (NOTE: not another FSDP run, see pytorch #162338).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

BATCH, STEPS = 8, 3
LR = 1e-2
# NOTE [AdamW eps] (tests/test_transformers.py): GPT-2 has gradients that are zero in exact
# arithmetic (the attention key bias); both runs return rounding noise there, which AdamW's default
# eps would turn into steps of +-lr in random directions.
GPT2_EPS = 1e-6


def make_mlp() -> tuple[nn.Module, nn.Module]:
    """A body ORTModule runs and an eager head (the head is used by the ``inner`` scenario)."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh())
    return body, nn.Linear(64, 4)


def make_gpt2() -> nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def mlp_batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g),) for _ in range(STEPS)]


def gpt2_batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 96, (BATCH, 16), generator=g),) for _ in range(STEPS)]


def mlp_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(batch[0]).square().mean()


def gpt2_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def shard(batch, rank: int, world: int):
    n = batch[0].shape[0] // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model: nn.Module, opt, batches, loss_of, rank: int, world: int, steps=range(STEPS)) -> dict:
    out: dict = {"loss": [], "grads": [], "params": []}
    for step in steps:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, shard(batches[step], rank, world))
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["loss"].append(float(mean) / world)
        out["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        out["params"].append({n: _full(p) for n, p in model.named_parameters()})
    return out


def _sharded(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from ortmodule import ORTModule

    wrapped = ORTModule(model, fallback="raise")
    fully_shard(wrapped)
    return wrapped


def scenario_root(rank, world):
    """The wrapper is the root FSDP unit (the whole graph is one all-gather)."""
    body, head = make_mlp()
    model = _sharded(nn.Sequential(body, head))
    out = _train(model, torch.optim.AdamW(model.parameters(), lr=LR), mlp_batches(), mlp_loss, rank, world)
    out["sharded"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
    out["exports"] = model.stats.exports
    return out


def scenario_inner(rank, world):
    """The wrapper is an inner FSDP unit under an eager root: FSDP frees its unsharded parameters
    after forward and gathers them again before backward, so the backward binds new storage."""
    from torch.distributed.fsdp import fully_shard

    body, head = make_mlp()
    inner = _sharded(body)
    model = nn.Sequential(inner, head)
    fully_shard(model)
    freed = []

    def after_forward(module, args, output):  # FSDP's own post-forward hook ran first: resharded
        group = module._get_fsdp_state()._fsdp_param_group
        freed.append(all(p._unsharded_param.untyped_storage().size() == 0 for p in group.fsdp_params))

    inner.register_forward_hook(after_forward)
    out = _train(model, torch.optim.AdamW(model.parameters(), lr=LR), mlp_batches(), mlp_loss, rank, world)
    out["freed_after_forward"] = freed  # so a pointer kept from the forward would read freed memory
    return out


def scenario_gpt2(rank, world):
    """A transformers GPT-2 (tied embeddings) as the root unit."""
    model = _sharded(make_gpt2())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=GPT2_EPS)
    out = _train(model, opt, gpt2_batches(), gpt2_loss, rank, world)
    out["exports"] = model.stats.exports
    out["fallbacks"] = model.stats.fallbacks
    return out


def scenario_resume(rank, world, folder: str):
    """Two steps, a sharded checkpoint (torch.distributed.checkpoint), a fresh sharded wrapper that
    loads it, and the last step: the parameters must be the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    body, head = make_mlp()
    model = _sharded(nn.Sequential(body, head))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = mlp_batches()
    _train(model, opt, batches, mlp_loss, rank, world, steps=range(STEPS - 1))
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=folder)
    dist.barrier()

    body, head = make_mlp()  # fresh weights: the checkpoint must overwrite them
    with torch.no_grad():
        for p in body.parameters():
            p.add_(1.0)
    resumed = _sharded(nn.Sequential(body, head))
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=LR)
    model_sd, opt_sd = get_state_dict(resumed, opt2)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(resumed, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out = _train(resumed, opt2, batches, mlp_loss, rank, world, steps=range(STEPS - 1, STEPS))
    out["keys"] = sorted(model_sd)
    return out


SCENARIOS = ("root", "inner", "gpt2", "resume")


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
        fn = globals()[f"scenario_{name}"]
        result = fn(rank, world, os.path.join(args.out, "ckpt")) if name == "resume" else fn(rank, world)
        result["seconds"] = time.perf_counter() - t0
        torch.save(result, os.path.join(args.out, f"{name}_rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
