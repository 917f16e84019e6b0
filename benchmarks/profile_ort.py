"""Where ORTModule's time goes: ONNX Runtime's profiler, summed per session and op type.

    python benchmarks/profile_ort.py cnn               # a built-in model of bench_train.py
    python benchmarks/profile_ort.py bert --steps 3 --top 25
    python benchmarks/profile_ort.py my_module:factory # a plugin model (see bench_train.py)
    python benchmarks/profile_ort.py gpt2 --ops Mul,Exp # list only these op types' nodes

Runs ``--warmup`` full training steps, then ``--steps`` profiled forward+loss+backward steps, and
prints, per session (forward / backward), the time per op type and the most expensive nodes, as
Markdown tables (milliseconds per step).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train  # noqa: E402


def _summarise(path: str, steps: int, top: int, ops: set[str] | None = None) -> str:
    events = json.load(open(path))
    by_type: dict[str, float] = collections.Counter()
    by_node: dict[tuple[str, str], float] = collections.Counter()
    runs = [e["dur"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        op = e.get("args", {}).get("op_name", "?")
        by_type[op] += e["dur"]
        by_node[(e["name"][: -len("_kernel_time")], op)] += e["dur"]
    if not runs:
        return ""  # a session that never ran (the full backward when an output grad is always None)
    total_nodes = sum(by_type.values()) / 1e3 / max(len(runs), 1)
    lines = [f"model_run: {len(runs)} runs, median {sorted(runs)[len(runs) // 2] / 1e3:.2f} ms; "
             f"kernels {total_nodes:.2f} ms per run", "", "| op type | ms/run | share |", "|---|---|---|"]
    total = sum(by_type.values()) or 1.0
    for op, dur in sorted(by_type.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {op} | {dur / 1e3 / len(runs):.2f} | {dur / total:.0%} |")
    lines += ["", "| node | op | ms/run |", "|---|---|---|"]
    nodes = [kv for kv in sorted(by_node.items(), key=lambda kv: -kv[1]) if not ops or kv[0][1] in ops]
    for (node, op), dur in nodes[:top]:
        lines.append(f"| {node[-70:]} | {op} | {dur / 1e3 / len(runs):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ops", default="", help="comma-separated op types: list only these nodes")
    ap.add_argument("--quick", action="store_true", help="the tiny shapes of bench_train.py --quick")
    args = ap.parse_args()

    if not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
        os.environ["GOMP_SPINCOUNT"] = "10000"  # what importing ortmodule first does: NOTE [threads]
    import psutil
    import torch

    from ortmodule import DebugOptions, ORTModule

    torch.set_num_threads(args.threads or psutil.cpu_count(logical=False) or 1)
    torch.manual_seed(0)
    model, make_batch, loss_fn = bench_train.build_model(args.model, quick=args.quick)
    model.train()
    plain = ORTModule(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(args.warmup):  # warm up without the profiler: first-call work stays out
        inputs, target = make_batch()
        opt.zero_grad(set_to_none=True)
        loss_fn(bench_train._call(plain, inputs), target).backward()
        opt.step()

    with tempfile.TemporaryDirectory() as tmp:
        prof = ORTModule(model, debug=DebugOptions(profile_prefix=os.path.join(tmp, "ort")))
        for _ in range(args.steps + 1):  # one extra: the session's first run is not representative
            inputs, target = make_batch()
            opt.zero_grad(set_to_none=True)
            loss_fn(bench_train._call(prof, inputs), target).backward()
        files = prof.end_profiling()
        # forward, full backward, backward for absent output grads; a graph with torch nodes has a
        # session per ORT segment (NOTE [segments]), in order
        for k, path in enumerate(files):
            summary = _summarise(path, args.steps, args.top, set(filter(None, args.ops.split(","))))
            if summary:
                print(f"## {args.model}: {'forward' if k == 0 else 'backward'} session ({Path(path).name})\n")
                print(summary)
                print()


if __name__ == "__main__":
    main()
