"""One ORT session per graph, run on torch tensors without copies (DLPack + IOBinding)."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import torch
from onnxruntime.capi import _pybind_state as C
from torch.utils.dlpack import from_dlpack

from ..passes.precision import lower_precise
from .threads import release_omp_workers

_CPU_DEVICE = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


def make_session_options(
    intra_op_threads: int | None = None, optimization: str = "all", profile_prefix: str | None = None,
    spinning: bool = True,
) -> ort.SessionOptions:
    """Session options chosen once per session.

    # NOTE [threads]: torch and ORT share the cores. ORT's intra-op pool follows
    # ``torch.get_num_threads()``. Its workers spin between the parallel sections of one run (measured
    # here: without spinning a 2-thread MatMul ran at 1-thread speed, 27 vs 62 GFLOP/s) and stop
    # spinning when the run ends (``force_spinning_stop``), so torch's own work between runs (loss,
    # autograd, optimizer) gets the cores. torch's OpenMP workers, in turn, spin only briefly after a
    # torch op (GOMP_SPINCOUNT, which ortmodule sets when it is imported before torch:
    # ortmodule/__init__.py).
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = intra_op_threads or torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # (``spinning=False``: the segments between torch calls, NOTE [segment threads] in segments.py)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    so.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }[optimization]
    so.log_severity_level = 3
    if _shared_cpu_arena():
        # NOTE [one arena]: every ortmodule session allocates from one process-wide CPU arena instead
        # of an arena each, so the forward's and the backward's freed blocks serve each other; the
        # per-run memory pattern (one preallocated block per session) is off for the same reason.
        # Measured on GPT-2 (2 layers, b8, seq 64): peak RSS 1451 -> 1028 MB, step time unchanged.
        so.enable_mem_pattern = False
        so.add_session_config_entry("session.use_env_allocators", "1")
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


_ARENA_STATE: list[bool] = []


def _shared_cpu_arena() -> bool:
    """Register the process-wide CPU arena once (NOTE [one arena]); False where that fails."""
    if not _ARENA_STATE:
        try:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            # max memory 0 = unlimited; extend strategy 1 = grow by what is requested
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
            _ARENA_STATE.append(True)
        except Exception:  # e.g. already registered by the application: use per-session arenas
            _ARENA_STATE.append(False)
    return _ARENA_STATE[0]


def providers_for(device: torch.device) -> list:
    if device.type == "cuda":
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


# NOTE [node order]: onnxruntime orders a graph's nodes by a depth-first walk up from its leaf
# nodes, the last leaf first. The backward graph ends with one Identity per gradient output (in
# ``partition.py``), last parameter last, so the walk computes each parameter's gradient as soon as
# the chain reaches its layer. ORT's EliminateIdentity rule removes those Identity nodes; the leaves
# are then the producers in graph order and the last one is the embedding gradient, whose walk runs
# the whole data-gradient chain first and the weight gradients after it, keeping every layer's
# output gradients alive at once. Measured (bench_memory.py --model bert,gpt2 --batch 64, activation
# memory = peak RSS - RSS before the step): BERT level 0 1382 -> 1211 MB, level 1 875 -> 492 MB; GPT-2
# level 0 1860 MB, level 1 1753 MB (unchanged); step times equal within noise. A simulation of ORT's
# walk on BERT's backward graph agrees (live peak 146 vs 444 MB at level 0, 289 vs 657 MB at level 1);
# PRIORITY_BASED ``execution_order`` did not help (the optimized graph's new nodes get new indices).
# The first target's Identity is walked last, so its producer writes that output itself (no copy,
# ``partition._first_gradient_in_place``): BERT's 31 MB word-embedding gradient. A/B, same command,
# 3 runs each interleaved (AMD EPYC host): level 1 peak RSS 1276/1266/1291 -> 1244/1227/1236 MB,
# activations 418/378/403 -> 389/373/381 MB; level 0 within noise (949/980/972 -> 958/963/1003).
DISABLED_OPTIMIZERS = ["EliminateIdentity"]


def _spins(options: ort.SessionOptions | None) -> bool:
    """Whether a session made with ``options`` spins its intra-op workers (ORT's default: yes)."""
    if options is None:
        return True
    try:
        return options.get_session_config_entry("session.intra_op.allow_spinning") != "0"
    except Exception:  # not set: ORT's default
        return True


class GraphRunner:
    """Runs one ONNX model on torch tensors: inputs bound by storage, outputs handed back by DLPack."""

    def __init__(
        self,
        model: onnx.ModelProto,
        device: torch.device,
        options: ort.SessionOptions | None = None,
        stable_inputs: frozenset[str] = frozenset(),
    ) -> None:
        self.device = device
        # NOTE [bound parameters]: parameters and buffers keep their storage from step to step (the
        # optimizer updates them in place), so their OrtValues are made once and reused while the
        # tensor's data pointer, shape and dtype stay the same. A cached OrtValue holds the old
        # storage alive, so an equal data pointer means the same storage. Activations are never
        # cached: that would keep a step's tensors alive into the next.
        self._stable = stable_inputs
        self._bound: dict[str, tuple] = {}
        model = lower_precise(model)  # NOTE [precise sigmoid]
        self.session = ort.InferenceSession(
            model.SerializeToString(), options or make_session_options(), providers=providers_for(device),
            disabled_optimizers=DISABLED_OPTIMIZERS,
        )
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._sess = self.session._sess
        self._run_options = C.RunOptions()
        # NOTE [omp pause] (runtime/threads.py): a spinning CPU session runs with torch's OpenMP workers
        # released, not spinning beside its own
        self._release_omp = device.type == "cpu" and _spins(options)
        if device.type == "cuda":
            self._out_device = C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), device.index or 0)
        else:
            self._out_device = _CPU_DEVICE

    def run(self, feeds: dict[str, torch.Tensor], state: dict | None = None, keep_state: bool = False
            ) -> list[torch.Tensor]:
        """Run with ``feeds`` (by input name; extra names are ignored); outputs in model order.
        (``state``: the torch nodes' state, which a graph without them does not use.)"""
        binding = C.SessionIOBinding(self._sess)
        for name in self.input_names:
            t = feeds[name]
            if name in self._stable and t.is_contiguous():
                key = (t.data_ptr(), t.shape, t.dtype)
                hit = self._bound.get(name)
                if hit is None or hit[0] != key:
                    hit = (key, C.OrtValue.from_dlpack(t.detach().__dlpack__()))
                    self._bound[name] = hit
                binding.bind_ortvalue_input(name, hit[1])
                continue
            if not t.is_contiguous():
                t = t.contiguous()
            binding.bind_ortvalue_input(name, C.OrtValue.from_dlpack(t.detach().__dlpack__()))
        for name in self.output_names:
            binding.bind_output(name, self._out_device)
        if self._release_omp:
            release_omp_workers()
        self._sess.run_with_iobinding(binding, self._run_options)
        # NOTE [output conversion]: OrtValueVector.to_dlpacks converts every output in one call
        # (~0.5 us each); iterating the vector in Python copies each OrtValue wrapper (~8 us each,
        # 86 us per run on the MLP's backward).
        return binding.get_outputs().to_dlpacks(from_dlpack)
