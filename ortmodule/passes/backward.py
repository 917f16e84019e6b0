"""Passes on backward models (proto level), run on the full backward and on each specialised one."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .label_grad import fold_label_grad
from .proto import node_attrs


def lower_sums(model: onnx.ModelProto) -> int:
    """Write each gradient-accumulating ``Sum`` as a chain of ``Add`` (and ``ScatterElements``).

    # NOTE [sum as adds]: onnxruntime's CPU Sum runs at half the speed of Add (measured on
    # [16, 128, 256]: Sum of 3 inputs 0.44 ms, two Adds 0.21 ms; Sum of 2: 0.22 ms, Add 0.10 ms).
    # Sum and Add broadcast alike, so the chain computes the same value. A two-term Sum with a
    # C-less Gemm's result stays: onnxruntime folds it into the Gemm as its C input (GemmSumFusion).
    The autodiff builder still emits Sum: the absent-gradient specialisation drops zero terms of a
    Sum, which is only sound for the accumulation it stands for.
    """
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    consumers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    for o in graph.output:
        consumers[o.name] = consumers.get(o.name, 0) + 1
    changed = 0
    folded: set[str] = set()  # outputs of the scatters folded into a sum
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        ins = [i for i in node.input if i]
        if node.op_type != "Sum" or node.domain not in ("", "ai.onnx") or len(ins) < 2:
            nodes.append(node)
            continue
        scatters = [i for i in ins if _scatter_onto_zeros(producers.get(i), producers, consumers)]
        if not scatters and len(ins) == 2 and any(_is_cless_gemm(producers.get(i)) for i in ins):
            nodes.append(node)
            continue
        # NOTE [scatter into the sum]: a term that scatters onto zeros (an embedding's gradient) is
        # applied to the sum of the other terms instead:
        # ScatterElements(acc, i, u, add) = acc + ScatterElements(0, i, u, add) when acc has the zeros'
        # shape, which holds for the builder's Sums (contributions to one value all have its shape;
        # the only other Sum, the Max/Min rule's mask count, adds Casts). GPT-2's tied [50257, 128]
        # embedding: no zero tensor copied, no Add over it. The scatter keeps its op, axis and
        # reduction: an exact ScatterElements, never a ScatterND (NOTE [exact scatters] in
        # ortmodule/autodiff/rules/indexing.py).
        plain = [i for i in ins if i not in scatters]
        if not plain:
            plain, scatters = scatters[:1], scatters[1:]
        acc = plain[0]
        steps = [("Add", t) for t in plain[1:]] + [("Scatter", t) for t in scatters]
        for k, (op, term) in enumerate(steps, start=1):
            out = node.output[0] if k == len(steps) else f"{node.output[0]}/acc_{k}"
            if op == "Add":
                nodes.append(helper.make_node("Add", [acc, term], [out], name=f"{node.name}/add_{k}"))
            else:
                scatter = producers[term]
                folded.add(scatter.output[0])
                folded_node = onnx.NodeProto()
                folded_node.CopyFrom(scatter)
                folded_node.input[0], folded_node.output[0] = acc, out
                folded_node.name = f"{node.name}/scatter_{k}"
                nodes.append(folded_node)
            acc = out
        changed += 1
    if changed:
        # The folded scatters are read by nothing now; a zero tensor only they read goes with them.
        nodes = [n for n in nodes if n.output[0] not in folded]
        live = {o.name for o in graph.output} | {i for n in nodes for i in n.input}
        nodes = [n for n in nodes if n.op_type != "ConstantOfShape" or any(o in live for o in n.output)]
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _scatter_onto_zeros(node: onnx.NodeProto | None, producers: dict, consumers: dict[str, int]) -> bool:
    """``ScatterElements(zeros, i, u, reduction=add)`` read only once (NOTE [exact scatters])."""
    if node is None or node.op_type != "ScatterElements" or node.domain not in ("", "ai.onnx"):
        return False
    if consumers.get(node.output[0], 0) != 1:
        return False
    if node_attrs(node).get("reduction", "none") != "add":  # with "none", repeated indices are undefined
        return False
    data = producers.get(node.input[0])
    if data is None or data.op_type != "ConstantOfShape":
        return False
    value = next((a.t for a in data.attribute if a.name == "value"), None)
    return value is None or not onnx.numpy_helper.to_array(value).any()


def _is_cless_gemm(node: onnx.NodeProto | None) -> bool:
    return node is not None and node.op_type == "Gemm" and len([i for i in node.input if i]) == 2


def split_leading_sums(model: onnx.ModelProto) -> int:
    """Write a ``ReduceSum`` over the leading axes ``[0, 1, ..., m-1]`` (m >= 2) as a chain of
    one-axis ReduceSums, the innermost of them first.

    # NOTE [chained sums]: a bias's or a LayerNorm weight's gradient sums [batch, seq, hidden] over
    # (batch, seq). onnxruntime's CPU ReduceSum flattens that to [tokens, hidden] and reduces axis 0
    # slowly and with one long float accumulation per column: [64, 128, 256] took 7.8 ms at 3.7e-6
    # relative error, reduced over seq then batch 0.26 ms at 3.2e-7 ([16, 512, 768]: 8.0 -> 1.1 ms;
    # [8, 1024, 768]: 8.4 -> 1.7 ms; [16, 128, 256]: 0.20 -> 0.09 ms; torch's own error 2e-7). Axes
    # must be a constant; reducing the highest axis first leaves the lower ones where they were. In a
    # whole model the gain is small (A/B in one process, interleaved, fwd+bwd medians: HF BERT-4L h256
    # s128 b16 371.6 -> 366.0 ms, b64 1591 -> 1562 ms; GPT-2 2L e128 b32 751 -> 741 ms, b8 182 -> 185
    # ms, noise), the precision gain is not: BERT's LayerNorm weight gradients 1.6e-6 -> 5.2e-7 from
    # float64's (eager: 8.9e-7).
    """
    graph = model.graph
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.output and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = onnx.numpy_helper.to_array(n.attribute[0].t)
    changed = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        axes = consts.get(node.input[1]) if node.op_type == "ReduceSum" and len(node.input) > 1 else None
        if axes is None or node.domain not in ("", "ai.onnx") or axes.ndim != 1 or axes.size < 2 \
                or sorted(int(a) for a in axes) != list(range(axes.size)):
            nodes.append(node)
            continue
        keepdims = node_attrs(node).get("keepdims", 1)
        acc = node.input[0]
        for k, axis in enumerate(reversed(range(axes.size))):
            name = f"{node.name or node.output[0]}/axis_{axis}"
            axis_const = f"{name}/axes"
            nodes.append(helper.make_node("Constant", [], [axis_const],
                                          value=onnx.numpy_helper.from_array(np.array([axis], np.int64), axis_const)))
            out = node.output[0] if k == axes.size - 1 else f"{name}/sum"
            nodes.append(helper.make_node("ReduceSum", [acc, axis_const], [out], name=name, keepdims=keepdims))
            acc = out
        changed += 1
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def run_backward_passes(model: onnx.ModelProto) -> int:
    return fold_label_grad(model) + lower_sums(model) + split_leading_sums(model)
