"""Issue 3: a CNN (Conv-BN-ReLU-MaxPool x2, AdaptiveAvgPool, Linear) trains in ORT like eager PyTorch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

from .helpers import TORCH_EXPORT, CallCounter, assert_close, by_frontend, train_side_by_side


def cnn(bias: bool = False) -> nn.Module:
    # NOTE [conv bias before BatchNorm]: a train-mode BatchNorm subtracts the batch mean, so the
    # gradient of a conv bias in front of it is exactly 0 and both eager and ORT return rounding
    # noise (~1e-7). AdamW turns noise into +-lr steps of random sign, so the AdamW parity test
    # uses bias=False (the usual conv-BN practice); bias=True is checked with SGD below.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=bias), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=bias), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def batches(n=4, b=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)) for _ in range(n)]


def test_cnn_adamw_parity_with_batchnorm_stats():
    # train_side_by_side also compares every buffer: running_mean, running_var, num_batches_tracked.
    wrapped = train_side_by_side(cnn(), batches(), lambda out, b: F.cross_entropy(out, b[1]), rtol=1e-4,
                                 kwargs_fn=lambda b: {"input": b[0]})
    assert int(wrapped.module[1].num_batches_tracked) == 4
    counter = CallCounter(wrapped.module)
    x, y = batches(1)[0]
    F.cross_entropy(wrapped(input=x), y).backward()  # same call signature as in training
    assert counter.count == 0


def test_cnn_with_conv_bias_sgd_parity():
    train_side_by_side(cnn(bias=True), batches(3), lambda out, b: F.cross_entropy(out, b[1]), rtol=1e-4,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                       kwargs_fn=lambda b: {"input": b[0]})


def test_cnn_eval_uses_running_stats():
    model = cnn()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(copy.deepcopy(model))
    for x, _ in batches(2):  # move the running stats away from their initial values
        eager(x)
        wrapped(x)
    eager.eval()
    wrapped.eval()
    x = batches(1)[0][0]
    assert_close(wrapped(x), eager(x), 1e-4, "eval output")
    with torch.no_grad():
        assert_close(wrapped(x), eager(x), 1e-4, "eval no_grad output")
    for (n, be), (_, bo) in zip(eager.named_buffers(), wrapped.named_buffers()):
        assert_close(bo.float(), be.float(), 1e-5, f"buffer {n}")


def test_frozen_batchnorm_in_eval_inside_training_model():
    model = cnn()
    model[1].eval()  # a frozen BN inside a model in train mode keeps its running stats
    before = model[1].running_mean.clone()
    train_side_by_side(model, batches(2), lambda out, b: F.cross_entropy(out, b[1]), rtol=1e-4,
                       kwargs_fn=lambda b: {"input": b[0]})
    assert torch.equal(model[1].running_mean, before)


def test_batchnorm_no_grad_training_updates_stats():
    model = cnn()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = batches(1)[0][0]
    with torch.no_grad():
        eager(x)
        wrapped(x)
    for (n, be), (_, bo) in zip(eager.named_buffers(), wrapped.named_buffers()):
        assert_close(bo.float(), be.float(), 1e-5, f"buffer {n}")


class Zoo(nn.Module):
    """Layers beyond the basic CNN: GroupNorm, LayerNorm, Conv1d, ConvTranspose2d, AvgPool, SiLU, Mish,
    LeakyReLU, ELU, Hardswish, Embedding — each exported op must have a rule and match eager."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.conv1d = nn.Conv1d(8, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(2, 4, 2, stride=2)
        self.gn = nn.GroupNorm(2, 4)
        self.pool = nn.AvgPool2d(2)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.emb(tokens).transpose(1, 2)  # [B, 8, T]
        h = F.silu(self.conv1d(h))
        h = h.reshape(h.shape[0], 2, 4, 8)  # [B, 2, 4, 8] as an image
        h = F.mish(self.gn(self.up(h)))  # [B, 4, 8, 16]
        h = F.leaky_relu(self.pool(h), 0.1) + F.elu(self.pool(h)) + F.hardswish(self.pool(h))
        h = self.ln(h.mean(1).reshape(h.shape[0], -1)[:, :16])
        return self.head(h)


def test_layer_zoo_parity():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 20, (3, 8), generator=g), torch.randint(0, 3, (3,), generator=g)) for _ in range(3)]
    torch.manual_seed(0)
    train_side_by_side(Zoo(), data, lambda out, b: F.cross_entropy(out, b[1]), rtol=1e-4,
                       kwargs_fn=lambda b: {"tokens": b[0]})


