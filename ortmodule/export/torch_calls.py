"""Capture of torch nodes (NOTE [torch nodes] in runtime/torch_nodes.py): a custom ``autograd.Function``
called in forward, and ATen ops whose ONNX translation has no gradient rule, become
``ortmodule::torch_call`` nodes of the exported program, translated as ``TorchCall`` ONNX nodes.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from collections.abc import Sequence

import onnx
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from ..runtime.torch_nodes import (
    CALL_OP,
    TORCH_DOMAIN,
    TorchCall,
    define_torch_call_op,
    lookup_call,
    register_call,
)

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _call_node(target, args: tuple, kwargs: dict, what: str, reason: str, where: str):
    """One ``torch_call`` node running ``target(*args, **kwargs)``, the tensors among the arguments its
    inputs and the rest fixed; the outputs as ``target`` returns them, or None where an argument is a
    size computed from an input's shape (the graph would keep the traced value)."""
    define_torch_call_op()
    flat, spec = pytree.tree_flatten((args, kwargs))
    if any(isinstance(a, _SYM) for a in flat):
        return None
    positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    template = [None if i in positions else a for i, a in enumerate(flat)]

    def fn(*tensors):
        leaves = list(template)
        for i, t in zip(positions, tensors):
            leaves[i] = t
        a, k = pytree.tree_unflatten(leaves, spec)
        return target(*a, **k)

    key = register_call(TorchCall(fn, what, reason, where))
    outs = torch.ops.ortmodule.torch_call([flat[i] for i in positions], key)
    return outs[0] if lookup_call(key).single else tuple(outs)


def function_call(original, cls, args: tuple, kwargs: dict, where: str):
    """The traced stand-in for ``cls.apply(*args, **kwargs)``: one ``torch_call`` node whose torch
    call is the Function's own ``apply`` (forward and backward as in eager).

    Returns the outputs as ``apply`` would, or a reason it cannot be a torch node."""
    out = _call_node(functools.partial(original, cls), args, kwargs,
                     f"custom autograd.Function '{cls.__qualname__}'",
                     "a custom autograd.Function runs with its own forward and backward", where)
    if out is None:
        return None, (f"custom torch.autograd.Function '{cls.__qualname__}' ({where}) gets a size computed from "
                      "an input's shape as a non-tensor argument: the graph would keep the traced value")
    return out, None


def drawing_call(func, args: tuple, kwargs: dict, where: str):
    """NOTE [draws as torch nodes]: a random call whose values depend on tensors inside the graph
    (``multinomial`` in ``Categorical.sample()``, ``_standard_gamma`` in ``Gamma`` / ``Beta.rsample()``,
    ``_sample_dirichlet``, ``poisson``, ``binomial``) as one ``torch_call`` node: torch draws it during the
    run, from eager's generator, with torch's own gradient (the reparameterised gamma's). It keeps
    eager's stream only where every draw the graph makes before the run comes first in eager too
    (NOTE [draws in torch nodes]: the capture refuses it otherwise). Returns None where the call cannot
    be one (a size computed from an input's shape as an argument)."""
    name = getattr(func, "__name__", str(func))
    return _call_node(func, args, kwargs, f"torch.{name}", "it draws values that depend on tensors inside the "
                      "graph: torch draws them during the run, in eager's order", where)


