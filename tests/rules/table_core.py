"""Rows for the core rules: elementwise, activation, linalg, shape and loss (opset 20).

One ``OpCase`` per op variant (tests/rules/opinfo.py); ``test_rules.py`` turns each into a torch
parity test and a float64 finite-difference test via ``tests/rules/harness.py``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from onnx import TensorProto

from .opinfo import OpCase

_rng = np.random.default_rng(20240607)


def randn(*shape: int) -> np.ndarray:
    return _rng.standard_normal(shape).astype(np.float32)


def away(*shape: int, margin: float = 0.2) -> np.ndarray:
    """Random values with |x| >= margin (keeps FD steps off kinks at 0)."""
    x = _rng.standard_normal(shape)
    x = np.where(x >= 0, x + margin, x - margin)
    return x.astype(np.float32)


def positive(*shape: int, low: float = 0.5, high: float = 2.0) -> np.ndarray:
    return _rng.uniform(low, high, shape).astype(np.float32)


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


CASES: list[OpCase] = []


def row(op_type: str, name: str, inputs, torch_fn, **kw) -> None:
    CASES.append(OpCase(op_type, name, inputs, torch_fn, **kw))


# -- elementwise unary ----------------------------------------------------------------------------
row("Identity", "Identity", [randn(3, 4)], lambda x: x.clone())
row("Neg", "Neg", [randn(3, 4)], torch.neg)
row("Exp", "Exp", [randn(3, 4)], torch.exp)
row("Log", "Log", [positive(3, 4)], torch.log)
row("Sqrt", "Sqrt", [positive(3, 4)], torch.sqrt)
row("Reciprocal", "Reciprocal", [away(3, 4, margin=0.5)], torch.reciprocal)
row("Abs", "Abs", [away(3, 4)], torch.abs)
row("Erf", "Erf", [randn(3, 4)], torch.erf)
# NOTE [zero derivatives]: torch's backward of these is zeros (not "no gradient"); inputs sit a
# quarter away from the steps so the finite differences see the flat parts.
# (their own generator: drawing from _rng would change every later row's inputs)
_steps = (np.round(np.random.default_rng(7).standard_normal((3, 4)) * 3) + 0.25).astype(np.float32)
row("Round", "Round", [_steps], torch.round)
row("Floor", "Floor", [_steps], torch.floor)
row("Ceil", "Ceil", [_steps], torch.ceil)
row("Sign", "Sign", [_steps], torch.sign)
row("Sin", "Sin", [randn(3, 4)], torch.sin)
row("Cos", "Cos", [randn(3, 4)], torch.cos)
# Cast to float32 is linear; a large FD step keeps float32 rounding out of the difference quotient.
row("Cast", "Cast_f64_to_f32", [randn(3, 4).astype(np.float64)], lambda x: x.to(torch.float32),
    attributes={"to": TensorProto.FLOAT}, fd_eps=1e-2, fd_rtol=1e-5)
row("Cast", "Cast_f32_to_f32", [randn(3, 4)], lambda x: x.to(torch.float32),
    attributes={"to": TensorProto.FLOAT}, fd_eps=1e-2, fd_rtol=1e-5)
row("Cast", "Cast_f32_to_f64", [randn(3, 4)], lambda x: x.to(torch.float64),
    attributes={"to": TensorProto.DOUBLE})

# -- broadcasting binary --------------------------------------------------------------------------
_BROADCAST = [
    ("same", (3, 4), (3, 4)),
    ("row", (3, 4), (4,)),
    ("scalar", (3, 4), ()),
    ("scalar_lhs", (), (3, 4)),
    ("1N_M1", (1, 4), (3, 1)),
    ("rank3_keep1", (2, 1, 4), (3, 1)),
]
_BINARY = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}
for _op, _fn in _BINARY.items():
    for _tag, _sa, _sb in _BROADCAST:
        _b = away(*_sb, margin=0.5) if _op == "Div" else randn(*_sb)
        row(_op, f"{_op}_{_tag}", [randn(*_sa), _b], _fn)

row("Pow", "Pow_float_exp", [positive(3, 4), randn(3, 4)], torch.pow)
row("Pow", "Pow_float_exp_broadcast", [positive(3, 4), randn(4)], torch.pow)
# x ** 2.0 with a negative base: only the base is differentiated (d/db would be log(negative)).
row("Pow", "Pow_scalar_float_exp", [away(3, 4), np.array(2.0, np.float32)], torch.pow, grad_inputs=[0])
# a constant exponent 2 (x ** 2): the gradient is 2 * x without a Pow; 3 keeps the Pow
# (their own generator: drawing from _rng would change every later row's inputs)
_base = np.random.default_rng(11).standard_normal((3, 4)).astype(np.float32)
row("Pow", "Pow_const_square", [_base, np.array(2.0, np.float32)], torch.pow, const_inputs=[1])
row("Pow", "Pow_const_cube", [_base, np.array(3.0, np.float32)], torch.pow, const_inputs=[1])
row("Pow", "Pow_int_exp", [away(3, 4), i64(3)], torch.pow)
row("Pow", "Pow_int_exp_tensor", [positive(3, 4), i64([[2, 3, 1, 4]])], torch.pow)

# -- activations ----------------------------------------------------------------------------------
row("Relu", "Relu", [away(3, 4)], torch.relu)
row("Tanh", "Tanh", [randn(3, 4)], torch.tanh)
row("Sigmoid", "Sigmoid", [randn(3, 4)], torch.sigmoid)
row("Gelu", "Gelu_none", [randn(3, 4)], lambda x: F.gelu(x, approximate="none"))
row("Gelu", "Gelu_tanh", [randn(3, 4)], lambda x: F.gelu(x, approximate="tanh"),
    attributes={"approximate": "tanh"})
for _axis in (-1, 0, 1):
    row("Softmax", f"Softmax_axis{_axis}", [randn(2, 3, 4)], lambda x, a=_axis: torch.softmax(x, a),
        attributes={"axis": _axis})
    row("LogSoftmax", f"LogSoftmax_axis{_axis}", [randn(2, 3, 4)], lambda x, a=_axis: torch.log_softmax(x, a),
        attributes={"axis": _axis})
row("Softmax", "Softmax_default_axis", [randn(3, 5)], lambda x: torch.softmax(x, -1))
row("LogSoftmax", "LogSoftmax_default_axis", [randn(3, 5)], lambda x: torch.log_softmax(x, -1))


# -- linalg ---------------------------------------------------------------------------------------
def _gemm_ref(ta: int, tb: int, alpha: float, beta: float):
    def fn(a, b, c=None):
        y = alpha * ((a.T if ta else a) @ (b.T if tb else b))
        return y if c is None else y + beta * c

    return fn


_M, _K, _N = 3, 5, 4
for _ta in (0, 1):
    for _tb in (0, 1):
        _a = randn(_K, _M) if _ta else randn(_M, _K)
        _bm = randn(_N, _K) if _tb else randn(_K, _N)
        row("Gemm", f"Gemm_tA{_ta}_tB{_tb}", [_a, _bm, randn(_M, _N)], _gemm_ref(_ta, _tb, 1.0, 1.0),
            attributes={"transA": _ta, "transB": _tb})
        row("Gemm", f"Gemm_tA{_ta}_tB{_tb}_alpha_beta_biasN", [_a, _bm, randn(_N)],
            _gemm_ref(_ta, _tb, 0.7, -1.3),
            attributes={"transA": _ta, "transB": _tb, "alpha": 0.7, "beta": -1.3})
row("Gemm", "Gemm_bias_1N", [randn(_M, _K), randn(_K, _N), randn(1, _N)], _gemm_ref(0, 0, 2.0, 0.5),
    attributes={"alpha": 2.0, "beta": 0.5})
row("Gemm", "Gemm_bias_M1", [randn(_M, _K), randn(_K, _N), randn(_M, 1)], _gemm_ref(0, 0, 1.0, 1.0))
row("Gemm", "Gemm_bias_scalar", [randn(_M, _K), randn(_K, _N), randn()], _gemm_ref(0, 0, 1.0, 2.0),
    attributes={"beta": 2.0})
row("Gemm", "Gemm_no_bias", [randn(_M, _K), randn(_K, _N)], _gemm_ref(0, 0, 1.0, 1.0))
row("Gemm", "Gemm_no_bias_tB_alpha", [randn(_M, _K), randn(_N, _K)], _gemm_ref(0, 1, 1.5, 1.0),
    attributes={"transB": 1, "alpha": 1.5})
row("Gemm", "Gemm_omitted_bias", [randn(_M, _K), randn(_K, _N), None], _gemm_ref(0, 0, 1.0, 1.0))

_MATMUL = [
    ("2d", (3, 5), (5, 4)),
    ("3d", (2, 3, 5), (2, 5, 4)),
    ("4d", (2, 3, 4, 5), (2, 3, 5, 2)),
    ("BMK_KN", (2, 3, 5), (5, 4)),
    ("MK_BKN", (3, 5), (2, 5, 4)),
    ("1MK_BKN", (1, 3, 5), (2, 5, 4)),
    ("B1MK_1CKN", (2, 1, 3, 5), (1, 3, 5, 4)),
    ("1d_2d", (5,), (5, 4)),
    ("2d_1d", (3, 5), (5,)),
    ("1d_1d", (5,), (5,)),
    ("1d_3d", (5,), (2, 5, 4)),
    ("3d_1d", (2, 3, 5), (5,)),
]
for _tag, _sa, _sb in _MATMUL:
    row("MatMul", f"MatMul_{_tag}", [randn(*_sa), randn(*_sb)], torch.matmul)

# -- shape ----------------------------------------------------------------------------------------
row("Reshape", "Reshape", [randn(2, 3, 4), i64([4, 6])], lambda x, s: x.reshape(s.tolist()), const_inputs=[1])
row("Reshape", "Reshape_infer_dim", [randn(2, 3, 4), i64([0, -1])], lambda x, s: x.reshape(2, 12),
    const_inputs=[1])
for _axis in (0, 1, 2, -1):
    row("Flatten", f"Flatten_axis{_axis}", [randn(2, 3, 4)],
        lambda x, a=_axis: x.reshape(int(np.prod(x.shape[:a])) if a else 1, -1), attributes={"axis": _axis})
row("Flatten", "Flatten_default", [randn(2, 3, 4)], lambda x: x.reshape(2, -1))
row("Squeeze", "Squeeze_axes", [randn(2, 1, 3, 1), i64([1, -1])], lambda x, a: x.squeeze(-1).squeeze(1),
    const_inputs=[1])
row("Squeeze", "Squeeze_all", [randn(2, 1, 3, 1)], lambda x: x.squeeze())
row("Unsqueeze", "Unsqueeze", [randn(2, 3), i64([0, 3])], lambda x, a: x.unsqueeze(0).unsqueeze(3),
    const_inputs=[1])
row("Unsqueeze", "Unsqueeze_neg", [randn(2, 3), i64([-1])], lambda x, a: x.unsqueeze(-1), const_inputs=[1])
row("Transpose", "Transpose_perm", [randn(2, 3, 4)], lambda x: x.permute(1, 2, 0),
    attributes={"perm": [1, 2, 0]})
row("Transpose", "Transpose_default", [randn(2, 3, 4)], lambda x: x.permute(2, 1, 0))
row("Expand", "Expand", [randn(3, 1), i64([2, 3, 4])], lambda x, s: x.expand(*s.tolist()), const_inputs=[1])
row("Expand", "Expand_same_rank", [randn(1, 4), i64([3, 4])], lambda x, s: x.expand(*s.tolist()),
    const_inputs=[1])


# -- losses ---------------------------------------------------------------------------------------
def _ce_ref(reduction: str, ignore_index: int | None, log_prob: bool):
    def fn(x, t, w=None):
        kw = {} if ignore_index is None else {"ignore_index": ignore_index}
        loss = F.cross_entropy(x, t, weight=w, reduction=reduction, **kw)
        return (loss, torch.log_softmax(x, 1)) if log_prob else loss

    return fn


def _nll_ref(reduction: str, ignore_index: int | None, log_prob: bool = False):
    def fn(x, t, w=None):
        kw = {} if ignore_index is None else {"ignore_index": ignore_index}
        return F.nll_loss(x, t, weight=w, reduction=reduction, **kw)

    return fn


_N_, _C_, _D_ = 6, 4, 3
_LABELS = i64(_rng.integers(0, _C_, _N_))
_LABELS_IGN = _LABELS.copy()
_LABELS_IGN[[1, 4]] = 1  # ignore_index=1 below: these and any other 1s are ignored
_LABELS_ND = i64(_rng.integers(0, _C_, (_N_, _D_)))
_LABELS_ND_IGN = _LABELS_ND.copy()
_LABELS_ND_IGN[0, 0] = _LABELS_ND_IGN[2, 1] = -1
_W = positive(_C_)

for _red in ("mean", "sum", "none"):
    for _op, _ref in (("SoftmaxCrossEntropyLoss", _ce_ref), ("NegativeLogLikelihoodLoss", _nll_ref)):
        _short = "SCE" if _op.startswith("Softmax") else "NLL"
        _mk = lambda r, i, ref=_ref: ref(r, i, False)
        _x = randn(_N_, _C_)
        _xnd = randn(_N_, _C_, _D_)
        row(_op, f"{_short}_{_red}", [_x, _LABELS], _mk(_red, None), attributes={"reduction": _red})
        row(_op, f"{_short}_{_red}_ignore", [_x, _LABELS_IGN], _mk(_red, 1),
            attributes={"reduction": _red, "ignore_index": 1})
        row(_op, f"{_short}_{_red}_weight", [_x, _LABELS, _W], _mk(_red, None),
            attributes={"reduction": _red}, const_inputs=[2])
        row(_op, f"{_short}_{_red}_weight_ignore", [_x, _LABELS_IGN, _W], _mk(_red, 1),
            attributes={"reduction": _red, "ignore_index": 1}, const_inputs=[2])
        row(_op, f"{_short}_{_red}_NCd", [_xnd, _LABELS_ND], _mk(_red, None), attributes={"reduction": _red})
        row(_op, f"{_short}_{_red}_NCd_weight_ignore", [_xnd, _LABELS_ND_IGN, _W], _mk(_red, -1),
            attributes={"reduction": _red, "ignore_index": -1}, const_inputs=[2])
    # the log_prob second output, with upstream grads on both outputs
    row("SoftmaxCrossEntropyLoss", f"SCE_{_red}_log_prob", [randn(_N_, _C_), _LABELS_IGN, _W],
        _ce_ref(_red, 1, True), attributes={"reduction": _red, "ignore_index": 1}, const_inputs=[2],
        num_outputs=2)
    row("SoftmaxCrossEntropyLoss", f"SCE_{_red}_NCd_log_prob", [randn(_N_, _C_, _D_), _LABELS_ND],
        _ce_ref(_red, None, True), attributes={"reduction": _red}, num_outputs=2)
row("SoftmaxCrossEntropyLoss", "SCE_log_prob_only_grad", [randn(_N_, _C_), _LABELS],
    _ce_ref("mean", None, True), num_outputs=2, grad_outputs=[1])
row("SoftmaxCrossEntropyLoss", "SCE_loss_only_grad_2_outputs", [randn(_N_, _C_), _LABELS],
    _ce_ref("mean", None, True), num_outputs=2, grad_outputs=[0])

# -- variadic Sum / Mean, CastLike ----------------------------------------------------------------------
row("Sum", "Sum_three_broadcast", [randn(3, 4), randn(4), randn(3, 1)], lambda a, b, c: a + b + c)
row("Sum", "Sum_single", [randn(3, 4)], lambda a: a * 1)
row("Mean", "Mean_two_broadcast", [randn(3, 4), randn(1, 4)], lambda a, b: (a + b) / 2)
row("CastLike", "CastLike_f64_like_f32", [randn(3, 4).astype(np.float64), randn(1)],
    lambda x, t: x.to(torch.float32), grad_inputs=(0,), fd_eps=1e-2)
