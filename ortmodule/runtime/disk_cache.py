"""The persistent compile cache: exported forward graphs and built training graphs on disk.

# NOTE [persistent cache]: ``ORTMODULE_CACHE_DIR`` / ``ORTModule(cache_dir=...)`` keeps what a first
# call builds, so that a restart, or every rank but one under torchrun, skips the export (seconds)
# and the gradient build. Correct or loud decides the design: an entry is loaded only when
# everything that decided its graph is the same, else it is rebuilt.
#
# - The KEY (the file name) holds what is known before the export: the versions of Python, torch,
#   onnxruntime, onnx, onnxscript and ortmodule (and a hash of ortmodule's own source), the front
#   end, the graph options, the default dtype, the input signature (structure, constants, dtypes,
#   shapes, devices, autocast, train/eval flags, the parameter/buffer layout with shapes and dtypes),
#   and the module: per submodule its class (the code of every method of every class in its MRO
#   outside torch), its attributes (atomic values; configs and other objects walked a few levels
#   deep; functions by their code; plain tensors by their bytes) and its hooks' code.
# - The SOURCES (stored in the entry, checked on load) are the content hashes of the source files
#   the graph came from: every loaded file of the packages the module's classes (and hooks) live in,
#   ``__main__``'s file, and every file torch.export's stack traces name. A helper function in the
#   model's file or package that changed, even one the classes only call, makes the entry stale.
# - Not seen: environment variables or other global state the forward reads, and code of a third
#   package that produced no graph node of its own and whose version did not change. Clear the
#   folder after changing those (the reference ORTModule's cache saw less: its key was the module's
#   name and input shapes).
# - A training-graph entry is keyed by the hash of the forward graph it was built from (plus the
#   requires_grad mask), so it can never pair with another forward.
#
# Entries are pickles: the folder must be as trusted as a ``torch.load(weights_only=False)`` file.
# Writes are atomic (temporary file + ``os.replace``); while one process builds an entry it holds
# the entry's lock file (``fcntl.flock``), and others wanting the same entry wait for it and load
# it (after ``LOCK_WAIT_S`` they build it too). An entry that cannot be read, or whose recorded key
# or format differs, is ignored with a warning; a stale one with an info line; neither is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import os
import pickle
import platform
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils import _pytree as pytree

from ..guards import _SKIP, global_values
from ..io import register_container
from ..options import logger

FORMAT = 1
LOCK_WAIT_S = 600.0
_ATOMIC = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)
_OWN_PACKAGES = frozenset({"torch", "ortmodule", "onnx", "onnxruntime", "onnxscript", "onnx_ir", "builtins",
                           "typing", "functools", "collections", "abc", "enum", "dataclasses"})
# Attributes that differ between processes and decide nothing: transformers' GenerationConfig keeps
# ``hash(self)``, which follows the per-process str hash seed.
_VOLATILE = frozenset({"_original_object_hash"})
_MAX_DEPTH = 4
_MAX_ITEMS = 4096


def _digest(obj: Any) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def versions() -> tuple:
    """Everything of the installation that changes what the compiler builds."""
    import onnx
    import onnxruntime

    import ortmodule

    own = Path(ortmodule.__file__).parent
    source = hashlib.sha256()
    for path in sorted(own.rglob("*.py")):
        source.update(str(path.relative_to(own)).encode())
        source.update(path.read_bytes())
    return (FORMAT, sys.version_info[:3], platform.machine(), torch.__version__, onnxruntime.__version__,
            onnx.__version__, _dist_version("onnxscript"), _dist_version("onnx-ir"), ortmodule.__version__,
            source.hexdigest())


# -- fingerprints ------------------------------------------------------------------------------
def _const_fp(c: Any) -> Any:
    if isinstance(c, types.CodeType):
        return _code_fp(c)
    if isinstance(c, frozenset):  # ``x in {"a", "b"}``: its repr's order follows the per-process str hash
        return ("frozenset", tuple(sorted(repr(x) for x in c)))
    if isinstance(c, tuple):
        return tuple(_const_fp(x) for x in c)
    return repr(c)


def _code_fp(code: types.CodeType) -> tuple:
    consts = tuple(_const_fp(c) for c in code.co_consts)
    return (code.co_qualname, code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars,
            code.co_argcount, code.co_kwonlyargcount, code.co_flags)


def _callable_fp(f: Any, depth: int, seen: set[int]) -> Any:
    if isinstance(f, (staticmethod, classmethod)):
        return (type(f).__name__, _callable_fp(f.__func__, depth, seen))
    if isinstance(f, property):
        return ("property", *(_callable_fp(g, depth, seen) for g in (f.fget, f.fset, f.fdel)))
    if isinstance(f, types.MethodType):
        return ("method", _callable_fp(f.__func__, depth, seen), _type_name(type(f.__self__)))
    if isinstance(f, functools.partial):
        return ("partial", _callable_fp(f.func, depth, seen), _value_fp(f.args, depth + 1, seen),
                _value_fp(f.keywords, depth + 1, seen))
    if isinstance(f, types.FunctionType):
        cells = tuple(_value_fp(c.cell_contents, depth + 1, seen) if _cell_full(c) else None
                      for c in (f.__closure__ or ()))
        return ("function", f.__module__, _code_fp(f.__code__), _value_fp(f.__defaults__, depth + 1, seen),
                _value_fp(f.__kwdefaults__, depth + 1, seen), cells)
    return ("callable", _type_name(type(f)), getattr(f, "__qualname__", None))


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _value_fp(v: Any, depth: int, seen: set[int]) -> Any:
    """A deterministic (process-independent) fingerprint of an attribute value."""
    if isinstance(v, enum.Enum):
        return ("enum", _type_name(type(v)), repr(v.value))
    if isinstance(v, _ATOMIC):
        return (type(v).__name__, repr(v))
    if isinstance(v, nn.Module):
        return ("module", _type_name(type(v)))  # its own entry when it is a submodule
    if isinstance(v, torch.Tensor):
        if v.grad_fn is not None:
            return None  # a result kept on the module, not read by forward (NOTE [module guards])
        try:
            data = v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            content = hashlib.sha256(data).hexdigest()
        except Exception:
            content = None
        return ("tensor", repr(v.dtype), tuple(v.shape), content)
    if isinstance(v, type):
        return ("type", _type_name(v))
    if isinstance(v, types.ModuleType):
        return ("pymodule", v.__name__)
    if depth >= _MAX_DEPTH or id(v) in seen:
        return ("deep", _type_name(type(v)))
    seen = seen | {id(v)}
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, len(v), tuple(_value_fp(x, depth + 1, seen) for x in v[:_MAX_ITEMS]))
    if isinstance(v, (set, frozenset)):
        return (type(v).__name__, tuple(sorted(repr(_value_fp(x, depth + 1, seen)) for x in v)))
    if isinstance(v, dict):
        items = sorted(((repr(k), _value_fp(x, depth + 1, seen)) for k, x in v.items()), key=lambda kv: kv[0])
        return ("dict", len(v), tuple(items[:_MAX_ITEMS]))
    if callable(v) and not hasattr(v, "__dict__") or isinstance(v, (types.FunctionType, types.MethodType,
                                                                     functools.partial)):
        return _callable_fp(v, depth, seen)
    if _library_type(type(v)):
        return ("object", _type_name(type(v)))  # a logger, a regex, a generator: not model config
    if dataclasses.is_dataclass(v) or hasattr(v, "__dict__"):
        attrs = getattr(v, "__dict__", {})
        return ("object", _type_name(type(v)),
                tuple(sorted((k, _value_fp(x, depth + 1, seen)) for k, x in attrs.items()
                             if not k.startswith("__") and k not in _VOLATILE)))
    return ("object", _type_name(type(v)))


def _library_type(t: type) -> bool:
    top = t.__module__.split(".")[0]
    return top in sys.stdlib_module_names or top in _OWN_PACKAGES


def _outside(module_name: str) -> bool:
    return module_name.split(".")[0] not in _OWN_PACKAGES


def _class_fp(cls: type) -> tuple:
    parts = []
    for c in cls.__mro__:
        if not _outside(c.__module__):
            parts.append(_type_name(c))
            continue
        members = []
        for name, v in sorted(vars(c).items()):
            if name in ("__dict__", "__weakref__", "__module__", "__doc__"):
                continue
            if isinstance(v, (types.FunctionType, staticmethod, classmethod, property, functools.partial)):
                members.append((name, _callable_fp(v, 0, set())))
            elif isinstance(v, _ATOMIC) or isinstance(v, enum.Enum):
                members.append((name, _value_fp(v, 0, set())))
            else:
                members.append((name, _type_name(type(v))))
        parts.append((_type_name(c), tuple(members)))
    return tuple(parts)


def _hook_fps(hooks) -> tuple:
    return tuple(_callable_fp(h, 0, set()) for h in hooks.values())


def module_fingerprint(module: nn.Module) -> tuple:
    """What of ``module`` decides its exported graph, process-independently (NOTE [persistent cache])."""
    parts = []
    for name, m in module.named_modules():
        d = m.__dict__
        attrs = tuple((k, _value_fp(v, 0, set())) for k, v in d.items() if k not in _SKIP and k not in _VOLATILE)
        hooks = tuple(_hook_fps(d[k]) for k in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                "_backward_pre_hooks"))
        parts.append((name, _class_fp(type(m)), attrs, hooks))
    parts.append(tuple(_hook_fps(h) for h in (_nn_module._global_forward_hooks,
                                              _nn_module._global_forward_pre_hooks)))
    parts.append(global_values(module))  # NOTE [global guards]
    return tuple(parts)


def export_key(module: nn.Module, signature: Any, frontend: str, options: tuple) -> str:
    """The cache key of one export: a hex digest (NOTE [persistent cache])."""
    return _digest(("export", versions(), frontend, options, repr(torch.get_default_dtype()),
                    repr(signature), module_fingerprint(module)))


def training_key(exported: Any, requires_grad: dict[str, bool], recompute: Any = None) -> str:
    """The key of the training graphs built from ``exported``: its graph's hash, the grad mask and
    the recompute policy (NOTE [recompute]) and the ATen kernels chosen (NOTE [ATen kernels])."""
    from ..autodiff.rules.aten import aten_kernels

    graph = hashlib.sha256(exported.model.SerializeToString(deterministic=True)).hexdigest()
    return _digest(("training", versions(), graph, exported.num_user_outputs, exported.mutated_buffers,
                    tuple(sorted(requires_grad.items())), repr(recompute), tuple(sorted(aten_kernels()))))


# -- source files --------------------------------------------------------------------------------
_FILE_HASHES: dict[tuple[str, int, int], str] = {}


def _file_hash(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    memo = (path, st.st_mtime_ns, st.st_size)
    found = _FILE_HASHES.get(memo)
    if found is None:
        try:
            found = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            return None
        # A file written in the last seconds may be written again within the mtime granularity,
        # at the same size: its hash is not remembered (git's "racy" rule).
        if time.time() - st.st_mtime > 2.0:
            _FILE_HASHES[memo] = found
    return found


def source_files(module: nn.Module, traced: tuple[str, ...] = ()) -> dict[str, str]:
    """Content hashes of the source files ``module``'s graph came from (NOTE [persistent cache])."""
    packages = set()
    for m in module.modules():
        packages.update(c.__module__.split(".")[0] for c in type(m).__mro__ if _outside(c.__module__))
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            packages.update(getattr(h, "__module__", "").split(".")[0] for h in hooks.values())
    by_file = {}
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if path and path.endswith(".py"):
            by_file[os.path.realpath(path)] = name
    files = {os.path.realpath(p) for p, name in by_file.items() if name.split(".")[0] in packages}
    for path in traced:
        real = os.path.realpath(path)
        top = by_file.get(real, "").split(".")[0]
        if top and top in _OWN_PACKAGES:
            continue
        if os.path.isfile(real) and not _under_own_package(real):
            files.add(real)
    hashes = {p: _file_hash(p) for p in sorted(files)}
    return {p: h for p, h in hashes.items() if h is not None}