def ctc_loss_call(args: tuple, kwargs: dict, where: str):
    """NOTE [ctc as a torch node]: ``F.ctc_loss`` as one ``torch_call`` node. Its lengths decide the
    work (torch.export refuses its ATen op as data-dependent, and ONNX has no CTC), so it runs in torch
    with torch's own backward; the capture sees only its output's shape (a scalar, or one loss per
    sequence with ``reduction="none"``)."""
    define_torch_call_op()
    bound = inspect.signature(F.ctc_loss).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    names = ("log_probs", "targets", "input_lengths", "target_lengths")
    slots = [n for n in names if isinstance(a[n], torch.Tensor)]
    consts = {n: a[n] for n in names if n not in slots}
    options = {"blank": a["blank"], "reduction": a["reduction"], "zero_infinity": a["zero_infinity"]}

    def fn(*tensors):
        kw = {**consts, **dict(zip(slots, tensors))}
        log_probs = kw["log_probs"]
        if is_fake(log_probs):  # the capture: only the output's shape and dtype
            per_sequence = options["reduction"] == "none" and log_probs.dim() == 3
            return log_probs.new_empty((log_probs.shape[1],) if per_sequence else ())
        return F.ctc_loss(log_probs, kw["targets"], kw["input_lengths"], kw["target_lengths"], **options)

    key = register_call(TorchCall(fn, "F.ctc_loss", "its lengths decide the computation (data-dependent for "
                                  "torch.export; ONNX has no CTC): it runs in torch", where))
    return torch.ops.ortmodule.torch_call([a[n] for n in slots], key)[0]


def grouped_mm_call(args: tuple, kwargs: dict, where: str):
    """NOTE [grouped mm as a torch node]: ``torch._grouped_mm`` (``F.grouped_mm``; transformers' MoE experts:
    Mixtral, Qwen2-MoE, ...) as one ``torch_call`` node, run by torch's kernel with torch's backward. Its
    output's shape follows from the operands' (the offsets only say which rows go to which group), but
    torch.export's fake kernel fails on CPU; the capture computes the shape here. Returns None for a
    form this does not cover (the trace then goes on as it would have)."""
    bound = inspect.signature(lambda mat_a, mat_b, offs=None, bias=None, out_dtype=None: None).bind(*args, **kwargs)
    a = dict(bound.arguments)
    x, w, offs = a["mat_a"], a.get("mat_b"), a.get("offs")
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return None
    grouped = x.dim() == 2 and w.dim() == 3 and isinstance(offs, torch.Tensor)  # rows grouped by offs
    batched = x.dim() == 3 and w.dim() == 3 and offs is None
    if not (grouped or batched):
        return None
    dtype = a.get("out_dtype") or x.dtype
    slots = [k for k in ("offs", "bias") if isinstance(a.get(k), torch.Tensor)]
    fixed = {k: v for k, v in a.items() if k not in ("mat_a", "mat_b", *slots)}
    define_torch_call_op()

    def fn(x_, w_, *rest):
        if is_fake(x_):  # the capture: only the output's shape and dtype
            return x_.new_empty((*x_.shape[:-1], w_.shape[2]), dtype=dtype)
        kw = {**fixed, **dict(zip(slots, rest))}
        try:
            return torch._grouped_mm(x_, w_, **kw)
        except RuntimeError:
            if not w_.is_contiguous():
                raise
            # torch's CPU kernel wants 16-byte strides: the graph hands a weight over contiguous where
            # eager may have passed a transposed view ([E, N, K] weights, N * 4 bytes not a multiple of
            # 16); the same values in that column-major layout
            return torch._grouped_mm(x_, w_.transpose(-2, -1).contiguous().transpose(-2, -1), **kw)

    key = register_call(TorchCall(fn, "torch._grouped_mm", "torch.export cannot trace its CPU kernel and ONNX has "
                                  "no grouped matmul: it runs in torch", where))
    return torch.ops.ortmodule.torch_call([x, w, *(a[k] for k in slots)], key)[0]


_FX_NAME = re.compile(r"^%(\S+) :")
_RNN = {"gru", "lstm", "rnn_tanh", "rnn_relu"}


