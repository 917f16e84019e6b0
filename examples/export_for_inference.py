"""Train with ORTModule, then export the trained model for deployment and serve it with plain
onnxruntime (no torch needed at inference time).

A small CNN with BatchNorm learns scikit-learn's bundled 8x8 digits (no download). ``export_onnx``
writes the EVAL-mode graph (BatchNorm on its running statistics, Dropout off) with the trained
weights as initializers and a dynamic batch axis; ``optimized_path`` also keeps ONNX Runtime's
optimised graph. The example checks the files against eager PyTorch at two batch sizes.

Run:  python examples/export_for_inference.py [--out exported/]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

from ortmodule import ORTModule

SEED, EPOCHS, BATCH, LR = 0, 8, 64, 3e-3


def load_data():
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(x, torch.tensor(y), test_size=0.25, random_state=SEED)
    return x_train, y_train, x_test, y_test


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, 10),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="exported")
    args = ap.parse_args()
    out = Path(args.out)
    x, y, x_test, y_test = load_data()

    model = make_model()
    wrapped = ORTModule(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    shuffle = torch.Generator().manual_seed(SEED)
    bar = tqdm(range(EPOCHS), desc="train (ORTModule)", unit="epoch")
    for _ in bar:
        order = torch.randperm(len(x), generator=shuffle)
        for i in range(0, len(x) - BATCH + 1, BATCH):  # full batches only: one compiled shape
            idx = order[i : i + BATCH]
            loss = F.cross_entropy(wrapped(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")

    # Export: eval-mode graph, trained weights as initializers, dynamic batch axis ("auto").
    path = wrapped.export_onnx(out / "digits_cnn.onnx", x_test[:4], optimized_path=out / "digits_cnn.opt.onnx")
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB) and {out / 'digits_cnn.opt.onnx'}")
    assert wrapped.training, "the wrapper keeps its train/eval state"

    # Serve with onnxruntime alone and compare with eager PyTorch in eval mode.
    model.eval()
    for file in (path, out / "digits_cnn.opt.onnx"):
        sess = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        for batch in (1, len(x_test)):
            got = sess.run(None, {name: x_test[:batch].numpy()})[0]
            with torch.no_grad():
                want = model(x_test[:batch]).numpy()
            err = np.abs(got - want).max()
            print(f"  {file.name:>20}, batch {batch:>3}: max |onnxruntime - torch eval| = {err:.2e}")
            assert err < 1e-4
        t0 = time.perf_counter()
        logits = sess.run(None, {name: x_test.numpy()})[0]
        ms = (time.perf_counter() - t0) * 1e3
        acc = float((logits.argmax(1) == y_test.numpy()).mean())
        print(f"  {file.name:>20}: test accuracy {acc:.3f}, {len(x_test)} images in {ms:.1f} ms")


if __name__ == "__main__":
    main()
