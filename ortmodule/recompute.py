"""The recompute policy: which forward values the backward computes again instead of saving them.

# NOTE [recompute]: the forward model returns every value the backward reads ("saved values"),
# and they stay alive from the forward to the backward: with a transformer that is most of the
# step's memory. A recomputed value is not a forward output; the backward graph runs the forward
# nodes that produce it again, from values that are saved. Levels (``memory_opt_level=`` /
# ``ORTMODULE_MEMORY_OPT_LEVEL``):
#
# - 0 (default): what costs nothing measurable: a saved value produced by a shape or cast op
#   (Cast, Reshape, Unsqueeze, Squeeze, Expand, Identity, Not, Equal, Where on masks, ...) whose
#   inputs are saved anyway is recomputed from them.
# - 1, layerwise: per repeated block (``layer.3``, ``h.1``: a module path with an index whose
#   siblings also occur), only the values the block reads from outside it are saved (its input,
#   the attention mask, the dropout masks); everything the backward needs inside the block is
#   recomputed in the backward, block by block, right before that block's gradient nodes.
# - ``torch.utils.checkpoint`` regions in the user's forward are recomputed like level-1 blocks at
#   every level (NOTE [checkpoint regions] in ``export/traps.py``): the region runs once, in the
#   graph, and again inside the backward graph; never twice in eager.
# - a plan list (``memory_opt_config=`` / ``ORTMODULE_MEMORY_OPT_CONFIG``): ``"Erf:-1,Softmax:2"``
#   recomputes saved values produced by these op types (a cluster: inputs produced by listed ops
#   are recomputed too), for the first N occurrences (-1: all).
#
# What stays exact: dropout masks are graph inputs (drawn once, read again: bit-identical); a
# recomputed BatchNorm computes the same batch statistics and its running-stat outputs are not
# backward outputs (the statistics are updated once, by the forward); random ops (RandomNormal,
# Bernoulli, ...) and nodes with subgraphs are never recomputed. A value read by one recompute
# group but produced in another is saved, so the backward never needs a group recomputed later.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from .errors import MODULE_PATH_KEY

_CHEAP = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Identity", "Not", "Equal", "Where",
                    "Shape", "Size", "Flatten", "ConstantOfShape", "Less", "Greater", "And", "Or"})
_RANDOM = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"})
_INDEX = re.compile(r"\d+")
_ITEMSIZE = {ir.DataType.FLOAT: 4, ir.DataType.DOUBLE: 8, ir.DataType.FLOAT16: 2, ir.DataType.BFLOAT16: 2,
             ir.DataType.INT64: 8, ir.DataType.INT32: 4, ir.DataType.BOOL: 1, ir.DataType.UINT8: 1,
             ir.DataType.INT8: 1, ir.DataType.INT16: 2}
LEVELS = (0, 1)
MASK_SCALE_KEY = "pkg.ortmodule.dropout_scale"  # NOTE [bool masks] in export/semantics.py


@dataclasses.dataclass(frozen=True)
class RecomputePolicy:
    """What to recompute (NOTE [recompute]); part of the training graphs' cache key."""

    level: int = 0
    plan: tuple[tuple[str, int], ...] = ()  # (op type, how many occurrences; -1 = all)

    @classmethod
    def resolve(cls, level: int | str | None = None, config: str | None = None) -> RecomputePolicy:
        raw = level if level is not None else os.environ.get("ORTMODULE_MEMORY_OPT_LEVEL", "0")
        try:
            lvl = int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"memory_opt_level={raw!r}: use one of {list(LEVELS)}") from None
        if lvl not in LEVELS:
            raise ValueError(f"memory_opt_level={lvl}: use one of {list(LEVELS)}")
        text = config if config is not None else os.environ.get("ORTMODULE_MEMORY_OPT_CONFIG", "")
        return cls(level=lvl, plan=parse_plan(text))


def parse_plan(text: str) -> tuple[tuple[str, int], ...]:
    """``"Erf:-1,Softmax:2"`` -> ``(("Erf", -1), ("Softmax", 2))``; a bare op type means all."""
    plan = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        op, _, count = item.partition(":")
        try:
            n = int(count) if count else -1
        except ValueError:
            raise ValueError(f"memory_opt_config item {item!r}: use OpType or OpType:count (-1 = all)") from None
        if not op.isidentifier():
            raise ValueError(f"memory_opt_config item {item!r}: {op!r} is not an ONNX op type")
        plan.append((op, n))
    return tuple(plan)


