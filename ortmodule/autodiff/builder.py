"""Forward ONNX graph -> gradient nodes, by a reverse topological walk over registered rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import onnx_ir as ir

from ..errors import GradientRuleError, node_location
from . import rules as _rules  # noqa: F401  (registers every rule)
from .registry import GradBuilder, is_float, lookup

STOP_GRADIENT_KEY = "pkg.ortmodule.stop_gradient"  # set by export/semantics.py


@dataclasses.dataclass
class GradientGraph:
    """What :func:`build_gradient` adds to a forward graph.

    ``grad_outputs[i]`` is the new graph input holding d(loss)/d(``outputs[i]``); ``input_grads`` maps
    each requested input to its gradient value (``None`` when no output depends on it).
    """

    nodes: list[ir.Node]
    outputs: list[ir.Value]
    grad_outputs: list[ir.Value]
    input_grads: dict[ir.Value, ir.Value | None]


def differentiable_values(graph: ir.Graph, wrt: Sequence[ir.Value]) -> set[ir.Value]:
    """Float values that depend on ``wrt`` through differentiable ops."""
    active: set[ir.Value] = {v for v in wrt if is_float(v.dtype)}
    for node in graph:
        if not any(v in active for v in node.inputs if v is not None):
            continue
        info = lookup(node.domain, node.op_type)
        if info is not None and info.fn is None:
            continue  # non-differentiable op: its outputs carry no gradient
        if node.metadata_props.get(STOP_GRADIENT_KEY):
            continue  # NOTE [stop gradient]: .detach(), no_grad blocks, padding_idx rows
        for out in node.outputs:
            if is_float(out.dtype):
                active.add(out)
    return active


def build_gradient(
    graph: ir.Graph,
    wrt: Sequence[ir.Value],
    outputs: Sequence[ir.Value],
    *,
    opset: int,
    dim_values: dict[str, int] | None = None,
) -> GradientGraph:
    """Build the nodes computing the gradients of ``outputs`` with respect to ``wrt``.

    ``graph`` is not modified; the returned nodes reference its values. Every output in ``outputs``
    must be differentiable (a float value depending on ``wrt``).
    """
    active = differentiable_values(graph, wrt)
    g = GradBuilder(opset, dim_values)
    grads: dict[ir.Value, list[ir.Value]] = {}
    grad_inputs: list[ir.Value] = []
    for out in outputs:
        gi = ir.Value(name=f"grad.{out.name}", type=out.type, shape=out.shape)
        grad_inputs.append(gi)
        grads.setdefault(out, []).append(gi)

    def total(v: ir.Value) -> ir.Value | None:
        contribs = grads.get(v)
        if not contribs:
            return None
        if len(contribs) > 1:
            g._node = None
            summed = g.op("Sum", contribs, dtype=v.dtype, shape=v.shape)
            grads[v] = [summed]
        return grads[v][0]

    for node in reversed(list(graph)):
        if not any(o in grads for o in node.outputs):
            continue
        if not any(v in active for v in node.inputs if v is not None):
            continue
        info = lookup(node.domain, node.op_type)
        if info is None:
            raise GradientRuleError(
                f"No gradient rule for ONNX op '{node.domain + '::' if node.domain else ''}{node.op_type}' "
                f"({node_location(node)}); register one in ortmodule/autodiff/rules/ "
                "with @register(op_type)."
            )
        if info.fn is None:
            continue
        dys = [total(o) for o in node.outputs]
        g._node = node
        try:
            results = info.fn(g, node, dys)
        except GradientRuleError:
            raise
        except Exception as exc:  # a rule failing on an unexpected node shape is a bug worth locating
            raise GradientRuleError(
                f"Gradient rule for '{node.op_type}' failed ({node_location(node)}): {exc}"
            ) from exc
        finally:
            g._node = None
        if len(results) != len(node.inputs):
            raise GradientRuleError(
                f"Gradient rule for '{node.op_type}' returned {len(results)} gradients for "
                f"{len(node.inputs)} inputs ({node_location(node)})"
            )
        for inp, r in zip(node.inputs, results, strict=True):
            if r is None or inp is None or inp not in active:
                continue
            # NOTE [grad type]: the gradient of x has x's dtype and shape; record it so later rules
            # can rely on it (e.g. reduce_to needs the gradient's shape).
            r.dtype = inp.dtype
            if r.shape is None:
                r.shape = inp.shape
            grads.setdefault(inp, []).append(r)

    input_grads = {v: total(v) for v in wrt}
    return GradientGraph(
        nodes=g.nodes, outputs=list(outputs), grad_outputs=grad_inputs, input_grads=input_grads
    )
