"""The torch.export front end (``frontend="export"``, NOTE [torch.export front end]): training
semantics at parity with eager, symbolic shapes served under their guards, and the patterns that
must fall back naming the cause instead of baking a value."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule
from ortmodule.export.program import ShapeGuard

from .helpers import assert_close
from .test_trace_traps import AtenIndexAdd


def _export(model: nn.Module, **kwargs) -> ORTModule:
    return ORTModule(model, frontend="export", **kwargs)


def _grads_match(ort: nn.Module, eager: nn.Module, rtol: float = 1e-5) -> None:
    for (name, pe), (_, po) in zip(eager.named_parameters(), ort.named_parameters()):
        if pe.grad is None:
            assert po.grad is None, name
        else:
            assert_close(po.grad, pe.grad, rtol, f"{name}.grad")


class BnDropNet(nn.Module):
    """BatchNorm on batch statistics, dropout, a no_grad block and a detach: the training semantics."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        h = F.dropout(F.relu(self.bn(self.l1(x))), 0.2, self.training)
        with torch.no_grad():
            scale = h.abs().mean()
        return self.l2(h).detach() * scale + self.l2(h)


def test_training_semantics_match_eager_over_batch_sizes_with_one_dynamic_export():
    torch.manual_seed(0)
    eager = BnDropNet()
    ort = _export(copy.deepcopy(eager), fallback="raise")
    # SGD, not Adam: l1.bias's true gradient is ~0 under the BatchNorm, and Adam would turn its
    # rounding noise into steps of +-lr (NOTE [relative error] in helpers.py).
    opt_e, opt_o = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ort))
    for step, batch in enumerate((64, 64, 48, 17)):
        x = torch.randn(batch, 8)
        outs = []
        for m, opt in ((eager, opt_e), (ort, opt_o)):
            opt.zero_grad()
            torch.manual_seed(step)  # the same dropout masks: drawn by torch in eager order
            out = m(x)
            out.square().mean().backward()
            outs.append(out)
        assert_close(outs[1], outs[0], 1e-5, f"output at step {step}")
        _grads_match(ort, eager)
        opt_e.step()
        opt_o.step()
        for (name, be), (_, bo) in zip(eager.named_buffers(), ort.named_buffers()):
            if be.is_floating_point():
                assert_close(bo, be, 1e-5, f"buffer {name}")
            else:
                assert torch.equal(bo, be), name
    # NOTE [static first]: batch 64 gets a static graph, batch 48 a symbolic one that serves 17 too
    assert ort.stats.exports == 2 and ort.stats.fallbacks == 0