def nodes_without_rules(model: onnx.ModelProto) -> dict[str, str]:
    """FX node name -> ONNX op, for the nodes on a gradient path whose ONNX translation holds an op
    with no gradient rule: they become torch nodes (NOTE [torch nodes])."""
    import onnx_ir as ir

    from ..autodiff.builder import differentiable_values, node_reads
    from ..autodiff.registry import is_float, lookup
    from .semantics import MASK_DOMAIN

    # ortmodule's own placeholders (dropout masks, stop-gradients) are rewritten after translation
    missing = [n for n in model.graph.node if lookup(n.domain, n.op_type) is None and n.domain != MASK_DOMAIN]
    if not missing:
        return {}
    graph = ir.serde.deserialize_model(model).graph
    # untyped: torchlib's Loops (embedding_bag's) and sequences have no types before shape inference
    active = differentiable_values(graph, [v for v in graph.inputs if is_float(v.dtype)], untyped=True)
    found: dict[str, str] = {}
    for node in graph:
        if node.domain == MASK_DOMAIN or lookup(node.domain, node.op_type) is not None \
                or not any(v in active for v in node_reads(node)):
            continue
        meta = node.metadata_props.get("pkg.torch.onnx.fx_node")
        match = _FX_NAME.match(meta or "")
        if match:
            found.setdefault(match.group(1), node.op_type)
    return found


# NOTE [tie order as torch]: torch.topk returns tied values in an order of its own (a row of equal
# values gives indices 16, 15, 14, ... , not ONNX TopK's lowest-first), so ORT's TopK returned other
# indices than eager, and its gradient went to other positions.
# NOTE [as torch]: the ops below run as torch nodes whatever their translation, because it is not
# torch's at some inputs: topk's ties; at exact zeros the ONNX forms of cdist (a sqrt of a clamped
# mm form), atan2 (a quotient) and sinc (a Where over a quotient) have NaN gradients where torch's
# backward is finite; avg_pool2d's divisor_override and scatter_reduce's mean have no ONNX form
# (torchlib dropped them: wrong outputs), nor do its amax/amin/prod gradients (torch's own handle
# ties and zeros), nor embedding's scale_grad_by_freq (its gradient was unscaled). Under the
# TorchScript front end, which has no torch nodes, they fall back.
# NOTE [erfc as torch]: erfc and the normal tails (special.erfcx, ndtr, log_ndtr) are written from
# 1 - erf(x): erfc(3) came out 0.1% off, erfc(4) 0 for 1.5e-8, so log(erfc(x)) was -inf from about 3.9
# and erfcx / log_ndtr NaN where torch's are finite. ONNX has no erfc; torch's kernel it is.
# NOTE [upsample as torch]: torch's upsampling kernels and ONNX Resize (torchlib's translation) do
# not pick the same source pixels: nearest resizing of 1..39 pixels to 1..99 chose another pixel in
# 97 of those 3861 size pairs (torch computes src = floor(dst * (in / out)) in float, onnxruntime
# dst / (out / in)), and the antialiased filters differ outright. So upsampling stays a torch node
# (eager's pixels and gradients); Resize's own rule (autodiff/rules/resample.py) serves ONNX files.
_UPSAMPLE = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
             "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
             "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")


def _reduce_arg(node) -> str | None:
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("reduce")  # scatter_reduce.two


def _tail(node) -> str:  # NOTE [erfc as torch]
    return f"{node.target._schema.name.split('::')[-1]}'s ONNX form (from 1 - erf) has no digits in the tail"