@dataclasses.dataclass
class RecomputePlan:
    """What a policy did to one training graph (printed by ``explain()`` and logged)."""

    policy: RecomputePolicy
    recomputed: list[tuple[str, str, str, int | None]]  # (value, op type, module path, bytes)
    saved_instead: list[tuple[str, int | None]]  # values saved because a recompute reads them
    saved: list[tuple[str, int | None]] = dataclasses.field(default_factory=list)  # what the forward still saves
    nodes: int = 0  # forward nodes run again in the backward
    extra_flops: int = 0  # estimated, at the export-time sizes
    # NOTE [recompute order]: (trigger value, first-output names of the group's nodes, the values
    # the group reads from outside): the group's reads are made to wait for the trigger.
    gates: list[tuple[str, list[str], list[str]]] = dataclasses.field(default_factory=list)

    @property
    def bytes_saved(self) -> int:
        return sum(b or 0 for *_, b in self.recomputed) - sum(b or 0 for _, b in self.saved_instead)

    def summary(self) -> str:
        plan = f", plan {list(self.policy.plan)}" if self.policy.plan else ""
        kept = sum(b or 0 for _, b in self.saved)
        return (f"recompute (level {self.policy.level}{plan}): "
                f"{len(self.recomputed)} saved values recomputed by {self.nodes} nodes, {len(self.saved_instead)} "
                f"saved instead; {self.bytes_saved / 2**20:.1f} MB less saved per step at the export-time sizes "
                f"({len(self.saved)} values, {kept / 2**20:.1f} MB still saved), "
                f"~{self.extra_flops / 1e9:.2f} GFLOP more per step")

    def table(self, limit: int = 40) -> str:
        rows = [self.summary(), f"  {'value':<28} {'op':<14} {'bytes':>12}  module"]
        for name, op, path, size in self.recomputed[:limit]:
            rows.append(f"  {name:<28} {op:<14} {size if size is not None else '?':>12}  {path}")
        if len(self.recomputed) > limit:
            rows.append(f"  ... {len(self.recomputed) - limit} more")
        return "\n".join(rows)


def _path(node: ir.Node) -> str:
    return node.metadata_props.get(MODULE_PATH_KEY, "") or ""


def _blocks(nodes: Sequence[ir.Node]) -> dict[ir.Node, str]:
    """Each node's repeated block (``encoder.layer.3``), where its module path has one."""
    indices: dict[str, set[str]] = {}
    for node in nodes:
        parts = _path(node).split(".")
        for i, part in enumerate(parts):
            if _INDEX.fullmatch(part):
                indices.setdefault(".".join(parts[:i]), set()).add(part)
    out = {}
    for node in nodes:
        parts = _path(node).split(".")
        for i, part in enumerate(parts):
            if _INDEX.fullmatch(part) and len(indices.get(".".join(parts[:i]), ())) >= 2:
                out[node] = ".".join(parts[: i + 1])
                break
    return out


def _regions(nodes: Sequence[ir.Node], regions: Sequence[str]) -> dict[ir.Node, str]:
    """Each node's checkpoint region: the longest region path its module path lies in."""
    if not regions:
        return {}
    by_length = sorted(regions, key=len, reverse=True)
    out = {}
    for node in nodes:
        path = _path(node)
        for r in by_length:
            if r == "" or path == r or path.startswith(r + "."):
                out[node] = f"checkpoint:{r}"
                break
    return out


def _recomputable(node: ir.Node) -> bool:
    if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM:
        return False
    return not any(isinstance(a, ir.Attr) and a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                   for a in node.attributes.values())


def nbytes(v: ir.Value, dims: dict[str, int]) -> int | None:
    if v.shape is None or v.dtype is None:
        return None
    n = 1
    for d in v.shape:
        if isinstance(d, int):
            n *= d
        else:
            size = dims.get(str(d.value)) if getattr(d, "value", None) is not None else None
            if size is None:
                return None
            n *= size
    return n * _ITEMSIZE.get(v.dtype, 4)


def _flops(node: ir.Node, dims: dict[str, int]) -> int:
    out = node.outputs[0] if node.outputs else None
    size = nbytes(out, dims) if out is not None else None
    numel = (size or 0) // _ITEMSIZE.get(out.dtype, 4) if out is not None and out.dtype is not None else 0
    if node.op_type in ("MatMul", "Gemm") and node.inputs[0] is not None and node.inputs[0].shape is not None:
        k = node.inputs[0].shape[-1]
        k = k if isinstance(k, int) else dims.get(str(getattr(k, "value", "")), 0)
        return 2 * numel * k
    return numel


