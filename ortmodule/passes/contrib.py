"""onnxruntime's fused inference ops (``com.microsoft``) written out as standard ONNX ops, so that a file
optimised for inference trains (OnnxModule).

# NOTE [contrib ops]: onnxruntime's transformer optimizer (``onnxruntime.transformers.optimizer``,
# Optimum's ORTOptimizer) fuses a BERT's embeddings, attention, residual LayerNorms and GELUs into
# ``com.microsoft`` ops (EmbedLayerNormalization, Attention, SkipLayerNormalization, BiasGelu, FastGelu,
# ...; SimplifiedLayerNormalization, an RMSNorm, sits in the default domain), and many published ONNX
# checkpoints are such files. The stock wheel has their forward kernels
# but no gradients. Each node is replaced by the standard ops that compute what its kernel computes
# (the same formula, the same mask fill value), and the existing rules differentiate those. The test
# of every form is onnxruntime itself: the expanded graph's outputs against the fused kernels' on
# the same file (``tests/test_contrib_ops.py``). A form the expansion does not cover (a KV cache, rotary
# attention, 4-D masks, batch transposes) is refused at load, naming the node and what it uses.
# The expanded graph is also what ``to_onnx`` saves: a standard-ops file (run it through the optimizer
# again to fuse it for inference).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS_DOMAIN = "com.microsoft"
NEEDED_OPSET = 17  # LayerNormalization


class ContribOpError(ValueError):
    """A ``com.microsoft`` node whose form the expansion does not cover."""


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _opt(node: onnx.NodeProto, i: int) -> str | None:
    return node.input[i] if len(node.input) > i and node.input[i] else None


def _out(node: onnx.NodeProto, i: int) -> str | None:
    return node.output[i] if len(node.output) > i and node.output[i] else None


class _Writer:
    """Emits the standard nodes that replace one contrib node; constants are typed like a float value
    of the graph through CastLike, so fp16 / bf16 files get constants of their own type."""

    def __init__(self, node: onnx.NodeProto, k: int, opset: int, ranks: dict[str, int],
                 shapes: dict[str, list]) -> None:
        self.node, self.opset, self.ranks, self.shapes = node, opset, ranks, shapes
        self.base = f"ortmodule_contrib{k}_{node.op_type}"
        self.nodes: list[onnx.NodeProto] = []
        self.n = 0

    def _name(self, hint: str) -> str:
        self.n += 1
        return f"{self.base}/{hint}{self.n}"

    def op(self, op_type: str, inputs: list[str | None], out: str | None = None, n_out: int = 1, **attrs):
        outs = [out] if out is not None and n_out == 1 else [self._name(op_type) for _ in range(n_out)]
        names = [x or "" for x in inputs]
        while names and not names[-1]:  # a trailing empty optional input crashed onnxruntime 1.32's
            names.pop()                 # session creation (LayerNormalization without B)
        self.nodes.append(helper.make_node(op_type, names, outs, name=self._name(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, like: str) -> str:
        """A float constant with ``like``'s element type."""
        c = self.op("Constant", [], value=numpy_helper.from_array(np.array(value, np.float32)))
        return self.op("CastLike", [c, like])

    def ints(self, values) -> str:
        return self.op("Constant", [], value=numpy_helper.from_array(np.array(values, np.int64)))

    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int) -> str:
        if op_type == "ReduceSum" or self.opset >= 18:
            return self.op(op_type, [x, self.ints(axes)], keepdims=keepdims)
        return self.op(op_type, [x], axes=axes, keepdims=keepdims)

    def gelu(self, x: str, out: str | None) -> str:
        """0.5 x (1 + erf(x / sqrt 2)): the erf form, as onnxruntime's Gelu and BiasGelu kernels."""
        cdf = self.op("Add", [self.op("Erf", [self.op("Mul", [x, self.const(1 / math.sqrt(2), x)])]),
                              self.const(1.0, x)])
        return self.op("Mul", [self.op("Mul", [x, cdf]), self.const(0.5, x)], out)

    def rank(self, name: str, what: str) -> int:
        r = self.ranks.get(name)
        if r is None:
            raise ContribOpError(f"{self.where()}: the rank of its {what} ({name!r}) is not known")
        return r

    def where(self) -> str:
        return f"{self.node.domain or 'ai.onnx'}::{self.node.op_type} node {self.node.name or self.node.output[0]!r}"


