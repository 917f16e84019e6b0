"""Training semantics: Dropout masks from torch's generator, BatchNorm statistics, eval mode."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

from .helpers import CallCounter, assert_close


def dropout_mlp(p1=0.3, p2=0.5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Dropout(p1), nn.Linear(64, 64), nn.Dropout(p2), nn.Linear(64, 10)
    )


def test_dropout_masks_match_eager_under_the_same_seed():
    model = dropout_mlp()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(16, 32)
    for step in range(3):
        for m in (eager, wrapped):
            m.zero_grad()
            torch.manual_seed(100 + step)
            m.out = m(x)
            m.out.square().sum().backward()
        assert_close(wrapped.out, eager.out, 1e-5, f"output at step {step}")
        for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-5, f"{n}.grad at step {step}")


def test_dropout_output_bit_identical_to_eager():
    drop = nn.Dropout(0.3)
    wrapped = ORTModule(nn.Dropout(0.3))
    x = torch.randn(64, 129)
    torch.manual_seed(5)
    expected = drop(x)
    torch.manual_seed(5)
    assert torch.equal(wrapped(x.requires_grad_()), expected)


def test_dropout_reproducible_and_fresh_each_call():
    wrapped = ORTModule(dropout_mlp())
    x = torch.randn(16, 32)
    torch.manual_seed(7)
    a = wrapped(x)
    b = wrapped(x)
    torch.manual_seed(7)
    c = wrapped(x)
    assert torch.equal(a, c), "same seed must give the same masks"
    assert not torch.equal(a, b), "each call must draw new masks"


def test_dropout_backward_reuses_forward_mask():
    torch.manual_seed(0)
    wrapped = ORTModule(nn.Sequential(nn.Dropout(0.5)))
    x = torch.randn(64, 64, requires_grad=True)
    y = wrapped(x)
    y.sum().backward()
    kept = y != 0
    # d(sum(x * mask / (1 - p)))/dx = mask / (1 - p): exactly where the forward kept values
    assert torch.equal(x.grad != 0, kept)
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 2.0))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate(p):
    wrapped = ORTModule(nn.Sequential(nn.Dropout(p)))
    x = torch.ones(200, 500)
    y = wrapped(x)
    keep = (y != 0).float().mean().item()
    n = x.numel()
    sigma = ((1 - p) * p / n) ** 0.5
    assert abs(keep - (1 - p)) < 5 * sigma, f"keep rate {keep:.4f}, expected {1 - p} +- {5 * sigma:.4f}"
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / (1 - p)))


def test_dropout_eval_is_identity():
    wrapped = ORTModule(dropout_mlp()).eval()
    x = torch.randn(16, 32)
    ref = copy.deepcopy(wrapped.module).eval()(x)
    assert_close(wrapped(x), ref, 1e-6, "eval output")
    assert_close(wrapped(x), wrapped(x), 0.0, "eval is deterministic")


class SDPA(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.p = p

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.p if self.training else 0.0)


def test_sdpa_dropout_masks_match_eager():
    torch.manual_seed(0)
    model = SDPA(0.2)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(2, 5, 16)
    mask = torch.zeros(2, 1, 5, 5)
    mask[:, :, :, -1] = float("-inf")
    for m in (eager, wrapped):
        torch.manual_seed(3)
        m.out = m(x, mask)
        m.out.square().sum().backward()
    assert_close(wrapped.out, eager.out, 1e-5, "attention output")
    for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-5, f"{n}.grad")


def test_module_forward_not_rerun_with_dropout():
    wrapped = ORTModule(dropout_mlp())
    x = torch.randn(4, 32)
    wrapped(x).sum().backward()
    counter = CallCounter(wrapped.module)
    for _ in range(3):
        wrapped(x).sum().backward()
    assert counter.count == 0


class StopGrads(nn.Module):
    """Gradients stop at .detach(), inside torch.no_grad() blocks and at Embedding's padding_idx."""

    def __init__(self, padding_idx=0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.emb = nn.Embedding(10, 4, padding_idx=padding_idx)

    def forward(self, x, idx):
        h = self.lin(x)
        with torch.no_grad():
            scale = h.abs().mean() + 1.0
        centred = h - h.mean(0).detach()
        return (centred * h.detach()).sum() / scale + self.emb(idx).square().sum()


@pytest.mark.parametrize("padding_idx", [0, -1])
def test_gradients_stop_like_eager(padding_idx):
    torch.manual_seed(0)
    model = StopGrads(padding_idx)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x, idx = torch.randn(3, 4), torch.tensor([[0, 1, 9], [0, 0, 3]])
    for m in (eager, wrapped):
        m(x, idx).backward()
    for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-5, f"{n}.grad")
    pad = padding_idx % 10
    assert torch.count_nonzero(wrapped.module.emb.weight.grad[pad]) == 0


def test_first_call_under_no_grad_then_training():
    torch.manual_seed(0)
    model = StopGrads()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x, idx = torch.randn(3, 4), torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert_close(wrapped(x, idx), eager(x, idx), 1e-5, "no-grad output")
    for m in (eager, wrapped):
        m(x, idx).backward()
    for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-5, f"{n}.grad after a first no-grad call")
    assert wrapped.stats.exports == 1


