"""Forward ONNX graph -> gradient nodes, by a reverse topological walk over registered rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import onnx_ir as ir

from ..errors import GradientRuleError, node_location
from . import rules as _rules  # noqa: F401  (registers every rule)
from .registry import GradBuilder, is_float, lookup
from .rules.indexing import zeros_like

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


def _subgraphs(node: ir.Node) -> list[ir.Graph]:
    graphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.value)
    return graphs


def captured_values(node: ir.Node) -> list[ir.Value]:
    """Outer-scope values that the subgraphs of ``node`` (``If`` branches, ``Loop``/``Scan`` bodies,
    nested ones included) read without receiving them as inputs.

    # NOTE [captured values]: a subgraph may read any value of the enclosing graphs by name, so such
    # a value is an input of the node as far as dependence goes. The activeness walk, the gradient
    # walk and dead-code elimination treat it as one: a trainable value read only inside an ``If``
    # or ``Loop`` on a gradient path makes :func:`build_gradient` raise instead of dropping its
    # gradient (NOTE [constant If] inlines the ``If``s whose condition is known).
    """
    defined: set[ir.Value] = set()
    used: list[ir.Value] = []

    def visit(g: ir.Graph) -> None:
        defined.update(g.inputs)
        defined.update(g.initializers.values())
        for n in g:
            defined.update(n.outputs)
            used.extend(v for v in n.inputs if v is not None)
            for sub in _subgraphs(n):
                visit(sub)
        used.extend(g.outputs)

    for sub in _subgraphs(node):
        visit(sub)
    return list(dict.fromkeys(v for v in used if v not in defined))


def node_reads(node: ir.Node) -> list[ir.Value]:
    """The values ``node`` depends on: its inputs, then its captured values (NOTE [captured values])."""
    reads = [v for v in node.inputs if v is not None]
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        reads += [v for v in captured_values(node) if v not in reads]
    return reads


def differentiable_values(graph: ir.Graph, wrt: Sequence[ir.Value], *, untyped: bool = False) -> set[ir.Value]:
    """Float values that depend on ``wrt`` through differentiable ops (with ``untyped``, values whose
    type is not known yet count as float: a translation before shape inference)."""
    float_ = (lambda v: v.dtype is None or is_float(v.dtype)) if untyped else (lambda v: is_float(v.dtype))
    active: set[ir.Value] = {v for v in wrt if float_(v)}
    for node in graph:
        if not any(v in active for v in node_reads(node)):
            continue
        info = lookup(node.domain, node.op_type)
        if info is not None and info.fn is None:
            continue  # non-differentiable op: its outputs carry no gradient
        if node.metadata_props.get(STOP_GRADIENT_KEY):
            continue  # NOTE [stop gradient]: .detach(), no_grad blocks, padding_idx rows
        for out in node.outputs:
            if float_(out):
                active.add(out)
    return active


def _differentiated_inputs(g: GradBuilder, node: ir.Node, active: set[ir.Value], zeros: Sequence[bool]
                           ) -> list[ir.Value]:
    """The active inputs of ``node`` that its rule gives a gradient (NOTE [zero derivatives]): asked of
    the rule itself, with placeholder output gradients, in a scratch builder whose nodes are dropped."""
    info = lookup(node.domain, node.op_type)
    reads = [v for v in node.inputs if v is not None and v in active]
    if info is None or info.fn is None or not reads or _subgraphs(node):
        return []  # no rule (or control flow): no gradient to be zero, as before
    if info.zero_derivative:
        return reads
    scratch = GradBuilder(g.opset, g.dim_values)
    scratch.active = active
    dys = [ir.Value(name=f"probe.{o.name}", type=o.type, shape=o.shape) if z else None
           for o, z in zip(node.outputs, zeros)]
    scratch._node = node
    try:
        results = info.fn(scratch, node, dys)
    except Exception:  # a rule that cannot run here gives no gradient anywhere: leave it to None
        return []
    return [v for v, r in zip(node.inputs, results) if r is not None and v is not None and v in active]


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
    g.active = active
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

    # NOTE [zero derivatives]: the values a zero-derivative op (Round, Floor, ...) passes a zero
    # gradient to, and upstream of them the inputs each rule differentiates: eager's autograd reaches
    # them with zeros where no other contribution arrives.
    zero_reached: set[ir.Value] = set()
    for node in reversed(list(graph)):
        if not any(o in grads for o in node.outputs):
            zeros = [o in zero_reached for o in node.outputs]
            if any(zeros):
                zero_reached.update(_differentiated_inputs(g, node, active, zeros))
            continue
        captured = [v for v in captured_values(node) if v in active] if _subgraphs(node) else []
        if not captured and not any(v in active for v in node.inputs if v is not None):
            continue
        if captured:  # NOTE [captured values]: no rule can return gradients for these
            op = f"{node.domain + '::' if node.domain else ''}{node.op_type}"
            shown = ", ".join(repr(v.name) for v in captured[:5]) + (" ..." if len(captured) > 5 else "")
            raise GradientRuleError(
                f"ONNX control-flow op '{op}' ({node_location(node)}) is on a gradient path: its "
                f"subgraph reads {shown}, which needs a gradient, and ortmodule has no gradient for "
                "control flow. Write the forward without data-dependent control flow, freeze those "
                "values, or run this module in eager PyTorch."
            )
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
        if info.zero_derivative:
            zero_reached.update(v for v in node.inputs if v is not None and v in active)
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
    for v, grad in input_grads.items():
        if grad is None and v in zero_reached:  # NOTE [zero derivatives]
            g._node = None
            input_grads[v] = zeros_like(g, v)
    return GradientGraph(
        nodes=g.nodes, outputs=list(outputs), grad_outputs=grad_inputs, input_grads=input_grads
    )