def _gelu(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    w.gelu(node.input[0], node.output[0])


def _bias_gelu(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    w.gelu(w.op("Add", [node.input[0], node.input[1]]), node.output[0])


def _fast_gelu(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), x = X + bias: onnxruntime's FastGelu."""
    x = node.input[0]
    if _opt(node, 1):
        x = w.op("Add", [x, node.input[1]])
    cube = w.op("Mul", [w.op("Mul", [x, x]), x])
    inner = w.op("Mul", [w.op("Add", [x, w.op("Mul", [cube, w.const(0.044715, x)])]),
                         w.const(math.sqrt(2 / math.pi), x)])
    half = w.op("Mul", [x, w.const(0.5, x)])
    w.op("Mul", [half, w.op("Add", [w.op("Tanh", [inner]), w.const(1.0, x)])], node.output[0])


def _quick_gelu(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    x = node.input[0]
    w.op("Mul", [x, w.op("Sigmoid", [w.op("Mul", [x, w.const(float(a.get("alpha", 1.702)), x)])])], node.output[0])


def _bias_add(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    w.op("Add", [w.op("Add", [node.input[0], node.input[1]]), node.input[2]], node.output[0])


def _swap_last(w: _Writer, x: str, what: str) -> str:
    r = w.rank(x, what)
    return w.op("Transpose", [x], perm=[*range(r - 2), r - 1, r - 2])


def _fused_matmul(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    if a.get("transBatchA", 0) or a.get("transBatchB", 0):
        raise ContribOpError(f"{w.where()}: transBatchA / transBatchB are not supported")
    x, y = node.input[0], node.input[1]
    if a.get("transA", 0):
        x = _swap_last(w, x, "input A")
    if a.get("transB", 0):
        y = _swap_last(w, y, "input B")
    alpha = float(a.get("alpha", 1.0))
    if alpha == 1.0:
        w.op("MatMul", [x, y], node.output[0])
    else:
        w.op("Mul", [w.op("MatMul", [x, y]), w.const(alpha, x)], node.output[0])


def _skip_sum(w: _Writer, node: onnx.NodeProto, bias_at: int) -> str:
    s = w.op("Add", [node.input[0], node.input[1]])
    if _opt(node, bias_at):
        s = w.op("Add", [s, node.input[bias_at]])
    if _out(node, 3):
        w.op("Identity", [s], node.output[3])
    return s


def _skip_layer_norm(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    """LayerNormalization(input + skip + bias) over the last axis; output 3 is that sum."""
    if _out(node, 1) or _out(node, 2):
        raise ContribOpError(f"{w.where()}: its mean / inv_std_var outputs are read")
    s = _skip_sum(w, node, 4)
    w.op("LayerNormalization", [s, node.input[2], _opt(node, 3)], node.output[0], axis=-1,
         epsilon=float(a.get("epsilon", 1e-12)))


def _rms(w: _Writer, s: str, gamma: str, eps: float, out: str, axes: list[int] = (-1,),
         inv_out: str | None = None) -> None:
    """out = s / sqrt(mean(s^2 over ``axes``) + eps) * gamma; the inverse RMS is ``inv_out``."""
    ms = w.reduce("ReduceMean", w.op("Mul", [s, s]), list(axes), 1)
    inv = w.op("Reciprocal", [w.op("Sqrt", [w.op("Add", [ms, w.const(eps, s)])])], inv_out)
    w.op("Mul", [w.op("Mul", [s, inv]), gamma], out)


def _skip_simplified_layer_norm(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    """RMSNorm(input + skip + bias) over the last axis."""
    if _out(node, 1) or _out(node, 2):
        raise ContribOpError(f"{w.where()}: its mean / inv_std_var outputs are read")
    s = _skip_sum(w, node, 3)
    _rms(w, s, node.input[2], float(a.get("epsilon", 1e-12)), node.output[0])


def _embed_layer_norm(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    """LayerNorm(word[ids] + position[position_ids or 0..S-1] + segment[segment_ids]); mask_index is
    the number of mask entries > 0 per row (int32), zeros without a mask."""
    ids, seg_ids, word, pos, seg = (_opt(node, i) for i in range(5))
    mask, pos_ids = _opt(node, 7), _opt(node, 8)
    e = w.op("Gather", [word, ids])
    if pos_ids is None:
        length = w.op("Squeeze", [w.op("Shape", [ids], start=1, end=2), w.ints([0])])
        pos_ids = w.op("Range", [w.ints(0), length, w.ints(1)])
    e = w.op("Add", [e, w.op("Gather", [pos, pos_ids])])
    if seg_ids is not None and seg is not None:
        e = w.op("Add", [e, w.op("Gather", [seg, seg_ids])])
    if _out(node, 2):
        w.op("Identity", [e], node.output[2])
    w.op("LayerNormalization", [e, node.input[5], node.input[6]], node.output[0], axis=-1,
         epsilon=float(a.get("epsilon", 1e-12)))
    if _out(node, 1):
        if int(a.get("mask_index_type", 1)) != 1:
            raise ContribOpError(f"{w.where()}: mask_index_type {a['mask_index_type']} with a mask_index output")
        if mask is not None:
            positive = w.op("Cast", [w.op("Greater", [mask, w.op("CastLike", [w.ints(0), mask])])],
                            to=onnx.TensorProto.INT32)
            w.op("ReduceSum", [positive, w.ints([1])], node.output[1], keepdims=0)
        else:
            batch = w.op("Shape", [ids], start=0, end=1)
            w.op("ConstantOfShape", [batch], node.output[1],
                 value=numpy_helper.from_array(np.zeros(1, np.int32)))


def _attention(w: _Writer, node: onnx.NodeProto, a: dict, mask_lengths: set[str]) -> None:
    """Self-attention over input @ weights + bias split into Q, K, V (thirds, or qkv_hidden_sizes):
    softmax(Q K^T * scale + mask) V per head, masked positions filled additively with
    mask_filter_value (-10000) as onnxruntime does; causal with ``unidirectional``."""
    x, weights, bias = node.input[0], node.input[1], _opt(node, 2)
    for i, what in ((4, "past"), (6, "past_sequence_length")):
        if _opt(node, i):
            raise ContribOpError(f"{w.where()}: a {what} input (a KV cache) is not supported")
    if _out(node, 1):
        raise ContribOpError(f"{w.where()}: its present output (a KV cache) is read")
    if a.get("do_rotary", 0) or a.get("past_present_share_buffer", 0):
        raise ContribOpError(f"{w.where()}: do_rotary / past_present_share_buffer are not supported")
    wshape = w.shapes.get(weights)
    sizes = list(a.get("qkv_hidden_sizes", []))
    if not sizes:
        if not wshape or not isinstance(wshape[-1], int) or wshape[-1] % 3:
            raise ContribOpError(f"{w.where()}: the width of its weights is not known")
        sizes = [wshape[-1] // 3] * 3
    qkv = w.op("MatMul", [x, weights])
    if bias is not None:
        qkv = w.op("Add", [qkv, bias])
    q, k, v = w.op("Split", [qkv, w.ints(sizes)], n_out=3, axis=-1)
    _attend(w, a, q, k, v, sizes, _opt(node, 3), _opt(node, 5), mask_lengths, node.output[0])


def _multi_head_attention(w: _Writer, node: onnx.NodeProto, a: dict, mask_lengths: set[str]) -> None:
    """Attention over separate query [B, S, D], key [B, L, D] and value [B, L, Dv] (a bias [D + D + Dv]
    added to them), as Attention computes it; a packed QKV, a KV cache or 5-D inputs are refused."""
    q, k, v, bias = node.input[0], _opt(node, 1), _opt(node, 2), _opt(node, 3)
    if k is None or v is None:
        raise ContribOpError(f"{w.where()}: packed QKV in the query (no key / value input) is not supported")
    for i in range(6, len(node.input)):
        if node.input[i]:
            raise ContribOpError(f"{w.where()}: a past key / value or cache input is not supported")
    if any(_out(node, i) for i in (1, 2, 3)):
        raise ContribOpError(f"{w.where()}: its present key / value or qk outputs are read")
    for t, what in ((q, "query"), (k, "key"), (v, "value")):
        if w.rank(t, what) != 3:
            raise ContribOpError(f"{w.where()}: a {w.ranks[t]}-D {what} is not supported (3-D only)")
    sizes = [w.shapes[q][-1], w.shapes[k][-1], w.shapes[v][-1]]
    if not all(isinstance(d, int) for d in sizes):
        raise ContribOpError(f"{w.where()}: the hidden sizes of its query, key and value are not known")
    if bias is not None:
        bq, bk, bv = w.op("Split", [bias, w.ints(sizes)], n_out=3, axis=0)
        q, k, v = w.op("Add", [q, bq]), w.op("Add", [k, bk]), w.op("Add", [v, bv])
    _attend(w, a, q, k, v, sizes, _opt(node, 4), _opt(node, 5), mask_lengths, node.output[0])


def _attend(w: _Writer, a: dict, q: str, k: str, v: str, sizes: list, mask: str | None, attention_bias: str | None,
            mask_lengths: set[str], out: str) -> None:
    """softmax(Q K^T * scale + masks) V per head, the heads concatenated: [B, S, Dv]."""
    heads = int(a["num_heads"])
    if any(s % heads for s in sizes):
        raise ContribOpError(f"{w.where()}: hidden sizes {sizes} do not split into {heads} heads")

    def heads_of(t, size, perm):
        return w.op("Transpose", [w.op("Reshape", [t, w.ints([0, 0, heads, size // heads])])], perm=perm)

    qh, kh, vh = heads_of(q, sizes[0], [0, 2, 1, 3]), heads_of(k, sizes[1], [0, 2, 3, 1]), heads_of(v, sizes[2],
                                                                                                     [0, 2, 1, 3])
    scale = a.get("scale")
    scale = float(scale) if scale else 1.0 / math.sqrt(sizes[0] // heads)
    scores = w.op("Mul", [w.op("MatMul", [qh, kh]), w.const(scale, q)])
    fill = float(a.get("mask_filter_value", -10000.0))
    zero, filled = w.const(0.0, q), w.const(fill, q)
    def keys():
        return w.op("Squeeze", [w.op("Shape", [k], start=1, end=2), w.ints([0])])

    if mask is not None:
        rank = 1 if mask in mask_lengths else w.rank(mask, "mask")
        if rank == 1:
            if mask not in mask_lengths:
                raise ContribOpError(f"{w.where()}: a 1-D mask that does not come from EmbedLayerNormalization "
                                     "(it may hold start and end positions)")
            j = w.op("Range", [w.ints(0), keys(), w.ints(1)])
            lengths = w.op("Unsqueeze", [w.op("Cast", [mask], to=onnx.TensorProto.INT64), w.ints([1])])
            keep = w.op("Less", [w.op("Unsqueeze", [j, w.ints([0])]), lengths])  # [B, T]
            add = w.op("Unsqueeze", [w.op("Where", [keep, zero, filled]), w.ints([1, 2])])
        elif rank in (2, 3):
            keep = w.op("Greater", [mask, w.op("CastLike", [w.ints(0), mask])])
            add = w.op("Where", [keep, zero, filled])
            add = w.op("Unsqueeze", [add, w.ints([1, 2] if rank == 2 else [1])])
        else:
            raise ContribOpError(f"{w.where()}: a {rank}-D mask is not supported")
        scores = w.op("Add", [scores, add])
    if a.get("unidirectional", 0):
        queries = w.op("Squeeze", [w.op("Shape", [q], start=1, end=2), w.ints([0])])
        i = w.op("Range", [w.ints(0), queries, w.ints(1)])
        j = w.op("Range", [w.ints(0), keys(), w.ints(1)])
        later = w.op("Greater", [w.op("Unsqueeze", [j, w.ints([0])]), w.op("Unsqueeze", [i, w.ints([1])])])
        scores = w.op("Add", [scores, w.op("Where", [later, filled, zero])])
    if attention_bias is not None:
        scores = w.op("Add", [scores, attention_bias])
    probs = w.op("Softmax", [scores], axis=-1)
    ctx = w.op("Transpose", [w.op("MatMul", [probs, vh])], perm=[0, 2, 1, 3])
    w.op("Reshape", [ctx, w.ints([0, 0, -1])], out)


def _simplified_layer_norm(w: _Writer, node: onnx.NodeProto, a: dict) -> None:
    """RMSNorm over the axes from ``axis`` on (onnxruntime's SimplifiedLayerNormalization, a T5 / Llama
    norm in the default domain); output 1 is the inverse RMS."""
    x = node.input[0]
    axis = int(a.get("axis", -1))
    r = w.rank(x, "input") if axis != -1 else None
    axes = list(range(axis % r, r)) if r is not None else [-1]
    _rms(w, x, node.input[1], float(a.get("epsilon", 1e-5)), node.output[0], axes, _out(node, 1))


_EXPANSIONS = {
    "Gelu": _gelu, "BiasGelu": _bias_gelu, "FastGelu": _fast_gelu, "QuickGelu": _quick_gelu, "BiasAdd": _bias_add,
    "FusedMatMul": _fused_matmul, "SkipLayerNormalization": _skip_layer_norm,
    "SkipSimplifiedLayerNormalization": _skip_simplified_layer_norm, "EmbedLayerNormalization": _embed_layer_norm,
}


def _is_contrib(node: onnx.NodeProto) -> bool:
    return node.domain == MS_DOMAIN or (node.domain in ("", "ai.onnx")
                                        and node.op_type == "SimplifiedLayerNormalization")


def has_contrib_ops(model: onnx.ModelProto) -> bool:
    return any(_is_contrib(n) for n in model.graph.node)


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    g = inferred.graph
    out: dict[str, list] = {t.name: list(t.dims) for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape"):
            out.setdefault(vi.name, [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                     for d in tt.shape.dim])
    return out


def expand_contrib_ops(model: onnx.ModelProto) -> list[str]:
    """Replace the ``com.microsoft`` nodes of ``model``'s main graph by standard ops, in place (NOTE
    [contrib ops]); the op types replaced. Raises :class:`ContribOpError` for a node it cannot write
    out (the model is then left as it was)."""
    if not has_contrib_ops(model):
        return []
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < NEEDED_OPSET:
        raise ContribOpError(f"com.microsoft ops are written out with opset {NEEDED_OPSET} ops (LayerNormalization); "
                             f"the file uses opset {opset}")
    shapes = _shapes(model)
    ranks = {k: len(v) for k, v in shapes.items()}
    mask_lengths = {n.output[1] for n in model.graph.node if n.domain == MS_DOMAIN
                    and n.op_type == "EmbedLayerNormalization" and _out(n, 1)}
    new_nodes: list[onnx.NodeProto] = []
    done: list[str] = []
    for k, node in enumerate(model.graph.node):
        if not _is_contrib(node):
            new_nodes.append(node)
            continue
        w = _Writer(node, k, opset, ranks, shapes)
        if node.op_type == "Attention":
            _attention(w, node, _attrs(node), mask_lengths)
        elif node.op_type == "MultiHeadAttention":
            _multi_head_attention(w, node, _attrs(node), mask_lengths)
        elif node.op_type == "SimplifiedLayerNormalization":
            _simplified_layer_norm(w, node, _attrs(node))
        elif node.op_type in _EXPANSIONS:
            _EXPANSIONS[node.op_type](w, node, _attrs(node))
        else:
            raise ContribOpError(f"{w.where()}: ortmodule has no standard-op form of it (it writes out "
                                 f"{', '.join(['Attention', 'MultiHeadAttention', *_EXPANSIONS])} and "
                                 "SimplifiedLayerNormalization)")
        new_nodes.extend(w.nodes)
        done.append(node.op_type)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return done
