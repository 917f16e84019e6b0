"""torch's OpenMP workers and ONNX Runtime's intra-op pool on the same cores.

# NOTE [omp pause]: after every parallel torch op, libgomp's workers spin-wait for the next one
# (GOMP_SPINCOUNT, default 300000 PAUSE iterations: several ms on this machine's Xeon). An ORT run
# that starts inside that window shares its cores with them: its workers get a core only when the
# scheduler takes it from a spinning OpenMP thread. Measured with torch imported first (so the
# GOMP_SPINCOUNT that ortmodule sets at import cannot apply), 2 threads, the ORT forward call right
# after the loss of the previous step: CNN b32 forward median 9.7 -> 6.0 ms (min 5.6 either way),
# GPT-2 59.5 -> 53.0 ms, BERT 160 -> 156 ms; MLP unchanged within noise. libgomp cannot be told to
# stop spinning once loaded, but OpenMP 5's ``omp_pause_resource_all`` releases the calling thread's
# pool: its workers leave at once, and the next parallel torch op starts new ones (~50 us for one
# worker). So before each run of a spinning session (``GraphRunner``) on CPU, the pool is paused. The
# segments between torch nodes do not spin (NOTE [segment threads]) and are not paused: the torch
# calls between them would start the workers again each time.
#
# Only the calling thread's pool is touched (libgomp keeps one per thread), an idle pool costs
# ~0.5 us to pause, and where torch does not use libgomp (another OpenMP runtime, a 1-thread torch,
# no ``omp_pause_resource_all``) or ``ORTMODULE_OMP_PAUSE=0`` this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

_PAUSE_SOFT = 1  # omp_pause_soft
_state: list = []  # [callable or None], resolved once


def _find_pause():
    if os.environ.get("ORTMODULE_OMP_PAUSE", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    # torch's own libgomp first (the wheel bundles one); a system libgomp otherwise
    for path in sorted(paths, key=lambda p: not p.startswith(torch_dir)):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


def omp_pause_function():
    """``omp_pause_resource_all`` of the libgomp torch uses, or None where there is none to call."""
    if not _state:
        _state.append(_find_pause())
    return _state[0]


def release_omp_workers() -> None:
    """Let this thread's OpenMP workers go before an ORT run (NOTE [omp pause])."""
    fn = omp_pause_function()
    if fn is not None:
        fn(_PAUSE_SOFT)