def test_no_legacy_exporter_deprecation_warning():
    model = _export(BnDropNet(), fallback="raise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(16, 8)).sum().backward()
    legacy = [w for w in caught if "TorchScript-based ONNX export" in str(w.message)]
    assert not legacy, legacy[0].message


class ShapeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[1] > 5:  # Python reads a size: torch.export records a guard
            return self.lin(x[:, :5]).sum(1)
        return self.lin(x).sum(1) * 2


def test_shape_dependent_branch_gets_its_own_graph_and_reuses_under_its_guard():
    torch.manual_seed(0)
    eager = ShapeBranch()
    ort = _export(copy.deepcopy(eager), fallback="raise")
    # NOTE [static first]: seq 7 gets a static graph; 4 and 9 a guarded symbolic graph each
    for seq, exports in ((7, 1), (4, 2), (9, 3), (3, 3), (6, 3)):
        x = torch.randn(2, seq, 4)
        for m in (eager, ort):
            m.zero_grad()
        ye, yo = eager(x), ort(x)
        ye.sum().backward()
        yo.sum().backward()
        assert_close(yo, ye, 1e-6, f"output at seq {seq}")
        _grads_match(ort, eager)
        assert ort.stats.exports == exports, (seq, ort.stats)
    guards = [e.guard for e in ort._dynamic._data.values() for e in e.guarded]
    assert all(isinstance(g, ShapeGuard) for g in guards) and len(guards) == 2


def test_guard_checks_ranges_equalities_and_torch_guards():
    guard = ShapeGuard(dims=(("s0", "s1"), ("s0", 3)), fixed=((4, 8), (4, 3)),
                       ranges=(("s0", 2, None), ("s1", 2, 64)), code=("L['tensors'][0].size()[1] > 5",))
    assert guard.covers([(9, 6), (9, 3)])
    assert not guard.covers([(9, 6), (8, 3)])  # s0 must agree
    assert not guard.covers([(9, 6), (9, 4)])  # a fixed dim
    assert not guard.covers([(1, 6), (1, 3)])  # below the range (0/1 specialisation)
    assert not guard.covers([(9, 65), (9, 3)])  # above the range
    assert not guard.covers([(9, 5), (9, 3)])  # torch.export's own guard


class ItemBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.mean().item() > 0:  # data-dependent Python: must never be baked
            return y * 2
        return -y


def test_item_branch_falls_back_naming_the_cause():
    torch.manual_seed(0)
    eager = ItemBranch()
    ort = _export(copy.deepcopy(eager))
    with pytest.warns(UserWarning, match="falls back"):
        out = ort(torch.randn(3, 4))
    assert ort.stats.fallbacks == 1
    reason = ort.stats.last_fallback_reason
    assert "data-dependent" in reason or "item" in reason, reason
    for x in (torch.randn(3, 4) + 5, torch.randn(3, 4) - 5):  # both branches, as eager takes them
        assert torch.equal(ort(x), eager(x))
    del out


class Ste(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class SteNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return Ste.apply(self.lin(x))


def test_custom_function_falls_back_naming_the_class(ort_only):
    ort = _export(SteNet())
    with pytest.warns(UserWarning, match="Ste"):
        ort(torch.randn(3, 4)).sum().backward()
    assert ort.stats.fallbacks == 1 and "autograd.Function" in ort.stats.last_fallback_reason
    assert ort.module.lin.weight.grad is not None and ort.module.lin.weight.grad.abs().sum() > 0


class MutatesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


class MutatesParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x)


@pytest.mark.parametrize("model, what", [(MutatesInput, "input"), (MutatesParam, "parameter 'lin.weight'")])
def test_in_place_writes_to_inputs_and_parameters_fall_back(model, what):
    torch.manual_seed(0)
    eager = model()
    ort = _export(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    xe, xo = x.clone(), x.clone()
    with pytest.warns(UserWarning, match="in place"):
        yo = ort(xo)
    assert what in ort.stats.last_fallback_reason
    assert torch.equal(yo, eager(xe)) and torch.equal(xo, xe)  # mutated once, like eager
    assert torch.equal(ort.module.lin.weight, eager.lin.weight)


def test_module_path_reaches_error_messages(ort_only):
    class Inner(nn.Module):
        def forward(self, x):
            return torch.linalg.det(x)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.block = nn.Sequential(nn.Identity(), Inner())

        def forward(self, x):
            return self.block(self.lin(x))

    ort = _export(Outer())
    with pytest.warns(UserWarning, match="falls back"):
        ort(torch.randn(2, 3, 3)).sum().backward()
    assert "block.1" in ort.stats.last_fallback_reason, ort.stats.last_fallback_reason


class NllMinusSum(nn.Module):
    """Two gradients into one log-softmax, one through an unreduced NLL (NOTE [trusted shapes])."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 5)

    def forward(self, x, y):
        lp = F.log_softmax(self.head(x), 1)
        return F.nll_loss(lp, y, reduction="none") - 0.1 * lp.sum(1)


def test_unreduced_nll_beside_a_sum_gets_eager_gradients():
    torch.manual_seed(0)
    eager = NllMinusSum()
    ort = _export(copy.deepcopy(eager), fallback="raise")
    x, y, g = torch.randn(64, 3), torch.randint(0, 5, (64,)), torch.randn(64)
    eager(x, y).backward(g)
    ort(x, y).backward(g)
    _grads_match(ort, eager)


def test_wrong_input_raises_the_eager_error_and_the_module_keeps_working():
    ort = _export(nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        ort(torch.randn(3, 5))
    assert ort.stats.fallbacks == 0 and ort.stats.exports == 0
    out = ort(torch.randn(3, 4))
    assert out.shape == (3, 2) and ort.stats.fallbacks == 0 and ort.stats.exports == 1


def test_an_accumulating_scatternd_falls_back():
    """torchlib writes the decomposed aten.index_add as ScatterND(add), which races (NOTE [exact scatters])."""
    ort = _export(AtenIndexAdd())
    x, idx = torch.randn(4096, 4), torch.zeros(4096, dtype=torch.long)
    with pytest.warns(UserWarning, match="ScatterND"):
        out = ort(x, idx)
    assert torch.equal(out, ort.module(x, idx))


def test_a_torch_without_recorded_guard_code_serves_exact_shapes_only(monkeypatch):
    """Without ``ExportedProgram._guards_code`` a guard like ``x.shape[0] % 2 == 0`` would be unseen:
    the graph must then serve only the shapes it was exported at (NOTE [shape guards])."""
    from ortmodule.export import program

    real = program._shape_guard

    def without_code(ep, *args):
        class Plain:  # the same program, minus the attribute
            def __getattr__(self, name):
                if name == "_guards_code":
                    raise AttributeError(name)
                return getattr(ep, name)
        return real(Plain(), *args)

    monkeypatch.setattr(program, "_shape_guard", without_code)
    torch.manual_seed(0)
    eager = ParityBranch()
    ort = _export(copy.deepcopy(eager), fallback="raise")
    for b in (4, 6, 5, 4):
        x = torch.randn(b, 4)
        assert_close(ort(x), eager(x), 1e-6, f"batch {b}")
    assert ort.stats.exports == 3


class ParityBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * (2.0 if x.shape[0] % 2 == 0 else 3.0)


def test_a_guard_beyond_ranges_is_checked_per_call():
    """``x.shape[0] % 2 == 0`` is no range: torch.export's recorded guard code decides reuse."""
    torch.manual_seed(0)
    eager = ParityBranch()
    ort = _export(copy.deepcopy(eager), fallback="raise")
    for b, exports in ((4, 1), (6, 2), (5, 3), (7, 3), (8, 3)):  # 4: static (NOTE [static first])
        x = torch.randn(b, 4)
        assert_close(ort(x), eager(x), 1e-6, f"batch {b}")
        assert ort.stats.exports == exports, (b, ort.stats)


class MixedDtypes(nn.Module):
    """Ops that promote: float * int64 mask, int + float scalar, bool in arithmetic, int // float."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask, counts):
        h = self.lin(x) * mask  # int64 mask: promoted to float
        h = h + (counts + 0.5).unsqueeze(-1)  # int64 + Python float
        h = h + (mask > 0)  # float + bool
        return h * (counts // 2.0).unsqueeze(-1)  # int64 // float


def test_type_promotion_is_kept_where_dtypes_mix():
    """NOTE [export time]: the type-promotion pass is skipped only when nothing mixes dtypes."""
    torch.manual_seed(0)
    eager = MixedDtypes()
    ort = _export(copy.deepcopy(eager), fallback="raise")
    x, mask, counts = torch.randn(6, 4), torch.randint(0, 2, (6, 4)), torch.randint(-5, 5, (6,))
    ye, yo = eager(x, mask, counts), ort(x, mask, counts)
    assert yo.dtype == ye.dtype
    assert_close(yo, ye, 1e-6, "output")
    ye.sum().backward()
    yo.sum().backward()
    _grads_match(ort, eager)


class ResetsStats(nn.Module):
    """Writes a BatchNorm's running mean in place after the BatchNorm updated it."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        y = self.bn(x)
        self.bn.running_mean.mul_(0.5)
        return y


def test_a_running_stat_written_twice_falls_back_and_matches_eager():
    torch.manual_seed(0)
    eager = ResetsStats()
    ort = _export(copy.deepcopy(eager))
    x = torch.randn(16, 4)
    with pytest.warns(UserWarning, match="running statistics"):
        yo = ort(x)
    assert_close(yo, eager(x), 1e-6, "output")
    assert torch.equal(ort.module.bn.running_mean, eager.bn.running_mean)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_one_onnx_gelu_and_trains_like_eager(approximate):
    """NOTE [one Gelu]: aten.gelu becomes ONNX Gelu (not torchlib's Erf/Tanh arithmetic, whose
    intermediates the backward would save); outputs and gradients match eager over AdamW steps."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 64), nn.GELU(approximate=approximate), nn.Linear(64, 4))
    ort = _export(copy.deepcopy(eager), fallback="raise")
    opt_e, opt_o = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, ort))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(512, 16, generator=g) * 3  # both tails of the curve
        outs = []
        for m, opt in ((eager, opt_e), (ort, opt_o)):
            opt.zero_grad()
            out = m(x)
            out.square().mean().backward()
            outs.append(out)
        assert_close(outs[1], outs[0], 1e-5, f"output at step {step}")
        _grads_match(ort, eager, 1e-4)
        opt_e.step()
        opt_o.step()
    (entry,) = [e for e in ort._built._data.values() if e.graphs is not None]
    ops = [n.op_type for n in entry.graphs.forward.graph.node]
    gelus = [n for n in entry.graphs.forward.graph.node if n.op_type == "Gelu"]
    assert len(gelus) == 1 and "Erf" not in ops and "Tanh" not in ops, ops
    assert [a.s.decode() for a in gelus[0].attribute if a.name == "approximate"] in ([approximate], [])


class SlicedPositions(nn.Module):
    """A learned position table sliced by the sequence length (ViT-style and hand-written transformers)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.pos = nn.Parameter(torch.randn(1, 64, 16) * 0.1)

    def forward(self, x):
        return torch.tanh(self.proj(x) + self.pos[:, : x.shape[1]])


def test_a_parameter_sliced_by_the_sequence_length_serves_every_length():
    """The symbolic graph's moved shape nodes were placed twice in the forward (NOTE [shapes early]: a
    node freed by another's placement was met again), so onnxruntime refused the model ("two nodes with
    the same name") and every new length fell back to eager."""
    from .helpers import TORCH_EXPORT, assert_close

    torch.manual_seed(0)
    model = SlicedPositions()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    for seq in (12, 16, 9, 33, 40):
        x = torch.randn(3, seq, 16)
        outs = []
        for m in (eager, wrapped):
            m.zero_grad()
            y = m(x)
            y.pow(2).sum().backward()
            outs.append((y.detach(), m.pos.grad.clone()))
        assert_close(outs[1][0], outs[0][0], 1e-6, f"output at length {seq}")
        assert_close(outs[1][1], outs[0][1], 1e-5, f"pos.grad at length {seq}")
    assert wrapped.stats.fallbacks == 0, wrapped.stats.last_fallback_reason
    if TORCH_EXPORT:
        assert wrapped.stats.exports == 2  # static at 12, one symbolic graph for every other length


def test_an_onnxscript_without_the_expected_rules_is_loud(monkeypatch):
    """NOTE [near-identity constants]: ortmodule leaves some of onnxscript's rewrite rules out; where a
    newer onnxscript keeps them elsewhere, the export falls back naming it instead of optimizing with
    rules that change small constants."""
    import onnxscript.rewriter as rewriter

    monkeypatch.delattr(rewriter, "_DEFAULT_REWRITE_RULES")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    wrapped = _export(copy.deepcopy(model))
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="keeps its rewrite rules elsewhere"):
        y = wrapped(x)
    assert_close(y, model(x), 1e-6, "output")
    assert wrapped.stats.fallbacks == 1