_AS_TORCH = {
    "topk": lambda node: "torch.topk orders tied values its own way (the indices and where the gradient goes)",
    "cdist": lambda node: "cdist's ONNX form has NaN gradients at zero distance",
    "_cdist_forward": lambda node: "cdist's ONNX form has NaN gradients at zero distance",
    "atan2": lambda node: "atan2's ONNX form has NaN gradients at (0, 0)",
    "sinc": lambda node: "sinc's ONNX form has NaN gradients at 0",
    **dict.fromkeys(("erfc", "special_erfc", "special_erfcx", "special_ndtr", "special_log_ndtr"), _tail),
    # torchlib has no erfinv, and its decomposition is a prim (``prims.erf_inv``) that nothing translates
    # either: the model fell back (probit links, Gaussian copulas, inverse-CDF sampling)
    **dict.fromkeys(("erfinv", "special_erfinv"), lambda node: "torch.onnx has no translation of erfinv"),
    # torchlib's entr writes a Where of int64 and float, which onnxruntime refuses to load
    "special_entr": lambda node: "torchlib's special.entr gives a graph onnxruntime cannot load",
    "avg_pool2d": lambda node: ("torchlib ignores avg_pool2d's divisor_override"
                                if (node.args[6] if len(node.args) > 6 else node.kwargs.get("divisor_override"))
                                is not None else None),
    "embedding": lambda node: ("embedding's scale_grad_by_freq has no ONNX form"
                               if (node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq"))
                               else None),
    "scatter_reduce": lambda node: (f"scatter_reduce '{_reduce_arg(node)}' has no exact ONNX form"
                                    if _reduce_arg(node) != "sum" else None),
    # NOTE [onnx rnn as torch] (runtime/torch_nodes.py): as an ONNX LSTM / GRU / RNN node, the backward
    # would re-run the forward in torch; as a torch node, torch's kernel runs each pass once
    **dict.fromkeys(("lstm", "gru", "rnn_tanh", "rnn_relu"), lambda node: "torch's recurrent kernel runs "
                    "forward and backward once; as an ONNX node its backward re-runs the forward"),
    **dict.fromkeys(_UPSAMPLE, lambda node: "ONNX Resize picks other source pixels than torch's upsampling "
                                            "for some sizes (NOTE [upsample as torch])"),
}


# NOTE [custom ops]: an op a library defines with torch.library (``transformers::grouped_mm_fallback``,
# the MoE experts of Mixtral / Qwen2-MoE on CPU; users' own ``custom_op``s) has no ONNX translation: it
# runs as a torch node, its registered fake kernel giving the capture its output shapes and its
# registered autograd its gradient. One that writes an argument (a mutable schema) is left as it is,
# and the translation then fails naming it.
_NOT_CUSTOM = ("aten", "prims", "ortmodule")


def _custom_op(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in _NOT_CUSTOM:
        return False
    schema = target._schema
    return not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns)


def torch_only_nodes(ep) -> dict[str, str]:
    """FX node name -> reason, for the ops only torch's own kernel computes as eager does (NOTE [as torch])
    and the custom ops (NOTE [custom ops])."""
    found = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if _custom_op(node.target):
            found[node.name] = f"a custom op ({node.target.namespace}::{node.target._opname}) runs its own kernel"
        elif node.target.namespace == "aten":
            why = _AS_TORCH.get(node.target._schema.name.split("::")[-1])
            reason = why(node) if why is not None else None
            if reason is not None:
                found[node.name] = reason
    return found


def _fake_kernel(target):
    """A custom op's registered fake kernel (NOTE [custom ops]), or None."""
    from torch._library.simple_registry import singleton

    entry = singleton.find(f"{target.namespace}::{target._opname}")
    kernel = entry.fake_impl.kernel if entry is not None else None
    return kernel.func if kernel is not None else None


def to_torch_calls(ep, names: dict[str, str]) -> list[str]:
    """Rewrite the FX nodes ``names`` of ``ep`` as ``torch_call`` nodes calling their ATen op.

    ``names`` maps each to the ONNX op without a gradient rule it translates to, or to the reason
    it runs in torch (NOTE [tie order as torch]).

    Returns the ones rewritten; a node that cannot be (a symbolic-size argument, a non-tensor
    output, a random op whose draws would move in the stream) is left as it is, and its missing rule
    then falls back with a cause."""
    define_torch_call_op()
    gm = ep.graph_module
    graph = gm.graph
    done: list[str] = []
    renamed: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.name not in names or node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        target = node.target
        # ortmodule's own placeholders, prims (no autograd) are never torch nodes
        fake = _fake_kernel(target) if _custom_op(target) else None
        if target.namespace != "aten" and fake is None:
            continue
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]
        if not all(isinstance(flat[i].meta.get("val"), torch.Tensor) for i in positions):
            continue
        if _draws_random(target, node):
            continue
        val = node.meta.get("val")
        single = isinstance(val, torch.Tensor)
        outs = [val] if single else list(val) if isinstance(val, (tuple, list)) else None
        if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
            continue
        if any(t.is_complex() for t in outs) or any(flat[i].meta["val"].is_complex() for i in positions):
            continue  # ONNX has no complex type: torchlib writes them as real pairs
        template = [None if i in positions else a for i, a in enumerate(flat)]

        def fn(*tensors, _template=template, _positions=positions, _spec=spec, _target=target, _fake=fake):
            leaves = list(_template)
            for i, t in zip(_positions, tensors):
                leaves[i] = t
            a, k = pytree.tree_unflatten(leaves, _spec)
            if _fake is not None and any(is_fake(t) for t in tensors):
                return _fake(*a, **k)  # NOTE [custom ops]: its autograd wrapper cannot run on fake tensors
            return _target(*a, **k)

        qualified = f"{target.namespace}::{target._schema.name.split('::')[-1]}.{target._overloadname}"
        why = names[node.name]
        why = why if " " in why else f"no gradient rule for the ONNX op '{why}' it translates to"
        call = TorchCall(fn, qualified, why, n_outputs=len(outs), single=single, custom_op=fake is not None)
        key = register_call(call)
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.ortmodule.torch_call.default, ([flat[i] for i in positions], key))
        new.meta = dict(node.meta)
        new.meta["val"] = list(outs)
        if single:
            with graph.inserting_after(new):
                item = graph.call_function(operator.getitem, (new, 0))
            item.meta = dict(node.meta)
            node.replace_all_uses_with(item)
        else:
            node.replace_all_uses_with(new)
        name = node.name
        graph.erase_node(node)
        if single:
            renamed[name] = item.name
        done.append(name)
    if done:
        gm.recompile()
        from torch.export.graph_signature import TensorArgument

        for spec in ep.graph_signature.output_specs:  # the program's outputs name their nodes
            if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
                spec.arg = TensorArgument(name=renamed[spec.arg.name])
    return done


