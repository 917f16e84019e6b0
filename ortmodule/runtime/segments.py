"""A graph with torch nodes, run as ORT segments with torch calls between them (NOTE [torch nodes]).

# NOTE [segments]: every node gets a phase: an ORT node can run in segment ``max(phase of what it
# reads)``, where a torch node's outputs count one phase later than the node, and runs in the first
# phase that reads its outputs (NOTE [sunk nodes]). Segment k's ORT nodes run as one session, then
# the torch nodes of phase k, so the ORT parts stay as large as the graph allows (one boundary per
# torch node on a chain). ``Constant`` nodes are copied into every segment that reads them. A value
# crosses a boundary as a torch tensor (DLPack both ways, no copy) and is dropped after its last
# reader.
"""

from __future__ import annotations

import time

import onnx
import torch

from ..passes.proto import node_attrs
from .session import GraphRunner, make_session_options
from .torch_nodes import (
    ATEN_OP,
    CALL_OP,
    GRAD_OP,
    TORCH_DOMAIN,
    decode_args,
    lookup_call,
    resolve_aten,
    run_aten,
    run_backward,
    run_forward,
)


def has_torch_nodes(model: onnx.ModelProto) -> bool:
    return any(n.domain == TORCH_DOMAIN for n in model.graph.node)


def torch_node_count(model: onnx.ModelProto) -> int:
    return sum(n.domain == TORCH_DOMAIN for n in model.graph.node)


def _subgraph_reads(node: onnx.NodeProto) -> list[str]:
    """Outer names the node's subgraphs read (NOTE [captured values] in autodiff/builder.py)."""
    names: list[str] = []

    def visit(g: onnx.GraphProto, defined: set[str]) -> None:
        defined = defined | {i.name for i in g.input} | {i.name for i in g.initializer}
        for n in g.node:
            names.extend(x for x in n.input if x and x not in defined)
            for a in n.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    visit(sub, defined)
            defined |= set(n.output)
        names.extend(o.name for o in g.output if o.name not in defined)

    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            visit(a.g, set())
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                visit(g, set())
    return names


def _tensor(proto: onnx.TensorProto, device: torch.device) -> torch.Tensor:
    import onnx.numpy_helper

    return torch.from_numpy(onnx.numpy_helper.to_array(proto).copy()).to(device)


def _constant(node: onnx.NodeProto, device: torch.device) -> torch.Tensor:
    (a,) = node.attribute
    if a.name == "value":
        return _tensor(a.t, device)
    value = onnx.helper.get_attribute_value(a)
    dtype = {"value_float": torch.float32, "value_floats": torch.float32, "value_int": torch.int64,
             "value_ints": torch.int64}.get(a.name)
    if dtype is None:
        raise RuntimeError(f"torch nodes: a Constant with {a.name!r} cannot be read by a torch node")
    return torch.tensor(list(value) if isinstance(value, (list, tuple)) else value, dtype=dtype, device=device)


def _reads(node: onnx.NodeProto) -> list[str]:
    reads = [x for x in node.input if x]
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        reads += [x for x in _subgraph_reads(node) if x not in reads]
    return reads


_ONNX_OF = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 7,
            torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.bfloat16: 16}


class _TorchStep:
    def __init__(self, node: onnx.NodeProto, used: set[str], types: dict) -> None:
        self.node = node
        self.declared = []  # (elem type, dims: int or None) of each output, as the graph states them
        for o in node.output:
            tt = types[o].type.tensor_type if o in types else None
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] \
                if tt is not None and tt.HasField("shape") else None
            self.declared.append((tt.elem_type if tt is not None else 0, dims))
        self.name = node.name
        self.inputs = list(node.input)
        self.outputs = list(node.output)
        attrs = node_attrs(node)
        self.grad = node.op_type == GRAD_OP
        self.aten = None
        if node.op_type == ATEN_OP:  # NOTE [ATen kernels]
            self.what = attrs["op"]
            self.aten = resolve_aten(attrs["op"])
            self.build_args = decode_args(attrs["args"])
            self.pick = [int(i) for i in attrs["outputs"]]
        elif self.grad:
            self.forward = attrs["forward"]
            self.wanted = [o in used for o in self.outputs]
        else:
            self.key = int(attrs["key"])
            self.grad_inputs = [int(i) for i in attrs.get("grad_inputs", [])]


