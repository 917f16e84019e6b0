"""Torch nodes inside the ORT-run graph (NOTE [torch nodes], NOTE [segments]): custom autograd Functions
and ops without a gradient rule run in torch, the rest in ORT, at parity with eager PyTorch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule
from ortmodule.runtime.segments import SegmentedRunner, has_torch_nodes

from .helpers import TORCH_EXPORT, assert_close, train_side_by_side
from .test_trace_traps import GradReverse  # identity forward, -scale * g backward

pytestmark = pytest.mark.skipif(not TORCH_EXPORT, reason="torch nodes are captured by the torch.export front end")


# -- custom autograd Functions users write -----------------------------------------------------------

class RoundSTE(torch.autograd.Function):
    """Straight-through estimator (quantisation-aware training): round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class MyGelu(torch.autograd.Function):
    """A hand-written GELU (tanh form) with its own backward, saving its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x**3)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.7978845608 * (x + 0.044715 * x**3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608 * (1 + 3 * 0.044715 * x * x)
        return g * d


class ScaledPair(torch.autograd.Function):
    """Two outputs, a non-tensor argument and ctx state."""

    @staticmethod
    def forward(ctx, x, w, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(x, w)
        return x * w * scale, (x - w).abs()

    @staticmethod
    def backward(ctx, g1, g2):
        x, w = ctx.saved_tensors
        sign = torch.sign(x - w)
        gx = g1 * w * ctx.scale + g2 * sign
        gw = (g1 * x * ctx.scale - g2 * sign).sum(0)
        return gx, gw, None


class FunctionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.w = nn.Parameter(torch.randn(64) * 0.5)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(64, 4)
        self.domain = nn.Linear(64, 2)

    def forward(self, x, y):
        h = MyGelu.apply(self.inp(x))
        h = self.drop(RoundSTE.apply(self.mid(h)))
        a, b = ScaledPair.apply(h, self.w, 0.5)
        h = self.drop(torch.relu(a) + b)
        logits = self.head(h)
        adv = self.domain(GradReverse.apply(h, 0.3))
        return F.cross_entropy(logits, y) + 0.1 * adv.pow(2).mean()


def _batches(n=3, batch=64):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 32, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def test_custom_functions_train_like_eager_with_dropout():
    torch.manual_seed(0)
    model = FunctionNet()
    seeds = iter(range(100))

    def loss_fn(out, batch):
        return out

    # Same dropout draws in both runs: reseed before each forward (eager first, then ORTModule).
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    opt_e, opt_o = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, wrapped))
    for step, (x, y) in enumerate(_batches(4) * 1):
        seed = next(seeds)
        losses = []
        for m, opt in ((eager, opt_e), (wrapped, opt_o)):
            opt.zero_grad()
            torch.manual_seed(seed)
            loss = m(x, y)
            loss.backward()
            losses.append(loss)
        assert_close(losses[1], losses[0], 1e-5, f"loss at step {step}")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad at step {step}")
        opt_e.step()
        opt_o.step()
    for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po, pe, 1e-5, name)
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason
    assert wrapped.stats.torch_nodes == 4


def test_gradient_reversal_changes_the_sign_and_a_new_alpha_is_a_new_graph():
    class DANN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.feat = nn.Linear(16, 16)
            self.alpha = 1.0

        def forward(self, x):
            return GradReverse.apply(self.feat(x), self.alpha).sum()

    model = DANN()
    om = ORTModule(copy.deepcopy(model))
    x = torch.randn(8, 16)
    om(x).backward()
    model(x).backward()
    assert_close(om.module.feat.weight.grad, model.feat.weight.grad, 1e-6, "weight.grad")
    # d sum(W x + b) / dW[i, j] = sum_n x[n, j], reversed: the Function's own backward ran
    assert_close(om.module.feat.weight.grad, -x.sum(0).expand(16, 16), 1e-6, "reversed weight.grad")
    # alpha is a Python attribute the graph baked: changing it must not reuse the old graph silently
    for m in (om.module, model):
        m.alpha = 0.5
        m.zero_grad()
    om(x).backward()
    model(x).backward()
    assert_close(om.module.feat.weight.grad, model.feat.weight.grad, 1e-6, "weight.grad after alpha=0.5")


def test_torch_node_state_is_per_call_and_freed_after_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x):
            return MyGelu.apply(self.body(x)).sum()

    eager, om = Net(), ORTModule(Net())
    om.load_state_dict(eager.state_dict())
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    # two forwards before one backward: each call keeps its own torch-node state
    l1, l2 = om(x1), om(x2)
    state = l1.grad_fn.torch_state
    assert state and all(k for k in state)
    (l1 + 2 * l2).backward()
    assert not l1.grad_fn.torch_state and not l2.grad_fn.torch_state, "state kept after the backward"
    (eager(x1) + 2 * eager(x2)).backward()
    for (name, pe), (_, po) in zip(eager.named_parameters(), om.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-6, name)


def test_retain_graph_runs_the_torch_backward_twice():
    eager = nn.Linear(8, 8)

    class Net(nn.Module):
        def __init__(self, lin) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return MyGelu.apply(self.lin(x)).pow(2).sum()

    e, o = Net(eager), ORTModule(Net(copy.deepcopy(eager)))
    x = torch.randn(5, 8)
    le, lo = e(x), o(x)
    le.backward(retain_graph=True)
    le.backward()
    lo.backward(retain_graph=True)
    lo.backward()
    assert_close(o.module.lin.weight.grad, e.lin.weight.grad, 1e-6, "weight.grad after two backwards")


def test_no_grad_and_eval_run_the_torch_nodes_without_recording():
    torch.manual_seed(0)
    model = FunctionNet().eval()
    om = ORTModule(copy.deepcopy(model)).eval()
    x, y = _batches(1)[0]
    with torch.no_grad():
        assert_close(om(x, y), model(x, y), 1e-6, "eval loss")
    assert om.stats.fallbacks == 0


# -- ops without a gradient rule ----------------------------------------------------------------------

class SegHead(nn.Module):
    """Segmentation-style decoder: conv features upsampled bilinearly (Resize), pixel_shuffle."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)  # BN follows
        self.bn = nn.BatchNorm2d(16)
        self.sub = nn.Conv2d(16, 4 * 4, 3, padding=1)
        self.out = nn.Conv2d(4, 5, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.enc(x)))
        up = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        ps = F.pixel_shuffle(self.sub(h), 2)
        return self.out(ps + up[:, :4])


