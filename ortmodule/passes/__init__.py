"""Graph passes: on the forward graph before autodiff (``FORWARD_PASSES``), lowerings of the
partitioned forward model (``lower_softmax_cross_entropy``), and both on the no-grad inference
graph (``optimize_inference``).

Each pass changes the graph in place and returns how many nodes it changed (0: nothing to do).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from .control_flow import inline_constant_ifs
from .precision import precise_double_kernels, precise_sigmoid, propagate_nan_in_max, stable_logs
from .proto import node_attrs
from .rows import select_rows_early

BATCH_STATS_KEY = "pkg.ortmodule.batch_stats"


def _const_ints(v: ir.Value | None) -> list[int] | None:
    if v is None:
        return None
    tensor = ir.convenience.get_const_tensor(v)
    return None if tensor is None else [int(i) for i in tensor.numpy().reshape(-1)]


def _reduce_mean_of(v: ir.Value | None, x: ir.Value, axes: list[int], keepdims: int) -> bool:
    """Whether ``v`` is ``ReduceMean(x, axes, keepdims)`` (axes as input or attribute)."""
    node = v.producer() if v is not None else None
    if node is None or node.op_type != "ReduceMean" or node.domain != "" or node.inputs[0] is not x:
        return False
    a = node.attributes.get("axes")
    got = list(a.value) if a is not None else _const_ints(node.inputs[1] if len(node.inputs) > 1 else None)
    k = node.attributes.get("keepdims")
    return got == axes and (1 if k is None else k.value) == keepdims


def batch_stats_batch_norm(graph: ir.Graph) -> int:
    """Run train-mode BatchNormalization as a plain affine on the batch statistics it is given.

    # NOTE [batch-stats BN]: the exporter feeds each train-mode BatchNormalization the batch mean and
    # biased variance it computed itself (NOTE [batchnorm stats]), as ReduceMean(x) and
    # ReduceMean((x - mean(x))^2). ORT's training-mode kernel would compute them a second time, and
    # the gradient rule a third. When a node's mean/var inputs are exactly those values and its
    # running-stat outputs are unused, it becomes an inference-mode node (the same Y) marked
    # ``pkg.ortmodule.batch_stats``, whose gradient rule uses the batch formula with the saved
    # statistics (autodiff/rules/norm.py).
    """
    changed = 0
    graph_outputs = set(graph.outputs)
    for node in graph:
        if node.op_type != "BatchNormalization" or node.domain != "" or len(node.inputs) < 5:
            continue
        training = node.attributes.get("training_mode")
        if training is None or not training.value:
            continue
        x, _, _, mean, var = node.inputs[:5]
        if x is None or x.shape is None or any(o.uses() or o in graph_outputs for o in node.outputs[1:]):
            continue
        axes = [0, *range(2, x.shape.rank())]
        if not _reduce_mean_of(mean, x, axes, 0):
            continue
        var_node = var.producer() if var is not None else None
        if var_node is None or not _reduce_mean_of(var, var_node.inputs[0], axes, 0):
            continue
        sq = var_node.inputs[0].producer()
        if sq is None or sq.op_type != "Mul" or sq.inputs[0] is not sq.inputs[1]:
            continue
        centred = sq.inputs[0].producer()
        if centred is None or centred.op_type != "Sub" or centred.inputs[0] is not x:
            continue
        if not _reduce_mean_of(centred.inputs[1], x, axes, 1):
            continue
        node.attributes["training_mode"] = ir.AttrInt64("training_mode", 0)
        node.resize_outputs(1)
        node.metadata_props[BATCH_STATS_KEY] = "1"
        changed += 1
    return changed


def drop_noop_casts(graph: ir.Graph) -> int:
    """Remove Casts to the dtype their input already has.

    # NOTE [no-op casts]: models upcast before a loss (HF GPT-2: ``logits.float()``); traced in
    # fp32 that is a Cast FLOAT->FLOAT, which ORT keeps when its result is a graph output: a copy of
    # the [tokens, vocab] logits (GPT-2: 10.7 ms per step). The Cast's uses, and its place among the
    # graph outputs, go to its input, unless that input is a graph input, an initializer or already
    # an output.
    """
    changed = 0
    inputs, outputs = set(graph.inputs), list(graph.outputs)
    for node in list(graph):
        if node.op_type != "Cast" or node.domain != "" or len(node.inputs) != 1:
            continue
        (x,), (y,) = node.inputs, node.outputs
        to = node.attributes.get("to")
        if x is None or x.dtype is None or to is None or int(to.value) != int(x.dtype):
            continue
        if y in outputs and (x in inputs or x in outputs or x.is_initializer()):
            continue
        y.replace_all_uses_with(x, replace_graph_outputs=True)
        outputs = list(graph.outputs)
        graph.remove(node, safe=True)
        changed += 1
    return changed


def keep_layer_norm_stats(graph: ir.Graph) -> int:
    """Give every fp32 LayerNormalization its optional ``Mean`` and ``InvStdDev`` outputs.

    # NOTE [save LN stats]: the kernel computes both anyway; saved (one value per row), they spare
    # the gradient rule recomputing the mean, the variance and the normalised input from x (four
    # passes over the activation per LayerNorm). Only fp32: the outputs come in the stash type.
    """
    changed = 0
    for node in graph:
        if node.op_type != "LayerNormalization" or node.domain != "" or len(node.outputs) != 1:
            continue
        x = node.inputs[0]
        stash = node.attributes.get("stash_type")
        if x is None or x.shape is None or x.dtype != ir.DataType.FLOAT or (stash is not None and stash.value != 1):
            continue
        rank = x.shape.rank()
        a = node.attributes.get("axis")
        axis = (a.value if a is not None else -1) % rank
        y = node.outputs[0]
        node.resize_outputs(3)
        for out, suffix in zip(node.outputs[1:], (".mean", ".inv_std_dev")):
            out.dtype = ir.DataType.FLOAT
            out.shape = ir.Shape([*list(x.shape)[:axis], *([1] * (rank - axis))])
            out.name = f"{y.name}{suffix}"
        changed += 1
    return changed


def pool_before_relu(graph: ir.Graph) -> int:
    """Rewrite ``MaxPool(Relu(x))`` as ``Relu(MaxPool(x))``.

    # NOTE [pool before relu]: ReLU is monotonic, so the max of the rectified window is the
    # rectified max, and the gradients agree as well: where the window's max is positive both pick
    # its first maximum with slope 1; where it is not, eager's pick is a zero of ReLU whose slope
    # is 0, and so is ours. The ReLU and its gradient then run on the pooled tensor (a quarter of
    # the size for 2x2 pooling; the CNN benchmark: ~0.9 ms of its step). Only where the Relu's
    # result feeds the MaxPool alone and the MaxPool returns no indices.
    """
    changed = 0
    outputs = set(graph.outputs)
    for relu in list(graph):
        if relu.op_type != "Relu" or relu.domain != "":
            continue
        (x,), (r,) = relu.inputs, relu.outputs
        uses = list(r.uses())
        if x is None or r in outputs or len(uses) != 1:
            continue
        pool = uses[0].node
        if pool.op_type != "MaxPool" or pool.domain != "" or len(pool.outputs) != 1 or uses[0].idx != 0:
            continue
        (p,) = pool.outputs
        pool.replace_input_with(0, x)  # pool the pre-activation
        p.replace_all_uses_with(r, replace_graph_outputs=True)  # the rectified pooled value, downstream
        relu.replace_input_with(0, p)
        r.shape = p.shape
        graph.remove(relu)
        graph.insert_after(pool, relu)
        outputs = set(graph.outputs)
        changed += 1
    return changed


FORWARD_PASSES = (inline_constant_ifs, stable_logs, precise_sigmoid, precise_double_kernels, drop_noop_casts,
                  select_rows_early, keep_layer_norm_stats, batch_stats_batch_norm, pool_before_relu,
                  propagate_nan_in_max)


def score_ranks(nodes) -> dict[str, int]:
    """The rank of each SoftmaxCrossEntropyLoss's scores among ``nodes`` (ir), for the lowering."""
    return {n.inputs[0].name: n.inputs[0].shape.rank() for n in nodes
            if n.op_type == "SoftmaxCrossEntropyLoss" and n.inputs[0].shape is not None}


