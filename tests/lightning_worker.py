"""Worker for tests/test_lightning.py: a LightningModule whose network is an ORTModule, trained by
``lightning.Trainer`` (CPU; ``--devices 2`` uses the ddp strategy, whose launcher starts rank 1 by
running this script again), and the same run with the plain network.

    python tests/lightning_worker.py --out DIR [--devices 1|2]

Writes ``DIR/<ort|eager>_rank<r>.pt``: the per-step training losses, the final parameters and the
wrapper's stats; with one device also a Lightning checkpoint of the ORT run (``ort.ckpt``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ortmodule import ORTModule  # noqa: E402

STEPS, BATCH = 6, 16


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 5))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = STEPS * BATCH * 2
    return TensorDataset(torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g))


class Classifier(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(net: nn.Module, devices: int, ckpt: str | None = None) -> Classifier:
    model = Classifier(net)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    trainer.fit(model, DataLoader(make_data(), batch_size=BATCH, shuffle=False))
    if ckpt:
        trainer.save_checkpoint(ckpt)
    model.rank = trainer.global_rank
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in ("ort", "eager"):
        net = make_net()
        if name == "ort":
            net = ORTModule(net, fallback="raise")
        ckpt = os.path.join(args.out, "ort.ckpt") if name == "ort" and args.devices == 1 else None
        model = fit(net, args.devices, ckpt)
        stats = net.stats if isinstance(net, ORTModule) else None
        torch.save({"losses": model.losses, "params": {n: p.detach().clone() for n, p in model.net.named_parameters()},
                    "exports": None if stats is None else stats.exports,
                    "fallbacks": None if stats is None else stats.fallbacks},
                   os.path.join(args.out, f"{name}_rank{model.rank}.pt"))


if __name__ == "__main__":
    main()
