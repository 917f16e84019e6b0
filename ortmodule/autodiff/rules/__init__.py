"""Gradient rules, one file per op family. Importing this package registers them all."""

from . import activation, elementwise, linalg, loss, shape  # noqa: F401
