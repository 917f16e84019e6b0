"""Sharded data-parallel training (FSDP2, ZeRO-3): fully_shard(ORTModule(model)) on CPU with gloo.

Parameters, gradients and AdamW state are sharded over the ranks between steps; FSDP all-gathers the
parameters before the ORT forward and backward and reduce-scatters the gradients. The order matters
(NOTE [FSDP order]): wrap first, then shard the wrapper. A small GPT-2 built from a transformers
config learns a fixed pool of token sequences; the run saves a sharded checkpoint with torch.distributed.checkpoint,
and a second model loads it and checks it resumes with the same weights.

Run:  torchrun --nproc_per_node=2 examples/fsdp_train.py [--steps 20] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from ortmodule import ORTModule

SEED, BATCH, SEQ, LR = 0, 8, 64, 1e-3


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(SEED)  # the same initial weights on every rank
    cfg = transformers.GPT2Config(vocab_size=2048, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4)
    model = ORTModule(transformers.GPT2LMHeadModel(cfg))  # 1. wrap
    fully_shard(model)  # 2. shard the wrapper: parameters become DTensor shards
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--checkpoint", default=None, help="folder for the sharded checkpoint (default: a temporary one)")
    args = ap.parse_args()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)  # also runnable without torchrun, as one rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model, opt = build()
    # A fixed pool of 64 token sequences to memorise; each rank draws its own batches from it.
    pool = torch.randint(0, 2048, (64, SEQ), generator=torch.Generator().manual_seed(SEED))
    data = torch.Generator().manual_seed(SEED + 1 + rank)
    start = time.perf_counter()
    for step in range(args.steps):
        ids = pool[torch.randint(0, len(pool), (BATCH,), generator=data)]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {float(mean) / world:.4f}")
    seconds = time.perf_counter() - start
    shard = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or (tmp if world == 1 else None)
        if folder is None:  # every rank must write to the same folder: rank 0's temporary one
            names = [tmp]
            dist.broadcast_object_list(names, src=0)
            folder = names[0]
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=folder)
        resumed, opt2 = build()
        state = dict(zip(("model", "optim"), get_state_dict(resumed, opt2)))
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(resumed, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), resumed.parameters()))
        dist.barrier()  # rank 0's temporary folder outlives every rank's reads
    if rank == 0:
        print(f"{world} rank(s): {args.steps} steps in {seconds:.1f} s; this rank holds {shard:,} of {total:,} "
              f"parameters; resumed from the sharded checkpoint with the same weights: {same}; "
              f"exports: {model.stats.exports}, fallbacks: {model.stats.fallbacks}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
