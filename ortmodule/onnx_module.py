"""OnnxModule: train an ``.onnx`` file as an ``nn.Module`` with the same engine as ORTModule.

The file's float initializers become ``nn.Parameter``s (or buffers, when frozen) and are fed to the
graph as inputs, so every run binds their current storage; the gradient graph is built by our rule
registry (``build_training_graphs``) exactly as for an exported torch module. ``save()`` writes the
original graph back with the updated weights under their original names.

Loading treats the file as untrusted: external-data locations are checked before any byte of external
data is read, the model is checked by ``onnx.checker``, and every failure is an :class:`OnnxLoadError`
raised before the module holds any state.
"""

from __future__ import annotations

import copy
import dataclasses
import keyword
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import external_data_helper, helper, numpy_helper
from torch import nn

from .autodiff import differentiable_values
from .autodiff.registry import lookup, refusal
from .errors import GradientRuleError, ORTModuleError
from .export import ExportedModel
from .function import ORTFunction, functorch_level, write_back
from .io import OutputSpec, flatten_outputs
from .runtime.cache import LRUCache
from .runtime.entry import CompiledEntry

MIN_OPSET = 13  # older models are upgraded with onnx.version_converter
UPGRADE_OPSET = 17
_TWO_GB = 2**31 - 1

_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
}
_TORCH_TYPES = {
    **_FLOAT_TYPES,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.BOOL: torch.bool,
}
_ONNX_TYPES = {v: k for k, v in _TORCH_TYPES.items()}


class OnnxLoadError(ORTModuleError, ValueError):
    """The ONNX file is malformed, truncated, unsafe (external data outside its folder) or unsupported."""


# -- loading an untrusted file ----------------------------------------------------------------------
def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it (If/Loop/Scan bodies), recursively."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _graphs(g)


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of the model: initializers, sparse ones, and tensors in node attributes."""
    node_lists = [g.node for g in _graphs(model.graph)] + [f.node for f in model.functions]
    for g in _graphs(model.graph):
        yield from g.initializer
        for s in g.sparse_initializer:
            yield s.values
            yield s.indices
    for nodes in node_lists:
        for node in nodes:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t
                elif a.type == onnx.AttributeProto.TENSORS:
                    yield from a.tensors
                elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield a.sparse_tensor.values
                    yield a.sparse_tensor.indices


def _byte_size(t: onnx.TensorProto) -> int | None:
    if t.data_type not in _TORCH_TYPES:
        return None
    n = 1
    for d in t.dims:
        n *= d
    return n * torch.empty((), dtype=_TORCH_TYPES[t.data_type]).element_size()


def _check_external_data(model: onnx.ModelProto, base_dir: str | None) -> None:
    """Refuse external-data references that leave ``base_dir`` or point at missing/short data.

    # NOTE [external data is untrusted]: a model file chooses the paths onnx would read. We check
    # every location ourselves before anything is read: relative, no ``..`` component, and the
    # resolved path (symlinks followed) inside the model's folder; offset+length within the file.
    """
    root = os.path.realpath(base_dir) if base_dir is not None else None
    for t in _all_tensors(model):
        if not external_data_helper.uses_external_data(t):
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        what = f"tensor {t.name!r}: external data location {loc!r}"
        if root is None:
            raise OnnxLoadError(f"{what}: the model uses external data but no folder is known; pass base_dir=")
        if not loc:
            raise OnnxLoadError(f"{what}: empty location")
        if os.path.isabs(loc) or loc.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", loc):
            raise OnnxLoadError(f"{what} is an absolute path; only paths inside the model's folder are allowed")
        if ".." in re.split(r"[\\/]", loc):
            raise OnnxLoadError(f"{what} contains '..'; only paths inside the model's folder are allowed")
        path = os.path.realpath(os.path.join(root, loc))
        if os.path.commonpath([root, path]) != root:
            raise OnnxLoadError(f"{what} resolves outside the model's folder (symlink?): {path}")
        if not os.path.isfile(path):
            raise OnnxLoadError(f"{what}: file not found")
        try:
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else None
        except ValueError as exc:
            raise OnnxLoadError(f"{what}: bad offset/length: {exc}") from None
        size = os.path.getsize(path)
        if offset < 0 or (length is not None and length < 0):
            raise OnnxLoadError(f"{what}: negative offset or length")
        available = size - offset if length is None else length
        if offset + (length or 0) > size or available < 0:
            raise OnnxLoadError(f"{what}: offset {offset} + length {length} is past the end of the file ({size} bytes)")
        expected = _byte_size(t)
        if expected is not None and available != expected:
            raise OnnxLoadError(
                f"{what}: holds {available} bytes, but a {onnx.TensorProto.DataType.Name(t.data_type)} "
                f"tensor of shape {list(t.dims)} needs {expected} (truncated file?)"
            )


def _load(source: str | os.PathLike | onnx.ModelProto | bytes, base_dir: str | None) -> onnx.ModelProto:
    """Parse, validate, load external data and upgrade the opset. Raises OnnxLoadError."""
    if isinstance(source, onnx.ModelProto):
        model = copy.deepcopy(source)  # never touch the caller's proto
    else:
        try:
            if isinstance(source, bytes):
                data = source
            else:
                path = Path(source)
                if base_dir is None:
                    base_dir = str(path.resolve().parent)
                data = path.read_bytes()
            model = onnx.load_model_from_string(data)
        except OSError as exc:
            raise OnnxLoadError(f"cannot read ONNX file {source!r}: {exc}") from exc
        except Exception as exc:  # protobuf DecodeError and friends
            raise OnnxLoadError(f"not a valid ONNX file ({type(exc).__name__}: {exc}); truncated or corrupt?") from exc
    if not model.HasField("graph") or not model.opset_import:
        raise OnnxLoadError("not a valid ONNX model: no graph or no opset_import (truncated or corrupt file?)")
    _check_external_data(model, base_dir)
    try:
        onnx.checker.check_model(_ms_domain_rms(_without_external_data(model)))
    except Exception as exc:
        raise OnnxLoadError(f"onnx.checker rejected the model: {exc}") from exc
    model = _standard_ops(model)
    if any(external_data_helper.uses_external_data(t) for t in _all_tensors(model)):
        try:
            external_data_helper.load_external_data_for_model(model, base_dir)
        except Exception as exc:
            raise OnnxLoadError(f"cannot load external data: {exc}") from exc
    opset = _default_opset(model)
    if opset < MIN_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, UPGRADE_OPSET)
            onnx.checker.check_model(model)
        except Exception as exc:
            raise OnnxLoadError(
                f"the model uses opset {opset}; ortmodule needs opset {MIN_OPSET} or later and "
                f"onnx.version_converter could not upgrade it to {UPGRADE_OPSET}: {exc}"
            ) from exc
    return model


def _ms_domain_rms(model: onnx.ModelProto) -> onnx.ModelProto:
    """For onnx.checker: onnxruntime registers SimplifiedLayerNormalization in the default domain,
    where onnx has no schema of it (the checker refuses it); a copy with those nodes under
    com.microsoft, whose ops it does not check (NOTE [contrib ops] writes them out after the check)."""
    if not any(n.op_type == "SimplifiedLayerNormalization" and n.domain in ("", "ai.onnx") for n in model.graph.node):
        return model
    model = copy.deepcopy(model)
    for n in model.graph.node:
        if n.op_type == "SimplifiedLayerNormalization" and n.domain in ("", "ai.onnx"):
            n.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _standard_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """Ops without gradient rules written out as ops that have them: ONNX's function ops as their bodies
    (NOTE [function ops]), onnxruntime's fused ``com.microsoft`` ops as the standard ops their kernels
    compute (NOTE [contrib ops]; opset 17 at least, for LayerNormalization). Raises OnnxLoadError naming
    a node it cannot write out."""
    from .passes.contrib import NEEDED_OPSET, ContribOpError, expand_contrib_ops, has_contrib_ops
    from .passes.functions import expand_function_ops

    try:  # NOTE [function ops]
        expand_function_ops(model, lambda domain, op: lookup(domain, op) is not None)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise OnnxLoadError(f"cannot write out a function op of the model ({type(exc).__name__}: {exc})") from exc
    if not has_contrib_ops(model):
        return model
    opset = _default_opset(model)
    if opset < NEEDED_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, NEEDED_OPSET)
        except Exception as exc:
            raise OnnxLoadError(f"the model's com.microsoft ops are written out with opset {NEEDED_OPSET} ops, and "
                                f"onnx.version_converter could not upgrade it from opset {opset}: {exc}") from exc
    try:
        expand_contrib_ops(model)
    except ContribOpError as exc:
        raise OnnxLoadError(f"{exc} (NOTE [contrib ops]); export the model without onnxruntime's transformer "
                            "optimizer (or with fewer fusions) to train it") from exc
    except (KeyError, IndexError, TypeError, ValueError) as exc:  # onnx.checker does not check these nodes
        raise OnnxLoadError(f"a com.microsoft node is malformed ({type(exc).__name__}: {exc})") from exc
    return model


def _without_external_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for onnx.checker, external tensors replaced by empty placeholders.

    The checker would look for external files relative to the working directory (it has no folder
    for a proto), and a model with its data loaded may exceed protobuf's 2 GB; the external data
    itself was validated by :func:`_check_external_data`.
    """
    if not any(external_data_helper.uses_external_data(t) for t in _all_tensors(model)):
        return model
    stub = copy.deepcopy(model)
    for t in _all_tensors(stub):
        if external_data_helper.uses_external_data(t):
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            del t.dims[:]
            t.dims.append(0)
    return stub


