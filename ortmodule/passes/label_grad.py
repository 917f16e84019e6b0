"""Fold the cross-entropy gradient's label correction into the matrix products that read it.

# NOTE [label grad folding]: the cross-entropy rule builds the logits gradient as
# ``dZ = P * c - onehot(labels) * c`` (P = softmax(scores) [N, V], c the per-row coefficient [N, 1]),
# a ScatterElements that copies the whole [N, V] tensor to subtract c at N positions (GPT-2's LM
# head, V = 50257: 15 ms for the copy and 9 ms for the Mul by c, per step). When dZ (or a Reshape
# of it) is read only by the LM head's gradient products, both are pushed through them:
#
#   dZ @ W     = c * (P @ W - W[labels])                       [N, E]: a Gather of N rows
#   X^T @ dZ   = ((P^T @ (c X)) with -(c X)[i] added at row labels[i])^T    a scatter over [V, E]
#
# so only P is materialised. The pass runs on backward models (proto level): after the absent
# output-gradient specialisation the logits gradient of a model that returns (loss, logits) is the
# cross-entropy term alone, which is when the pattern appears.
#
# The scatter is a ScatterElements(add) with the labels expanded to [N, E], never a ScatterND(add):
# labels repeat by the thousand, and onnxruntime's ScatterND races on repeated rows (NOTE [exact
# scatters] in ortmodule/autodiff/rules/indexing.py).
"""

from __future__ import annotations

import itertools

import onnx
from onnx import helper

from .proto import node_attrs


def _static_dims(vi: onnx.ValueInfoProto | None) -> list[int | None] | None:
    if vi is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]


def _const_ints(name: str, producers: dict, inits: dict) -> list[int] | None:
    if name in inits:
        return [int(i) for i in onnx.numpy_helper.to_array(inits[name]).reshape(-1)]
    node = producers.get(name)
    if node is not None and node.op_type == "Constant":
        for a in node.attribute:
            if a.name == "value":
                return [int(i) for i in onnx.numpy_helper.to_array(a.t).reshape(-1)]
    return None


def fold_label_grad(model: onnx.ModelProto) -> int:
    """Rewrite ``model`` in place (NOTE [label grad folding]); returns the number of folds."""
    graph = model.graph
    folds = 0
    while True:
        new_nodes = _fold_once(graph)
        if new_nodes is None:
            break
        del graph.node[:]
        graph.node.extend(new_nodes)
        folds += 1
    return folds


def _fold_once(graph: onnx.GraphProto) -> list[onnx.NodeProto] | None:
    nodes = list(graph.node)
    producers = {o: n for n in nodes for o in n.output if o}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            if i:
                consumers.setdefault(i, []).append(n)
    inits = {t.name: t for t in graph.initializer}
    infos = {v.name: v for v in itertools.chain(graph.input, graph.value_info)}
    graph_outputs = {o.name for o in graph.output}
    names = {v for n in nodes for v in itertools.chain(n.input, n.output)} | set(inits) | set(infos)

    for scatter in nodes:
        if scatter.op_type != "ScatterElements" or scatter.domain not in ("", "ai.onnx"):
            continue
        at = node_attrs(scatter)
        if at.get("axis", 0) not in (1, -1) or at.get("reduction") != "add":
            continue
        a_name, idx_name, upd_name = scatter.input
        mul, neg = producers.get(a_name), producers.get(upd_name)
        if mul is None or neg is None or mul.op_type != "Mul" or neg.op_type != "Neg":
            continue
        coef = neg.input[0]
        if coef not in mul.input:
            continue
        prob = mul.input[1] if mul.input[0] == coef else mul.input[0]
        source = producers.get(prob)  # Softmax(scores), or Exp(log_prob)
        if source is None or not (source.op_type == "Exp" or (
                source.op_type == "Softmax" and node_attrs(source).get("axis", -1) in (1, -1))):
            continue
        vocab = _vocab(source.input[0], infos, producers, inits)  # of the scores / log_prob [N, V]
        if vocab is None:
            continue

        # The views of dZ (itself, Reshapes and Identities of it; each mapped to the Reshape that set
        # its shape, None for dZ's own) and the products reading them.
        views, terminals, ok = {scatter.output[0]: None}, [], True
        frontier = [scatter.output[0]]
        while frontier and ok:
            v = frontier.pop()
            if v in graph_outputs:
                ok = False
                break
            for c in consumers.get(v, []):
                if c.op_type == "Reshape" and c.input[0] == v:
                    views[c.output[0]] = c
                    frontier.append(c.output[0])
                elif c.op_type == "Identity":  # e.g. a Sum left with one term by the zero-grad pass
                    views[c.output[0]] = views[v]
                    frontier.append(c.output[0])
                elif c.op_type == "MatMul" and c.input[0] == v and c.input[1] != v:
                    w_dims = _static_dims(infos.get(c.input[1]))
                    if c.input[1] in inits:
                        w_dims = list(inits[c.input[1]].dims)
                    if w_dims is None or len(w_dims) != 2 or w_dims[0] != vocab:
                        ok = False
                        break
                    if v in views and views[v] is not None:  # a Reshape's 0 would copy dZ's dims
                        dims = _const_ints(views[v].input[1], producers, inits)
                        if dims is not None and 0 in dims:
                            ok = False
                            break
                    terminals.append(("dx", c))
                elif (c.op_type == "Gemm" and len(c.input) == 2 and c.input[1] == v and c.input[0] != v
                      and _plain_transposed_a(c)):
                    if not _is_rows_of(v, views, vocab, producers, inits):
                        ok = False
                        break
                    terminals.append(("dw", c))
                else:
                    ok = False
                    break
        if not ok or not terminals:
            continue

        em = _Emitter(names, scatter.name or "label_grad")
        index = em.op("Cast", [idx_name], to=onnx.TensorProto.INT64)  # [N, 1]
        labels = em.op("Reshape", [index, em.const([-1])])  # [N]
        shared = em.take()
        # Each product is replaced in place by its folded form (its own inputs precede it; P, c and
        # the labels precede the scatter, which precedes every view and product).
        replace: dict[int, list[onnx.NodeProto]] = {}
        for kind, node in terminals:
            if kind == "dx":
                w = node.input[1]
                dense = em.op("MatMul", [prob, w])  # [N, E]
                picked = em.op("Gather", [w, labels], axis=0)  # [N, E]
                rows = em.op("Mul", [em.op("Sub", [dense, picked]), coef])
                view = node.input[0]
                if views[view] is None:
                    em.emit("Identity", [rows], node)
                else:
                    shape = views[view].input[1]  # the view's target shape, with E for its last dim
                    lead = em.op("Slice", [shape, em.const([0]), em.const([-1])])
                    em.emit("Reshape", [rows, em.op("Concat", [lead, em.const([-1])], axis=0)], node)
            else:
                scaled = em.op("Mul", [node.input[0], coef])  # c X [N, E]
                dense_t = em.op("Gemm", [prob, scaled], transA=1)  # P^T (c X) [V, E]
                at = em.op("Expand", [index, em.op("Shape", [scaled])])  # [N, E]: NOTE [exact scatters]
                corrected = em.op("ScatterElements", [dense_t, at, em.op("Neg", [scaled])], axis=0,
                                  reduction="add")
                em.emit("Transpose", [corrected], node, perm=[1, 0])
            replace[id(node)] = em.take()

        first = min(nodes.index(n) for _, n in terminals)
        result: list[onnx.NodeProto] = []
        for i, n in enumerate(nodes):
            if i == first:
                result.extend(shared)
            result.extend(replace.get(id(n), [n]))
        return _prune(result, graph_outputs)
    return None