class _ThreeNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 1, bias=False)  # a bias before BN has a ~0 gradient: AdamW amplifies noise
        self.bn3, self.bn2 = nn.BatchNorm3d(3), nn.BatchNorm2d(3, momentum=0.3)
        self.bn1 = nn.BatchNorm1d(3, affine=False)

    def forward(self, x):
        h = torch.tanh(self.bn3(self.conv(x))).sum(-1)
        h = torch.tanh(self.bn2(h)).sum(-1)
        return self.bn1(h)


@pytest.mark.filterwarnings("error")  # a fallback to eager would make the parity check vacuous
def test_train_batchnorm_runs_on_its_batch_statistics():
    """NOTE [batch-stats BN]: the exported train-mode BN becomes an affine node on the batch statistics
    computed once in the forward; the gradient reuses them. Parity over 1-D, 2-D and 3-D BN with
    affine and non-affine layers, gradients and running stats included."""
    torch.manual_seed(0)
    x = torch.randn(5, 2, 4, 4, 4)
    wrapped = train_side_by_side(_ThreeNorms(), [(x,)], lambda out, _: (out * out.detach().sign()).mean(),
                                 rtol=1e-4, steps=3)
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    bns = [n for n in entry.graphs.forward.graph.node if n.op_type == "BatchNormalization"]
    assert len(bns) == 3
    assert all(next(a.i for a in n.attribute if a.name == "training_mode") == 0 for n in bns)


def _step_like_eager(eager, wrapped, x, y, where: str) -> None:
    """One cross-entropy forward/backward of both: loss, every .grad and every buffer agree."""
    for m in (eager, wrapped):
        m.zero_grad(set_to_none=True)
        m.loss = F.cross_entropy(m(x), y)
        m.loss.backward()
    assert_close(wrapped.loss, eager.loss, 1e-5, f"loss at {where}")
    for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-4, f"{n}.grad at {where}")
    for (n, be), (_, bo) in zip(eager.named_buffers(), wrapped.named_buffers()):
        assert_close(bo.float(), be.float(), 1e-5, f"{n} at {where}")


def test_batchnorm_and_cross_entropy_with_dynamic_batch():
    """The forward passes (batch-stats BN, lowered cross-entropy) across batch sizes, the last one
    partial: outputs, gradients and running statistics follow eager at every size."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 36, 5))
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    for b in (6, 4, 3, 6):
        _step_like_eager(eager, wrapped, torch.randn(b, 3, 8, 8), torch.randint(0, 5, (b,)), f"batch {b}")
    # The ONNX Conv rule needed static spatial dims (NOTE [batch-dynamic graphs]); its ATen kernel does
    # not, so the all-dims graph serves the partial batch too.
    s = wrapped.stats
    # torch.export: batch 6 gets a static graph (NOTE [static first]); the Conv gradient is an ATen
    # kernel (NOTE [ATen kernels]), which needs no static sizes, so the all-dims export at batch 4
    # serves batch 3 under its guard (and every image size it admits).
    # TorchScript: the dynamic export and one verification at batch 4.
    assert s.exports == 2 and s.gradient_builds == by_frontend(1, 2) and s.cache_misses == 3, s
    assert not any(d.static for d in wrapped._dynamic._data.values())


def test_conv_model_across_batch_sizes_and_image_sizes():
    """A batch-dynamic graph serves other batch sizes; another image size gets its own, which serves
    that size's batch sizes in turn."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    # exports (TorchScript): the all-dims graph at 8x8, verified at batch 3 and at 12x12 (the Conv
    # gradient is an ATen kernel, NOTE [ATen kernels], so no rule needs static sizes); then all reuse it.
    expected = {(4, 8): 1, (3, 8): 2, (5, 8): 2, (4, 12): 3, (2, 12): 3, (2, 8): 3, (6, 12): 3}
    if TORCH_EXPORT:  # the Conv gradient is an ATen kernel (NOTE [ATen kernels]): no rule needs static
        # sizes, so the all-dims graph exported at the second shape (the first is static: NOTE [static
        # first]) serves every batch and image size under its guard, at parity
        expected = {(4, 8): 1, (3, 8): 2, (5, 8): 2, (4, 12): 2, (2, 12): 2, (2, 8): 2, (6, 12): 2}
    for (b, hw), exports in expected.items():
        _step_like_eager(eager, wrapped, torch.randn(b, 3, hw, hw), torch.randint(0, 3, (b,)), f"{b}x{hw}")
        assert wrapped.stats.exports == exports, (b, hw, wrapped.stats)


