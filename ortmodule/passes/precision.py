"""Precise forms of onnxruntime kernels whose values are exact only in absolute terms, where the
graph reads them relatively.

# NOTE [precise sigmoid]: onnxruntime's CPU Sigmoid (MLAS's logistic approximation) is exact to
# about 1e-7 absolute, not relative: sigmoid(-10) comes out 0.2% off, sigmoid(-12) 29%,
# sigmoid(-16) 5.96e-8 for 1.13e-7 and sigmoid(-18) 0 (float32; float64 is 0.1% off at -30), where
# torch's is exact to an ulp. Added to or multiplied into other activations that is noise; read
# relatively it is a wrong number: ``log(sigmoid(x))`` (focal and custom BCE losses) was 0.25 off
# at x = -12 and -inf from -17.4 on, ``x / sigmoid(z)`` and ``sqrt`` likewise, and a model that
# returns probabilities to a loss computed in torch (``F.binary_cross_entropy(model(x), y)``) gave
# a gradient 1000x eager's for a confident mistake. Where a Sigmoid's value reaches such a reader
# (Log, Sqrt, Reciprocal, the divisor of a Div, the base of a Pow, a graph output or a node outside
# the ONNX domain) through value-keeping ops, its negative half is written ``e / (1 + e)`` with
# ``e = exp(x)`` and its positive half ``1 / (1 + exp(-x))`` as torch writes it (onnxruntime's is 3
# ulps off near 1, where ``log(1 - p)`` reads it: a BCE on probabilities differed by 1%); exact to an
# ulp, denormals aside. The graph pass only marks the node (``PRECISE_KEY``): autodiff sees a Sigmoid
# and gives eager's gradient ``dy y (1 - y)`` of the precise value (differentiating the written-out
# form instead gave 1e3 where eager's is 0: y rounds to 1 where exp(-x) does not vanish), and the
# node is written out where a model becomes a session (runtime/session.py), so the forward, a
# recomputation in the backward and the no-grad graph all run the same precise form.

# NOTE [no where]: onnxruntime's CPU Where is slow: 7.95 ms on [2048, 512] float32 (2 threads), where
# Cast + Sub + Mul + Add of the same tensors take 0.41 ms and torch.where 2.3 ms. The precise sigmoid
# is written without one: Mixtral's SiLU feeds a torch node (the experts' custom op), so its sigmoids
# are precise, and their four Wheres per layer took 57 ms of a 96 ms forward.

# NOTE [float64 kernels]: onnxruntime's CPU Gelu(approximate='tanh') computes float64 inputs at
# float32 precision (2e-7 relative against torch's 1e-13; a test model's gradients 1e-8 off), and
# Selu's alpha and gamma are float attributes (3.3e-8 relative off on every output). A float64 model
# (scientific ML) got float32 numbers without a word: both are marked by a forward pass and written
# out at session creation in torch's form with double constants; Selu's gradient rule takes the
# double constants too. Float64 ops onnxruntime has no kernel for (Erf, Softplus, Atan, ...)
# fail the session and fall back, naming the op.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir

PRECISE_KEY = "pkg.ortmodule.precise"

# Ops through which a small value stays small in relative terms (or is passed on as it is).
_KEEPS_VALUE = frozenset({
    "Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Slice", "Gather",
    "GatherElements", "GatherND", "Concat", "Expand", "Split", "Tile", "Pad", "Add", "Sub", "Mul", "Neg",
    "Abs", "Clip", "Max", "Min", "Where", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
    "CumSum", "Div",
})
_READS_RELATIVELY = frozenset({"Log", "Sqrt", "Reciprocal"})
_PRECISE_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})
_MAX_WALK = 256


def _read_relatively(graph: ir.Graph, y: ir.Value) -> bool:
    """Whether ``y``'s value reaches a relative reader (NOTE [precise sigmoid])."""
    outputs = set(graph.outputs)
    seen: set[int] = set()
    todo = [y]
    while todo:
        v = todo.pop()
        if v in outputs:
            return True
        for use in v.uses():
            node, idx = use.node, use.idx
            if node.domain not in ("", "ai.onnx"):
                return True
            op = node.op_type
            if (op in _READS_RELATIVELY or (op == "Div" and idx == 1) or (op == "Pow" and idx == 0)):
                return True
            if op not in _KEEPS_VALUE or id(node) in seen:
                continue
            seen.add(id(node))
            if len(seen) > _MAX_WALK:
                return True  # a long walk: keep it precise rather than guess
            todo.extend(o for o in node.outputs if o is not None)
    return False


