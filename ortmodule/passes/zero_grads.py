"""Specialise a backward model for output gradients that autograd did not provide (``None``).

# NOTE [absent output grads]: a model often returns outputs nobody differentiates (HF models return
# ``loss`` and ``logits``; only the loss is backpropagated). Autograd then hands the Function ``None``
# for those outputs (``ctx.set_materialize_grads(False)``). Feeding zeros instead would allocate
# and add a tensor the size of the output (GPT-2's logits: 103 MB per step). This pass treats the
# absent gradient inputs as symbolic zeros and propagates them: ``Sum`` drops them, linear ops of a
# zero give a zero, and a parameter gradient that ends up zero is returned as ``None``, as eager
# autograd leaves ``.grad`` alone. An op that would need a real zero tensor makes the pass give up
# (``None``), and the caller feeds materialised zeros to the full backward instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import onnx

# Ops whose output is zero when any of the listed input positions is zero (linear in that input,
# or multiplying by it). ``None``: any input position.
_ZERO_IF_ANY = {
    "Mul": None, "MatMul": None, "FusedMatMul": None,
    "Div": (0,), "Gemm": (0, 1),
}
# Ops whose output is zero when every float data input is zero (the other inputs are shapes/axes).
_ZERO_IF_DATA = {
    "Identity": (0,), "Neg": (0,), "Cast": (0,), "Reshape": (0,), "Transpose": (0,), "Squeeze": (0,),
    "Unsqueeze": (0,), "Flatten": (0,), "Expand": (0,), "Tile": (0,), "Slice": (0,),
    "ReduceSum": (0,), "ReduceMean": (0,), "Gather": (0,), "GatherElements": (0,), "GatherND": (0,),
    "Pad": (0,), "Split": (0,), "Where": (1, 2), "Concat": None,
    "ScatterElements": (0, 2), "ScatterND": (0, 2),
}


@dataclasses.dataclass(frozen=True)
class SpecialisedBackward:
    model: onnx.ModelProto
    outputs: list[str]  # the kept backward outputs (gradients known to be zero are dropped)


def specialise_zero_grads(model: onnx.ModelProto, zero_inputs: Collection[str]) -> SpecialisedBackward | None:
    """``model`` with the graph inputs ``zero_inputs`` known to be zero; ``None`` if that needs zeros."""
    graph = model.graph
    zero = set(zero_inputs)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        ins = list(node.input)
        if not any(i in zero for i in ins if i):
            nodes.append(node)
            continue
        op = node.op_type
        if op == "Sum":
            rest = [i for i in ins if i not in zero]
            if not rest:
                zero.update(node.output)
                continue
            new = onnx.NodeProto()
            new.CopyFrom(node)
            del new.input[:]
            if len(rest) == 1:
                new.op_type = "Identity"
            new.input.extend(rest)
            nodes.append(new)
            continue
        if op == "Gemm" and len(ins) == 3 and ins[2] and ins[2] not in zero:
            return None  # alpha*A@B + beta*C with a zero product would need C's broadcast: rare, give up
        positions = _ZERO_IF_ANY.get(op, False)
        if positions is not False:
            if any(i in zero for k, i in enumerate(ins) if positions is None or k in positions):
                zero.update(node.output)
                continue
            return None
        positions = _ZERO_IF_DATA.get(op, False)
        if positions is not False:
            data = [i for k, i in enumerate(ins) if i and (positions is None or k in positions)]
            if data and all(i in zero for i in data):
                zero.update(node.output)
                continue
        return None
    kept = [o for o in graph.output if o.name not in zero]
    if any(o.name in zero_inputs for o in kept):
        return None
    live = {o.name for o in kept}
    needed: list[onnx.NodeProto] = []
    for node in reversed(nodes):
        if any(o in live for o in node.output):
            needed.append(node)
            live.update(i for i in node.input if i)
    needed.reverse()
    if any(i in zero for n in needed for i in n.input):
        return None  # cannot happen by construction; kept as a guard against a wrong table entry
    produced = {o for n in needed for o in n.output}
    new_graph = onnx.helper.make_graph(
        needed, graph.name,
        [i for i in graph.input if i.name in live],
        kept,
        [t for t in graph.initializer if t.name in live],
        value_info=[v for v in graph.value_info if v.name in produced],
    )
    out = onnx.helper.make_model(new_graph, opset_imports=list(model.opset_import), producer_name=model.producer_name)
    out.ir_version = model.ir_version
    return SpecialisedBackward(out, [o.name for o in kept])
