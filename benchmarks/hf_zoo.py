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

ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
DEC = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           use_cache=False)
GQA = dict(DEC, num_key_value_heads=2)

# name -> (model factory, batch kind)
models = {
    "bert-cls": (lambda: T.BertForSequenceClassification(T.BertConfig(vocab_size=V, num_labels=3, **ENC)), "cls"),
    "roberta-mlm": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(vocab_size=V, max_position_embeddings=40,
                                                                 pad_token_id=1, **ENC)), "lm"),
    "distilbert-qa": (lambda: T.DistilBertForQuestionAnswering(
        T.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=2, hidden_dim=64)), "qa"),
    "gpt2-lm": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                                       use_cache=False)), "lm"),
    "llama-lm": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**GQA)), "lm"),
    "mistral-lm": (lambda: T.MistralForCausalLM(T.MistralConfig(sliding_window=8, **GQA)), "lm"),
    "qwen2-lm": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**GQA)), "lm"),
    "gptneox-lm": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**DEC)), "lm"),
    "phi-lm": (lambda: T.PhiForCausalLM(T.PhiConfig(**DEC)), "lm"),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=V, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0)), "s2s"),
    "vit-cls": (lambda: T.ViTForImageClassification(T.ViTConfig(image_size=32, patch_size=8, num_labels=3, **ENC)),
                "img"),
    "convnext-cls": (lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, image_size=32)), "img"),
}


def batch_for(kind: str, g: torch.Generator) -> dict:
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
