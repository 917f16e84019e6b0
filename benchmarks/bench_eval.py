"""Evaluation-mode forward (``model.eval()`` under ``torch.no_grad()``): eager PyTorch against ORTModule.

    python benchmarks/bench_eval.py                    # the four models of bench_train.py
    python benchmarks/bench_eval.py --model bert --reps 9
    python benchmarks/bench_eval.py --quick            # tiny shapes (CI smoke; no speed claims)

ORTModule runs the no-grad inference graph (row-pruned: NOTE [rows nobody reads]). Both modes run in
this one process, interleaved rep by rep; ortmodule is imported before torch, so torch runs with the
short OpenMP spin ortmodule sets (NOTE [threads]) in both. Prints a Markdown table of the median and
min forward time, the first ORTModule call and the largest output difference against eager.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import ortmodule  # noqa: F401  (first: sets the OpenMP spin before torch starts its workers)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train  # noqa: E402
import torch  # noqa: E402


def _call(model, batch):
    inputs, _ = batch
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _time(model, batch, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        _call(model, batch)
        times.append(time.perf_counter() - t0)
    return times


def bench(name: str, quick: bool, reps: int, inner: int) -> dict:
    model, data, _ = bench_train.build_model(name, quick)
    model.eval()
    batch = data()
    wrapped = ortmodule.ORTModule(model)
    with torch.no_grad():
        t0 = time.perf_counter()
        got = _tensors(_call(wrapped, batch))
        first = time.perf_counter() - t0
        want = _tensors(_call(model, batch))
        diff = max(((g.double() - w.double()).abs().max().item() for g, w in zip(got, want)
                    if g.is_floating_point()), default=0.0)
        times = {"eager": [], "ortmodule": []}
        for m in (model, wrapped):
            _time(m, batch, 2)  # warm-up
        for _ in range(reps):  # interleaved: machine noise hits both modes alike
            times["eager"] += _time(model, batch, inner)
            times["ortmodule"] += _time(wrapped, batch, inner)
    row = {mode: (statistics.median(ts) * 1e3, min(ts) * 1e3) for mode, ts in times.items()}
    return {"model": name, "first_call_s": first, "max_abs_diff": diff, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None,
                    help="built-in (mlp, cnn, bert, gpt2) or pkg.mod:factory as in bench_train.py; repeatable")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--inner", type=int, default=None, help="timed calls of each mode per rep")
    args = ap.parse_args()
    names = args.model or list(bench_train.BUILDERS)
    reps = args.reps or (2 if args.quick else 7)
    inner = args.inner or (2 if args.quick else 5)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {reps} reps x {inner} calls per mode\n")
    print("| model | eager median / min ms | ORTModule median / min ms | speedup (median) "
          "| ORTModule first call s | max abs diff |")
    print("|---|---|---|---|---|---|")
    for name in names:
        r = bench(name, args.quick, reps, inner)
        (em, emin), (om, omin) = r["eager"], r["ortmodule"]
        print(f"| {name} | {em:.2f} / {emin:.2f} | {om:.2f} / {omin:.2f} | {em / om:.2f}x "
              f"| {r['first_call_s']:.2f} | {r['max_abs_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
