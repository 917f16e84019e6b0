"""The persistent compile cache (NOTE [persistent cache], ortmodule/runtime/disk_cache.py).

Each test builds graphs into a fresh folder, then wraps a NEW model (or starts a new process) on
the same folder and checks what was loaded and that the results match eager PyTorch. The ways an
entry could be silently wrong get their own tests: a changed attribute, tensor constant, method or
helper function of the model, a corrupt or mismatched entry, another signature or grad mask.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule.runtime import disk_cache

from .helpers import TORCH_EXPORT, assert_close

ROOT = Path(__file__).resolve().parent.parent
FRONTEND = "export" if TORCH_EXPORT else "torchscript"


class Scaled(nn.Module):
    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = scale
        self.offset = torch.arange(8.0)  # a plain tensor attribute: a constant of the graph

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale + self.offset


def _wrap(model, folder, **kw):
    return ORTModule(model, cache_dir=folder, fallback="raise", **kw)


def _check_step(model: nn.Module, folder, x: torch.Tensor, **kw) -> ORTModule:
    """One forward/backward through ORTModule on ``folder`` against eager on a copy."""
    import copy

    eager = copy.deepcopy(model)
    om = _wrap(model, folder, **kw)
    out = om(x)
    out.square().sum().backward()
    ref = eager(x)
    ref.square().sum().backward()
    assert_close(out, ref, 1e-5, "output")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name}.grad should be None"
            continue
        assert_close(p.grad, q.grad, 1e-5, f"{name}.grad")
    return om


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.pkl"))


def test_new_model_on_a_warm_folder_loads_both_graphs(tmp_path):
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    cold = _check_step(Scaled(), tmp_path, x)
    assert (cold.stats.exports, cold.stats.disk_cache_stores, cold.stats.disk_cache_hits) == (1, 2, 0)
    assert len(_entries(tmp_path)) == 2
    torch.manual_seed(0)
    warm = _check_step(Scaled(), tmp_path, x)
    assert (warm.stats.exports, warm.stats.gradient_builds, warm.stats.disk_cache_hits) == (0, 0, 2)
    # Another batch size: the warm graph's shape guards serve it, or it has its own entry.
    _check_step(Scaled(), tmp_path, torch.randn(6, 8))


def test_env_var_sets_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "env"))
    om = ORTModule(Scaled())
    om(torch.randn(2, 8)).sum().backward()
    assert om.options.cache_dir == str(tmp_path / "env")
    assert len(_entries(tmp_path / "env")) == 2


@pytest.mark.parametrize("change", ["attribute", "tensor constant", "method"])
def test_a_changed_module_is_built_again(tmp_path, change):
    x = torch.randn(4, 8)
    _check_step(Scaled(), tmp_path, x)
    model = Scaled()
    if change == "attribute":
        model.scale = 3.0
    elif change == "tensor constant":
        model.offset = torch.arange(8.0) * 2
    else:
        model.__class__ = type("Scaled", (Scaled,), {"forward": lambda self, x: torch.sigmoid(self.fc(x)),
                                                      "__module__": Scaled.__module__})
    om = _check_step(model, tmp_path, x)
    assert om.stats.exports == 1, f"a {change} change must not load the old graph"


_HELPER_SOURCE = '''
import torch
from torch import nn


def act(x):
    return torch.{act}(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return act(self.fc(x))
'''


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_changed_helper_function_in_the_models_file_makes_the_entry_stale(tmp_path, caplog):
    """The class's own code is the same, only a function it calls changed (same file size): the
    entry's recorded source hashes catch it."""
    src = tmp_path / "cached_net_helper.py"
    folder = tmp_path / "cache"
    x = torch.randn(4, 8)
    try:
        src.write_text(textwrap.dedent(_HELPER_SOURCE.format(act="relu")))
        torch.manual_seed(0)
        _check_step(_import(src, "cached_net_helper").Net(), folder, x)
        src.write_text(textwrap.dedent(_HELPER_SOURCE.format(act="tanh")))
        torch.manual_seed(0)
        with caplog.at_level(logging.INFO, logger="ortmodule"):
            om = _check_step(_import(src, "cached_net_helper").Net(), folder, x,
                             debug=DebugOptions(log_level="INFO"))
        assert om.stats.exports == 1
        assert any("changed since entry" in r.message and src.name in r.message for r in caplog.records)
    finally:
        sys.modules.pop("cached_net_helper", None)


