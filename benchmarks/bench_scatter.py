"""Accumulating scatters at BERT / GPT-2 sizes: ScatterND(add) against the exact ScatterElements(add).

    python benchmarks/bench_scatter.py                  # 2 intra-op threads
    python benchmarks/bench_scatter.py --threads 1,2,4 --reps 9

Each case scatters N rows of width E into a [V, E] tensor, half of them onto row 0 (the
``token_type_embeddings`` pattern) and the rest at random, once onto zeros (an embedding gradient as
the Gather rule emits it) and once onto an accumulator input (a gradient Sum folded into the scatter,
NOTE [scatter into the sum] in ortmodule/passes/backward.py). Prints, per formulation, the median
time of a whole one-node-model run, the largest error against a float64 ``np.add.at`` and whether
``--reps`` runs gave bit-identical results (NOTE [exact scatters] in
ortmodule/autodiff/rules/indexing.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

CASES = [  # (name, V, E, N)
    ("BERT bench (b16 s128)", 30522, 256, 2048),
    ("BERT 8192 tokens", 30522, 256, 8192),
    ("GPT-2 bench (b8 s64)", 50257, 128, 512),
    ("GPT-2 8192 tokens", 50257, 128, 8192),
    ("8000 rows, 20000 upd", 8000, 16, 20000),
]


def _model(kind: str, onto: str, v: int, e: int, n: int) -> bytes:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    consts = [helper.make_node("Constant", [], ["shape"], value=helper.make_tensor("s", i64, [2], [v, e])),
              helper.make_node("Constant", [], ["col"], value=helper.make_tensor("c", i64, [2], [-1, 1]))]
    nodes = list(consts)
    if onto == "zeros":
        nodes.append(helper.make_node("ConstantOfShape", ["shape"], ["data"],
                                      value=helper.make_tensor("z", f, [1], [0.0])))
    data = "data" if onto == "zeros" else "acc"
    nodes.append(helper.make_node("Reshape", ["i", "col"], ["i2"]))
    if kind == "ScatterND":
        nodes.append(helper.make_node("ScatterND", [data, "i2", "u"], ["y"], reduction="add"))
    else:
        nodes += [helper.make_node("Shape", ["u"], ["us"]), helper.make_node("Expand", ["i2", "us"], ["ie"]),
                  helper.make_node("ScatterElements", [data, "ie", "u"], ["y"], axis=0, reduction="add")]
    inputs = [helper.make_tensor_value_info("i", i64, [n]), helper.make_tensor_value_info("u", f, [n, e])]
    if onto == "acc":
        inputs.append(helper.make_tensor_value_info("acc", f, [v, e]))
    graph = helper.make_graph(nodes, "scatter", inputs, [helper.make_tensor_value_info("y", f, [v, e])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| case | threads | onto | formulation | median ms | max abs err | bit-equal runs |")
    print("|---|---|---|---|---|---|---|")
    for name, v, e, n in CASES:
        idx = rng.integers(0, v, n)
        idx[: n // 2] = 0
        upd = rng.standard_normal((n, e)).astype(np.float32)
        acc = rng.standard_normal((v, e)).astype(np.float32)
        for threads in (int(t) for t in args.threads.split(",")):
            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
            so.log_severity_level = 3
            for onto in ("zeros", "acc"):
                ref = np.zeros((v, e)) if onto == "zeros" else acc.astype(np.float64)
                np.add.at(ref, idx, upd.astype(np.float64))
                feeds = {"i": idx, "u": upd} | ({"acc": acc} if onto == "acc" else {})
                for kind in ("ScatterND", "ScatterElements"):
                    sess = ort.InferenceSession(_model(kind, onto, v, e, n), so, providers=["CPUExecutionProvider"])
                    sess.run(None, feeds)
                    outs, times = [], []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        outs.append(sess.run(None, feeds)[0])
                        times.append(time.perf_counter() - t0)
                    err = max(float(np.abs(o - ref).max()) for o in outs)
                    same = all(np.array_equal(outs[0], o) for o in outs[1:])
                    print(f"| {name} | {threads} | {onto} | {kind} | {np.median(times) * 1e3:.2f} | {err:.3g} "
                          f"| {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
