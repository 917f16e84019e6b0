"""All of ortmodule's settings in one place: debug options, fallback policy, cache size, env vars.

Environment variables (read when an ORTModule is created; constructor arguments win):

========================== =================================================================
``ORTMODULE_FALLBACK``     ``fallback`` (default): run the module eagerly, with one warning,
                           when export or gradient building fails; ``raise``: raise instead.
``ORTMODULE_SAVE_ONNX``    a folder: save every forward/backward/inference graph built there.
``ORTMODULE_LOG_LEVEL``    ``DEBUG``, ``INFO``, ``WARNING`` (default), ``ERROR``.
``ORTMODULE_PROFILE``      a file prefix: enable ONNX Runtime's profiler for every session.
``ORTMODULE_CACHE_SIZE``   how many compiled entries (input signatures) to keep; default 8.
========================== =================================================================
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os

logger = logging.getLogger("ortmodule")


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


@dataclasses.dataclass
class Options:
    """Resolved settings of one ORTModule."""

    fallback: FallbackPolicy = FallbackPolicy.FALLBACK
    cache_size: int = 8
    debug: DebugOptions = dataclasses.field(default_factory=DebugOptions)

    @classmethod
    def resolve(
        cls,
        fallback: str | FallbackPolicy | None = None,
        cache_size: int | None = None,
        debug: DebugOptions | None = None,
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
        return cls(fallback=policy, cache_size=size, debug=debug)
