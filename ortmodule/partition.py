"""Split forward + gradient nodes into a forward model and a backward model.

The forward model computes the user outputs, the new values of mutated buffers, and the
intermediates the backward needs ("saved values"). The backward model takes the saved values and the
output gradients and returns the gradients of the inputs that require grad.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import onnx
import onnx_ir as ir

from .autodiff import build_gradient, differentiable_values
from .autodiff.builder import node_reads
from .export import ExportedModel
from .export.torchscript import input_name, mask_name
from .passes import lower_softmax_cross_entropy, run_forward_passes, score_ranks
from .passes.proto import apply_inferred_types
from .recompute import RecomputePlan, RecomputePolicy, gate_groups, plan_recompute
from .runtime.torch_nodes import TORCH_DOMAIN

# NOTE [cheap to move]: backward nodes that only read forward values and produce shapes (Shape,
# Size and the integer arithmetic on their results) run in the forward model instead: saving a
# small int64 vector beats saving the big tensor it was measured from.
_SHAPE_OPS = {"Shape", "Size"}
_SHAPE_ARITH = {"Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Add", "Sub", "Mul",
                "Div", "Equal", "Not", "NonZero", "Reshape", "ReduceProd", "Range", "Constant"}


@dataclasses.dataclass
class TrainingGraphs:
    """Forward/backward models and the calling convention between them (STYLE.md §6).

    Forward inputs are the exported graph's inputs (``forward_inputs`` names). Forward outputs: the
    user outputs, the mutated buffers, then ``saved_outputs``. Backward inputs: ``saved_inputs`` (names
    of forward inputs it reads), ``saved_outputs``, then one gradient per ``diff_outputs`` entry.
    Backward outputs: one gradient per entry of ``grad_targets`` (forward input names).
    """

    forward: onnx.ModelProto
    backward: onnx.ModelProto
    forward_inputs: list[str]
    forward_outputs: list[str]
    saved_inputs: list[str]
    saved_outputs: list[str]
    diff_outputs: list[int]  # indices of user outputs that carry gradient
    grad_targets: list[str]
    backward_inputs: list[str]
    backward_outputs: list[str]
    # NOTE [unreached targets]: per ``grad_targets`` entry, the user outputs (indices into
    # ``diff_outputs``' values) whose gradient can reach it through differentiable values.
    target_outputs: list[frozenset[int]] = dataclasses.field(default_factory=list)
    recompute: RecomputePlan | None = None  # NOTE [recompute]


def _value_info(v: ir.Value, name: str | None = None) -> onnx.ValueInfoProto:
    if v.dtype is None:
        raise ValueError(f"value {v.name!r} has no known dtype")
    shape = None
    if v.shape is not None:
        shape = [d if isinstance(d, int) else (str(d.value) if d.value is not None else None) for d in v.shape]
    return onnx.helper.make_tensor_value_info(name or v.name, int(v.dtype), shape)


def _make_model(
    nodes: Iterable[ir.Node],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto],
    opset_imports: dict[str, int],
    name: str,
) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], name, list(inputs), list(outputs), list(initializers)
    )
    return onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opset_imports.items()],
        producer_name="ortmodule",
    )


def _infer_missing_types(model: ir.Model, nodes: Sequence[ir.Node]) -> None:
    """Fill dtype/shape of new values that the rules did not annotate, by ONNX shape inference."""
    missing = [o for n in nodes for o in n.outputs if o.dtype is None or o.shape is None]
    if not missing:
        return
    apply_inferred_types(missing, onnx.shape_inference.infer_shapes(ir.to_proto(model)))


def reference_dim_values(exported: ExportedModel) -> dict[str, int]:
    """NOTE [reference dims]: the size of each symbolic dim of the forward graph at export time.

    Shape inference on a dynamic graph names most intermediate dims ``unk__N``, so whether a
    gradient must be summed over a broadcast axis is often undecidable from symbols alone. The same
    graph inferred with the export-time input shapes gives each symbol a size; an axis whose sizes
    agree there is taken as not broadcast. The graph was seen to be identical at two shapes
    (NOTE [dynamic shapes]); if a later shape broadcasts differently, torch rejects the gradient's
    shape loudly rather than training wrongly.
    """
    concrete = onnx.ModelProto.FromString(exported.model.SerializeToString())
    sizes = {input_name(i): shape for i, shape in enumerate(exported.input_shapes)}
    sizes.update({mask_name(k): spec.shape for k, spec in enumerate(exported.masks)})
    for vi in concrete.graph.input:
        if vi.name in sizes:
            for dim, size in zip(vi.type.tensor_type.shape.dim, sizes[vi.name]):
                dim.Clear()
                dim.dim_value = size
    del concrete.graph.value_info[:]
    try:
        concrete = onnx.shape_inference.infer_shapes(concrete, data_prop=True)
    except Exception:  # an op onnx cannot infer: no reference sizes, the run-time path is used
        return {}
    symbolic = exported.model.graph
    by_name = {vi.name: vi for vi in concrete.graph.value_info}
    values: dict[str, int] = {}
    for vi in list(symbolic.value_info) + list(symbolic.input) + list(symbolic.output):
        ref = by_name.get(vi.name)
        if ref is None:
            ref = next((c for c in concrete.graph.input if c.name == vi.name), None)
        if ref is None or not vi.type.HasField("tensor_type"):
            continue
        for d, r in zip(vi.type.tensor_type.shape.dim, ref.type.tensor_type.shape.dim):
            if d.dim_param and r.HasField("dim_value"):
                values.setdefault(d.dim_param, r.dim_value)
    return values


def _as_early_as_possible(nodes: Sequence[ir.Node], extra: Sequence[ir.Node]) -> list[ir.Node]:
    """``nodes`` in order, each of ``extra`` placed right after the last producer of its inputs.

    # NOTE [shapes early]: the shape nodes moved into the forward (NOTE [cheap to move]) feed only
    # graph outputs, and onnxruntime runs such nodes where the graph lists them. Appended at the
    # end, a ``Shape`` of the first layer's query projection ran after the last layer and kept that
    # [64, 128, 256] tensor alive through the whole forward, with 25 others (BERT at level 1: a
    # simulation of the forward's live bytes in onnxruntime's own execution order, from its
    # profile, peaked at 246 MB; with each shape node right after its input's producer, 133 MB).
    """
    pending = {n: 0 for n in extra}
    producer: dict[ir.Value, ir.Node] = {o: n for n in [*nodes, *extra] for o in n.outputs}
    waiting: dict[ir.Node, list[ir.Node]] = {}
    for n in extra:
        for p in {producer[v] for v in n.inputs if v is not None and v in producer}:
            pending[n] += 1
            waiting.setdefault(p, []).append(n)
    out: list[ir.Node] = []
    placed: set[ir.Node] = set()

    def emit(node: ir.Node) -> None:
        if node in placed:  # an extra node freed by another one's emission, met again in the loop below
            return
        placed.add(node)
        out.append(node)
        for m in waiting.pop(node, ()):
            pending[m] -= 1
            if pending[m] == 0:
                emit(m)

    for n in extra:
        if pending[n] == 0:
            emit(n)
    for n in nodes:
        emit(n)
    return out + [n for n in extra if n not in placed]  # (none left: a cycle would be a bug upstream)


def _needed_nodes(nodes: Sequence[ir.Node], outputs: Iterable[ir.Value]) -> list[ir.Node]:
    """Dead-code elimination: the nodes (in order) that ``outputs`` depend on."""
    live = set(outputs)
    keep = []
    for node in reversed(nodes):
        if any(o in live for o in node.outputs):
            keep.append(node)
            live.update(node_reads(node))  # NOTE [captured values]: what its subgraphs read, too
    keep.reverse()
    return keep


def _recomputed_views(fwd_nodes: Sequence[ir.Node], bwd_nodes: Sequence[ir.Node], free: set[ir.Value]) -> list[ir.Node]:
    """Forward Reshapes the backward reads whose data is free to save: run them again in the backward.

    # NOTE [views are recomputed]: a Reshape of a user output (GPT-2's logits viewed as [tokens,
    # vocab] for the loss) would be saved as a second forward output of the same data, which ORT
    # cannot alias to the first and copies (103 MB, 16 ms per step). Saving the data (already an
    # output, or a forward input) and reshaping it again in the backward costs nothing.
    """
    producer = {o: n for n in fwd_nodes for o in n.outputs}
    views: list[ir.Node] = []
    for node in bwd_nodes:
        for v in node.inputs:
            p = producer.get(v) if v is not None else None
            if (p is not None and p.op_type == "Reshape" and p.domain == "" and p not in views
                    and p.inputs[0] in free):
                views.append(p)
    return views


def _reached_from(outputs: dict[int, ir.Value], active: set[ir.Value], wrt: Sequence[ir.Value]
                  ) -> dict[ir.Value, frozenset[int]]:
    """For each value in ``wrt``, the user outputs (by index) that depend on it through ``active``.

    # NOTE [unreached targets]: eager autograd leaves ``p.grad`` None when no output it
    # differentiates depends on ``p``. A parameter that feeds only outputs whose gradient is absent
    # (``None``: not used in the loss) must not get a zero gradient instead, or AdamW's weight decay
    # moves it where eager does not. The walk is structural (over-approximate): a target it reaches
    # gets its computed gradient, which is then exact; one it does not reach gets None.
    """
    wrt_set = set(wrt)
    reached: dict[ir.Value, set[int]] = {v: set() for v in wrt}
    for i, out in outputs.items():
        seen = {out}
        stack = [out]
        while stack:
            v = stack.pop()
            if v in wrt_set:
                reached[v].add(i)
            node = v.producer()
            if node is None:
                continue
            for u in node_reads(node):
                if u in active and u not in seen:
                    seen.add(u)
                    stack.append(u)
    return {v: frozenset(r) for v, r in reached.items()}


def _read_from_forward(bwd_nodes: Sequence[ir.Node], grad_inputs: set[ir.Value], init_values: set[ir.Value]
                       ) -> list[ir.Value]:
    produced = {o for n in bwd_nodes for o in n.outputs}
    seen: set[ir.Value] = set()
    out = []
    for node in bwd_nodes:
        for v in node.inputs:
            if v is None or v in seen or v in produced or v in grad_inputs or v in init_values:
                continue
            seen.add(v)
            out.append(v)
    return out


def build_training_graphs(exported: ExportedModel, requires_grad: dict[str, bool],
                          policy: RecomputePolicy | None = None) -> TrainingGraphs:
    """Autodiff + partition of ``exported`` for the inputs whose name maps to True in ``requires_grad``;
    ``policy`` decides which saved values are recomputed instead (NOTE [recompute])."""
    model = ir.from_proto(exported.model)
    model.opset_imports.setdefault(TORCH_DOMAIN, 1)  # rules may emit ATen nodes (NOTE [ATen kernels])
    graph = model.graph
    initializers = [ir.serde.serialize_tensor(v.const_value) for v in graph.initializers.values()]
    init_values = set(graph.initializers.values())
    run_forward_passes(graph)
    inputs = list(graph.inputs)
    wrt = [v for v in inputs if requires_grad.get(v.name, False)]
    n_user = exported.num_user_outputs
    outputs = list(graph.outputs)
    active = differentiable_values(graph, wrt)
    diff_outputs = [i for i in range(n_user) if outputs[i] in active]
    fwd_nodes = list(graph)
    dims = reference_dim_values(exported) if exported.dynamic else {}
    grad = build_gradient(graph, wrt, [outputs[i] for i in diff_outputs], opset=exported.opset,
                          dim_values=dims if exported.dynamic else None)

    # Name every new value uniquely by adding the nodes to the graph (its name authority), then
    # take them out again: the split below only needs names.
    graph.extend(grad.nodes)
    for gi in grad.grad_outputs:
        graph.inputs.append(gi)
    _infer_missing_types(model, grad.nodes)

    # Gradient results, in the order of the forward inputs they belong to.
    targets = [(v, grad.input_grads[v]) for v in wrt if grad.input_grads[v] is not None]
    reached = _reached_from({i: outputs[i] for i in diff_outputs}, active, [t for t, _ in targets])
    bwd_result_values = [gv for _, gv in targets]
    bwd_all = _needed_nodes(grad.nodes, bwd_result_values)

    forward_values = set(inputs) | init_values | {o for n in fwd_nodes for o in n.outputs}
    grad_inputs = set(grad.grad_outputs)
    consts = [n for n in bwd_all if n.op_type == "Constant"]
    free = {o for n in consts for o in n.outputs}
    moved: list[ir.Node] = []
    moved_out: set[ir.Value] = set()
    for node in bwd_all:
        ins = [v for v in node.inputs if v is not None]
        if node.op_type == "Constant" or any(v in grad_inputs for v in ins):
            continue
        shape_op = node.op_type in _SHAPE_OPS and all(v in forward_values for v in ins)
        arith = node.op_type in _SHAPE_ARITH and any(v in moved_out for v in ins) and all(
            v in moved_out or v in free or v.const_value is not None for v in ins
        )
        if shape_op or arith:
            moved.append(node)
            moved_out.update(node.outputs)
    moved_set = set(moved)
    bwd_nodes = _needed_nodes([n for n in bwd_all if n not in moved_set], bwd_result_values)
    views = _recomputed_views(fwd_nodes, bwd_nodes, set(inputs) | set(outputs))
    bwd_nodes = views + bwd_nodes
    bwd_nodes, plan = plan_recompute(fwd_nodes, bwd_nodes, _read_from_forward(bwd_nodes, grad_inputs, init_values),
                                     set(inputs) | set(outputs), policy or RecomputePolicy(), dims, grad_inputs,
                                     exported.checkpoint_regions)
    # Constant nodes of the forward that the backward reads are copied there rather than saved.
    in_backward = set(bwd_nodes)
    copied: list[ir.Node] = []
    for node in bwd_nodes:
        for v in node.inputs:
            p = v.producer() if v is not None else None
            if p is not None and p.op_type == "Constant" and p not in in_backward and p not in copied:
                copied.append(p)
    bwd_nodes = copied + bwd_nodes

    # Saved values: what the backward reads that it does not compute, other than output grads.
    bwd_produced = {o for n in bwd_nodes for o in n.outputs}
    saved: list[ir.Value] = []
    seen: set[ir.Value] = set()
    for node in bwd_nodes:
        for v in node.inputs:
            if v is None or v in seen or v in bwd_produced or v in grad_inputs or v in init_values:
                continue
            seen.add(v)
            saved.append(v)
    for v in bwd_result_values:  # a gradient that is a saved value or an output grad itself
        if v not in bwd_produced and v not in seen and v not in grad_inputs and v not in init_values:
            seen.add(v)
            saved.append(v)
    input_set = set(inputs)
    saved_inputs = [v for v in saved if v in input_set]
    saved_outputs = [v for v in saved if v not in input_set]

    # Forward model: exported nodes + moved shape nodes, outputs = user outputs, buffers, saved.
    output_set = set(outputs)
    fwd_out_values = outputs + [v for v in saved_outputs if v not in output_set]
    fwd_keep = _needed_nodes(_as_early_as_possible(consts + fwd_nodes, moved), fwd_out_values)
    forward = _make_model(
        fwd_keep,
        [_value_info(v) for v in inputs],
        [_value_info(v) for v in fwd_out_values],
        initializers,
        dict(model.opset_imports),
        "ortmodule_forward",
    )
    lower_softmax_cross_entropy(forward, score_ranks(fwd_keep))

    # Backward model.
    grad_out_vals = list(grad.grad_outputs)
    bwd_outputs: list[onnx.ValueInfoProto] = []
    extra_nodes: list[onnx.NodeProto] = []
    out_names: list[str] = []
    # The Identity nodes go last, in target order: they set onnxruntime's node order (NOTE [node order]).
    for target, gv in targets:
        name = f"grad:{target.name}"
        out_names.append(name)
        bwd_outputs.append(_value_info(gv, name))
        extra_nodes.append(onnx.helper.make_node("Identity", [gv.name], [name], name=f"Identity_{name}"))
    used = {v.name for n in bwd_nodes for v in n.inputs if v is not None} | {v.name for v in bwd_result_values}
    bwd_initializers = [t for t in initializers if t.name in used]
    backward = _make_model(
        bwd_nodes,
        [_value_info(v) for v in saved] + [_value_info(v) for v in grad_out_vals],
        bwd_outputs,
        bwd_initializers,
        dict(model.opset_imports),
        "ortmodule_backward",
    )
    backward.graph.node.extend(extra_nodes)
    _first_gradient_in_place(backward, len(extra_nodes))
    gate_groups(backward, plan.gates)  # NOTE [recompute order]
    # The recomputed views keep their known shapes (the backward passes read them).
    backward.graph.value_info.extend(_value_info(o) for n in views for o in n.outputs if o.dtype is not None)
    # NOTE [torch nodes]: onnx cannot infer a torch node's outputs; the segments read their types here
    for model_, nodes_ in ((forward, fwd_keep), (backward, bwd_nodes)):
        model_.graph.value_info.extend(_value_info(o) for n in nodes_ if n.domain == TORCH_DOMAIN
                                       for o in n.outputs if o.dtype is not None and o.name)
    return TrainingGraphs(
        forward=forward,
        backward=backward,
        forward_inputs=[v.name for v in inputs],
        forward_outputs=[v.name for v in fwd_out_values],
        saved_inputs=[v.name for v in saved_inputs],
        saved_outputs=[v.name for v in saved_outputs],
        diff_outputs=diff_outputs,
        grad_targets=[t.name for t, _ in targets],
        backward_inputs=[v.name for v in saved] + [v.name for v in grad_out_vals],
        backward_outputs=out_names,
        target_outputs=[reached[t] for t, _ in targets],
        recompute=plan,
    )


def _first_gradient_in_place(backward: onnx.ModelProto, n_identities: int) -> None:
    """NOTE [node order]: the first target's Identity is walked last, so its producer can write the
    graph output itself without changing onnxruntime's node order; that spares a copy of what is
    usually the largest gradient (the word embedding's)."""
    if not n_identities:
        return
    nodes = backward.graph.node
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for a in n.attribute):
        return  # a subgraph may read the value by its name
    first = nodes[len(nodes) - n_identities]
    src, dst = first.input[0], first.output[0]
    producers = [n for n in nodes if src in n.output]
    uses = sum(list(n.input).count(src) for n in nodes)
    if (len(producers) != 1 or uses != 1 or any(o.name == src for o in backward.graph.output)
            or any(i.name == src for i in backward.graph.input)):
        return
    out = producers[0].output
    out[list(out).index(src)] = dst
    nodes.remove(first)
