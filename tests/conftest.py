"""Shared pytest setup: make the repository root importable (``ortmodule``, ``tests.rules``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture
def ort_only(monkeypatch):
    """Torch nodes off (NOTE [torch nodes]): an op without a rule or a custom Function falls back again,
    as the fallback paths these tests check need (under torch.export they would run in torch)."""
    monkeypatch.setenv("ORTMODULE_TORCH_NODES", "0")
