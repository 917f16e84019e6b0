"""The OpInfo-style table format: one ``OpCase`` row per op (or op variant).

Each family keeps its rows in ``tests/rules/table_<family>.py`` as a module-level ``CASES`` list;
``test_rules.py`` collects every ``table_*.py``. A row becomes a one-node ONNX model whose gradient
graph (built by ortmodule) runs in onnxruntime and is compared with ``torch.autograd.grad`` of
``torch_fn``; a float64 finite-difference VJP check (onnx's reference evaluator) guards the rule
independently of torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class OpCase:
    op_type: str
    name: str  # unique row id, e.g. "Gemm_transB"
    inputs: Sequence[np.ndarray | None]  # sample inputs; None = omitted optional input
    torch_fn: Callable[..., Any] | None  # torch reference: fn(*torch inputs) -> tensor or tuple
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)
    domain: str = ""
    num_outputs: int = 1
    # Which inputs get gradients checked; default: every floating-point input not in const_inputs.
    grad_inputs: Sequence[int] | None = None
    # Inputs baked into the model as initializers (shapes, axes, indices the op needs statically).
    const_inputs: Sequence[int] = ()
    # Outputs that get an upstream gradient; default: every floating-point output.
    grad_outputs: Sequence[int] | None = None
    rtol: float = 1e-4
    atol: float = 1e-5
    fd_check: bool = True  # float64 finite-difference VJP check via onnx.reference
    fd_eps: float = 1e-6
    fd_rtol: float = 1e-5
    fd_keep_dtype: Sequence[int] = ()  # float inputs the FD check leaves as they are (Resize's scales)
    opset: int = 20
    xfail: str | None = None  # expected failure, with the reason