def lower_softmax_cross_entropy(model: onnx.ModelProto, ranks: dict[str, int]) -> int:
    """In a forward model, split ``SoftmaxCrossEntropyLoss(scores [N, C], labels) -> (loss[, log_prob])``
    into ``LogSoftmax`` + ``NegativeLogLikelihoodLoss``.

    # NOTE [lowered cross-entropy]: ORT runs SoftmaxCrossEntropyLoss as its ONNX function body, which
    # reshapes the scores to [N, C, 1] and takes LogSoftmax over axis 1 of that, not the last axis
    # (GPT-2's [512, 50257]: 43 ms, and 16 ms of Reshape copies), and whose ``log_prob`` output is an
    # Identity copy (11 ms). Written out, one LogSoftmax over the last axis feeds the NLL (and is the
    # log_prob output, where the node has one).
    """
    changed = 0
    nodes = []
    names = {v for n in model.graph.node for v in (*n.input, *n.output)}
    for node in model.graph.node:
        if (node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx")
                or ranks.get(node.input[0]) != 2):
            nodes.append(node)
            continue
        log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else f"{node.output[0]}.log_prob"
        while log_prob not in node.output and log_prob in names:
            log_prob += "_"
        attrs = node_attrs(node)
        nodes.append(onnx.helper.make_node("LogSoftmax", [node.input[0]], [log_prob], axis=1,
                                           name=f"{node.name}/LogSoftmax"))
        nodes.append(onnx.helper.make_node("NegativeLogLikelihoodLoss", [log_prob, *node.input[1:]],
                                           [node.output[0]], name=f"{node.name}/NLL", **attrs))
        changed += 1
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


def run_forward_passes(graph: ir.Graph) -> int:
    return sum(p(graph) for p in FORWARD_PASSES)


# The forward passes that keep a graph's outputs as they are (keep_layer_norm_stats adds outputs).
INFERENCE_PASSES = (stable_logs, precise_sigmoid, precise_double_kernels, drop_noop_casts, select_rows_early,
                    batch_stats_batch_norm, pool_before_relu, propagate_nan_in_max)


def optimize_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """The exported forward for a no-grad session: the inference passes and the cross-entropy
    lowering; ``model`` itself (unchanged) where none applies."""
    irm = ir.from_proto(model)
    changed = sum(p(irm.graph) for p in INFERENCE_PASSES)
    ranks = score_ranks(irm.graph)
    optimized = ir.to_proto(irm)
    changed += lower_softmax_cross_entropy(optimized, ranks)
    return optimized if changed else model
