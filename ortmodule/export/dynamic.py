"""Dynamic shapes: one export serves many batch sizes / sequence lengths where the model permits.

# NOTE [dynamic shapes]: an export marks all dims of the user's tensor inputs as symbolic (with the
# torch.export front end, from the second shapes of a signature on: NOTE [static first]). The
# tracer turns sizes read through ``x.shape`` into Shape ops, but a size that reaches Python (a loop
# bound, a baked Reshape target) silently becomes a constant. So a graph is trusted for other shapes
# only after it is seen to be the same graph: when a call comes with a shape that differs in dims not
# yet verified, the module is exported again at that shape and the two graphs (nodes, attributes,
# constants) are compared. Equal: those dims are verified and the first graph (with its compiled
# sessions) serves every shape that differs only in verified dims. Different: the model is shape-
# specialised and each shape gets its own export from then on. Dropout mask shapes are matched to
# input dims across the observed exports the same way.
#
# NOTE [batch-dynamic graphs]: some gradient rules need sizes the forward graph leaves symbolic (a
# Conv's spatial dims). When the all-dims-dynamic graph cannot be differentiated, the module is
# exported again with only dim 0 of each input symbolic; that graph is verified across batch sizes
# as above and serves every shape that differs only in dim 0 (a partial last batch). A shape that
# differs elsewhere (another image size) gets a batch-dynamic graph of its own, verified across batch
# sizes in turn. Only if the batch-dynamic graph fails too is the model shape-specialised.
#
# NOTE [shape-conditional graphs]: Python that reads an input size (``if x.shape[0] >= 4``,
# ``range(x.size(1))``; NOTE [trace traps]) may take another branch at another size, and two
# exports agreeing at batch 8 and 6 prove nothing about batch 2. Such a graph serves only the exact
# shapes it was exported or verified at: each new shape is exported again and compared (the
# sessions are still shared when the graphs agree), never assumed.
"""

from __future__ import annotations

import dataclasses

import onnx

from .semantics import MaskSpec
from .torchscript import ExportedModel

Shapes = tuple[tuple[int, ...], ...]


def non_batch_dims(shapes: Shapes) -> Shapes:
    """Each input's sizes but the first: what a batch-dynamic graph has fixed."""
    return tuple(s[1:] for s in shapes)


def _attribute_key(a: onnx.AttributeProto) -> bytes:
    # NOTE [constant names]: onnx_ir's get_const_tensor names a Constant's tensor after its output,
    # in the proto it wraps: the passes do that to the reference export when they build its
    # training graphs, so a fresh export at another shape differed by names alone. Names are not values.
    if a.type == onnx.AttributeProto.TENSOR and a.t.name:
        a = onnx.AttributeProto.FromString(a.SerializeToString())
        a.t.ClearField("name")
    return a.SerializeToString()


def graph_fingerprint(model: onnx.ModelProto) -> tuple:
    """Nodes (ops, wiring, attributes) and constants: what must match for two exports to agree."""
    g = model.graph
    nodes = tuple(
        (n.domain, n.op_type, tuple(n.input), tuple(n.output), tuple(_attribute_key(a) for a in n.attribute))
        for n in g.node
    )
    inits = tuple((t.name, t.SerializeToString()) for t in g.initializer)
    return nodes, inits, tuple(i.name for i in g.input), tuple(o.name for o in g.output)


def _resolve_masks(observations: list[tuple[Shapes, tuple[MaskSpec, ...]]]) -> tuple[MaskSpec, ...] | None:
    """Express each mask dim as a constant or an input dim, consistent with every observation.

    A dim equal in every observation is a constant (if it really follows an input dim that has not
    varied yet, a call varying that dim is not covered and triggers a new verification).
    """
    _, ref_masks = observations[0]
    if any(len(m) != len(ref_masks) for _, m in observations):
        return None
    resolved = []
    for k, spec in enumerate(ref_masks):
        if any(len(masks[k].shape) != len(spec.shape) for _, masks in observations):
            return None
        dims: list = []
        for d in range(len(spec.shape)):
            values = [masks[k].shape[d] for _, masks in observations]
            if len(set(values)) == 1:
                dims.append(values[0])
                continue
            source = _matching_input_dim(values, observations)
            if source is None:
                return None
            dims.append(source)
        resolved.append(dataclasses.replace(spec, dims=tuple(dims)))
    return tuple(resolved)