class _ReluPool(nn.Module):
    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, 3, 1, 1))
        self.pool = pool

    def forward(self, x):
        return self.pool(torch.relu(x * self.scale))


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize(
    "pool", [nn.MaxPool2d(2), nn.MaxPool2d(3, stride=2, padding=1), nn.MaxPool2d(2, ceil_mode=True)],
    ids=["2x2", "3x3s2p1", "ceil"],
)
def test_maxpool_of_relu_runs_as_relu_of_maxpool_with_eager_gradients(pool):
    """NOTE [pool before relu]: windows that are all negative (ReLU ties at 0), positive ties and
    mixed windows: the output and the gradients of the input and of the scale match eager exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 7, generator=g)
    x[0, 0] = -torch.rand(7, 7, generator=g)  # every window negative: max of ReLU is a tie at 0
    x[0, 1, :4, :4] = 2.5  # positive ties
    w = torch.randn(2, 3, 4, 4, generator=g)  # weights the pooled output (cropped to its size)
    eager = _ReluPool(pool)
    wrapped = ORTModule(copy.deepcopy(eager))
    results = []
    for m in (eager, wrapped):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        (out * w[..., : out.shape[-2], : out.shape[-1]]).sum().backward()
        results.append((out.detach(), xi.grad, next(m.parameters()).grad))
    for name, e, o in zip(("output", "x.grad", "scale.grad"), *results, strict=True):
        assert torch.allclose(o, e, rtol=1e-6, atol=1e-6), name
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    ops = [n.op_type for n in entry.graphs.forward.graph.node if n.op_type in ("Relu", "MaxPool")]
    assert ops == ["MaxPool", "Relu"]


def test_aten_kernels_at_benchmark_size_match_eager_and_repeat_bit_identically():
    """NOTE [ATen kernels] at the benchmark CNN's size (b32, 32x32, 32/64 channels) on 2 threads: the
    Conv, MaxPool and BatchNorm gradients by torch's kernels match eager, and two runs on the same
    batch give bit-identical gradients (no racing accumulation)."""
    torch.set_num_threads(2)
    torch.manual_seed(0)

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    model = nn.Sequential(*block(3, 32), *block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model), fallback="raise")
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    _step_like_eager(eager, wrapped, x, y, "batch 32")
    first = [p.grad.clone() for p in wrapped.parameters()]
    wrapped.zero_grad(set_to_none=True)
    F.cross_entropy(wrapped(x), y).backward()
    for a, b in zip(first, (p.grad for p in wrapped.parameters())):
        assert torch.equal(a, b), "gradients differ between two runs on the same batch"
    ops = {n.op_type for n in next(iter(wrapped._built._data.values())).backward_model.graph.node}
    assert "ATen" in ops, ops


class _ConvNeXtBlock(nn.Module):
    """A ConvNeXt block as transformers writes it: depthwise 7x7, channels-last LayerNorm and MLP, a
    residual; the depthwise conv's gradient takes NOTE [grouped conv backward]."""

    def __init__(self, c):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.up, self.down = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.down(F.gelu(self.up(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


def test_depthwise_and_grouped_convs_train_like_eager_on_the_channels_last_kernel():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 4, stride=4), _ConvNeXtBlock(32), nn.Conv2d(32, 64, 2, stride=2, groups=2),
                          _ConvNeXtBlock(64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    wrapped = train_side_by_side(model, batches, lambda out, b: F.cross_entropy(out, b[1]), rtol=1e-4, atol=1e-5,
                                 kwargs_fn=lambda b: {"input": b[0]})
    assert wrapped.stats.fallbacks == 0
    backward = next(e for e in wrapped._built._data.values() if e.graphs is not None).backward_model
    kernels = [a.s.decode() for n in backward.graph.node if n.op_type == "ATen" for a in n.attribute if a.name == "op"]
    assert kernels.count("ortmodule::conv2d_backward_channels_last") == 3, kernels  # 2 depthwise + 1 grouped
    assert kernels.count("aten::convolution_backward.default") == 1, kernels  # the dense stem