def _plain_transposed_a(gemm: onnx.NodeProto) -> bool:
    """``A^T @ B`` exactly: transA=1, transB=0, alpha=1."""
    at = node_attrs(gemm)
    return at.get("transA", 0) == 1 and at.get("transB", 0) == 0 and float(at.get("alpha", 1.0)) == 1.0


def _vocab(scores: str, infos: dict, producers: dict, inits: dict) -> int | None:
    """V of a 2-D [N, V] value: from its declared shape (a saved value), or from the constant target
    shape of the Reshape that makes it (NOTE [views are recomputed])."""
    dims = _static_dims(infos.get(scores))
    if dims is None:
        reshape = producers.get(scores)
        if reshape is not None and reshape.op_type == "Reshape":
            dims = _const_ints(reshape.input[1], producers, inits)
            dims = None if dims is None or any(d <= 0 for d in dims[1:]) else dims
    if dims is None or len(dims) != 2 or dims[1] is None:
        return None
    return dims[1]


def _is_rows_of(view: str, views: dict, vocab: int, producers: dict, inits: dict) -> bool:
    """Whether ``view`` is dZ laid out as [N, V] (dZ itself, or a Reshape to a constant [-1|N, V])."""
    reshape = views.get(view)
    if reshape is None:
        return True
    dims = _const_ints(reshape.input[1], producers, inits)
    return dims is not None and len(dims) == 2 and dims[1] == vocab and dims[0] != 0


class _Emitter:
    """New nodes with fresh names; ``take()`` hands over those emitted since the last call."""

    def __init__(self, taken: set[str], prefix: str) -> None:
        self._taken, self._prefix, self._count = taken, prefix, itertools.count()
        self._nodes: list[onnx.NodeProto] = []

    def _fresh(self, kind: str) -> str:
        while True:
            name = f"{self._prefix}/label_fold/{kind}_{next(self._count)}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self._fresh(op_type)
        self._nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def const(self, values: list[int]) -> str:
        name = self._fresh("const")
        tensor = helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
        self._nodes.append(helper.make_node("Constant", [], [name], name=name, value=tensor))
        return name

    def emit(self, op_type: str, inputs: list[str], replaces: onnx.NodeProto, **attrs) -> None:
        """A node that takes over ``replaces``'s outputs (and name)."""
        self._nodes.append(helper.make_node(op_type, inputs, list(replaces.output), name=replaces.name, **attrs))

    def take(self) -> list[onnx.NodeProto]:
        nodes, self._nodes = self._nodes, []
        return nodes


def _prune(nodes: list[onnx.NodeProto], graph_outputs: set[str]) -> list[onnx.NodeProto]:
    """Drop nodes none of whose outputs is read (the scatter, its views and the Mul by c)."""
    live = set(graph_outputs)
    keep = []
    for node in reversed(nodes):
        if any(o in live for o in node.output):
            keep.append(node)
            live.update(i for i in node.input if i)
    keep.reverse()
    return keep