class SmoothedLoss(nn.Module):
    """A classifier whose forward returns its label-smoothed cross-entropy (NOTE [label smoothing])."""

    def __init__(self, reduction: str, weighted: bool, spatial: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Conv2d(3, 5, 1) if spatial else nn.Linear(3, 5)
        weight = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.25]) if weighted else None
        self.loss = nn.CrossEntropyLoss(weight=weight, reduction=reduction, label_smoothing=0.15, ignore_index=4)

    def forward(self, x, y):
        return self.loss(self.head(x), y)


@pytest.mark.filterwarnings("error")  # no fallback warning: the loss runs in the graph
@pytest.mark.parametrize("spatial", [False, True], ids=["rows", "pixels"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_trains_like_eager(reduction, weighted, spatial):
    model = SmoothedLoss(reduction, weighted, spatial)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    opt_e, opt_o = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, wrapped))
    g = torch.Generator().manual_seed(1)
    for step, n in enumerate([6, 6, 4, 5]):  # smaller last batches: dynamic batch
        x = torch.randn(n, 3, 2, 2, generator=g) if spatial else torch.randn(n, 3, generator=g)
        y = torch.randint(0, 5, (n, 2, 2) if spatial else (n,), generator=g)  # 4 is ignore_index
        y.view(-1)[0] = 4
        for m, opt in ((eager, opt_e), (wrapped, opt_o)):
            opt.zero_grad()
            m.out = m(x, y)
            (m.out.square().sum() if reduction == "none" else m.out).backward()
        assert_close(wrapped.out, eager.out, 1e-5, f"loss at step {step}")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad at step {step}")
        opt_e.step()
        opt_o.step()
    # the first export and one verification at batch 4, which serves 5; torch.export: a static graph at 6
    # (NOTE [static first]) and a symbolic one at 4 whose guard serves 5 (a Conv head needs no
    # batch-dynamic export: its gradient is an ATen kernel, NOTE [ATen kernels])
    assert wrapped.stats.fallbacks == 0 and wrapped.stats.exports == 2


class SoftTargetLoss(nn.Module):
    """Mixup / cutmix / distillation: cross-entropy against class probabilities (NOTE [soft targets])."""

    def __init__(self, reduction: str, weighted: bool, spatial: bool, smoothing: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Conv2d(8, 5, 1) if spatial else nn.Linear(8, 5)
        weight = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.25]) if weighted else None
        self.loss = nn.CrossEntropyLoss(weight=weight, reduction=reduction, label_smoothing=smoothing)

    def forward(self, x, probs):
        return self.loss(self.head(x), probs)