class ViTPosInterp(nn.Module):
    """A ViT position embedding interpolated to the input's grid (bicubic, as timm does)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 16, 4, 4) * 0.1)
        self.patch = nn.Conv2d(3, 16, 4, stride=4)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        p = self.patch(x)
        pos = F.interpolate(self.pos, size=p.shape[-2:], mode="bicubic", align_corners=False)
        return self.head((p + pos).flatten(2).mean(-1))


class Recurrent(nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        rnn = nn.GRU if cell == "gru" else nn.LSTM
        self.emb = nn.Embedding(50, 16)
        self.rnn = rnn(16, 24, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, 3)

    def forward(self, x):
        out, _ = self.rnn(self.emb(x))
        return self.head(out[:, -1])


class ProdGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        gates = torch.sigmoid(self.lin(x)).view(-1, 4, 4)
        return torch.prod(gates, dim=-1)


class BagClassifier(nn.Module):
    """fastText-style: a bag of token ids per document (flat ids + offsets), and a padded 2-D bag of
    tag ids weighted per sample."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.words = nn.EmbeddingBag(2000, 32, mode=mode)
        self.tags = nn.EmbeddingBag(300, 32, mode="sum", padding_idx=0)
        self.weigh = nn.Linear(32, 1)
        self.head = nn.Linear(32, 5)

    def forward(self, ids, offsets, tags):
        weights = torch.sigmoid(self.weigh(self.words.weight[tags.clamp(max=1999)])).squeeze(-1)
        return self.head(torch.tanh(self.words(ids, offsets) + self.tags(tags, per_sample_weights=weights)))


def _ce(out, batch):
    return F.cross_entropy(out.flatten(2).mean(-1) if out.dim() == 4 else out, batch[-1])


