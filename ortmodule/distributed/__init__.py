"""Distributed training helpers: DDP communication hooks (Adasum).

``DDP(ORTModule(model))`` needs nothing from this package: the wrapper's parameters are the wrapped
module's, and their gradients reach them through ordinary torch autograd, where DDP's reducer hooks
fire. What lives here is optional: :func:`adasum_hook`, an adaptive-summation gradient reduction.
"""

from .adasum import AdasumState, adasum_hook, adasum_pair, adasum_reduce

__all__ = ["AdasumState", "adasum_hook", "adasum_pair", "adasum_reduce"]
