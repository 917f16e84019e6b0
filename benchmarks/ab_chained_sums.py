"""A/B of the chained leading-axis sums (NOTE [chained sums]): two ORTModules of one HF model, built in
one process with and without ``split_leading_sums`` among the backward passes and timed interleaved
(fwd + loss + bwd), so that the host's drift hits both alike; prints the medians and how far each
one's gradients are from float64 eager's.

    python benchmarks/ab_chained_sums.py --model bert --batch 16
    python benchmarks/ab_chained_sums.py --model gpt2 --batch 32 --reps 15
"""

from __future__ import annotations  # noqa: I001  (ortmodule before torch: NOTE [threads])

import argparse
import copy
import statistics
import time

import ortmodule  # noqa: F401  (before torch: NOTE [threads])
import torch
import transformers

from ortmodule import ORTModule
from ortmodule.passes import backward as backward_passes
from ortmodule.runtime import entry


def _model(name: str, batch: int):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    t = transformers
    if name == "bert":
        model = t.BertForSequenceClassification(t.BertConfig(
            vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
            num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        return model, dict(input_ids=torch.randint(0, 30522, (batch, 128)), labels=torch.randint(0, 2, (batch,)))
    model = t.GPT2LMHeadModel(t.GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=128, use_cache=False,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 50257, (batch, 64))
    return model, dict(input_ids=ids, labels=ids)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert", choices=["bert", "gpt2"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    base, batch = _model(args.model, args.batch)
    reference = copy.deepcopy(base).double()
    reference(**batch).loss.backward()

    def without_chains(model):
        return backward_passes.fold_label_grad(model) + backward_passes.lower_sums(model)

    chained = entry.run_backward_passes
    wrapped = {}
    for label, passes in (("one ReduceSum", without_chains), ("chained", chained)):
        entry.run_backward_passes = passes  # read when the entry's backward session is made
        try:
            m = ORTModule(copy.deepcopy(base))
            m(**batch).loss.backward()
        finally:
            entry.run_backward_passes = chained
        wrapped[label] = m
    times: dict[str, list[float]] = {label: [] for label in wrapped}
    for rep in range(args.reps):
        order = list(wrapped.items()) if rep % 2 == 0 else list(reversed(wrapped.items()))
        for label, m in order:
            m.zero_grad()
            t0 = time.perf_counter()
            m(**batch).loss.backward()
            times[label].append(time.perf_counter() - t0)
    print(f"| {args.model} batch {args.batch} | fwd+bwd median ms | min ms | worst LayerNorm weight grad vs float64 |")
    print("|---|---|---|---|")
    for label, m in wrapped.items():
        ts = times[label][2:]
        worst = max(float((p.grad.double() - r.grad).norm() / r.grad.norm())
                    for (n, p), (_, r) in zip(m.named_parameters(), reference.named_parameters())
                    if "LayerNorm.weight" in n or "ln_" in n and n.endswith("weight"))
        print(f"| {label} | {1e3 * statistics.median(ts):.1f} | {1e3 * min(ts):.1f} | {worst:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