@pytest.mark.parametrize("case", ["seg_head", "vit_pos", "gru", "lstm", "prod", "bag_sum", "bag_mean", "bag_max"])
def test_models_that_fell_back_for_one_op_train_like_eager(case):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case == "seg_head":
        model, batches = SegHead(), [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 5, (8,), generator=g))
                                     for _ in range(3)]
        loss = _ce
    elif case == "vit_pos":
        model = ViTPosInterp()
        batches = [(torch.randn(4, 3, 24, 24, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
        loss = _ce
    elif case in ("gru", "lstm"):
        model = Recurrent(case)
        batches = [(torch.randint(0, 50, (16, 12), generator=g), torch.randint(0, 3, (16,), generator=g))
                   for _ in range(3)]
        loss = _ce
    elif case.startswith("bag_"):
        # torchlib writes embedding_bag as a Loop over sequences, which have no gradient rules. 8192
        # ids over 100 of 2000 words: duplicates by the thousand for the backward's scatter
        model = BagClassifier(case[4:])
        batches = [(torch.randint(0, 100, (8192,), generator=g), torch.arange(0, 8192, 128),
                    torch.randint(0, 300, (64, 20), generator=g), torch.randint(0, 5, (64,), generator=g))
                   for _ in range(3)]
        om = train_side_by_side(model, batches, lambda out, b: F.cross_entropy(out, b[-1]), rtol=2e-5, steps=3,
                                kwargs_fn=lambda b: {"ids": b[0], "offsets": b[1], "tags": b[2]})
        assert om.stats.fallbacks == 0, om.stats.last_fallback_reason
        assert om.stats.torch_nodes == 2
        return
    else:
        model, batches = ProdGate(), [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g))
                                      for _ in range(3)]
        loss = lambda out, b: F.mse_loss(out, b[-1])  # noqa: E731
    rtol = 1e-4 if case in ("seg_head", "vit_pos") else 2e-5  # convolutions: as tests/test_cnn.py
    om = train_side_by_side(model, batches, loss, rtol=rtol, steps=3, kwargs_fn=lambda b: {"x": b[0]})
    assert om.stats.fallbacks == 0, om.stats.last_fallback_reason
    # prod has a rule now (ReduceProd) and runs in ORT; the others stay torch nodes
    assert (om.stats.torch_nodes == 0) if case == "prod" else (om.stats.torch_nodes >= 1)


def test_a_recurrent_net_serves_a_new_batch_with_the_same_graph():
    """torch.export keeps the batch symbolic through the GRU (its trace fixes the length: a new length
    is a new export, by the guard); the first shape gets a static graph (NOTE [static first])."""
    torch.manual_seed(0)
    model = Recurrent("gru")
    om = ORTModule(copy.deepcopy(model))
    for shape in [(8, 10), (5, 10), (8, 7), (3, 7)]:
        tokens = torch.randint(0, 50, shape)
        for m in (model, om):
            m.zero_grad()
            m(tokens).pow(2).sum().backward()
        for (name, pe), (_, po) in zip(model.named_parameters(), om.named_parameters()):
            assert_close(po.grad, pe.grad, 2e-5, f"{name}.grad at {shape}")
    assert om.stats.fallbacks == 0 and om.stats.exports == 3


def test_a_custom_function_whose_output_shape_follows_the_data_is_loud():
    class KeepPositive(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x[x > 0]

        @staticmethod
        def backward(ctx, g):
            raise NotImplementedError

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return KeepPositive.apply(self.lin(x)).sum()

    model = Net()
    om = ORTModule(copy.deepcopy(model))
    x = torch.randn(6, 4)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out = om(x)
    assert_close(out, model(x), 1e-6, "output")
    assert om.stats.fallbacks == 1, "a data-dependent shape must fall back, not be baked"


def test_segments_keep_ort_parts_whole():
    """One torch node in a chain: two ORT segments in the forward, whatever the node count."""
    torch.manual_seed(0)
    om = ORTModule(SegHead())
    x = torch.randn(2, 3, 16, 16)
    om(x).sum().backward()
    entry = next(iter(om._entries._data.values()))
    fwd = entry.forward
    assert isinstance(fwd, SegmentedRunner) and has_torch_nodes(entry.graphs.forward)
    assert fwd.n_segments <= 3, fwd.n_segments


class GeluStack(nn.Module):
    """Transformer-style MLPs on [batch, seq, hidden] with a custom GELU Function between them."""

    def __init__(self, layers: int = 3, d: int = 32) -> None:
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))

    def forward(self, x):
        for up, down, norm in zip(self.ups, self.downs, self.norms):
            x = norm(x + down(MyGelu.apply(up(x))))
        return x


def test_ort_nodes_run_in_the_segment_that_reads_them():
    """NOTE [sunk nodes]: a layer's weight Transpose (it reads only a parameter) runs beside the MatMul
    that reads it, not in segment 0 before the first torch node; the numbers stay eager's."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 128, 32), torch.randn(8, 128, 32)) for _ in range(2)]
    om = train_side_by_side(GeluStack(), batches, lambda out, b: F.mse_loss(out, b[-1]), rtol=2e-5,
                            kwargs_fn=lambda b: {"x": b[0]})
    entry = next(iter(om._entries._data.values()))
    # the forward reads the last layer's weights in its last segments, the backward the first layer's
    for runner, names in ((entry.forward, ("ups.2.weight", "downs.2.weight")), (entry.backward, ("downs.0.weight",))):
        assert isinstance(runner, SegmentedRunner)
        reads = [{i.name for i in s.get_inputs()} for s in runner.sessions]
        assert len(reads) == 4, reads  # one boundary per custom GELU
        for name in names:
            first = next((k for k, r in enumerate(reads) if name in r), None)
            assert first in (2, 3), (name, reads)
    assert om.stats.fallbacks == 0


def test_explain_lists_the_torch_nodes_and_why():
    from ortmodule import explain

    torch.manual_seed(0)
    report = explain(FunctionNet(), *_batches(1)[0])
    assert not report.would_fall_back, report
    whats = sorted(t.what for t in report.torch_nodes)
    assert whats == sorted(["custom autograd.Function 'MyGelu'", "custom autograd.Function 'RoundSTE'",
                            "custom autograd.Function 'ScaledPair'", "custom autograd.Function 'GradReverse'"])
    assert "nodes that run in torch" in str(report)
    seg = explain(SegHead(), torch.randn(2, 3, 16, 16))
    # pixel_shuffle runs in ORT (DepthToSpace has a rule); upsampling stays torch's (NOTE [upsample as torch])
    assert {t.what for t in seg.torch_nodes} == {"aten::upsample_bilinear2d.vec"}
    assert all("NOTE [upsample as torch]" in t.reason for t in seg.torch_nodes), seg


class TwoGelus(nn.Module):
    """The same custom Function in two places (two torch nodes, two states) inside transformer-like
    blocks, for the recompute and verify tests."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64)) for _ in range(2))
        self.outs = nn.ModuleList(nn.Linear(64, 32) for _ in range(2))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        for block, out in zip(self.blocks, self.outs):
            x = x + self.drop(out(MyGelu.apply(block(x))))
        return self.head(x.mean(1))


