"""A/B of the ATen backward kernels (NOTE [ATen kernels]): eager and one ORTModule per
ORTMODULE_ATEN_KERNELS setting, built in one process and timed interleaved (fwd + loss + bwd), so that
the host's drift hits every column alike. Prints a table.

    python benchmarks/ab_kernels.py --model cnn --settings 0,1 --reps 60
    python benchmarks/ab_kernels.py --model bert --settings 0,Conv,1 --reps 10
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import ortmodule  # noqa: F401  (before torch: NOTE [threads])

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402

from ortmodule import ORTModule  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=["mlp", "cnn", "bert", "gpt2"])
    parser.add_argument("--settings", default="0,1", help="ORTMODULE_ATEN_KERNELS values, comma separated")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    model, data, loss_fn = getattr(bench_train, f"_{args.model}")(False)
    inputs = data()

    def step(m) -> None:
        x, y = inputs
        loss = loss_fn(m(**x), y) if isinstance(x, dict) else loss_fn(m(x), y)
        loss.backward()

    runs = {"eager": model}
    for setting in args.settings.split(","):
        os.environ["ORTMODULE_ATEN_KERNELS"] = setting.replace("+", ",")
        wrapped = ORTModule(copy.deepcopy(model))
        step(wrapped)  # builds the graphs with this setting
        runs[f"ortmodule kernels={setting}"] = wrapped
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.reps):
        for name, m in runs.items():
            m.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(m)
            times[name].append((time.perf_counter() - t0) * 1e3)
    print(f"| {args.model} | fwd+loss+bwd median ms | min ms | vs eager (median) |")
    print("|---|---|---|---|")
    base = statistics.median(times["eager"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {min(ts):.2f} | {base / med:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
