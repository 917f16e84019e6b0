"""Issue 4: ORTModule is a drop-in module: inputs/outputs, transparency, caching, fallback, debugging,
bad input. Every test compares against eager PyTorch where a value is involved."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import re
import threading
import warnings
from typing import NamedTuple

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortmodule
from ortmodule import DebugOptions, ExportError, ORTModule

from .helpers import TORCH_EXPORT, CallCounter, NoRule, NoSymbolic, assert_close, by_frontend


def seeded(fn):
    torch.manual_seed(0)
    return fn()


def both(model: nn.Module):
    """(eager copy, wrapped copy) of ``model``."""
    return copy.deepcopy(model), ORTModule(copy.deepcopy(model))


def check_grads(eager: nn.Module, wrapped: ORTModule, rtol=1e-5):
    for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        if pe.grad is None:
            assert po.grad is None, f"{n}.grad should be None"
        else:
            assert po.grad is not None, f"{n}.grad missing"
            assert_close(po.grad, pe.grad, rtol, f"{n}.grad")


# -- inputs ---------------------------------------------------------------------------------------
class Defaults(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y=None, scale: float = 2.0, *, bias: torch.Tensor | None = None):
        out = self.lin(x) * scale
        if y is not None:
            out = out + y
        if bias is not None:
            out = out - bias
        return out


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x, y, b: m(x),
        lambda m, x, y, b: m(x, y),
        lambda m, x, y, b: m(x, y=y),
        lambda m, x, y, b: m(x=x, y=y),
        lambda m, x, y, b: m(x, None, 3.0),
        lambda m, x, y, b: m(x, scale=0.5),
        lambda m, x, y, b: m(x, y, bias=b),
        lambda m, x, y, b: m(x, bias=b, scale=-1.0),
    ],
    ids=["x", "x_y", "x_kw_y", "all_kw", "none_and_float", "kw_float", "kwonly", "kwonly_float"],
)
def test_positional_keyword_default_inputs(call):
    eager, wrapped = both(seeded(Defaults))
    x, y, b = torch.randn(2, 4), torch.randn(2, 3), torch.randn(3)
    out_e, out_o = call(eager, x, y, b), call(wrapped, x, y, b)
    assert_close(out_o, out_e, 1e-6, "output")
    out_e.sum().backward()
    out_o.sum().backward()
    check_grads(eager, wrapped)


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, *xs, **named):
        out = sum(self.lin(x) for x in xs)
        for k in sorted(named):
            out = out * named[k]
        return out


def test_varargs_and_varkwargs():
    eager, wrapped = both(seeded(VarArgs))
    xs = [torch.randn(3, 4) for _ in range(3)]
    kw = {"a": torch.randn(3, 4), "b": torch.randn(4)}
    for m in (eager, wrapped):
        m.out = m(*xs, **kw)
        m.out.square().sum().backward()
    assert_close(wrapped.out, eager.out, 1e-6, "output")
    check_grads(eager, wrapped)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, batch):
        x, (y, z) = batch["pair"]
        out = self.a(x) + self.b(y) * z
        for t in batch["extra"]:
            out = out + t
        return {"out": out, "parts": [self.a(x), (self.b(y), None)], "none": None}


def test_nested_inputs_and_outputs():
    eager, wrapped = both(seeded(Nested))
    batch = {"pair": (torch.randn(2, 4), [torch.randn(2, 4), torch.randn(2, 4)]),
             "extra": [torch.randn(4), torch.randn(2, 4)]}
    res_e, res_o = eager(batch), wrapped(batch)
    assert res_o["none"] is None and res_o["parts"][1][1] is None
    assert isinstance(res_o["parts"], list) and isinstance(res_o["parts"][1], tuple)
    assert_close(res_o["out"], res_e["out"], 1e-6, "out")
    assert_close(res_o["parts"][1][0], res_e["parts"][1][0], 1e-6, "parts")
    (res_e["out"].sum() + res_e["parts"][0].sum()).backward()
    (res_o["out"].sum() + res_o["parts"][0].sum()).backward()
    check_grads(eager, wrapped)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    w: torch.Tensor
    tag: str = "a"


@dataclasses.dataclass
class Result:
    y: torch.Tensor
    loss: torch.Tensor
    note: str


class DataclassModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, batch: Batch) -> Result:
        y = self.lin(batch.x) * batch.w
        return Result(y=y, loss=y.square().mean(), note=batch.tag)


def test_dataclass_inputs_and_outputs():
    eager, wrapped = both(seeded(DataclassModel))
    batch = Batch(torch.randn(5, 4), torch.randn(2), "t")
    re, ro = eager(batch), wrapped(batch)
    assert isinstance(ro, Result) and ro.note == "t"
    assert_close(ro.y, re.y, 1e-6, "y")
    re.loss.backward()
    ro.loss.backward()
    check_grads(eager, wrapped)
    # the tensors inside a dataclass are inputs, not constants baked into the graph
    batch2 = Batch(torch.randn(5, 4), torch.randn(2), "t")
    assert_close(wrapped(batch2).y, eager(batch2).y, 1e-6, "y with new data")
    assert wrapped.stats.exports == 1


class Constants(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, k: int, flag: bool, mode: str, scale: float):
        y = self.lin(x)
        for _ in range(k):
            y = torch.tanh(y)
        if flag:
            y = y * 2
        if mode == "neg":
            y = -y
        return y * scale


@pytest.mark.parametrize("k,flag,mode,scale", [(1, True, "neg", 0.5), (3, False, "pos", 2.0), (0, True, "pos", 1.0)])
def test_python_scalar_and_string_inputs_are_constants(k, flag, mode, scale):
    eager, wrapped = both(seeded(Constants))
    x = torch.randn(3, 4)
    assert_close(wrapped(x, k, flag, mode, scale), eager(x, k, flag, mode, scale), 1e-6, "output")


def test_constants_are_part_of_the_cache_key():
    eager, wrapped = both(seeded(Constants))
    x = torch.randn(3, 4)
    for args in [(1, True, "neg", 0.5), (2, True, "neg", 0.5), (1, False, "neg", 0.5), (1, True, "neg", 0.5)]:
        assert_close(wrapped(x, *args), eager(x, *args), 1e-6, f"output for {args}")
    assert wrapped.stats.exports == 3 and wrapped.stats.cache_hits == 1


def test_inputs_requiring_grad_receive_gradients():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))))
    x = torch.randn(5, 4)
    xe, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager(xe).pow(2).sum().backward()
    wrapped(xo).pow(2).sum().backward()
    assert_close(xo.grad, xe.grad, 1e-5, "input grad")
    check_grads(eager, wrapped)


def test_input_grad_only_frozen_parameters():
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    for p in model.parameters():
        p.requires_grad_(False)
    eager, wrapped = both(model)
    xe, xo = torch.randn(5, 4).requires_grad_(), None
    xo = xe.detach().clone().requires_grad_()
    eager(xe).sum().backward()
    out = wrapped(xo)
    assert out.requires_grad
    out.sum().backward()
    assert_close(xo.grad, xe.grad, 1e-5, "input grad")
    assert all(p.grad is None for p in wrapped.parameters())


# -- outputs --------------------------------------------------------------------------------------
class Outputs(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "tensor":
            return y
        if self.kind == "tuple":
            return y, y.sum(1)
        if self.kind == "dict":
            return {"y": y, "n": y.norm()}
        if self.kind == "duplicate":
            return y, y
        if self.kind == "passthrough":
            return x, y
        if self.kind == "int":
            return y, y.argmax(1), y > 0
        if self.kind == "namedtuple":
            return Pair(y, y.exp())
        raise AssertionError(self.kind)


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "duplicate", "passthrough", "int", "namedtuple"])
def test_output_structures(kind):
    eager, wrapped = both(seeded(lambda: Outputs(kind)))
    x = torch.randn(6, 4)
    oe, oo = eager(x), wrapped(x)
    assert type(oo) is type(oe)
    le, lo = torch.utils._pytree.tree_leaves(oe), torch.utils._pytree.tree_leaves(oo)
    assert len(le) == len(lo)
    for a, b in zip(lo, le):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.requires_grad == b.requires_grad, f"requires_grad {a.requires_grad} != {b.requires_grad}"
        if a.is_floating_point():
            assert_close(a, b, 1e-6, "output")
        else:
            assert torch.equal(a, b)
    sum(t.float().sum() for t in le if t.requires_grad).backward()
    sum(t.float().sum() for t in lo if t.requires_grad).backward()
    check_grads(eager, wrapped)


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_unused_parameters_get_no_grad():
    eager, wrapped = both(seeded(Unused))
    x = torch.randn(2, 4)
    eager(x).sum().backward()
    wrapped(x).sum().backward()
    assert wrapped.module.unused.weight.grad is None
    check_grads(eager, wrapped)


class Heads(nn.Module):
    """Three outputs from a shared trunk: a loss, big logits, and a head only some losses use."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.head = nn.Linear(8, 5)
        self.aux = nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.tanh(self.trunk(x))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits, y), logits, torch.cat([self.aux(h), logits], dim=1)