# NOTE [draw order]: a torch node that draws (a custom Function's noise, ``multinomial`` in
# ``Categorical.sample()``, a gamma draw) takes its numbers from torch's generator while the graph runs,
# so drawing nodes must run in eager's order. Phases alone do not keep it: ``a = multinomial(p1)`` after
# a torch node and ``b = multinomial(p2)`` after none ran b first (phase 0), swapping their streams
# without a word (loss 1.249 vs eager's 1.237). The capture numbers the drawing calls as the trace meets
# them (eager's order); a drawing node is held back to the phase of the one drawn before it, and within
# a phase (whose torch nodes never read each other) they run by that number.
def _draw_indices(nodes: list[onnx.NodeProto]) -> dict[int, int]:
    """Position in ``nodes`` -> eager draw index, for the forward torch nodes that draw."""
    found = {}
    for i, node in enumerate(nodes):
        if node.domain == TORCH_DOMAIN and node.op_type == CALL_OP:
            index = lookup_call(int(node_attrs(node)["key"])).draw_index
            if index is not None:
                found[i] = index
    return found


def _phases(nodes: list[onnx.NodeProto], constants: dict, draws: dict[int, int], floor: dict[int, int]) -> list[int]:
    """Each node's phase (NOTE [segments]); -1 for a constant. ``floor``: position -> the node's least phase."""
    available: dict[str, int] = {}  # value -> the first segment that can read it
    phases: list[int] = []
    for i, node in enumerate(nodes):
        if node.op_type == "Constant" and not node.input:
            phases.append(-1)
            continue
        phase = max((available.get(x, 0) for x in _reads(node) if x not in constants), default=0)
        phase = max(phase, floor.get(i, 0))
        phases.append(phase)
        after = phase + 1 if node.domain == TORCH_DOMAIN else phase
        for o in node.output:
            available[o] = after
    held, latest = dict(floor), 0
    for i in sorted(draws, key=draws.get):  # NOTE [draw order]
        if phases[i] < latest:
            held[i] = latest
        latest = max(latest, phases[i])
    return phases if held == floor else _phases(nodes, constants, draws, held)


def _sink(nodes: list[onnx.NodeProto], phases: list[int]) -> list[int]:
    """NOTE [sunk nodes]: each ORT node moves to the first phase that reads its outputs (never before
    the first that can run it). By ``_phases`` alone, everything that reads only the graph's inputs ran
    in segment 0: every Linear's weight Transpose there, its MatMul after a torch node, where
    onnxruntime can no longer fuse the two into one Gemm, and the transposed weights held across
    every boundary. A/B (2 threads, HF models of benchmarks/bench_zoo.py whose GELU is a custom
    autograd.Function, one torch node per layer; one process, order rotated, 24 reps, fwd+bwd
    medians): bert-cls 150.2 -> 142.8 ms, gpt2-lm 213.5 -> 197.0 ms (eager 155.3 / 261.3). A node
    that nothing reads (a graph output only) stays where it is, and a node moves only into a phase
    that runs ORT nodes anyway: into one of torch calls alone it made a segment of its own (the CNN's
    ReLU masks and BatchNorm's inverse std: backward 7.4-7.9 -> 8.6-9.5 ms; level with this rule,
    medians of five runs 7.68 vs 7.59 ms)."""
    at = {o: i for i, n in enumerate(nodes) for o in n.output}
    readers: list[list[int]] = [[] for _ in nodes]
    for j, node in enumerate(nodes):
        for x in _reads(node):
            i = at.get(x)
            if i is not None and j not in readers[i]:
                readers[i].append(j)
    occupied = sorted({p for n, p in zip(nodes, phases) if p >= 0 and n.domain != TORCH_DOMAIN
                       and not (n.op_type == "Constant" and not n.input)})
    sunk = list(phases)
    for i in reversed(range(len(nodes))):
        if sunk[i] < 0 or nodes[i].domain == TORCH_DOMAIN or not readers[i]:
            continue
        first_read = min(sunk[j] for j in readers[i])
        sunk[i] = max([p for p in occupied if phases[i] <= p <= first_read], default=phases[i])
    return sunk


SPIN_NODES = 32  # NOTE [segment threads]: a segment of at least this many ORT nodes spins


