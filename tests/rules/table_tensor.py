"""Rows for the tensor-op rules: indexing, reductions and the extra activations (opset 20).

Covers ortmodule/autodiff/rules/indexing.py, reduction.py and activation_extra.py; see
tests/rules/opinfo.py for the row format and tests/rules/harness.py for how a row is checked.
Index, axes and shape inputs are initializers (``const_inputs``) unless a row's name says ``dyn``,
which makes them graph inputs so the rules' run-time shape paths are exercised.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .opinfo import OpCase

_rng = np.random.default_rng(20240611)


def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (scale * _rng.standard_normal(shape)).astype(np.float32)


def away(*shape: int, kinks=(0.0,), margin: float = 0.1, scale: float = 1.0) -> np.ndarray:
    """Random values at least ``margin`` away from every kink (keeps FD steps on one side)."""
    x = scale * _rng.standard_normal(shape)
    for k in kinks:
        d = x - k
        x = np.where(np.abs(d) < margin, k + np.where(d >= 0, margin, -margin) + d, x)
    return x.astype(np.float32)


def uniform(*shape: int, low: float, high: float) -> np.ndarray:
    return _rng.uniform(low, high, shape).astype(np.float32)


def distinct(*shape: int) -> np.ndarray:
    """A permutation of well-separated values: no ties for Max/Min/TopK to split."""
    n = int(np.prod(shape))
    return (_rng.permutation(n).astype(np.float32) * 0.37 - n * 0.15).reshape(shape)


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


CASES: list[OpCase] = []


def row(op_type: str, name: str, inputs, torch_fn, **kw) -> None:
    CASES.append(OpCase(op_type, name, inputs, torch_fn, **kw))


# -- Gather family --------------------------------------------------------------------------------
_EMB_IDX = i64([[1, 3, 1, 9], [7, 3, 3, -1]])  # repeated rows accumulate; -1 is the last row
row("Gather", "Gather_embedding_repeated", [randn(10, 4), _EMB_IDX],
    lambda w, i: F.embedding(i % 10, w), const_inputs=[1])
row("Gather", "Gather_embedding_dyn_indices", [randn(10, 4), _EMB_IDX],
    lambda w, i: F.embedding(i % 10, w))
row("Gather", "Gather_embedding_int32_indices", [randn(6, 3), _EMB_IDX.clip(0, 5).astype(np.int32)],
    lambda w, i: F.embedding(i.long(), w), const_inputs=[1])
row("Gather", "Gather_axis1_negative_repeated", [randn(3, 5, 2), i64([[-1, 0], [2, -1]])],
    lambda x, i: x[:, i], attributes={"axis": 1}, const_inputs=[1])
row("Gather", "Gather_axis_last_scalar_index", [randn(2, 3, 4), i64(-2)],
    lambda x, i: x[..., int(i)], attributes={"axis": -1}, const_inputs=[1])
row("Gather", "Gather_axis2_dyn_indices", [randn(2, 3, 4), i64([3, 0, 3])],
    lambda x, i: x.index_select(2, i), attributes={"axis": 2})

row("GatherElements", "GatherElements_axis1_repeated",
    [randn(3, 4), i64([[0, 1, 1, 3, 3], [2, 2, 0, -1, 1], [3, 3, 3, 0, -4]])],
    lambda x, i: torch.gather(x, 1, i % 4), attributes={"axis": 1}, const_inputs=[1])
# Indices smaller than data off the axis: no FD check, onnx.reference's ScatterElements (used by the
# gradient graph) requires indices and data to agree off the axis; onnxruntime and the spec do not.
row("GatherElements", "GatherElements_partial_indices",
    [randn(3, 4), i64([[0, 1, 1, 3], [2, 2, 0, -1]])],
    lambda x, i: torch.gather(x, 1, i % 4), attributes={"axis": 1}, const_inputs=[1], fd_check=False)
row("GatherElements", "GatherElements_axis0_dyn", [randn(3, 4), i64([[0, 2, 2, 1], [0, 0, 1, 2]])],
    lambda x, i: torch.gather(x, 0, i))

row("GatherND", "GatherND_pairs", [randn(3, 4, 2), i64([[0, 1], [2, -1], [0, 1]])],
    lambda x, i: x[i[:, 0], i[:, 1] % 4], const_inputs=[1])
row("GatherND", "GatherND_rows_dyn", [randn(3, 4), i64([[[1], [2]], [[1], [0]]])],
    lambda x, i: x[i[..., 0]])
row("GatherND", "GatherND_triples_repeated", [randn(2, 3, 4), i64([[1, 2, 3], [0, -1, 1], [1, 2, 3], [1, 2, -1]])],
    lambda x, i: x[i[:, 0], i[:, 1] % 3, i[:, 2] % 4], const_inputs=[1])  # element tuples, repeated
row("GatherND", "GatherND_batch_dims1", [randn(2, 3, 4), i64([[[1], [1]], [[2], [0]]])],
    lambda x, i: x[torch.arange(2)[:, None], i[..., 0]], attributes={"batch_dims": 1}, const_inputs=[1])

# -- Scatter family -------------------------------------------------------------------------------
row("ScatterND", "ScatterND_rows", [randn(4, 3), i64([[1], [3]]), randn(2, 3)],
    lambda d, i, u: d.index_put((i[:, 0],), u), const_inputs=[1])
row("ScatterND", "ScatterND_elements_dyn", [randn(4, 3), i64([[1, 2], [3, 0], [0, 0]]), randn(3)],
    lambda d, i, u: d.index_put((i[:, 0], i[:, 1]), u))
row("ScatterND", "ScatterND_add_repeated", [randn(4, 3), i64([[1], [1], [2]]), randn(3, 3)],
    lambda d, i, u: d.index_put((i[:, 0],), u, accumulate=True),
    attributes={"reduction": "add"}, const_inputs=[1])

row("ScatterElements", "ScatterElements_axis1", [randn(3, 4), i64([[0, 3], [2, 1], [1, 0]]), randn(3, 2)],
    lambda d, i, u: torch.scatter(d, 1, i, u), attributes={"axis": 1}, const_inputs=[1])
# As GatherElements_partial_indices: onnx.reference cannot run this gradient graph, onnxruntime can.
row("ScatterElements", "ScatterElements_partial_indices", [randn(3, 4), i64([[0, 3], [2, 1]]), randn(2, 2)],
    lambda d, i, u: torch.scatter(d, 1, i, u), attributes={"axis": 1}, const_inputs=[1], fd_check=False)
row("ScatterElements", "ScatterElements_axis0_dyn", [randn(3, 4), i64([[2, 0, 1, 1]]), randn(1, 4)],
    lambda d, i, u: torch.scatter(d, 0, i, u))
row("ScatterElements", "ScatterElements_add_repeated",
    [randn(3, 4), i64([[0, 0, 3], [1, 2, 1], [2, 2, 2]]), randn(3, 3)],
    lambda d, i, u: torch.scatter_add(d, 1, i, u),
    attributes={"axis": 1, "reduction": "add"}, const_inputs=[1])

# -- Where, Tile ----------------------------------------------------------------------------------
_COND = np.array([[True], [False], [True]])
row("Where", "Where_broadcast", [_COND, randn(1, 4), randn(3, 4)], torch.where)
row("Where", "Where_scalar_other", [np.array([[True, False, False, True]] * 2), randn(2, 4), randn()],
    torch.where)
row("Where", "Where_cond_broadcast", [np.array([True, False, True]), randn(2, 3), randn(2, 1)], torch.where)

row("Tile", "Tile_2d", [randn(2, 3), i64([2, 3])], lambda x, r: x.repeat(*r.tolist()), const_inputs=[1])
row("Tile", "Tile_3d_dyn_repeats", [randn(2, 1, 3), i64([1, 4, 2])], lambda x, r: x.repeat(*r.tolist()))

# -- Slice ----------------------------------------------------------------------------------------
_BIG = np.iinfo(np.int64).max


def _slice_ref(starts, ends, axes, steps):
    """Python's slice clamping is ONNX Slice's (also for huge ends and negative steps)."""

    def fn(x, *_):
        out = x
        for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
            idx = list(range(out.shape[a]))[slice(s, e, st)]
            out = out.index_select(a, torch.tensor(idx, dtype=torch.int64))
        return out

    return fn


row("Slice", "Slice_step1_pad", [randn(4, 6), i64([1, -4]), i64([3, _BIG]), i64([0, 1])],
    _slice_ref([1, -4], [3, _BIG], [0, 1], [1, 1]), const_inputs=[1, 2, 3])
row("Slice", "Slice_no_axes_no_steps", [randn(4, 6), i64([1]), i64([-1])],
    _slice_ref([1], [-1], [0], [1]), const_inputs=[1, 2])
row("Slice", "Slice_step2", [randn(3, 7), i64([1]), i64([7]), i64([-1]), i64([2])],
    _slice_ref([1], [7], [-1], [2]), const_inputs=[1, 2, 3, 4])
row("Slice", "Slice_negative_step",
    [randn(3, 6), i64([-1, 2]), i64([-_BIG - 1, 0]), i64([1, 0]), i64([-2, -1])],
    _slice_ref([-1, 2], [-_BIG - 1, 0], [1, 0], [-2, -1]), const_inputs=[1, 2, 3, 4])
row("Slice", "Slice_dyn_starts", [randn(5, 4), i64([1]), i64([4]), i64([0])],
    _slice_ref([1], [4], [0], [1]), const_inputs=[2, 3])
row("Slice", "Slice_dyn_all_clamped", [randn(3, 5, 4), i64([-2, -9]), i64([_BIG, -1]), i64([-1, 1])],
    _slice_ref([-2, -9], [_BIG, -1], [-1, 1], [1, 1]))
row("Slice", "Slice_dyn_ends_no_axes", [randn(5, 4), i64([0, 1]), i64([-2, 3])],
    _slice_ref([0, 1], [-2, 3], [0, 1], [1, 1]), const_inputs=[1])
row("Slice", "Slice_dyn_steps", [randn(5, 4), i64([4]), i64([0]), i64([0]), i64([-3])],
    _slice_ref([4], [0], [0], [-3]), const_inputs=[1, 2, 3])
row("Slice", "Slice_empty", [randn(4, 3), i64([3]), i64([1]), i64([0])],
    _slice_ref([3], [1], [0], [1]), const_inputs=[1, 2, 3])

# -- Concat, Split ---------------------------------------------------------------------------------
row("Concat", "Concat_last_axis", [randn(2, 3), randn(2, 1), randn(2, 4)],
    lambda *xs: torch.cat(xs, -1), attributes={"axis": -1})
row("Concat", "Concat_axis0", [randn(1, 3), randn(2, 3)], lambda *xs: torch.cat(xs, 0),
    attributes={"axis": 0})

row("Split", "Split_sizes", [randn(6, 4), i64([1, 2, 3])],
    lambda x, s: torch.split(x, s.tolist(), 0), num_outputs=3, const_inputs=[1])
row("Split", "Split_sizes_missing_grads", [randn(4, 6), i64([2, 1, 3])],
    lambda x, s: torch.split(x, s.tolist(), 1), attributes={"axis": -1}, num_outputs=3,
    const_inputs=[1], grad_outputs=[0, 2])
row("Split", "Split_num_outputs", [randn(2, 6)],
    lambda x: torch.chunk(x, 2, 1), attributes={"axis": 1, "num_outputs": 2}, num_outputs=2)

# -- TopK, Trilu ----------------------------------------------------------------------------------
row("TopK", "TopK_largest", [distinct(3, 5), i64([2])], lambda x, k: torch.topk(x, int(k[0]), dim=1),
    attributes={"axis": 1}, num_outputs=2, const_inputs=[1])
row("TopK", "TopK_smallest_axis0", [distinct(4, 3), i64([3])],
    lambda x, k: torch.topk(x, int(k[0]), dim=0, largest=False),
    attributes={"axis": 0, "largest": 0}, num_outputs=2, const_inputs=[1])

row("Trilu", "Trilu_upper_k1", [randn(4, 5), i64(1)], lambda x, k: torch.triu(x, int(k)), const_inputs=[1])
row("Trilu", "Trilu_lower_kneg1", [randn(2, 4, 4), i64(-1)], lambda x, k: torch.tril(x, int(k)),
    attributes={"upper": 0}, const_inputs=[1])
row("Trilu", "Trilu_upper_default_k", [randn(3, 3)], torch.triu)

# -- Einsum ---------------------------------------------------------------------------------------
_EINSUM = [
    ("attention_scores", "bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ("attention_context", "bhqk,bhkd->bhqd", [(2, 3, 4, 6), (2, 3, 6, 5)]),
    ("matmul", "ij,jk->ik", [(3, 4), (4, 5)]),
    ("transpose", "bij->bji", [(2, 3, 4)]),
    ("row_sum", "ij->i", [(3, 4)]),
    ("outer", "i,j->ij", [(3,), (4,)]),
    ("diagonal", "ii->i", [(4, 4)]),
    ("trace_implicit", "ii", [(4, 4)]),
    ("bmm_implicit", "bij,bjk", [(2, 3, 4), (2, 4, 5)]),
    ("three_operands", "ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
    ("ellipsis", "...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("ellipsis_broadcast", "...ij,...jk->...ik", [(2, 1, 3, 4), (1, 5, 4, 2)]),
    ("bilinear_summed", "bi,ij,bj->b", [(3, 4), (4, 5), (3, 5)]),
]
for _tag, _eq, _shapes in _EINSUM:
    row("Einsum", f"Einsum_{_tag}", [randn(*s) for s in _shapes],
        lambda *xs, eq=_eq: torch.einsum(eq, *xs), attributes={"equation": _eq})

# -- Min / Max / Clip ---------------------------------------------------------------------------------
_TIE_A = randn(3, 4)
_TIE_B = np.where(_rng.random((3, 4)) < 0.5, _TIE_A, randn(3, 4))
row("Max", "Max_three_broadcast", [distinct(3, 4), distinct(4), distinct(3, 1)],
    lambda a, b, c: torch.maximum(torch.maximum(a, b), c))
row("Min", "Min_two", [distinct(3, 4), distinct(3, 4)], torch.minimum)
row("Max", "Max_single", [randn(3, 4)], lambda a: a * 1)
# Ties: torch.maximum/minimum split the gradient evenly between tied inputs; so do we. No FD check:
# max is not differentiable where inputs tie (the central difference is not linear in u there).
row("Max", "Max_ties_split", [_TIE_A, _TIE_B], torch.maximum, fd_check=False)
row("Min", "Min_ties_split", [_TIE_A, _TIE_B], torch.minimum, fd_check=False)

_CLIP_X = away(3, 4, kinks=(-0.5, 0.5), margin=0.05)
row("Clip", "Clip_min_max", [_CLIP_X, np.float32(-0.5), np.float32(0.5)],
    lambda x, lo, hi: torch.clamp(x, lo, hi))
row("Clip", "Clip_min_only", [_CLIP_X, np.float32(-0.5)], lambda x, lo: torch.clamp(x, min=lo))
row("Clip", "Clip_max_only", [_CLIP_X, None, np.float32(0.5)], lambda x, lo, hi: torch.clamp(x, max=hi))
row("Clip", "Clip_no_bounds", [_CLIP_X], lambda x: x * 1)

# -- activations ----------------------------------------------------------------------------------
_X = away(3, 4, scale=2.0)
row("LeakyRelu", "LeakyRelu_default", [_X], lambda x: F.leaky_relu(x, 0.01))
row("LeakyRelu", "LeakyRelu_alpha", [_X], lambda x: F.leaky_relu(x, 0.2), attributes={"alpha": 0.2})
row("Elu", "Elu_default", [_X], F.elu)
row("Elu", "Elu_alpha", [_X], lambda x: F.elu(x, 0.5), attributes={"alpha": 0.5})
row("Selu", "Selu", [_X], F.selu)
row("Celu", "Celu_alpha", [_X], lambda x: F.celu(x, 2.0), attributes={"alpha": 2.0})
row("ThresholdedRelu", "ThresholdedRelu", [away(3, 4, kinks=(0.5,), scale=2.0)],
    lambda x: F.threshold(x, 0.5, 0.0), attributes={"alpha": 0.5})
row("HardSigmoid", "HardSigmoid_torch_params", [away(3, 4, kinks=(-3.0, 3.0), scale=4.0)], F.hardsigmoid,
    attributes={"alpha": 1.0 / 6.0, "beta": 0.5})
row("HardSigmoid", "HardSigmoid_default", [away(3, 4, kinks=(-2.5, 2.5), scale=3.0)],
    lambda x: torch.clamp(0.2 * x + 0.5, 0.0, 1.0))
row("HardSwish", "HardSwish", [away(3, 4, kinks=(-3.0, 3.0), scale=4.0)], F.hardswish)
row("Softplus", "Softplus", [randn(3, 4, scale=3.0)], F.softplus)
row("Softsign", "Softsign", [away(3, 4)], F.softsign)
row("Mish", "Mish", [randn(3, 4, scale=2.0)], F.mish)
row("PRelu", "PRelu_channel_slope", [away(2, 3, 4), randn(3, 1)], lambda x, s: torch.where(x < 0, s * x, x))
row("PRelu", "PRelu_scalar_slope", [away(3, 4), randn(1)], lambda x, s: torch.where(x < 0, s * x, x))

# At the kinks themselves (NOTE [kinks as torch]): the one-sided choice of torch's own backward, read from
# the installed torch (F.hardswish is 0 at -3 and 1 at 3; F.prelu takes the slope at 0; clamp keeps the
# gradient at its bounds; LeakyRelu/Elu/Selu/Celu take the negative side at 0). No FD check there.
def at_kinks(*shape: int, kinks) -> np.ndarray:
    """Random values with about half the elements exactly at a kink."""
    x = randn(*shape, scale=2.0)
    hit = _rng.random(shape) < 0.5
    return np.where(hit, np.asarray(kinks, np.float32)[_rng.integers(0, len(kinks), shape)], x).astype(np.float32)


_K0 = at_kinks(4, 6, kinks=(0.0,))
row("HardSwish", "HardSwish_at_kinks", [at_kinks(4, 6, kinks=(-3.0, 3.0, 0.0))], F.hardswish, fd_check=False)
row("HardSigmoid", "HardSigmoid_at_kinks", [at_kinks(4, 6, kinks=(-3.0, 3.0))], F.hardsigmoid,
    attributes={"alpha": 1.0 / 6.0, "beta": 0.5}, fd_check=False)
row("PRelu", "PRelu_at_zero", [_K0, randn(1)], lambda x, s: F.prelu(x, s), fd_check=False)
row("LeakyRelu", "LeakyRelu_at_zero", [_K0], lambda x: F.leaky_relu(x, 0.2), attributes={"alpha": 0.2},
    fd_check=False)
row("Elu", "Elu_alpha_at_zero", [_K0], lambda x: F.elu(x, 0.5), attributes={"alpha": 0.5}, fd_check=False)
row("Selu", "Selu_at_zero", [_K0], F.selu, fd_check=False)
row("Celu", "Celu_at_zero", [_K0], lambda x: F.celu(x, 2.0), attributes={"alpha": 2.0}, fd_check=False)
row("Relu", "Relu_at_zero", [_K0], F.relu, fd_check=False)
row("Clip", "Clip_at_bounds", [at_kinks(4, 6, kinks=(-0.5, 0.5)), np.float32(-0.5), np.float32(0.5)],
    lambda x, lo, hi: torch.clamp(x, lo, hi), fd_check=False)
row("ThresholdedRelu", "ThresholdedRelu_at_threshold", [at_kinks(4, 6, kinks=(0.5,))],
    lambda x: F.threshold(x, 0.5, 0.0), attributes={"alpha": 0.5}, fd_check=False)

row("Tan", "Tan", [uniform(3, 4, low=-1.2, high=1.2)], torch.tan)
row("Atan", "Atan", [randn(3, 4, scale=2.0)], torch.atan)
row("Asin", "Asin", [uniform(3, 4, low=-0.9, high=0.9)], torch.asin)
row("Acos", "Acos", [uniform(3, 4, low=-0.9, high=0.9)], torch.acos)
row("Sinh", "Sinh", [randn(3, 4)], torch.sinh)
row("Cosh", "Cosh", [randn(3, 4)], torch.cosh)
row("Asinh", "Asinh", [randn(3, 4, scale=2.0)], torch.asinh)
row("Acosh", "Acosh", [uniform(3, 4, low=1.2, high=3.0)], torch.acosh)
row("Atanh", "Atanh", [uniform(3, 4, low=-0.9, high=0.9)], torch.atanh)

# -- reductions -----------------------------------------------------------------------------------
_R = randn(2, 3, 4)


# (tag, axes or None, keepdims, torch dims)
_REDUCE_VARIANTS = [
    ("axis1_keep", [1], 1, (1,)),
    ("neg_axes_nokeep", [-1, 0], 0, (-1, 0)),
    ("all_nokeep", None, 0, None),
    ("all_keep", None, 1, None),
]


def _torch_reduce(op: str, dims, keep: bool):
    def fn(x, *_):
        d = tuple(range(x.dim())) if dims is None else dims
        if op == "ReduceSum":
            return torch.sum(x, d, keepdim=keep)
        if op == "ReduceMean":
            return torch.mean(x, d, keepdim=keep)
        if op == "ReduceMax":
            return torch.amax(x, d, keepdim=keep)
        if op == "ReduceMin":
            return torch.amin(x, d, keepdim=keep)
        if op == "ReduceL2":
            return torch.linalg.vector_norm(x, 2, d, keepdim=keep)
        if op == "ReduceL1":
            return torch.sum(torch.abs(x), d, keepdim=keep)
        if op == "ReduceSumSquare":
            return torch.sum(x * x, d, keepdim=keep)
        if op == "ReduceLogSumExp":
            return torch.logsumexp(x, d, keepdim=keep)
        if op == "ReduceLogSum":
            return torch.log(torch.sum(x, d, keepdim=keep))
        raise ValueError(op)

    return fn


_REDUCE_INPUTS = {
    "ReduceSum": _R,
    "ReduceMean": _R,
    "ReduceMax": distinct(2, 3, 4),
    "ReduceMin": distinct(2, 3, 4),
    "ReduceL2": _R,
    "ReduceL1": away(2, 3, 4),
    "ReduceSumSquare": _R,
    "ReduceLogSumExp": _R,
    "ReduceLogSum": uniform(2, 3, 4, low=0.5, high=2.0),
}
for _op, _x in _REDUCE_INPUTS.items():
    for _tag, _axes, _keep, _dims in _REDUCE_VARIANTS:
        _inputs = [_x] if _axes is None else [_x, i64(_axes)]
        row(_op, f"{_op}_{_tag}", _inputs, _torch_reduce(_op, _dims, bool(_keep)),
            attributes={"keepdims": _keep}, const_inputs=[1])
row("ReduceSum", "ReduceSum_dyn_axes", [_R, i64([0, 2])], _torch_reduce("ReduceSum", (0, 2), False),
    attributes={"keepdims": 0})
row("ReduceMean", "ReduceMean_dyn_axes_keep", [_R, i64([-1])], _torch_reduce("ReduceMean", (-1,), True))
row("ReduceSum", "ReduceSum_noop_empty_axes", [_R], lambda x: x * 1, attributes={"noop_with_empty_axes": 1})
row("ReduceSum", "ReduceSum_empty_const_axes", [_R, i64([])], _torch_reduce("ReduceSum", None, False),
    attributes={"keepdims": 0}, const_inputs=[1])
row("ReduceMax", "ReduceMax_noop_empty_axes", [_R], lambda x: x * 1, attributes={"noop_with_empty_axes": 1})
# Ties: like torch.amax/amin, the gradient is split evenly between the tied maxima. No FD check: the
# max is not differentiable at a tie.
_TIES = np.array([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 2.0, 2.0]], dtype=np.float32)
row("ReduceMax", "ReduceMax_ties_split", [_TIES, i64([1])], _torch_reduce("ReduceMax", (1,), False),
    attributes={"keepdims": 0}, const_inputs=[1], fd_check=False)
row("ReduceMin", "ReduceMin_ties_split_all", [_TIES], _torch_reduce("ReduceMin", None, True), fd_check=False)
# A zero row: the norm is not differentiable there (no FD check); torch and we give it a zero gradient.
row("ReduceL2", "ReduceL2_zero_norm_row",
    [np.concatenate([randn(2, 4), np.zeros((1, 4), np.float32)]), i64([1])],
    _torch_reduce("ReduceL2", (1,), False), attributes={"keepdims": 0}, const_inputs=[1], fd_check=False)

# -- CumSum ---------------------------------------------------------------------------------------


def _cumsum_ref(exclusive: int, reverse: int):
    def fn(x, axis):
        a = int(axis)
        xs = torch.flip(x, [a]) if reverse else x
        y = torch.cumsum(xs, a)
        if exclusive:
            y = y - xs
        return torch.flip(y, [a]) if reverse else y

    return fn


for _exc in (0, 1):
    for _rev in (0, 1):
        row("CumSum", f"CumSum_exclusive{_exc}_reverse{_rev}", [randn(3, 5), i64(1)], _cumsum_ref(_exc, _rev),
            attributes={"exclusive": _exc, "reverse": _rev}, const_inputs=[1])
row("CumSum", "CumSum_neg_axis_dyn", [randn(2, 3, 4), i64(-1)], _cumsum_ref(0, 0))

# -- ReduceProd -----------------------------------------------------------------------------------------


def _prod_ref(dims, keep: bool):
    """torch.prod over several dims (it takes one): the dims moved last, flattened, reduced."""

    def fn(x, *_):
        d = list(range(x.dim())) if dims is None else [a % x.dim() for a in dims]
        rest = [a for a in range(x.dim()) if a not in d]
        y = x.permute(*rest, *d).reshape(*[x.shape[a] for a in rest], -1).prod(-1)
        if keep:
            y = y.reshape([1 if a in d else x.shape[a] for a in range(x.dim())])
        return y

    return fn


_PROD_X = uniform(2, 3, 4, low=0.5, high=1.5) * np.sign(randn(2, 3, 4))
for _tag, _axes, _keep, _dims in _REDUCE_VARIANTS:
    row("ReduceProd", f"ReduceProd_{_tag}", [_PROD_X] if _axes is None else [_PROD_X, i64(_axes)],
        _prod_ref(_dims, bool(_keep)), attributes={"keepdims": _keep}, const_inputs=[1])
# NOTE [prod zeros]: rows (axis 2) with no zero, one zero and two zeros; a zero elsewhere in the tensor
# switches eager to its exclusive-product backward for every row.
_PROD_ZEROS = _PROD_X.copy()
_PROD_ZEROS[0, 1, 2] = 0.0
_PROD_ZEROS[1, 0, 0] = _PROD_ZEROS[1, 0, 3] = 0.0
row("ReduceProd", "ReduceProd_zeros", [_PROD_ZEROS, i64([2])], _prod_ref([2], False), attributes={"keepdims": 0},
    const_inputs=[1])
_PROD_ONE_ZERO = _PROD_X.copy()
_PROD_ONE_ZERO[1, 2, 1] = 0.0
row("ReduceProd", "ReduceProd_one_zero_all_axes", [_PROD_ONE_ZERO], _prod_ref(None, True))
row("ReduceProd", "ReduceProd_attr_axes_opset13", [_PROD_ZEROS], _prod_ref([1], True),
    attributes={"axes": [1], "keepdims": 1}, opset=13)