def _default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise OnnxLoadError("the model imports no version of the default ONNX domain")


def _to_torch(t: onnx.TensorProto) -> torch.Tensor:
    try:
        arr = numpy_helper.to_array(t)
    except Exception as exc:
        raise OnnxLoadError(f"initializer {t.name!r} is malformed: {exc}") from exc
    if t.data_type == onnx.TensorProto.BFLOAT16:
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr, copy=True))


def _to_proto(t: torch.Tensor, name: str) -> onnx.TensorProto:
    t = t.detach().to("cpu").contiguous()
    proto = onnx.TensorProto(name=name, data_type=_ONNX_TYPES[t.dtype], dims=list(t.shape))
    proto.raw_data = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # little-endian, as ONNX wants
    return proto


# -- turning the file into a training graph --------------------------------------------------------
def _tensor_elem_type(vi: onnx.ValueInfoProto) -> int | None:
    return vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else None


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names read by the subgraphs of ``node`` (conservatively: every input name)."""
    names: set[str] = set()
    for a in node.attribute:
        subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for g in subs:
            for sg in _graphs(g):
                for n in sg.node:
                    names.update(n.input)
    return names


def _prune(graph: onnx.GraphProto, outputs: Iterable[str]) -> None:
    """Drop the nodes that no output in ``outputs`` needs (e.g. a ZipMap behind a dropped output)."""
    live = set(outputs)
    keep = []
    for node in reversed(graph.node):
        if any(o in live for o in node.output):
            keep.append(node)
            live.update(i for i in node.input if i)
            live.update(_subgraph_reads(node))
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)


def _missing_rules(model: onnx.ModelProto, trainable: Sequence[str], outputs: Sequence[str]) -> list[str]:
    """Ops between a trainable initializer and a differentiated output that have no gradient rule.

    Mirrors the backward walk of ``build_gradient``: an op only needs a rule when a gradient reaches
    one of its outputs and one of its inputs depends on a trainable value.
    """
    graph = ir.from_proto(model).graph
    by_name = {v.name: v for v in graph.inputs}
    wrt = [by_name[n] for n in trainable if n in by_name]
    active = differentiable_values(graph, wrt)
    outs = {v.name: v for v in graph.outputs}
    needed = {outs[n] for n in outputs if outs[n] in active}
    problems = []
    for node in reversed(list(graph)):
        if not any(o in needed for o in node.outputs):
            continue
        ins = [v for v in node.inputs if v is not None and v in active]
        if not ins:
            continue
        info = lookup(node.domain, node.op_type)
        if info is None:
            sources = sorted(_trainable_sources(node, set(wrt)))
            op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
            shown = ", ".join(repr(s) for s in sources[:5]) + (" ..." if len(sources) > 5 else "")
            problems.append(f"op '{op}' (node '{node.name}') is reached from trainable {shown}")
        elif info.fn is not None:
            why = refusal(node.domain, node.op_type, node)
            if why is not None:
                problems.append(f"op '{node.op_type}' (node '{node.name}'): {why}")
            needed.update(ins)
    return problems


def _trainable_sources(node: ir.Node, wrt: set[ir.Value]) -> set[str]:
    seen: set[ir.Value] = set()
    stack = [v for v in node.inputs if v is not None]
    found = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in wrt:
            found.add(v.name)
        p = v.producer()
        if p is not None:
            stack.extend(x for x in p.inputs if x is not None)
    return found


def _safe_name(name: str, taken: set[str]) -> str:
    """A Python identifier for ``name`` (``fc1.weight`` -> ``fc1_weight``), unique within ``taken``."""
    s = re.sub(r"\W", "_", name, flags=re.ASCII) or "tensor"
    if s[0].isdigit() or keyword.iskeyword(s):
        s = "t_" + s
    candidate, i = s, 1
    while candidate in taken or hasattr(nn.Module, candidate) or candidate.startswith("__"):
        candidate = f"{s}_{i}"
        i += 1
    taken.add(candidate)
    return candidate


@dataclasses.dataclass(frozen=True)
class _EntryKey:
    """What changes the compiled graphs of an OnnxModule (STYLE.md §7). Shapes do not: the graph is
    the file's, with the file's own (possibly symbolic) dims, so one entry serves every batch size."""

    device: torch.device
    needs_grad: bool
    inputs_requires_grad: tuple[bool, ...]
    tensors_requires_grad: tuple[bool, ...]


class OnnxModule(nn.Module):
    """An ONNX model as a trainable ``nn.Module``; forward runs in ORT, backward is our gradient graph.

    Args:
        model: path of an ``.onnx`` file, its bytes, or an ``onnx.ModelProto`` (copied, never modified).
        trainable: which float initializers become ``nn.Parameter``s: ``None`` (all but BatchNorm
            running statistics, position tables and the one-element ones other than a layer's one-unit
            bias, with a warning naming those: NOTE [scalar constants], [bn statistics], [position
            tables]), a list of ONNX names, or a
            predicate ``onnx_name -> bool``. The other float initializers become buffers.
            Non-float initializers stay graph constants (also listed as buffers, read-only).
        outputs: the graph outputs to return (ONNX names), default every tensor output.
        output_format: ``"auto"`` (one tensor, or a tuple), ``"tuple"`` or ``"dict"`` (by output name).
        base_dir: folder of the external data, for a ``ModelProto`` or bytes that reference any.
        untie: give each reader of a shared float initializer its own copy (NOTE [merged initializers]):
            ``True`` for the shared ones whose elements are all equal (what exporters merge), or a list
            of ONNX names; the copies are named ``<name>.1``, ``<name>.2`` ... and saved as such.
        tie: train each pair of initializers holding the same values (or one the other's transpose)
            as one weight: the second is computed from the first (a Transpose or Identity node), as a
            tied embedding and LM head are in the model the file came from.

    Names: an initializer is stored under a Python-safe attribute name (``fc1.weight`` ->
    ``fc1_weight``); ``state_dict()`` is keyed by these attribute names, :attr:`onnx_names` maps them to
    the ONNX names, and :meth:`onnx_state_dict` gives the tensors keyed by ONNX name.
    Forward takes the graph inputs (non-initializer) in order, or by name as keyword arguments.
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        trainable: Sequence[str] | Callable[[str], bool] | None = None,
        *,
        outputs: Sequence[str] | None = None,
        output_format: str = "auto",
        base_dir: str | os.PathLike | None = None,
        cache_size: int = 8,
        untie: bool | Sequence[str] = False,
        tie: bool = False,
    ) -> None:
        super().__init__()
        if output_format not in ("auto", "tuple", "dict"):
            raise ValueError(f"output_format must be 'auto', 'tuple' or 'dict', not {output_format!r}")
        # Everything is built in locals first: a failure leaves no half-made module behind.
        proto = _load(model, None if base_dir is None else str(base_dir))
        _rewrite_shared(proto, untie, tie)
        graph = proto.graph
        init_names = {t.name for t in graph.initializer}
        float_inits = [t.name for t in graph.initializer if t.data_type in _FLOAT_TYPES]
        tensors = {t.name: _to_torch(t) for t in graph.initializer}
        # what no weight looks like, judged by value (only when the module chooses what trains)
        values = {n: tensors[n].float().numpy() for n in float_inits} if trainable is None else {}
        trainable_set = _select_trainable(float_inits, trainable, _constant_scalars(graph), _statistics(graph),
                                          _position_tables(values), [n for n, a in values.items()
                                                                     if _folded_constant(a)])

        data_inputs = [vi for vi in graph.input if vi.name not in init_names]
        for vi in data_inputs:
            if _tensor_elem_type(vi) is None:
                raise OnnxLoadError(f"graph input {vi.name!r} is not a tensor; only tensor inputs are supported")
        tensor_outputs = [vi.name for vi in graph.output if _tensor_elem_type(vi) is not None]
        other_outputs = [vi.name for vi in graph.output if _tensor_elem_type(vi) is None]
        if outputs is None:
            selected = tensor_outputs
            if other_outputs:
                warnings.warn(
                    f"OnnxModule: dropping non-tensor outputs {other_outputs} (sequences/maps, e.g. "
                    "scikit-learn's ZipMap); only tensor outputs are supported. For skl2onnx, convert "
                    "with options={id(model): {'zipmap': False}} to get probabilities as a tensor.",
                    stacklevel=2,
                )
        else:
            selected = list(outputs)
            all_names = {vi.name for vi in graph.output}
            for name in selected:
                if name in other_outputs:
                    raise OnnxLoadError(
                        f"output {name!r} is not a tensor (a sequence or map, e.g. scikit-learn's ZipMap); "
                        "only tensor outputs are supported"
                    )
                if name not in all_names:
                    raise ValueError(f"no graph output named {name!r}; outputs: {sorted(all_names)}")
        if not selected:
            raise OnnxLoadError("the model has no tensor outputs")

        # Template for to_onnx(): the graph as loaded, float initializers emptied (torch owns them).
        template = proto
        owned = float_inits  # fed as graph inputs: parameters and frozen float buffers
        for t in template.graph.initializer:
            if t.data_type in _FLOAT_TYPES:
                t.ClearField("raw_data")
                for f in ("float_data", "double_data", "int32_data"):
                    t.ClearField(f)

        stat_updates = _running_stat_updates(template.graph, set(owned) - trainable_set)
        exported = _training_model(template, owned, data_inputs, selected, output_format,
                                   [out for _, out in stat_updates])
        problems = _missing_rules(exported.model, sorted(trainable_set), selected)
        if problems:
            raise GradientRuleError(
                "No gradient rule for ops on the path from trainable initializers to the outputs: "
                + "; ".join(problems)
                + ". Freeze the initializers before them (trainable=...), select other outputs "
                "(outputs=...), or register a rule in ortmodule/autodiff/rules/."
            )

        # -- from here on nothing raises: register the state --------------------------------------
        self._template = template
        self._exported = exported
        self._input_names = [vi.name for vi in data_inputs]
        self._input_types = {vi.name: vi.type.tensor_type for vi in data_inputs}
        self._output_names = selected
        self._output_kind = _output_kind(output_format, selected)
        self._entries: LRUCache[CompiledEntry] = LRUCache(cache_size)
        self.onnx_names: dict[str, str] = {}  # attribute name -> ONNX name
        self.attr_names: dict[str, str] = {}  # ONNX name -> attribute name
        taken = set(self.__dict__)
        self._owned_attrs: list[str] = []
        for t in graph.initializer:
            attr = _safe_name(t.name, taken)
            self.onnx_names[attr] = t.name
            self.attr_names[t.name] = attr
            value = tensors[t.name]
            if t.name in trainable_set:
                self.register_parameter(attr, nn.Parameter(value))
            else:
                self.register_buffer(attr, value)
            if t.name in owned:
                self._owned_attrs.append(attr)
        self._feed_names = tuple(self._input_names + [self.onnx_names[a] for a in self._owned_attrs])
        # NOTE [running stats]: the buffers a training-mode BatchNormalization updates, in graph output order
        self._stat_attrs = tuple(self.attr_names[name] for name, _ in stat_updates)
        if not float_inits:
            warnings.warn(
                "OnnxModule: the model has no trainable float initializers (weights stored as node "
                "attributes, e.g. ai.onnx.ml LinearClassifier/TreeEnsemble, cannot be trained)",
                stacklevel=2,
            )

    # -- names -----------------------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        return list(self._input_names)

    @property
    def output_names(self) -> list[str]:
        return list(self._output_names)

    def onnx_state_dict(self) -> dict[str, torch.Tensor]:
        """Every initializer's current value (detached), keyed by its ONNX name."""
        return {self.onnx_names[a]: t.detach() for a, t in self._named_initializers()}

    def _named_initializers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for attr in self.onnx_names:
            t = self._parameters.get(attr)
            yield attr, (t if t is not None else self._buffers[attr])

    def _owned_tensors(self) -> list[torch.Tensor]:
        out = []
        for attr in self._owned_attrs:
            t = self._parameters.get(attr)
            out.append(t if t is not None else self._buffers[attr])
        return out

    # -- forward ---------------------------------------------------------------------------------
    def _bind(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        names = self._input_names
        if len(args) > len(names):
            raise TypeError(f"OnnxModule takes {len(names)} inputs {names}, got {len(args)} positional")
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"OnnxModule got an unexpected input {k!r}; inputs: {names}")
            if k in bound:
                raise TypeError(f"OnnxModule got input {k!r} both by position and by name")
            bound[k] = v
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"OnnxModule missing input(s) {missing}; inputs: {names}")
        out = []
        for name in names:
            x = bound[name]
            if isinstance(x, np.ndarray):
                x = torch.from_numpy(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {name!r} must be a tensor, not {type(x).__name__}")
            tt = self._input_types[name]
            want = _TORCH_TYPES.get(tt.elem_type)
            if want is not None and x.dtype != want:
                raise TypeError(f"input {name!r} must have dtype {want}, got {x.dtype}")
            if tt.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
                ok = len(dims) == x.dim() and all(d is None or d == s for d, s in zip(dims, x.shape))
                if not ok:
                    shown = [d if d is not None else "?" for d in dims]
                    raise ValueError(f"input {name!r} must have shape {shown}, got {list(x.shape)}")
            out.append(x)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if functorch_level() is not None:  # NOTE [functorch transforms]: no eager forward to run instead
            raise ORTModuleError(
                "OnnxModule cannot run under a torch.func transform (grad, vmap, jacrev, jvp, ...): the ONNX "
                "Runtime graph cannot be seen through. Take per-sample gradients with a loop over the samples, "
                "or differentiate with torch.autograd.grad outside the transform")
        inputs = self._bind(args, kwargs)
        owned = self._owned_tensors()
        device = owned[0].device if owned else (inputs[0].device if inputs else torch.device("cpu"))
        for name, x in zip(self._input_names, inputs):
            if x.device != device:
                raise RuntimeError(f"input {name!r} is on {x.device}, the model's tensors on {device}")
        grad = torch.is_grad_enabled()
        in_rg = tuple(grad and x.requires_grad for x in inputs)
        t_rg = tuple(grad and t.requires_grad for t in owned)
        needs_grad = any(in_rg) or any(t_rg)
        key = _EntryKey(device, needs_grad, in_rg if needs_grad else (), t_rg if needs_grad else ())
        entry = self._entries.get(key)
        if entry is None:
            requires_grad = None
            if needs_grad:
                requires_grad = dict(zip(self._feed_names, in_rg + t_rg))
            entry = CompiledEntry(self._exported, device, requires_grad)
            self._entries.put(key, entry)
        stats = tuple(getattr(self, a) for a in getattr(self, "_stat_attrs", ()))
        if stats:  # NOTE [running stats]: onnxruntime gets copies; the new values are written back
            fed = {id(t) for t in stats}
            owned = [t.clone() if id(t) in fed else t for t in owned]
        tensors = [*inputs, *owned]
        if needs_grad:
            outs = ORTFunction.apply(entry, self._feed_names, stats, *tensors)
        else:
            outs = entry.inference.run(dict(zip(self._feed_names, tensors)))
            write_back(stats, outs[len(self._output_names):])
        outs = outs[:len(self._output_names)]
        if self._output_kind == "dict":
            return dict(zip(self._output_names, outs))
        return outs[0] if self._output_kind == "single" else tuple(outs)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_entries"] = LRUCache(self._entries.maxsize)  # ORT sessions are rebuilt on demand
        # a pytree spec does not pickle cleanly; it is rebuilt from _output_kind
        state["_exported"] = dataclasses.replace(self._exported, output_spec=None)
        return state

    def __setstate__(self, state: dict) -> None:
        spec = _output_spec(state["_output_kind"], state["_output_names"])
        state["_exported"] = dataclasses.replace(state["_exported"], output_spec=spec)
        self.__dict__.update(state)

    # -- saving ----------------------------------------------------------------------------------
    def to_onnx(self) -> onnx.ModelProto:
        """The loaded graph with the current weights as initializers, under their original names."""
        model = copy.deepcopy(self._template)
        current = self.onnx_state_dict()
        owned = {self.onnx_names[a] for a in self._owned_attrs}
        inits = [(_to_proto(current[t.name], t.name) if t.name in owned else t) for t in model.graph.initializer]
        del model.graph.initializer[:]
        model.graph.initializer.extend(inits)
        return model

    def save(self, path: str | os.PathLike, external_data: bool = False) -> None:
        """Write :meth:`to_onnx` to ``path``; tensors go to ``<name>.data`` beside it with
        ``external_data=True`` (forced, with a warning, when the model exceeds protobuf's 2 GB)."""
        model = self.to_onnx()
        path = Path(path)
        size = sum(t.ByteSize() for t in model.graph.initializer)
        if not external_data and size > _TWO_GB - 64 * 2**20:
            warnings.warn("OnnxModule.save: model exceeds 2 GB, saving weights as external data", stacklevel=2)
            external_data = True
        if external_data:
            location = path.name + ".data"
            data = path.parent / location
            if data.exists():
                data.unlink()  # onnx appends to an existing file
            onnx.save_model(
                model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                location=location, size_threshold=1024,
            )
        else:
            onnx.save_model(model, str(path))


def _folded_constant(a: np.ndarray) -> bool:
    """NOTE [folded constants]: a float tensor no weight looks like: one holding -inf, NaN or a value of
    1e30 or more (an attention mask's fill), or one value in every element over two or more axes (a mask
    of zeros, [batch, 1, S, S], that an export at fixed shapes folds into an initializer: trained, a ViT
    file's logits moved 2.4e-2 off eager's at the second AdamW step). A zero-initialised layer of a fresh
    model (ControlNet's zero convolutions) looks like that too: the warning names it, trainable= trains it."""
    if a.size <= 1 or not np.issubdtype(a.dtype, np.floating):
        return False
    flat = a.reshape(-1)
    if not np.all(np.isfinite(flat)) or float(np.abs(flat).max()) >= 1e30:
        return True
    return sum(d > 1 for d in a.shape) >= 2 and bool(np.all(flat == flat[0]))


def _merged_suspects(graph: onnx.GraphProto) -> dict[str, tuple[float, int]]:
    """Float initializers of more than one element, all equal, read by several nodes: name -> (value,
    readers) (NOTE [merged initializers])."""
    readers: dict[str, int] = {}
    for node in graph.node:
        for x in node.input:
            readers[x] = readers.get(x, 0) + 1
    found = {}
    for t in graph.initializer:
        if t.data_type in _FLOAT_TYPES and readers.get(t.name, 0) > 1 and int(np.prod(t.dims)) > 1:
            arr = numpy_helper.to_array(t)
            if np.all(arr == arr.reshape(-1)[0]) and not _folded_constant(arr):
                found[t.name] = (float(arr.reshape(-1)[0]), readers[t.name])
    return found


def _twins(graph: onnx.GraphProto) -> list[tuple[str, str, bool]]:
    """Pairs of float initializers (over one element) holding the same values, or one the other's
    transpose: (a, b, transposed). NOTE [merged initializers]: a tied weight (an embedding shared with
    the LM head) the exporter stored twice, once transposed for a MatMul; they train apart. Candidates
    are found by their first 32 elements (a dict lookup each), then compared whole."""

    def head(prefix: np.ndarray, x: np.ndarray) -> tuple:
        return (x.dtype.str, x.size, prefix[:32].tobytes())

    seen: dict[tuple, list[onnx.TensorProto]] = {}  # protos, not arrays: no second copy of the weights
    pairs = []
    for t in graph.initializer:
        if t.data_type not in _FLOAT_TYPES or int(np.prod(t.dims)) <= 1:
            continue
        x = numpy_helper.to_array(t)
        flat = x.reshape(-1)
        if np.all(flat == flat[0]):
            continue  # all equal: merged constants (_merged_suspects)
        for other in seen.get(head(flat, x), []):
            y = numpy_helper.to_array(other)
            if y.shape == x.shape and np.array_equal(x, y):
                pairs.append((other.name, t.name, False))
        if x.ndim == 2:  # x.T's first 32 elements are in x's first columns
            cols = -(-32 // max(x.shape[0], 1))
            for other in seen.get(head(np.ascontiguousarray(x[:, :cols].T).reshape(-1), x), []):
                y = numpy_helper.to_array(other)
                if y.shape == x.T.shape and np.array_equal(x.T, y):
                    pairs.append((other.name, t.name, True))
        seen.setdefault(head(flat, x), []).append(t)
    return pairs


def _broadcasts(graph: onnx.GraphProto) -> list[tuple[str, list[int]]]:
    """Float initializers holding one smaller tensor repeated along some axes (bitwise equal slices, not all
    one value): (name, those axes). NOTE [merged initializers]: an export at a fixed batch folds
    ``cls_token.expand(batch, -1, -1)`` of a ViT into a [batch, 1, hidden] initializer, and its copies
    train apart where the model has one token (a ViT file's logits 2.4e-2 off eager's at the second
    AdamW step)."""
    found = []
    for t in graph.initializer:
        if t.data_type not in _FLOAT_TYPES or int(np.prod(t.dims)) <= 1 or not any(d > 1 for d in t.dims):
            continue
        x = numpy_helper.to_array(t)
        flat = x.reshape(-1)
        if np.all(flat == flat[0]):
            continue  # all one value: merged constants (_merged_suspects)
        axes = [ax for ax, d in enumerate(x.shape) if d > 1
                and np.array_equal(np.take(x, [1], ax), np.take(x, [0], ax))  # cheap first: two slices
                and np.all(x == np.take(x, [0], ax))]
        if axes:
            found.append((t.name, axes))
    return found


def _rewrite_shared(model: onnx.ModelProto, untie: bool | Sequence[str], tie: bool = False) -> None:
    """NOTE [merged initializers]: torch.onnx's exporter merges equal initializers into one (every
    LayerNorm weight of a fresh model is ones, every bias zeros: one HF BERT file read a single [32]
    bias in 15 places). Trained as one tensor they stay tied, where the model had a tensor each (outputs
    10% off eager's after one AdamW step). OnnxModule cannot tell merged from truly tied weights (an
    embedding shared with the LM head), so it warns about the likely ones (all elements equal) and
    unties what ``untie`` names: each further reader gets a copy, ``<name>.1``, ``<name>.2`` ...; with
    ``tie``, the second of two initializers holding the same values (or transposed) becomes a node
    computing it from the first, so both uses train one weight, as in the model, and an initializer that
    repeats one tensor along some axes (a folded broadcast) becomes that tensor, ``<name>.one``, and an
    Expand."""
    graph = model.graph
    suspects = _merged_suspects(graph)
    if untie is True:
        names = set(suspects)
    elif untie is False:
        names = set()
    else:
        names = set([untie] if isinstance(untie, str) else untie)
        inits = {t.name for t in graph.initializer}
        unknown = names - inits
        if unknown:
            raise ValueError(f"untie names {sorted(unknown)} that are not initializers of the model")
    left = {n: v for n, v in suspects.items() if n not in names}
    if left:
        shown = ", ".join(f"{n!r} (all {v:g}, read by {k} nodes)" for n, (v, k) in list(left.items())[:6])
        warnings.warn(f"OnnxModule: {len(left)} shared float initializer(s) look like several equal tensors the "
                      f"exporter merged into one: {shown}{' ...' if len(left) > 6 else ''}. Trained as one they "
                      "stay tied; pass untie=True (or their names) to train a copy per reader "
                      "(NOTE [merged initializers])", stacklevel=3)
    broadcasts = _broadcasts(graph)
    if broadcasts and not tie:
        by = {t.name: t for t in graph.initializer}
        shown = ", ".join(f"{n!r} {list(by[n].dims)} (repeated along axis {', '.join(map(str, axes))})"
                          for n, axes in broadcasts[:4])
        warnings.warn(f"OnnxModule: initializer(s) {shown}{' ...' if len(broadcasts) > 4 else ''} hold one tensor "
                      "repeated: a broadcast the exporter folded (a ViT's cls token expanded to the export batch)? "
                      "Its copies train apart; pass tie=True to train it as one tensor (NOTE [merged initializers])",
                      stacklevel=3)
    if tie:
        by = {t.name: t for t in graph.initializer}
        for name, axes in broadcasts:
            t = by[name]
            x = numpy_helper.to_array(t)
            one = x[tuple(slice(0, 1) if ax in axes else slice(None) for ax in range(x.ndim))]
            reduced = numpy_helper.from_array(np.ascontiguousarray(one), f"{name}.one")
            shape = numpy_helper.from_array(np.array(x.shape, np.int64), f"{name}.shape")
            t.CopyFrom(reduced)
            graph.initializer.append(shape)
            graph.node.insert(0, helper.make_node("Expand", [reduced.name, shape.name], [name],
                                                  name=f"ortmodule_tie_{name}"))
        for i in [i for i in graph.input if i.name in by and any(i.name == n for n, _ in broadcasts)]:
            graph.input.remove(i)  # IR 3 files list initializers as inputs
    twins = _twins(graph)
    if twins and not tie:
        shown = ", ".join(f"{a!r} and {b!r}{' (transposed)' if tr else ''}" for a, b, tr in twins[:4])
        warnings.warn(f"OnnxModule: initializers {shown}{' ...' if len(twins) > 4 else ''} hold the same values: "
                      "one weight the exporter stored twice (a tied embedding and LM head)? They train apart; "
                      "pass tie=True to train them as one (NOTE [merged initializers])", stacklevel=3)
    if tie:
        dropped: set[str] = set()
        for a, b, transposed in twins:
            if a in dropped or b in dropped:
                continue
            dropped.add(b)
            op = helper.make_node("Transpose", [a], [b], perm=[1, 0]) if transposed else \
                helper.make_node("Identity", [a], [b])
            op.name = f"ortmodule_tie_{b}"
            graph.node.insert(0, op)
        kept = [t for t in graph.initializer if t.name not in dropped]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        inputs = [i for i in graph.input if i.name not in dropped]  # IR 3 files list initializers as inputs
        del graph.input[:]
        graph.input.extend(inputs)
    if not names:
        return
    by_name = {t.name: t for t in graph.initializer}
    taken = set(by_name) | {x for n in graph.node for x in (*n.input, *n.output)} | {i.name for i in graph.input}
    seen: dict[str, int] = {}
    for node in graph.node:
        for j, x in enumerate(node.input):
            if x not in names:
                continue
            seen[x] = seen.get(x, 0) + 1
            if seen[x] == 1:
                continue  # the first reader keeps the original
            k = seen[x] - 1
            while f"{x}.{k}" in taken:
                k += 1
            copy_name = f"{x}.{k}"
            taken.add(copy_name)
            twin = onnx.TensorProto()
            twin.CopyFrom(by_name[x])
            twin.name = copy_name
            graph.initializer.append(twin)
            node.input[j] = copy_name


_BIAS_INPUTS = {"Gemm": 2, "Conv": 2, "ConvTranspose": 2}
_LINEAR_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"}


def _constant_scalars(graph: onnx.GraphProto) -> list[str]:
    """One-element float initializers that are not a layer's bias (NOTE [scalar constants]): a Gemm's,
    Conv's or ConvTranspose's bias input, or an Add onto a MatMul / Gemm / Conv result (the one-unit
    bias of ``nn.Linear(n, 1)`` is a weight)."""
    producer = {o: n for n in graph.node for o in n.output}
    bias = set()
    for node in graph.node:
        k = _BIAS_INPUTS.get(node.op_type)
        if k is not None and len(node.input) > k:
            bias.add(node.input[k])
        if node.op_type == "Add" and len(node.input) == 2:
            for mine, other in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
                if other in producer and producer[other].op_type in _LINEAR_OPS:
                    bias.add(mine)
    return [t.name for t in graph.initializer
            if t.data_type in _FLOAT_TYPES and int(np.prod(t.dims)) <= 1 and t.name not in bias]


def _statistics(graph: onnx.GraphProto) -> set[str]:
    """Initializers read only as a BatchNormalization's running mean or variance (inputs 3 and 4). NOTE
    [bn statistics]: they are statistics, buffers in the torch model; trained by AdamW through an
    inference-mode BN of an unoptimised torch.onnx file, outputs were 2% off eager's after one step."""
    stats: set[str] = set()
    other: set[str] = set()
    for node in graph.node:
        for i, x in enumerate(node.input):
            (stats if node.op_type == "BatchNormalization" and i in (3, 4) else other).add(x)
    return stats - other


def _sinusoidal(a: np.ndarray) -> bool:
    """Whether ``a``'s columns over its second-to-last axis are sinusoids of the position: each column
    follows x[s+1] + x[s-1] = 2 c x[s] (cos(s t) and sin(s t) both do, with c = cos t), at least one of
    them oscillates (a linear ramp meets the recurrence with c = 1), and there are 5 positions or more
    (3 equations for each column's one c)."""
    if a.ndim < 2 or a.shape[-2] < 5 or a.size != a.shape[-2] * a.shape[-1]:
        return False
    t = a.reshape(a.shape[-2], a.shape[-1])
    if a.shape[-2] > 5 and not _sinusoidal(t[:5]):  # most weights fail on their first rows already
        return False
    t = t.astype(np.float64)
    scale = float(np.abs(t).max())
    if not np.isfinite(scale) or scale == 0.0:
        return False
    mid, sides = t[1:-1], t[2:] + t[:-2]
    power = (mid * mid).sum(0)
    c = np.where(power > 0, (sides * mid).sum(0) / (2 * np.maximum(power, 1e-300)), 1.0)
    residual = np.abs(sides - 2 * c * mid).max()
    oscillates = (np.ptp(t, axis=0) > 0.1 * scale) & (np.abs(c) < 0.999)  # not a ramp (c = 1), not constant
    return bool(residual <= 1e-4 * scale and np.all(np.abs(c) <= 1 + 1e-4) and np.any(oscillates))


def _frequencies(a: np.ndarray) -> bool:
    """A rotary embedding's inverse frequencies: base ** (-2i / d), a 1-D geometric sequence from 1 down."""
    if a.ndim != 1 or a.size < 2 or a[0] != 1.0 or np.any(a <= 0):
        return False
    ratio = a[1:].astype(np.float64) / a[:-1]
    return bool(ratio[0] < 1 and np.all(np.abs(ratio / ratio[0] - 1) <= 1e-5))


def _position_tables(values: dict[str, np.ndarray]) -> list[str]:
    """NOTE [position tables]: float initializers that hold a model's position encoding rather than
    weights. A rotary model's ``inv_freq`` buffer is stored as an initializer (torch.onnx without
    optimisation), or its cos / sin tables are folded into initializers (``unsqueeze_14`` /
    ``unsqueeze_15`` of an optimised Llama, Mistral, Qwen2, GPT-NeoX or Phi file); so are fixed
    sinusoidal position tables. Nothing in the file marks them as buffers, and trained they moved an HF
    Llama file's logits 1.3e-4 off eager's in two AdamW steps. They are recognised by their values: an
    initializer named ``*inv_freq`` or holding a geometric sequence from 1 down (the frequencies), or
    whose columns are sinusoids over the positions (a three-term recurrence per column no trained or
    random weight meets). A table fine-tuned off the sinusoids no longer matches, and trains."""
    return [name for name, a in values.items()
            if a.size >= 2 and (name.endswith("inv_freq") or _frequencies(a) or _sinusoidal(a))]


def _select_trainable(float_inits: list[str], trainable, scalars: Sequence[str] = (),
                      statistics: set[str] = frozenset(), tables: Sequence[str] = (),
                      constants: Sequence[str] = ()) -> set[str]:
    if trainable is None:
        # NOTE [scalar constants]: exporters store constants as initializers too: torch.onnx's dynamo
        # exporter keeps the 0.0 that fills an LSTM's initial state, fill values of masks, epsilons and
        # scales as one-element float initializers. Trained, they change what the model computes (the
        # state fill drifted off 0 after one AdamW step: outputs 0.6% off eager's at the next). So by
        # default they stay buffers, and the warning names them, but a layer's one-unit bias
        # (``_constant_scalars``) trains; a learnt scalar elsewhere (a temperature, a one-slope PReLU)
        # is trained by naming it in ``trainable``.
        if scalars:
            shown = ", ".join(repr(n) for n in list(scalars)[:10]) + (" ..." if len(scalars) > 10 else "")
            warnings.warn(f"OnnxModule: {len(scalars)} one-element float initializer(s) kept frozen as constants "
                          f"({shown}); pass trainable=[...] naming them to train them (NOTE [scalar constants])",
                          stacklevel=3)
        if tables:
            warnings.warn(f"OnnxModule: {len(tables)} initializer(s) hold position encodings, not weights (rotary "
                          f"frequencies or cos/sin tables: {', '.join(repr(n) for n in tables[:10])}"
                          f"{' ...' if len(tables) > 10 else ''}); kept frozen as buffers, as in the torch model. "
                          "Pass trainable=[...] naming them to train them (NOTE [position tables])", stacklevel=3)
        if constants:
            warnings.warn(f"OnnxModule: {len(constants)} initializer(s) look like constants the exporter folded, not "
                          f"weights (a mask: -inf / huge fill values, or one value over several axes: "
                          f"{', '.join(repr(n) for n in constants[:10])}{' ...' if len(constants) > 10 else ''}); "
                          "kept frozen as buffers. Pass trainable=[...] naming them to train them (a zero-initialised "
                          "layer of a fresh model) (NOTE [folded constants])", stacklevel=3)
        return set(float_inits) - set(scalars) - statistics - set(tables) - set(constants)
    if callable(trainable):
        return {n for n in float_inits if trainable(n)}
    if isinstance(trainable, str):
        trainable = [trainable]
    chosen = set(trainable)
    unknown = chosen - set(float_inits)
    if unknown:
        raise ValueError(
            f"trainable names {sorted(unknown)} are not float initializers of the model; "
            f"float initializers: {float_inits[:20]}{' ...' if len(float_inits) > 20 else ''}"
        )
    return chosen


def _output_kind(output_format: str, outputs: Sequence[str]) -> str:
    if output_format == "auto":
        return "single" if len(outputs) == 1 else "tuple"
    return output_format


def _output_spec(kind: str, outputs: Sequence[str]) -> OutputSpec:
    """The engine's OutputSpec for the chosen output structure (a tensor, a tuple, a dict by name)."""
    example: Any = torch.empty(0)
    if kind == "dict":
        example = {n: torch.empty(0) for n in outputs}
    elif kind == "tuple":
        example = tuple(torch.empty(0) for _ in outputs)
    return flatten_outputs(example)[1]


def _const_array(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of an initializer or a Constant node's output, else None."""
    for t in graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for node in graph.node:
        if node.op_type == "Constant" and name in node.output and node.attribute:
            value = helper.get_attribute_value(node.attribute[0])
            return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)
    return None


def _split_sequences(graph: onnx.GraphProto) -> None:
    """NOTE [sequence splits]: unoptimised torch.onnx files split with SplitToSequence and read the pieces
    with SequenceAt at constant positions (GPT-2's fused q, k, v: chunks of a scalar size). Sequences have
    no gradient rules, so where every reader is such a SequenceAt, each becomes the Slice (and, for
    keepdims=0 unit pieces, Squeeze) of its piece, as the exporter's optimiser would have written it."""
    if not any(node.op_type == "SplitToSequence" for node in graph.node):
        return  # the common case: no map of readers to build
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for x in node.input:
            readers.setdefault(x, []).append(node)
    outputs = {o.name for o in graph.output}
    count = 0
    for node in list(graph.node):
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx"):
            continue
        seq, users = node.output[0], readers.get(node.output[0], [])
        if seq in outputs or not users or any(u.op_type != "SequenceAt" for u in users):
            continue
        split = _const_array(graph, node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if len(node.input) > 1 and node.input[1] and split is None:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis, keepdims = int(attrs.get("axis", 0)), int(attrs.get("keepdims", 1))
        ranges = []
        for u in users:
            pos = _const_array(graph, u.input[1])
            if pos is None or pos.size != 1:
                break
            pos = int(pos.reshape(-1)[0])
            if split is not None and split.ndim == 1:
                pos %= len(split)
                start = int(split[:pos].sum())
                ranges.append((start, start + int(split[pos]), False))
            elif pos < 0:  # counted from the end: needs the size along the axis
                break
            else:
                size = int(split.reshape(-1)[0]) if split is not None else 1
                ranges.append((pos * size, (pos + 1) * size, split is None and not keepdims))
        if len(ranges) != len(users):
            continue
        graph.node.remove(node)
        for u, (begin, stop, squeeze) in zip(users, ranges):
            count += 1
            k = list(graph.node).index(u)
            graph.node.remove(u)
            names = [f"ortmodule_seq{count}_{w}" for w in ("starts", "ends", "axes", "piece")]
            new = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array([v], np.int64)))
                   for n, v in zip(names[:3], (begin, stop, axis))]
            out = names[3] if squeeze else u.output[0]
            new.append(helper.make_node("Slice", [node.input[0], *names[:3]], [out], name=u.name))
            if squeeze:
                new.append(helper.make_node("Squeeze", [out, names[2]], [u.output[0]], name=f"{u.name}__squeeze"))
            for j, n in enumerate(new):
                graph.node.insert(k + j, n)


