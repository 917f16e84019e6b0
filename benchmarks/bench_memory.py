"""Peak memory and step time per recompute level (NOTE [recompute]), each mode in its own process.

    python benchmarks/bench_memory.py [--model bert,gpt2] [--batch 64] [--steps 4] [--budget-mb 3000]

Modes: eager PyTorch, ORTModule level 0 (default), level 1 (layerwise recompute). Per run: build the
model (BERT 4 layers hidden 256 seq 128; GPT-2 2 layers, n_embd 128, seq 64; dropout as configured),
AdamW steps at batch 2 and 3 (compile the graphs; allocate the optimizer state), then RSS is the
baseline and the kernel's peak-RSS counter is reset (/proc/self/clear_refs); then ``--steps`` AdamW
steps at ``--batch``. Activation memory = peak RSS - baseline. With ``--budget-mb`` it also finds
the largest batch (doubling from 16, then bisection to 8) whose whole-process peak RSS stays
within the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("eager", "level0", "level1")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _model(name: str, batch: int):
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=1024, max_position_embeddings=128, num_labels=2)
        model = transformers.BertForSequenceClassification(cfg)
        seq = 128

        def batch_of(b):
            return {"input_ids": torch.randint(0, cfg.vocab_size, (b, seq), generator=g),
                    "attention_mask": torch.ones(b, seq, dtype=torch.long),
                    "labels": torch.randint(0, 2, (b,), generator=g)}
    else:
        cfg = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=64)
        model = transformers.GPT2LMHeadModel(cfg)
        seq = 64

        def batch_of(b):
            ids = torch.randint(0, cfg.vocab_size, (b, seq), generator=g)
            return {"input_ids": ids, "labels": ids}
    return model, batch_of


def child(name: str, mode: str, batch: int, steps: int) -> None:
    import torch

    sys.path.insert(0, str(HERE.parent))
    from ortmodule import ORTModule

    model, batch_of = _model(name, batch)
    if mode != "eager":
        model = ORTModule(model, memory_opt_level=int(mode[-1]), fallback="raise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(2)
    # Two small batches: the first gets a static graph, the second the symbolic one that serves the
    # measured batch (NOTE [static first]), so that the measured steps export nothing.
    for warm in (batch_of(2), batch_of(3)):
        model(**warm).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    data = [batch_of(batch) for _ in range(steps)]
    baseline = _rss_mb()
    reset = _reset_peak()
    times, losses = [], []
    for b in data:
        t0 = time.perf_counter()
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step_s = statistics.median(times[1:] or times)
    exports = getattr(getattr(model, "stats", None), "exports", None)
    print(json.dumps(dict(baseline_mb=baseline, peak_mb=_peak_mb(), reset=reset, step_s=step_s, losses=losses,
                          exports=exports)))


def run(name: str, mode: str, batch: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", name, mode, str(batch), str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(f"{name}/{mode}/batch {batch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def largest_batch(name: str, mode: str, budget_mb: float, steps: int = 2, limit: int = 1024,
                  resolution: int = 8) -> int | None:
    """Doubling from 16 until the peak RSS exceeds the budget, then bisection to ``resolution``."""
    fits = lambda b: run(name, mode, b, steps)["peak_mb"] <= budget_mb  # noqa: E731
    best, batch = None, 16
    while batch <= limit and fits(batch):
        best, batch = batch, batch * 2
    if best is None or batch > limit:
        return best
    low, high = best, batch  # low fits, high does not
    while high - low > resolution:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert,gpt2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--budget-mb", type=float, default=None)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        name, mode, batch, steps = args.child
        child(name, mode, int(batch), int(steps))
        return 0
    modes = args.modes.split(",")
    print(f"batch {args.batch}, {args.steps} AdamW steps; activation memory = peak RSS - RSS after the model, the "
          "optimizer state and the compiled graphs\n")
    print("| model | mode | peak RSS | activations | vs level 0 | step time | vs level 0 | losses |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.model.split(","):
        res = {m: run(name, m, args.batch, args.steps) for m in modes}
        ref = res.get("level0")
        for m, r in res.items():
            act = r["peak_mb"] - r["baseline_mb"]
            rel = ""
            trel = ""
            if ref is not None and m != "level0":
                rel = f"{100 * (act / (ref['peak_mb'] - ref['baseline_mb']) - 1):+.0f}%"
                trel = f"{100 * (r['step_s'] / ref['step_s'] - 1):+.0f}%"
            losses = " ".join(f"{x:.5f}" for x in r["losses"])
            print(f"| {name} | {m} | {r['peak_mb']:.0f} MB | {act:.0f} MB | {rel} | {r['step_s']:.3f} s | {trel} | "
                  f"{losses} |")
        if args.budget_mb:
            for m in modes:
                print(f"| {name} | {m} | largest batch within {args.budget_mb:.0f} MB: "
                      f"{largest_batch(name, m, args.budget_mb)} | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