@pytest.mark.parametrize("use", [(0,), (1,), (2,), (0, 1), (0, 2), (0, 1, 2)])
def test_outputs_without_gradient_like_eager(use):
    """NOTE [absent output grads]: outputs no loss reads get None, not zeros; grads match eager."""
    eager, wrapped = both(seeded(Heads))
    x, y = torch.randn(4, 6), torch.randint(0, 5, (4,))
    for _ in range(2):  # the second call reuses the specialised backward
        for m in (eager, wrapped):
            m.zero_grad(set_to_none=True)
            outs = m(x, y)
            sum(outs[i].sum() * (i + 1) for i in use).backward()
        check_grads(eager, wrapped)
    uses_aux = 2 in use
    assert (wrapped.module.aux.weight.grad is None) == (not uses_aux)
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    absent = frozenset({0, 1, 2} - set(use))
    if absent:
        # the cat's backward slices the gradient of output 2; with it absent the pass must drop that
        assert entry.backward_without(absent) is not None


def test_full_backward_released_when_unused_and_rebuilt_when_needed():
    """NOTE [unused full backward]: a loss-only backward releases the full backward's session; a later
    step through every output makes it again (and keeps it). Every step's gradients match eager."""
    eager, wrapped = both(seeded(Heads))
    x, y = torch.randn(4, 6), torch.randint(0, 5, (4,))
    for use, released in [((0,), True), ((0, 1, 2), False), ((0,), False), ((0, 1, 2), False)]:
        for m in (eager, wrapped):
            m.zero_grad(set_to_none=True)
            outs = m(x, y)
            sum(outs[i].sum() * (i + 1) for i in use).backward()
        check_grads(eager, wrapped)
        (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
        assert (entry._backward is None) == released, use


class SoftmaxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x):
        h = self.lin(x)
        return torch.softmax(h, dim=-1), (h * h).mean()


