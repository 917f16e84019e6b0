"""Training speed of the transformers architectures of ``hf_zoo.py`` at working sizes, against eager.

``hf_zoo.py`` checks that each architecture trains in ONNX Runtime at toy sizes; this script asks
whether it is faster than eager PyTorch as users run it: torch imported first, models built from
configs (no downloads) at hidden 256, 4 layers, 4 heads, FFN 1024, sequence 128 (ViT: 64 patches;
ConvNeXt: 4 stages of 32-256 channels on 64x64 images), batch 8, dropout as configured, fp32, AdamW.
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

MODELS = ("bert-cls", "roberta-mlm", "distilbert-qa", "gpt2-lm", "llama-lm", "mistral-lm", "qwen2-lm",
          "gptneox-lm", "phi-lm", "t5", "vit-cls", "convnext-cls")


def build(name: str, quick: bool):
    """(model, batch) for ``name``: working sizes, or tiny ones with ``quick``."""
    import torch
    import transformers as T

    T.logging.set_verbosity_error()
    h, layers, heads, ffn, seq, batch, vocab = (32, 1, 2, 64, 16, 2, 96) if quick else (256, 4, 4, 1024, 128, 8,
                                                                                         8192)
    enc = dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn)
    dec = dict(vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
               num_attention_heads=heads, use_cache=False, max_position_embeddings=max(seq, 128))
    gqa = dict(dec, num_key_value_heads=max(1, heads // 2))
    image = 32 if quick else 64
    factories = {
        "bert-cls": lambda: T.BertForSequenceClassification(T.BertConfig(vocab_size=vocab, num_labels=3, **enc)),
        "roberta-mlm": lambda: T.RobertaForMaskedLM(T.RobertaConfig(
            vocab_size=vocab, max_position_embeddings=seq + 2, pad_token_id=1, **enc)),
        "distilbert-qa": lambda: T.DistilBertForQuestionAnswering(T.DistilBertConfig(
            vocab_size=vocab, dim=h, n_layers=layers, n_heads=heads, hidden_dim=ffn)),
        "gpt2-lm": lambda: T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_positions=seq, use_cache=False)),
        "llama-lm": lambda: T.LlamaForCausalLM(T.LlamaConfig(**gqa)),
        "mistral-lm": lambda: T.MistralForCausalLM(T.MistralConfig(sliding_window=seq // 2, **gqa)),
        "qwen2-lm": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**gqa)),
        "gptneox-lm": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**dec)),
        "phi-lm": lambda: T.PhiForCausalLM(T.PhiConfig(**dec)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=vocab, d_model=h, d_ff=ffn, num_layers=layers, num_heads=heads, d_kv=h // heads,
            use_cache=False, decoder_start_token_id=0, pad_token_id=0)),
        "vit-cls": lambda: T.ViTForImageClassification(T.ViTConfig(
            image_size=image, patch_size=8, num_labels=3, **enc)),
        "convnext-cls": lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
            hidden_sizes=[8, 16] if quick else [32, 64, 128, 256], depths=[1, 1] if quick else [2, 2, 2, 2],
            num_stages=2 if quick else 4, num_labels=3, image_size=image)),
    }
    torch.manual_seed(0)
    model = factories[name]().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels3 = torch.randint(0, 3, (batch,), generator=g)
    if name == "bert-cls":
        data = dict(input_ids=ids, labels=labels3)
    elif name == "distilbert-qa":
        data = dict(input_ids=ids, start_positions=torch.randint(0, seq, (batch,), generator=g),
                    end_positions=torch.randint(0, seq, (batch,), generator=g))
    elif name == "t5":
        data = dict(input_ids=ids, labels=ids[:, : seq // 2].contiguous())
    elif name in ("vit-cls", "convnext-cls"):
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
