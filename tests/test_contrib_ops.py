"""NOTE [contrib ops]: files optimised for inference by onnxruntime's transformer optimizer hold fused
``com.microsoft`` ops; OnnxModule writes them out as standard ops. Each form is checked against
onnxruntime's own fused kernel (the forward) and torch's autograd of the same formula (every gradient)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from ortmodule import OnnxModule
from ortmodule.onnx_module import OnnxLoadError

from .helpers import assert_close

B, S, H, HEADS = 3, 12, 16, 2


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _attend_ref(q, k, v, mask=None, causal=False, fill=-10000.0):
    split = lambda t: t.unflatten(-1, (HEADS, t.shape[-1] // HEADS)).transpose(1, 2)  # noqa: E731
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(q.shape[-1] // HEADS)
    if mask is not None:
        scores = scores + torch.where(mask > 0, 0.0, fill)[:, None, None, :]
    if causal:
        scores = scores + torch.where(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), fill, 0.0)
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).flatten(2)


def _attention_ref(x, w, b, mask=None, causal=False):
    q, k, v = (x @ w + b).split(H, -1)
    return _attend_ref(q, k, v, mask, causal)


def _mha_ref(t, mask=None, causal=False):
    bq, bk, bv = t["b"].split([H, H, 8], -1)
    return _attend_ref(t["q"] + bq, t["k"] + bk, t["v"] + bv, mask, causal)


def _ln(x, g, b, eps):
    return F.layer_norm(x, (x.shape[-1],), g, b, eps)


def _rms(x, g, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * g


def _mask():
    m = np.ones((B, S), np.int32)
    m[1, 7:] = 0
    m[2, 2:] = 0
    return m


# name -> (op, inputs [(name, array, initializer?)], attributes, outputs, reference(tensors) -> outputs)
R = np.random.default_rng(0)
X, SKIP = R.standard_normal((B, S, H)).astype(np.float32), R.standard_normal((B, S, H)).astype(np.float32)
VEC = lambda: (R.standard_normal(H) * 0.5).astype(np.float32)  # noqa: E731
GAMMA, BETA, BIAS = (1 + VEC()), VEC(), VEC()
W3, B3 = (R.standard_normal((H, 3 * H)) * 0.3).astype(np.float32), (R.standard_normal(3 * H) * 0.1).astype(np.float32)
IDS, SEG = R.integers(0, 20, (B, S)).astype(np.int32), R.integers(0, 2, (B, S)).astype(np.int32)
WORD, POS, SEGE = ((R.standard_normal((n, H)) * 0.5).astype(np.float32) for n in (20, S + 4, 2))

L = 9  # cross-attention keys
KV, VV = R.standard_normal((B, L, H)).astype(np.float32), R.standard_normal((B, L, 8)).astype(np.float32)
VS = R.standard_normal((B, S, 8)).astype(np.float32)
MB = (R.standard_normal(2 * H + 8) * 0.1).astype(np.float32)
MASK_L = np.ones((B, L), np.int32)
MASK_L[0, 6:] = 0

CASES = {
    "Gelu": ("Gelu", [("x", X, False)], {}, ["y"], lambda t: [F.gelu(t["x"])]),
    "BiasGelu": ("BiasGelu", [("x", X, False), ("b", BIAS, True)], {}, ["y"], lambda t: [F.gelu(t["x"] + t["b"])]),
    "FastGelu": ("FastGelu", [("x", X, False), ("b", BIAS, True)], {}, ["y"],
                 lambda t: [_gelu_tanh(t["x"] + t["b"])]),
    "FastGelu_nobias": ("FastGelu", [("x", X, False)], {}, ["y"], lambda t: [_gelu_tanh(t["x"])]),
    "QuickGelu": ("QuickGelu", [("x", X, False)], {"alpha": 1.5}, ["y"],
                  lambda t: [t["x"] * torch.sigmoid(1.5 * t["x"])]),
    "BiasAdd": ("BiasAdd", [("x", X, False), ("b", BIAS, True), ("s", SKIP, False)], {}, ["y"],
                lambda t: [t["x"] + t["b"] + t["s"]]),
    "FusedMatMul": ("FusedMatMul", [("x", X, False), ("w", (R.standard_normal((8, H)) * 0.3).astype(np.float32), True)],
                    {"transB": 1, "alpha": 0.5}, ["y"], lambda t: [0.5 * t["x"] @ t["w"].T]),
    "FusedMatMul_transA": ("FusedMatMul", [("x", X.transpose(0, 2, 1).copy(), False),
                                          ("w", (R.standard_normal((H, 8)) * 0.3).astype(np.float32), True)],
                           {"transA": 1}, ["y"], lambda t: [t["x"].transpose(-1, -2) @ t["w"]]),
    "SkipLayerNormalization": ("SkipLayerNormalization", [("x", X, False), ("s", SKIP, False), ("g", GAMMA, True),
                                                          ("be", BETA, True), ("b", BIAS, True)],
                               {"epsilon": 1e-5}, ["y", "", "", "sum"],
                               lambda t: [_ln(t["x"] + t["s"] + t["b"], t["g"], t["be"], 1e-5),
                                          t["x"] + t["s"] + t["b"]]),
    "SkipLayerNormalization_nobeta": ("SkipLayerNormalization", [("x", X, False), ("s", SKIP, False),
                                                                 ("g", GAMMA, True)], {"epsilon": 1e-12}, ["y"],
                                      lambda t: [_ln(t["x"] + t["s"], t["g"], None, 1e-12)]),
    "SkipSimplifiedLayerNormalization": ("SkipSimplifiedLayerNormalization", [("x", X, False), ("s", SKIP, False),
                                                                              ("g", GAMMA, True), ("b", BIAS, True)],
                                         {"epsilon": 1e-6}, ["y"],
                                         lambda t: [_rms(t["x"] + t["s"] + t["b"], t["g"], 1e-6)]),
    "EmbedLayerNormalization": ("EmbedLayerNormalization",
                                [("ids", IDS, False), ("seg", SEG, False), ("word", WORD, True), ("pos", POS, True),
                                 ("sege", SEGE, True), ("g", GAMMA, True), ("be", BETA, True),
                                 ("mask", _mask(), False)],
                                {"epsilon": 1e-12}, ["y", "mask_index", "sum"],
                                lambda t: [_ln(t["word"][t["ids"].long()] + t["pos"][:S] + t["sege"][t["seg"].long()],
                                               t["g"], t["be"], 1e-12),
                                           (t["mask"] > 0).sum(1).int(),
                                           t["word"][t["ids"].long()] + t["pos"][:S] + t["sege"][t["seg"].long()]]),
    "EmbedLayerNormalization_bare": ("EmbedLayerNormalization",
                                     [("ids", IDS, False), ("", None, False), ("word", WORD, True), ("pos", POS, True),
                                      ("", None, False), ("g", GAMMA, True), ("be", BETA, True)],
                                     {"epsilon": 1e-12}, ["y", "mask_index"],
                                     lambda t: [_ln(t["word"][t["ids"].long()] + t["pos"][:S], t["g"], t["be"], 1e-12),
                                                torch.zeros(B, dtype=torch.int32)]),
    "Attention": ("Attention", [("x", X, False), ("w", W3, True), ("b", B3, True)], {"num_heads": HEADS}, ["y"],
                  lambda t: [_attention_ref(t["x"], t["w"], t["b"])]),
    "Attention_mask2d": ("Attention", [("x", X, False), ("w", W3, True), ("b", B3, True), ("mask", _mask(), False)],
                         {"num_heads": HEADS}, ["y"],
                         lambda t: [_attention_ref(t["x"], t["w"], t["b"], mask=t["mask"])]),
    "MultiHeadAttention": ("MultiHeadAttention", [("q", X, False), ("k", KV, False), ("v", VV, False),
                                                  ("b", MB, True), ("mask", MASK_L, False)], {"num_heads": HEADS},
                           ["y"], lambda t: [_mha_ref(t, mask=t["mask"])]),
    "MultiHeadAttention_causal": ("MultiHeadAttention", [("q", X, False), ("k", X, False),
                                                         ("v", VS, False), ("b", MB, True)],
                                  {"num_heads": HEADS, "unidirectional": 1}, ["y"],
                                  lambda t: [_mha_ref(t, causal=True)]),
    "SimplifiedLayerNormalization": ("SimplifiedLayerNormalization", [("x", X, False), ("g", GAMMA, True)],
                                     {"epsilon": 1e-6}, ["y", "inv"],
                                     lambda t: [_rms(t["x"], t["g"], 1e-6),
                                                torch.rsqrt(t["x"].square().mean(-1, keepdim=True) + 1e-6)]),
    "Attention_causal": ("Attention", [("x", X, False), ("w", W3, True), ("b", B3, True)],
                         {"num_heads": HEADS, "unidirectional": 1}, ["y"],
                         lambda t: [_attention_ref(t["x"], t["w"], t["b"], causal=True)]),
}


def _model(op, inputs, attrs, outputs, shapes=None) -> onnx.ModelProto:
    inits, graph_inputs = [], []
    for name, arr, is_init in inputs:
        if not name:
            continue
        if is_init:
            inits.append(numpy_helper.from_array(arr, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype),
                                                              list(arr.shape)))
    domain = "" if op == "SimplifiedLayerNormalization" else "com.microsoft"
    node = helper.make_node(op, [n for n, _, _ in inputs], outputs, domain=domain, name="fused", **attrs)
    named = [o for o in outputs if o]
    shapes = shapes or [[] for _ in named]  # rank 0 where the test does not run the model
    outs = [helper.make_tensor_value_info(o, TensorProto.INT32 if o == "mask_index" else TensorProto.FLOAT, shape)
            for o, shape in zip(named, shapes)]
    graph = helper.make_graph([node], "g", graph_inputs, outs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("case", list(CASES))
def test_contrib_op_is_written_out_as_onnxruntime_computes_it(case):
    op, inputs, attrs, outputs, reference = CASES[case]
    ref_t = {n: torch.tensor(a, requires_grad=a.dtype == np.float32) for n, a, init in inputs if n}
    want = reference(ref_t)
    file = _model(op, inputs, attrs, outputs, [list(w.shape) for w in want])
    feeds = {n: a for n, a, init in inputs if n and not init}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # onnxruntime's CPU build has no BiasAdd kernel (CUDA only): its form is checked against torch's
    fused = None if op == "BiasAdd" else ort.InferenceSession(file.SerializeToString(), so, providers=[
        "CPUExecutionProvider"]).run(None, feeds)
    om = OnnxModule(file, output_format="tuple")
    assert not any(n.domain == "com.microsoft" for n in om.to_onnx().graph.node)
    data = {n: torch.tensor(feeds[n], requires_grad=feeds[n].dtype == np.float32) for n in om.input_names}
    got = om(*data.values())
    weights = torch.Generator().manual_seed(1)
    loss_o = loss_r = 0.0
    for g, f, w in zip(got, fused or [None] * len(want), want):
        if f is not None:
            assert_close(g.detach(), torch.from_numpy(f), 1e-5, f"{case}: output vs onnxruntime's fused kernel")
        assert_close(g.detach(), w.detach(), 1e-5, f"{case}: output vs the torch formula")
        if g.is_floating_point():
            proj = torch.randn(g.shape, generator=weights)
            loss_o, loss_r = loss_o + (g * proj).sum(), loss_r + (w * proj).sum()
    loss_o.backward()
    loss_r.backward()
    for n, a, init in inputs:
        if n and a.dtype == np.float32:
            mine = om.get_parameter(om.attr_names[n]).grad if init else data[n].grad
            assert_close(mine, ref_t[n].grad, 1e-5, f"{case}: {n}.grad")


def test_contrib_forms_not_written_out_are_refused_at_load_naming_the_node():
    past = np.zeros((2, B, HEADS, 0, H // HEADS), np.float32)
    file = _model("Attention", [("x", X, False), ("w", W3, True), ("b", B3, True), ("", None, False),
                                ("past", past, True)], {"num_heads": HEADS}, ["y"])
    with pytest.raises(OnnxLoadError, match=r"Attention node 'fused'.*past"):
        OnnxModule(file)
    file = _model("MultiHeadAttention", [("x", X, False)], {"num_heads": HEADS}, ["y"])
    with pytest.raises(OnnxLoadError, match=r"MultiHeadAttention node 'fused'.*packed QKV"):
        OnnxModule(file)
    file = _model("Attention", [("x", X, False), ("w", W3, True)], {}, ["y"])  # no num_heads
    with pytest.raises(OnnxLoadError, match=r"malformed.*num_heads"):
        OnnxModule(file)
    file = _model("GemmFastGelu", [("x", X, False), ("w", W3, True)], {}, ["y"])
    with pytest.raises(OnnxLoadError, match=r"GemmFastGelu node 'fused'.*no standard-op form"):
        OnnxModule(file)


def _fine_tuned_lm(arch: str, **config):
    """A small HF model (bert: sequence classifier, gpt2 / llama: causal LM) in eval mode, every weight
    moved as in a fine-tuned checkpoint (no two weights alike, no zero bias); ``config`` adds settings."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if arch == "bert":
        net = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, **config))
    elif arch == "gpt2":
        net = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            use_cache=False, **config))
    else:
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, use_cache=False, **config))
    net.eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return net


