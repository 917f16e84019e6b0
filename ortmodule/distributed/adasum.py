"""Adasum (Maleki et al., 2021) as a DDP communication hook.

Adaptive summation combines two gradients ``a`` and ``b`` as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is their sum when they are orthogonal and their average when they are equal, so learning-rate
schedules tuned for one worker stay usable at larger scale. Over ``2^k`` ranks the pairwise rule is
applied hierarchically by recursive doubling: at level ``l`` rank ``r`` exchanges its partial result
with rank ``r ^ 2^l`` and both compute the same combination (the lower rank's vector as ``a``, so the
two ranks agree bit for bit). After ``k`` levels every rank holds

    adasum(... adasum(adasum(g0, g1), adasum(g2, g3)) ...)

A world size that is not a power of two is folded first: rank ``p + i`` (beyond the largest power of
two ``p``) sends its gradient to rank ``i``, which combines the two with the pairwise rule before the
recursion, and receives the final result afterwards.

As in the paper (and Horovod), the rule is applied per layer: each parameter's slice of a DDP bucket
gets its own dot products. ``per_tensor=False`` treats the whole bucket as one vector instead.

Usage::

    ddp = DDP(ORTModule(model))
    ddp.register_comm_hook(AdasumState(), adasum_hook)   # or state=None: default group, per tensor
"""

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["AdasumState", "adasum_hook", "adasum_pair", "adasum_reduce"]


@dataclasses.dataclass
class AdasumState:
    """State of :func:`adasum_hook`: the process group (``None``: the default one) and granularity."""

    process_group: dist.ProcessGroup | None = None
    per_tensor: bool = True
    eps: float = 1e-30  # |a|^2 below this counts as a zero vector (its coefficient is then 1)


def _coeffs(a: torch.Tensor, b: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Dot products in float64: the coefficients are the only non-linear part, keep them exact.
    a64, b64 = a.double(), b.double()
    dot = torch.dot(a64, b64)
    na, nb = torch.dot(a64, a64), torch.dot(b64, b64)
    ca = torch.where(na > eps, 1.0 - dot / (2.0 * na.clamp_min(eps)), torch.ones_like(na))
    cb = torch.where(nb > eps, 1.0 - dot / (2.0 * nb.clamp_min(eps)), torch.ones_like(nb))
    return ca, cb


def adasum_pair(
    a: torch.Tensor, b: torch.Tensor, splits: list[int] | None = None, eps: float = 1e-30
) -> torch.Tensor:
    """The pairwise Adasum of two flat vectors; ``splits`` (sizes summing to ``numel``) applies it
    separately to each slice (one per layer)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if splits is None:
        splits = [a.numel()]
    out = torch.empty_like(a)
    offset = 0
    for n in splits:
        sa, sb = a[offset : offset + n], b[offset : offset + n]
        ca, cb = _coeffs(sa, sb, eps)
        out[offset : offset + n] = (ca * sa.double() + cb * sb.double()).to(a.dtype)
        offset += n
    if offset != a.numel():
        raise ValueError(f"adasum_pair: splits sum to {offset}, but the vectors have {a.numel()} elements")
    return out


def _exchange(t: torch.Tensor, peer: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send ``t`` to ``peer`` and receive its tensor of the same shape (group ranks)."""
    other = torch.empty_like(t)
    g_peer = peer if group is None else dist.get_global_rank(group, peer)
    ops = [dist.P2POp(dist.isend, t, g_peer, group), dist.P2POp(dist.irecv, other, g_peer, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return other


def adasum_reduce(
    t: torch.Tensor,
    splits: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-30,
) -> torch.Tensor:
    """Adasum of ``t`` over every rank of ``group`` (recursive doubling); every rank gets the result."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    flat = t.reshape(-1).contiguous()
    if world == 1:
        return flat.clone()
    p = 1 << (world.bit_length() - 1)  # largest power of two <= world
    # Fold the ranks beyond p into their partners.
    if rank >= p:
        g_peer = rank - p if group is None else dist.get_global_rank(group, rank - p)
        dist.send(flat, g_peer, group)
        result = torch.empty_like(flat)
        dist.recv(result, g_peer, group)
        return result
    acc = flat
    if rank + p < world:
        other = torch.empty_like(flat)
        g_peer = rank + p if group is None else dist.get_global_rank(group, rank + p)
        dist.recv(other, g_peer, group)
        acc = adasum_pair(acc, other, splits, eps)
    level = 1
    while level < p:
        peer = rank ^ level
        other = _exchange(acc, peer, group)
        acc = adasum_pair(acc, other, splits, eps) if rank < peer else adasum_pair(other, acc, splits, eps)
        level <<= 1
    if rank + p < world:
        g_peer = rank + p if group is None else dist.get_global_rank(group, rank + p)
        dist.send(acc, g_peer, group)
    return acc


def _bucket_splits(bucket: dist.GradBucket) -> list[int]:
    return [p.numel() for p in bucket.parameters()]


# NOTE [hook annotations]: DDP checks a hook's annotations at registration and accepts only the
# real objects dist.GradBucket / torch.futures.Future[torch.Tensor], so this file does not use
# ``from __future__ import annotations`` (which would turn them into strings).
def adasum_hook(
    state: AdasumState | dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: replace the bucket's gradients by their Adasum over the ranks.

    ``state`` is an :class:`AdasumState`, a process group, or ``None`` (default group, per tensor).
    The local gradients enter unscaled (DDP hands a hook the raw local sums), and the result is not
    divided by the world size: Adasum is already an average for parallel gradients.
    """
    if not isinstance(state, AdasumState):
        state = AdasumState(process_group=state)
    buf = bucket.buffer()
    splits = _bucket_splits(bucket) if state.per_tensor else None
    if splits is not None and sum(splits) != buf.numel():
        splits = None  # unexpected bucket layout: fall back to one vector
    result = adasum_reduce(buf, splits, state.process_group, state.eps)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(result.view_as(buf))
    return fut
