"""Which transformers architectures train in ONNX Runtime, per front end, checked against eager.

Each model is built from a small config (no downloads), wrapped with ``ORTModule(verify=True)`` (the
first call of every graph also runs eager PyTorch and compares the loss and every gradient) and
trained two AdamW steps with the ordinary call (LMs: ``labels`` and no ``attention_mask``). Prints a
Markdown table: runs in ORT or falls back (with the reason), exports, verified graphs, wall time of
the two steps.

    python benchmarks/hf_zoo.py                      # both front ends, every model
    python benchmarks/hf_zoo.py --frontend export llama-lm t5
"""

import argparse
import time
import warnings

import torch
import transformers

from ortmodule import ORTModule

transformers.logging.set_verbosity_error()
V = 96
T = transformers


def factories(h=32, layers=2, heads=2, dec_heads=4, ffn=64, vocab=V, *, positions=None, roberta_positions=40,
              gpt2_positions=64, sliding_window=8, image=32, convnext=((8, 16), (1, 1))) -> dict:
    """name -> (model factory, batch kind), the models built from configs at these sizes (``bench_zoo.py``
    builds them at working sizes); the defaults are this script's toy sizes.

    ``heads``: the encoders', GPT-2's and T5's; ``dec_heads``: the other decoders' (the GQA ones get half as
    many key/value heads); ``positions``: the other decoders' max_position_embeddings (None: the config's);
    ``convnext``: its (hidden_sizes, depths), one entry per stage.
    """
    enc = dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn)
    dec = dict(vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
               num_attention_heads=dec_heads, use_cache=False)
    if positions is not None:
        dec["max_position_embeddings"] = positions
    gqa = dict(dec, num_key_value_heads=max(1, dec_heads // 2))
    hidden_sizes, depths = convnext
    return {
        "bert-cls": (lambda: T.BertForSequenceClassification(T.BertConfig(vocab_size=vocab, num_labels=3, **enc)),
                     "cls"),
        "roberta-mlm": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(
            vocab_size=vocab, max_position_embeddings=roberta_positions, pad_token_id=1, **enc)), "lm"),
        "distilbert-qa": (lambda: T.DistilBertForQuestionAnswering(T.DistilBertConfig(
            vocab_size=vocab, dim=h, n_layers=layers, n_heads=heads, hidden_dim=ffn)), "qa"),
        "gpt2-lm": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_positions=gpt2_positions, use_cache=False)),
                    "lm"),
        "llama-lm": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**gqa)), "lm"),
        "mistral-lm": (lambda: T.MistralForCausalLM(T.MistralConfig(sliding_window=sliding_window, **gqa)), "lm"),
        "qwen2-lm": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**gqa)), "lm"),
        # mixtures of experts: transformers' grouped matmul custom op runs as a torch node (NOTE [custom ops])
        "mixtral-lm": (lambda: T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                    **gqa)), "lm"),
        "qwen2moe-lm": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=max(4, ffn // 2),
            shared_expert_intermediate_size=ffn, **gqa)), "lm"),
        "gptneox-lm": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**dec)), "lm"),
        "phi-lm": (lambda: T.PhiForCausalLM(T.PhiConfig(**dec)), "lm"),
        "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=vocab, d_model=h, d_ff=ffn, num_layers=layers, num_heads=heads, d_kv=h // heads,
            use_cache=False, decoder_start_token_id=0, pad_token_id=0)), "s2s"),
        "vit-cls": (lambda: T.ViTForImageClassification(T.ViTConfig(
            image_size=image, patch_size=8, num_labels=3, **enc)), "img"),
        "convnext-cls": (lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
            hidden_sizes=list(hidden_sizes), depths=list(depths), num_stages=len(hidden_sizes), num_labels=3,
            image_size=image)), "img"),
    }


models = factories()


def batch_for(kind: str, g: torch.Generator) -> dict:
    """The toy batch of a batch kind (``bench_zoo.py`` draws its own, random labels and positions)."""
    ids = torch.randint(3, V, (2, 12), generator=g)
    if kind == "cls":
        return dict(input_ids=ids, labels=torch.tensor([0, 2]))
    if kind == "lm":
        return dict(input_ids=ids, labels=ids)
    if kind == "qa":
        return dict(input_ids=ids, start_positions=torch.tensor([1, 30]), end_positions=torch.tensor([3, 4]))
    if kind == "s2s":
        return dict(input_ids=ids, labels=ids[:, :7].contiguous())
    return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g), labels=torch.tensor([0, 2]))


def run(name: str, frontend: str) -> str:
    make, kind = models[name]
    torch.manual_seed(0)
    model = ORTModule(make(), verify=True, frontend=frontend)
    batch = batch_for(kind, torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                opt.zero_grad()
                model(**batch).loss.backward()
                opt.step()
    except Exception as exc:  # a VerificationError would be a wrong result: reported as such
        return f"| {name} | {frontend} | **raised** {type(exc).__name__}: {str(exc)[:120]} | | | |"
    s = model.stats
    where = "ORT" if not s.fallbacks else f"falls back: {(s.last_fallback_reason or '')[:110]}"
    return f"| {name} | {frontend} | {where} | {s.exports} | {s.verifications} | {time.perf_counter() - t0:.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help=f"a subset of {sorted(models)}")
    ap.add_argument("--frontend", choices=("export", "torchscript"), action="append")
    args = ap.parse_args()
    print("| model | front end | runs in | exports | verified graphs | 2 steps s |")
    print("|---|---|---|---|---|---|")
    for name in args.models or list(models):
        for frontend in args.frontend or ("export", "torchscript"):
            print(run(name, frontend), flush=True)


if __name__ == "__main__":
    main()