def test_absent_output_grad_through_an_op_the_pass_does_not_know():
    """A softmax output without gradient: its backward subtracts from the output grad, which
    NOTE [absent output grads] does not propagate; the full backward runs on zeros instead."""
    eager, wrapped = both(seeded(SoftmaxHead))
    x = torch.randn(4, 6)
    for m in (eager, wrapped):
        m(x)[1].backward()
    check_grads(eager, wrapped)
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    assert entry.backward_without(frozenset({0})) is None


def test_retain_graph_and_second_backward_like_eager():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))))
    x = torch.randn(3, 4)
    for m in (eager, wrapped):
        out = m(x).sum()
        out.backward(retain_graph=True)
        out.backward()  # gradients accumulate twice
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.backward()
    check_grads(eager, wrapped)


def test_several_calls_before_one_backward():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))))
    xs = [torch.randn(3, 4) for _ in range(3)]
    sum(eager(x).sum() * (i + 1) for i, x in enumerate(xs)).backward()
    sum(wrapped(x).sum() * (i + 1) for i, x in enumerate(xs)).backward()
    check_grads(eager, wrapped)


class TwoWrapped(nn.Module):
    def __init__(self, wrap: bool):
        super().__init__()
        torch.manual_seed(0)
        enc, head = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 2)
        self.enc = ORTModule(enc) if wrap else enc
        self.head = ORTModule(head) if wrap else head

    def forward(self, x):
        return self.head(self.enc(x) * 2)


def test_two_ortmodules_in_one_model():
    eager, wrapped = TwoWrapped(False), TwoWrapped(True)
    x = torch.randn(3, 4)
    eager(x).square().sum().backward()
    wrapped(x).square().sum().backward()
    for (n, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-5, f"{n}.grad")
    assert list(eager.state_dict()) == list(wrapped.state_dict())


# -- transparency ---------------------------------------------------------------------------------
class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("offset", torch.ones(4))
        self.note = "hello"

    def forward(self, x):
        return self.bn(self.lin(x)) + self.offset


def test_state_dict_round_trip_and_names():
    model = seeded(WithBuffers)
    wrapped = ORTModule(copy.deepcopy(model))
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in wrapped.named_buffers()] == [n for n, _ in model.named_buffers()]
    wrapped(torch.randn(8, 4))  # changes running stats
    fresh = ORTModule(seeded(WithBuffers))
    fresh.load_state_dict(wrapped.state_dict())
    plain = seeded(WithBuffers)
    plain.load_state_dict(wrapped.state_dict())
    for k, v in wrapped.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v) and torch.equal(plain.state_dict()[k], v), k


def test_attribute_get_and_set_pass_through():
    wrapped = ORTModule(seeded(WithBuffers))
    assert wrapped.note == "hello"
    wrapped.note = "changed"
    assert wrapped.module.note == "changed"
    assert wrapped.lin is wrapped.module.lin
    with pytest.raises(AttributeError):
        wrapped.does_not_exist  # noqa: B018


def test_to_and_double_precision():
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    eager, wrapped = both(model)
    wrapped.to("cpu")
    eager.double()
    wrapped.double()
    assert all(p.dtype == torch.float64 for p in wrapped.parameters())
    x = torch.randn(3, 4, dtype=torch.float64)
    eager(x).sum().backward()
    out = wrapped(x)
    assert out.dtype == torch.float64
    out.sum().backward()
    check_grads(eager, wrapped, rtol=1e-10)