def mark_precise(node: ir.Node, dtype: ir.DataType | None) -> None:
    """Have the sessions run ``node`` in its written-out form (``lower_precise``), if of a float dtype."""
    if dtype in _PRECISE_TYPES:
        node.metadata_props[PRECISE_KEY] = str(int(dtype))  # the proto has no types


def stable_logs(graph: ir.Graph) -> int:
    """Write ``Log(Sigmoid(x))`` as ``-Softplus(-x)`` and ``Log(Softmax(x))`` as ``LogSoftmax(x)``.

    # NOTE [stable logsigmoid] (export/semantics.py): both exporters write logsigmoid as the log of
    # the sigmoid, which even exact is -inf below x ~ -104 (float32) where torch's is x. A direct
    # ``F.logsigmoid`` is rewritten at trace time, but composites call it from ATen
    # (``F.multilabel_soft_margin_loss``: NaN where a target is 0 and the logit ~ 110), and ONNX
    # files carry the same pair.
    # NOTE [log of softmax]: ``torch.log(F.softmax(x, -1))`` (entropy and KL terms written by hand)
    # is -inf where a probability underflows, from a gap of ~87 in ORT (it keeps fewer denormals
    # than torch: 353 -inf of 1024 at logit scale 40 where eager had 223); as LogSoftmax it is finite
    # and eager's wherever eager's is finite. Where eager's underflows too (gaps over ~104) ours is
    # the finite value, as for the log of an underflowing sigmoid: a -inf eager can only propagate.
    # The Sigmoid or Softmax stays where something else reads it.
    """
    changed = 0
    for log in list(graph):
        if log.op_type != "Log" or log.domain not in ("", "ai.onnx"):
            continue
        inner = log.inputs[0].producer() if log.inputs[0] is not None else None
        if inner is None or inner.op_type not in ("Sigmoid", "Softmax") or inner.domain not in ("", "ai.onnx"):
            continue
        x = inner.inputs[0]
        if x is None or x.dtype not in _PRECISE_TYPES:
            continue
        if inner.op_type == "Sigmoid" and x.dtype != ir.DataType.FLOAT:
            continue  # no float64 Softplus kernel in the sessions: the precise Sigmoid serves (exact to -708)
        base = log.name or "Log"
        if inner.op_type == "Sigmoid":
            steps = (("Neg", "minus", ()), ("Softplus", "softplus", ()), ("Neg", "log_sigmoid", ()))
        else:
            steps = (("LogSoftmax", "log_softmax", [a for a in inner.attributes.values() if a.name == "axis"]),)
        nodes: list[ir.Node] = []
        for op, name, attrs in steps:
            n = ir.Node("", op, [nodes[-1].outputs[0] if nodes else x], list(attrs), name=f"{base}/{name}",
                        metadata_props=dict(log.metadata_props))
            n.outputs[0].dtype, n.outputs[0].shape = x.dtype, log.outputs[0].shape or x.shape
            nodes.append(n)
        graph.insert_before(log, nodes)
        (y,) = log.outputs
        y.replace_all_uses_with(nodes[-1].outputs[0], replace_graph_outputs=True)
        name = y.name
        graph.remove(log, safe=True)
        nodes[-1].outputs[0].name = name
        if not inner.outputs[0].uses() and inner.outputs[0] not in graph.outputs:
            graph.remove(inner, safe=True)
        changed += 1
    return changed


def precise_sigmoid(graph: ir.Graph) -> int:
    """Mark the Sigmoids whose value is read relatively (NOTE [precise sigmoid]); the sessions run them
    as :func:`lower_precise` writes them, and their gradient stays eager's ``y (1 - y)`` of that value."""
    changed = 0
    for node in graph:
        if (node.op_type != "Sigmoid" or node.domain not in ("", "ai.onnx") or PRECISE_KEY in node.metadata_props
                or node.inputs[0] is None or node.inputs[0].dtype not in _PRECISE_TYPES):
            continue
        if _read_relatively(graph, node.outputs[0]):
            mark_precise(node, node.inputs[0].dtype)
            changed += 1
    return changed