@pytest.mark.filterwarnings("error")  # no fallback warning: the loss runs in the graph
@pytest.mark.parametrize("spatial", [False, True], ids=["rows", "pixels"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["sharp", "smoothed"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_soft_target_cross_entropy_trains_like_eager(reduction, smoothing, weighted, spatial):
    """Before, torchlib's NegativeLogLikelihoodLoss refused a float target and the model fell back."""
    model = SoftTargetLoss(reduction, weighted, spatial, smoothing)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    lr = 0.1 if reduction == "mean" else 1e-4  # a summed loss over thousands of rows: small steps
    opt_e, opt_o = (torch.optim.SGD(m.parameters(), lr=lr) for m in (eager, wrapped))
    g = torch.Generator().manual_seed(1)
    for step, n in enumerate([4096, 4096, 3000]):
        if spatial:
            n //= 64
        x = torch.randn(n, 8, 4, 4, generator=g) if spatial else torch.randn(n, 8, generator=g)
        logits = torch.randn(n, 5, 4, 4, generator=g) if spatial else torch.randn(n, 5, generator=g)
        teacher = (3 * logits).requires_grad_()  # distillation: the target's gradient too
        for m, opt in ((eager, opt_e), (wrapped, opt_o)):
            opt.zero_grad()
            teacher.grad = None
            m.out = m(x, teacher.softmax(1))
            (m.out.square().sum() if reduction == "none" else m.out).backward()
            m.teacher_grad = teacher.grad.clone()
        assert_close(wrapped.out, eager.out, 1e-5, f"loss at step {step}")
        assert_close(wrapped.teacher_grad, eager.teacher_grad, 1e-5, f"target's grad at step {step}")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-4, f"{name}.grad at step {step}")  # sums that cancel
        opt_e.step()
        opt_o.step()
    assert wrapped.stats.fallbacks == 0


class ChannelDropoutNet(nn.Module):
    """What U-Nets and temporal CNNs use: whole channels dropped (Dropout1d/2d/3d), and the inputs eager
    reads in its own ways (a 3-D input to dropout2d, an unbatched one to dropout3d)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv1d(4, 8, 3), nn.Conv2d(8, 8, 3, padding=1), nn.Conv3d(8, 4, 1)
        self.d1, self.d2, self.d3 = nn.Dropout1d(0.3), nn.Dropout2d(0.25), nn.Dropout3d(0.5)

    def forward(self, x):  # x: [N, 4, 18]
        h = self.d1(torch.relu(self.c1(x)))  # [N, 8, 16]
        h = self.d2(torch.tanh(self.c2(h.view(h.shape[0], 8, 4, 4))))
        h = self.d3(self.c3(h.unsqueeze(2)))  # [N, 4, 1, 4, 4]
        as_1d = F.dropout2d(h[0, :, 0], 0.2)  # [4, 4, 4], read as [N, C, L]: a [4, 4, 1] mask
        unbatched = F.dropout3d(h[0], 0.2)  # [4, 1, 4, 4]: a [4, 1, 1, 1] mask
        return h.flatten(1).sum(-1) + as_1d.sum() + unbatched.sum()


def test_feature_dropout_masks_match_eager_bit_for_bit():
    """NOTE [feature dropout]: the channel masks are drawn by torch in eager order. Before they were ONNX
    Runtime's draws: losses, grads and weights 20-40% off eager under the same seed."""
    torch.manual_seed(0)
    model = ChannelDropoutNet()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(64, 4, 18)
    for step in range(3):
        outs = []
        for m in (eager, wrapped):
            m.zero_grad()
            torch.manual_seed(100 + step)
            out = m(x)
            out.pow(2).mean().backward()
            outs.append(out)
        assert_close(outs[1], outs[0], 1e-6, f"output at step {step}")  # different masks: 5-40% off
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad at step {step}")
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason


def test_alpha_dropout_in_training_falls_back_naming_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.SELU(), nn.AlphaDropout(0.2))
    with pytest.warns(UserWarning, match="alpha_dropout"):
        ORTModule(model)(torch.randn(16, 8))


def test_embedding_gradient_scaled_by_frequency_matches_eager():
    """scale_grad_by_freq divides each row's gradient by its count in the batch; the ONNX form dropped it
    (rows of repeated tokens 12x off). A torch node under torch.export, a named fallback under TorchScript."""
    from .helpers import TORCH_EXPORT, train_side_by_side

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32, scale_grad_by_freq=True, padding_idx=0), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    # 8k tokens over 10-90 rows: thousands of repeats per row
    batches = [(torch.randint(0, 100, (64, 128), generator=g) % (10 + 40 * k),) for k in range(3)]
    wrapped = train_side_by_side(model, batches, lambda out, b: out.pow(2).mean(), rtol=5e-5)  # 8k-term sums
    if TORCH_EXPORT:
        assert wrapped.stats.fallbacks == 0 and wrapped.stats.torch_nodes == 1
    else:
        assert wrapped.stats.fallbacks == 1 and "frequency" in wrapped.stats.last_fallback_reason


def test_instance_norm_running_stats_update_like_eager():
    """NOTE [instance norm stats]: the running statistics of InstanceNorm(track_running_stats=True) stayed at
    their initial values (eval outputs 4% off eager afterwards), without a word."""
    from .helpers import train_side_by_side

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
                          nn.ReLU(), nn.Conv2d(8, 8, 3, bias=False),
                          nn.InstanceNorm2d(8, track_running_stats=True, momentum=0.3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 3, 14, 14, generator=g),) for _ in range(3)]
    proj = torch.randn(16, 8, 10, 10, generator=g)
    wrapped = train_side_by_side(model, batches, lambda out, b: (out * proj).sum(), rtol=1e-5, steps=3)
    assert wrapped.stats.fallbacks == 0
    stats = wrapped.module[1].running_var
    assert not torch.allclose(stats, torch.ones_like(stats))  # moved (buffers compared with eager above)


NO_GRAD_LAST = {
    "logsigmoid": F.logsigmoid,
    "relu6": F.relu6,
    "hardtanh": F.hardtanh,
    "expm1": torch.expm1,
    "log1p": lambda h: torch.log1p(h * h),
    "max_dim": lambda h: h.max(dim=-1, keepdim=True).values,
    "dropout": lambda h: F.dropout(h, 0.3),
    "floor_divide": lambda h: h // 0.5,
}


class NoGradLast(nn.Module):
    """``fn(h)`` as the last op of a ``torch.no_grad()`` block, used as a weight (a gate, a scale)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.fn = fn

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            w = self.fn(h)
        return self.b(h * w)


@pytest.mark.parametrize("case", sorted(NO_GRAD_LAST))
def test_own_forms_under_no_grad_carry_no_gradient(case):
    """NOTE [stop gradient]: ortmodule writes these calls in its own form (a rewrite, a kink mark, a
    drawn mask); under no_grad that form carried a gradient, and h's layer got one 17-75 off eager's."""
    torch.manual_seed(0)
    model = NoGradLast(NO_GRAD_LAST[case])
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(256, 16)
    for m in (eager, wrapped):
        torch.manual_seed(1)
        m(x).square().sum().backward()
    for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad")
    assert wrapped.stats.fallbacks == 0