@pytest.mark.exports
@pytest.mark.parametrize("arch", ["bert", "bert-opset14", "gpt2"])
def test_files_optimised_by_onnxruntime_train_like_eager(arch, tmp_path):
    """A fine-tuned HF BERT (eager attention) and GPT-2, exported by torch.onnx and fused by onnxruntime's
    transformer optimizer (EmbedLayerNormalization, Attention with the padding mask, SkipLayerNormalization,
    BiasGelu / FastGelu), train at eager's numbers: logits with padded rows over 3 AdamW steps. An opset-14
    file is upgraded to 17 first (LayerNormalization)."""
    arch, opset = arch.split("-opset")[0], int(arch.split("-opset")[1]) if "-opset" in arch else 18
    net = _fine_tuned_lm(arch, attn_implementation="eager")
    from onnxruntime.transformers import optimizer

    from .test_onnx_module import RTOL

    fused = {"EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu"} if arch == "bert" \
        else {"SkipLayerNormalization", "FastGelu"}

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, ids, mask):
            return self.net(input_ids=ids, attention_mask=mask).logits

    model = Logits()
    ids = torch.randint(0, 100, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.int64)
    mask[1, 11:] = 0
    mask[3, 5:] = 0
    raw, opt = tmp_path / "raw.onnx", tmp_path / "opt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids[:2], mask[:2]), str(raw), dynamo=False, opset_version=opset,
                          input_names=["ids", "mask"], dynamic_axes={"ids": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}})
        optimizer.optimize_model(str(raw), model_type=arch, num_heads=2, hidden_size=32).save_model_to_file(str(opt))
        ops = {n.op_type for n in onnx.load(str(opt)).graph.node if n.domain == "com.microsoft"}
        assert fused <= ops, ops
        om = OnnxModule(str(opt), tie=True)
    opt_e, opt_o = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(om.parameters(), lr=1e-3)
    keep = mask.bool()
    for step in range(3):
        outs = []
        for m, o in ((model, opt_e), (om, opt_o)):
            o.zero_grad(set_to_none=True)
            out = m(ids, mask)
            (out[keep] if arch == "gpt2" else out).square().mean().backward()
            o.step()
            outs.append((out[keep] if arch == "gpt2" else out).detach())
        assert_close(outs[1], outs[0], RTOL, f"logits at step {step}")


