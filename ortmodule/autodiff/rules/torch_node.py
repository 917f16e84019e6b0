"""Torch nodes (NOTE [torch nodes] in runtime/torch_nodes.py): the gradient of a ``TorchCall`` is the
``TorchCallGrad`` node that hands the output gradients to the torch backward its forward recorded."""

from __future__ import annotations

import onnx_ir as ir

from ...runtime.torch_nodes import ATEN_OP, CALL_OP, GRAD_OP, TORCH_DOMAIN
from ..registry import GradBuilder, is_float, register, register_nondifferentiable


@register(CALL_OP, domain=TORCH_DOMAIN)
def torch_call_grad(g: GradBuilder, node: ir.Node, dys):
    wanted = [i for i, v in enumerate(node.inputs) if v is not None and is_float(v.dtype) and v in g.active]
    if not wanted:
        return [None] * len(node.inputs)
    # The forward node learns which inputs it must record a backward for (NOTE [torch nodes]).
    node.attributes["grad_inputs"] = ir.AttrInt64s("grad_inputs", wanted)
    if not node.name:
        raise ValueError("a TorchCall node needs a name: its gradient node finds the forward's state by it")
    # an absent output gradient (the output does not reach the loss) is an empty input
    outs = g.op_multi(GRAD_OP, list(dys), {"forward": node.name}, domain=TORCH_DOMAIN, num_outputs=len(wanted))
    results: list[ir.Value | None] = [None] * len(node.inputs)
    for i, out in zip(wanted, outs):
        x = node.inputs[i]
        out.dtype, out.shape = x.dtype, x.shape
        results[i] = out
    return results


# The gradient node itself is not differentiated again (NOTE [no double backward] in function.py).
register_nondifferentiable(GRAD_OP, ATEN_OP, domain=TORCH_DOMAIN)  # ATen: backward kernels
