"""Losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (weights, ignore_index, reductions)."""

from __future__ import annotations

import onnx_ir as ir

from ..registry import GradBuilder, attr, input_or_none, register
from .indexing import scatter_elements_add


def _per_sample_coefficient(g: GradBuilder, node: ir.Node, scores: ir.Value, labels: ir.Value, dloss):
    """d loss / d (per-sample loss) times the sample's weight; also returns the safe labels.

    # NOTE [loss reductions]: per sample i the loss is -w[label_i] * logp[i, label_i], with
    # w = 0 where label_i == ignore_index. 'mean' divides the sum by sum_i w[label_i] (the number of
    # kept samples when there are no weights), as torch and the ONNX spec both do.
    """
    weights = input_or_none(node, 2)
    ignore_index = attr(node, "ignore_index")
    reduction = attr(node, "reduction", "mean")
    dtype = scores.dtype
    safe = labels
    valid = None
    if ignore_index is not None:
        valid = g.op("Not", [g.op("Equal", [labels, g.const(ignore_index, labels.dtype)])])
        safe = g.op("Where", [valid, labels, g.const(0, labels.dtype)], dtype=labels.dtype)
    if weights is not None:
        w = g.op("Gather", [weights, safe], dtype=dtype)
        if valid is not None:
            w = g.mul(w, g.op("Cast", [valid], {"to": int(dtype)}, dtype=dtype))
    elif valid is not None:
        w = g.op("Cast", [valid], {"to": int(dtype)}, dtype=dtype)
    else:
        w = None
    coef = dloss
    if w is not None:
        coef = g.mul(coef, w)
    if reduction == "mean":
        if w is not None:
            denom = g.op("ReduceSum", [w], {"keepdims": 0}, dtype=dtype)
            # NOTE [all ignored]: a batch whose labels are all ignore_index (a chunk of padding, an MLM
            # batch with nothing masked) has loss 0/0 = NaN in eager too, but eager's gradient is 0 (its
            # backward writes only the kept samples' entries); dloss * 0 / 0 made ours NaN, and the
            # optimizer step then NaN every weight. A zero total weight divides by 1 (every sample's
            # weight is 0 then). A Div, not a Where on the coefficient: the zero-gradient
            # specialisation (passes/zero_grads.py) still sees the coefficient as dloss's multiple.
            one = g.const(1.0, dtype)
            denom = g.op("Where", [g.op("Equal", [denom, g.const(0.0, dtype)]), one, denom], dtype=dtype)
        else:
            denom = g.op("Cast", [g.op("Size", [labels])], {"to": int(dtype)}, dtype=dtype)
        coef = g.op("Div", [coef, denom], dtype=dtype)
    if w is None or reduction != "none":
        # Broadcast a scalar coefficient to one per sample.
        coef = g.op("Expand", [coef, g.op("Shape", [labels])], dtype=dtype)
    return g.op("Unsqueeze", [coef, g.ints([1])], dtype=dtype), safe


def _add_at_labels(g: GradBuilder, base: ir.Value, safe_labels: ir.Value, updates: ir.Value) -> ir.Value:
    """``base`` plus ``updates`` (shape [N, 1, d...]) at the label positions along axis 1.

    # NOTE [no one-hot]: a ScatterElements(add) touches N entries where a OneHot would build and
    # multiply an [N, C] tensor (GPT-2's LM loss: C = 50257, measured 117 ms of a 660 ms backward).
    """
    index = g.op("Unsqueeze", [safe_labels, g.ints([1])], dtype=safe_labels.dtype)
    return scatter_elements_add(g, base, index, updates, 1, shape=base.shape)


@register("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_grad(g: GradBuilder, node: ir.Node, dys):
    scores, labels = node.inputs[0], node.inputs[1]
    # NOTE [softmax from the scores]: the probabilities are recomputed from the scores, which the
    # backward keeps anyway (a model returns its logits), instead of saving the [N, C] log-probs:
    # GPT-2's LM loss keeps 103 MB less at its peak for one Softmax (11 ms) in place of an Exp (8 ms).
    prob = g.op("Softmax", [scores], {"axis": 1}, dtype=scores.dtype)
    dscores = None
    if dys[0] is not None:
        coef, safe = _per_sample_coefficient(g, node, scores, labels, dys[0])
        dscores = _add_at_labels(g, g.mul(prob, coef), safe, g.neg(coef))
    if len(dys) > 1 and dys[1] is not None:  # through the log_prob output, as LogSoftmax
        s = g.op("ReduceSum", [dys[1], g.ints([1])], {"keepdims": 1})
        d_lp = g.op("Sub", [dys[1], g.mul(prob, s)])
        dscores = d_lp if dscores is None else g.add(dscores, d_lp)
    return [dscores, None] + [None] * (len(node.inputs) - 2)


@register("NegativeLogLikelihoodLoss")
def nll_loss_grad(g: GradBuilder, node: ir.Node, dys):
    inp, labels = node.inputs[0], node.inputs[1]
    coef, safe = _per_sample_coefficient(g, node, inp, labels, dys[0])
    zeros = g.op("ConstantOfShape", [g.shape_of(inp)], {"value": ir.tensor([0.0], dtype=inp.dtype)},
                 dtype=inp.dtype, shape=inp.shape)
    d = _add_at_labels(g, zeros, safe, g.neg(coef))
    return [d, None] + [None] * (len(node.inputs) - 2)