def _assert_grads(model, wrapped, rtol: float, step: int, atol: float = 1e-6) -> None:
    for (name, pe), (_, po) in zip(model.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, rtol, f"{name}.grad at step {step}", atol)


def _seeded_steps(model, wrapped, steps=3, autocast=None):
    g = torch.Generator().manual_seed(3)
    opt_e, opt_o = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, wrapped))
    for step in range(steps):
        x, y = torch.randn(8, 16, 32, generator=g), torch.randint(0, 3, (8,), generator=g)
        losses = []
        for m, opt in ((model, opt_e), (wrapped, opt_o)):
            opt.zero_grad()
            torch.manual_seed(step)
            if autocast is None:
                loss = F.cross_entropy(m(x), y)
            else:
                with torch.autocast("cpu", dtype=autocast):
                    loss = F.cross_entropy(m(x).float(), y)
            loss.backward()
            losses.append(loss)
        yield step, losses, opt_e, opt_o


@pytest.mark.parametrize("level", [0, 1])
def test_torch_nodes_under_recompute_levels(level):
    """memory_opt_level=1 recomputes each block in the backward: a torch node is never recomputed (its
    state is the forward's), the ORT parts around it are, and training matches eager."""
    torch.manual_seed(0)
    model = TwoGelus()
    wrapped = ORTModule(copy.deepcopy(model), memory_opt_level=level)
    for step, losses, opt_e, opt_o in _seeded_steps(model, wrapped):
        assert_close(losses[1], losses[0], 1e-5, f"loss at step {step}")
        _assert_grads(model, wrapped, 1e-5, step)
        opt_e.step()
        opt_o.step()
    assert wrapped.stats.fallbacks == 0 and wrapped.stats.torch_nodes == 2


def test_verify_mode_checks_a_graph_with_torch_nodes():
    torch.manual_seed(0)
    model = TwoGelus()
    wrapped = ORTModule(copy.deepcopy(model), verify=True)
    for step, losses, opt_e, opt_o in _seeded_steps(model, wrapped, steps=2):
        assert_close(losses[1], losses[0], 1e-5, f"loss at step {step}")
        opt_e.step()
        opt_o.step()
    assert wrapped.stats.verifications == 1 and wrapped.stats.fallbacks == 0


def test_custom_function_under_fp16_autocast_matches_eager():
    """Under the caller's fp16 autocast (NOTE [torch node autocast]): values at half precision."""
    torch.manual_seed(0)
    model = TwoGelus()
    wrapped = ORTModule(copy.deepcopy(model))
    for step, losses, opt_e, opt_o in _seeded_steps(model, wrapped, steps=2, autocast=torch.float16):
        assert_close(losses[1], losses[0], 1e-2, f"loss at step {step}")
        _assert_grads(model, wrapped, 3e-2, step, atol=1e-3)
        opt_e.step()
        opt_o.step()
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason


class LinearFn(torch.autograd.Function):
    """A Function with a matmul inside (autocast casts it in eager), given fp32 input (after a LayerNorm)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g @ w.to(g.dtype)).to(x.dtype), (g.t() @ x.to(g.dtype)).to(w.dtype)


def test_a_function_with_a_matmul_inside_under_autocast_runs_as_captured():
    """NOTE [torch node autocast]: the Function's own ops run in its inputs' dtypes (eager casts its
    matmul to half), so the values agree to half precision and the outputs' dtypes are eager's."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.w = nn.Parameter(torch.randn(8, 16) * 0.2)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(LinearFn.apply(self.norm(x), self.w))

    torch.manual_seed(0)
    model = Net()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(32, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        oe, oo = model(x), wrapped(x)
    assert oo.dtype == oe.dtype
    assert_close(oo.float(), oe.float(), 1e-2, "output")
    oe.float().sum().backward()
    oo.float().sum().backward()
    assert_close(wrapped.module.w.grad, model.w.grad, 2e-2, "w.grad", atol=1e-2)
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason


class Untranslatable(nn.Module):
    """Ops torch.onnx fails to translate with these arguments: a global max (``amax`` over every dim),
    a per-row median, a running max (``cummax``); each sent the whole model back to eager."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        peak = h.amax()
        med = h.median(dim=-1).values
        run = h.cummax(dim=-1).values
        return run * peak + med.unsqueeze(-1)


def test_ops_torch_onnx_cannot_translate_run_as_torch_nodes():
    from ortmodule import explain

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(256, 16, generator=g), torch.randn(256, 16, generator=g)) for _ in range(3)]
    om = train_side_by_side(Untranslatable(), batches, lambda out, b: F.mse_loss(out, b[-1]), rtol=2e-5, steps=3,
                            kwargs_fn=lambda b: {"x": b[0]})
    assert om.stats.fallbacks == 0, om.stats.last_fallback_reason
    assert om.stats.torch_nodes == 3
    report = explain(Untranslatable(), batches[0][0])
    assert {t.what for t in report.torch_nodes} == {"aten::amax.default", "aten::median.dim", "aten::cummax.default"}
    assert all("torch.onnx cannot translate" in t.reason for t in report.torch_nodes), report


class Probit(nn.Module):
    """A probit link (inverse normal CDF through erfinv), as Gaussian-copula and inverse-CDF sampling
    code writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return 2 ** 0.5 * torch.erfinv(2 * torch.sigmoid(self.lin(x)) * 0.998 - 0.999)


def test_erfinv_runs_as_a_torch_node():
    """torchlib has no erfinv and its decomposition is a prim nothing translates: the model fell back."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(512, 16, generator=g), torch.randn(512, 16, generator=g)) for _ in range(3)]
    om = train_side_by_side(Probit(), batches, lambda out, b: F.mse_loss(out, b[-1]), rtol=2e-5,
                            kwargs_fn=lambda b: {"x": b[0]})
    assert om.stats.fallbacks == 0, om.stats.last_fallback_reason
    assert om.stats.torch_nodes == 1


class ScaleInPlace(torch.autograd.Function):
    """A Function that writes its input in place and says so (``ctx.mark_dirty``), as memory-saving
    activations do."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2.0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class DirtyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.tanh(ScaleInPlace.apply(self.a(x))))  # linear does not save its output


def test_a_function_writing_its_input_in_place_runs_as_a_torch_node():
    """NOTE [dirty inputs]: the torch node gave the Function the leaf that collects its input's gradient,
    and autograd refused the in-place write ('a leaf Variable that requires grad has been used in an
    in-place operation'): the forward raised. Seen writing during the capture, it now gets a copy."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)) for _ in range(3)]
    om = train_side_by_side(DirtyNet(), batches, lambda out, b: F.mse_loss(out, b[-1]), rtol=1e-5, steps=3,
                            kwargs_fn=lambda b: {"x": b[0]})
    assert om.stats.fallbacks == 0 and om.stats.torch_nodes == 1
    with torch.no_grad():  # the inference graph runs the node too
        assert_close(om(batches[0][0]), om.module(batches[0][0]), 1e-6, "no_grad output")


class NoisyScale(torch.autograd.Function):
    """A custom Function that draws in its forward (a fused noise-injection kernel's Python twin)."""

    @staticmethod
    def forward(ctx, x):
        noise = 1.0 + 0.1 * torch.randn_like(x)
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, g):
        (noise,) = ctx.saved_tensors
        return g * noise


class NoisyNet(nn.Module):
    def __init__(self, dropout_after: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)
        self.dropout_after = dropout_after

    def forward(self, x):
        h = F.dropout(self.a(x), 0.2)  # drawn before the run, first in eager order too
        h = NoisyScale.apply(torch.relu(h))
        if self.dropout_after:
            h = F.dropout(h, 0.3)  # eager draws it after the Function's noise
        return self.b(h)


@pytest.mark.skipif(not TORCH_EXPORT, reason="torch nodes are captured by the torch.export front end")
@pytest.mark.parametrize("dropout_after", [False, True])
def test_a_custom_function_that_draws_keeps_eager_order_or_falls_back(dropout_after):
    """NOTE [draws in torch nodes]: the graph's draws are made before the run, a torch node's during
    it. With nothing drawn after the Function in eager order the stream is eager's; with a dropout
    after it, the Function's noise would take that mask's numbers: it falls back, naming it."""
    torch.manual_seed(0)
    model = NoisyNet(dropout_after)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(512, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            outs = []
            for m in (eager, wrapped):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                y = m(x)
                y.square().mean().backward()
                outs.append(y.detach())
            assert_close(outs[1], outs[0], 1e-5, f"output at step {step}")
            for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
                assert_close(po.grad, pe.grad, 1e-4, f"{name}.grad at step {step}")
    if dropout_after:
        assert wrapped.stats.fallbacks == 1
        assert any("NoisyScale" in str(w.message) and "draws" in str(w.message) for w in caught)
    else:
        assert wrapped.stats.fallbacks == 0 and wrapped.stats.torch_nodes == 1


# NOTE [decomposed to nothing]: ops torchlib has no translation for, whose decomposition ends in a node
# nothing translates either (a prim, an effectful error check): each fell back for the whole model.
_DECOMPOSED_TO_NOTHING = {
    "lgamma": lambda h: torch.lgamma(h.exp() + 0.1),  # Gamma / Beta / Dirichlet / StudentT / Poisson
    "digamma": lambda h: torch.digamma(h.exp() + 0.1),
    "mvlgamma": lambda h: torch.mvlgamma(h.exp() + 2, 2),
    "i0": lambda h: torch.i0(h),
    "i0e": lambda h: torch.special.i0e(h),  # von Mises
    "i1": lambda h: torch.special.i1(h),
    "i1e": lambda h: torch.special.i1e(h),
    "ndtri": lambda h: torch.special.ndtri(torch.sigmoid(h)),
    "copysign": lambda h: torch.copysign(h, -h.flip(1)),
    "entr": lambda h: torch.special.entr(torch.sigmoid(h)),  # torchlib's graph does not load
    "inv": lambda h: torch.linalg.inv(h.reshape(-1, 4, 4) + 4 * torch.eye(4)).reshape(h.shape),
    "solve": lambda h: torch.linalg.solve(h[:, :16].reshape(-1, 4, 4) + 4 * torch.eye(4),
                                          h[:, 16:].reshape(-1, 4, 4)).reshape(h.shape[0], 16),
    "cholesky": lambda h: torch.linalg.cholesky(
        (lambda a: a @ a.mT + torch.eye(4))(h[:, :16].reshape(-1, 4, 4))).reshape(h.shape[0], 16),
}


class Special(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(32, 32), nn.Linear(32 if form not in ("solve", "cholesky") else 16, 8)
        self.form = form

    def forward(self, x):
        return self.out(_DECOMPOSED_TO_NOTHING[self.form](self.lin(x)))


@pytest.mark.parametrize("form", sorted(_DECOMPOSED_TO_NOTHING))
def test_ops_decomposed_to_untranslatable_nodes_run_in_torch(form):
    """The ATen call the untranslatable node came from (its ``from_node`` provenance) runs in torch,
    the rest in ORT: 3 AdamW steps at eager's numbers, no fallback, and explain() says why."""
    from ortmodule import explain

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4096, 32, generator=g) * 0.5,) for _ in range(2)]
    wrapped = train_side_by_side(Special(form), batches, lambda y, _: y.square().mean(), rtol=2e-5, steps=3)
    assert wrapped.stats.fallbacks == 0 and wrapped.stats.torch_nodes >= 1
    report = explain(Special(form), *batches[0])
    assert report.torch_nodes and any("cannot translate" in t.reason or "cannot load" in t.reason
                                      for t in report.torch_nodes), report.torch_nodes


