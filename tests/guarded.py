"""A model with the sanity checks users write in forward (tests/test_trace_traps.py, NOTE [value checks]).

Not a test module: pytest rewrites the ``assert`` statements of test modules into its own code, and
these must stay the plain Python asserts users write."""

from __future__ import annotations

import torch
from torch import nn


class Guarded(nn.Module):
    """Sanity checks users write in forward: asserts on tensors, torch._assert, a raise under an ``if``."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.lin, self.norm, self.out = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.1)
        self.branch = branch

    def forward(self, x):
        assert not torch.isnan(x).any(), "NaN in the input"
        if torch.isinf(x).any() or (x.abs() > 1e5).any():
            raise ValueError("inf or huge values in the input")
        torch._assert((x.abs() < 3e4).all(), "input beyond 3e4")
        assert (x > -1e4).all() and (x < 1e4).all(), "input out of range"
        z = self.norm(self.lin(x))
        if (z.abs() > 50).any():
            raise ValueError("an outlier after the BatchNorm")
        h = self.drop(torch.relu(z))
        assert torch.isfinite(h).all()
        if self.branch and (h > 3).any():  # a real branch: a value read, the graph cannot take both ways
            h = h.clamp(max=3)
        return self.out(h)
