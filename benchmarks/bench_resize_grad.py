"""The cost of Resize's gradient rule (NOTE [resize adjoint]): an ONNX file ``y = Resize(x + w)`` trained
through OnnxModule (forward + backward, ORT) against the same upsampling in eager torch, per size and
mode, interleaved in one process; prints a Markdown table of medians (and the forward alone, no_grad:
onnxruntime's cubic Resize kernel is slow on its own).

    python benchmarks/bench_resize_grad.py
    python benchmarks/bench_resize_grad.py --reps 30
"""

from __future__ import annotations  # noqa: I001  (ortmodule before torch: NOTE [threads])

import argparse
import statistics
import time

import ortmodule  # noqa: F401  (before torch: NOTE [threads])
import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from ortmodule import OnnxModule

# (N, C, H, W), output (H', W'), ONNX attributes, torch interpolate arguments
CASES = [
    ((8, 64, 32, 32), (64, 64), "nearest", dict(mode="nearest")),
    ((8, 64, 32, 32), (64, 64), "linear", dict(mode="bilinear", align_corners=False)),
    ((8, 32, 64, 64), (128, 128), "linear", dict(mode="bilinear", align_corners=False)),
    ((4, 21, 64, 64), (256, 256), "linear", dict(mode="bilinear", align_corners=False)),
    ((8, 64, 32, 32), (64, 64), "cubic", dict(mode="bicubic", align_corners=False)),
]
_ATTRS = {"nearest": dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
          "linear": dict(mode="linear", coordinate_transformation_mode="half_pixel"),
          "cubic": dict(mode="cubic", coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75)}


def _file(shape, out_hw, mode):
    n, c, h, w = shape
    weight = numpy_helper.from_array(np.zeros((1, c, h, w), np.float32), "w")
    sizes = numpy_helper.from_array(np.array([n, c, *out_hw], np.int64), "sizes")
    nodes = [helper.make_node("Add", ["x", "w"], ["h"]),
             helper.make_node("Resize", ["h", "", "", "sizes"], ["y"], **_ATTRS[mode])]
    graph = helper.make_graph(nodes, "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, c, *out_hw])], [weight, sizes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _row(shape, out_hw, mode: str, kw: dict, reps: int) -> str:
    om = OnnxModule(_file(shape, out_hw, mode))
    w = torch.zeros(1, *shape[1:], requires_grad=True)
    x = torch.randn(*shape)
    v = torch.randn(shape[0], shape[1], *out_hw)

    def ort_step():
        om.zero_grad(set_to_none=True)
        (om(x) * v).sum().backward()

    def eager_step():
        w.grad = None
        (torch.nn.functional.interpolate(x + w, size=out_hw, **kw) * v).sum().backward()

    for fn in (ort_step, eager_step, ort_step, eager_step):  # warm-up, then interleaved
        fn()
    ort_ms, eager_ms = [], []
    for _ in range(3):
        ort_ms.append(_median_ms(ort_step, reps))
        eager_ms.append(_median_ms(eager_step, reps))
    o, e = statistics.median(ort_ms), statistics.median(eager_ms)
    with torch.no_grad():
        fwd = _median_ms(lambda: om(x), reps)
    return f"| {list(shape)} -> {list(out_hw)} | {mode} | {e:.2f} | {o:.2f} | {fwd:.2f} | {e / o:.2f}x |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    rows = [_row(shape, out_hw, mode, kw, args.reps) for shape, out_hw, mode, kw in CASES]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fwd + bwd of y = Resize(x + w), "
          "median ms")
    print("| input -> output | mode | eager interpolate | OnnxModule Resize | of which ORT's forward | speedup |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
