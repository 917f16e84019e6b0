"""Quickstart: train the same MLP twice, with eager PyTorch and with ORTModule, and compare.

Data: scikit-learn's bundled 8x8 handwritten digits (1797 images, no download).
Run:  python examples/quickstart.py
"""

import copy
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from tqdm import tqdm

from ortmodule import ORTModule

SEED, EPOCHS, BATCH, LR = 0, 10, 64, 3e-3


def load_data():
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=SEED, stratify=y)
    scaler = StandardScaler().fit(x_train)  # fit on the training split only
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)
    as_y = lambda a: torch.tensor(a, dtype=torch.long)
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def train(model: nn.Module, x, y, name: str) -> tuple[float, float]:
    """Train for EPOCHS epochs with AdamW; return (final epoch's mean train loss, wall seconds)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    shuffle = torch.Generator().manual_seed(SEED)  # same batch order for both runs
    start = time.perf_counter()
    bar = tqdm(range(EPOCHS), desc=f"{name:>9}", unit="epoch")
    for _ in bar:
        order = torch.randperm(len(x), generator=shuffle)
        losses = []
        for i in range(0, len(x), BATCH):
            idx = order[i : i + BATCH]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        epoch_loss = sum(losses) / len(losses)
        bar.set_postfix(loss=f"{epoch_loss:.4f}")
    return epoch_loss, time.perf_counter() - start


@torch.no_grad()
def accuracy(model: nn.Module, x, y) -> float:
    model.eval()
    return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    # A model this small gains nothing from more threads, and on a busy machine extra threads slow
    # both runs down a lot. ORTModule's sessions follow torch's thread count.
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data()
    initial = make_model()

    results = {}
    eager = copy.deepcopy(initial)
    loss, secs = train(eager, x_train, y_train, "eager")
    results["eager"] = (accuracy(eager, x_test, y_test), loss, secs)

    ort = ORTModule(copy.deepcopy(initial))  # the same initial weights
    loss, secs = train(ort, x_train, y_train, "ORTModule")
    results["ORTModule"] = (accuracy(ort, x_test, y_test), loss, secs)

    print(f"\ndigits: {len(x_train)} train / {len(x_test)} test, {EPOCHS} epochs, batch {BATCH}, AdamW")
    print(f"{'':<10} {'test acc':>9} {'train loss':>11} {'wall s':>7}")
    for name, (acc, loss, secs) in results.items():
        print(f"{name:<10} {acc:>9.4f} {loss:>11.4f} {secs:>7.2f}")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    stats = ", ".join(f"{k}={fmt(v)}" for k, v in vars(ort.stats).items())
    print(f"\nORTModule stats: {stats}")


if __name__ == "__main__":
    main()
