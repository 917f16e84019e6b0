"""Dynamic shapes: one export serves many batch sizes / sequence lengths where the model permits.

# NOTE [dynamic shapes]: every export marks all dims of the user's tensor inputs as symbolic. The
# tracer turns sizes read through ``x.shape`` into Shape ops, but a size that reaches Python (a loop
# bound, a baked Reshape target) silently becomes a constant. So a graph is trusted for other shapes
# only after it is seen to be the same graph: when a call comes with a shape that differs in dims not
# yet verified, the module is exported again at that shape and the two graphs (nodes, attributes,
# constants) are compared. Equal: those dims are verified and the first graph (with its compiled
# sessions) serves every shape that differs only in verified dims. Different: the model is shape-
# specialised and each shape gets its own export from then on. Dropout mask shapes are matched to
# input dims across the observed exports the same way.
"""

from __future__ import annotations

import dataclasses

import onnx

from .semantics import MaskSpec
from .torchscript import ExportedModel

Shapes = tuple[tuple[int, ...], ...]


def graph_fingerprint(model: onnx.ModelProto) -> tuple:
    """Nodes (ops, wiring, attributes) and constants: what must match for two exports to agree."""
    g = model.graph
    nodes = tuple(
        (n.domain, n.op_type, tuple(n.input), tuple(n.output), tuple(a.SerializeToString() for a in n.attribute))
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

    @classmethod
    def start(cls, exported: ExportedModel, shapes: Shapes) -> DynamicExport:
        return cls(exported, shapes, graph_fingerprint(exported.model), [(shapes, exported.masks)])

    def differing_dims(self, shapes: Shapes) -> set[tuple[int, int]]:
        return {(i, j) for i, (a, b) in enumerate(zip(self.ref_shapes, shapes)) for j in range(len(a)) if a[j] != b[j]}

    def covers(self, shapes: Shapes) -> bool:
        return not self.static and self.differing_dims(shapes) <= self.verified

    def verify(self, candidate: ExportedModel, shapes: Shapes) -> bool:
        """Compare ``candidate`` (exported at ``shapes``) with the reference; True if it can serve."""
        if self.static:
            return False
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
        self.reference.masks = masks
        return True
