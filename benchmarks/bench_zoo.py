"""Training speed of the transformers architectures of ``hf_zoo.py`` at working sizes, against eager.

``hf_zoo.py`` checks that each architecture trains in ONNX Runtime at toy sizes; this script asks
whether it is faster than eager PyTorch as users run it: torch imported first, models built from
configs (no downloads) at hidden 256, 4 layers, 4 heads, FFN 1024, sequence 128 (ViT: 64 patches;
ConvNeXt: 4 stages of 32-256 channels on 64x64 images; Mixtral / Qwen2-MoE: 4 experts, top-2), batch 8,
dropout as configured, fp32, AdamW.
Per model, one process runs eager and ORTModule on the same module, interleaved rep by rep (so a
noisy host slows both), and times forward + loss + backward and the full step with AdamW.

    python benchmarks/bench_zoo.py                      # every model
    python benchmarks/bench_zoo.py llama-lm vit-cls --reps 7
    python benchmarks/bench_zoo.py --quick              # tiny sizes (CI smoke; no speed claims)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_zoo.py: the models

MODELS = ("bert-cls", "roberta-mlm", "distilbert-qa", "gpt2-lm", "llama-lm", "mistral-lm", "qwen2-lm",
          "mixtral-lm", "qwen2moe-lm", "gptneox-lm", "phi-lm", "t5", "vit-cls", "convnext-cls")


def build(name: str, quick: bool):
    """(model, batch) for ``name``: working sizes, or tiny ones with ``quick``."""
    import torch
    from hf_zoo import factories  # beside this script; imports transformers and ortmodule, after torch

    h, layers, heads, ffn, seq, batch, vocab = (32, 1, 2, 64, 16, 2, 96) if quick else (256, 4, 4, 1024, 128, 8,
                                                                                         8192)
    image = 32 if quick else 64
    convnext = ((8, 16), (1, 1)) if quick else ((32, 64, 128, 256), (2, 2, 2, 2))
    make, kind = factories(h, layers, heads, dec_heads=heads, ffn=ffn, vocab=vocab, positions=max(seq, 128),
                           roberta_positions=seq + 2, gpt2_positions=seq, sliding_window=seq // 2, image=image,
                           convnext=convnext)[name]
    torch.manual_seed(0)
    model = make().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels3 = torch.randint(0, 3, (batch,), generator=g)
    if kind == "cls":
        data = dict(input_ids=ids, labels=labels3)
    elif kind == "qa":
        data = dict(input_ids=ids, start_positions=torch.randint(0, seq, (batch,), generator=g),
                    end_positions=torch.randint(0, seq, (batch,), generator=g))
    elif kind == "s2s":
        data = dict(input_ids=ids, labels=ids[:, : seq // 2].contiguous())
    elif kind == "img":
        data = dict(pixel_values=torch.randn(batch, 3, image, image, generator=g), labels=labels3)
    else:  # the LMs, as users call them for training: labels, no attention_mask
        data = dict(input_ids=ids, labels=ids)
    return model, data


def child(name: str, quick: bool, reps: int, inner: int) -> dict:
    import torch  # torch first, as users import it

    from ortmodule import ORTModule

    model, data = build(name, quick)
    wrapped = ORTModule(model)
    runs = {"eager": model, "ortmodule": wrapped}
    opts = {mode: torch.optim.AdamW(model.parameters(), lr=1e-4) for mode in runs}

    def fwd_bwd(m) -> float:
        t0 = time.perf_counter()
        m(**data).loss.backward()
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return dt

    def full(mode) -> float:
        t0 = time.perf_counter()
        runs[mode](**data).loss.backward()
        opts[mode].step()
        opts[mode].zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    fwd_bwd(wrapped)
    first = time.perf_counter() - t0
    for mode in runs:  # warm-up (eager's allocator, ORT's arena, AdamW state)
        for _ in range(2):
            full(mode)
    times = {mode: {"fwd_bwd": [], "full": []} for mode in runs}
    for _ in range(reps):
        for mode, m in runs.items():
            times[mode]["fwd_bwd"] += [fwd_bwd(m) for _ in range(inner)]
            times[mode]["full"] += [full(mode) for _ in range(inner)]
    s = wrapped.stats
    out = {"model": name, "first_call_s": first, "fallbacks": s.fallbacks,
           "fallback_reason": s.last_fallback_reason, "torch_nodes": getattr(s, "torch_nodes", None),
           "params": sum(p.numel() for p in model.parameters())}
    for mode, t in times.items():
        for kind, v in t.items():
            out[f"{mode}_{kind}_median_ms"] = statistics.median(v) * 1e3
            out[f"{mode}_{kind}_min_ms"] = min(v) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help=f"a subset of {list(MODELS)}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 rep (CI smoke; no speed claims)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=2, help="timed steps of each kind per rep")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps, inner = (1, 1) if args.quick else (args.reps, args.inner)
    if args.child:
        print(json.dumps(child(args.child, args.quick, reps, inner)))
        return
    names = args.models or list(MODELS)
    unknown = set(names) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    print("| model | params | eager fwd+bwd ms (median / min) | ORTModule fwd+bwd ms | speedup fwd+bwd "
          "| speedup full step (AdamW) | ORTModule first call s | runs in |")
    print("|---|---|---|---|---|---|---|---|")
    rows, speedups = [], []
    for name in names:
        cmd = [sys.executable, __file__, "--child", name, "--reps", str(reps), "--inner", str(inner)]
        proc = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"| {name} | | **failed**: {proc.stderr.strip().splitlines()[-1][:150] if proc.stderr else ''} "
                  "| | | | | |", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(r)
        sp = r["eager_fwd_bwd_median_ms"] / r["ortmodule_fwd_bwd_median_ms"]
        sp_full = r["eager_full_median_ms"] / r["ortmodule_full_median_ms"]
        speedups.append(sp)
        where = "ORT" if not r["fallbacks"] else f"falls back: {(r['fallback_reason'] or '')[:80]}"
        print(f"| {name} | {r['params'] / 1e6:.1f}M | {r['eager_fwd_bwd_median_ms']:.1f} / "
              f"{r['eager_fwd_bwd_min_ms']:.1f} | {r['ortmodule_fwd_bwd_median_ms']:.1f} / "
              f"{r['ortmodule_fwd_bwd_min_ms']:.1f} | {sp:.2f}x | {sp_full:.2f}x | {r['first_call_s']:.1f} "
              f"| {where} |", flush=True)
    if speedups:
        geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        print(f"\ngeo-mean speedup, fwd+bwd medians: {geo:.2f}x over {len(speedups)} models; "
              f"slower than eager: {sum(s < 1 for s in speedups)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
