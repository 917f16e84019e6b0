"""Architectures beyond the zoo, built from transformers configs as users build them (no downloads): each
trains in ORT at eager's loss and gradients, or falls back with a warning naming the cause.

Two batches (the cached graph serves the second), dropout on (masks drawn in eager order), no optimizer
step between them: several of these nets are ill-conditioned at toy sizes (BatchNorm over a handful of
values, ReLU6 kinks), where AdamW's first steps amplify float rounding in eager fp32 itself.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from ortmodule import ORTModule
from tests.helpers import TORCH_EXPORT

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
T = transformers
V = 96
ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
DEC = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           use_cache=False)
GQA = dict(DEC, num_key_value_heads=2)
VIS = dict(image_size=32, num_labels=3)

# name -> (factory, batch kind)
MODELS = {
    # the experts' grouped matmul is transformers' custom op on CPU: a torch node (NOTE [custom ops])
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **GQA)), "lm"),
    "albert": (lambda: T.AlbertForMaskedLM(T.AlbertConfig(vocab_size=V, embedding_size=16, **ENC)), "lm"),
    "electra": (lambda: T.ElectraForPreTraining(T.ElectraConfig(vocab_size=V, embedding_size=16, **ENC)), "electra"),
    "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        use_cache=False)), "s2s"),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(
        vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
        max_position_embeddings=64, use_cache=False)), "lm"),
    "bloom-alibi": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4,
                                                             use_cache=False)), "lm"),
    "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=4, use_cache=False, alibi=False)), "lm"),
    "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                    n_positions=64, use_cache=False)), "lm"),
    "gpt-neo-local": (lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(
        vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=64, use_cache=False)), "lm"),
    "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(head_dim=8, **GQA)), "lm"),
    "gemma2-softcap": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(head_dim=8, sliding_window=4, **GQA)), "lm"),
    "olmo": (lambda: T.OlmoForCausalLM(T.OlmoConfig(**GQA)), "lm"),
    "stablelm": (lambda: T.StableLmForCausalLM(T.StableLmConfig(**GQA)), "lm"),
    "starcoder2": (lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**GQA)), "lm"),
    "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                       state_size=4, use_cache=False)), "lm"),
    "xlnet": (lambda: T.XLNetLMHeadModel(T.XLNetConfig(vocab_size=V, d_model=32, n_layer=2, n_head=2, d_inner=64,
                                                       use_mems_train=False)), "lm"),
    "mpnet": (lambda: T.MPNetForMaskedLM(T.MPNetConfig(vocab_size=V, **ENC)), "lm"),
    "funnel": (lambda: T.FunnelForSequenceClassification(T.FunnelConfig(
        vocab_size=V, block_sizes=[1, 1], d_model=32, n_head=2, d_head=16, d_inner=64, num_labels=3)), "cls"),
    "layoutlm": (lambda: T.LayoutLMForMaskedLM(T.LayoutLMConfig(vocab_size=V, **ENC)), "lm"),
    "squeezebert": (lambda: T.SqueezeBertForSequenceClassification(T.SqueezeBertConfig(
        vocab_size=V, embedding_size=32, num_labels=3, **ENC)), "cls"),
    "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=V, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, use_cache=False, decoder_start_token_id=1, pad_token_id=0)), "whisper"),
    "clip": (lambda: T.CLIPModel(T.CLIPConfig(text_config=dict(vocab_size=V, max_position_embeddings=32, **ENC),
                                              vision_config=dict(image_size=32, patch_size=8, **ENC),
                                              projection_dim=16)), "clip"),
    "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(
        embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, patch_size=2, **VIS)), "img"),
    "vit-mae": (lambda: T.ViTMAEForPreTraining(T.ViTMAEConfig(
        patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
        decoder_intermediate_size=64, image_size=32, **ENC)), "pixels"),
    "beit": (lambda: T.BeitForImageClassification(T.BeitConfig(patch_size=8, use_relative_position_bias=True,
                                                               **VIS, **ENC)), "img"),
    "dinov2": (lambda: T.Dinov2ForImageClassification(T.Dinov2Config(patch_size=8, **VIS, **ENC)), "img"),
    "resnet": (lambda: T.ResNetForImageClassification(T.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)), "img"),
    "regnet": (lambda: T.RegNetForImageClassification(T.RegNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, num_labels=3)), "img"),
    "mobilenet-v2": (lambda: T.MobileNetV2ForImageClassification(T.MobileNetV2Config(
        image_size=32, depth_multiplier=0.25, num_labels=3)), "img16"),
    "mobilevit": (lambda: T.MobileViTForImageClassification(T.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_labels=3)),
                  "img16"),
    "levit": (lambda: T.LevitForImageClassification(T.LevitConfig(
        image_size=32, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
        key_dim=[8, 8, 8], num_labels=3)), "img16"),
    "poolformer": (lambda: T.PoolFormerForImageClassification(T.PoolFormerConfig(
        hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=3)), "img"),
    "segformer": (lambda: T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=32, num_labels=3)), "seg"),
}

# the ones that fall back, and the cause the warning must name
FALLBACKS = {
    # labels >= 0 -> nonzero -> `if label_index.size(0) > 0` in the classification loss
    "deberta-v2": ((lambda: T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
        vocab_size=V, num_labels=3, relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=16,
        position_buckets=8, **ENC)), "cls"), "reads tensor values into Python"),
    # `if labels.max() >= vocab_size: raise`
    "wav2vec2-ctc": ((lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=V, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0, **ENC)), "ctc"), "reads tensor values into Python"),
    # complex FFTs: ONNX DFT has no gradient rule, and complex values cannot cross into a torch node
    "fnet": ((lambda: T.FNetForSequenceClassification(T.FNetConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_labels=3,
        use_tpu_fourier_optimizations=False)), "cls"), "DFT"),
}


def _batch(kind: str, g: torch.Generator) -> dict:
    ids = torch.randint(3, V, (4, 16), generator=g)
    labels = torch.randint(0, 3, (4,), generator=g)
    if kind == "cls":
        return dict(input_ids=ids, labels=labels)
    if kind == "lm":
        return dict(input_ids=ids, labels=ids)
    if kind == "electra":
        return dict(input_ids=ids, labels=(ids > 50).long())
    if kind == "s2s":
        return dict(input_ids=ids, labels=ids[:, :7].contiguous())
    if kind in ("img", "img16"):
        n = 16 if kind == "img16" else 4  # BatchNorm over 1x1 maps: 16 rows keep it well-conditioned
        return dict(pixel_values=torch.randn(n, 3, 32, 32, generator=g), labels=torch.randint(0, 3, (n,), generator=g))
    if kind == "seg":
        return dict(pixel_values=torch.randn(4, 3, 32, 32, generator=g),
                    labels=torch.randint(0, 3, (4, 32, 32), generator=g))
    if kind == "pixels":
        return dict(pixel_values=torch.randn(4, 3, 32, 32, generator=g))
    if kind == "whisper":
        return dict(input_features=torch.randn(4, 16, 32, generator=g), labels=ids[:, :7].contiguous())
    if kind == "ctc":
        return dict(input_values=torch.randn(4, 400, generator=g), labels=torch.randint(1, V, (4, 5), generator=g))
    if kind == "clip":
        return dict(input_ids=ids, pixel_values=torch.randn(4, 3, 32, 32, generator=g), return_loss=True)
    raise ValueError(kind)


def _train_side_by_side(make, kind):
    torch.manual_seed(0)
    eager = make().train()
    model = copy.deepcopy(eager)
    wrapped = ORTModule(model)
    for step in range(2):
        batch = _batch(kind, torch.Generator().manual_seed(step))
        losses = []
        for m in (eager, wrapped):
            m.zero_grad()
            torch.manual_seed(10 + step)  # dropout, ViT-MAE's random masking: the same draws
            loss = m(**batch).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.allclose(losses[1], losses[0], rtol=1e-4, atol=1e-5), f"loss at step {step}: {losses}"
        grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
        scale = max(float(g.abs().max()) for g in grads.values())
        for name, p in model.named_parameters():
            if name not in grads:
                assert p.grad is None or not p.grad.any(), f"{name}.grad: eager has none"
                continue
            ref = grads[name]
            # per tensor, against its own magnitude; a gradient that is mathematically zero (a key
            # bias, a bias before a BatchNorm) is rounding noise in both, so the floor is the model's scale
            err = float((p.grad - ref).abs().max()) / max(float(ref.abs().max()), 1e-3 * scale)
            assert err < 2e-3, f"{name}.grad at step {step}: relative error {err:.2e}"
    return wrapped


@pytest.mark.parametrize("name", list(MODELS))
def test_architecture_trains_in_ort_like_eager(name):
    """Under the TorchScript front end many of these fall back (aten::diff in the causal masks, Pad with
    computed pads, interpolate, custom Functions): loudly, with eager's numbers, which are still checked."""
    make, kind = MODELS[name]
    with warnings.catch_warnings():
        warnings.filterwarnings("error" if TORCH_EXPORT else "ignore", message="ORTModule falls back")
        wrapped = _train_side_by_side(make, kind)
    assert wrapped.stats.fallbacks == 0 or not TORCH_EXPORT


@pytest.mark.skipif(not TORCH_EXPORT, reason="the causes named are the torch.export front end's")
@pytest.mark.parametrize("name", list(FALLBACKS))
def test_architecture_falls_back_naming_the_cause(name):
    (make, kind), cause = FALLBACKS[name]
    with pytest.warns(UserWarning, match=f"falls back.*{cause}"):
        wrapped = _train_side_by_side(make, kind)
    assert wrapped.stats.fallbacks == 1
