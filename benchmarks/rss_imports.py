"""Where ORTModule's extra resident memory comes from on a small model: RSS after each import and step.

    python benchmarks/rss_imports.py

Prints a Markdown table of the process RSS (psutil) after importing torch, one eager MLP step
(784-512-512-10, batch 64), each of ORTModule's dependencies, and one ORTModule step of the same
model. Run it in a fresh process: the numbers are cumulative.
"""

from __future__ import annotations

import sys

import psutil


def main() -> None:
    proc = psutil.Process()
    rows: list[tuple[str, float]] = []

    def mark(what: str) -> None:
        rows.append((what, proc.memory_info().rss / 2**20))

    mark("python")
    import torch
    from torch import nn

    mark("import torch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.randn(64, 784)
    model(x).sum().backward()
    mark("eager MLP step")
    import onnxruntime  # noqa: F401

    mark("import onnxruntime")
    import onnx  # noqa: F401

    mark("import onnx")
    import onnx_ir  # noqa: F401

    mark(f"import onnx_ir (sympy loaded: {'sympy' in sys.modules})")
    import ortmodule

    mark("import ortmodule")
    ortmodule.ORTModule(model)(x).sum().backward()
    mark("ORTModule MLP step")

    print("| after | RSS MB | added MB |")
    print("|---|---|---|")
    previous = 0.0
    for what, mb in rows:
        print(f"| {what} | {mb:.0f} | {mb - previous:+.0f} |")
        previous = mb


if __name__ == "__main__":
    main()