def test_a_singular_matrix_raises_eagers_error_and_the_module_keeps_working():
    """linalg.solve as a torch node raises torch's own LinAlgError on a singular matrix, as eager does."""
    torch.manual_seed(0)
    model = Special("solve")
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(64, 32)
    wrapped(x).sum().backward()
    with torch.no_grad():
        saved = [p.clone() for p in wrapped.module.lin.parameters()]
        wrapped.module.lin.weight.zero_()
        wrapped.module.lin.bias.zero_()
        wrapped.module.lin.bias[[0, 5, 10, 15]] = -4.0  # h + 4 I == 0
    for m in (wrapped.module, wrapped):
        with pytest.raises(torch.linalg.LinAlgError, match="singular"):
            m(x)
    with torch.no_grad():
        for p, s in zip(wrapped.module.lin.parameters(), saved):
            p.copy_(s)
    assert_close(wrapped(x), model(x), 1e-5, "output after the error")


# NOTE [draws as torch nodes]: draws whose values depend on tensors inside the graph
_DRAWS = {
    "categorical_sample": lambda h: (lambda d: (lambda a: -(d.log_prob(a) * (a.float() - 3)).mean())(d.sample()))(
        torch.distributions.Categorical(logits=h[:, :6])),  # REINFORCE
    "multinomial_no_replacement": lambda h: (torch.multinomial(h.softmax(-1), 3).float() * h[:, :3]).mean(),
    "gamma_rsample": lambda h: torch.distributions.Gamma(h[:, :4].exp(), 1.0).rsample().mean(),
    "beta_rsample": lambda h: torch.distributions.Beta(h[:, :4].exp(), h[:, 4:8].exp()).rsample().pow(2).mean(),
    "dirichlet_rsample": lambda h: torch.distributions.Dirichlet(h[:, :5].exp()).rsample().pow(2).sum(-1).mean(),
    "poisson_sample": lambda h: (torch.distributions.Poisson(h[:, :4].exp()).sample() * h[:, :4]).mean(),
}


