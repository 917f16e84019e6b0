"""What verification mode (``verify=True``) adds to the first call of a new graph.

    python benchmarks/verify_cost.py            # MLP, CNN (BatchNorm + dropout), small HF BERT
    python benchmarks/verify_cost.py --reps 5

For each model, a fresh ORTModule makes its first training call (export, gradient graphs, sessions,
one forward) with and without ``verify=True``; the table gives the median seconds of that call, the
part ``Stats.verify_s`` accounts for (eager forward + two autograd.grad + compare) and the overhead.
Later calls of the same signature cost nothing extra (verification runs once per compiled graph).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from ortmodule import ORTModule


def mlp():
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    return model, ((torch.randn(64, 256),), {})


def cnn():
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.3), nn.Linear(64 * 16 * 16, 10),
    )
    return model, ((torch.randn(16, 3, 32, 32),), {})


def bert():
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = transformers.BertConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512, max_position_embeddings=128, num_labels=3,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    model = transformers.BertForSequenceClassification(cfg)
    batch = {"input_ids": torch.randint(0, 1000, (8, 64)), "attention_mask": torch.ones(8, 64, dtype=torch.long),
             "labels": torch.randint(0, 3, (8,))}
    return model, ((), batch)


def first_call(factory, verify: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    model, (args, kwargs) = factory()
    wrapped = ORTModule(model.train(), verify=verify)
    t0 = time.perf_counter()
    wrapped(*args, **kwargs)
    dt = time.perf_counter() - t0
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason
    assert wrapped.stats.verifications == int(verify)
    return dt, wrapped.stats.verify_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    opts = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {opts.reps}")
    print("| model | first call (s) | first call, verify=True (s) | of which verify_s | overhead |")
    print("|---|---:|---:|---:|---:|")
    for name, factory in (("MLP", mlp), ("CNN BN+dropout", cnn), ("BERT 2x128", bert)):
        first_call(factory, True)  # warm-up: imports, lazy inits, allocator
        plain_runs, runs = [], []
        for _ in range(opts.reps):  # interleaved, so that machine noise hits both alike
            plain_runs.append(first_call(factory, False)[0])
            runs.append(first_call(factory, True))
        plain = statistics.median(plain_runs)
        verified = statistics.median(r[0] for r in runs)
        vs = statistics.median(r[1] for r in runs)
        print(f"| {name} | {plain:.3f} | {verified:.3f} | {vs:.3f} | {100 * (verified - plain) / plain:+.0f}% |")


if __name__ == "__main__":
    main()
