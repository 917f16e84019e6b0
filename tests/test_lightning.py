"""PyTorch Lightning: a LightningModule whose network is an ORTModule trains like the same
LightningModule without it, on 1 CPU process and on 2 with the ddp strategy (tests/lightning_worker.py,
each run in its own process: Lightning's ddp launcher starts rank 1 by running the script again)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from ortmodule import ORTModule  # noqa: E402

from .helpers import assert_close  # noqa: E402

pytestmark = pytest.mark.processes  # each run starts its own processes: a CI step of its own

WORKER = Path(__file__).with_name("lightning_worker.py")
ROOT = WORKER.parent.parent


def _run(out: Path, devices: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out), "--devices", str(devices)], env=env,
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]


@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_trainer_with_an_ortmodule_network_matches_the_plain_run(tmp_path, devices):
    _run(tmp_path, devices)
    results = []
    for rank in range(devices):
        ort = torch.load(tmp_path / f"ort_rank{rank}.pt")
        eager = torch.load(tmp_path / f"eager_rank{rank}.pt")
        assert ort["exports"] == 1 and ort["fallbacks"] == 0
        assert len(ort["losses"]) == len(eager["losses"]) == 6
        for step, (a, b) in enumerate(zip(ort["losses"], eager["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} loss at step {step}: {a} != {b}"
        assert sorted(ort["params"]) == sorted(eager["params"])
        for name, t in eager["params"].items():
            assert_close(ort["params"][name], t, 1e-5, f"rank {rank} {name}")
        results.append(ort)
    for name, t in results[0]["params"].items():  # DDP keeps the ranks in step
        assert all(torch.equal(r["params"][name], t) for r in results[1:]), name


def test_lightning_checkpoint_loads_with_and_without_the_wrapper(tmp_path):
    from . import lightning_worker as W

    _run(tmp_path, 1)
    ckpt = torch.load(tmp_path / "ort.ckpt", weights_only=False)
    trained = torch.load(tmp_path / "ort_rank0.pt")["params"]
    assert all(k.startswith("net.") and "_original_module" not in k for k in ckpt["state_dict"])
    for net in (W.make_net(), ORTModule(W.make_net())):
        model = W.Classifier(net)
        model.load_state_dict(ckpt["state_dict"])
        for name, p in model.net.named_parameters():
            assert torch.equal(p.detach(), trained[name]), name
