"""Training-step benchmark: eager PyTorch vs torch.compile (inductor) vs ORTModule, side by side.

    python benchmarks/bench_train.py                      # all built-in models, all modes
    python benchmarks/bench_train.py --quick              # CI smoke: tiny shapes, few reps
    python benchmarks/bench_train.py --model mlp --modes eager,ortmodule
    python benchmarks/bench_train.py --model my_module:factory   # a model of your own (see below)

Every (model, mode) pair runs in its own worker process (this script with ``--worker``), so its peak
RSS is its own. The workers of one model stay alive together and the coordinator measures them
round-robin, one repetition each in turn (the order rotating), so that machine noise hits every mode
alike. Each repetition times ``inner`` forward+loss+backward steps (forward and backward timed
separately) and ``inner`` full steps with AdamW (zero_grad + forward + loss + backward + step).

Outputs: a Markdown table on stdout, ``<out-dir>/latest.json``, ``<out-dir>/speedup.png`` and, for a
default full run (every built-in model and mode), ``benchmarks/RESULTS.md``.

Plugin models: ``--model pkg.module:factory`` or ``--model path/to/file.py:factory``. ``factory()``
(or ``factory(quick=True)`` under ``--quick`` when it takes a ``quick`` argument) returns
``(model, make_batch, loss_fn)``: ``make_batch()`` returns ``(inputs, target)`` where ``inputs`` is a
tensor (``model(x)``), a tuple (``model(*inputs)``) or a dict (``model(**inputs)``), and
``loss_fn(output, target)`` returns the scalar loss. The batch size (for samples/s) is the first
dimension of the first input tensor.

A mode that fails (an exception, or no answer within ``--timeout`` seconds, e.g. a slow
torch.compile) is recorded with its error in the table and the JSON; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUILTIN_MODELS = ("mlp", "cnn", "bert", "gpt2")
ALL_MODES = ("eager", "compile", "ortmodule")
# ortmodule: the default front end (torch.export), torch imported first as users do;
# ortmodule-ortfirst: the same with ortmodule imported before torch (NOTE [threads]: it sets
# GOMP_SPINCOUNT before torch loads); ortmodule-torchscript: the legacy TorchScript front end.
ORT_MODES = ("ortmodule", "ortmodule-ortfirst", "ortmodule-torchscript")
MARK = "@@BENCH "  # prefix of the protocol lines a worker writes

# Repetitions: warmup steps, then `reps` rounds of `inner` timed steps of each kind, per model.
FULL_PLAN = {
    "mlp": dict(warmup=10, reps=7, inner=20),
    "cnn": dict(warmup=3, reps=7, inner=5),
    "bert": dict(warmup=2, reps=5, inner=2),
    "gpt2": dict(warmup=3, reps=7, inner=5),
    "plugin": dict(warmup=3, reps=5, inner=3),
}
QUICK_PLAN = dict(warmup=1, reps=2, inner=2)


# ================================================================================================
# Models (built inside the worker; torch is imported there only)
# ================================================================================================
def _mlp(quick: bool):
    import torch
    from torch import nn

    d_in, hidden, batch = (64, 32, 8) if quick else (784, 512, 64)
    model = nn.Sequential(
        nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, d_in, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return model, lambda: (x, y), nn.functional.cross_entropy


def _cnn(quick: bool):
    import torch
    from torch import nn

    c1, c2, hw, batch = (4, 8, 8, 4) if quick else (32, 64, 32, 32)

    def block(cin, cout):
        conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        return [conv, nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    model = nn.Sequential(
        *block(3, c1), *block(c1, c2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c2, 10)
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, hw, hw, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return model, lambda: (x, y), nn.functional.cross_entropy


def _hf_quiet():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _bert(quick: bool):
    import torch
    import transformers

    _hf_quiet()
    if quick:
        dims = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64)
        seq, batch = 16, 2
    else:
        dims = dict(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=1024)
        seq, batch = 128, 16
    cfg = transformers.BertConfig(max_position_embeddings=max(seq, 128), num_labels=2, **dims)
    model = transformers.BertForSequenceClassification(cfg)  # dropout: the config default (0.1)
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }
    return model, lambda: (inputs, None), lambda out, _: out.loss


def _gpt2(quick: bool):
    import torch
    import transformers

    _hf_quiet()
    if quick:
        dims = dict(vocab_size=100, n_embd=32, n_layer=1, n_head=2)
        seq, batch = 16, 2
    else:
        dims = dict(n_embd=128, n_layer=2, n_head=4)  # vocab: the GPT-2 default (50257)
        seq, batch = 64, 8
    cfg = transformers.GPT2Config(n_positions=max(seq, 64), **dims)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return model, lambda: ({"input_ids": ids, "labels": ids}, None), lambda out, _: out.loss


BUILDERS = {"mlp": _mlp, "cnn": _cnn, "bert": _bert, "gpt2": _gpt2}


def _load_plugin(spec: str):
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or os.sep in target:
        path = Path(target).resolve()
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        mod_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(target)
    return getattr(module, attr)


def build_model(name: str, quick: bool):
    if name in BUILDERS:
        return BUILDERS[name](quick)
    factory = _load_plugin(name)
    if quick and "quick" in inspect.signature(factory).parameters:
        return factory(quick=True)
    return factory()


def is_plugin(name: str) -> bool:
    return name not in BUILDERS


# ================================================================================================
# Worker: one (model, mode) in its own process, driven by commands on stdin
# ================================================================================================
class _OrtRunTimer:
    """Accumulates the wall time spent inside ORT session runs (GraphRunner.run, every segment of a
    graph with torch nodes) and, apart, inside torch nodes (NOTE [torch nodes])."""

    total = 0.0
    torch_total = 0.0

    @classmethod
    def install(cls):
        from ortmodule.runtime import segments, session

        original = session.GraphRunner.run

        def timed_run(self, feeds, *args):
            t0 = time.perf_counter()
            try:
                return original(self, feeds, *args)
            finally:
                cls.total += time.perf_counter() - t0

        session.GraphRunner.run = timed_run
        original_torch = segments.SegmentedRunner._run_torch

        def timed_torch(self, *args):
            t0 = time.perf_counter()
            try:
                return original_torch(self, *args)
            finally:
                cls.torch_total += time.perf_counter() - t0

        segments.SegmentedRunner._run_torch = timed_torch


def _batch_size(inputs) -> int:
    import torch

    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0])
    values = inputs.values() if isinstance(inputs, dict) else inputs
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 1


def _call(model, inputs):
    import torch

    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    return model(*inputs)


class Worker:
    def __init__(self, model_name: str, mode: str, quick: bool, threads: int) -> None:
        import psutil
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.proc = psutil.Process()
        self.peak_rss = self.proc.memory_info().rss
        self.mode = mode
        torch.manual_seed(0)
        model, self.make_batch, self.loss_fn = build_model(model_name, quick)
        model.train()
        self.batch_size = _batch_size(self.make_batch()[0])
        self.n_params = sum(p.numel() for p in model.parameters())
        if mode == "eager":
            self.model = model
        elif mode == "compile":
            self.model = torch.compile(model)
        elif mode in ORT_MODES:
            from ortmodule import ORTModule

            _OrtRunTimer.install()
            self.model = ORTModule(model, frontend="torchscript" if mode == "ortmodule-torchscript" else None)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self._sample_rss()

    def _sample_rss(self) -> None:
        self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)

    def fwd_bwd(self) -> dict:
        """One forward+loss+backward, each part timed; gradients reset (untimed) first."""
        self.opt.zero_grad(set_to_none=True)
        inputs, target = self.make_batch()
        ort0, torch0 = _OrtRunTimer.total, _OrtRunTimer.torch_total
        t0 = time.perf_counter()
        out = _call(self.model, inputs)
        t1 = time.perf_counter()
        ort1 = _OrtRunTimer.total
        loss = self.loss_fn(out, target)
        t2 = time.perf_counter()
        self._sample_rss()
        t2b = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        ort2 = _OrtRunTimer.total
        self._sample_rss()
        return {
            "fwd": t1 - t0, "loss": t2 - t1, "bwd": t3 - t2b, "total": (t3 - t2b) + (t2 - t0),
            "ort_fwd": ort1 - ort0, "ort_bwd": ort2 - ort1, "torch_nodes": _OrtRunTimer.torch_total - torch0,
        }

    def full_step(self) -> float:
        inputs, target = self.make_batch()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(_call(self.model, inputs), target)
        loss.backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        self._sample_rss()
        return dt

    def first(self) -> dict:
        parts = self.fwd_bwd()
        t0 = time.perf_counter()
        self.opt.step()
        first_opt = time.perf_counter() - t0
        out = {"first_call_s": parts["total"], "first_fwd_s": parts["fwd"], "first_bwd_s": parts["bwd"],
               "first_optimizer_step_s": first_opt}
        stats = getattr(self.model, "stats", None)
        if dataclasses.is_dataclass(stats):
            out["ort_stats"] = dataclasses.asdict(stats)
        return out

    def warmup(self, n: int) -> dict:
        for _ in range(n):
            self.full_step()
        return {}

    def rep(self, inner: int) -> dict:
        parts = [self.fwd_bwd() for _ in range(inner)]
        full = [self.full_step() for _ in range(inner)]
        return {"fwd_bwd": parts, "full": full}

    def finish(self) -> dict:
        import resource

        import torch

        self._sample_rss()
        out = {
            "peak_rss_mb": self.peak_rss / 2**20,
            "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "batch_size": self.batch_size, "n_params": self.n_params,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        }
        stats = getattr(self.model, "stats", None)
        if dataclasses.is_dataclass(stats):
            out["ort_stats"] = dataclasses.asdict(stats)
        if self.mode in ORT_MODES:
            import onnxruntime

            out["onnxruntime"] = onnxruntime.__version__
        return out


def worker_main(model_name: str, mode: str, quick: bool, threads: int) -> None:
    # The protocol goes to the original stdout; everything else anyone prints (including C code such
    # as the inductor's compiler) goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(MARK + json.dumps(obj) + "\n")
        proto.flush()

    worker = None
    try:
        t0 = time.perf_counter()
        worker = Worker(model_name, mode, quick, threads)
        send({"ok": True, "setup_s": time.perf_counter() - t0})
    except BaseException as e:  # noqa: BLE001 - reported to the coordinator
        send({"ok": False, "error": _error_text(e), "traceback": traceback.format_exc()})
        return
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "first":
                result = worker.first()
            elif op == "warmup":
                result = worker.warmup(cmd["n"])
            elif op == "rep":
                result = worker.rep(cmd["inner"])
            elif op == "finish":
                send({"ok": True, **worker.finish()})
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            send({"ok": True, **result})
        except BaseException as e:  # noqa: BLE001 - reported to the coordinator
            send({"ok": False, "error": _error_text(e), "traceback": traceback.format_exc()})
            return


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


# ================================================================================================
# Coordinator
# ================================================================================================
class WorkerHandle:
    """A worker process; replies are read by a thread so that waits can time out."""

    def __init__(self, model: str, mode: str, args, log_path: Path) -> None:
        self.model, self.mode = model, mode
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, mode,
               "--threads", str(args.threads)]
        if args.quick:
            cmd.append("--quick")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if mode == "ortmodule-ortfirst" and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & env.keys():
            # What `import ortmodule` before `import torch` does (NOTE [threads] in
            # ortmodule/__init__.py); every other mode keeps torch's default, as `import torch` first does.
            env["GOMP_SPINCOUNT"] = "10000"
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1, env=env)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.error: str | None = None
        self.result: dict = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.replies.put(json.loads(line[len(MARK):]))
        self.replies.put(None)

    def request(self, cmd: dict | None, timeout: float, phase: str) -> dict | None:
        """Send ``cmd`` (None: only wait for the next reply); on failure record the error, return None."""
        if self.error is not None:
            return None
        try:
            if cmd is not None:
                self.proc.stdin.write(json.dumps(cmd) + "\n")
                self.proc.stdin.flush()
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            self.fail(f"timed out after {timeout:.0f} s ({phase})")
            return None
        except (BrokenPipeError, OSError) as e:
            reply = None
            self.error = f"worker died ({phase}): {e}"
        if reply is None:
            if self.error is None:
                self.proc.wait(timeout=10)
                self.error = f"worker exited with code {self.proc.returncode} ({phase}); " + self._log_tail()
            self.close()
            return None
        if not reply.get("ok"):
            self.error = f"{reply.get('error')} ({phase})"
            self.result["traceback"] = reply.get("traceback")
            self.close()
            return None
        return reply

    def _log_tail(self, n: int = 600) -> str:
        self.log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    def fail(self, message: str) -> None:
        self.error = message
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _median(xs):
    return statistics.median(xs) if xs else None


def bench_model(model: str, modes: list[str], args, log_dir: Path) -> dict:
    plan = dict(QUICK_PLAN) if args.quick else dict(FULL_PLAN["plugin" if is_plugin(model) else model])
    for k in ("warmup", "reps", "inner"):
        if getattr(args, k) is not None:
            plan[k] = getattr(args, k)
    safe = "".join(c if c.isalnum() else "_" for c in model)
    handles = {m: WorkerHandle(model, m, args, log_dir / f"{safe}-{m}.log") for m in modes}
    # Setup (imports, model construction) in parallel; the timed phases below run one worker at a time.
    for h in handles.values():
        reply = h.request(None, args.timeout, "setup")
        if reply:
            h.result["setup_s"] = reply["setup_s"]
    for m, h in handles.items():
        _log(f"  {model}/{m}: first call")
        reply = h.request({"op": "first"}, args.timeout, "first call")
        if reply:
            h.result.update({k: v for k, v in reply.items() if k != "ok"})
    for h in handles.values():
        h.request({"op": "warmup", "n": plan["warmup"]}, args.timeout, "warmup")
    samples = {m: {"fwd_bwd": [], "full": []} for m in modes}
    for r in range(plan["reps"]):
        order = modes[r % len(modes):] + modes[: r % len(modes)]  # rotate, so no mode always goes first
        for m in order:
            reply = handles[m].request({"op": "rep", "inner": plan["inner"]}, args.timeout, f"rep {r}")
            if reply:
                samples[m]["fwd_bwd"] += reply["fwd_bwd"]
                samples[m]["full"] += reply["full"]
        _log(f"  {model}: rep {r + 1}/{plan['reps']} done")
    results = {}
    for m, h in handles.items():
        reply = h.request({"op": "finish"}, args.timeout, "finish")
        if reply:
            h.result.update({k: v for k, v in reply.items() if k != "ok"})
        h.close()
        results[m] = summarize(h, samples[m])
    eager = results.get("eager", {})
    for res in results.values():
        for key, out in (("full_median_ms", "speedup_full"), ("fwd_bwd_median_ms", "speedup_fwd_bwd")):
            base, mine = eager.get(key), res.get(key)
            res[out] = base / mine if base and mine else None
    return {"plan": plan, "modes": results}


def summarize(h: WorkerHandle, s: dict) -> dict:
    res = dict(h.result)
    res["error"] = h.error
    res["log"] = str(h.log_path)
    if h.error is not None or not s["full"]:
        return res
    fb = s["fwd_bwd"]
    ms = lambda xs: [1e3 * x for x in xs]
    total = ms([p["total"] for p in fb])
    full = ms(s["full"])
    res.update({
        "fwd_bwd_median_ms": _median(total), "fwd_bwd_min_ms": min(total),
        "full_median_ms": _median(full), "full_min_ms": min(full),
        "fwd_median_ms": _median(ms([p["fwd"] for p in fb])),
        "loss_median_ms": _median(ms([p["loss"] for p in fb])),
        "bwd_median_ms": _median(ms([p["bwd"] for p in fb])),
        "samples_per_s": res.get("batch_size", 0) / (_median(full) / 1e3),
        "n_fwd_bwd": len(total), "n_full": len(full),
    })
    if h.mode in ORT_MODES:
        ort_f = _median(ms([p["ort_fwd"] for p in fb]))
        ort_b = _median(ms([p["ort_bwd"] for p in fb]))
        res["ort_breakdown_ms"] = {
            "forward_run": ort_f, "backward_run": ort_b,
            "torch_nodes": _median(ms([p.get("torch_nodes", 0.0) for p in fb])),
            "torch_overhead": _median(ms([p["total"] - p["ort_fwd"] - p["ort_bwd"] - p.get("torch_nodes", 0.0)
                                          for p in fb])),
            "forward_wall": res["fwd_median_ms"], "backward_wall": res["bwd_median_ms"],
        }
        stats = res.get("ort_stats") or {}
        res["first_call_breakdown_s"] = {
            k: stats.get(k) for k in ("export_s", "gradient_build_s", "session_create_s")
        }
    return res


def _cpu_model() -> str | None:
    """The CPU's model name (Linux): results differ a lot between hosts of the same VM size."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def machine_info(threads: int, results: dict) -> dict:
    import psutil

    info = {
        "platform": platform.platform(), "python": platform.python_version(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpu_logical": psutil.cpu_count(), "cpu_physical": psutil.cpu_count(logical=False),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg": [round(x, 2) for x in os.getloadavg()], "torch_threads": threads,
    }
    for model in results.values():
        for res in model["modes"].values():
            for k in ("torch", "onnxruntime"):
                if k in res:
                    info.setdefault(k, res[k])
            if "torch_threads" in res:
                info["torch_threads"] = res["torch_threads"]
    return info


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(results: dict) -> str:
    lines = []
    head = ("| mode | first call s | fwd+bwd median ms | fwd+bwd min ms | full step median ms | samples/s "
            "| speedup vs eager (full / fwd+bwd) | peak RSS MB |")
    for model, data in results.items():
        res_m = data["modes"]
        any_res = next(iter(res_m.values()), {})
        desc = f"batch {any_res.get('batch_size', '?')}, {_fmt(any_res.get('n_params'), ',')} params" \
            if any_res.get("n_params") else ""
        p = data["plan"]
        lines += [f"### {model}" + (f" ({desc})" if desc else ""), "",
                  f"{p['reps']} reps × {p['inner']} steps of each kind, after {p['warmup']} warmup steps.",
                  "",
                  head, "|" + "---|" * 8]
        for mode, r in res_m.items():
            if r.get("error"):
                err = r["error"].replace("|", "\\|").replace("\n", " ")
                first = _fmt(r.get("first_call_s"), ".2f")
                rss = _fmt(r.get("peak_rss_mb"), ".0f")
                lines.append(f"| {mode} | {first} | **failed**: {err} | | | | | {rss} |")
                continue
            speed = f"{_fmt(r.get('speedup_full'), '.2f')}× / {_fmt(r.get('speedup_fwd_bwd'), '.2f')}×"
            lines.append(
                f"| {mode} | {_fmt(r.get('first_call_s'), '.2f')} "
                f"| {_fmt(r.get('fwd_bwd_median_ms'), '.2f')} "
                f"| {_fmt(r.get('fwd_bwd_min_ms'), '.2f')} | {_fmt(r.get('full_median_ms'), '.2f')} "
                f"| {_fmt(r.get('samples_per_s'), '.0f')} | {speed} | {_fmt(r.get('peak_rss_mb'), '.0f')} |"
            )
        for ort_mode in ORT_MODES:
            _ort_lines(lines, ort_mode, res_m.get(ort_mode, {}))
        lines.append("")
    return "\n".join(lines)


def _ort_lines(lines: list[str], mode: str, ort: dict) -> None:
    """The first-call breakdown and steady-state session times of one ORTModule mode."""
    if not (ort.get("ort_breakdown_ms") or ort.get("first_call_breakdown_s")):
        return
    lines.append("")
    fc = ort.get("first_call_breakdown_s") or {}
    if fc:
        lines.append(
            f"ORTModule ({mode}) first call: export {_fmt(fc.get('export_s'), '.2f')} s, gradient build "
            f"{_fmt(fc.get('gradient_build_s'), '.2f')} s, session creation "
            f"{_fmt(fc.get('session_create_s'), '.2f')} s."
        )
    b = ort.get("ort_breakdown_ms")
    if b:
        lines.append(
            f"ORTModule ({mode}) steady fwd+bwd (medians of separate quantities, so they need not add up): "
            f"ORT forward session run {b['forward_run']:.2f} ms, ORT backward session run "
            f"{b['backward_run']:.2f} ms (every ORT segment), torch calls inside the graphs (torch nodes and "
            f"ATen backward kernels) {b.get('torch_nodes', 0.0):.2f} ms "
            f"({(ort.get('ort_stats') or {}).get('torch_nodes', 0)} torch nodes in the forward); the rest of a step "
            "outside these "
            f"{b['torch_overhead']:.2f} ms (the loss, Python, binding, autograd). Wall time of the "
            f"forward call {b['forward_wall']:.2f} ms and of loss.backward() {b['backward_wall']:.2f} ms, "
            "each including its session run."
        )


def plot(results: dict, path: Path, quick: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    modes = [m for m in ALL_MODES if any(m in results[x]["modes"] for x in models)]
    modes += sorted({m for x in models for m in results[x]["modes"]} - set(modes))
    # Two panels: forward+loss+backward (what the optimisation targets are stated on) and the full step.
    panels = (("speedup_fwd_bwd", "forward + loss + backward"), ("speedup_full", "full step (with AdamW)"))
    fig, axes = plt.subplots(1, 2, figsize=(2 * max(6.0, 1.8 + 1.6 * len(models)), 4), sharey=True)
    width = 0.8 / max(1, len(modes))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, mode in enumerate(modes):
            vals = [results[x]["modes"].get(mode, {}).get(key) or 0.0 for x in models]
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(models))]
            bars = ax.bar(xs, vals, width, label=mode)
            for bar, v, x in zip(bars, vals, models, strict=True):
                failed = results[x]["modes"].get(mode, {}).get("error")
                label = "failed" if failed else (f"{v:.2f}×" if v else "")
                ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
        ax.set_title(f"{title}: speedup vs eager")
    axes[0].set_ylabel("eager median / mode median (higher is better)")
    axes[0].legend()
    if quick:
        fig.suptitle("--quick smoke run: tiny shapes, few repetitions; not a speed measurement", color="red")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def results_md(table: str, info: dict, command: str) -> str:
    machine = (
        f"{info['platform']}, Python {info['python']}, {info['processor']}, "
        f"{info['cpu_physical']} physical / {info['cpu_logical']} logical CPUs, {info['memory_gb']} GiB RAM; "
        f"torch {info.get('torch', '?')} with {info['torch_threads']} threads, "
        f"onnxruntime {info.get('onnxruntime', '?')}; load average at the end {info['load_avg']}"
    )
    return "\n".join([
        "# Training-step benchmark results", "",
        f"Command: `{command}`", "",
        f"Machine: {machine}.", "",
        "Times are per training step (fp32, CPU). *fwd+bwd* is forward + loss + `loss.backward()`; "
        "*full step* adds `zero_grad` and `AdamW.step()`. *First call* is the first forward+loss+backward "
        "(ORTModule: export + gradient build + session creation; torch.compile: compilation). Speedups are "
        "eager's median over the mode's median. Peak RSS is each mode's own worker process (psutil). "
        "Modes were measured interleaved, round-robin, in one run, on a shared VM: numbers move by "
        "10% or more from run to run.", "",
        table,
    ])


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=None,
                    help=f"built-in ({', '.join(BUILTIN_MODELS)}, comma-separated) or module:factory; "
                         "repeatable (default: all built-ins)")
    ap.add_argument("--modes", default=",".join(ALL_MODES),
                    help="comma-separated subset of " + ",".join(ALL_MODES + ORT_MODES[1:]))
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few reps (CI smoke; no speed claims)")
    ap.add_argument("--threads", type=int, default=None, help="torch/ORT threads (default: physical cores)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds a worker may take per phase (setup, first call, one rep) before it is "
                         "recorded as failed (default 600, --quick 120)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--inner", type=int, default=None, help="timed steps of each kind per rep")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    ap.add_argument("--results-md", type=Path, default=None,
                    help="write the table here (default: benchmarks/RESULTS.md for the default full "
                         "run of every built-in model and mode; none otherwise)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.threads is None:
        import psutil

        args.threads = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if args.worker:
        worker_main(args.worker[0], args.worker[1], args.quick, args.threads)
        return 0
    if args.timeout is None:
        args.timeout = 120.0 if args.quick else 600.0

    models: list[str] = []
    for spec in args.model or [",".join(BUILTIN_MODELS)]:
        models += [s for s in spec.split(",") if s] if ":" not in spec else [spec]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ALL_MODES + ORT_MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {ALL_MODES + ORT_MODES[1:]}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = args.out_dir / "logs"
    log_dir.mkdir(exist_ok=True)

    t_start = time.perf_counter()
    results = {}
    for model in models:
        _log(f"{model}: {', '.join(modes)}")
        results[model] = bench_model(model, modes, args, log_dir)
    info = machine_info(args.threads, results)
    command = "python benchmarks/bench_train.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    table = markdown(results)
    payload = {"command": command, "quick": args.quick, "modes": modes, "machine": info,
               "wall_s": time.perf_counter() - t_start, "models": results}
    (args.out_dir / "latest.json").write_text(json.dumps(payload, indent=2))
    if not args.no_plot:
        try:
            plot(results, args.out_dir / "speedup.png", quick=args.quick)
        except ImportError as e:
            _log(f"no chart: {e} (pip install -e '.[bench]')")
    # Only the default full run (every built-in model, every mode, default plan) replaces the
    # committed table; partial runs write it only where --results-md says.
    default_run = not (args.quick or args.model or args.warmup or args.reps or args.inner) and modes == list(ALL_MODES)
    md_path = args.results_md or (HERE / "RESULTS.md" if default_run else None)
    if md_path is not None:
        md_path.write_text(results_md(table, info, command) + "\n")
    print(table)
    _log(f"wrote {args.out_dir / 'latest.json'} in {payload['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
