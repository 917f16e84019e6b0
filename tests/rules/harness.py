"""Runs one ``OpCase`` row (tests/rules/opinfo.py): the rule test harness every ``table_*.py`` uses.

Public entry points (keep their signatures stable; other tables call them)::

    check_case(case: OpCase) -> None      # torch parity, then the float64 FD check if case.fd_check
    check_torch_parity(case: OpCase) -> None
    check_finite_differences(case: OpCase) -> None

Each raises ``AssertionError`` naming the row (``case.name``) and what mismatched.

How a row becomes a test
------------------------
* A one-node ONNX model (opset ``case.opset``): input ``i`` is graph input ``x{i}`` typed and shaped
  from ``case.inputs[i]``; indices in ``case.const_inputs`` become initializers instead; ``None``
  inputs become ``""`` (trailing ones too). Outputs are ``y0 .. y{num_outputs-1}``, typed by onnx
  shape inference (or, where it cannot, by an onnxruntime run of the forward).
* The model goes to onnx_ir; ``build_gradient(graph, wrt=[x_i for i in grad_inputs],
  outputs=[y_k for k in grad_outputs], opset=case.opset)`` builds the backward nodes, and ONE joint
  model is assembled: inputs = the x's + the upstream grads ``grad.y_k``; outputs = the y's + one
  ``dx{i}`` per checked input (+ for the ORT run, every backward value a rule gave a dtype, whose
  annotated dtype/shape must match what it computes).
* Torch parity: the joint model runs in onnxruntime (CPU) with random upstream grads ``v``; the y's
  are compared with ``case.torch_fn(*inputs)`` and the ``dx``'s with
  ``torch.autograd.grad(outputs, inputs, grad_outputs=v)``, within ``case.rtol`` / ``case.atol``.
  ``torch_fn`` gets every entry of ``case.inputs`` in order, as torch tensors (``None`` stays
  ``None``; const inputs such as shapes or axes come as int64 tensors, use ``.tolist()``), and
  returns a tensor or a tuple with one tensor per ONNX output.
* FD check (float64, independent of torch): floating-point inputs (but ``case.fd_keep_dtype``,
  e.g. Resize's float32 scales) are cast to float64, the model is
  rebuilt, and both the forward and the joint model run in ``onnx.reference.ReferenceEvaluator``.
  With a random direction ``u`` over the checked inputs, ``<J u, v>`` (central differences with step
  ``case.fd_eps``) must match ``<u, J^T v>`` (the gradient graph) within ``case.fd_rtol``, relative to
  the magnitude of the summed terms. Sample inputs must keep ``fd_eps`` away from kinks (Relu, Abs at 0).
  Reference ops that compute in float32 get float64 overrides (``_PRECISE_OPS``, e.g. Erf); nodes no
  output needs are pruned first.

Defaults: ``grad_inputs`` = every floating-point input not in ``const_inputs``; ``grad_outputs`` =
every floating-point output. Integer inputs (labels, indices) never get gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.reference
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import helper
from onnx.reference.ops._op import OpRunUnaryNum
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ortmodule.autodiff import build_gradient
from ortmodule.runtime.torch_nodes import TORCH_DOMAIN

from .opinfo import OpCase

__all__ = ["check_case", "check_finite_differences", "check_torch_parity", "grad_input_indices"]


def _is_float(arr: np.ndarray | None) -> bool:
    return arr is not None and np.issubdtype(np.asarray(arr).dtype, np.floating)


def grad_input_indices(case: OpCase) -> list[int]:
    """The inputs whose gradients the row checks."""
    if case.grad_inputs is not None:
        return list(case.grad_inputs)
    return [i for i, a in enumerate(case.inputs) if _is_float(a) and i not in case.const_inputs]


def _grad_output_indices(case: OpCase, out_dtypes: Sequence[np.dtype]) -> list[int]:
    if case.grad_outputs is not None:
        return list(case.grad_outputs)
    return [k for k, dt in enumerate(out_dtypes) if np.issubdtype(dt, np.floating)]


@dataclasses.dataclass
class _Built:
    forward: onnx.ModelProto  # the one-node model
    joint: onnx.ModelProto  # forward node + backward nodes
    feeds: dict[str, np.ndarray]  # forward inputs (not initializers)
    wrt: list[int]  # checked input indices, in the order of the dx outputs
    out_dtypes: list[np.dtype]
    grad_outs: list[int]  # outputs given upstream grads, in the order of the grad.y inputs
    grad_names: list[str]  # names of the upstream-grad inputs of the joint model
    dx_present: list[bool]  # False where build_gradient returned None (no dependence)
    # Backward values with a dtype a rule annotated, output after the dx's: (label, dtype, static shape)
    annotated: list[tuple[str, ir.DataType, tuple | None]] = dataclasses.field(default_factory=list)


def _fail(case: OpCase, msg: str) -> AssertionError:
    return AssertionError(f"[{case.op_type} row '{case.name}'] {msg}")


def _forward_model(case: OpCase, inputs: Sequence[np.ndarray | None]) -> onnx.ModelProto:
    graph_inputs, initializers, names = [], [], []
    for i, arr in enumerate(inputs):
        if arr is None:
            names.append("")
            continue
        arr = np.asarray(arr)
        name = f"x{i}"
        names.append(name)
        if i in case.const_inputs:
            initializers.append(onnx.numpy_helper.from_array(arr, name))
        else:
            elem = helper.np_dtype_to_tensor_dtype(arr.dtype)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, list(arr.shape)))
    outs = [f"y{k}" for k in range(case.num_outputs)]
    node = helper.make_node(case.op_type, names, outs, name=f"{case.op_type}_0", domain=case.domain,
                            **case.attributes)
    graph = helper.make_graph(
        [node], f"row_{case.name}", graph_inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outs],
        initializer=initializers,
    )
    opsets = [helper.make_opsetid("", case.opset)]
    if case.domain not in ("", "ai.onnx"):
        opsets.append(helper.make_opsetid(case.domain, 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    inference_error = None
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except onnx.shape_inference.InferenceError as exc:  # e.g. onnx's Einsum broadcasting ellipsis
        inference_error = exc
        model = onnx.shape_inference.infer_shapes(model)
    # make_value_info with an empty TypeProto leaves outputs untyped; take the inferred types.
    inferred = {vi.name: vi for vi in model.graph.value_info}
    for out in model.graph.output:
        if not _typed(out) and out.name in inferred:
            out.type.CopyFrom(inferred[out.name].type)
    if not all(_typed(out) for out in model.graph.output):
        _type_outputs_by_running(case, model, inputs, inference_error)
    return model


def _feeds(case: OpCase, inputs: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
    const = set(case.const_inputs)
    return {f"x{i}": np.asarray(a) for i, a in enumerate(inputs) if a is not None and i not in const}


def _typed(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    return vi.type.HasField("tensor_type") and t.elem_type != 0 and t.HasField("shape")


def _type_outputs_by_running(case: OpCase, model: onnx.ModelProto, inputs, inference_error) -> None:
    """Where onnx shape inference cannot type an output, take dtype and shape from an ORT run."""
    feeds = _feeds(case, inputs)
    try:
        sess = _session(model)
        results = sess.run(None, feeds)
    except Exception as exc:
        raise _fail(case, f"cannot type the outputs: shape inference said {inference_error}; "
                          f"onnxruntime said {exc}") from exc
    for out, res in zip(model.graph.output, results, strict=True):
        if not _typed(out):
            elem = helper.np_dtype_to_tensor_dtype(np.asarray(res).dtype)
            out.type.CopyFrom(helper.make_tensor_type_proto(elem, list(np.shape(res))))


def _build(case: OpCase, inputs: Sequence[np.ndarray | None], *, prune: bool = False) -> _Built:
    forward = _forward_model(case, inputs)
    model = ir.from_proto(forward)
    graph = model.graph
    by_name = {v.name: v for v in graph.inputs}
    wrt_idx = grad_input_indices(case)
    for i in wrt_idx:
        if f"x{i}" not in by_name:
            raise _fail(case, f"grad input {i} is not a graph input (None or in const_inputs)")
    wrt = [by_name[f"x{i}"] for i in wrt_idx]
    outs = list(graph.outputs)
    out_dtypes = [o.dtype.numpy() for o in outs]
    grad_outs = _grad_output_indices(case, out_dtypes)
    try:
        gg = build_gradient(graph, wrt=wrt, outputs=[outs[k] for k in grad_outs], opset=case.opset)
    except Exception as exc:
        raise _fail(case, f"build_gradient failed: {type(exc).__name__}: {exc}") from exc
    graph.extend(gg.nodes)
    if any(n.domain == TORCH_DOMAIN for n in gg.nodes):  # an ATen kernel (NOTE [ATen kernels])
        model.opset_imports.setdefault(TORCH_DOMAIN, 1)
    for gi in gg.grad_outputs:
        graph.inputs.append(gi)
    dx_present = []
    for i, x in zip(wrt_idx, wrt, strict=True):
        dx = gg.input_grads.get(x)
        dx_present.append(dx is not None)
        if dx is None:
            continue
        # An Identity per grad gives each output its own name (the grad may be a graph input itself).
        node = ir.Node("", "Identity", [dx], num_outputs=1, name=f"dx{i}_out")
        out = node.outputs[0]
        out.name = f"dx{i}"
        out.dtype = x.dtype
        out.shape = x.shape
        graph.append(node)
        graph.outputs.append(out)
    annotated = []
    if not prune:
        # Check every dtype/shape a rule annotated against what ORT computes (a wrong annotation
        # misleads later rules, e.g. reduce_to, and ORT only warns about it).
        outputs = set(graph.outputs)
        for node in gg.nodes:
            for v in node.outputs:
                if v.dtype is None or v in outputs or node.op_type == "Constant":
                    continue
                static = None
                if v.shape is not None and all(isinstance(d, int) for d in v.shape):
                    static = tuple(v.shape)
                annotated.append((f"{v.name!r} (from node '{node.name}')", v.dtype, static))
                graph.outputs.append(v)
                outputs.add(v)
    if prune:
        # onnx.reference runs every node, even one no output needs (e.g. Pow's d/db when only a is
        # checked, which may be log(negative)); ORT gets the unpruned graph so it validates them all.
        RemoveUnusedNodesPass()(model)
    try:
        joint = ir.to_proto(model)
    except Exception as exc:
        raise _fail(case, f"could not serialize the joint model: {exc}") from exc
    feeds = _feeds(case, inputs)
    return _Built(forward, joint, feeds, wrt_idx, out_dtypes, grad_outs,
                  [gi.name for gi in gg.grad_outputs], dx_present, annotated)


class _Segmented:
    """A graph with torch nodes (an ``ATen`` backward kernel, NOTE [ATen kernels]) run as ortmodule
    runs it, behind ``InferenceSession.run``'s numpy interface."""

    def __init__(self, model: onnx.ModelProto) -> None:
        from ortmodule.runtime.segments import SegmentedRunner

        self.runner = SegmentedRunner(model, torch.device("cpu"))

    def run(self, names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outs = self.runner.run({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()})
        return [o.numpy() for o in outs]


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    from ortmodule.runtime.segments import has_torch_nodes

    if has_torch_nodes(model):
        return _Segmented(model)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # tiny graphs: threads only add overhead
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _output_templates(model: onnx.ModelProto) -> list[np.ndarray] | None:
    """Zero arrays with the inferred dtype and shape of each graph output; None if a dim is not static."""
    out = []
    for vi in model.graph.output:
        t = vi.type.tensor_type
        if not t.HasField("shape") or not all(d.HasField("dim_value") for d in t.shape.dim):
            return None
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        out.append(np.zeros([d.dim_value for d in t.shape.dim], dtype=dtype))
    return out


def _rng(case: OpCase, salt: int) -> np.random.Generator:
    return np.random.default_rng([salt, *case.name.encode()])


def _upstream(case: OpCase, built: _Built, outputs: Sequence[np.ndarray], salt: int) -> list[np.ndarray]:
    rng = _rng(case, salt)
    return [rng.standard_normal(np.shape(outputs[k])).astype(outputs[k].dtype) for k in built.grad_outs]


def _to_torch(arr: np.ndarray | None, requires_grad: bool = False) -> torch.Tensor | None:
    if arr is None:
        return None
    t = torch.from_numpy(np.array(arr, copy=True))
    if requires_grad:
        t.requires_grad_(True)
    return t


def _describe_mismatch(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> str:
    got64, want64 = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got64.shape != want64.shape:
        return f"shape {got64.shape} != expected {want64.shape}"
    err = np.abs(got64 - want64)
    bad = ~(err <= atol + rtol * np.abs(want64))
    if not bad.any():
        return ""
    flat = int(np.argmax(np.where(bad, err, -1.0)))
    idx = tuple(int(i) for i in np.unravel_index(flat, err.shape)) if err.ndim else ()
    return (
        f"{int(bad.sum())}/{bad.size} elements differ; worst at {list(idx)}: got {float(got64[idx]):.6g}, "
        f"expected {float(want64[idx]):.6g} (max abs err {float(np.max(err)):.3g}; rtol={rtol}, atol={atol})"
    )


def check_torch_parity(case: OpCase) -> None:
    """Run the joint model in onnxruntime; compare outputs and input grads with torch autograd."""
    built = _build(case, case.inputs)
    try:
        sess = _session(built.joint)
    except Exception as exc:
        raise _fail(case, f"onnxruntime rejected the joint model: {exc}") from exc
    templates = _output_templates(built.forward)
    if templates is None:  # an output shape depends on input values: run the forward to get it
        templates = _session(built.forward).run(None, built.feeds)
    vs = _upstream(case, built, templates, salt=1)
    feeds = dict(built.feeds)
    feeds.update(zip(built.grad_names, vs, strict=True))
    try:
        res = sess.run(None, feeds)
    except Exception as exc:
        raise _fail(case, f"onnxruntime failed running the joint model: {exc}") from exc
    n_dx = sum(built.dx_present)
    ys, dxs = res[: case.num_outputs], res[case.num_outputs : case.num_outputs + n_dx]
    for (name, dtype, shape), val in zip(built.annotated, res[case.num_outputs + n_dx :], strict=True):
        val = np.asarray(val)
        if val.dtype != dtype.numpy() or (shape is not None and val.shape != shape):
            raise _fail(case, f"backward value {name} is annotated {dtype.name}{list(shape or [])} but "
                              f"computes {val.dtype}{list(val.shape)}: fix the dtype=/shape= the rule passes")

    if case.torch_fn is None:
        raise _fail(case, "no torch_fn to compare with")
    wrt = set(built.wrt)
    tin = [_to_torch(a, requires_grad=i in wrt) for i, a in enumerate(case.inputs)]
    tout = case.torch_fn(*tin)
    if not isinstance(tout, (tuple, list)):
        tout = (tout,)
    if len(tout) != case.num_outputs:
        raise _fail(case, f"torch_fn returned {len(tout)} outputs, the op has {case.num_outputs}")
    for k, (got, want) in enumerate(zip(ys, tout, strict=True)):
        msg = _describe_mismatch(got, want.detach().numpy(), case.rtol, case.atol)
        if msg:
            raise _fail(case, f"forward output y{k}: {msg}")

    t_outs = [tout[k] for k in built.grad_outs]
    t_inputs = [tin[i] for i in built.wrt]
    t_vs = [torch.from_numpy(v).to(o.dtype) for v, o in zip(vs, t_outs, strict=True)]
    t_grads = torch.autograd.grad(t_outs, t_inputs, grad_outputs=t_vs, allow_unused=True)
    it = iter(dxs)
    for i, present, tg in zip(built.wrt, built.dx_present, t_grads, strict=True):
        want = np.zeros_like(case.inputs[i]) if tg is None else tg.numpy()
        got = next(it) if present else np.zeros_like(case.inputs[i])
        msg = _describe_mismatch(got, want, case.rtol, case.atol)
        if msg:
            where = "" if present else " (ortmodule built no gradient: treated as zeros)"
            raise _fail(case, f"gradient of input x{i}{where}: {msg}")


class Erf(OpRunUnaryNum):
    """float64-exact Erf: onnx.reference's computes in float32, too coarse for finite differences."""

    op_domain = ""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


# Reference-evaluator overrides for ops whose stock implementation loses float64 precision.
_PRECISE_OPS = [Erf]


def _as_float64(inputs: Sequence[np.ndarray | None], keep: Sequence[int] = ()) -> list[np.ndarray | None]:
    return [a.astype(np.float64) if _is_float(a) and i not in keep else a for i, a in enumerate(inputs)]


def check_finite_differences(case: OpCase) -> None:
    """float64 check <J u, v> ~= <u, J^T v>: central differences vs. the gradient graph."""
    inputs = _as_float64(case.inputs, case.fd_keep_dtype)
    built = _build(case, inputs, prune=True)
    try:
        fwd = onnx.reference.ReferenceEvaluator(built.forward, new_ops=_PRECISE_OPS)
        joint = onnx.reference.ReferenceEvaluator(built.joint, new_ops=_PRECISE_OPS)
    except Exception as exc:
        raise _fail(case, f"onnx.reference could not load the model: {exc}") from exc

    def run_fwd(feeds):
        return [np.asarray(o) for o in fwd.run(None, feeds)]

    y0 = run_fwd(built.feeds)
    vs = [v.astype(np.float64) for v in _upstream(case, built, y0, salt=2)]
    rng = _rng(case, 3)
    us = {i: rng.standard_normal(np.shape(inputs[i])) for i in built.wrt}

    feeds = dict(built.feeds)
    feeds.update(zip(built.grad_names, vs, strict=True))
    try:
        res = joint.run(None, feeds)
    except Exception as exc:
        raise _fail(case, f"FD: onnx.reference failed running the joint model: {exc}") from exc
    dxs = iter(res[case.num_outputs :])
    # <u, J^T v>, and the sum of |terms| as the scale of the comparison
    vjp, scale = 0.0, 0.0
    for i, present in zip(built.wrt, built.dx_present, strict=True):
        if not present:
            continue
        dx = np.asarray(next(dxs), dtype=np.float64)
        if dx.shape != np.shape(inputs[i]):
            raise _fail(case, f"FD: gradient of x{i} has shape {dx.shape}, input has {np.shape(inputs[i])}")
        vjp += float(np.sum(us[i] * dx))
        scale += float(np.sum(np.abs(us[i] * dx)))

    eps = case.fd_eps
    plus, minus = dict(built.feeds), dict(built.feeds)
    for i in built.wrt:
        plus[f"x{i}"] = inputs[i] + eps * us[i]
        minus[f"x{i}"] = inputs[i] - eps * us[i]
    yp, ym = run_fwd(plus), run_fwd(minus)
    jvp, jscale = 0.0, 0.0
    for k, v in zip(built.grad_outs, vs, strict=True):
        d = (yp[k].astype(np.float64) - ym[k].astype(np.float64)) / (2 * eps)
        jvp += float(np.sum(d * v))
        jscale += float(np.sum(np.abs(d * v)))
    if not (np.isfinite(jvp) and np.isfinite(vjp)):
        raise _fail(case, f"FD: non-finite values: <J u, v> = {jvp}, <u, J^T v> = {vjp}")
    tol = case.fd_rtol * max(scale, jscale, 1e-300)
    if abs(jvp - vjp) > tol:
        raise _fail(
            case,
            f"FD check failed: <J u, v> = {jvp:.10g} (central differences, eps={eps}) but "
            f"<u, J^T v> = {vjp:.10g} (gradient graph); |diff| = {abs(jvp - vjp):.3g} > {tol:.3g}",
        )


def check_case(case: OpCase) -> None:
    """Torch parity, then (if ``case.fd_check``) the float64 finite-difference check."""
    check_torch_parity(case)
    if case.fd_check:
        check_finite_differences(case)
