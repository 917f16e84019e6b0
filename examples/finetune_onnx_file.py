"""Fine-tune an ONNX file with OnnxModule, then save it back as ONNX.

A scikit-learn MLPClassifier is trained briefly on the bundled digits data and converted with
skl2onnx; from then on only the .onnx file is used: OnnxModule loads it (its weights become
nn.Parameters), AdamW fine-tunes it with a torch loss, and save() writes an .onnx file that a plain
onnxruntime.InferenceSession runs, label output included.

    python examples/finetune_onnx_file.py [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from skl2onnx import to_onnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

from ortmodule import OnnxModule


def make_model_file(folder: Path) -> tuple[Path, tuple]:
    X, y = load_digits(return_X_y=True)
    X = (X / 16).astype(np.float32)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.25, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stopped early on purpose: leaves room to fine-tune
        clf = MLPClassifier(hidden_layer_sizes=(64,), max_iter=5, random_state=0).fit(X_tr, y_tr)
    # zipmap=False: probabilities as a tensor rather than a list of dicts
    model = to_onnx(clf, X_tr[:1], options={id(clf): {"zipmap": False}})
    path = folder / "digits_mlp.onnx"
    onnx.save_model(model, path)
    return path, (X_tr, X_te, y_tr, y_te)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the .onnx files (default: a temp dir)")
    parser.add_argument("--epochs", type=int, default=15)
    args = parser.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.out, args.epochs)
        return
    with tempfile.TemporaryDirectory(prefix="ortmodule_") as tmp:  # removed afterwards
        run(Path(tmp), args.epochs, keep=False)


def run(out: Path, epochs: int, keep: bool = True) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    path, (X_tr, X_te, y_tr, y_te) = make_model_file(out)

    model = OnnxModule(path, outputs=["probabilities"])  # the 'label' output needs no gradient
    print(f"loaded {path.name}: inputs {model.input_names}, outputs {model.output_names}")
    for name, p in model.named_parameters():
        print(f"  parameter {name:14s} <- initializer {model.onnx_names[name]!r:16s} {tuple(p.shape)}")

    x_tr, y_tr_t = torch.from_numpy(X_tr), torch.from_numpy(y_tr)
    x_te, y_te_t = torch.from_numpy(X_te), torch.from_numpy(y_te)

    def evaluate(x, y):
        with torch.no_grad():
            p = model(x)
            loss = torch.nn.functional.nll_loss(p.clamp_min(1e-7).log(), y).item()
            return loss, (p.argmax(1) == y).float().mean().item()

    before = evaluate(x_tr, y_tr_t), evaluate(x_te, y_te_t)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t0 = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(x_tr)).split(64):
            opt.zero_grad()
            probs = model(x_tr[idx])
            loss = torch.nn.functional.nll_loss(probs.clamp_min(1e-7).log(), y_tr_t[idx])
            loss.backward()
            opt.step()
    train_s = time.perf_counter() - t0
    after = evaluate(x_tr, y_tr_t), evaluate(x_te, y_te_t)

    print(f"\nfine-tuning: {epochs} epochs, AdamW, {train_s:.2f} s")
    print("              train loss  test loss  test acc")
    for label, ((tr_loss, _), (te_loss, te_acc)) in (("before", before), ("after", after)):
        print(f"{label:12s} {tr_loss:11.4f} {te_loss:10.4f} {te_acc:9.4f}")

    saved = out / "digits_mlp_finetuned.onnx"
    model.save(saved)
    session = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"])
    labels, probs = session.run(None, {"X": X_te})
    print(f"\nsaved {saved}; onnxruntime test accuracy of the saved file: {(labels == y_te).mean():.4f}")
    if not keep:
        print("(a temporary folder, removed at exit: pass --out DIR to keep the files)")


if __name__ == "__main__":
    main()
