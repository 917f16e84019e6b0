"""Gradient rules, one file per op family. Importing this package registers them all."""

from . import (  # noqa: F401
    activation,
    activation_extra,
    conv,
    elementwise,
    indexing,
    linalg,
    loss,
    norm,
    pool,
    recurrent,
    reduction,
    resample,
    shape,
    torch_node,
)
