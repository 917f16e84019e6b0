"""Rule-test rows for the CNN family: Conv, ConvTranspose, pooling, normalisation, Pad, Dropout."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .opinfo import OpCase

_rng = np.random.default_rng(20)


def _r(*shape: int) -> np.ndarray:
    return _rng.standard_normal(shape).astype(np.float32)


def _pos(*shape: int) -> np.ndarray:
    return _rng.uniform(0.5, 1.5, shape).astype(np.float32)


def _distinct(*shape: int) -> np.ndarray:
    """Values with no ties (max pooling is differentiable there), spaced well beyond fd_eps."""
    return (_rng.permutation(int(np.prod(shape))).reshape(shape) * 0.01 - 1.0).astype(np.float32)


# NOTE [onnx.reference gaps]: some rows skip the float64 FD check because onnx 1.23's reference
# evaluator (which runs it) is wrong or incomplete there; onnxruntime runs them correctly and the torch
# comparison still checks every gradient:
# * ConvTranspose with group > 1 and more than one channel per group fails (it reshapes W with the
#   wrong group size): the forward of a grouped ConvTranspose, and Conv's dX for such groups.
# * MaxPool's 2-D Indices output is wrong for overlapping windows (stride < kernel) and with begin
#   pads (it counts positions in the padded tensor); 1-D, 3-D and 2-D non-overlapping rows are checked.
# * MaxUnpool (the MaxPool gradient for non-overlapping windows) misplaces values when its
#   output_shape exceeds the minimal unpooled shape (a pooling remainder): it indexes the smaller one.
# * GlobalMaxPool reduces the wrong axes unless the input is 4-D.
# * Pad rejects negative pads.
# * Resize does not know coordinate_transformation_mode 'tf_half_pixel_for_nn'.
# * AffineGrid computes in float32 whatever theta's dtype, too coarse for float64 finite differences.


def _onnx_flat_indices(idx: torch.Tensor, spatial: int, column_major_hw: tuple[int, int] | None = None):
    """torch's per-plane argmax indices -> ONNX MaxPool Indices (flat over the whole N C H W tensor)."""
    n, c = idx.shape[:2]
    if column_major_hw is not None:
        h, w = column_major_hw
        idx = (idx % w) * h + idx // w
    plane = torch.arange(n * c, dtype=torch.int64).reshape(n, c, *([1] * (idx.dim() - 2)))
    return idx + plane * spatial


def _avg_pool_dilated(x, k, d):
    c = x.shape[1]
    w = torch.full((c, 1, k, k), 1.0 / (k * k), dtype=x.dtype)
    return F.conv2d(x, w, dilation=d, groups=c)


def _bn_train(x, s, b, m, v, eps=1e-5, momentum=0.9):
    """Y and the running statistics of ONNX BatchNormalization(training_mode=1) (biased variance)."""
    axes = (0, *range(2, x.dim()))
    y = F.batch_norm(x, None, None, s, b, training=True, eps=eps)
    mean, var = x.mean(axes), x.var(axes, unbiased=False)
    return y, m * momentum + mean * (1 - momentum), v * momentum + var * (1 - momentum)


def _layer_norm_stats(x, axis, eps):
    dims = tuple(range(axis, x.dim()))
    mean = x.mean(dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dims, keepdim=True)
    inv = 1.0 / torch.sqrt(var + eps)
    return mean, inv


def _pad_with_value_grad(x, c, pads):
    # F.pad takes the value as a float; this form lets autograd see it.
    return F.pad(x, pads) + c * (1.0 - F.pad(torch.ones_like(x), pads))


