"""First call of a model in a fresh process, with a cold and a warm persistent compile cache.

    python benchmarks/bench_cache.py [--model bert,gpt2] [--reps 3] [--frontend export|torchscript]

Each run is its own process: build the model (the bench_train.py configurations), wrap it with
``ORTModule(model, cache_dir=...)`` and time its first training call (forward + backward) and the
second one. "cold" starts from an empty folder, "warm" reuses the folder the cold run filled.
Prints a markdown table of medians (NOTE [persistent cache] in ortmodule/runtime/disk_cache.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(model_name: str, folder: str, frontend: str | None) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    import torch
    from bench_train import build_model

    from ortmodule import ORTModule

    torch.manual_seed(0)
    model, batch, loss_fn = build_model(model_name, False)
    om = ORTModule(model, cache_dir=folder, frontend=frontend)
    inputs, _ = batch()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        out = om(**inputs)
        loss_fn(out, None).backward()
        times.append(time.perf_counter() - t0)
    s = om.stats
    print(json.dumps(dict(first=times[0], second=times[1], export_s=s.export_s, build_s=s.gradient_build_s,
                          session_s=s.session_create_s, hits=s.disk_cache_hits, exports=s.exports,
                          loss=float(loss_fn(out, None)))))


def run(model_name: str, folder: str, frontend: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", model_name, folder]
    if frontend:
        cmd += ["--frontend", frontend]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert,gpt2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--frontend", default=None)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "FOLDER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child, args.frontend)
        return 0
    rows = []
    for name in args.model.split(","):
        cold, warm = [], []
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory(prefix="ortmodule-cache-") as folder:
                cold.append(run(name, folder, args.frontend))
                warm.append(run(name, folder, args.frontend))
        for w, c in zip(warm, cold):
            assert w["exports"] == 0 and w["hits"] >= 1, f"{name}: the warm run did not load its graphs: {w}"
            assert w["loss"] == c["loss"], f"{name}: the warm run's loss differs: {w['loss']} != {c['loss']}"
        med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
        rows.append((name, med(cold, "first"), med(warm, "first"), med(cold, "export_s"), med(warm, "second")))
    print(f"first training call (forward + backward) in a fresh process, median of {args.reps}\n")
    print("| model | cold cache | warm cache | warm / cold | cold: export | second call |")
    print("|---|---|---|---|---|---|")
    for name, c, w, e, second in rows:
        print(f"| {name} | {c:.2f} s | {w:.2f} s | {100 * w / c:.0f}% | {e:.2f} s | {second:.3f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
