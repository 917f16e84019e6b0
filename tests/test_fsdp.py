"""FSDP2 (``fully_shard``, ZeRO-3) over ORTModule under torchrun (2 CPU processes, gloo), against
single-process eager training on the full batch: losses, gradients after the reduce-scatter and
parameters after 3 AdamW steps to 1e-5; a sharded checkpoint resumes the run.

One torchrun launch runs every scenario of tests/fsdp_worker.py. The reference is never another
FSDP run: FSDP2 over gloo has summed gradients instead of averaging them (pytorch #162338), which a
comparison between two FSDP runs would not see.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ortmodule import ORTModule

from . import fsdp_worker as W
from .helpers import TORCH_EXPORT, assert_close

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable"),
              pytest.mark.processes]
needs_export = pytest.mark.skipif(not TORCH_EXPORT, reason="FSDP needs the torch.export front end (tested below)")

WORKER = Path(__file__).with_name("fsdp_worker.py")
ROOT = WORKER.parent.parent
WORLD = 2
RTOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(WORKER), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"torchrun failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}"
    return out


def _load(out: Path, scenario: str) -> list[dict]:
    return [torch.load(out / f"{scenario}_rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _reference(model: nn.Module, batches, loss_of, steps=range(W.STEPS), opt=None) -> dict:
    """Single-process eager training on the full batches, recorded like the worker records."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=W.LR)
    out: dict = {"loss": [], "grads": [], "params": []}
    for step in steps:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, batches[step])
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _compare(results: list[dict], ref: dict, what: str, rtol: float = RTOL) -> None:
    for rank, res in enumerate(results):
        for step, (loss, ref_loss) in enumerate(zip(res["loss"], ref["loss"])):
            assert abs(loss - ref_loss) <= rtol * abs(ref_loss), f"{what} rank {rank} loss at step {step}"
        for key in ("grads", "params"):
            for step, (got, want) in enumerate(zip(res[key], ref[key])):
                # an ORTModule inside an eager module is named through its _original_module
                got = {n.replace("_original_module.", ""): t for n, t in got.items()}
                assert sorted(got) == sorted(want), f"{what}: {key} names differ"
                for name, t in want.items():
                    assert_close(got[name], t, rtol, f"{what} rank {rank} {key}[{name}] at step {step}")


def _mlp() -> nn.Module:
    return nn.Sequential(*W.make_mlp())


@needs_export
def test_the_wrapper_as_root_unit_trains_like_one_process(runs):
    results = _load(runs, "root")
    assert all(r["sharded"] for r in results), "parameters are DTensor shards between steps"
    assert all(r["exports"] == 1 for r in results)
    _compare(results, _reference(_mlp(), W.mlp_batches(), W.mlp_loss), "root")


@needs_export
def test_an_inner_unit_resharded_after_forward_trains_like_one_process(runs):
    """FSDP frees the unsharded parameters after the wrapper's forward and gathers them again for
    the backward: the sessions must bind that new storage (NOTE [bound parameters])."""
    results = _load(runs, "inner")
    assert all(r["freed_after_forward"] == [True] * W.STEPS for r in results)
    _compare(results, _reference(_mlp(), W.mlp_batches(), W.mlp_loss), "inner")


@needs_export
def test_gpt2_with_tied_embeddings_trains_like_one_process(runs):
    results = _load(runs, "gpt2")
    assert all(r["fallbacks"] == 0 and r["exports"] == 1 for r in results)
    model = W.make_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=W.LR, eps=W.GPT2_EPS)  # NOTE [AdamW eps]
    _compare(results, _reference(model, W.gpt2_batches(), W.gpt2_loss, opt=opt), "gpt2")


@needs_export
def test_a_sharded_checkpoint_resumes_the_run(runs):
    results = _load(runs, "resume")
    assert "0.0.weight" in results[0]["keys"], "the checkpoint has the plain model's names"
    ref = _reference(_mlp(), W.mlp_batches(), W.mlp_loss)
    last = {key: ref[key][-1:] for key in ("loss", "grads", "params")}
    _compare(results, last, "resume")


def test_sharding_inside_the_wrapper_is_refused():
    """fully_shard on submodules, then ORTModule: FSDP's hooks would never run in the graph."""
    from torch.distributed.fsdp import FSDPModule

    model = _mlp()
    fake = copy.deepcopy(model)
    fake[0].__class__ = type("FSDPSequential", (FSDPModule, nn.Sequential), {})
    with pytest.raises(ValueError, match=r"'0' was sharded with fully_shard.*ORTModule first"):
        ORTModule(fake)


def test_fsdp_under_the_torchscript_front_end_falls_back_naming_it():
    """One process, world size 1: fully_shard works; the legacy tracer cannot trace FSDP's
    gathered parameters, so the wrapper runs eagerly with a warning saying so."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = _mlp()
        eager = copy.deepcopy(model)
        wrapped = ORTModule(model, frontend="torchscript")
        fully_shard(wrapped)
        x = torch.randn(4, 16)
        with pytest.warns(UserWarning, match="needs the torch.export front end"):
            out = wrapped(x)
        assert_close(out, eager(x), 1e-6, "output")
        assert wrapped.stats.fallbacks == 1
    finally:
        dist.destroy_process_group()
