"""Issue 6: checkpoints. A wrapped model's state_dict + optimizer state saved mid-training resumes,
in a fresh ORTModule or in the plain model, exactly where the uninterrupted run goes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

from .helpers import assert_close

STEPS, SAVE_AT = 6, 3


def model() -> nn.Module:
    # No bias before the BatchNorm: its gradient is 0 up to rounding, which AdamW would amplify.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64, bias=False), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(STEPS)]


def make_opt(m: nn.Module):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return opt, sched


def train(m, opt, sched, data) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach())
    return losses


def test_checkpoint_resume_wrapped_and_unwrapped(tmp_path):
    data = batches()
    # Uninterrupted run.
    full = ORTModule(model())
    ref = train(full, *make_opt(full), data)

    # Interrupted run: train SAVE_AT steps, save, throw away.
    first = ORTModule(model())
    opt, sched = make_opt(first)
    head = train(first, opt, sched, data[:SAVE_AT])
    for a, b in zip(head, ref):
        assert torch.equal(a, b)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    del first, opt, sched

    ckpt = torch.load(path)
    assert list(ckpt["model"]) == list(model().state_dict())  # no wrapper prefix in the keys
    assert "1.running_mean" in ckpt["model"] and int(ckpt["model"]["1.num_batches_tracked"]) == SAVE_AT

    # Resume in a fresh wrapper: bit-identical continuation.
    wrapped = ORTModule(model())
    wrapped.load_state_dict(ckpt["model"])
    opt, sched = make_opt(wrapped)
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    tail = train(wrapped, opt, sched, data[SAVE_AT:])
    for step, (a, b) in enumerate(zip(tail, ref[SAVE_AT:]), SAVE_AT):
        assert torch.equal(a, b), f"wrapped resume, loss at step {step}: {a} != {b}"
    for (n, p), (_, q) in zip(wrapped.named_parameters(), full.named_parameters()):
        assert torch.equal(p, q), f"wrapped resume: {n} differs from the uninterrupted run"

    # Resume in the plain (unwrapped) module, eagerly: equal up to float rounding. Load the file
    # again: Optimizer.load_state_dict keeps the loaded state tensors (no copy) and steps them in place.
    ckpt = torch.load(path)
    plain = model()
    plain.load_state_dict(ckpt["model"])
    opt, sched = make_opt(plain)
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    tail = train(plain, opt, sched, data[SAVE_AT:])
    for step, (a, b) in enumerate(zip(tail, ref[SAVE_AT:]), SAVE_AT):
        assert_close(a, b, 1e-6, f"unwrapped resume, loss at step {step}")
    for (n, p), (_, q) in zip(plain.named_parameters(), full.named_parameters()):
        assert_close(p, q, 1e-5, f"unwrapped resume: {n}")
    for (n, b), (_, c) in zip(plain.named_buffers(), full.named_buffers()):
        assert_close(b.double(), c.double(), 1e-5, f"unwrapped resume: buffer {n}")


def test_unwrapped_checkpoint_loads_into_wrapper(tmp_path):
    """The other direction: a checkpoint written by eager training resumes under ORTModule."""
    data = batches()
    eager = model()
    opt, sched = make_opt(eager)
    train(eager, opt, sched, data[:SAVE_AT])
    path = tmp_path / "eager.pt"
    torch.save({"model": eager.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    ckpt = torch.load(path)
    eager_tail = train(eager, opt, sched, data[SAVE_AT:])

    wrapped = ORTModule(model())
    wrapped.load_state_dict(ckpt["model"])
    opt, sched = make_opt(wrapped)
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    tail = train(wrapped, opt, sched, data[SAVE_AT:])
    for step, (a, b) in enumerate(zip(tail, eager_tail), SAVE_AT):
        assert_close(a, b, 1e-6, f"wrapped resume of an eager checkpoint, loss at step {step}")