def test_corrupt_and_mismatched_entries_are_ignored_with_a_warning(tmp_path, caplog):
    x = torch.randn(4, 8)
    _check_step(Scaled(), tmp_path, x)
    export_entry = next(p for p in _entries(tmp_path) if p.name.endswith(".export.pkl"))
    training_entry = next(p for p in _entries(tmp_path) if p.name.endswith(".training.pkl"))
    export_entry.write_bytes(b"not a pickle")
    record = pickle.loads(training_entry.read_bytes())
    record["key"] = "0" * 64  # an entry under another entry's name
    training_entry.write_bytes(pickle.dumps(record))
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        om = _check_step(Scaled(), tmp_path, x)
    assert (om.stats.exports, om.stats.gradient_builds, om.stats.disk_cache_hits) == (1, 1, 0)
    messages = " ".join(r.message for r in caplog.records)
    assert "unreadable entry" in messages and "does not match" in messages
    # Both were written again, whole: the next model loads them.
    again = _check_step(Scaled(), tmp_path, x)
    assert again.stats.disk_cache_hits == 2 and again.stats.exports == 0


def test_signature_and_grad_mask_have_their_own_entries(tmp_path):
    x = torch.randn(4, 8)
    _check_step(Scaled(), tmp_path, x)
    n = len(_entries(tmp_path))
    frozen = Scaled()
    frozen.fc.bias.requires_grad_(False)
    om = _check_step(frozen, tmp_path, x)
    assert frozen.fc.bias.grad is None
    assert om.stats.disk_cache_hits == 1 and om.stats.gradient_builds == 1  # same forward, new backward
    assert len(_entries(tmp_path)) == n + 1
    om = _check_step(Scaled().double(), tmp_path, x.double())
    assert om.stats.exports == 1 and om.stats.disk_cache_hits == 0
    for frontend in {"export", "torchscript"} - {FRONTEND}:
        om = _check_step(Scaled(), tmp_path, x, frontend=frontend)
        assert om.stats.exports == 1, "the front end is part of the key"


def test_an_unwritable_folder_is_no_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    om = _check_step(Scaled(), blocker / "sub", torch.randn(4, 8))  # a folder under a file
    assert om.stats.disk_cache_stores == 0 and om.stats.exports == 1


@pytest.mark.processes  # starts Python processes: the CI step of its own
def test_fingerprint_is_the_same_in_every_process():
    """str hashes are randomised per process: a fingerprint that depended on them would never hit."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import transformers as t; "
            "from ortmodule.runtime.disk_cache import module_fingerprint as f, _digest as d; "
            "t.utils.logging.set_verbosity_error(); "
            "print(d(f(t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2)))))")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
               for seed in ("1", "2")}
    assert len(digests) == 1, digests


def _worker(folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "cache_worker.py"), str(folder),
                             "--frontend", FRONTEND], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.processes  # starts Python processes: the CI step of its own
def test_fresh_processes_load_what_the_first_built_and_train_alike(tmp_path):
    """A cold process, then two started at once on the warm folder: the warm ones export nothing,
    and every process trains bit-identically to the cold one and to eager within rounding."""
    cold = _result(_worker(tmp_path))
    warm = [_result(p) for p in [_worker(tmp_path), _worker(tmp_path)]]
    for name in ("bert", "mlp"):
        c = cold[name]
        assert c["exports"] == 1 and c["disk_cache_stores"] == 2 and c["fallbacks"] == 0
        for w in warm:
            r = w[name]
            assert (r["exports"], r["gradient_builds"], r["disk_cache_hits"]) == (0, 0, 2), r
            assert r["losses"] == c["losses"] and r["digest"] == c["digest"], name
        for a, b in zip(c["losses"], c["eager_losses"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b))
        assert c["max_param_diff"] < 1e-4


@pytest.mark.processes  # starts Python processes: the CI step of its own
def test_processes_starting_at_once_build_each_entry_once(tmp_path):
    """NOTE [persistent cache]: the entry's lock makes the second process wait and load."""
    results = [_result(p) for p in [_worker(tmp_path), _worker(tmp_path)]]
    for name in ("bert", "mlp"):
        assert sum(r[name]["exports"] for r in results) == 1, [r[name] for r in results]
        assert results[0][name]["digest"] == results[1][name]["digest"]
    assert not list(tmp_path.glob(".tmp-*")), "no temporary file is left behind"


def test_source_files_cover_the_models_package():
    import transformers

    model = transformers.BertModel(transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                           num_attention_heads=2, intermediate_size=32))
    files = disk_cache.source_files(model)
    assert any(p.endswith(os.path.join("bert", "modeling_bert.py")) for p in files)
    assert not any(f"{os.sep}torch{os.sep}" in p for p in files), "torch is covered by its version"