def _draws_random(target, node) -> bool:
    """Whether the op draws from torch's generator: run as a torch node, its draws would move in the
    stream against the dropout masks drawn before the run (eager order), so it is not one."""
    name = target._schema.name.split("::")[-1]
    if name in _RNN:  # tagged as random for its inter-layer dropout, which may be off
        formal = [a.name for a in target._schema.arguments]
        value = dict(zip(formal, node.args)) | dict(node.kwargs)
        return bool(value.get("train", False)) and float(value.get("dropout", 0.0)) > 0
    return torch.Tag.nondeterministic_seeded in target.tags


_schemas: dict[int, object] = {}


def torch_call_translation(xs: Sequence, key: int):
    """``ortmodule::torch_call`` -> one ``TorchCall`` node with one output per tensor it returns."""
    import onnxscript
    from onnx.defs import OpSchema

    n = lookup_call(key).n_outputs
    op = _schemas.get(n)
    if op is None:
        types = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)", "tensor(int64)",
                 "tensor(int32)", "tensor(int8)", "tensor(uint8)", "tensor(int16)", "tensor(bool)"]
        schema = OpSchema(
            CALL_OP, TORCH_DOMAIN, 1,
            inputs=[OpSchema.FormalParameter("xs", "T", param_option=OpSchema.FormalParameterOption.Variadic,
                                             is_homogeneous=False)],
            outputs=[OpSchema.FormalParameter(f"y{i}", f"T{i}") for i in range(n)],
            type_constraints=[("T", types, "")] + [(f"T{i}", types, "") for i in range(n)],
            attributes=[OpSchema.Attribute("key", OpSchema.AttrType.INT, "")],
        )
        op = _schemas[n] = onnxscript.values.Op(onnxscript.values.Opset(TORCH_DOMAIN, 1), CALL_OP, schema)
    outs = op(*xs, key=key)
    return (outs,) if n == 1 else tuple(outs)
