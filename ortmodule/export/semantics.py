"""Training semantics kept through export: BatchNorm running statistics and Dropout masks.

# NOTE [dropout masks]: every training-mode dropout (``F.dropout`` and the dropout inside
# ``F.scaled_dot_product_attention``) is exported as ``x * mask * 1/(1-p)`` where ``mask`` is a
# graph INPUT. Before each run the masks are drawn in torch, in the order the eager forward would
# draw them, with the same call (``empty_like(x).bernoulli_(1-p)``). So the masks come from torch's
# generator (``torch.manual_seed`` makes runs reproducible; they are even bit-identical to eager
# PyTorch's), and the backward reuses the forward's mask because it is a saved input. During the
# trace a placeholder op ``ortmodule::dropout_mask(x, p, k)`` stands for mask k; the exporter emits it
# as an ``ortmodule.DropoutMask`` node that :func:`masks_to_inputs` replaces by the input ``dropout:k``.
#
# NOTE [batchnorm stats]: ONNX BatchNormalization(training_mode=1) updates its running variance
# with the biased batch variance while torch uses the unbiased one, so the exported node keeps
# computing Y (batch statistics, fused kernel) and the running-stat updates are written as explicit
# in-place ops on the buffer clones; the exporter turns them into graph outputs that are copied
# back into the module's buffers after each run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import math
import os
import sys
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..autodiff.registry import GRAD_KIND_KEY
from ..errors import ExportError, user_location
from ..recompute import MASK_SCALE_KEY
from ..runtime.torch_nodes import inside_call
from .draws import RANDOM_FUNCS, RandomSpec, random_call
from .traps import NOT_REWRITTEN, TraceWatch, UnsupportedTrace, is_inplace, rewrite, thread_value


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """One dropout mask: its shape at export time, and how each dim follows the inputs' shapes.

    ``dims[d]`` is an int (a fixed size) or ``(i, j)``: dim j of user input i (see
    NOTE [dynamic shapes]); ``None`` means the export-time ``shape`` holds.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    p: float
    dims: tuple | None = None
    # NOTE [mask layout]: eager draws ``empty_like(x).bernoulli_()``, which keeps x's strides (a
    # transposed attention output, say), and a fill's values depend on them (normal_ takes another
    # kernel on a non-contiguous tensor); ``order`` lists x's dims from the outermost in memory,
    # None when x is contiguous. The draw fills a tensor of those strides (:func:`strided_empty`),
    # the same call as eager's, then is made contiguous.
    order: tuple[int, ...] | None = None

    def draw(self, device: torch.device, inputs=()) -> torch.Tensor:
        shape = drawn_shape(self.shape, self.dims, inputs)
        # NOTE [bool masks]: eager's CPU dropout computes ``x * bernoulli(1 - p).div_(1 - p)``. The
        # mask is drawn by the same call (the same random stream) and kept as bool, a quarter of the
        # float mask's bytes while it is alive from the forward to the backward; the graph computes
        # the scaled values ``Cast(mask) * scale`` with ``scale`` from the same division, so they are
        # bit-identical (``scale_value``), and the backward recomputes them (``recompute.py``).
        mask = strided_empty(shape, self.order, self.dtype, device).bernoulli_(1.0 - self.p).bool()
        return mask if self.order is None else mask.contiguous()

    def scale_value(self) -> float:
        """What eager's ``div_(1 - p)`` makes of a kept element, in the mask's dtype (p = 1: eager
        multiplies by zeros)."""
        if self.p >= 1.0:
            return 0.0
        return float(torch.ones((), dtype=self.dtype).div_(1.0 - self.p))


def drawn_shape(shape: tuple, dims: tuple | None, inputs) -> tuple:
    """The shape of a draw for this call: ``dims[d]`` is a fixed size or ``(i, j)``, dim j of user
    input i (NOTE [dynamic shapes]); ``dims`` None: the export-time ``shape``."""
    if dims is None:
        return shape
    return tuple(d if isinstance(d, int) else inputs[d[0]].shape[d[1]] for d in dims)


def strided_empty(shape, order, dtype, device) -> torch.Tensor:
    """NOTE [mask layout]: an empty tensor of ``shape`` laid out densely in ``order`` (outermost dim
    first; None: contiguous), as ``empty_like`` makes it of a template with those strides."""
    if order is None:
        return torch.empty(shape, dtype=dtype, device=device)
    physical = [shape[d] for d in order]
    return torch.empty(physical, dtype=dtype, device=device).permute(sorted(range(len(order)), key=order.__getitem__))


def _dropout_args(func, args, kwargs):
    """(input, p, training) of an F.dropout call."""
    names = ("input", "p", "training", "inplace")
    defaults = {"p": 0.5, "training": True, "inplace": False}
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound["input"], float(bound["p"]), bool(bound["training"])


def _cross_entropy_args(args, kwargs) -> dict:
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    bound = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
             "label_smoothing": 0.0}
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


_FEATURE_DROPOUTS = {F.dropout1d: 3, F.dropout2d: None, F.dropout3d: 5}  # -> the batched input's rank
_HARDTANHS = {F.hardtanh, F.relu6, F.hardtanh_}


_ERFC_TAILS = {torch.erfc, torch.Tensor.erfc, torch.special.erfc, torch.special.erfcx, torch.special.ndtr,
               torch.special.log_ndtr}


def _torch_only(func, args, kwargs) -> str | None:
    """Why the ONNX form of this call is not torch's (NOTE [as torch]), or None."""
    if func in (torch.topk, torch.Tensor.topk):
        return "ONNX TopK orders tied values lowest index first, torch its own way"
    if func in (torch.cdist, torch.atan2, torch.Tensor.atan2, torch.arctan2, torch.sinc, torch.Tensor.sinc):
        return "its ONNX form has NaN gradients at exact zeros where torch's are finite"
    if func in _ERFC_TAILS:  # NOTE [erfc as torch] (torch_calls.py)
        return "its ONNX form is 1 - erf(x), with no digits left in the tail (erfc(4) = 0, log of it -inf)"
    if func is F.avg_pool2d and (args[6] if len(args) > 6 else kwargs.get("divisor_override")) is not None:
        return "ONNX AveragePool has no divisor_override"
    if func is F.embedding and (args[5] if len(args) > 5 else kwargs.get("scale_grad_by_freq", False)):
        return "ONNX has no embedding gradient scaled by the indices' frequency"
    if func in (F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear):  # NOTE [upsample as torch]
        return "ONNX Resize picks other source pixels than torch's upsampling for some sizes"
    if func in (torch.scatter_reduce, torch.Tensor.scatter_reduce) \
            and (args[4] if len(args) > 4 else kwargs.get("reduce")) != "sum":
        return "ONNX ScatterElements has no exact form of this reduction and its gradient"
    return None
_MAX_MIN = {torch.max, torch.min, torch.Tensor.max, torch.Tensor.min}
_CLAMPS = {torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip, torch.Tensor.clamp_, torch.Tensor.clip_}


def _tensor_bounds(args, kwargs):
    """``t.clamp(0, x.size(1))`` under torch.export: a SymInt bound reaches torch.onnx's type
    promotion as a graph value it cannot type; as 0-d tensors of t's dtype (both bounds, as
    ``clamp.Tensor`` takes them) it stays symbolic. Only integer bounds are converted: a float
    bound would change eager's result dtype (an integer ``t`` clamps to float)."""
    t = args[0] if args else None
    bounds = (*args[1:], *kwargs.values())
    if not isinstance(t, torch.Tensor) or not any(isinstance(v, torch.SymInt) for v in bounds):
        return args, kwargs
    if not all(v is None or isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) for v in bounds):
        return args, kwargs

    def as_tensor(v):
        return None if v is None else torch.full((), v, dtype=t.dtype, device=t.device)

    return (t, *map(as_tensor, args[1:])), {k: as_tensor(v) for k, v in kwargs.items()}


