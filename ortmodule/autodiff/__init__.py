"""Autodiff: gradient graphs over ONNX, built from one registered rule per op."""

from .builder import GradientGraph, build_gradient, differentiable_values
from .registry import GradBuilder, register, register_nondifferentiable, registered_ops

__all__ = [
    "GradBuilder",
    "GradientGraph",
    "build_gradient",
    "differentiable_values",
    "register",
    "register_nondifferentiable",
    "registered_ops",
]
