"""PyTorch Lightning: the LightningModule's network is an ORTModule; the Trainer does the rest.

One line changes: ``self.net = ORTModule(net)``. The run trains a small classifier on scikit-learn's
bundled 8x8 digits (no download), evaluates it, and compares with the same Trainer run without
ORTModule (same seed, same batches).

Run:  python examples/lightning_train.py [--devices 2]   (2 devices: the ddp strategy on CPU)
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ortmodule import ORTModule

SEED, EPOCHS, BATCH, LR = 0, 5, 32, 3e-3


class DigitClassifier(L.LightningModule):
    def __init__(self, use_ort: bool) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
        self.net = ORTModule(net) if use_ort else net  # <- the one line

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def data():
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=SEED, stratify=y)
    scaler = StandardScaler().fit(x_train)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    return TensorDataset(as_x(x_train), torch.tensor(y_train)), (as_x(x_test), torch.tensor(y_test))


def run(use_ort: bool, devices: int):
    train, (x_test, y_test) = data()
    model = DigitClassifier(use_ort)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                        max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False)
    start = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=BATCH, shuffle=False))
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    return trainer, model, seconds, acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    trainer, ort_model, ort_s, ort_acc = run(True, args.devices)
    _, eager_model, eager_s, eager_acc = run(False, args.devices)
    diff = max((a - b).abs().max().item()
               for a, b in zip(ort_model.net.parameters(), eager_model.net.parameters()))
    if trainer.global_rank == 0:
        print(f"{args.devices} device(s), {EPOCHS} epochs: ORTModule {ort_s:.1f} s, test accuracy {ort_acc:.3f}; "
              f"eager {eager_s:.1f} s, test accuracy {eager_acc:.3f}; largest weight difference {diff:.2e}; "
              f"ORTModule stats: exports={ort_model.net.stats.exports}, fallbacks={ort_model.net.stats.fallbacks}")


if __name__ == "__main__":
    main()
