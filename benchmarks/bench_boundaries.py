"""Per-boundary overhead of torch nodes (NOTE [segments]): one graph of ``--layers`` x (MatMul + Relu)
on [rows, width], run whole in ORT and split by k torch nodes that do no work (``aten::alias``), so
the difference is what a boundary costs: one more ORT session run, the tensor handed to torch and
back (DLPack), the Python step. Prints a table.

    python benchmarks/bench_boundaries.py --rows 2048 --width 256 --layers 24
"""

# ruff: noqa: I001  (ortmodule is imported before torch: NOTE [threads])
from __future__ import annotations

import argparse
import statistics
import sys
import time

import ortmodule  # noqa: F401  (before torch: NOTE [threads])
import onnx
import torch
from onnx import helper

from ortmodule.runtime.segments import SegmentedRunner
from ortmodule.runtime.session import GraphRunner
from ortmodule.runtime.torch_nodes import ATEN_OP, TORCH_DOMAIN, Arg, encode_args


def build(layers: int, width: int, every: int | None) -> onnx.ModelProto:
    nodes, inits = [], []
    x = "x"
    for i in range(layers):
        inits.append(helper.make_tensor(f"w{i}", onnx.TensorProto.FLOAT, [width, width],
                                        (torch.randn(width, width) / width**0.5).flatten().tolist()))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        x = f"r{i}"
        if every and (i + 1) % every == 0 and i + 1 < layers:
            node = helper.make_node(ATEN_OP, [x], [f"t{i}"], name=f"alias{i}", domain=TORCH_DOMAIN,
                                    op="aten::alias.default", args=encode_args([Arg(0)]))
            node.attribute.append(helper.make_attribute("outputs", [0]))
            nodes.append(node)
            x = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", 1, ["n", width])],
                              [helper.make_tensor_value_info(x, 1, ["n", width])], inits)
    graph.value_info.extend(helper.make_tensor_value_info(f"t{i}", 1, ["n", width]) for i in range(layers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(TORCH_DOMAIN, 1)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.width)
    cpu = torch.device("cpu")
    runners = {}
    for every in [None, 12, 6, 3, 1]:
        model = build(args.layers, args.width, every)
        runner = SegmentedRunner(model, cpu) if every else GraphRunner(model, cpu)
        boundaries = 0 if every is None else (args.layers - 1) // every
        runners[boundaries] = runner
    times: dict[int, list[float]] = {k: [] for k in runners}
    for _ in range(args.reps):
        for k, runner in runners.items():
            t0 = time.perf_counter()
            runner.run({"x": x})
            times[k].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times[0])
    print(f"| torch nodes (boundaries) | run median ms | min ms | overhead per boundary us |  ({args.layers} x "
          f"MatMul+Relu on [{args.rows}, {args.width}])")
    print("|---|---|---|---|")
    for k, ts in times.items():
        med = statistics.median(ts)
        per = "" if k == 0 else f"{(med - base) / k * 1e3:.0f}"
        print(f"| {k} | {med:.2f} | {min(ts):.2f} | {per} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
