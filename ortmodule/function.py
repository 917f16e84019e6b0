"""The ``torch.autograd.Function`` seam between PyTorch autograd and the ORT sessions.

Calling convention (STYLE.md §6): the forward session returns the user outputs, then the new values
of mutated buffers, then the saved values; the backward session takes the saved values followed by the
output gradients and returns the gradients of the inputs that require grad. Outputs that carry no
gradient are marked non-differentiable; inputs that need no grad get ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import DoubleBackwardError
from .runtime.entry import CompiledEntry

# NOTE [no double backward]: the ORT backward is a black box to autograd, so its results cannot be
# differentiated again. ``once_differentiable`` is no guard: with grad_outputs that need no grad
# (the default ones of ``autograd.grad(out, x, create_graph=True)``) it returns plain tensors, and
# a gradient penalty built on them (WGAN-GP, R1) silently adds nothing to the loss's gradient. The
# engine runs a backward with grad mode = ``create_graph``, so grad mode at entry tells; we raise.
_DOUBLE_BACKWARD = (
    "double backward / create_graph=True is not supported by ORTModule: the gradient computed by "
    "ONNX Runtime cannot be differentiated again, so a term built on it (a gradient penalty, a "
    "Hessian) would silently contribute nothing. Compute this term with the unwrapped module "
    "`model.module` (eager PyTorch), or pass create_graph=False where no second-order gradient "
    "is needed."
)


def write_back(buffers: Sequence[torch.Tensor], new_values: Sequence[torch.Tensor]) -> None:
    if not buffers:
        return  # entering no_grad costs ~15 us a call
    with torch.no_grad():
        for buf, new in zip(buffers, new_values):
            buf.copy_(new)


class ValueCheckFailed(Exception):
    """A value check of the forward (NOTE [value checks]) did not hold on this call's inputs."""


def check_values(exported, outs: Sequence[torch.Tensor], n_mutated: int) -> None:
    """Raise :class:`ValueCheckFailed` where the graph's value check output is false (NOTE [value checks]):
    read before any buffer is written back, so the eager forward that then raises starts from the same state."""
    if exported.checks and not bool(outs[exported.num_user_outputs + n_mutated]):
        raise ValueCheckFailed(", ".join(exported.checks))


def functorch_level() -> int | None:
    """The current torch.func transform level, or None outside any transform (NOTE [functorch transforms]
    in module.py: the Function below cannot be seen through by them)."""
    try:
        return torch._C._functorch.maybe_current_level()
    except AttributeError:  # a torch without functorch's C bindings
        return None


class ORTFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry: CompiledEntry, names: tuple[str, ...], mutated: tuple, *tensors: torch.Tensor):
        graphs = entry.graphs
        assert graphs is not None
        feeds = dict(zip(names, tensors))
        # NOTE [torch nodes]: what the forward's torch calls recorded, for the backward's
        ctx.torch_state = {} if entry.has_torch_nodes else None
        outs = entry.forward.run(feeds, ctx.torch_state)
        n_user = entry.exported.num_user_outputs
        n_mut = len(mutated)
        check_values(entry.exported, outs, n_mut)
        write_back(mutated, outs[n_user : n_user + n_mut])
        by_name = dict(zip(graphs.forward_outputs, outs))
        ctx.entry = entry
        ctx.names = names
        ctx.set_materialize_grads(False)  # NOTE [absent output grads]
        ctx.out_meta = [(t.shape, t.dtype, t.device) for t in outs[:n_user]]
        # NOTE [saved values]: intermediates are saved through save_for_backward too, so autograd
        # frees them after the backward (or keeps them for retain_graph=True), as in eager.
        ctx.save_for_backward(*[feeds[n] for n in graphs.saved_inputs],
                              *[by_name[n] for n in graphs.saved_outputs])
        user = outs[:n_user]
        diff = set(graphs.diff_outputs)
        non_diff = [t for i, t in enumerate(user) if i not in diff]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(user)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        if torch.is_grad_enabled():  # NOTE [no double backward]
            raise DoubleBackwardError(_DOUBLE_BACKWARD)
        entry: CompiledEntry = ctx.entry
        graphs = entry.graphs
        assert graphs is not None
        feeds = dict(zip(graphs.saved_inputs + graphs.saved_outputs, ctx.saved_tensors))
        n_saved = len(graphs.saved_inputs) + len(graphs.saved_outputs)
        absent = frozenset(i for i in graphs.diff_outputs if grad_outputs[i] is None)
        if len(absent) == len(graphs.diff_outputs):
            return (None, None, None, *[None for _ in ctx.names])
        special = entry.backward_without(absent) if absent else None
        runner, targets = special if special is not None else (entry.backward, graphs.grad_targets)
        for name, i in zip(graphs.backward_inputs[n_saved:], graphs.diff_outputs):
            grad = grad_outputs[i]
            if grad is None:
                if special is not None:
                    continue  # the specialised backward does not read it
                shape, dtype, device = ctx.out_meta[i]
                grad = torch.zeros(shape, dtype=dtype, device=device)
            feeds[name] = grad
        keep = ctx.torch_state is not None and torch._C._autograd._get_current_graph_task_keep_graph()
        results = dict(zip(targets, runner.run(feeds, ctx.torch_state, keep)))
        if absent:  # NOTE [unreached targets]: None, as eager, where only absent outputs reach
            for name in entry.unreached_targets(absent):
                results.pop(name, None)
        return (None, None, None, *[results.get(n) for n in ctx.names])