# -- standard ops defined as functions (NOTE [function ops]): opset 21 / 23 --------------------------------
QA = R.standard_normal((B, 4, S, 8)).astype(np.float32)  # [B, q heads, S, head size]
KA, VA = (R.standard_normal((B, 2, L, 8)).astype(np.float32) for _ in range(2))  # 2 key/value heads (GQA)
BOOL_MASK = np.ones((S, L), bool)
BOOL_MASK[:, 6:] = False
BOOL_MASK[3, :] = True
X4 = R.standard_normal((B, 6, 5, 7)).astype(np.float32)
C6 = (1 + R.standard_normal(6) * 0.3).astype(np.float32), (R.standard_normal(6) * 0.3).astype(np.float32)


def _sdpa(t, **kw):
    return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], enable_gqa=True, **kw)


FUNCTION_CASES = {
    "RMSNormalization": ("RMSNormalization", 23, [("x", X, False), ("g", GAMMA, True)], {"epsilon": 1e-6},
                         lambda t: [_rms(t["x"], t["g"], 1e-6)]),
    "GroupNormalization": ("GroupNormalization", 21, [("x", X4, False), ("g", C6[0], True), ("b", C6[1], True)],
                           {"num_groups": 3, "epsilon": 1e-5},
                           lambda t: [F.group_norm(t["x"], 3, t["g"], t["b"], 1e-5)]),
    "Attention_gqa_mask": ("Attention", 23, [("q", QA, False), ("k", KA, False), ("v", VA, False),
                                             ("mask", BOOL_MASK, False)], {},
                           lambda t: [_sdpa(t, attn_mask=t["mask"])]),
    "Attention_causal": ("Attention", 23, [("q", QA, False), ("k", KA[:, :, :S].copy(), False),
                                           ("v", VA[:, :, :S].copy(), False)], {"is_causal": 1},
                         lambda t: [_sdpa(t, is_causal=True)]),
}