class SegmentedRunner:
    """Runs one ONNX model holding torch nodes: same interface as :class:`GraphRunner`, plus the
    run's torch-node ``state`` (NOTE [torch nodes])."""

    def __init__(self, model: onnx.ModelProto, device: torch.device, options_factory=None,
                 stable_inputs: frozenset[str] = frozenset()) -> None:
        self.device = device
        graph = model.graph
        self.input_names = [i.name for i in graph.input]
        self.output_names = [o.name for o in graph.output]
        inferred = onnx.shape_inference.infer_shapes(model)
        types = {vi.name: vi for vi in [*inferred.graph.value_info, *graph.value_info, *graph.input,
                                         *graph.output]}
        initializers = {t.name: t for t in graph.initializer}
        constants = {o: n for n in graph.node if n.op_type == "Constant" and not n.input for o in n.output}
        nodes = list(graph.node)
        draws = _draw_indices(nodes)
        phases = _sink(nodes, _phases(nodes, constants, draws, {}))
        n_phases = max(phases, default=0) + 1
        used = {x for n in graph.node for x in _reads(n)} | set(self.output_names)
        # plan: per phase, the ORT nodes, then the torch nodes
        ort_nodes: list[list[onnx.NodeProto]] = [[] for _ in range(n_phases)]
        torch_nodes: list[list[onnx.NodeProto]] = [[] for _ in range(n_phases)]
        torch_at: list[list[int]] = [[] for _ in range(n_phases)]
        for i, (node, phase) in enumerate(zip(nodes, phases)):
            if phase < 0:
                continue
            if node.domain == TORCH_DOMAIN:
                torch_at[phase].append(i)
            else:
                ort_nodes[phase].append(node)
        for k, at in enumerate(torch_at):  # NOTE [draw order]: one phase's torch nodes never read each other
            slots = [j for j, i in enumerate(at) if i in draws]
            for j, i in zip(slots, sorted((at[j] for j in slots), key=draws.get)):
                at[j] = i
            torch_nodes[k] = [nodes[i] for i in at]
        later_reads: list[set[str]] = []  # what phases > k read (or the graph returns)
        reads_after: set[str] = set(self.output_names)
        for k in reversed(range(n_phases)):
            later_reads.append(set(reads_after))
            for n in ort_nodes[k] + torch_nodes[k]:
                reads_after.update(_reads(n))
        later_reads.reverse()
        self.steps: list = []
        self.n_segments = 0
        make_options = options_factory or (lambda segment=0, **kw: make_session_options(**kw))
        for k in range(n_phases):
            torch_reads = {x for n in torch_nodes[k] for x in _reads(n)}
            if any(o in later_reads[k] or o in torch_reads for n in ort_nodes[k] for o in n.output):
                seg = self._segment(model, ort_nodes[k], constants, initializers, types,
                                    later_reads[k] | torch_reads, k)
                # NOTE [segment threads]: torch calls sit between these runs, and after each of them
                # torch's OpenMP workers spin (for milliseconds with libgomp's defaults, torch imported
                # first); ORT workers spinning beside them halve both. Small segments do not spin: CNN
                # fwd+bwd with torch imported first 24.3 -> 18.3 ms median (eager 17.5). A segment of
                # many nodes does (its run releases torch's workers first, NOTE [omp pause]): without
                # spinning, each of its parallel ops waits for a parked ORT worker to wake. A/B (HF
                # models with a custom-Function GELU per layer, segments of 21-182 nodes, one process,
                # fwd+bwd medians, two runs): bert-cls 150 / 145 -> 116 / 117 ms, gpt2-lm 197 -> 176
                # ms; all segments spinning, the CNN (segments of 2-11 nodes) went +1-3% on average
                # (noise-level) and ConvNeXt (4-103) stayed level.
                options = make_options(spinning=len(ort_nodes[k]) >= SPIN_NODES, segment=self.n_segments)
                runner = GraphRunner(seg, device, options, stable_inputs=stable_inputs)
                self.steps.append(("ort", runner, runner.output_names))
                self.n_segments += 1
            for node in torch_nodes[k]:
                self.steps.append(("torch", _TorchStep(node, used, types), None))
        # Constants and initializers live inside the segments that read them; a torch node that reads
        # one gets it as a tensor made once here.
        self._fixed: dict[str, torch.Tensor] = {}
        for kind, step, _ in self.steps:
            if kind != "torch":
                continue
            for x in step.inputs:
                if x in constants and x not in self._fixed:
                    self._fixed[x] = _constant(constants[x], device)
                elif x in initializers and x not in self._fixed:
                    self._fixed[x] = _tensor(initializers[x], device)
        # NOTE [segments]: each value is dropped after the last step that reads it
        last: dict[str, int] = {}
        for i, (kind, step, _) in enumerate(self.steps):
            reads = step.input_names if kind == "ort" else step.inputs
            for x in reads:
                last[x] = i
        keep = set(self.output_names)
        self._drop = [[x for x, i in last.items() if i == s and x not in keep] for s in range(len(self.steps))]
        self.boundary_s = 0.0  # time spent in torch nodes and at the boundaries (NOTE [segments])
        self.torch_calls = 0

    @staticmethod
    def _segment(model, nodes, constants, initializers, types, wanted_after, k) -> onnx.ModelProto:
        produced = {o for n in nodes for o in n.output}
        reads: list[str] = []
        for n in nodes:
            reads.extend(x for x in _reads(n) if x not in produced and x not in reads)
        const_nodes = [constants[x] for x in reads if x in constants]
        inits = [initializers[x] for x in reads if x in initializers]
        feeds = [x for x in reads if x not in constants and x not in initializers]
        outputs = [o for n in nodes for o in n.output if o and o in wanted_after]

        def info(name: str) -> onnx.ValueInfoProto:
            vi = types.get(name)
            if vi is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.elem_type:
                raise RuntimeError(f"torch nodes: the type of {name!r}, which crosses a segment boundary, is unknown")
            out = onnx.ValueInfoProto()
            out.CopyFrom(vi)
            out.name = name
            return out

        graph = onnx.helper.make_graph(const_nodes + list(nodes), f"{model.graph.name}_segment{k}",
                                       [info(x) for x in feeds], [info(x) for x in outputs], inits)
        seg = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
        seg.functions.extend(model.functions)
        return seg

    def run(self, feeds: dict[str, torch.Tensor], state: dict | None = None,
            keep_state: bool = False) -> list[torch.Tensor]:
        values = {**self._fixed, **feeds}
        t_torch = 0.0
        for i, (kind, step, names) in enumerate(self.steps):
            if kind == "ort":
                values.update(zip(names, step.run(values)))
            else:
                t0 = time.perf_counter()
                self._run_torch(step, values, state, keep_state)
                t_torch += time.perf_counter() - t0
            for x in self._drop[i]:
                values.pop(x, None)
        self.boundary_s += t_torch
        return [values[n] for n in self.output_names]

    def _run_torch(self, step: _TorchStep, values: dict, state: dict | None, keep_state: bool) -> None:
        self.torch_calls += 1
        if step.aten is not None:
            outs = run_aten(step.aten, step.build_args, step.pick, [values[x] if x else None for x in step.inputs])
            self._check(step, outs, step.what)
            values.update(zip(step.outputs, outs))
            return
        if step.grad:
            grads = [values[x] if x else None for x in step.inputs]
            results = run_backward(step.forward, grads, step.wanted, state, keep_state)
            for name, r in zip(step.outputs, results):
                if r is not None:
                    values[name] = r
            return
        outs = run_forward(step.key, step.name, [values[x] for x in step.inputs], step.grad_inputs, state)
        if len(outs) != len(step.outputs):
            raise RuntimeError(f"torch node {step.name!r} returned {len(outs)} tensors where the graph has "
                               f"{len(step.outputs)}: its outputs depend on more than the captured shapes")
        self._check(step, outs, lookup_call(step.key).what)
        values.update(zip(step.outputs, outs))

    @staticmethod
    def _check(step: _TorchStep, outs: list[torch.Tensor], what: str) -> None:
        for name, t, (elem, dims) in zip(step.outputs, outs, step.declared):
            if (elem and _ONNX_OF.get(t.dtype) != elem) or (dims is not None and (
                    len(dims) != t.dim() or any(d is not None and d != s for d, s in zip(dims, t.shape)))):
                raise RuntimeError(
                    f"torch node {step.name!r} ({what}) returned {name!r} as "
                    f"{t.dtype} {tuple(t.shape)}, where the graph has type {elem} and dims {dims}: "
                    "its result depends on more than the captured shapes and dtypes")

    @property
    def session(self):
        """The first ORT segment's session (profiling); see :attr:`sessions`."""
        return next(step.session for kind, step, _ in self.steps if kind == "ort")

    @property
    def sessions(self) -> list:
        return [step.session for kind, step, _ in self.steps if kind == "ort"]
