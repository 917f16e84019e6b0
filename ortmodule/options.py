"""All of ortmodule's settings in one place: debug options, fallback policy, cache size, env vars.

Environment variables (read when an ORTModule is created; constructor arguments win):

========================== =================================================================
``ORTMODULE_FALLBACK``     ``fallback`` (default): run the module eagerly, with one warning,
                           when export or gradient building fails; ``raise``: raise instead.
``ORTMODULE_SAVE_ONNX``    a folder: save every forward/backward/inference graph built there.
``ORTMODULE_LOG_LEVEL``    ``DEBUG``, ``INFO``, ``WARNING`` (default), ``ERROR``.
``ORTMODULE_PROFILE``      a file prefix: enable ONNX Runtime's profiler for every session.
``ORTMODULE_CACHE_SIZE``   how many compiled entries (input signatures) to keep; default 8.
``ORTMODULE_VERIFY``       ``1``: verification mode (``verify=True``): the first call of every newly
                           compiled graph also runs the module eagerly (same inputs, RNG state,
                           autocast/grad mode; module state restored) and compares outputs,
                           buffer updates and gradients; a mismatch raises ``VerificationError``.
                           ``0`` (default): off. See ``ortmodule/verify.py``.
``ORTMODULE_VERIFY_RTOL``  the float32 relative tolerance of verification (default 1e-4);
                           ``verify_tolerance=VerifyTolerance(...)`` sets all of them.
``ORTMODULE_FRONTEND``     how the forward is captured (``frontend=``): ``export`` (default:
                           torch.export + onnxscript's torchlib, symbolic shapes with guards;
                           ``ortmodule/export/program.py``) or ``torchscript`` (the legacy tracer,
                           which torch deprecates; kept as an opt-in while both pass the suite).
``ORTMODULE_MEMORY_OPT_LEVEL`` ``memory_opt_level=``: ``0`` (default) saves what the backward reads
                           except cheap recomputable values; ``1`` recomputes each repeated
                           block (transformer layer) in the backward from its input. NOTE
                           [recompute] in ``ortmodule/recompute.py``.
``ORTMODULE_MEMORY_OPT_CONFIG`` ``memory_opt_config=``: a plan list, ``"Erf:-1,Softmax:2"``: saved
                           values produced by these op types (first N; -1 all) are recomputed.
``ORTMODULE_CACHE_DIR``    a folder: the persistent compile cache (``cache_dir=``). Exported
                           forward graphs and built training graphs are kept there, so a new
                           process (a restart, the other ranks) skips the export; see NOTE
                           [persistent cache] in ``ortmodule/runtime/disk_cache.py``. Unset
                           (default): nothing is written.
``ORTMODULE_OMP_PAUSE``    ``1`` (default): before each ORT run on CPU, torch's idle OpenMP
                           workers are released instead of left spinning beside ORT's
                           (NOTE [omp pause] in ``ortmodule/runtime/threads.py``); ``0``: off.
``ORTMODULE_ATEN_KERNELS`` which gradient rules use torch's fused kernels (``1`` all, ``0`` none,
                           or a list such as ``Conv,MaxPool``): ``autodiff/rules/aten.py``.
========================== =================================================================
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os

from .recompute import RecomputePolicy

logger = logging.getLogger("ortmodule")

FRONTENDS = ("export", "torchscript")  # the first is the default


class FallbackPolicy(str, enum.Enum):
    FALLBACK = "fallback"  # run eagerly with one warning naming the cause
    RAISE = "raise"  # strict: raise the error


@dataclasses.dataclass
class DebugOptions:
    """Observability switches; see the module docstring for the matching environment variables."""

    save_onnx_dir: str | None = None
    log_level: str = "WARNING"
    profile_prefix: str | None = None

    @classmethod
    def from_env(cls) -> DebugOptions:
        return cls(
            save_onnx_dir=os.environ.get("ORTMODULE_SAVE_ONNX") or None,
            log_level=os.environ.get("ORTMODULE_LOG_LEVEL", "WARNING").upper(),
            profile_prefix=os.environ.get("ORTMODULE_PROFILE") or None,
        )


@dataclasses.dataclass(frozen=True)
class VerifyTolerance:
    """Tolerances of verification mode (``verify=True``), as in tests/helpers.py ``assert_close``:
    a float tensor matches when its relative norm error ``||ort - eager|| / ||eager||`` is at most
    ``rtol``, or every element is within ``atol`` (tensors that are ~0, e.g. rounding noise of a
    gradient that is exactly 0 in exact arithmetic). ``half_*`` apply under fp16/bf16 autocast and
    to half-precision tensors. Integer and bool tensors must be equal."""

    rtol: float = 1e-4
    atol: float = 1e-6
    half_rtol: float = 1e-2
    half_atol: float = 1e-3


@dataclasses.dataclass
class Options:
    """Resolved settings of one ORTModule."""

    fallback: FallbackPolicy = FallbackPolicy.FALLBACK
    cache_size: int = 8
    debug: DebugOptions = dataclasses.field(default_factory=DebugOptions)
    verify: bool = False
    verify_tolerance: VerifyTolerance = dataclasses.field(default_factory=VerifyTolerance)
    frontend: str = FRONTENDS[0]
    cache_dir: str | None = None  # NOTE [persistent cache]
    recompute: RecomputePolicy = dataclasses.field(default_factory=RecomputePolicy)  # NOTE [recompute]
    # NOTE [torch nodes]: custom Functions and ops without a rule run in torch inside the graph;
    # ORTMODULE_TORCH_NODES=0 makes them fall back instead (a graph that must be ORT only)
    torch_nodes: bool = True

    @classmethod
    def resolve(
        cls,
        fallback: str | FallbackPolicy | None = None,
        cache_size: int | None = None,
        debug: DebugOptions | None = None,
        verify: bool | None = None,
        verify_tolerance: VerifyTolerance | None = None,
        frontend: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        memory_opt_level: int | None = None,
        memory_opt_config: str | None = None,
    ) -> Options:
        env_fallback = os.environ.get("ORTMODULE_FALLBACK")
        policy = fallback or env_fallback or FallbackPolicy.FALLBACK
        try:
            policy = FallbackPolicy(policy)
        except ValueError:
            raise ValueError(
                f"unknown fallback policy {policy!r}; use one of {[p.value for p in FallbackPolicy]}"
            ) from None
        size = cache_size if cache_size is not None else int(os.environ.get("ORTMODULE_CACHE_SIZE", "8"))
        if size < 1:
            raise ValueError(f"cache_size must be >= 1, got {size}")
        debug = debug or DebugOptions.from_env()
        level = getattr(logging, debug.log_level.upper(), None)
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {debug.log_level!r}")
        logger.setLevel(level)
        if verify is None:
            env_verify = os.environ.get("ORTMODULE_VERIFY", "0").strip().lower()
            if env_verify not in ("", "0", "1", "false", "true", "off", "on"):
                raise ValueError(f"ORTMODULE_VERIFY={env_verify!r}: use 1 (on) or 0 (off)")
            verify = env_verify in ("1", "true", "on")
        if verify_tolerance is None:
            rtol = os.environ.get("ORTMODULE_VERIFY_RTOL")
            verify_tolerance = VerifyTolerance(rtol=float(rtol)) if rtol else VerifyTolerance()
        frontend = (frontend or os.environ.get("ORTMODULE_FRONTEND") or FRONTENDS[0]).strip().lower()
        if frontend not in FRONTENDS:
            raise ValueError(f"unknown frontend {frontend!r}; use one of {list(FRONTENDS)}")
        env_nodes = os.environ.get("ORTMODULE_TORCH_NODES", "1").strip().lower()
        if env_nodes not in ("", "0", "1", "false", "true", "off", "on"):
            raise ValueError(f"ORTMODULE_TORCH_NODES={env_nodes!r}: use 1 (on) or 0 (off)")
        folder = cache_dir if cache_dir is not None else os.environ.get("ORTMODULE_CACHE_DIR") or None
        return cls(fallback=policy, cache_size=size, debug=debug, verify=bool(verify),
                   verify_tolerance=verify_tolerance, frontend=frontend,
                   cache_dir=None if folder is None else os.fspath(folder),
                   recompute=RecomputePolicy.resolve(memory_opt_level, memory_opt_config),
                   torch_nodes=env_nodes not in ("0", "false", "off"))