def _matching_input_dim(values: list[int], observations) -> tuple[int, int] | None:
    shapes0 = observations[0][0]
    for i, shape in enumerate(shapes0):
        for j in range(len(shape)):
            if all(obs[0][i][j] == v for obs, v in zip(observations, values)):
                return (i, j)
    return None


@dataclasses.dataclass
class DynamicExport:
    """The shape-generic candidate for one signature-without-shapes."""

    reference: ExportedModel
    ref_shapes: Shapes
    fingerprint: tuple
    observations: list[tuple[Shapes, tuple[MaskSpec, ...]]]
    verified: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    static: bool = False  # the graph was seen to change with the shape
    exact: set[Shapes] = dataclasses.field(default_factory=set)  # shapes a conditional graph serves
    # NOTE [shape guards]: torch.export graphs, each serving the shapes its guard admits; a shape
    # none admits is exported again, and that graph joins them.
    guarded: list[ExportedModel] = dataclasses.field(default_factory=list)

    @property
    def shape_conditional(self) -> bool:
        """NOTE [shape-conditional graphs]: the graph holds only for the shapes in ``exact``."""
        return bool(self.reference.shape_conditions)

    @classmethod
    def start(cls, exported: ExportedModel, shapes: Shapes) -> DynamicExport:
        if exported.guard is not None:
            return cls(exported, shapes, (), [], guarded=[exported])
        return cls(exported, shapes, graph_fingerprint(exported.model), [(shapes, exported.masks)], exact={shapes})

    def served(self, shapes: Shapes) -> ExportedModel:
        """The graph that serves ``shapes`` (after ``covers`` or ``verify`` said one does)."""
        for exported in self.guarded:
            if exported.guard.covers(shapes):
                return exported
        return self.reference

    @property
    def batch_only(self) -> bool:
        return self.reference.batch_only

    def differing_dims(self, shapes: Shapes) -> set[tuple[int, int]]:
        return {(i, j) for i, (a, b) in enumerate(zip(self.ref_shapes, shapes)) for j in range(len(a)) if a[j] != b[j]}

    def covers(self, shapes: Shapes) -> bool:
        if self.guarded:
            return any(e.guard.covers(shapes) for e in self.guarded)
        if self.static:
            return False
        if self.shape_conditional:
            return shapes in self.exact
        return self.differing_dims(shapes) <= self.verified

    def may_serve(self, shapes: Shapes) -> bool:
        """Whether a graph exported at ``shapes`` could be verified to be this one: a batch-only
        graph has the other dims fixed, so it serves only shapes that differ in dim 0."""
        return not self.batch_only or all(j == 0 for _, j in self.differing_dims(shapes))

    def verify(self, candidate: ExportedModel, shapes: Shapes) -> bool:
        """Compare ``candidate`` (exported at ``shapes``) with the reference; True if it can serve."""
        if candidate.guard is not None and self.guarded:
            self.guarded.append(candidate)
            del self.guarded[:-8]  # the most recent few (a model specialised on every size grows no list)
            return candidate.guard.covers(shapes)
        if self.static or not self.may_serve(shapes):
            return False
        if candidate.shape_conditions and not self.reference.shape_conditions:
            self.reference.shape_conditions = candidate.shape_conditions
        if graph_fingerprint(candidate.model) != self.fingerprint:
            self.static = True
            return False
        observations = self.observations + [(shapes, candidate.masks)]
        masks = _resolve_masks(observations)
        if masks is None:
            self.static = True
            return False
        self.observations = observations
        self.verified |= self.differing_dims(shapes)
        self.exact.add(shapes)
        self.reference.masks = masks
        return True