def _clamp_by_tensors(func, args, kwargs):
    """NOTE [kinks as torch]: a clamp with tensor bounds translates to ONNX Max and Min, whose rules
    split the gradient between tied inputs (torch.maximum's backward); torch.clamp gives it all to
    ``x`` at its bounds. Written as the two selections clamp's backward makes, same values."""
    if getattr(func, "__name__", "").endswith("_") or not torch.is_grad_enabled():
        return NOT_REWRITTEN
    bound = dict(zip(("input", "min", "max"), args))
    bound.update(kwargs)
    x, lo, hi = bound.get("input"), bound.get("min"), bound.get("max")
    tensors = [b for b in (lo, hi) if isinstance(b, torch.Tensor)]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not tensors \
            or not all(b is None or isinstance(b, torch.Tensor) and b.is_floating_point() for b in (lo, hi)):
        return NOT_REWRITTEN
    y = x if lo is None else torch.where(x < lo, lo, x)
    return y if hi is None else torch.where(y > hi, hi, y)


def _concrete_ignore_index(func, args, kwargs):
    """An ``ignore_index`` computed from a size (HF QA heads: ``ignored = logits.size(1)``) is a
    SymInt under torch.export, which torchlib's loss takes as an int only: made an int, which adds
    torch.export's guard on that size (a new size exports again, NOTE [shape guards])."""
    position = 4  # F.cross_entropy and F.nll_loss alike: (input, target, weight, size_average, ignore_index)
    value = kwargs.get("ignore_index", args[position] if len(args) > position else None)
    if not isinstance(value, torch.SymInt):
        return args, kwargs
    if "ignore_index" in kwargs:
        return args, {**kwargs, "ignore_index": int(value)}
    return (*args[:position], int(value), *args[position + 1:]), kwargs


def smoothed_cross_entropy(input, target, weight, ignore_index: int, reduction: str, smoothing: float):
    """``F.cross_entropy(..., label_smoothing=smoothing)`` for class-index targets, from ops that export.

    # NOTE [label smoothing]: the TorchScript exporter rejects ``label_smoothing > 0``, which made
    # such a model fall back to eager. Torch computes it as ``(1 - e) * nll + e / C * smooth``, where
    # ``smooth`` is the (class-weighted) negative sum of the log-probabilities over classes, zero at
    # ignored targets, and reduced like the NLL (a weighted mean divides by the weights of the targets
    # that are not ignored); written out the same way here.
    """
    class_dim = 0 if input.dim() == 1 else 1
    logp = F.log_softmax(input, class_dim)
    nll = F.nll_loss(logp, target, weight, ignore_index=ignore_index, reduction=reduction)
    ignored = target == ignore_index
    if weight is not None:
        shape = [1] * logp.dim()
        shape[class_dim] = weight.shape[0]
        smooth = -(logp * weight.view(shape)).sum(class_dim)
    else:
        smooth = -logp.sum(class_dim)
    smooth = smooth.masked_fill(ignored, 0.0)
    if reduction == "mean":
        if weight is not None:
            picked = weight.gather(0, target.masked_fill(ignored, 0).flatten()).view(target.shape)
            smooth = smooth.sum() / picked.masked_fill(ignored, 0.0).sum()
        else:
            smooth = smooth.sum() / (~ignored).sum()
    elif reduction == "sum":
        smooth = smooth.sum()
    return (1.0 - smoothing) * nll + smooth * (smoothing / input.shape[class_dim])


