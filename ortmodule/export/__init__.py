"""Export: torch module -> forward ONNX graph, with parameters and buffers as graph inputs.

Two front ends with one result type (:class:`ExportedModel`), chosen by ``Options.frontend``:

- :func:`export_program` (default): ``torch.export`` + onnxscript's torchlib, symbolic shapes with
  guards (``program.py``, NOTE [torch.export front end]);
- :func:`export_module`: the legacy TorchScript tracer (``torchscript.py``), an opt-in while it
  passes the same suite. torch.onnx's own ExportedProgram conversion is not used as is: it writes
  train-mode BatchNorm in inference mode and drops mutated buffers (measured, torch 2.13).
"""

from .program import export_program
from .torchscript import ExportedModel, export_module

__all__ = ["ExportedModel", "export_module", "export_program"]