def _under_own_package(path: str) -> bool:
    parts = Path(path).parts
    return any(p in _OWN_PACKAGES for p in parts[-4:-1]) and "site-packages" in parts


def _changed(sources: dict[str, str]) -> str | None:
    for path, digest in sources.items():
        if _file_hash(path) != digest:
            return path
    return None


# -- the store -----------------------------------------------------------------------------------
class DiskCache:
    """One cache folder: ``<key>.<kind>.pkl`` entries and their ``.lock`` files."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder).expanduser()

    def _path(self, kind: str, key: str) -> Path:
        return self.folder / f"{key}.{kind}.pkl"

    def load(self, kind: str, key: str) -> Any | None:
        path = self._path(kind, key)
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f, warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's TreeSpec.__setstate__ on LeafSpec
                record = pickle.load(f)
        except Exception as exc:
            logger.warning("compile cache: ignoring unreadable entry %s (%s: %s); building it again", path,
                           type(exc).__name__, exc)
            return None
        if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("key") != key \
                or record.get("kind") != kind:
            logger.warning("compile cache: ignoring entry %s, whose recorded key does not match its name; "
                           "building it again", path)
            return None
        stale = _changed(record.get("sources", {}))
        if stale is not None:
            logger.info("compile cache: %s changed since entry %s was built; building it again", stale, path.name)
            return None
        return record["value"]

    def store(self, kind: str, key: str, value: Any, sources: dict[str, str] | None = None) -> bool:
        record = {"format": FORMAT, "kind": kind, "key": key, "sources": sources or {}, "value": value}
        try:
            data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            logger.info("compile cache: %s entry not stored, it cannot be pickled (%s: %s)", kind,
                        type(exc).__name__, exc)
            return False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".pkl")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._path(kind, key))  # NOTE [persistent cache]: atomic
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            logger.warning("compile cache: could not write to %s (%s); going on without it", self.folder, exc)
            return False
        return True

    @contextlib.contextmanager
    def exclusive(self, key: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Hold ``key``'s lock while building its entry; waits for another builder up to ``wait_s``."""
        try:
            import fcntl
        except ImportError:  # no flock (Windows): everyone builds, the atomic writes keep entries whole
            yield
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield
            return
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        logger.warning("compile cache: waited %.0f s for another process building %s; "
                                       "building it here too", wait_s, key[:16])
                        break
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # releases the lock


def register_output_types(spec: pytree.TreeSpec) -> None:
    """A loaded entry's output spec may name types that only the export registered with pytree (user
    dataclasses, transformers caches: io.register_container): register them in this process too."""
    stack = [spec]
    while stack:
        s = stack.pop()
        if isinstance(s.type, type):
            register_container(s.type)
        stack.extend(s.children() if callable(getattr(s, "children", None)) else s.children_specs)
