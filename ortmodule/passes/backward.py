"""Passes on backward models (proto level), run on the full backward and on each specialised one."""

from __future__ import annotations

import onnx
from onnx import helper

from .label_grad import fold_label_grad


def lower_sums(model: onnx.ModelProto) -> int:
    """Write each gradient-accumulating ``Sum`` as a chain of ``Add``.

    # NOTE [sum as adds]: onnxruntime's CPU Sum runs at half the speed of Add (measured on
    # [16, 128, 256]: Sum of 3 inputs 0.44 ms, two Adds 0.21 ms; Sum of 2: 0.22 ms, Add 0.10 ms).
    # Sum and Add broadcast alike, so the chain computes the same value. A two-term Sum with a
    # C-less Gemm's result stays: onnxruntime folds it into the Gemm as its C input (GemmSumFusion).
    The autodiff builder still emits Sum: the absent-gradient specialisation drops zero terms of a
    Sum, which is only sound for the accumulation it stands for.
    """
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    changed = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        ins = [i for i in node.input if i]
        if node.op_type != "Sum" or node.domain not in ("", "ai.onnx") or len(ins) < 2:
            nodes.append(node)
            continue
        if len(ins) == 2 and any(_is_cless_gemm(producers.get(i)) for i in ins):
            nodes.append(node)
            continue
        acc = ins[0]
        for k, term in enumerate(ins[1:], start=1):
            last = k == len(ins) - 1
            out = node.output[0] if last else f"{node.output[0]}/add_{k}"
            nodes.append(helper.make_node("Add", [acc, term], [out], name=f"{node.name}/add_{k}"))
            acc = out
        changed += 1
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _is_cless_gemm(node: onnx.NodeProto | None) -> bool:
    return node is not None and node.op_type == "Gemm" and len([i for i in node.input if i]) == 2


def run_backward_passes(model: onnx.ModelProto) -> int:
    return fold_label_grad(model) + lower_sums(model)
