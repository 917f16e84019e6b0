"""ortmodule: train PyTorch models (and ONNX files) with ONNX Runtime.

Pipeline stages, in order:
  io         flatten inputs/outputs, the frozen InputSignature (cache key)
  export     torch module -> forward ONNX (training semantics kept; parameters are graph inputs)
  autodiff   forward ONNX -> gradient nodes, one registered rule per op
  partition  forward model (outputs + saved values) and backward model
  runtime    ORT sessions, zero-copy binding, compiled-entry cache
  function   the torch.autograd.Function seam
  module     ORTModule, the transparent wrapper
  onnx_module OnnxModule: train an .onnx file with the same engine
"""

from .errors import ExportError, GradientRuleError, ORTModuleError
from .explain import Explanation, explain
from .module import ORTModule, Stats
from .onnx_module import OnnxModule
from .options import DebugOptions, FallbackPolicy

__all__ = [
    "DebugOptions",
    "Explanation",
    "ExportError",
    "FallbackPolicy",
    "GradientRuleError",
    "OnnxModule",
    "ORTModule",
    "ORTModuleError",
    "Stats",
    "explain",
]
__version__ = "0.1.0"
