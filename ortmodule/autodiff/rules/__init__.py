"""Gradient rules, one file per op family. Importing this package registers them all."""

from . import activation, conv, elementwise, linalg, loss, norm, pool, shape  # noqa: F401
