"""A compiled entry: everything built for one input signature, sessions created on first use."""

from __future__ import annotations

import time

import onnx
import torch

from ..export import ExportedModel
from ..export.torchscript import is_state_input
from ..options import logger
from ..partition import TrainingGraphs, build_training_graphs
from ..passes import optimize_inference
from ..passes.backward import run_backward_passes
from ..passes.zero_grads import specialise_zero_grads
from ..recompute import RecomputePolicy
from .segments import SegmentedRunner, has_torch_nodes
from .session import GraphRunner, make_session_options


class CompiledEntry:
    """The forward graph of one signature and, when gradients are needed, its training graphs
    (built here, or ``prebuilt``: loaded from the persistent cache).

    Sessions are created on first use or by :meth:`create_sessions` (ORTModule calls it when it
    builds the entry, so that load errors can still fall back to eager).
    """

    def __init__(
        self,
        exported: ExportedModel,
        device: torch.device,
        requires_grad: dict[str, bool] | None,
        stats=None,
        profile_prefix: str | None = None,
        prebuilt: tuple[TrainingGraphs, onnx.ModelProto] | None = None,
        recompute: RecomputePolicy | None = None,
    ) -> None:
        self.exported = exported
        self.profile_prefix = profile_prefix
        # Parameters and buffers: the forward graph's inputs other than user inputs and dropout masks.
        self.stable_inputs = frozenset(
            vi.name for vi in exported.model.graph.input if is_state_input(vi.name)
        )
        self.device = device
        self.stats = stats
        self.graphs: TrainingGraphs | None = None
        self._inference: GraphRunner | None = None
        self._forward: GraphRunner | None = None
        self._backward: GraphRunner | None = None
        # absent output-gradient positions -> (runner, grad targets) or None (NOTE [absent output grads])
        self._partial_backward: dict[frozenset[int], tuple[GraphRunner, list[str]] | None] = {}
        self._unreached: dict[frozenset[int], frozenset[str]] = {}  # NOTE [unreached targets]
        # The backward model the session runs: ``graphs.backward`` after the backward passes.
        self.backward_model: onnx.ModelProto | None = None
        self._has_torch: bool | None = None
        if requires_grad is not None and prebuilt is not None:  # NOTE [persistent cache]
            self.graphs, self.backward_model = prebuilt
        elif requires_grad is not None:
            t0 = time.perf_counter()
            self.graphs = build_training_graphs(exported, requires_grad, recompute)
            if self.graphs.recompute is not None and self.graphs.recompute.recomputed:
                logger.info("%s", self.graphs.recompute.table())
            self.backward_model = _for_session(self.graphs.backward)
            if stats is not None:
                stats.gradient_build_s += time.perf_counter() - t0

    @property
    def has_torch_nodes(self) -> bool:
        """Whether the training forward holds torch nodes (NOTE [torch nodes])."""
        if self._has_torch is None:
            self._has_torch = self.graphs is not None and has_torch_nodes(self.graphs.forward)
        return self._has_torch

    def _runner(self, model) -> GraphRunner:
        t0 = time.perf_counter()
        if has_torch_nodes(model):  # NOTE [segments]
            runner = SegmentedRunner(model, self.device,
                                     lambda segment=0, **kw: make_session_options(
                                         profile_prefix=_segment_prefix(self.profile_prefix, model, segment), **kw),
                                     stable_inputs=self.stable_inputs)
        else:
            runner = GraphRunner(model, self.device, make_session_options(profile_prefix=self.profile_prefix),
                                 stable_inputs=self.stable_inputs)
        if self.stats is not None:
            self.stats.session_create_s += time.perf_counter() - t0
        return runner

    @property
    def inference(self) -> GraphRunner:
        if self._inference is None:
            self._inference = self._runner(optimize_inference(self.exported.model))
        return self._inference

    @property
    def forward(self) -> GraphRunner:
        if self._forward is None:
            assert self.graphs is not None
            self._forward = self._runner(self.graphs.forward)
        return self._forward

    @property
    def backward(self) -> GraphRunner:
        if self._backward is None:
            assert self.graphs is not None
            assert self.backward_model is not None
            self._backward = self._runner(self.backward_model)
        return self._backward

    def backward_without(self, absent: frozenset[int]) -> tuple[GraphRunner, list[str]] | None:
        """The backward for when the gradients of user outputs ``absent`` are ``None``.

        Returns the runner and the forward-input names its outputs are the gradients of, or ``None``
        where the full backward must run on materialised zeros (NOTE [absent output grads]).
        """
        if absent not in self._partial_backward:
            graphs = self.graphs
            assert graphs is not None
            n_saved = len(graphs.saved_inputs) + len(graphs.saved_outputs)
            grad_inputs = graphs.backward_inputs[n_saved:]
            zero = {name for name, i in zip(grad_inputs, graphs.diff_outputs) if i in absent}
            t0 = time.perf_counter()
            special = specialise_zero_grads(graphs.backward, zero)
            if self.stats is not None:
                self.stats.gradient_build_s += time.perf_counter() - t0
            if special is None:
                self._partial_backward[absent] = None
            else:
                target_of = dict(zip(graphs.backward_outputs, graphs.grad_targets))
                runner = self._runner(_for_session(special.model))
                self._partial_backward[absent] = (runner, [target_of[o] for o in special.outputs])
                # NOTE [unused full backward]: the full backward's session was made when the entry was
                # built, to fail there if ORT cannot load it; a model whose extra outputs get no
                # gradient (an HF model's logits beside its loss) never runs it. Its session is
                # released here and made again on first use (BERT: 34 MB of peak RSS).
                self._backward = None
        return self._partial_backward[absent]

    def unreached_targets(self, absent: frozenset[int]) -> frozenset[str]:
        """The grad targets that only user outputs in ``absent`` reach: their gradient is ``None``
        (NOTE [unreached targets])."""
        found = self._unreached.get(absent)
        if found is None:
            graphs = self.graphs
            assert graphs is not None
            if len(graphs.target_outputs) != len(graphs.grad_targets):
                raise RuntimeError("TrainingGraphs.target_outputs does not match grad_targets: "
                                   "build the graphs with partition.build_training_graphs")
            found = frozenset(t for t, outs in zip(graphs.grad_targets, graphs.target_outputs)
                              if outs <= absent)
            self._unreached[absent] = found
        return found

    def create_sessions(self) -> None:
        """Create the sessions this entry runs: forward and backward, or inference only."""
        if self.graphs is None:
            _ = self.inference
        else:
            _ = self.forward, self.backward

    def end_profiling(self) -> list[str]:
        runners = [self._inference, self._forward, self._backward]
        runners += [p[0] for p in self._partial_backward.values() if p is not None]
        return [s.end_profiling() for r in runners if r is not None for s in getattr(r, "sessions", [r.session])]


def _segment_prefix(prefix: str | None, model: onnx.ModelProto, segment: int) -> str | None:
    """A profile file prefix of its own per segment (sessions made in the same second would write one
    file otherwise)."""
    return None if prefix is None else f"{prefix}_{model.graph.name}_seg{segment}"


def _for_session(backward: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a backward model with the backward passes applied (NOTE [label grad folding],
    NOTE [sum as adds]). ``TrainingGraphs.backward`` keeps the plain form: the absent-gradient
    specialisation reads its Sums as accumulations."""
    model = onnx.ModelProto()
    model.CopyFrom(backward)
    run_backward_passes(model)
    return model