def plan_recompute(
    fwd_nodes: Sequence[ir.Node],
    bwd_nodes: Sequence[ir.Node],
    saved: Sequence[ir.Value],
    free: set[ir.Value],
    policy: RecomputePolicy,
    dims: dict[str, int],
    grad_inputs: set[ir.Value] = frozenset(),
    regions: Sequence[str] = (),
) -> tuple[list[ir.Node], RecomputePlan]:
    """The backward node list with recompute groups inserted, and the plan (NOTE [recompute]).

    ``saved`` are the values the backward reads from the forward; ``free`` those that cost nothing
    to save (graph inputs, user outputs, mutated buffers: alive anyway); ``grad_inputs`` the
    backward's output-gradient inputs (NOTE [recompute order] gates groups on values made from them);
    ``regions`` the module paths run under torch.utils.checkpoint (NOTE [checkpoint regions]): at
    every level they are recomputed like level-1 blocks."""
    producer = {o: n for n in fwd_nodes for o in n.outputs}
    groups: dict[str, list[ir.Node]] = {}
    group_of: dict[ir.Node, str] = {}
    saved_set = set(saved)
    already = set(bwd_nodes)  # forward nodes the backward runs anyway (NOTE [views are recomputed])

    def add(node: ir.Node, group: str) -> None:
        if node not in group_of and node not in already:
            group_of[node] = group
            groups.setdefault(group, []).append(node)

    blocks = _blocks(fwd_nodes) if policy.level >= 1 else {}
    blocks.update(_regions(fwd_nodes, regions))

    def grow(v: ir.Value, group: str, inside) -> None:
        stack = [v]
        while stack:
            node = producer[stack.pop()]
            if node in group_of or node in already:
                continue
            add(node, group)
            for u in node.inputs:
                p = producer.get(u) if u is not None else None
                if p is not None and u not in free and p not in group_of and _recomputable(p) and inside(p):
                    stack.append(u)

    for v in saved:  # level 1: the saved values of each block, from what the block reads
        p = producer.get(v)
        if v in free or p is None or p not in blocks or not _recomputable(p):
            continue
        b = blocks[p]
        grow(v, b, lambda n, b=b: blocks.get(n) == b)
    left = {op: n for op, n in policy.plan}
    for v in saved:  # the plan list: clusters of the listed op types
        p = producer.get(v)
        if v in free or p is None or p in group_of or p.op_type not in left or not _recomputable(p):
            continue
        if left[p.op_type] == 0:
            continue
        left[p.op_type] -= 1
        grow(v, f"plan:{v.name}", lambda n: n.op_type in left)
    for v in saved:  # every level: the scaled dropout masks, from their bool inputs (NOTE [bool masks])
        p = producer.get(v)
        if v in free or p is None or p in group_of or MASK_SCALE_KEY not in p.metadata_props:
            continue
        grow(v, f"mask:{v.name}", lambda n: MASK_SCALE_KEY in n.metadata_props and n.op_type != "Constant")
    for v in saved:  # level 0: cheap ops whose inputs are saved (or free) anyway
        p = producer.get(v)
        if v in free or p is None or p in group_of or p.op_type not in _CHEAP or not _recomputable(p):
            continue
        if all(u is None or u in free or (u in saved_set and producer.get(u) not in group_of)
               or u.const_value is not None or (producer.get(u) is not None and producer[u].op_type == "Constant")
               for u in p.inputs):
            add(p, f"cheap:{v.name}")

    # A value one group reads from outside itself must be saved: drop its producer from any group.
    changed = True
    while changed:
        changed = False
        for node in list(group_of):
            g = group_of.get(node)
            if g is None:  # dropped in this sweep
                continue
            for u in node.inputs:
                p = producer.get(u) if u is not None else None
                if p is not None and p in group_of and group_of[p] != g:
                    groups[group_of[p]].remove(p)
                    del group_of[p]
                    changed = True
    recomputed_nodes = set(group_of)
    if not recomputed_nodes:
        return list(bwd_nodes), RecomputePlan(policy, [], [], saved=[(v.name, nbytes(v, dims)) for v in saved
                                                                     if v not in free])

    # Insert each group (forward order) before the first backward node that reads one of its values.
    order = {n: i for i, n in enumerate(fwd_nodes)}
    made = {o: group_of[n] for n in recomputed_nodes for o in n.outputs}
    pending = {g: sorted(nodes, key=order.__getitem__) for g, nodes in groups.items() if nodes}
    out: list[ir.Node] = []
    gates = []
    last_grad: list[ir.Value | None] = [None]
    from_grads = set(grad_inputs)  # values computed from the output gradients

    def emit(g: str, at: ir.Node) -> None:
        nodes = pending.pop(g, None)
        if nodes is None:
            return
        out.extend(nodes)
        inside = {o for n in nodes for o in n.outputs}
        # The gradient value computed last before this point: the group waits for it.
        trigger = last_grad[0]
        if trigger is not None:
            reads = sorted({u.name for n in nodes for u in n.inputs if u is not None and u not in inside
                            and u.const_value is None and u.name})
            gates.append((trigger.name, [n.outputs[0].name for n in nodes], reads))

    for node in bwd_nodes:
        for u in node.inputs:
            if u is not None and u in made:
                emit(made[u], node)
        out.append(node)
        if node not in group_of and any(u is not None and u in from_grads for u in node.inputs):
            from_grads.update(node.outputs)
            floats = [o for o in node.outputs if o.dtype is not None and o.dtype.is_floating_point()
                      and o.shape is not None and len(o.shape) >= 1]
            if floats:
                last_grad[0] = floats[0]
    leftover = [n for g in list(pending) for n in pending.pop(g)]  # values the backward returns as they are
    out = leftover + out

    produced_by_groups = set(made)
    reads = {u for n in recomputed_nodes for u in n.inputs if u is not None}
    new_saved = [u for u in reads if u not in produced_by_groups and u not in saved_set and u not in free
                 and u.const_value is None and producer.get(u) is not None and producer[u].op_type != "Constant"]
    recomputed = [(v.name, producer[v].op_type, _path(producer[v]), nbytes(v, dims))
                  for v in saved if v in produced_by_groups]
    still = [v for v in saved if v not in produced_by_groups and v not in free] + new_saved
    plan = RecomputePlan(policy, recomputed, [(u.name, nbytes(u, dims)) for u in new_saved],
                         saved=[(v.name, nbytes(v, dims)) for v in still],
                         nodes=len(recomputed_nodes), extra_flops=sum(_flops(n, dims) for n in recomputed_nodes),
                         gates=gates)
    return out, plan