CASES: list[OpCase] = [
    # -- Conv ---------------------------------------------------------------------------------------
    OpCase("Conv", "Conv2d_bias_pad1", [_r(2, 3, 7, 7), _r(4, 3, 3, 3), _r(4)],
           lambda x, w, b: F.conv2d(x, w, b, padding=1), {"pads": [1, 1, 1, 1]}),
    # stride 1, no dilation, group 1: the im2col weight gradient (NOTE [wgrad im2col])
    OpCase("Conv", "Conv2d_1x1", [_r(2, 3, 5, 4), _r(4, 3, 1, 1)], lambda x, w: F.conv2d(x, w), {}),
    OpCase("Conv", "Conv2d_rect_kernel_asym_pads", [_r(2, 3, 6, 7), _r(4, 3, 5, 3)],
           lambda x, w: F.conv2d(F.pad(x, (1, 0, 2, 1)), w), {"pads": [2, 1, 1, 0]}),
    OpCase("Conv", "Conv2d_stride2_asym_pads", [_r(2, 3, 7, 8), _r(4, 3, 3, 3)],
           lambda x, w: F.conv2d(F.pad(x, (0, 1, 1, 2)), w, stride=2),
           {"strides": [2, 2], "pads": [1, 0, 2, 1]}),
    OpCase("Conv", "Conv2d_dilation_stride", [_r(2, 3, 9, 8), _r(4, 3, 3, 2), _r(4)],
           lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), dilation=2, padding=(1, 0)),
           {"strides": [2, 1], "dilations": [2, 2], "pads": [1, 0, 1, 0]}),
    OpCase("Conv", "Conv2d_stride_gt_kernel", [_r(2, 3, 8, 8), _r(2, 3, 2, 2)],
           lambda x, w: F.conv2d(x, w, stride=3), {"strides": [3, 3]}),
    OpCase("Conv", "Conv2d_group2", [_r(2, 4, 6, 6), _r(6, 2, 3, 3), _r(6)],
           lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=2),
           {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]},
           fd_check=False),  # NOTE [onnx.reference gaps]
    OpCase("Conv", "Conv2d_depthwise_mult2", [_r(2, 3, 7, 7), _r(6, 1, 3, 3)],
           lambda x, w: F.conv2d(x, w, stride=2, groups=3), {"group": 3, "strides": [2, 2]},
           fd_check=False),  # NOTE [onnx.reference gaps]
    OpCase("Conv", "Conv2d_depthwise", [_r(2, 4, 6, 6), _r(4, 1, 3, 3), _r(4)],
           lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=4), {"group": 4, "pads": [1, 1, 1, 1]}),
    OpCase("Conv", "Conv2d_auto_pad_same_upper", [_r(2, 3, 8, 7), _r(4, 3, 3, 3)],
           lambda x, w: F.conv2d(F.pad(x, (1, 1, 0, 1)), w, stride=2),
           {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    OpCase("Conv", "Conv2d_auto_pad_same_lower", [_r(2, 3, 8, 7), _r(4, 3, 3, 3)],
           lambda x, w: F.conv2d(F.pad(x, (1, 1, 1, 0)), w, stride=2),
           {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    OpCase("Conv", "Conv2d_auto_pad_valid", [_r(2, 3, 8, 7), _r(4, 3, 3, 3)],
           lambda x, w: F.conv2d(x, w, stride=2), {"strides": [2, 2], "auto_pad": "VALID"}),
    OpCase("Conv", "Conv1d_stride3_asym_pads", [_r(2, 3, 10), _r(4, 3, 3), _r(4)],
           lambda x, w, b: F.conv1d(F.pad(x, (2, 1)), w, b, stride=3), {"strides": [3], "pads": [2, 1]}),
    OpCase("Conv", "Conv3d_stride2_pad1", [_r(1, 2, 5, 6, 5), _r(3, 2, 3, 3, 3), _r(3)],
           lambda x, w, b: F.conv3d(x, w, b, stride=2, padding=1),
           {"strides": [2, 2, 2], "pads": [1, 1, 1, 1, 1, 1]}),
    # -- ConvTranspose ------------------------------------------------------------------------------
    OpCase("ConvTranspose", "ConvTranspose2d_stride2_outpad", [_r(2, 4, 5, 5), _r(4, 3, 3, 3), _r(3)],
           lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
           {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}),
    OpCase("ConvTranspose", "ConvTranspose2d_dilation", [_r(2, 3, 4, 5), _r(3, 2, 3, 2)],
           lambda x, w: F.conv_transpose2d(x, w, stride=(1, 2), dilation=2),
           {"strides": [1, 2], "dilations": [2, 2]}),
    OpCase("ConvTranspose", "ConvTranspose2d_group2", [_r(2, 4, 4, 4), _r(4, 3, 3, 3), _r(6)],
           lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, groups=2, padding=1),
           {"strides": [2, 2], "group": 2, "pads": [1, 1, 1, 1]},
           fd_check=False),  # NOTE [onnx.reference gaps]
    OpCase("ConvTranspose", "ConvTranspose1d_asym_pads", [_r(2, 3, 6), _r(3, 2, 4)],
           lambda x, w: F.conv_transpose1d(x, w, stride=3)[..., 1:-2], {"strides": [3], "pads": [1, 2]}),
    OpCase("ConvTranspose", "ConvTranspose3d_stride2", [_r(1, 2, 3, 3, 3), _r(2, 2, 2, 2, 2), _r(2)],
           lambda x, w, b: F.conv_transpose3d(x, w, b, stride=2), {"strides": [2, 2, 2]}),
    # -- MaxPool -------------------------------------------------------------------------------------
    OpCase("MaxPool", "MaxPool2d_k2s2", [_distinct(2, 3, 6, 6)],
           lambda x: F.max_pool2d(x, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    # Tiled windows with ties (NOTE [tiled maxpool]): the gradient goes to the first max, as in torch.
    OpCase("MaxPool", "MaxPool2d_k2s2_ties", [np.random.default_rng(5).integers(0, 3, (2, 3, 6, 8)).astype(np.float32)],
           lambda x: F.max_pool2d(x, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]},
           fd_check=False),  # not differentiable at ties
    OpCase("MaxPool", "MaxPool2d_k2x3_rect", [_distinct(2, 2, 6, 9)],
           lambda x: F.max_pool2d(x, (2, 3), (2, 3)), {"kernel_shape": [2, 3], "strides": [2, 3]}),
    OpCase("MaxPool", "MaxPool2d_k2s2_remainder", [_distinct(2, 2, 7, 7)],
           lambda x: F.max_pool2d(x, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]},
           fd_check=False),  # NOTE [onnx.reference gaps]
    OpCase("MaxPool", "MaxPool2d_overlap", [_distinct(2, 2, 5, 6)],
           lambda x: F.max_pool2d(x, 3, 1), {"kernel_shape": [3, 3]},
           fd_check=False),  # NOTE [onnx.reference gaps]
    OpCase("MaxPool", "MaxPool2d_overlap_pad", [_distinct(2, 2, 5, 6)],
           lambda x: F.max_pool2d(x, 3, 1, padding=1),
           {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, fd_check=False),  # NOTE [onnx.reference gaps]
    OpCase("MaxPool", "MaxPool2d_ceil_dilation", [_distinct(2, 2, 7, 8)],
           lambda x: F.max_pool2d(x, 2, 2, dilation=2, ceil_mode=True),
           {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2], "ceil_mode": 1}),
    OpCase("MaxPool", "MaxPool2d_same_upper", [_distinct(2, 2, 5, 5)],
           lambda x: F.max_pool2d(F.pad(x, (0, 1, 0, 1), value=-np.inf), 2, 2),
           {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    OpCase("MaxPool", "MaxPool2d_indices_output", [_distinct(2, 3, 4, 6)],
           lambda x: (lambda y, i: (y, _onnx_flat_indices(i, 24)))(
               *F.max_pool2d(x, 2, 2, return_indices=True)),
           {"kernel_shape": [2, 2], "strides": [2, 2]}, num_outputs=2, grad_outputs=[0]),
    OpCase("MaxPool", "MaxPool2d_storage_order1", [_distinct(2, 3, 4, 6)],
           lambda x: (lambda y, i: (y, _onnx_flat_indices(i, 24, (4, 6))))(
               *F.max_pool2d(x, 2, 2, return_indices=True)),
           {"kernel_shape": [2, 2], "strides": [2, 2], "storage_order": 1}, num_outputs=2, grad_outputs=[0]),
    OpCase("MaxPool", "MaxPool1d_overlap", [_distinct(2, 3, 9)],
           lambda x: F.max_pool1d(x, 3, 2), {"kernel_shape": [3], "strides": [2]}),
    OpCase("MaxPool", "MaxPool3d_k2", [_distinct(1, 2, 4, 5, 4)],
           lambda x: F.max_pool3d(x, 2, 2, padding=1),
           {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2], "pads": [1, 1, 1, 1, 1, 1]},
           fd_check=False),  # NOTE [onnx.reference gaps]
    # -- AveragePool ---------------------------------------------------------------------------------
    OpCase("AveragePool", "AveragePool2d_exclude_pad", [_r(2, 3, 7, 6)],
           lambda x: F.avg_pool2d(x, 3, 2, padding=1, count_include_pad=False),
           {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    OpCase("AveragePool", "AveragePool2d_include_pad", [_r(2, 3, 7, 6)],
           lambda x: F.avg_pool2d(x, 3, 2, padding=1, count_include_pad=True),
           {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    OpCase("AveragePool", "AveragePool2d_ceil_exclude_pad", [_r(2, 2, 6, 7)],
           lambda x: F.avg_pool2d(x, 3, 2, padding=1, ceil_mode=True, count_include_pad=False),
           {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    OpCase("AveragePool", "AveragePool2d_ceil_include_pad", [_r(2, 2, 6, 7)],
           lambda x: F.avg_pool2d(x, 3, 2, padding=1, ceil_mode=True, count_include_pad=True),
           {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1,
            "count_include_pad": 1}),
    OpCase("AveragePool", "AveragePool2d_ceil_nopad", [_r(2, 2, 7, 6)],
           lambda x: F.avg_pool2d(x, 2, 2, ceil_mode=True),
           {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    OpCase("AveragePool", "AveragePool2d_dilation", [_r(2, 2, 7, 8)],
           lambda x: _avg_pool_dilated(x, 2, 2), {"kernel_shape": [2, 2], "dilations": [2, 2]}),
    OpCase("AveragePool", "AveragePool1d_overlap", [_r(2, 3, 9)],
           lambda x: F.avg_pool1d(x, 3, 2), {"kernel_shape": [3], "strides": [2]}),
    OpCase("AveragePool", "AveragePool3d_pad", [_r(1, 2, 4, 5, 4)],
           lambda x: F.avg_pool3d(x, 2, 2, padding=1, count_include_pad=False),
           {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2], "pads": [1, 1, 1, 1, 1, 1]},
           fd_check=False),  # NOTE [onnx.reference gaps]
    # -- Global pooling ------------------------------------------------------------------------------
    OpCase("GlobalAveragePool", "GlobalAveragePool2d", [_r(2, 3, 4, 5)],
           lambda x: x.mean((2, 3), keepdim=True)),
    OpCase("GlobalAveragePool", "GlobalAveragePool1d", [_r(2, 3, 7)], lambda x: x.mean(2, keepdim=True)),
    OpCase("GlobalMaxPool", "GlobalMaxPool2d", [_distinct(2, 3, 4, 5)],
           lambda x: x.amax((2, 3), keepdim=True)),
    OpCase("GlobalMaxPool", "GlobalMaxPool3d", [_distinct(2, 2, 3, 2, 3)],
           lambda x: x.amax((2, 3, 4), keepdim=True), fd_check=False),  # NOTE [onnx.reference gaps]
    # -- BatchNormalization --------------------------------------------------------------------------
    # training_mode=1 requires the running_mean / running_var outputs; they get no upstream grad.
    OpCase("BatchNormalization", "BatchNorm2d_training",
           [_r(4, 3, 5, 5), _r(3), _r(3), _r(3), _pos(3)],
           lambda x, s, b, m, v: _bn_train(x, s, b, m, v, eps=1e-3, momentum=0.8),
           {"training_mode": 1, "epsilon": 1e-3, "momentum": 0.8}, const_inputs=(3, 4), num_outputs=3,
           grad_outputs=[0]),
    OpCase("BatchNormalization", "BatchNorm1d_training_2d_input",
           [_r(6, 4), _r(4), _r(4), _r(4), _pos(4)],
           _bn_train, {"training_mode": 1}, const_inputs=(3, 4), num_outputs=3, grad_outputs=[0]),
    OpCase("BatchNormalization", "BatchNorm3d_training",
           [_r(2, 3, 3, 4, 3), _r(3), _r(3), _r(3), _pos(3)],
           _bn_train, {"training_mode": 1}, const_inputs=(3, 4), num_outputs=3, grad_outputs=[0]),
    OpCase("BatchNormalization", "BatchNorm2d_inference",
           [_r(2, 3, 4, 5), _r(3), _r(3), _r(3), _pos(3)],
           # Written out (not F.batch_norm) so autograd reaches the running mean and variance too.
           lambda x, s, b, m, v: ((x - m[:, None, None]) / torch.sqrt(v[:, None, None] + 1e-5)
                                  * s[:, None, None] + b[:, None, None])),
    # -- InstanceNormalization -----------------------------------------------------------------------
    OpCase("InstanceNormalization", "InstanceNorm2d", [_r(2, 3, 5, 4), _r(3), _r(3)],
           lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-3), {"epsilon": 1e-3}),
    OpCase("InstanceNormalization", "InstanceNorm1d", [_r(2, 3, 7), _r(3), _r(3)],
           lambda x, s, b: F.instance_norm(x, weight=s, bias=b)),
    # -- LayerNormalization --------------------------------------------------------------------------
    OpCase("LayerNormalization", "LayerNorm_last_axis", [_r(2, 3, 8), _r(8), _r(8)],
           lambda x, s, b: F.layer_norm(x, (8,), s, b)),
    OpCase("LayerNormalization", "LayerNorm_axis1_no_bias", [_r(2, 3, 4, 5), _r(3, 4, 5)],
           lambda x, s: F.layer_norm(x, (3, 4, 5), s, None, eps=1e-3), {"axis": 1, "epsilon": 1e-3}),
    OpCase("LayerNormalization", "LayerNorm_mean_invstd_outputs", [_r(3, 2, 6), _r(2, 6), _r(2, 6)],
           lambda x, s, b: (F.layer_norm(x, (2, 6), s, b), *_layer_norm_stats(x, 1, 1e-5)),
           {"axis": -2}, num_outputs=3),
    # -- Pad -----------------------------------------------------------------------------------------
    OpCase("Pad", "Pad_constant",
           [_r(2, 3, 4, 5), np.array([0, 0, 1, 2, 0, 0, 2, 1]), np.array(0.5, np.float32)],
           lambda x, p, c: F.pad(x, (2, 1, 1, 2), value=0.5), const_inputs=(1, 2)),
    OpCase("Pad", "Pad_constant_value_grad",
           [_r(2, 3, 4, 5), np.array([0, 0, 1, 2, 0, 0, 2, 1]), np.array(0.5, np.float32)],
           lambda x, p, c: _pad_with_value_grad(x, c, (2, 1, 1, 2)), const_inputs=(1,)),
    OpCase("Pad", "Pad_constant_negative", [_r(2, 3, 4, 5), np.array([0, 0, -1, 2, 0, 0, 1, -2])],
           lambda x, p: F.pad(x, (2, -2, -1, 1)), const_inputs=(1,),
           fd_check=False),  # NOTE [onnx.reference gaps]
    OpCase("Pad", "Pad_constant_axes", [_r(2, 3, 4, 5), np.array([1, 2, 2, 1]), None, np.array([-2, 3])],
           lambda x, p, c, a: F.pad(x, (2, 1, 1, 2)), const_inputs=(1, 3)),
    OpCase("Pad", "Pad_reflect", [_r(2, 3, 5, 6), np.array([0, 0, 2, 1, 0, 0, 3, 5])],
           lambda x, p: F.pad(x, (1, 5, 2, 3), mode="reflect"), {"mode": "reflect"}, const_inputs=(1,)),
    OpCase("Pad", "Pad_edge", [_r(2, 3, 5, 6), np.array([0, 0, 2, 1, 0, 0, 3, 4])],
           lambda x, p: F.pad(x, (1, 4, 2, 3), mode="replicate"), {"mode": "edge"}, const_inputs=(1,)),
    OpCase("Pad", "Pad_wrap", [_r(2, 3, 5, 6), np.array([0, 0, 2, 1, 0, 0, 3, 6])],
           lambda x, p: F.pad(x, (1, 6, 2, 3), mode="circular"), {"mode": "wrap"}, const_inputs=(1,)),
    # -- Dropout -------------------------------------------------------------------------------------
    OpCase("Dropout", "Dropout_inference", [_r(3, 4)], lambda x: F.dropout(x, 0.5, training=False)),
    OpCase("Dropout", "Dropout_training_false", [_r(3, 4), np.array(0.5, np.float32), np.array(False)],
           lambda x, r, t: F.dropout(x, 0.5, training=False), const_inputs=(1, 2)),
    # ratio 0 makes the mask deterministic (all kept), so torch and the FD check can follow it.
    OpCase("Dropout", "Dropout_training_mask_ratio0", [_r(3, 4), np.array(0.0, np.float32), np.array(True)],
           lambda x, r, t: (F.dropout(x, 0.0, training=True), torch.ones(3, 4, dtype=torch.bool)),
           const_inputs=(1, 2), num_outputs=2, grad_outputs=[0]),
    OpCase("Dropout", "Dropout_training_no_mask", [_r(3, 4), np.array(0.0, np.float32), np.array(True)],
           lambda x, r, t: F.dropout(x, 0.0, training=True), const_inputs=(1, 2),
           xfail="a training Dropout without a mask output has no gradient rule: the export must "
                 "request the mask (GradientRuleError)"),
]


# -- Resize, DepthToSpace, SpaceToDepth ----------------------------------------------------------------
# NOTE [resize adjoint] (autodiff/rules/resample.py): the gradient is probed from the node's own Resize,
# so every row checks it against torch's gradient (where torch resamples the same way) and against
# the float64 finite differences of onnx's reference Resize.
def _f32(*v) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def _interp(**kw):
    return lambda x, *_: F.interpolate(x, **kw)


def _ort_resize(attrs: dict, x_shape, extra: list, opset: int = 20):
    """Y = J x with J onnxruntime's own Resize applied to every one-hot input: the reference for the
    configurations torch resamples another way (antialias, rounding and coordinate modes)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    names = ["x"] + [f"c{i}" if e is not None else "" for i, e in enumerate(extra)]
    inits = [numpy_helper.from_array(e, f"c{i}") for i, e in enumerate(extra) if e is not None]
    node = helper.make_node("Resize", names, ["y"], **attrs)
    graph = helper.make_graph([node], "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    n = int(np.prod(x_shape))
    cols = [sess.run(None, {"x": np.eye(n, dtype=np.float32)[i].reshape(x_shape)})[0] for i in range(n)]
    out_shape = cols[0].shape
    jac = torch.from_numpy(np.stack([c.reshape(-1) for c in cols], axis=1))  # [out, in]
    return lambda x, *_: (jac @ x.reshape(-1)).reshape(out_shape)


_NEAREST = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
_LINEAR = {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}
_RESIZE_CASES = [
    OpCase("Resize", "Resize_nearest_scales2", [_r(2, 3, 4, 5), None, _f32(1, 1, 2, 2)],
           _interp(scale_factor=2, mode="nearest"), _NEAREST, const_inputs=(2,), fd_keep_dtype=(2,)),
    OpCase("Resize", "Resize_nearest_sizes_3x", [_r(2, 3, 4, 5), None, None, np.array([2, 3, 12, 15])],
           _interp(size=(12, 15), mode="nearest"), _NEAREST, const_inputs=(3,)),
    OpCase("Resize", "Resize_nearest_downsample", [_r(2, 3, 8, 6), None, None, np.array([2, 3, 4, 3])],
           _interp(size=(4, 3), mode="nearest"), _NEAREST, const_inputs=(3,)),
    OpCase("Resize", "Resize_linear_sizes_odd", [_r(2, 3, 4, 5), None, None, np.array([2, 3, 13, 11])],
           _interp(size=(13, 11), mode="bilinear"), _LINEAR, const_inputs=(3,)),
    OpCase("Resize", "Resize_linear_align_corners", [_r(2, 3, 4, 5), None, _f32(1, 1, 1.5, 1.5)],
           _interp(scale_factor=1.5, mode="bilinear", align_corners=True),
           {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, const_inputs=(2,),
           fd_keep_dtype=(2,)),
    OpCase("Resize", "Resize_linear_downsample", [_r(2, 3, 9, 8), None, None, np.array([2, 3, 5, 3])],
           _interp(size=(5, 3), mode="bilinear"), _LINEAR, const_inputs=(3,)),
    # torch's antialias filter differs from ONNX's: the reference is onnxruntime's own Jacobian
    OpCase("Resize", "Resize_linear_antialias_down", [_r(2, 3, 9, 8), None, None, np.array([2, 3, 4, 3])],
           _ort_resize({**_LINEAR, "antialias": 1}, [2, 3, 9, 8], [None, None, np.array([2, 3, 4, 3])], 18),
           {**_LINEAR, "antialias": 1}, const_inputs=(3,), opset=18),
    OpCase("Resize", "Resize_cubic_antialias_exclude_outside",
           [_r(1, 2, 9, 7), None, _f32(1, 1, 0.6, 0.5)],
           _ort_resize({"mode": "cubic", "antialias": 1, "exclude_outside": 1, "cubic_coeff_a": -0.5},
                       [1, 2, 9, 7], [None, _f32(1, 1, 0.6, 0.5)], 18),
           {"mode": "cubic", "antialias": 1, "exclude_outside": 1, "cubic_coeff_a": -0.5}, const_inputs=(2,),
           fd_keep_dtype=(2,), opset=18),
    # the rule cannot skip N and C here (a scale of 1 moves positions), so it probes every axis
    OpCase("Resize", "Resize_nearest_tf_half_pixel_ceil", [_r(2, 3, 4, 5), None, None, np.array([2, 3, 7, 9])],
           _ort_resize({"mode": "nearest", "coordinate_transformation_mode": "tf_half_pixel_for_nn",
                        "nearest_mode": "ceil"}, [2, 3, 4, 5], [None, None, np.array([2, 3, 7, 9])]),
           {"mode": "nearest", "coordinate_transformation_mode": "tf_half_pixel_for_nn", "nearest_mode": "ceil"},
           const_inputs=(3,), fd_check=False),
    OpCase("Resize", "Resize_nearest_round_prefer_ceil_odd", [_r(2, 3, 5, 7), None, None, np.array([2, 3, 8, 4])],
           _ort_resize({"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
                        "nearest_mode": "round_prefer_ceil"}, [2, 3, 5, 7], [None, None, np.array([2, 3, 8, 4])]),
           {"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_ceil"},
           const_inputs=(3,)),
    OpCase("Resize", "Resize_linear_half_pixel_symmetric", [_r(2, 3, 5, 4), None, None, np.array([2, 3, 8, 7])],
           _ort_resize({"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, [2, 3, 5, 4],
                       [None, None, np.array([2, 3, 8, 7])]),
           {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, const_inputs=(3,)),
    OpCase("Resize", "Resize_cubic_scales2", [_r(2, 3, 4, 5), None, _f32(1, 1, 2, 2)],
           _interp(scale_factor=2, mode="bicubic"),
           {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75},
           const_inputs=(2,), fd_keep_dtype=(2,)),
    OpCase("Resize", "Resize_linear_1d", [_r(2, 3, 7), None, None, np.array([2, 3, 12])],
           _interp(size=12, mode="linear"), _LINEAR, const_inputs=(3,)),
    OpCase("Resize", "Resize_trilinear_scales", [_r(1, 2, 3, 4, 5), None, _f32(1, 1, 2, 1.5, 2)],
           _interp(scale_factor=(2, 1.5, 2), mode="trilinear"), _LINEAR, const_inputs=(2,), fd_keep_dtype=(2,)),
    OpCase("Resize", "Resize_axes_attr", [_r(2, 3, 4, 5), None, _f32(2, 3)],
           _interp(scale_factor=(2, 3), mode="bilinear"), {**_LINEAR, "axes": [2, 3]}, const_inputs=(2,),
           fd_keep_dtype=(2,), opset=18),
    # sizes computed at run time: the rule cannot prove N and C unchanged and probes them too
    OpCase("Resize", "Resize_linear_runtime_sizes", [_r(2, 3, 4, 5), None, None, np.array([2, 3, 7, 9])],
           _interp(size=(7, 9), mode="bilinear"), _LINEAR, grad_inputs=(0,)),
    OpCase("Resize", "Resize_nearest_runtime_scales", [_r(2, 3, 4, 5), None, _f32(1, 1, 2, 3)],
           _interp(scale_factor=(2, 3), mode="nearest"), _NEAREST, grad_inputs=(0,), fd_keep_dtype=(2,)),
]
CASES += _RESIZE_CASES


def _depth_to_space_crd(x, b):
    return F.pixel_shuffle(x, b)


def _depth_to_space_dcr(x, b):
    n, c, h, w = x.shape
    y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    return y.reshape(n, c // (b * b), h * b, w * b)


def _space_to_depth(x, b):
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


CASES += [
    OpCase("DepthToSpace", "DepthToSpace_CRD", [_r(2, 8, 3, 4)], lambda x: _depth_to_space_crd(x, 2),
           {"blocksize": 2, "mode": "CRD"}),
    OpCase("DepthToSpace", "DepthToSpace_DCR", [_r(2, 18, 3, 2)], lambda x: _depth_to_space_dcr(x, 3),
           {"blocksize": 3, "mode": "DCR"}),
    OpCase("SpaceToDepth", "SpaceToDepth", [_r(2, 3, 4, 6)], lambda x: _space_to_depth(x, 2), {"blocksize": 2}),
]


# -- GridSample (NOTE [grid sample as torch]: the gradient is torch's kernel, so no FD check) -------------
def _grid(*shape: int) -> np.ndarray:
    return (_rng.random(shape) * 2.4 - 1.2).astype(np.float32)  # some samples outside [-1, 1]


_GRID_TORCH_MODE = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}
CASES += [
    OpCase("GridSample", f"GridSample_{mode}_{pad}_ac{ac}", [_r(2, 3, 7, 6), _grid(2, 5, 4, 2)],
           lambda x, g, m=mode, p=pad, a=ac: F.grid_sample(x, g, mode=_GRID_TORCH_MODE[m], padding_mode=p,
                                                            align_corners=bool(a)),
           {"mode": mode, "padding_mode": pad, "align_corners": ac}, fd_check=False,
           grad_inputs=(0,) if mode == "nearest" else None)
    for mode, pad, ac in [("linear", "zeros", 0), ("linear", "border", 1), ("linear", "reflection", 0),
                          ("cubic", "zeros", 1), ("cubic", "reflection", 0), ("nearest", "zeros", 0)]
]
CASES.append(OpCase("GridSample", "GridSample_3d_linear", [_r(1, 2, 4, 5, 3), _grid(1, 3, 2, 4, 3)],
                    lambda x, g: F.grid_sample(x, g, mode="bilinear", align_corners=False),
                    {"mode": "linear"}, fd_check=False))


def _affine_grid_ref(align: int):
    return lambda theta, size: F.affine_grid(theta, size.tolist(), align_corners=bool(align))


CASES += [
    OpCase("AffineGrid", f"AffineGrid_2d_ac{ac}", [_r(3, 2, 3), np.array([3, 4, 5, 6])], _affine_grid_ref(ac),
           {"align_corners": ac}, const_inputs=(1,), fd_check=False)
    for ac in (0, 1)
] + [OpCase("AffineGrid", "AffineGrid_3d", [_r(2, 3, 4), np.array([2, 1, 3, 4, 5])], _affine_grid_ref(0),
            const_inputs=(1,), fd_check=False)]
