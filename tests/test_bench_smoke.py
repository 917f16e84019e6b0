"""Smoke test of benchmarks/bench_train.py --quick: it runs and writes the expected JSON (no speed checks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # each run starts its own processes: a CI step of its own

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_train.py"


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not present")
def test_bench_quick_mlp_eager_and_ortmodule(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--model", "mlp", "--modes", "eager,ortmodule",
           "--out-dir", str(tmp_path), "--no-plot"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| eager |" in proc.stdout and "| ortmodule |" in proc.stdout

    data = json.loads((tmp_path / "latest.json").read_text())
    assert {"command", "quick", "modes", "machine", "models"} <= data.keys()
    assert data["quick"] is True and data["modes"] == ["eager", "ortmodule"]
    assert {"platform", "cpu_logical", "torch_threads", "torch"} <= data["machine"].keys()
    modes = data["models"]["mlp"]["modes"]
    assert set(modes) == {"eager", "ortmodule"}
    common = {"first_call_s", "fwd_bwd_median_ms", "fwd_bwd_min_ms", "full_median_ms", "full_min_ms",
              "samples_per_s", "speedup_full", "speedup_fwd_bwd", "peak_rss_mb", "error"}
    for mode, res in modes.items():
        assert common <= res.keys(), (mode, sorted(res))
        assert res["error"] is None, res["error"]
        assert res["fwd_bwd_median_ms"] > 0 and res["peak_rss_mb"] > 0
    ort = modes["ortmodule"]
    assert {"forward_run", "backward_run", "torch_overhead"} <= ort["ort_breakdown_ms"].keys()
    assert {"export_s", "gradient_build_s", "session_create_s"} <= ort["first_call_breakdown_s"].keys()


PROFILE = ROOT / "benchmarks" / "profile_ort.py"


@pytest.mark.skipif(not PROFILE.exists(), reason="benchmarks/ not present")
def test_profile_ort_quick_cnn():
    cmd = [sys.executable, str(PROFILE), "cnn", "--quick", "--steps", "2", "--warmup", "1", "--top", "5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "## cnn: forward session" in proc.stdout and "## cnn: backward session" in proc.stdout
    assert "| Conv |" in proc.stdout, proc.stdout  # the forward's convolutions are in the op-type table


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not present")
def test_bench_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_train
    finally:
        sys.path.remove(str(SCRIPT.parent))
    mode = lambda full, fb, error=None: {"speedup_full": full, "speedup_fwd_bwd": fb, "error": error}
    results = {
        "mlp": {"modes": {"eager": mode(1.0, 1.0), "ortmodule": mode(1.1, 0.9)}},
        "cnn": {"modes": {"eager": mode(1.0, 1.0), "ortmodule": mode(None, None, error="boom")}},
    }
    out = tmp_path / "speedup.png"
    bench_train.plot(results, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


EVAL = ROOT / "benchmarks" / "bench_eval.py"


@pytest.mark.skipif(not EVAL.exists(), reason="benchmarks/ not present")
def test_bench_eval_quick():
    cmd = [sys.executable, str(EVAL), "--quick", "--model", "mlp", "--model", "cnn"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| mlp |", "| cnn |"))]
    assert len(rows) == 2, proc.stdout
    for row in rows:  # the largest output difference against eager is tiny
        assert float(row.strip("| ").split("|")[-1]) < 1e-4, row


RSS = ROOT / "benchmarks" / "rss_imports.py"


@pytest.mark.skipif(not RSS.exists(), reason="benchmarks/ not present")
def test_rss_imports_table():
    proc = subprocess.run([sys.executable, str(RSS)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "MB" not in line]
    assert [r.split("|")[1].strip().split(" (")[0] for r in rows] == [
        "python", "import torch", "eager MLP step", "import onnxruntime", "import onnx", "import onnx_ir",
        "import ortmodule", "ORTModule MLP step"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)


MEMORY = ROOT / "benchmarks" / "bench_memory.py"


@pytest.mark.skipif(not MEMORY.exists(), reason="benchmarks/ not present")
def test_bench_memory_prints_a_row_per_level_with_equal_losses():
    pytest.importorskip("transformers")
    cmd = [sys.executable, str(MEMORY), "--model", "gpt2", "--batch", "8", "--steps", "2", "--modes", "level0,level1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[2].strip(): line.split("|") for line in proc.stdout.splitlines() if "| gpt2 |" in line}
    assert set(rows) == {"level0", "level1"}, proc.stdout
    assert rows["level0"][8] == rows["level1"][8], "level 1 must train like level 0 (losses)"


ZOO = ROOT / "benchmarks" / "bench_zoo.py"


@pytest.mark.skipif(not ZOO.exists(), reason="benchmarks/ not present")
def test_bench_zoo_quick(tmp_path):
    out = tmp_path / "zoo.json"
    cmd = [sys.executable, str(ZOO), "--quick", "bert-cls", "llama-lm", "--json", str(out)]
    # the benchmark measures the default front end (the TorchScript one falls back on llama's aten::diff)
    env = {k: v for k, v in os.environ.items() if k != "ORTMODULE_FRONTEND"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| bert-cls |" in proc.stdout and "| llama-lm |" in proc.stdout and "geo-mean" in proc.stdout
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["bert-cls", "llama-lm"]
    for r in rows:
        assert r["fallbacks"] == 0, r["fallback_reason"]
        assert r["eager_fwd_bwd_median_ms"] > 0 and r["ortmodule_full_median_ms"] > 0
