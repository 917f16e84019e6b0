"""Mixed precision: ORTModule under torch.autocast and GradScaler, against eager autocast."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

from .helpers import assert_close


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def data(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def test_fp16_autocast_matches_eager_autocast():
    eager, wrapped = copy.deepcopy(mlp()), ORTModule(mlp())
    x, y = data(1)[0]
    outs = []
    for m in (eager, wrapped):
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
            loss = F.cross_entropy(out.float(), y)
        loss.backward()
        outs.append(out)
    assert outs[1].dtype == outs[0].dtype == torch.float16
    assert_close(outs[1].float(), outs[0].float(), 2e-3, "fp16 logits")
    for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert po.grad.dtype == torch.float32, "parameter grads stay fp32 as in eager autocast"
        assert_close(po.grad, pe.grad, 1e-2, f"{n}.grad")


def test_fp16_autocast_with_gradscaler_trains_like_eager():
    eager, wrapped = copy.deepcopy(mlp()), ORTModule(mlp())
    runs = []
    for m in (eager, wrapped):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        losses = []
        for x, y in data():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in m.parameters()]))
    (le, pe), (lo, po) = runs
    for a, b in zip(lo, le):
        assert abs(a - b) <= 5e-3 * abs(b), f"loss {a} vs {b}"
    for a, b in zip(po, pe):
        assert_close(a, b, 5e-3, "parameters after GradScaler steps")
    assert wrapped.stats.exports == 1


def test_bf16_on_cpu_warns_once_and_keeps_fp32():
    eager, wrapped = copy.deepcopy(mlp()), ORTModule(mlp())
    x, y = data(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match="bfloat16"):
            out = wrapped(x)
        ref = eager(x)
    assert out.dtype == torch.float32
    assert_close(out, ref.float(), 2e-2, "bf16 eager vs fp32 ORT")
    F.cross_entropy(out, y).backward()
    assert all(p.grad is not None for p in wrapped.parameters())


def test_autocast_state_is_part_of_the_signature():
    wrapped = ORTModule(mlp())
    x = data(1)[0][0]
    assert wrapped(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        assert wrapped(x).dtype == torch.float16
    assert wrapped(x).dtype == torch.float32
    assert wrapped.stats.exports == 2


class PaddedSelfAttention(nn.Module):
    """nn.MultiheadAttention with a key-padding mask (one sample fully padded) under fp16 autocast: its
    gradient sums rows with a ScatterElements, which onnxruntime's CPU kernel cannot add in half."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x, pad):
        return self.head(self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0])


def test_fp16_autocast_backward_sums_rows_in_float():
    """Before: the first backward raised onnxruntime's 'MLFloat16 data type is not supported with
    ScatterElements ... reduction is add' after the forward had run."""
    torch.manual_seed(0)
    model = PaddedSelfAttention()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(8, 20, 32)
    pad = torch.zeros(8, 20, dtype=torch.bool)
    pad[2], pad[3, :5] = True, True
    for m in (eager, wrapped):
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x, pad)
        out.float().pow(2).mean().backward()
    for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert torch.isfinite(po.grad).all(), name
        assert_close(po.grad, pe.grad, 1e-2, f"{name}.grad", atol=1e-3)  # fp16: eager's kernels differ
    assert wrapped.stats.fallbacks == 0
