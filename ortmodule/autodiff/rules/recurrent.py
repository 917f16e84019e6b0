"""Recurrent ops: LSTM, GRU, RNN, differentiated by torch's own recurrent kernels (NOTE [onnx rnn as
torch] in runtime/torch_nodes.py)."""

from __future__ import annotations

import onnx_ir as ir

from ...runtime.torch_nodes import Arg
from ..registry import GradBuilder, attr, attr_str, input_or_none, register, register_check, text

_DEFAULT_ACTIVATIONS = {"LSTM": ["sigmoid", "tanh", "tanh"], "GRU": ["sigmoid", "tanh"]}


def _refusal(node: ir.Node) -> str | None:
    """What torch's recurrent kernels (which give the gradient) do not compute, or None."""
    n_dir = 2 if attr_str(node, "direction", "forward") == "bidirectional" else 1
    acts = [text(a).lower() for a in (attr(node, "activations") or [])]
    if node.op_type == "RNN":
        acts = acts or ["tanh"] * n_dir
        bad_acts = len(set(acts)) != 1 or acts[0] not in ("tanh", "relu")
    else:
        bad_acts = bool(acts) and acts != _DEFAULT_ACTIVATIONS[node.op_type] * n_dir
    why = None
    if bad_acts:
        why = f"activations {acts}"
    elif attr(node, "clip") is not None:
        why = "clip"
    elif attr(node, "activation_alpha") is not None or attr(node, "activation_beta") is not None:
        why = "activation_alpha / activation_beta"
    elif node.op_type == "LSTM" and attr(node, "input_forget", 0):
        why = "input_forget"
    elif node.op_type == "LSTM" and input_or_none(node, 7) is not None:
        why = "peephole weights (input P)"
    elif node.op_type == "GRU" and not attr(node, "linear_before_reset", 0):
        why = "linear_before_reset=0 (torch's GRU applies the reset gate after the recurrent matmul)"
    elif input_or_none(node, 4) is not None:
        why = "sequence_lens (per-sequence lengths)"
    elif attr(node, "layout", 0):
        return "no gradient rule for layout=1 (onnxruntime runs no batch-first recurrent op)"
    if why is None:
        return None
    return (f"no gradient rule for {why} (torch's recurrent kernels, which give the gradient, do not compute "
            "it: NOTE [onnx rnn as torch])")


def _kind(node: ir.Node) -> str:
    """torch's kernel for the node."""
    why = _refusal(node)
    if why is not None:
        raise NotImplementedError(f"{node.op_type} node {node.name!r}: {why}")
    if node.op_type != "RNN":
        return node.op_type
    acts = [text(a).lower() for a in (attr(node, "activations") or [])]
    return "RNN_RELU" if acts and acts[0] == "relu" else "RNN_TANH"


def _recurrent_grad(g: GradBuilder, node: ir.Node, dys):
    """dX, dW, dR, dB, d initial_h, d initial_c from one ``ortmodule::onnx_rnn_backward`` node."""
    direction = attr_str(node, "direction", "forward")
    kind = _kind(node)
    names = ("x", "w", "r", "b", "h0", "c0")
    index = {"x": 0, "w": 1, "r": 2, "b": 3, "h0": 5, "c0": 6}
    values = {k: input_or_none(node, i) for k, i in index.items()}
    if node.op_type != "LSTM":
        values["c0"] = None
    feeds: list[ir.Value] = []
    args: list = [kind, int(attr(node, "hidden_size")), direction]
    for v in [values[k] for k in names] + [dys[i] if i < len(dys) else None for i in range(3)]:
        if v is None:
            args.append(None)
        else:
            args.append(Arg(len(feeds)))
            feeds.append(v)
    wanted = [i for i, k in enumerate(names) if values[k] is not None]
    outs = g.aten("ortmodule::onnx_rnn_backward", feeds, args, wanted)
    grads: list[ir.Value | None] = [None] * len(node.inputs)
    for i, out in zip(wanted, outs):
        src = values[names[i]]
        out.dtype, out.shape = src.dtype, src.shape
        grads[index[names[i]]] = out
    return grads


for _op in ("LSTM", "GRU", "RNN"):
    register(_op)(_recurrent_grad)
    register_check(_op)(_refusal)
