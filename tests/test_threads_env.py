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


# -- NOTE [omp pause] (runtime/threads.py) ----------------------------------------------------------
def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _wait_gone(tids: set[str], timeout: float = 2.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not tids & _tasks():
            return True
        time.sleep(0.01)
    return False


def test_release_omp_workers_lets_torch_workers_go_and_torch_starts_them_again():
    import torch

    from ortmodule.runtime.threads import omp_pause_function, release_omp_workers

    if omp_pause_function() is None:
        pytest.skip("torch does not run on libgomp with omp_pause_resource_all here")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.arange(1 << 20, dtype=torch.float32)
        a.add_(1)  # a parallel op: the workers exist now
        release_omp_workers()
        base = _tasks()
        a.add_(1)
        workers = _tasks() - base
        assert workers, "a parallel torch op after the pause started no OpenMP worker"
        release_omp_workers()
        assert _wait_gone(workers), "the OpenMP workers did not leave after omp_pause_resource_all"
        a.add_(1)  # torch keeps working, on as many threads as before
        assert torch.get_num_threads() == 2
        assert torch.equal(a, torch.arange(1 << 20, dtype=torch.float32) + 3)
    finally:
        torch.set_num_threads(threads)


def test_only_spinning_cpu_sessions_release_the_workers(monkeypatch):
    import onnx
    import torch
    from onnx import TensorProto, helper

    from ortmodule.runtime import session as session_mod

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    calls = []
    monkeypatch.setattr(session_mod, "release_omp_workers", lambda: calls.append(1))
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    cpu = torch.device("cpu")
    spinning = session_mod.GraphRunner(model, cpu, session_mod.make_session_options())
    assert torch.equal(spinning.run({"x": x})[0], x.relu())
    assert calls == [1]
    segment = session_mod.GraphRunner(model, cpu, session_mod.make_session_options(spinning=False))
    assert torch.equal(segment.run({"x": x})[0], x.relu())
    assert calls == [1]


def test_omp_pause_can_be_switched_off():
    code = "from ortmodule.runtime.threads import omp_pause_function; print(omp_pause_function())"
    env = dict(os.environ, ORTMODULE_OMP_PAUSE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "None"
