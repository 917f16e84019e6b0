"""NOTE [threads]: importing ortmodule before torch sets a short OpenMP spin, and only then."""

import os
import subprocess
import sys

import pytest

CODE = "import os, {first}; import torch, ortmodule; print(os.environ.get('GOMP_SPINCOUNT'))"


@pytest.mark.parametrize(("first", "extra_env", "expected"), [
    ("ortmodule", {}, "10000"),
    ("torch", {}, "None"),  # too late: libgomp has read its environment
    ("ortmodule", {"OMP_WAIT_POLICY": "PASSIVE"}, "None"),  # the user's choice stands
    ("ortmodule", {"GOMP_SPINCOUNT": "5"}, "5"),
])
def test_openmp_spin_default(first, extra_env, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", CODE.format(first=first)], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == expected