def gate_groups(backward: onnx.ModelProto, gates: Sequence[tuple[str, list[str], list[str]]]) -> None:
    """NOTE [recompute order]: onnxruntime orders nodes itself and runs a recompute group as soon as
    its inputs are there, which are saved values: every layer's recompute at the start of the
    backward, all alive at once (measured: BERT's recomputed nodes ran first). Each group's reads
    from outside are routed through ``Reshape(x, Shape(x) + z)`` with ``z`` a zero computed from
    the gradient value ("trigger") the group's first consumer reads (``Xor(isnan(t), isnan(t))``:
    0 whatever t holds, and not foldable); the Reshape is a view, the values are unchanged."""
    from onnx import TensorProto
    from onnx import helper as h

    if not gates:
        return
    graph = backward.graph
    first_out = {n.output[0]: n for n in graph.node if n.output}
    position = {id(n): i for i, n in enumerate(graph.node)}
    inserts: dict[int, list[onnx.NodeProto]] = {}
    for k, (trigger, members, reads) in enumerate(gates):
        nodes = [first_out[m] for m in members if m in first_out]
        if not nodes or not reads:
            continue
        p = f"recompute_gate{k}"
        new = [
            h.make_node("Flatten", [trigger], [f"{p}/flat"], axis=0),
            h.make_node("Slice", [f"{p}/flat", f"{p}/zero", f"{p}/one", f"{p}/one"], [f"{p}/first"]),
            h.make_node("IsNaN", [f"{p}/first"], [f"{p}/nan"]),
            h.make_node("Xor", [f"{p}/nan", f"{p}/nan"], [f"{p}/false"]),
            h.make_node("Cast", [f"{p}/false"], [f"{p}/z2"], to=TensorProto.INT64),
            h.make_node("Reshape", [f"{p}/z2", f"{p}/minus_one"], [f"{p}/z"]),
        ]
        graph.initializer.extend([h.make_tensor(f"{p}/zero", TensorProto.INT64, [1], [0]),
                                  h.make_tensor(f"{p}/one", TensorProto.INT64, [1], [1]),
                                  h.make_tensor(f"{p}/minus_one", TensorProto.INT64, [1], [-1])])
        renamed = {}
        for i, x in enumerate(reads):
            g = f"{p}/in{i}"
            new += [h.make_node("Shape", [x], [f"{g}/shape"]),
                    h.make_node("Add", [f"{g}/shape", f"{p}/z"], [f"{g}/gated_shape"]),
                    h.make_node("Reshape", [x, f"{g}/gated_shape"], [g])]
            renamed[x] = g
        for n in nodes:
            for j, name in enumerate(n.input):
                if name in renamed:
                    n.input[j] = renamed[name]
        inserts.setdefault(min(position[id(n)] for n in nodes), []).extend(new)
    ordered = []
    for i, n in enumerate(graph.node):
        ordered.extend(inserts.get(i, ()))
        ordered.append(n)
    del graph.node[:]
    graph.node.extend(ordered)