def lower_precise(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its marked nodes written out (Sigmoid: NOTE [precise sigmoid]; float64 Gelu and
    Selu: NOTE [float64 kernels]); ``model`` itself where none is marked. The outputs keep their names."""
    if not any(p.key == PRECISE_KEY for n in model.graph.node for p in n.metadata_props):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    for node in out.graph.node:
        written = _WRITTEN_OUT.get(node.op_type)
        if written is None or not any(p.key == PRECISE_KEY for p in node.metadata_props):
            nodes.append(node)
            continue
        dtype = next(int(p.value) for p in node.metadata_props if p.key == PRECISE_KEY)
        new = written(node, dtype)
        props = {p.key: p.value for p in node.metadata_props if p.key != PRECISE_KEY}
        for i, n in enumerate(new):
            n.name = f"{node.name or node.op_type}/precise/{i}"
            if props:
                onnx.helper.set_metadata_props(n, props)
        nodes.extend(new)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _sigmoid_nodes(node: onnx.NodeProto, dtype: int) -> list[onnx.NodeProto]:
    # exp(min(x, 0)) / (1 + exp(-|x|)): the negative half e / (1 + e) and the positive half 1 / (1 + e),
    # e = exp(-|x|), without a Where (NOTE [no where]: exp(min(x, 0)) is e below 0 and exactly 1 above)
    (x,), (y,) = node.input, node.output
    base = f"{y}/precise"
    make = onnx.helper.make_node
    return [
        _const(f"{base}/one", dtype, 1.0), _const(f"{base}/zero", dtype, 0.0),
        make("Abs", [x], [f"{base}/abs"]),
        make("Neg", [f"{base}/abs"], [f"{base}/minus_abs"]),
        make("Exp", [f"{base}/minus_abs"], [f"{base}/exp"]),
        make("Add", [f"{base}/exp", f"{base}/one"], [f"{base}/one_plus_exp"]),
        make("Min", [x, f"{base}/zero"], [f"{base}/negative_part"]),
        make("Exp", [f"{base}/negative_part"], [f"{base}/numerator"]),
        make("Div", [f"{base}/numerator", f"{base}/one_plus_exp"], [y]),
    ]


def _const(name: str, dtype: int, value: float) -> onnx.NodeProto:
    return onnx.helper.make_node("Constant", [], [name], value=onnx.helper.make_tensor(name, dtype, [], [value]))


def _gelu_tanh_nodes(node: onnx.NodeProto, dtype: int) -> list[onnx.NodeProto]:
    # torch's form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    (x,), (y,) = node.input, node.output
    b = f"{y}/precise"
    make = onnx.helper.make_node
    return [
        _const(f"{b}/kappa", dtype, 0.044715), _const(f"{b}/beta", dtype, math.sqrt(2.0 / math.pi)),
        _const(f"{b}/one", dtype, 1.0), _const(f"{b}/half", dtype, 0.5),
        make("Mul", [x, x], [f"{b}/x2"]), make("Mul", [f"{b}/x2", x], [f"{b}/x3"]),
        make("Mul", [f"{b}/x3", f"{b}/kappa"], [f"{b}/kx3"]), make("Add", [x, f"{b}/kx3"], [f"{b}/inner"]),
        make("Mul", [f"{b}/inner", f"{b}/beta"], [f"{b}/scaled"]), make("Tanh", [f"{b}/scaled"], [f"{b}/t"]),
        make("Add", [f"{b}/t", f"{b}/one"], [f"{b}/t1"]), make("Mul", [x, f"{b}/half"], [f"{b}/hx"]),
        make("Mul", [f"{b}/hx", f"{b}/t1"], [y]),
    ]


_SELU_ALPHA, _SELU_GAMMA = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def selu_constants(alpha: float | None, gamma: float | None) -> tuple[float, float]:
    """Selu's (alpha, gamma) from its float attributes: torch's double constants where the
    attributes are those rounded to float (NOTE [float64 kernels])."""
    alpha = _SELU_ALPHA if alpha is None or np.float32(alpha) == np.float32(_SELU_ALPHA) else alpha
    gamma = _SELU_GAMMA if gamma is None or np.float32(gamma) == np.float32(_SELU_GAMMA) else gamma
    return float(alpha), float(gamma)


def _selu_nodes(node: onnx.NodeProto, dtype: int) -> list[onnx.NodeProto]:
    # gamma * (x if x > 0 else alpha * expm1(x)), with torch's double constants where the (float)
    # attributes are theirs rounded, and expm1(x) = (u - 1) x / log(u), u = exp(x), for |x| < 1
    attrs = {a.name: a.f for a in node.attribute}
    alpha, gamma = selu_constants(attrs.get("alpha"), attrs.get("gamma"))
    (x,), (y,) = node.input, node.output
    b = f"{y}/precise"
    make = onnx.helper.make_node
    return [
        _const(f"{b}/alpha", dtype, alpha), _const(f"{b}/gamma", dtype, gamma), _const(f"{b}/zero", dtype, 0.0),
        _const(f"{b}/one", dtype, 1.0),
        make("Exp", [x], [f"{b}/u"]), make("Sub", [f"{b}/u", f"{b}/one"], [f"{b}/naive"]),
        make("Log", [f"{b}/u"], [f"{b}/lu"]), make("Div", [f"{b}/naive", f"{b}/lu"], [f"{b}/ratio"]),
        make("Mul", [f"{b}/ratio", x], [f"{b}/exact"]), make("Abs", [x], [f"{b}/ax"]),
        make("Less", [f"{b}/ax", f"{b}/one"], [f"{b}/small"]), make("Equal", [f"{b}/u", f"{b}/one"], [f"{b}/flat"]),
        make("Where", [f"{b}/small", f"{b}/exact", f"{b}/naive"], [f"{b}/em1_"]),
        make("Where", [f"{b}/flat", x, f"{b}/em1_"], [f"{b}/em1"]),
        make("Mul", [f"{b}/em1", f"{b}/alpha"], [f"{b}/neg"]), make("Greater", [x, f"{b}/zero"], [f"{b}/pos"]),
        make("Where", [f"{b}/pos", x, f"{b}/neg"], [f"{b}/v"]), make("Mul", [f"{b}/v", f"{b}/gamma"], [y]),
    ]


_WRITTEN_OUT = {"Sigmoid": _sigmoid_nodes, "Gelu": _gelu_tanh_nodes, "Selu": _selu_nodes}


def precise_double_kernels(graph: ir.Graph) -> int:
    """Mark float64 Gelu(tanh) and Selu nodes to be written out (NOTE [float64 kernels])."""
    changed = 0
    for node in graph:
        if node.domain not in ("", "ai.onnx") or PRECISE_KEY in node.metadata_props or not node.inputs \
                or node.inputs[0] is None or node.inputs[0].dtype != ir.DataType.DOUBLE:
            continue
        approximate = node.attributes.get("approximate")
        if node.op_type == "Selu" or (node.op_type == "Gelu" and approximate is not None
                                      and approximate.value == "tanh"):
            mark_precise(node, ir.DataType.DOUBLE)
            changed += 1
    return changed


# NOTE [NaN in max]: onnxruntime's CPU ReduceMax, ReduceMin and MaxPool skip NaN (a row [NaN, 0.2,
# 0.8] reduces to 0.8), where torch's amax, amin, max and max_pool propagate it. A NaN that eager
# would carry to the loss (a diverging run, an fp16 overflow that GradScaler must see) vanished in
# ORT, and the run went on with a finite loss, without a word. Each such node's value is now
# ``y + Where(IsNaN(s), NaN, -0.0)``, where ``s`` is the sum over the same window (ReduceSum with
# the same axes, AveragePool with the same geometry), which is NaN where the window holds a NaN; the
# Add is exact elsewhere (``y + -0.0`` is ``y``, signed zeros included). Cost: one more pass over
# the input and a few ops on the output-sized tensor, ~0.35 ms of ORT's forward kernels for the CNN
# benchmark's two pools (3.07 -> 3.52 ms, ~3% of its step; an IsNaN mask pooled alike cost ~0.8 ms).
# A window holding +inf and -inf but no NaN sums to NaN too, and comes out NaN where torch's max is
# +inf: loud, not silent. fp16 sums overflow, so fp16 (and a dilated MaxPool: AveragePool has no
# dilations before opset 19) pool the IsNaN mask itself. The rules still differentiate the original
# node, and the Add passes the whole output gradient to it, so a NaN gradient reaches the weights
# before the window as in eager (a Where would stop it there). Indices outputs (ArgMax, MaxPool's
# Indices) keep onnxruntime's choice; a MaxPool window of only -inf gives -FLT_MAX (torch: -inf).
_NAN_SKIPPING = frozenset({"ReduceMax", "ReduceMin", "MaxPool"})
_SUMMED_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})


class _Emitter:
    """Makes the nodes of one rewrite, named after the node rewritten and keeping its metadata."""

    def __init__(self, base: str, meta: dict[str, str]) -> None:
        self.base, self.meta, self.nodes = base, meta, []

    def __call__(self, op: str, inputs, attrs=(), dtype=None, shape=None) -> ir.Value:
        n = ir.Node("", op, inputs, list(attrs), name=f"{self.base}/nan_{len(self.nodes)}_{op}",
                    metadata_props=dict(self.meta))
        n.outputs[0].dtype, n.outputs[0].shape = dtype, shape
        self.nodes.append(n)
        return n.outputs[0]


def _nan_in_window(node: ir.Node, x: ir.Value, y: ir.Value, new: _Emitter) -> ir.Value:
    """A bool value, True where ``node``'s window (its reduction or pooling window) of ``x`` holds a NaN."""
    attrs = {a.name: a for a in node.attributes.values()}
    dilated = any(d != 1 for d in (attrs["dilations"].value if "dilations" in attrs else ()))
    if x.dtype in _SUMMED_TYPES and not (node.op_type == "MaxPool" and dilated):
        if node.op_type == "MaxPool":
            keep = [a for k, a in attrs.items() if k in ("auto_pad", "ceil_mode", "kernel_shape", "pads", "strides")]
            window = new("AveragePool", [x], keep, x.dtype, y.shape)
        else:
            inputs = list(node.inputs[1:])
            if "axes" in attrs:  # opset < 18: ReduceMax's axes are an attribute, ReduceSum's (13+) an input
                axes = np.asarray(attrs["axes"].value, dtype=np.int64)
                inputs = [new("Constant", [], [ir.AttrTensor("value", ir.tensor(axes))], ir.DataType.INT64,
                              ir.Shape(axes.shape))]
            window = new("ReduceSum", [x, *inputs], [a for k, a in attrs.items() if k != "axes"], x.dtype, y.shape)
        return new("IsNaN", [window], dtype=ir.DataType.BOOL, shape=y.shape)
    is_nan = new("IsNaN", [x], dtype=ir.DataType.BOOL, shape=x.shape)
    mask = new("Cast", [is_nan], [ir.AttrInt64("to", x.dtype)], x.dtype, x.shape)
    op = "ReduceMax" if node.op_type == "ReduceMin" else node.op_type
    window = new(op, [mask, *node.inputs[1:]], list(attrs.values()), x.dtype, y.shape)
    zero = new("Constant", [], [ir.AttrTensor("value", ir.tensor(np.zeros((), dtype=x.dtype.numpy())))], x.dtype,
               ir.Shape([]))
    return new("Greater", [window, zero], dtype=ir.DataType.BOOL, shape=y.shape)


def propagate_nan_in_max(graph: ir.Graph) -> int:
    """Make ReduceMax, ReduceMin and MaxPool values NaN where their window holds a NaN (NOTE [NaN in max])."""
    changed = 0
    for node in list(graph):
        if node.op_type not in _NAN_SKIPPING or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if x is None or x.dtype is None or not x.dtype.is_floating_point() or not (y.uses() or y in graph.outputs):
            continue
        if any(u.node.op_type == "Add" and u.node.name.endswith("/nan") for u in y.uses()):
            continue  # done already
        new = _Emitter(node.name or f"{node.op_type}_{changed}", dict(node.metadata_props))  # unnamed: numbered
        held = _nan_in_window(node, x, y, new)
        nan, minus_zero = (new("Constant", [], [ir.AttrTensor("value", ir.tensor(np.full((), v, x.dtype.numpy())))],
                               x.dtype, ir.Shape([])) for v in (np.nan, -0.0))
        addend = new("Where", [held, nan, minus_zero], dtype=x.dtype, shape=y.shape)
        add = ir.Node("", "Add", [y, addend], name=f"{new.base}/nan", metadata_props=dict(new.meta))
        out = add.outputs[0]
        out.dtype, out.shape = y.dtype, y.shape
        graph.insert_after(node, [*new.nodes, add])
        for use in list(y.uses()):
            if use.node is not add:
                use.node.replace_input_with(use.idx, out)
        if y in graph.outputs:
            graph.outputs[list(graph.outputs).index(y)] = out
        name = y.name
        y.name = f"{name}/nan_skipping"
        out.name = name
        changed += 1
    return changed