def _running_stat_updates(graph: onnx.GraphProto, buffers: set[str]) -> list[tuple[str, str]]:
    """NOTE [running stats]: (buffer, new value) for the running mean and variance of each
    training-mode BatchNormalization (a file exported with ``training=TrainingMode.TRAINING``) that reads
    them from buffers; unnamed running-stat outputs get names. The statistics used to move only because
    onnxruntime's BatchNormalization wrote its running-stat outputs into the bound buffers' memory (the
    kernel may write them in place, NOTE [no writes into inputs]), an allocation choice, not a contract:
    had it not, they would have stayed put without a word. Now the new values are graph outputs the
    module writes back after each run, and onnxruntime reads copies. (They follow ONNX's formula: the
    running variance takes the biased batch variance, torch's the unbiased one, n / (n - 1) apart.)"""
    updates: list[tuple[str, str]] = []
    for node in graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 5 \
                or not any(a.name == "training_mode" and a.i for a in node.attribute):
            continue
        if node.input[3] not in buffers or node.input[4] not in buffers:
            continue
        while len(node.output) < 3:
            node.output.append("")
        for k in (1, 2):
            if not node.output[k]:
                node.output[k] = f"{node.output[0]}__ortmodule_running_{'mean' if k == 1 else 'var'}"
            updates.append((node.input[2 + k], node.output[k]))
    return updates