class Draws(nn.Module):
    def __init__(self, form: str, dropout: str) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 16), nn.Dropout(0.2)
        self.form, self.dropout = form, dropout

    def forward(self, x):
        h = self.lin(x)
        if self.dropout == "before":
            h = self.drop(h)
        y = _DRAWS[self.form](h)
        if self.dropout == "after":
            y = y + self.drop(h).mean()
        return y


def _same_draws(eager: nn.Module, wrapped: ORTModule, x: torch.Tensor, steps: int = 2) -> None:
    for step in range(steps):
        outs, states = [], []
        for m in (eager, wrapped):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            y = m(x)
            y.backward()
            outs.append(y.detach())
            states.append(torch.get_rng_state())
        assert_close(outs[1], outs[0], 1e-5, f"loss at step {step}")
        assert torch.equal(states[0], states[1]), f"generator at step {step}"
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad at step {step}")


@pytest.mark.parametrize("dropout", ["none", "before", "after"])
@pytest.mark.parametrize("form", sorted(_DRAWS))
def test_draws_that_depend_on_graph_values_run_in_torch_in_eager_order(form, dropout):
    """``Categorical.sample()`` (multinomial), gamma / Beta / Dirichlet ``rsample`` (with their
    reparameterised gradient), ``Poisson.sample()``: torch draws them during the run, from eager's
    stream, with a dropout mask drawn before (graph draws come first); with one drawn after, it falls
    back naming the call (NOTE [draws in torch nodes]). They all fell back before."""
    torch.manual_seed(0)
    model = Draws(form, dropout)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(4096, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_draws(eager, wrapped, x)
    if dropout == "after":
        assert wrapped.stats.fallbacks == 1
        assert any("draws random numbers" in str(w.message) for w in caught)
    else:
        assert wrapped.stats.fallbacks == 0 and wrapped.stats.torch_nodes >= 1


class TwoDraws(nn.Module):
    """Two multinomial draws; the first reads a torch node's output (lgamma), the second only ORT's."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        p1 = torch.lgamma(self.l1(x).exp() + 1).softmax(-1)
        a = torch.multinomial(p1, 2, replacement=True)  # drawn first in eager
        p2 = self.l2(x).softmax(-1)
        b = torch.multinomial(p2, 2, replacement=True)
        return (a.float() * p1[:, :2]).mean() + 2 * (b.float() * p2[:, :2]).mean()


def test_drawing_torch_nodes_run_in_eager_order():
    """NOTE [draw order]: the second draw needs no torch node before it, so the segments ran it first
    and the two streams were swapped (loss 1.249 against eager's 1.237, no warning). Drawing nodes now
    run in the order the trace met them."""
    torch.manual_seed(0)
    model = TwoDraws()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    _same_draws(eager, wrapped, torch.randn(2048, 16), steps=3)
    assert wrapped.stats.fallbacks == 0 and wrapped.stats.torch_nodes == 3


# -- custom ops (torch.library) and transformers' MoE experts: NOTE [custom ops] ------------------------

@torch.library.custom_op("ortmodule_tests::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    """A user's own kernel as a custom op: limit * tanh(x / limit)."""
    return limit * torch.tanh(x / limit)


@soft_clip.register_fake
def _(x, limit):
    return torch.empty_like(x)


def _soft_clip_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.limit = inputs[1]


def _soft_clip_backward(ctx, g):
    (y,) = ctx.saved_tensors
    return g * (1 - (y / ctx.limit) ** 2), None


soft_clip.register_autograd(_soft_clip_backward, setup_context=_soft_clip_setup)


@torch.library.custom_op("ortmodule_tests::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    """A custom op whose kernel draws (its fake kernel cannot show it)."""
    return x + 0.1 * torch.randn_like(x)


@noisy.register_fake
def _(x):
    return torch.empty_like(x)


noisy.register_autograd(lambda ctx, g: g)


class CustomOpNet(nn.Module):
    def __init__(self, noise: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.noise = noise
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 4)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.drop(self.a(x))
        h = noisy(h) if self.noise else soft_clip(h, 2.0)
        return self.b(self.drop(h))


def test_a_custom_op_runs_as_a_torch_node_with_its_own_autograd():
    from ortmodule import explain

    torch.manual_seed(0)
    batches = [(torch.randn(4096, 32) * 3, torch.randn(4096, 4)) for _ in range(3)]
    om = train_side_by_side(CustomOpNet(), batches, lambda out, b: F.mse_loss(out, b[-1]), rtol=2e-5,
                            kwargs_fn=lambda b: {"x": b[0]})
    assert om.stats.fallbacks == 0
    report = explain(CustomOpNet(), batches[0][0])
    assert [t.what for t in report.torch_nodes] == ["ortmodule_tests::soft_clip.default"], report


def test_a_custom_op_that_draws_falls_back_with_eagers_numbers():
    """Its draws would come after the dropout masks drawn before the run, out of eager's order: seen
    moving the generator, the call runs eagerly (the generator put back first), and so do the next."""
    torch.manual_seed(0)
    model = CustomOpNet(noise=True, dropout=0.2)
    batches = [(torch.randn(2048, 32), torch.randn(2048, 4)) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        om = train_side_by_side(model, batches, lambda out, b: F.mse_loss(out, b[-1]), rtol=1e-6, seed=7,
                                kwargs_fn=lambda b: {"x": b[0]})
    assert om.stats.fallbacks == 1
    assert any("ortmodule_tests::noisy" in str(w.message) and "random generator" in str(w.message) for w in caught)


def _moe(arch: str) -> nn.Module:
    import transformers as T

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=1024, output_router_logits=True,
                  router_aux_loss_coef=0.02)
    if arch == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=128, num_local_experts=4, **common))
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=64,
                                                  shared_expert_intermediate_size=128, num_experts=4, **common))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_experts_train_in_ort_like_eager(arch):
    """transformers' MoE experts on CPU call its ``grouped_mm_fallback`` custom op (8192 tokens over 4
    experts: thousands of rows per group, and of repeated gather indices in the backward)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 512, (8, 1024), generator=g),) for _ in range(2)]
    om = train_side_by_side(_moe(arch), batches, lambda out, b: out.loss, rtol=2e-5,
                            kwargs_fn=lambda b: {"input_ids": b[0], "labels": b[0]})
    assert om.stats.fallbacks == 0
    assert om.stats.torch_nodes > 0