def test_forward_signature_is_the_wrapped_one():
    import inspect

    wrapped = ORTModule(seeded(Defaults))
    assert list(inspect.signature(wrapped.forward).parameters) == ["x", "y", "scale", "bias"]
    clone = pickle.loads(pickle.dumps(wrapped))
    assert list(inspect.signature(clone.forward).parameters) == ["x", "y", "scale", "bias"]
    x = torch.randn(2, 4)
    assert_close(clone.forward(x), wrapped.module(x), 1e-6, "forward through the exposed signature")


def test_forward_hooks_on_the_wrapper():
    wrapped = ORTModule(seeded(lambda: nn.Linear(4, 2)))
    seen = []
    wrapped.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    wrapped.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    wrapped(torch.randn(3, 4))
    wrapped(torch.randn(3, 4))
    assert seen == ["pre", (3, 2), "pre", (3, 2)]


def test_forward_hook_can_replace_output():
    wrapped = ORTModule(seeded(lambda: nn.Linear(4, 2)))
    wrapped.register_forward_hook(lambda m, args, out: out * 0)
    assert torch.count_nonzero(wrapped(torch.randn(3, 4))) == 0


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copy_and_pickle(how):
    wrapped = ORTModule(seeded(WithBuffers))
    x = torch.randn(8, 4)
    wrapped.eval()
    ref = wrapped(x)
    if how == "deepcopy":
        clone = copy.deepcopy(wrapped)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(wrapped))
    else:
        buf = io.BytesIO()
        torch.save(wrapped, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    assert isinstance(clone, ORTModule)
    assert_close(clone(x), ref, 1e-6, "output of the copy")
    clone.train()
    clone(x).sum().backward()
    assert clone.module.lin.weight.grad is not None
    assert wrapped.module.lin.weight.grad is None, "the copy must not share state with the original"


# -- caching and re-export ------------------------------------------------------------------------
def test_cache_hits_and_new_shapes():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU())))
    for b in (2, 3, 2, 3, 5):
        x = torch.randn(b, 4)
        assert_close(wrapped(x), eager(x), 1e-6, f"batch {b}")
    assert wrapped.stats.cache_misses == 3 and wrapped.stats.cache_hits == 2
    # batch 5 reuses the verified graph without exporting (torch.export: batch 2 has a static graph,
    # NOTE [static first]; 3's symbolic graph serves 5 under its guard)
    assert wrapped.stats.exports == 2


def test_dynamic_shapes_share_one_graph():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))))
    for b in (2, 3, 5, 7, 2):
        x = torch.randn(b, 4)
        oe, oo = eager(x), wrapped(x)
        assert_close(oo, oe, 1e-6, f"batch {b}")
        eager.zero_grad()
        wrapped.zero_grad()
        oe.square().sum().backward()
        oo.square().sum().backward()
        check_grads(eager, wrapped)
    s = wrapped.stats
    # TorchScript: the first shape + one verification export; torch.export: a static graph for the
    # first shape (NOTE [static first]), then one symbolic graph whose guard serves 5 and 7
    assert s.exports == 2
    assert s.gradient_builds == by_frontend(1, 2) and len(wrapped._built) == by_frontend(1, 2)