def _dropout_masks(graph: onnx.GraphProto) -> None:
    """NOTE [dropout mask] (autodiff/rules/norm.py): a Dropout that may run in training mode gets its mask
    output, which its gradient reads. torch.onnx's dynamo exporter writes a train-mode model's dropout
    without one, and such files were refused ("no mask output")."""
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or len(node.input) < 3 \
                or not node.input[2] or (len(node.output) > 1 and node.output[1]):
            continue
        const = producer.get(node.input[2])
        if const is not None and const.op_type == "Constant" and const.attribute \
                and not numpy_helper.to_array(const.attribute[0].t).any():
            continue  # training_mode false: an identity, no mask
        if len(node.output) == 1:
            node.output.append("")
        node.output[1] = f"{node.output[0]}__ortmodule_mask"


def _training_model(
    template: onnx.ModelProto,
    owned: Sequence[str],
    data_inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[str],
    output_format: str,
    stat_outputs: Sequence[str] = (),
) -> ExportedModel:
    """The forward graph in the engine's convention: inputs = data inputs then the owned initializers
    (bound to torch tensors each run), outputs = the selected tensor outputs."""
    model = onnx.ModelProto()
    model.CopyFrom(template)
    if model.functions:
        try:
            model = onnx.inliner.inline_local_functions(model)
        except Exception as exc:
            raise OnnxLoadError(f"cannot inline the model's local functions: {exc}") from exc
    g = model.graph
    _split_sequences(g)
    _dropout_masks(g)
    owned_set = set(owned)
    by_name = {t.name: t for t in g.initializer}
    kept_inits = [t for t in g.initializer if t.name not in owned_set]
    del g.initializer[:]
    g.initializer.extend(kept_inits)
    del g.input[:]
    g.input.extend(data_inputs)
    for name in owned:
        t = by_name[name]
        g.input.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    out_vis = {vi.name: vi for vi in g.output}
    del g.output[:]
    g.output.extend(out_vis[n] for n in outputs)
    # NOTE [running stats]: the new running statistics follow the user outputs (not differentiated)
    reads = {n.output[k]: n.input[2 + k] for n in g.node if n.op_type == "BatchNormalization"
             for k in (1, 2) if len(n.output) > k and n.output[k]}
    for name in stat_outputs:
        t = by_name[reads[name]]
        g.output.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
    _prune(g, [*outputs, *stat_outputs])
    declared = {vi.name: vi for vi in g.value_info}
    del g.value_info[:]
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:
        raise OnnxLoadError(f"ONNX shape inference failed: {exc}") from exc
    # NOTE [declared shapes]: ONNX shape inference loses some shapes that the exporter wrote down (an
    # unoptimised torch.onnx file of Llama: a ReduceMean whose axes come from a Reshape, and every
    # value after it); the rules need at least their ranks. Where inference found no shape, the
    # file's own value_info is used. Where both exist, inference wins: it follows the graph as it is
    # now (the owned initializers became inputs).
    inferred = {vi.name for vi in model.graph.value_info if vi.type.tensor_type.HasField("shape")}
    produced = {o for n in model.graph.node for o in n.output}
    gaps = [vi for name, vi in declared.items() if name not in inferred
            and name in produced and vi.type.tensor_type.HasField("shape")]
    if gaps:  # inference again, from the declared shapes on
        model.graph.value_info.extend(gaps)
        try:
            model = onnx.shape_inference.infer_shapes(model, data_prop=True)
        except Exception as exc:
            raise OnnxLoadError(f"ONNX shape inference failed with the file's declared shapes: {exc}") from exc
    return ExportedModel(
        model=model,
        output_spec=_output_spec(_output_kind(output_format, outputs), outputs),
        num_user_outputs=len(outputs),
        mutated_buffers=tuple(range(len(stat_outputs))),
        opset=_default_opset(model),
    )
