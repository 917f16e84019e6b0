"""A/B of NOTE [sunk nodes] (runtime/segments.py): ORTModules of one HF model whose GELU is a custom
``autograd.Function`` (a torch node per layer, so the graphs run as segments), built in one process
with ORT nodes placed in the first segment that can run them ("first possible") and in the first that
reads them ("sunk"), timed interleaved with eager (order rotated each rep), fwd + loss + bwd.

    python benchmarks/ab_sunk_nodes.py --model bert-cls --reps 24
    python benchmarks/ab_sunk_nodes.py --model gpt2-lm
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_zoo.py: the models


class _Gelu(torch.autograd.Function):
    """The erf GELU with a hand-written backward, as users write custom Functions."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.gelu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        return g * (cdf + x * pdf)


class GeluFunction(torch.nn.Module):
    def forward(self, x):
        return _Gelu.apply(x)


def main(argv=None) -> int:
    import bench_zoo

    from ortmodule import ORTModule
    from ortmodule.runtime import segments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-cls", choices=["bert-cls", "gpt2-lm"])
    parser.add_argument("--reps", type=int, default=24)
    args = parser.parse_args(argv)
    model, data = bench_zoo.build(args.model, False)
    for mod in model.modules():  # BERT's intermediate activation, GPT-2's MLP activation
        for attr in ("intermediate_act_fn", "act"):
            if isinstance(getattr(mod, attr, None), torch.nn.Module):
                setattr(mod, attr, GeluFunction())

    sink = segments._sink
    mods: dict[str, torch.nn.Module] = {}
    for label, placement in (("first possible", lambda nodes, phases: phases), ("sunk", sink)):
        segments._sink = placement  # read when the segments are planned (first forward and backward)
        try:
            m = ORTModule(copy.deepcopy(model))
            for _ in range(2):
                m(**data).loss.backward()
        finally:
            segments._sink = sink
        assert m.stats.fallbacks == 0, "the model fell back: nothing to compare"
        mods[label] = m
    mods["eager"] = copy.deepcopy(model)
    times: dict[str, list[float]] = {label: [] for label in mods}
    labels = list(mods)
    for rep in range(args.reps):
        k = rep % len(labels)
        for label in labels[k:] + labels[:k]:
            m = mods[label]
            m.zero_grad()
            t0 = time.perf_counter()
            m(**data).loss.backward()
            times[label].append(time.perf_counter() - t0)
    eager = statistics.median(times["eager"])
    print(f"| {args.model}, custom-Function GELU | fwd+bwd median ms | min ms | vs eager |")
    print("|---|---|---|---|")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"| {label} | {1e3 * med:.1f} | {1e3 * min(ts):.1f} | {eager / med:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