class GroupedExperts(nn.Module):
    """Top-1 experts by ``F.grouped_mm`` over rows sorted by expert, as users write MoE layers."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(32, 4)
        self.w1 = nn.Parameter(torch.randn(4, 32, 64) * 0.1)
        self.w2 = nn.Parameter(torch.randn(4, 64, 32) * 0.1)

    def forward(self, x):
        scores = self.router(x).softmax(-1)
        ids, perm = torch.sort(scores.argmax(-1))
        offs = torch.cumsum(torch.histc(ids.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        y = F.grouped_mm(F.grouped_mm(x[perm], self.w1, offs=offs).relu(), self.w2, offs=offs)
        out = torch.empty_like(y)
        out[perm] = y
        return out * scores.amax(-1, keepdim=True)


def test_grouped_mm_runs_as_a_torch_node():
    """NOTE [grouped mm as a torch node]: torch.export's fake kernel of ``_grouped_mm`` fails on CPU."""
    torch.manual_seed(0)
    batches = [(torch.randn(8192, 32), torch.randn(8192, 32)) for _ in range(2)]
    om = train_side_by_side(GroupedExperts(), batches, lambda out, b: F.mse_loss(out, b[-1]), rtol=2e-5,
                            kwargs_fn=lambda b: {"x": b[0]})
    assert om.stats.fallbacks == 0 and om.stats.torch_nodes > 0


class TransposedExperts(nn.Module):
    """Expert weights stored [E, out, in] and passed transposed, with an output width of 6 floats (24-byte
    rows): torch's CPU grouped matmul takes eager's transposed view, not a contiguous copy."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(32, 4)
        self.w1 = nn.Parameter(torch.randn(4, 64, 32) * 0.1)
        self.w2 = nn.Parameter(torch.randn(4, 6, 64) * 0.1)

    def forward(self, x):
        ids, perm = torch.sort(self.router(x).argmax(-1))
        offs = torch.cumsum(torch.histc(ids.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        h = F.grouped_mm(x[perm], self.w1.transpose(-2, -1), offs=offs).relu()
        y = F.grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        out = torch.empty_like(y)
        out[perm] = y
        return out


def test_grouped_mm_of_transposed_weights_runs_where_eager_runs():
    """Eager's forward takes the transposed view (its backward, with 24-byte gradient rows, raises in both);
    the graph hands the torch node a contiguous weight, which the kernel refused."""
    torch.manual_seed(0)
    model = TransposedExperts()
    om = ORTModule(copy.deepcopy(model))
    x = torch.randn(4096, 32)
    with torch.no_grad():
        assert_close(om(x), model(x), 1e-6, "no-grad output")
    assert om.stats.fallbacks == 0 and om.stats.torch_nodes > 0
