"""ortmodule: train PyTorch models (and ONNX files) with ONNX Runtime.

Pipeline stages, in order:
  io         flatten inputs/outputs, the frozen InputSignature (cache key)
  export     torch module -> forward ONNX (training semantics kept; parameters are graph inputs)
  autodiff   forward ONNX -> gradient nodes, one registered rule per op
  partition  forward model (outputs + saved values) and backward model
  runtime    ORT sessions, zero-copy binding, compiled-entry cache
  function   the torch.autograd.Function seam
  module     ORTModule, the transparent wrapper
  verify     verification mode: the first call of each new graph checked against eager PyTorch
  onnx_module OnnxModule: train an .onnx file with the same engine
"""

import os as _os
import sys as _sys

# NOTE [threads] (runtime/session.py): torch's OpenMP workers spin-wait after every torch op (libgomp
# default: ~3 ms) and then compete with ONNX Runtime's workers for the cores (measured on 2 cores: an
# ORT MatMul between torch ops took 39 ms instead of 20 ms). Not spinning at all (PASSIVE) makes
# every parallel torch op between the runs (loss, AdamW) wake sleeping workers. A short spin
# (GOMP_SPINCOUNT=10000, ~0.1 ms) keeps them warm across a run of torch ops and idle during the ORT
# runs: MLP fwd+bwd 1.83 -> 1.58 ms against PASSIVE, CNN/BERT/GPT-2 unchanged within noise.
# libgomp reads these once, when torch is first imported, so this only takes effect when ortmodule
# is imported before torch; otherwise set GOMP_SPINCOUNT=10000 in the environment. Values the user
# set (GOMP_SPINCOUNT or OMP_WAIT_POLICY) are kept.
if "torch" not in _sys.modules and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(_os.environ):
    _os.environ["GOMP_SPINCOUNT"] = "10000"

from .errors import (  # noqa: E402
    DoubleBackwardError,
    ExportError,
    GradientRuleError,
    ORTModuleError,
    VerificationError,
)
from .explain import Explanation, explain  # noqa: E402
from .module import ORTModule, Stats  # noqa: E402
from .onnx_module import OnnxModule
from .options import DebugOptions, FallbackPolicy, VerifyTolerance  # noqa: E402

__all__ = [
    "DebugOptions",
    "DoubleBackwardError",
    "Explanation",
    "ExportError",
    "FallbackPolicy",
    "GradientRuleError",
    "OnnxModule",
    "ORTModule",
    "ORTModuleError",
    "Stats",
    "VerificationError",
    "VerifyTolerance",
    "explain",
]
__version__ = "0.1.0"