@pytest.mark.parametrize("case", list(FUNCTION_CASES))
def test_function_op_is_written_out_as_its_onnx_body(case):
    """NOTE [function ops]: opset 21 / 23 ops without a rule of their own train through the body ONNX
    defines them by: the forward against onnxruntime's own kernel of the op and torch's formula, every
    gradient against torch's autograd."""
    op, opset, inputs, attrs, reference = FUNCTION_CASES[case]
    ref_t = {n: torch.tensor(a, requires_grad=a.dtype == np.float32) for n, a, _ in inputs}
    want = reference(ref_t)
    inits = [numpy_helper.from_array(a, n) for n, a, init in inputs if init]
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
                    for n, a, init in inputs if not init]
    node = helper.make_node(op, [n for n, _, _ in inputs], ["y"], name="composite", **attrs)
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, list(want[0].shape))], inits)
    file = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: a for n, a, init in inputs if not init}
    fused = ort.InferenceSession(file.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    om = OnnxModule(file, output_format="tuple")
    assert op not in {n.op_type for n in om.to_onnx().graph.node}
    data = {n: torch.tensor(feeds[n], requires_grad=feeds[n].dtype == np.float32) for n in om.input_names}
    (got,) = om(*data.values())
    assert_close(got.detach(), torch.from_numpy(fused[0]), 1e-5, f"{case}: output vs onnxruntime's kernel")
    assert_close(got.detach(), want[0].detach(), 1e-5, f"{case}: output vs torch")
    proj = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (got * proj).sum().backward()
    (want[0] * proj).sum().backward()
    for n, a, init in inputs:
        if a.dtype == np.float32:
            mine = om.get_parameter(om.attr_names[n]).grad if init else data[n].grad
            assert_close(mine, ref_t[n].grad, 1e-5, f"{case}: {n}.grad")


@pytest.mark.exports
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_opset23_files_train_like_eager(arch):
    """torch.onnx at opset 23 writes scaled_dot_product_attention as Attention and Llama's RMSNorm as
    RMSNormalization; such files were refused at load ("no gradient rule"). They train at eager's numbers
    over 3 AdamW steps (NOTE [function ops])."""
    from .test_onnx_module import _assert_logits_train_alike, _Logits

    net = _fine_tuned_lm(arch)
    model, x = _Logits(net), torch.randint(0, 100, (4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        file = torch.onnx.export(model, (x,), dynamo=True, opset_version=23, verbose=False).model_proto
        ops = {n.op_type for n in file.graph.node}
        assert {"Attention"} <= ops and (arch == "bert" or "RMSNormalization" in ops), ops
        om = OnnxModule(file, tie=True)
    _assert_logits_train_alike(model, om, x)