def soft_target_cross_entropy(input, target, weight, reduction: str, smoothing: float):
    """``F.cross_entropy`` with class-probability targets (distillation, mixup / cutmix), from ops that export.

    # NOTE [soft targets]: torchlib translates every cross_entropy to NegativeLogLikelihoodLoss, which
    # takes class indices only: onnxruntime refused a float target and the whole model fell back to
    # eager. Torch computes ``-(log_softmax(input) * target' * weight).sum(class_dim)`` with
    # ``target' = target * (1 - e) + e / C``; ``mean`` divides the total by the number of rows
    # (``numel / C``, not by the weights as class-index targets do), and ``ignore_index`` does not apply.
    """
    class_dim = 0 if input.dim() == 1 else 1
    n_classes = input.shape[class_dim]
    logp = F.log_softmax(input, class_dim)
    if smoothing > 0.0:
        target = target * (1.0 - smoothing) + smoothing / n_classes
    terms = logp * target
    if weight is not None:
        shape = [1] * logp.dim()
        shape[class_dim] = n_classes
        terms = terms * weight.view(shape)
    if reduction == "none":
        return -terms.sum(class_dim)
    total = -terms.sum()
    if reduction == "sum":
        return total
    return total / (input.numel() // n_classes)


def _sdpa_args(args, kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def sdpa_math(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, dropout=None):
    """Scaled dot-product attention written out, with ``dropout(weights)`` applied if given."""
    L, S = q.size(-2), k.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if enable_gqa:
        rep = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(rep, -3)
        v = v.repeat_interleave(rep, -3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    # NOTE [additive masks]: boolean masks become additive 0/-inf masks built at the mask's own
    # (small, broadcast) shape and added to the scores, as torch's math SDPA does
    # (convert_boolean_attn_mask): no Where over the [B, H, L, S] scores in the forward, and the
    # scores' gradient passes the Add unchanged (BERT-4L: about 6 ms forward + 5 ms backward).
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        scores = scores + torch.zeros(L, S, dtype=scores.dtype, device=q.device).masked_fill(~causal, float("-inf"))
    keep = None
    if attn_mask is not None:
        # NOTE [fully masked rows]: torch's SDPA gives 0 for a query row whose keys are all masked
        # (its safe softmax), by a bool mask or -inf: the pad positions before the first token of a
        # left-padded causal LM, one of which predicts that token; a fully padded sample under
        # nn.MultiheadAttention. Plain softmax made them a mean of the values or NaN (the loss and
        # every gradient 1e-4..10% off). The row is zeroed after the product, at the output's
        # [.., L, D] size, from the mask at its own (broadcast) size; the finite fill keeps those
        # rows' weights finite, and exp(min - max) is 0 as exp(-inf) is for the other rows.
        lowest = torch.finfo(scores.dtype).min / 2  # half the range: fill + score stays finite in fp16
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask
            attn_mask = torch.zeros_like(attn_mask, dtype=scores.dtype).masked_fill(~attn_mask, lowest)
        else:
            allowed = attn_mask > float("-inf")
            attn_mask = attn_mask.clamp(min=lowest)
        if is_causal:
            allowed = allowed & causal
        keep = allowed.any(-1, keepdim=True).to(scores.dtype)
        scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    if dropout is not None:
        weights = dropout(weights)
    out = torch.matmul(weights, v)
    return out if keep is None else out * keep


_DATA = torch._C.TensorBase.data  # the getset descriptor of ``Tensor.data``

MASK_OP = "DropoutMask"
MASK_DOMAIN = "ortmodule"
RANDOM_OP = "RandomValue"  # NOTE [random draws] (draws.py)


STOP_GRADIENT_OP = "StopGradient"
GRAD_KIND_OP = "GradKind"
# NOTE [kinks as torch]: where one ONNX op stands for torch functions whose backwards differ at ties
# or bounds, the trace marks the output (``ortmodule::grad_kind``) and :func:`mark_grad_kinds` moves
# the mark onto the producing node's metadata (``GRAD_KIND_KEY``), where its gradient rule reads it:
# - ``strict_bounds`` (F.hardtanh, F.relu6, nn.ReLU6 -> Clip): torch's hardtanh backward passes the
#   gradient strictly inside (lo, hi), clamp's inclusively (the Clip rule's default);
# - ``first_index`` (torch.max/min(x, dim) -> ReduceMax/Min): the gradient goes to the index the op
#   returns (the first extremum), where amax/amin split it between ties (the Reduce rule's default).
# An in-place hardtanh returns the marked value; a later read of its input by the old name keeps
# clamp's gradient at the bounds (the values are right).
GRAD_KINDS = {1: "strict_bounds", 2: "first_index"}
_KIND_OPS = {"strict_bounds": ("Clip",), "first_index": ("ReduceMax", "ReduceMin")}


def define_mask_op() -> None:
    """The placeholder ops traced for ortmodule's own semantics, and their ONNX symbolics:

    ``ortmodule::dropout_mask`` (NOTE [dropout masks]) and ``ortmodule::stop_gradient``
    (NOTE [stop gradient]).
    """
    if hasattr(torch.ops.ortmodule, "dropout_mask"):
        return
    lib = torch.library.Library("ortmodule", "DEF")
    lib.define("dropout_mask(Tensor x, float p, int k) -> Tensor")
    lib.impl("dropout_mask", lambda x, p, k: torch.ones_like(x), "CompositeExplicitAutograd")
    lib.define("random_value(Tensor like, int k) -> Tensor")
    lib.impl("random_value", lambda like, k: like.clone(), "CompositeExplicitAutograd")
    lib.define("stop_gradient(Tensor x) -> Tensor")
    lib.impl("stop_gradient", lambda x: x.detach().clone(), "CompositeExplicitAutograd")
    lib.define("grad_kind(Tensor x, int kind) -> Tensor")
    lib.impl("grad_kind", lambda x, kind: x.clone(), "CompositeExplicitAutograd")
    define_mask_op.lib = lib  # keep the library alive

    def mask_symbolic(g, x, p, k):
        index = torch.onnx.symbolic_helper._get_const(k, "i", "k")
        out = g.op(f"{MASK_DOMAIN}::{MASK_OP}", x, index_i=index)
        out.setType(x.type())
        return out

    def random_symbolic(g, like, k):
        out = g.op(f"{MASK_DOMAIN}::{RANDOM_OP}", like, index_i=torch.onnx.symbolic_helper._get_const(k, "i", "k"))
        out.setType(like.type())
        return out

    def stop_symbolic(g, x):
        out = g.op(f"{MASK_DOMAIN}::{STOP_GRADIENT_OP}", x)
        out.setType(x.type())
        return out

    def kind_symbolic(g, x, kind):
        out = g.op(f"{MASK_DOMAIN}::{GRAD_KIND_OP}", x, kind_i=torch.onnx.symbolic_helper._get_const(kind, "i", "kind"))
        out.setType(x.type())
        return out

    torch.onnx.register_custom_op_symbolic("ortmodule::dropout_mask", mask_symbolic, 9)
    torch.onnx.register_custom_op_symbolic("ortmodule::random_value", random_symbolic, 9)
    torch.onnx.register_custom_op_symbolic("ortmodule::stop_gradient", stop_symbolic, 9)
    torch.onnx.register_custom_op_symbolic("ortmodule::grad_kind", kind_symbolic, 9)


STOP_GRADIENT_KEY = "pkg.ortmodule.stop_gradient"


def mark_stop_gradients(model) -> None:
    """NOTE [stop gradient]: each traced ``ortmodule.StopGradient`` becomes a standard Identity node
    carrying the metadata ``pkg.ortmodule.stop_gradient``, which autodiff treats as the end of every
    gradient path; onnx shape inference and onnxruntime see a plain Identity."""
    for node in model.graph.node:
        if node.domain == MASK_DOMAIN and node.op_type == STOP_GRADIENT_OP:
            node.domain, node.op_type = "", "Identity"
            node.metadata_props.add(key=STOP_GRADIENT_KEY, value="true")
    opsets = [o for o in model.opset_import if o.domain != MASK_DOMAIN]
    if len(opsets) != len(model.opset_import):
        del model.opset_import[:]
        model.opset_import.extend(opsets)


def mark_grad_kinds(model) -> None:
    """NOTE [kinks as torch]: each traced ``ortmodule.GradKind`` becomes a plain Identity and its kind
    goes to the metadata of the node that produced its input, when that node is one the kind is for."""
    producers = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        if node.domain == MASK_DOMAIN and node.op_type == GRAD_KIND_OP:
            kind = GRAD_KINDS[next(a.i for a in node.attribute if a.name == "kind")]
            producer = producers.get(node.input[0])
            if producer is not None and producer.op_type in _KIND_OPS[kind] and producer.domain == "":
                producer.metadata_props.add(key=GRAD_KIND_KEY, value=kind)
            node.domain, node.op_type = "", "Identity"
            del node.attribute[:]


def grad_kind(x: torch.Tensor, kind: int) -> torch.Tensor:
    return torch.ops.ortmodule.grad_kind(x, kind) if x.is_floating_point() and torch.is_grad_enabled() else x


_LOG1P = {torch.log1p, torch.Tensor.log1p, torch.special.log1p}
_EXPM1 = {torch.expm1, torch.Tensor.expm1, torch.special.expm1}


# NOTE [log1p and expm1]: ONNX has neither; the exporters write log(1 + x) and exp(x) - 1, which lose
# every digit that ``1 + x`` or ``exp(x)`` rounds away: log1p(1e-6) came out 5% off, expm1(1e-4) 0.1%
# (eager's kernels are accurate to an ulp), and whatever scales them up (a log-probability of a
# near-certain event, a small-step update) inherited it. Written as the same naive term, which gives
# the gradient (1 / (1 + x), exp(x): torch's formulas), plus a correction without gradient from
# the classic exact forms for |x| < 1: log1p(x) = x log(u) / (u - 1) with u = 1 + x, and
# expm1(x) = (u - 1) / log(u) * x with u = exp(x) (x where u == 1). Elsewhere, or where a term is not
# finite (x = -1, NaN), the naive value stands, as accurate there as torch's.
def _precise_log1p(x: torch.Tensor) -> torch.Tensor:
    naive = torch.log(1 + x)
    xs = stop_gradient(x)
    u = 1 + xs
    d = u - 1
    exact = torch.where(d == 0, xs, xs * torch.log(u) / torch.where(d == 0, 1, d))
    return naive + _correction(exact, stop_gradient(naive), xs)


def _precise_expm1(x: torch.Tensor) -> torch.Tensor:
    naive = torch.exp(x) - 1
    xs = stop_gradient(x)
    u = torch.exp(xs)
    lu = torch.log(u)
    exact = torch.where(u == 1, xs, (u - 1) / torch.where(u == 1, 1, lu) * xs)
    return naive + _correction(exact, stop_gradient(naive), xs)


_LOGADDEXP = {torch.logaddexp, torch.Tensor.logaddexp, torch.logaddexp2, torch.Tensor.logaddexp2}


def _logaddexp(a: torch.Tensor, b: torch.Tensor, base2: bool) -> torch.Tensor:
    """NOTE [logaddexp]: the exporters write log(exp(a) + exp(b)), infinite from a or b ~ 89 on (NaN
    gradients) where eager's is finite; torch computes max(a, b) + log1p(exp(-|a - b|)) (base 2:
    log2, exp2), and two equal infinities give themselves. The max splits a tie's gradient half and
    half, as eager's exp(a) / (exp(a) + exp(b)) = 0.5."""
    m = torch.maximum(a, b)
    d = -(a - b).abs()
    tail = _precise_log1p(torch.exp2(d)) / math.log(2) if base2 else _precise_log1p(torch.exp(d))
    out = m + tail
    return torch.where(torch.isinf(a) & (a == b), a + torch.zeros_like(b), out)


_BCE_LOGITS = {F.binary_cross_entropy_with_logits, torch.binary_cross_entropy_with_logits}
_BCE = _BCE_LOGITS | {F.binary_cross_entropy}


def _binary_cross_entropy(func, args, kwargs):
    """NOTE [binary cross entropy]: the exporters write both losses from ``log(sigmoid(x))`` or
    ``log(p)``, and onnxruntime's CPU Sigmoid is exact only to ~6e-8 absolute (sigmoid(-16) came
    out 5.96e-8 for 1.13e-7, sigmoid(-18) 0): BCE with logits beyond about +-17 on the wrong side
    gave an infinite loss and NaN gradients where eager's are finite (a confident mistake in
    multi-label training), and BCE on probabilities of exactly 0 or 1 NaN gradients where eager
    divides by max(p (1 - p), 1e-12). Written as torch computes them:
    - with logits: ``(1 - y) x + w_log * softplus(-x)`` (``w_log = 1 + (pos_weight - 1) y``);
      onnxruntime's Softplus is stable and its rule's sigmoid gives torch's gradient sigmoid(x) - y,
      0.5 - y at x = 0 too;
    - on probabilities: ATen's value ``-(y max(log p, -100) + (1 - y) max(log(1 - p), -100))``
      without gradient, plus ``(p - sg(p)) * sg((p - y) / max(p (1 - p), 1e-12))``, which is 0 in
      the forward and has ATen's gradient."""
    names = ("input", "target", "weight", "size_average", "reduce", "reduction")
    if func in _BCE_LOGITS:
        names += ("pos_weight",)
    b = {"weight": None, "size_average": None, "reduce": None, "reduction": "mean", "pos_weight": None}
    b.update(zip(names, args))
    b.update(kwargs)
    x, y = b["input"], b["target"]
    legacy = b["size_average"] is not None or b["reduce"] is not None
    if (legacy or not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or not x.is_floating_point()
            or b["reduction"] not in ("none", "mean", "sum")):
        return NOT_REWRITTEN
    if func in _BCE_LOGITS:
        softplus = F.softplus(-x)
        if b["pos_weight"] is not None:
            softplus = ((b["pos_weight"] - 1) * y + 1) * softplus
        loss = (1 - y) * x + softplus
    else:
        p = stop_gradient(x)
        value = -(y * torch.log(p).clamp(min=-100) + (1 - y) * torch.log(1 - p).clamp(min=-100))
        slope = (p - y) / (p * (1 - p)).clamp(min=1e-12)
        loss = stop_gradient(value) + (x - p) * stop_gradient(slope)
    if b["weight"] is not None:
        loss = loss * b["weight"]
    if b["reduction"] == "mean":
        return loss.mean()
    return loss.sum() if b["reduction"] == "sum" else loss


_STD = {torch.std: torch.var, torch.Tensor.std: torch.Tensor.var, torch.std_mean: torch.var_mean}


def _std(func, args, kwargs):
    """NOTE [zero std]: the exporters write std as sqrt(var), whose gradient at a constant row is
    0 * inf: NaN where eager's std backward gives 0 (it masks a zero std; a padded or dead row in a
    hand-written normalisation). The same call to var (std and var take the same arguments), and
    its square root with the masked gradient: ``sg(s) + (v - sg(v)) * sg(where(s == 0, 0, 1 / 2s))``."""
    out = _STD[func](*args, **kwargs)
    v, mean = out if func is torch.std_mean else (out, None)
    s = torch.sqrt(stop_gradient(v))
    slope = torch.where(s == 0, torch.zeros_like(s), 0.5 / s)
    std = s + (v - stop_gradient(v)) * stop_gradient(slope)
    return std if mean is None else (std, mean)


# f(input, a, b, beta, alpha) = beta * input + alpha * product(a, b)
_BETA_TERMS = {
    torch.baddbmm: torch.bmm, torch.Tensor.baddbmm: torch.bmm,
    torch.addbmm: lambda a, b: torch.bmm(a, b).sum(0), torch.Tensor.addbmm: lambda a, b: torch.bmm(a, b).sum(0),
    torch.addmm: torch.mm, torch.Tensor.addmm: torch.mm,
    torch.addmv: torch.mv, torch.Tensor.addmv: torch.mv,
    torch.addr: torch.outer, torch.Tensor.addr: torch.outer,
}


def _without_beta_term(func, args, kwargs):
    """NOTE [beta zero]: with ``beta=0`` torch ignores ``input``, NaN and inf included (HF attention
    fills ``torch.empty`` by ``baddbmm(empty, q, k, beta=0)``); the exporters write ``0 * input``,
    NaN where it holds NaN. Written as the product alone (plus ``0 * input`` where the input needs a
    gradient, which eager gives as zeros)."""
    names = ("input", "a", "b")
    b = {"beta": 1, "alpha": 1}
    b.update(zip(names, args))
    b.update(kwargs)
    if len(args) > 3 or set(b) - {*names, "beta", "alpha"} or not isinstance(b.get("beta"), (int, float)) \
            or b["beta"] != 0 or not all(isinstance(b.get(k), torch.Tensor) for k in names):
        return NOT_REWRITTEN
    out = _BETA_TERMS[func](b["a"], b["b"])
    if b["alpha"] != 1:
        out = out * b["alpha"]
    out = torch.broadcast_to(out, torch.broadcast_shapes(out.shape, b["input"].shape))
    if b["input"].requires_grad:
        out = out + 0 * b["input"]
    return out.to(torch.result_type(b["input"], out)) if b["input"].dtype != out.dtype else out


def _correction(exact: torch.Tensor, naive: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    # only |x| < 1 loses digits to 1 + x or exp(x) - 1; further out the naive value is as good, and
    # the exact forms read log() of a denormal exp(x) (x < -87), which onnxruntime takes as zero
    ok = torch.isfinite(exact) & torch.isfinite(naive) & (xs.abs() < 1)
    return stop_gradient(torch.where(ok, exact - naive, 0))


def stop_gradient(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.ortmodule.stop_gradient(x) if x.is_floating_point() else x


_ONNX_DTYPE = {torch.float32: 1, torch.float16: 10, torch.float64: 11, torch.bfloat16: 16, torch.uint8: 2,
               torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 7, torch.bool: 9}


def masks_to_inputs(model, masks: list, input_name, dynamic: bool = False) -> None:
    """Replace each ``ortmodule.DropoutMask`` node (index k) by the bool graph input ``input_name(k)``
    and the nodes ``Cast(input) * scale`` (NOTE [bool masks]), tagged ``pkg.ortmodule.dropout_scale``;
    each ``ortmodule.RandomValue`` node by an Identity of its input (NOTE [random draws])."""
    import onnx
    from onnx import helper

    graph = model.graph
    keep = []
    found = []
    made = set()
    for node in graph.node:
        if node.domain == MASK_DOMAIN and node.op_type == MASK_OP:
            k = next(a.i for a in node.attribute if a.name == "index")
            spec, out = masks[k], node.output[0]
            dtype = _ONNX_DTYPE[spec.dtype]
            scale = helper.make_tensor(f"{out}/scale_value", dtype, [], [spec.scale_value()])
            new = [helper.make_node("Cast", [input_name(k)], [f"{out}/kept"], name=f"{out}/cast", to=dtype),
                   helper.make_node("Constant", [], [f"{out}/scale"], name=f"{out}/scale", value=scale),
                   helper.make_node("Mul", [f"{out}/kept", f"{out}/scale"], [out], name=f"{out}/mul")]
            for n in new:
                n.metadata_props.extend(node.metadata_props)
                n.metadata_props.add(key=MASK_SCALE_KEY, value=str(k))
            keep.extend(new)
            made.add(out)
            found.append(k)
        elif node.domain == MASK_DOMAIN and node.op_type == RANDOM_OP:
            k = next(a.i for a in node.attribute if a.name == "index")
            same = helper.make_node("Identity", [input_name(k)], [node.output[0]], name=f"{node.output[0]}/draw")
            same.metadata_props.extend(node.metadata_props)
            keep.append(same)
            found.append(k)
        else:
            keep.append(node)
    if not found:
        return
    for k in sorted(found):
        spec = masks[k]
        shape = [f"dropout{k}_dim{d}" for d in range(len(spec.shape))] if dynamic else list(spec.shape)
        dtype = onnx.TensorProto.BOOL if isinstance(spec, MaskSpec) else _ONNX_DTYPE[spec.dtype]
        graph.input.append(onnx.helper.make_tensor_value_info(input_name(k), dtype, shape))
    for out in graph.output:
        if out.name in made:
            raise ValueError("a dropout mask cannot be a graph output")
    del graph.node[:]
    graph.node.extend(keep)
    if not any(o.domain == MASK_DOMAIN for o in model.opset_import):
        return
    opsets = [o for o in model.opset_import if o.domain != MASK_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(opsets)


_PLAIN = object()  # a call traced as it is
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DISPATCH_FILES = (os.path.join("torch", "overrides.py"), os.path.join("torch", "utils", "_python_dispatch.py"))
_JUMPS: dict = {}  # code object -> {offset of a jump over ``raise AssertionError``: its answer}


def assert_jump() -> bool | None:
    """NOTE [value checks]: whether the ``bool(tensor)`` being taken only decides whether to raise: the
    innermost frame outside ortmodule and torch's dispatch is at a conditional jump whose fall-through
    is straight code ending in ``raise`` (``assert cond``, ``if not cond: raise ValueError(...)``,
    ``if torch.isnan(loss): raise ...``). Returns the answer that skips the raise: True where the jump
    is taken on a true value (``assert cond``), False where on a false one (``if cond: raise``); None
    for any other use (a branch), which stays a value read."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename.endswith(_DISPATCH_FILES)):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    jumps = _JUMPS.get(code)
    if jumps is None:
        jumps = _raise_jumps(code)
        _JUMPS[code] = jumps
    return jumps.get(frame.f_lasti)


def _raise_jumps(code) -> dict[int, bool]:
    """Offset of each conditional jump over a raise -> the truth value that skips the raise: the jump's
    own where its fall-through raises (``assert cond``, ``if cond: raise``), the other where its target
    does (the first operands of ``if a or b: raise`` and of ``assert a and b``: each must come out so)."""
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG", "NOT_TAKEN")]
    at_offset = {i.offset: k for k, i in enumerate(ins)}

    def raises(start: int) -> bool:  # straight code from ins[start] ending in raise (others may join it)
        for follow in ins[start:]:
            if follow.opname == "RAISE_VARARGS" and follow.arg:
                return True
            if "JUMP" in follow.opname or follow.opname.startswith(("RETURN", "YIELD")):
                return False
        return False

    found: dict[int, bool] = {}
    for k, at in enumerate(ins):
        j = k + 1 if at.opname == "TO_BOOL" else k  # 3.13: the conversion precedes the jump
        if j >= len(ins) or "JUMP" not in ins[j].opname:
            continue
        jump = ins[j].opname
        taken = True if jump.endswith("IF_TRUE") else False if jump.endswith("IF_FALSE") else None
        if taken is None:
            continue
        if raises(j + 1):
            found[at.offset] = taken
        elif at_offset.get(ins[j].argval) is not None and raises(at_offset[ins[j].argval]):
            found[at.offset] = not taken
    return found


class _Base(TorchFunctionMode):
    def _batch_norm(self, func, args, kwargs):
        return func(*args, **kwargs)

    def _instance_norm(self, func, args, kwargs):
        return func(*args, **kwargs)

    watch: TraceWatch | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._own_form(func, args, kwargs)
        if out is _PLAIN:
            if not torch.is_grad_enabled():
                if args and isinstance(args[0], torch.Tensor) and (is_inplace(func) or kwargs.get("out") is not None):
                    return self._no_grad_write(func, args, kwargs)
                # NOTE [stop gradient]: what the forward computes under torch.no_grad() carries no
                # gradient in eager PyTorch; the tracer records it like any op, so mark it.
                return torch.utils._pytree.tree_map_only(torch.Tensor, stop_gradient, func(*args, **kwargs))
            return func(*args, **kwargs)
        if (torch.is_grad_enabled() or is_inplace(func) or kwargs.get("out") is not None or kwargs.get("inplace")
                or func in (torch.Tensor.detach, torch.detach) or getattr(func, "__self__", None) is _DATA):
            return out  # ``t.data``, ``detach``: stopped already; a write through ``.data`` is known by identity
        # NOTE [stop gradient]: so does ortmodule's own form of a call (a rewrite, a draw, dropout,
        # logsigmoid, relu6 with its kink marked ...): relu6(h) as the last op of a no_grad block gave
        # h's layer a gradient 17 off eager's
        return torch.utils._pytree.tree_map_only(torch.Tensor, stop_gradient, out)

    def _own_form(self, func, args, kwargs):
        """ortmodule's own form of ``func(*args, **kwargs)`` for the trace, or ``_PLAIN`` (trace it as is)."""
        if self.watch is not None:  # NOTE [trace traps]
            if getattr(func, "__self__", None) is _DATA:
                # ``t.data`` is not traced: the tracer would bake the value it holds at export time.
                # Read as ``t.detach()``; writes through it are refused (they would go to a copy).
                out = stop_gradient(args[0])
                self.watch.data_view(out, args[0])
                return out
            if func is torch._assert and not inside_call() and isinstance(args[0], torch.Tensor) \
                    and args[0].numel() == 1:
                self.value_check(args[0] != 0)  # NOTE [value checks]
                return None
            if func is torch.Tensor.__bool__ and not inside_call() and args[0].numel() == 1:
                passes = assert_jump()
                if passes is not None:  # NOTE [value checks]: ``assert cond`` / ``assert not cond``
                    return self.value_check(args[0] != 0 if passes else args[0] == 0, passes)
            self.watch.on_call(func, args)
            out = rewrite(func, args, kwargs, self.watch)
            if out is not NOT_REWRITTEN:
                return out
        if func is torch._is_all_true and self.watch is not None and not inside_call():
            return self.value_check(*args, **kwargs)  # NOTE [value checks]
        if func in RANDOM_FUNCS and self.watch is not None and not inside_call():
            return random_call(self, func, args, kwargs)  # NOTE [random draws]
        if func in _VF_RNNS and not inside_call():
            out = self.rnn_dropout_call(func, args, kwargs)
            if out is not NOT_REWRITTEN:
                return out
        if func is _F_DROPOUT:
            return self.dropout_call(args, kwargs)
        if func in _FEATURE_DROPOUTS:
            return self.feature_dropout_call(func, args, kwargs)
        if func in (F.alpha_dropout, F.feature_alpha_dropout) and _dropout_args(None, args, kwargs)[2] \
                and _dropout_args(None, args, kwargs)[1] > 0.0:
            raise UnsupportedTrace(
                f"{func.__name__} at {user_location()} in training: its noise would be drawn by ONNX Runtime's "
                "generator, not torch's as eager does (ortmodule draws the masks of dropout, dropout1d/2d/3d)")
        if func is F.ctc_loss and self.watch is not None and self.watch.torch_nodes and not inside_call():
            from .torch_calls import ctc_loss_call  # NOTE [ctc as a torch node]

            return ctc_loss_call(args, kwargs, user_location())
        if func is torch._grouped_mm and self.watch is not None and self.watch.torch_nodes and not inside_call():
            from .torch_calls import grouped_mm_call  # NOTE [grouped mm as a torch node]

            out = grouped_mm_call(args, kwargs, user_location())
            if out is not None:
                return out
        if func is _F_SDPA:
            out = self.sdpa_call(args, kwargs)
            if out is not NOT_REWRITTEN:
                return out
        if func is F.batch_norm:
            return self._batch_norm(func, args, kwargs)
        if func is F.instance_norm:
            return self._instance_norm(func, args, kwargs)
        if func in (F.cross_entropy, F.nll_loss):
            args, kwargs = _concrete_ignore_index(func, args, kwargs)
        if func in _CLAMPS:
            args, kwargs = _tensor_bounds(args, kwargs)
            out = _clamp_by_tensors(func, args, kwargs)
            if out is not NOT_REWRITTEN:
                return out
        if func is F.cross_entropy:
            b = _cross_entropy_args(args, kwargs)
            if (b["label_smoothing"] > 0.0 and not b["target"].is_floating_point() and b["size_average"] is None
                    and b["reduce"] is None):
                return smoothed_cross_entropy(b["input"], b["target"], b["weight"], b["ignore_index"],
                                              b["reduction"], float(b["label_smoothing"]))
            if (isinstance(b["target"], torch.Tensor) and b["target"].is_floating_point()
                    and b["size_average"] is None and b["reduce"] is None and b["input"].numel() > 0):
                return soft_target_cross_entropy(b["input"], b["target"], b["weight"], b["reduction"],
                                                 float(b["label_smoothing"]))
        if func in (torch.Tensor.detach, torch.detach):
            return stop_gradient(args[0])
        if func in _LOGADDEXP and len(args) == 2 and not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            return _logaddexp(*args, base2=func in (torch.logaddexp2, torch.Tensor.logaddexp2))
        if func in _BCE:
            out = _binary_cross_entropy(func, args, kwargs)
            if out is not NOT_REWRITTEN:
                return out
        if func in _STD:
            return _std(func, args, kwargs)
        if func in _BETA_TERMS:
            out = _without_beta_term(func, args, kwargs)
            if out is not NOT_REWRITTEN:
                return out
        if self.watch is not None and self.watch.jit:
            why = _torch_only(func, args, kwargs)
            if why is not None:
                raise UnsupportedTrace(  # NOTE [as torch] (torch_calls.py)
                    f"{getattr(func, '__name__', func)} at {user_location()} under the TorchScript front end: {why}, "
                    "so the result would differ from eager; the torch.export front end (the default) runs it in torch")
        if func in (F.cosine_similarity, torch.cosine_similarity) and self.watch is not None and self.watch.jit:
            # NOTE [cosine at zero]: the TorchScript exporter writes x1.x2 / max(sqrt(|x1|^2 |x2|^2), eps),
            # whose sqrt has an infinite gradient at a zero vector (NaN gradients where eager's are 0);
            # written as torch's own decomposition (torch.export's): each norm clamped to eps.
            b = dict(zip(("x1", "x2", "dim", "eps"), args))
            b.update(kwargs)
            dim, eps = b.get("dim", 1), b.get("eps", 1e-8)
            n1 = torch.linalg.vector_norm(b["x1"], 2, dim, keepdim=True).clamp(min=eps)
            n2 = torch.linalg.vector_norm(b["x2"], 2, dim, keepdim=True).clamp(min=eps)
            return ((b["x1"] / n1) * (b["x2"] / n2)).sum(dim)
        if func in _LOG1P or func in _EXPM1:
            x = args[0] if args else kwargs["input"]
            if isinstance(x, torch.Tensor) and x.is_floating_point() and len(args) <= 1 and set(kwargs) <= {"input"}:
                return _precise_log1p(x) if func in _LOG1P else _precise_expm1(x)
        if func is F.logsigmoid:
            # NOTE [stable logsigmoid]: both exporters write log(sigmoid(x)), -inf below x ~ -104
            # where torch's value is ~x (DPO's loss, negative sampling): written as -softplus(-x).
            return -F.softplus(-args[0])
        if func in _HARDTANHS:  # NOTE [kinks as torch]
            return grad_kind(func(*args, **kwargs), 1)
        if func in _MAX_MIN and (len(args) > 1 or "dim" in kwargs):
            out = func(*args, **kwargs)
            if isinstance(out, tuple) and len(out) == 2:  # (values, indices); torch.max(a, b) is elementwise
                return type(out)((grad_kind(out[0], 2), out[1]))
            return out
        if func is F.embedding:
            return self._embedding(func, args, kwargs)
        return _PLAIN

    def _no_grad_write(self, func, args, kwargs):
        """An in-place op (or ``out=``) under ``torch.no_grad()``: NOTE [no_grad writes]."""
        # NOTE [no_grad writes]: eager PyTorch records nothing for a write under no_grad. Written
        # into a tensor that needs no grad (a buffer: an EMA, a counter, a memory bank), the result
        # carries no gradient, so the operands are marked, and the op returns its target itself:
        # ``buf.mul_(m).add_(x)`` writes ``buf`` twice (a marked copy as result lost the ``add_``).
        # Written into a tensor that requires grad, eager keeps that tensor's autograd history: the
        # gradient passes the write unchanged, while a graph would differentiate it. Refused.
        target = kwargs.get("out") if kwargs.get("out") is not None else args[0]
        if self.watch is not None and isinstance(target, torch.Tensor) and self.watch.requires_grad_in_eager(target):
            raise UnsupportedTrace(
                f"forward writes a tensor that requires grad in place under torch.no_grad() "
                f"({getattr(func, '__name__', func)} at {user_location()}): eager PyTorch passes the gradient "
                "through that write unchanged, a graph would differentiate it. Write a new tensor instead, e.g. "
                "`y = y + (y.clamp(lo, hi) - y).detach()` for a straight-through clamp")
        mark = lambda t: stop_gradient(t) if t is not target else t  # noqa: E731
        args = (args[0], *torch.utils._pytree.tree_map_only(torch.Tensor, mark, args[1:]))
        kwargs = {k: v if k == "out" else torch.utils._pytree.tree_map_only(torch.Tensor, mark, v)
                  for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _embedding(self, func, args, kwargs):
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        b = dict(zip(names, args))
        b.update(kwargs)
        if b.get("max_norm") is not None:
            raise UnsupportedTrace(
                "an embedding with max_norm (nn.Embedding(max_norm=...)) renormalises the looked-up rows of its "
                "weight in place on every call, a write into a parameter that a compiled graph cannot replay")
        if b.get("sparse") and torch.is_grad_enabled():
            # eager's gradient is a sparse tensor over the looked-up rows (SparseAdam takes only those,
            # and moves a looked-up row whose gradient is 0); ORT computes it dense
            raise UnsupportedTrace(
                "an embedding with sparse=True (nn.Embedding(sparse=True)) has a sparse gradient in eager "
                "PyTorch, ONNX Runtime computes it dense. Use sparse=False with a dense optimizer (torch.optim.SGD, "
                "Adagrad and Adam give the same numbers) to train it in ORT")
        idx = b["input"]
        if isinstance(idx, torch.Tensor) and not idx.is_floating_point():
            # NOTE [negative ids]: ONNX Gather reads -1 as the last row, torch's embedding raises
            # IndexError: a negative id is moved out of range, so the run fails as eager does.
            far = 1 << (30 if idx.dtype == torch.int32 else 40)
            idx = torch.where(idx < 0, idx + far, idx)
            if args:
                args = (idx, *args[1:])
            else:
                kwargs = {**kwargs, "input": idx}
        out = func(*args, **kwargs)
        padding_idx = b.get("padding_idx")
        if padding_idx is None or not torch.is_grad_enabled():
            return out
        # NOTE [stop gradient]: rows looked up at padding_idx get no gradient, as in eager.
        idx = b["input"]
        if padding_idx < 0:
            padding_idx += b["weight"].size(0)
        keep = (idx != padding_idx).unsqueeze(-1)
        return torch.where(keep, out, stop_gradient(out))

    def dropout(self, x: torch.Tensor, p: float, keep: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def dropout_call(self, args, kwargs) -> torch.Tensor:
        x, p, training = _dropout_args(None, args, kwargs)
        if training and p > 0.0:
            return self.dropout(x, p)
        return x

    def rnn_dropout_call(self, func, args, kwargs):
        """NOTE [rnn dropout]: a multi-layer LSTM / GRU / RNN with ``dropout`` in training draws a mask
        between its layers inside torch's kernel (``at::dropout`` on each layer's [T, B, H * dirs]
        output but the last's), a draw no torch node may make (it would move in the stream against the
        masks drawn before the run) and no ONNX op makes as eager does: the model fell back. Written
        out as the kernel runs it: one single-layer call per layer (each a torch node, NOTE [as
        torch]), with our dropout, drawn in eager order, between them; seq-first inside as the kernel
        is, so each mask covers the layer's output in the kernel's memory order."""
        names = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional",
                 "batch_first")
        if len(args) != len(names) or kwargs or not isinstance(args[2], (list, tuple)):
            return NOT_REWRITTEN  # the packed-sequence overload (data, batch_sizes, ...)
        b = dict(zip(names, args))
        p, layers = float(b["dropout"]), int(b["num_layers"])
        if not b["train"] or p <= 0.0:
            return NOT_REWRITTEN
        dirs = 2 if b["bidirectional"] else 1
        params = list(b["params"])
        per_layer = len(params) // layers
        lstm = isinstance(b["hx"], (list, tuple))
        x = b["input"].transpose(0, 1) if b["batch_first"] else b["input"]
        finals: list[list[torch.Tensor]] = []
        for layer in range(layers):
            rows = slice(layer * dirs, (layer + 1) * dirs)
            hx = tuple(h[rows] for h in b["hx"]) if lstm else b["hx"][rows]
            out, *final = func(x, hx, params[layer * per_layer:(layer + 1) * per_layer], b["has_biases"], 1, 0.0,
                               True, b["bidirectional"], False)
            finals.append(final)
            x = self.dropout(out, p) if layer < layers - 1 else out
        if b["batch_first"]:
            x = x.transpose(0, 1)
        return (x, *(torch.cat([f[i] for f in finals], 0) for i in range(len(finals[0]))))

    def feature_dropout_call(self, func, args, kwargs):
        """NOTE [feature dropout]: F.dropout1d/2d/3d zero whole channels: eager draws a [N, C, 1, ...]
        mask (``[C, 1, ...]`` for an input it reads as unbatched), the same call as our masks, so it is
        one, drawn in eager order; ONNX has no such op (the exported form drew on ORT's generator)."""
        x, p, training = _dropout_args(None, args, kwargs)
        batched = _FEATURE_DROPOUTS[func]
        if not training or p <= 0.0 or not isinstance(x, torch.Tensor) or x.dim() < 2 \
                or func is F.dropout1d and x.dim() > 3:  # eager raises, or has nothing to drop
            return func(*args, **kwargs)
        # dropout2d drops dim 1 of any input (a 3-D one is read as [N, C, L]); dropout1d/3d read an
        # input one dim short of batched as unbatched
        return self.dropout(x, p, keep=2 if batched is None or x.dim() == batched else 1)

    def sdpa_call(self, args, kwargs):
        b = _sdpa_args(args, kwargs)
        mask = b["attn_mask"]
        if b["dropout_p"] > 0.0 or mask is not None:  # NOTE [fully masked rows]
            p = float(b["dropout_p"])
            return sdpa_math(
                b["query"], b["key"], b["value"], mask, b["is_causal"], b["scale"],
                b["enable_gqa"], dropout=(lambda w: self.dropout(w, p)) if p > 0.0 else None,
            )
        return NOT_REWRITTEN


# NOTE [nested dropout]: the mode sees only the outermost torch function; a dropout that torch
# calls inside another functional (F.multi_head_attention_forward calls ``dropout`` and
# ``scaled_dot_product_attention`` by their names in torch.nn.functional) ran below it and was
# exported as an ONNX Dropout on ORT's generator. While an export traces, those two names point
# to routers that send a call from the tracing thread to its ExportSemantics, so those masks are
# graph inputs drawn by torch in eager order like every other (NOTE [dropout masks]).
_F_DROPOUT = F.dropout
_VF_RNNS = frozenset({torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu})
_F_SDPA = F.scaled_dot_product_attention
_local = threading.local()
_routing = threading.Lock()
_routing_depth = 0


def _nested_semantics() -> _Base | None:
    """This thread's tracing ExportSemantics if the call runs below it (inside another torch
    function, the mode popped); at top level the mode itself handles the call."""
    semantics = getattr(_local, "semantics", None)
    if semantics is None or torch._C._len_torch_function_stack() > 0:
        return None
    if semantics.watch is not None and not semantics.watch.tracing():
        return None
    return semantics


def _routed_dropout(input, p=0.5, training=True, inplace=False):
    semantics = _nested_semantics()
    if semantics is None:
        return _F_DROPOUT(input, p, training, inplace)
    return semantics.dropout_call((input, p, training, inplace), {})


def _routed_sdpa(*args, **kwargs):
    semantics = _nested_semantics()
    if semantics is not None:
        out = semantics.sdpa_call(args, kwargs)
        if out is not NOT_REWRITTEN:
            return out
    return _F_SDPA(*args, **kwargs)


@contextlib.contextmanager
def route_nested_dropout(semantics: _Base):
    """NOTE [nested dropout]: route F.dropout / F.scaled_dot_product_attention calls of this thread
    to ``semantics`` while it traces; restored when the last export in any thread ends."""
    global _routing_depth
    with _routing:
        if _routing_depth == 0:
            F.dropout, F.scaled_dot_product_attention = _routed_dropout, _routed_sdpa
        _routing_depth += 1
    try:
        with thread_value(_local, "semantics", semantics):
            yield
    finally:
        with _routing:
            _routing_depth -= 1
            if _routing_depth == 0:
                F.dropout, F.scaled_dot_product_attention = _F_DROPOUT, _F_SDPA


def _hint(v) -> int:
    """A size as an int: under torch.export a SymInt's example value, read without adding a guard."""
    if isinstance(v, torch.SymInt):
        hint = v.node.hint
        if hint is None:
            raise ValueError("a dropout input has a data-dependent size")
        return int(hint)
    return int(v)


def _dense_in(order, shape, strides) -> bool:
    """Whether ``strides`` are those of a dense tensor laid out in ``order`` (outermost first)."""
    step = 1
    for d in reversed(order):
        if shape[d] > 1 and strides[d] != step:
            return False
        step *= shape[d]
    return True


def _memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """NOTE [mask layout]: x's dims from the outermost in memory; None if x is contiguous."""
    if x.dim() < 2:
        return None
    shape, strides = [_hint(d) for d in x.shape], [_hint(s) for s in x.stride()]
    if _dense_in(range(x.dim()), shape, strides):
        return None  # contiguous
    # empty_like(x) keeps x's strides only where x is dense and non-overlapping.
    order = tuple(sorted(range(x.dim()), key=lambda d: (-strides[d], d)))
    return order if _dense_in(order, shape, strides) else None


def _running_stats(rm, rv, mean, var, momentum: float, n):
    """torch's running-stat update from the batch mean and biased variance over ``n`` values: the
    variance is stored unbiased (NOTE [batchnorm stats])."""
    return rm * (1.0 - momentum) + mean * momentum, rv * (1.0 - momentum) + var * (n / max(n - 1, 1)) * momentum


class ExportSemantics(_Base):
    """Trace pass: dropout reads its mask from graph inputs; BatchNorm updates its stats explicitly."""

    def __init__(self, watch: TraceWatch | None = None) -> None:
        super().__init__()
        self.masks: list[MaskSpec] = []
        self.mask_sizes: list[tuple] = []  # each mask's sizes as traced (SymInts under torch.export)
        self.buffer_writes: dict[int, torch.Tensor] = {}  # id(buffer clone) -> its new value
        self.checks: list[tuple[torch.Tensor, str]] = []  # NOTE [value checks]: (all true?, where)
        self.watch = watch

    # NOTE [value checks]: torch.distributions validates its arguments and samples by default
    # (``if not torch._is_all_true(constraint.check(value)): raise ValueError(...)``): a read of tensor
    # values into Python, which no graph can replay, so every model that builds a Normal or a
    # Categorical in forward (policies, VAEs, mixture heads) fell back to eager. The check is computed
    # in the graph instead, as one extra boolean output (after the mutated buffers), and read after
    # each run, before anything is written back: where it is false, the eager forward runs on the same
    # inputs and raises eager's own ValueError (the one that names the parameter and its values). The
    # trace carries on as if the check passed.
    # An ``assert`` on a tensor in forward (``assert torch.isfinite(x).all()``, ``assert not mask.any()``,
    # ``assert a.all() and b.all()``, ``torch._assert(cond, msg)``) or an ``if ...: raise`` (with ``or``
    # between operands) is the same kind of check: its ``bool(tensor)`` is seen at a conditional jump
    # over, or into, straight code ending in ``raise`` (:func:`assert_jump`), and answered so that the
    # trace goes on past the raise. ``if a.any() and b.any(): raise`` is not (the first operand alone
    # does not decide it): a value read, as any branch.
    def value_check(self, valid: torch.Tensor, answer: bool = True) -> bool:
        self.checks.append((valid.all(), user_location()))
        return answer

    def dropout(self, x, p, keep: int = 0):
        if p >= 1.0:
            return x * 0.0
        # ``keep``: a feature dropout's mask has x's first ``keep`` dims and ones after (NOTE [feature
        # dropout]); eager draws it as a fresh contiguous tensor of that shape.
        like = x[(slice(None),) * keep + (slice(0, 1),) * (x.dim() - keep)] if keep else x
        if self.watch is not None:
            self.watch.random_draws += 1
        k = len(self.masks)
        self.mask_sizes.append(tuple(like.shape))
        self.masks.append(MaskSpec(tuple(_hint(d) for d in like.shape), x.dtype, p,
                                   order=None if keep else _memory_order(x)))
        return x * torch.ops.ortmodule.dropout_mask(like, p, k)  # the mask holds 0 or 1 / (1 - p)

    def random_draw(self, sizes, dtype, fill, params, device, order):
        """A placeholder for one random draw, made before each run (NOTE [random draws])."""
        if self.watch is not None:
            self.watch.random_draws += 1
        k = len(self.masks)
        sizes = tuple(sizes)
        self.mask_sizes.append(sizes)
        where = None if device is None else str(torch.device(device))
        self.masks.append(RandomSpec(tuple(_hint(d) for d in sizes), dtype, fill, tuple(params), where, order=order))
        if fill == "randperm":  # a real permutation and in-range values: the TorchScript tracer runs on them
            like = torch.arange(sizes[0], dtype=dtype, device=device)
        elif fill == "random_" and params:
            like = torch.full(sizes, params[0] if len(params) > 1 else 0, dtype=dtype, device=device)
        else:
            like = torch.zeros(sizes, dtype=dtype, device=device)
        return torch.ops.ortmodule.random_value(like, k)

    def _batch_norm_export(self, func, x, rm, rv, b, dims, n):
        """torch.export: the running statistics are new values (NOTE [buffer writes]), and the
        normalisation a stat-less training ``batch_norm``, which mutates nothing, so it stays one
        ``aten.batch_norm`` written as BatchNormalization(training_mode=1) (NOTE [torch.export front
        end]). A buffer written in place as well as here would need an order: refused."""
        if id(rm) in self.buffer_writes or id(rv) in self.buffer_writes:
            raise ExportError("a BatchNorm's running statistics are updated twice in one forward")
        momentum = b["momentum"]
        xd = stop_gradient(x)
        kept = xd.mean(dims, keepdim=True)  # one pass over x for both (a ReduceMean without keepdims was a second)
        mean = kept.squeeze(dims)
        centred = xd - kept  # torchlib has no translation of var: written out
        var = (centred * centred).mean(dims)
        self.buffer_writes[id(rm)], self.buffer_writes[id(rv)] = _running_stats(rm, rv, mean, var, momentum, n)
        return func(x, None, None, b["weight"], b["bias"], True, momentum, b["eps"])

    def _instance_norm(self, func, args, kwargs):
        """NOTE [instance norm stats]: InstanceNorm with ``track_running_stats`` normalises each instance
        by its own statistics and moves the running ones by their mean over the batch (torch: a batch
        norm over [1, N*C, ...] with repeated running stats, averaged back over N). The exported
        graph dropped that update: the statistics stayed at their initial values, and eval-mode
        outputs were 4% off eager. Written out as the BatchNorm update is (NOTE [batchnorm stats])."""
        names = ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")
        b = {"running_mean": None, "running_var": None, "weight": None, "bias": None, "use_input_stats": True,
             "momentum": 0.1, "eps": 1e-5}
        b.update(zip(names, args))
        b.update(kwargs)
        x, rm, rv = b["input"], b["running_mean"], b["running_var"]
        if not (b["use_input_stats"] and rm is not None and rv is not None):
            return func(*args, **kwargs)
        if b["momentum"] is None:
            raise UnsupportedTrace("InstanceNorm with momentum=None (a cumulative average) is not supported")
        dims = list(range(2, x.dim()))
        n = x[0, 0].numel()
        export = self.watch is not None and not self.watch.jit
        if export and (id(rm) in self.buffer_writes or id(rv) in self.buffer_writes):
            raise ExportError("an InstanceNorm's running statistics are updated twice in one forward")
        with contextlib.nullcontext() if export else torch.no_grad():
            xd = stop_gradient(x) if export else x.detach()
            centred = xd - xd.mean(dims, keepdim=True)
            mean, var = xd.mean(dims).mean(0), (centred * centred).mean(dims).mean(0)
            new_mean, new_var = _running_stats(rm, rv, mean, var, b["momentum"], n)
            if export:
                self.buffer_writes[id(rm)], self.buffer_writes[id(rv)] = new_mean, new_var
            else:
                rm.copy_(new_mean)
                rv.copy_(new_var)
        return func(x, None, None, b["weight"], b["bias"], True, b["momentum"], b["eps"])

    def _batch_norm(self, func, args, kwargs):
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        b = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
        b.update(zip(names, args))
        b.update(kwargs)
        x, rm, rv = b["input"], b["running_mean"], b["running_var"]
        if not (b["training"] and rm is not None and rv is not None):
            return func(*args, **kwargs)
        momentum = b["momentum"]
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // x.size(1)
        if self.watch is not None and not self.watch.jit:
            return self._batch_norm_export(func, x, rm, rv, b, dims, n)
        with torch.no_grad():
            xd = x.detach()
            mean = xd.mean(dims)
            var = xd.var(dims, unbiased=False)
            # NOTE [no writes into inputs]: ORT's BatchNormalization may write its running-stat
            # outputs in place into its running-stat inputs. In training mode Y does not read them,
            # so the node gets these intermediates instead of the buffers, which are bound
            # zero-copy to the module's storage and must only change through the outputs below.
            stat_mean, stat_var = mean.clone(), var.clone()
            new_mean, new_var = _running_stats(rm, rv, mean, var, momentum, n)
            rm.copy_(new_mean)
            rv.copy_(new_var)
        return func(x, stat_mean, stat_var, b["weight"], b["bias"], True, momentum, b["eps"])