class ShapeBaked(nn.Module):
    """Reads a size into Python: the traced graph holds it as a constant."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * float(x.shape[0])


def test_shape_specialised_graph_gets_one_export_per_shape():
    eager, wrapped = both(seeded(ShapeBaked))
    for b in (2, 3, 5, 3):
        x = torch.randn(b, 4)
        assert_close(wrapped(x), eager(x), 1e-6, f"batch {b}")
    assert wrapped.stats.exports == 3
    dyn = wrapped._dynamic.get(next(iter(wrapped._dynamic._data)))
    # one graph per batch size either way (torch.export: the first one static, NOTE [static first])
    assert dyn.static or len(dyn.guarded) == 2


def test_dynamic_shapes_with_dropout_masks():
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)))
    eager, wrapped = both(model)
    for b in (3, 6, 9):
        x = torch.randn(b, 4)
        torch.manual_seed(b)
        oe = eager(x)
        torch.manual_seed(b)
        oo = wrapped(x)
        assert_close(oo, oe, 1e-6, f"batch {b}")
    assert wrapped.stats.exports == 2  # torch.export: 3 static (NOTE [static first]), 6 serving 9


def test_cache_is_bounded_lru():
    wrapped = ORTModule(seeded(lambda: nn.Linear(4, 4)), cache_size=2)
    for b in (1, 2, 3):
        wrapped(torch.randn(b, 4))
    assert len(wrapped._entries) == 2
    wrapped(torch.randn(3, 4))  # still cached
    assert wrapped.stats.cache_hits == 1
    wrapped(torch.randn(1, 4))  # evicted, rebuilt
    assert wrapped.stats.cache_misses == 4


def test_cache_size_from_env(monkeypatch):
    monkeypatch.setenv("ORTMODULE_CACHE_SIZE", "3")
    assert ORTModule(nn.Linear(2, 2)).options.cache_size == 3
    with pytest.raises(ValueError, match="cache_size"):
        ORTModule(nn.Linear(2, 2), cache_size=0)


def test_requires_grad_toggle_rebuilds_gradient_graph_only():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))))
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()
    for m in (eager, wrapped.module):
        m[0].weight.requires_grad_(False)
        m.zero_grad()
    eager(x).sum().backward()
    wrapped(x).sum().backward()
    assert wrapped.module[0].weight.grad is None
    check_grads(eager, wrapped)
    assert wrapped.stats.exports == 1 and wrapped.stats.gradient_builds == 2


def test_parameter_replaced_is_used():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh())))
    x = torch.randn(3, 4)
    wrapped(x)
    new = nn.Parameter(torch.randn(4, 4))
    eager[0].weight = nn.Parameter(new.detach().clone())
    wrapped.module[0].weight = new
    out = wrapped(x)
    assert_close(out, eager(x), 1e-6, "output with the new weight")
    out.sum().backward()
    assert new.grad is not None


def test_parameter_data_swapped_in_place_is_seen():
    # NOTE [bound parameters]: the OrtValue bound for a parameter is reused only while its storage is.
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh())))
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()
    new = torch.randn(4, 4)
    eager[0].weight.data = new.clone()
    wrapped.module[0].weight.data = new.clone()
    assert_close(wrapped(x), eager(x), 1e-6, "output after .data swap")
    with torch.no_grad():
        eager[0].bias.mul_(3)
        wrapped.module[0].bias.mul_(3)
    assert_close(wrapped(x), eager(x), 1e-6, "output after an in-place update")
    assert wrapped.stats.exports == 1


def test_submodule_replaced_with_other_shape_reexports():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))))
    x = torch.randn(3, 4)
    wrapped(x)
    torch.manual_seed(1)
    eager[2] = nn.Linear(4, 5)
    wrapped.module[2] = copy.deepcopy(eager[2])
    assert_close(wrapped(x), eager(x), 1e-6, "output after replacing a layer")
    assert wrapped.stats.exports == 2


def test_train_eval_no_grad_switch():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))))
    x = torch.randn(16, 4)
    for mode in ("train", "eval", "train", "eval"):
        getattr(eager, mode)()
        getattr(wrapped, mode)()
        torch.manual_seed(0)
        ye = eager(x)
        torch.manual_seed(0)
        yo = wrapped(x)
        assert_close(yo, ye, 1e-5, f"{mode} output")
        with torch.no_grad():
            torch.manual_seed(0)
            ye = eager(x)
            torch.manual_seed(0)
            yo = wrapped(x)
        assert not yo.requires_grad
        assert_close(yo, ye, 1e-5, f"{mode} no_grad output")
    for (n, be), (_, bo) in zip(eager.named_buffers(), wrapped.named_buffers()):
        assert_close(bo.float(), be.float(), 1e-5, n)
    assert wrapped.stats.exports == 2  # one per mode; grad/no-grad share the export


# -- fallback, explain ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls,expect", [(NoSymbolic, NoSymbolic.MATCH), (NoRule, "Det")])
def test_fallback_warns_once_and_matches_eager(cls, expect, ort_only):
    eager, wrapped = both(seeded(cls))
    x = torch.randn(2, 3, 3) if cls is NoRule else torch.randn(2, 8)
    with pytest.warns(UserWarning, match=expect) as record:
        out = wrapped(x)
    assert sum("falls back" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out2 = wrapped(x)  # no second warning
    assert_close(out, eager(x), 1e-6, "fallback output")
    assert_close(out2, eager(x), 1e-6, "fallback output")
    out2.sum().backward()
    assert wrapped.module.lin.weight.grad is not None if cls is NoSymbolic else True
    assert wrapped.stats.fallbacks == 1 and re.search(expect, wrapped.stats.last_fallback_reason)


def test_graph_onnxruntime_cannot_load_falls_back():
    # onnxruntime's CPU provider has no bfloat16 Gemm: session creation fails, eager runs instead.
    eager, wrapped = both(seeded(lambda: nn.Linear(4, 4)).to(torch.bfloat16))
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="onnxruntime could not load"):
        out = wrapped(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, eager(x))
    out.float().sum().backward()
    assert wrapped.module.weight.grad is not None


def test_missing_rule_message_names_op_node_and_module(ort_only):
    wrapped = ORTModule(seeded(NoRule), fallback="raise")
    with pytest.raises(ortmodule.GradientRuleError) as info:
        wrapped(torch.randn(2, 3, 3))
    msg = str(info.value)
    assert "'Det'" in msg and "node '" in msg and "ortmodule/autodiff/rules/" in msg
    # the module keeps working where no gradient is needed
    with torch.no_grad():
        assert_close(wrapped(torch.randn(2, 3, 3)).abs() * 0, torch.zeros(2), 1.0, "no-grad output")


def test_policy_raise_from_env(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK", "raise")
    wrapped = ORTModule(seeded(NoSymbolic))
    with pytest.raises((ExportError, ortmodule.GradientRuleError), match=NoSymbolic.MATCH):
        wrapped(torch.randn(2, 8))
    with pytest.raises(ValueError, match="fallback policy"):
        ORTModule(nn.Linear(2, 2), fallback="sometimes")


def test_unsupported_input_type_falls_back_with_reason():
    class Holder:
        def __init__(self, t):
            self.t = t

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, h):
            return self.lin(h.t)

    eager, wrapped = both(seeded(M))
    h = Holder(torch.randn(3, 2))
    with pytest.warns(UserWarning, match="unsupported input type"):
        out = wrapped(h)
    assert_close(out, eager(h), 1e-6, "output")


def test_explain_reports_ops_and_missing_rules(ort_only):
    ok = ortmodule.explain(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.1))),
                           torch.randn(2, 4))
    assert ok.exports and not ok.would_fall_back
    assert ok.ops["Gemm"] == 1 and ok.ops["Relu"] == 1 and ok.dropout_masks == 1
    assert "runs in ONNX Runtime" in str(ok)
    bad = ortmodule.explain(seeded(NoRule), torch.randn(2, 3, 3))
    assert bad.would_fall_back and [m.op_type for m in bad.missing_rules] == ["Det"]
    assert "Det" in str(bad) and "Det" in bad.fallback_reason
    failed = ortmodule.explain(seeded(NoSymbolic), torch.randn(2, 8))
    if TORCH_EXPORT:  # DFT exports, and has no gradient rule
        assert failed.exports and failed.would_fall_back and "DFT" in failed.fallback_reason
    else:
        assert not failed.exports and "fft" in failed.export_error and "FAILED" in str(failed)


def test_explain_does_not_change_state():
    model = seeded(WithBuffers)
    before = copy.deepcopy(model.state_dict())
    ortmodule.explain(model, torch.randn(8, 4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- debugging and observability ------------------------------------------------------------------
def test_save_onnx_graphs(tmp_path):
    wrapped = ORTModule(seeded(lambda: nn.Linear(4, 2)), debug=DebugOptions(save_onnx_dir=str(tmp_path)))
    wrapped(torch.randn(3, 4)).sum().backward()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith("_forward.onnx") for n in names) and any(n.endswith("_backward.onnx") for n in names)
    for p in tmp_path.iterdir():
        onnx.checker.check_model(onnx.load(str(p)))


def test_debug_options_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX", str(tmp_path))
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "info")
    monkeypatch.setenv("ORTMODULE_PROFILE", str(tmp_path / "prof"))
    wrapped = ORTModule(nn.Linear(4, 2))
    assert wrapped.options.debug.save_onnx_dir == str(tmp_path)
    assert wrapped.options.debug.log_level == "INFO"
    with torch.no_grad():
        wrapped(torch.randn(3, 4))
    assert any(p.name.endswith("_inference.onnx") for p in tmp_path.iterdir())
    files = wrapped.end_profiling()
    assert files and all(f.endswith(".json") for f in files)
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="log level"):
        ORTModule(nn.Linear(2, 2))


def test_compile_pauses_the_garbage_collector_and_restores_it():
    """NOTE [gc during compile]: paused while a graph compiles, on again after, also when the export
    fails; a collector the user turned off stays off."""
    import gc

    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            seen.append(gc.isenabled())
            if x.shape[0] == 3:
                raise RuntimeError("no export at batch 3")
            return self.lin(x)

    wrapped = ORTModule(Probe())
    wrapped(torch.randn(2, 4)).sum().backward()
    assert seen[0] is False and gc.isenabled()
    with pytest.raises(RuntimeError, match="no export at batch 3"):
        wrapped(torch.randn(3, 4))
    assert gc.isenabled()
    gc.disable()
    try:
        wrapped(torch.randn(5, 4)).sum().backward()
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert wrapped(torch.randn(2, 4)).shape == (2, 4)


def test_stats():
    wrapped = ORTModule(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU())))
    x = torch.randn(2, 4)
    for _ in range(3):
        wrapped(x).sum().backward()
    wrapped(torch.randn(5, 4))
    s = wrapped.stats
    # the second shape is exported once more to verify the graph is shape-generic, then shares it;
    # torch.export: the first shape's graph is static (NOTE [static first]), the second's symbolic
    assert s.exports == 2 and s.reexports == 1 and s.gradient_builds == by_frontend(1, 2)
    assert s.cache_hits == 2 and s.cache_misses == 2 and s.fallbacks == 0
    assert s.export_s > 0 and s.gradient_build_s > 0 and s.session_create_s > 0
    assert s.peak_rss_mb > 10


# -- bad input ------------------------------------------------------------------------------------
def _same_error(eager, wrapped, *args):
    with pytest.raises(Exception) as e_info:
        eager(*args)
    with pytest.raises(type(e_info.value)) as o_info:
        wrapped(*args)
    return e_info.value, o_info.value


@pytest.mark.parametrize(
    "bad",
    [torch.randn(3, 5), torch.randn(4), torch.randn(2, 3, 4, 4), torch.randint(0, 3, (3, 4))],
    ids=["wrong_features", "wrong_rank_1d", "wrong_rank_4d", "int_dtype"],
)
def test_bad_input_raises_eager_error_and_module_keeps_working(bad):
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))))
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()
    if bad.dim() == 1 or bad.dim() == 4:
        try:
            ref = eager(bad)
        except Exception:
            ref = None
        if ref is not None:  # Linear accepts any leading dims: then results must match
            assert_close(wrapped(bad), ref, 1e-6, "output")
            return
    e, o = _same_error(eager, wrapped, bad)
    assert str(o) == str(e)
    assert_close(wrapped(x), eager(x), 1e-6, "output after the error")
    assert wrapped.stats.fallbacks == 0


@pytest.mark.parametrize("ids", [[[1, 12, 3]], [[1, -1, 3]]], ids=["past_the_end", "negative"])
def test_token_id_out_of_range_raises_eagers_index_error(ids):
    """NOTE [run errors], [negative ids]: past the end, onnxruntime's Gather failed with its node's message;
    -1 it read as the last row, where eager raises. Both now raise eager's IndexError, and the module
    keeps training (forward and no_grad alike)."""
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 2))))
    good = torch.tensor([[4, 5, 6]])
    wrapped(good).sum().backward()
    bad = torch.tensor(ids)
    e, o = _same_error(eager, wrapped, bad)
    assert isinstance(o, IndexError) and str(o) == str(e)
    with torch.no_grad():
        _same_error(eager, wrapped, bad)
    assert_close(wrapped(good), eager(good), 1e-6, "output after the error")
    assert wrapped.stats.fallbacks == 0


def test_empty_batch():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))))
    x = torch.randn(0, 4)
    oe, oo = eager(x), wrapped(x)
    assert oo.shape == oe.shape == (0, 2)
    oe.sum().backward()
    oo.sum().backward()
    check_grads(eager, wrapped)


def test_nans_propagate_like_eager():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh())))
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    oe, oo = eager(x), wrapped(x)
    assert torch.equal(torch.isnan(oo), torch.isnan(oe))
    assert_close(oo[~torch.isnan(oo)], oe[~torch.isnan(oe)], 1e-6, "finite part")


def test_non_contiguous_inputs():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh())))
    base = torch.randn(4, 6)
    x = base.t()[:, :4]  # (6, 4) view with strides (1, 6)
    assert not x.is_contiguous()
    xe = x.detach().clone().requires_grad_()
    xo = x.detach().t().contiguous().t().requires_grad_()
    assert not xo.is_contiguous()
    eager(xe).sum().backward()
    out = wrapped(xo)
    assert_close(out, eager(x), 1e-6, "output")
    out.sum().backward()
    assert_close(xo.grad, xe.grad, 1e-6, "input grad")


def test_concurrent_no_grad_calls_are_safe():
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))))
    wrapped.eval()
    eager.eval()
    xs = [torch.randn(8, 16) for _ in range(8)]
    results: dict[int, torch.Tensor] = {}
    errors = []

    def work(i):
        try:
            with torch.no_grad():
                for _ in range(5):
                    results[i] = wrapped(xs[i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, x in enumerate(xs):
        assert_close(results[i], eager(x), 1e-6, f"thread {i}")
    assert wrapped.stats.exports == 1


def test_wrapping_errors():
    with pytest.raises(TypeError, match="nn.Module"):
        ORTModule(lambda x: x)
    with pytest.raises(TypeError, match="already an ORTModule"):
        ORTModule(ORTModule(nn.Linear(2, 2)))


def test_loss_functions_inside_module():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y, t):
            out = self.lin(x)
            return (F.cross_entropy(out, y, label_smoothing=0.0) + F.mse_loss(out, t)
                    + F.nll_loss(F.log_softmax(out, 1), y, reduction="sum") * 0.1)

    eager, wrapped = both(seeded(WithLoss))
    x, y, t = torch.randn(5, 4), torch.randint(0, 3, (5,)), torch.randn(5, 3)
    for m in (eager, wrapped):
        m.loss = m(x, y, t)
        m.loss.backward()
    assert_close(wrapped.loss, eager.loss, 1e-6, "loss")
    check_grads(eager, wrapped)


class LossHead(nn.Module):
    """Logits upcast with ``.float()`` (a no-op Cast in fp32) and returned beside a cross-entropy."""

    def __init__(self, **ce):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.ce = ce

    def forward(self, x, y, x_out):
        logits = self.lin(x).float()
        loss = F.cross_entropy(logits.flatten(0, -2) if logits.dim() > 2 else logits, y, **self.ce)
        return loss, logits, x_out.float()


@pytest.mark.parametrize("ce", [
    {}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 2},
    {"weight": torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, 1.0])},
], ids=["mean", "sum", "none", "ignore_index", "weight"])
@pytest.mark.filterwarnings("error")  # a fallback to eager would make the comparison vacuous
@pytest.mark.parametrize("rank", [2, 3])
def test_cross_entropy_and_noop_casts_like_eager(ce, rank):
    """NOTE [lowered cross-entropy] and NOTE [no-op casts]: loss, outputs and grads match eager."""
    eager, wrapped = both(seeded(lambda: LossHead(**ce)))
    shape = (5, 4) if rank == 2 else (2, 3, 4)
    x, x_out = torch.randn(*shape), torch.randn(3)
    y = torch.randint(0, 6, (5,) if rank == 2 else (6,))
    for m in (eager, wrapped):
        m.zero_grad(set_to_none=True)
        m.out = m(x, y, x_out)
        (m.out[0].sum() + m.out[1].square().mean()).backward()
    for a, b, what in zip(wrapped.out, eager.out, ("loss", "logits", "pass-through")):
        assert_close(a, b, 1e-6, what)
    check_grads(eager, wrapped)
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    ops = [n.op_type for n in entry.graphs.forward.graph.node]
    assert "Cast" not in ops
    assert "SoftmaxCrossEntropyLoss" not in ops and "NegativeLogLikelihoodLoss" in ops


@pytest.mark.filterwarnings("error")
def test_layer_norm_gradient_reads_saved_statistics():
    """NOTE [save LN stats]: the forward LayerNorm also outputs Mean / InvStdDev for the backward."""
    eager, wrapped = both(seeded(lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(),
                                                       nn.LayerNorm(8, elementwise_affine=False))))
    x = torch.randn(3, 5, 6) * 4 + 2
    for m in (eager, wrapped):
        m.out = m(x)
        (m.out * torch.linspace(-1, 1, 8)).square().sum().backward()
    assert_close(wrapped.out, eager.out, 1e-5, "output")
    check_grads(eager, wrapped)
    (entry,) = [e for e in wrapped._built._data.values() if e.graphs is not None]
    lns = [n for n in entry.graphs.forward.graph.node if n.op_type == "LayerNormalization"]
    assert len(lns) == 2 and all(len(n.output) == 3 for n in lns)
    # two ReduceMeans per LayerNorm gradient (of dxhat and dxhat * xhat); recomputing the statistics
    # from x would add two more
    means = [n for n in entry.graphs.backward.graph.node if n.op_type == "ReduceMean"]
    assert len(means) == 4, [n.name for n in means]


def test_forward_not_rerun_after_first_call():
    model = seeded(WithBuffers)
    wrapped = ORTModule(model)
    counter = CallCounter(model)
    for _ in range(3):
        wrapped(torch.randn(8, 4)).sum().backward()
    assert counter.count == 1


class _Box:
    """Not a pytree node: ortmodule cannot see the tensor inside."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class ReturnsBox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y, _Box(y * 2)


def test_an_output_object_holding_tensors_falls_back_naming_it():
    """NOTE [opaque outputs]: the trace's object (fake or stale tensors) is never returned."""
    model = ReturnsBox()
    om = ORTModule(copy.deepcopy(model))
    for _ in range(2):
        x = torch.randn(3, 4)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            y, box = om(x)
        ref_y, ref_box = model(x)
        assert type(box.t) is torch.Tensor
        assert_close(box.t, ref_box.t, 1e-6, "the boxed tensor")
        assert_close(y, ref_y, 1e-6, "y")
    assert om.stats.fallbacks == 1
    assert "_Box holding tensors" in om.stats.last_fallback_reason


def test_the_wrapper_keeps_its_state_out_of_the_wrapped_module():
    """ORTModule's bookkeeping (signatures to recheck, the export in progress) lives on the wrapper:
    an attribute leaked into the user's module would be pickled with it and read as its own state."""
    import torch
    from torch import nn

    from ortmodule import ORTModule

    plain = nn.Linear(4, 4)
    before = set(plain.__dict__)
    wrapped = ORTModule(nn.Linear(4, 4))
    for _ in range(2):
        wrapped(torch.randn(3, 4)).sum().backward()
    assert set(wrapped.module.__dict__) == before
