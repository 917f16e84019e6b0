"""Issue 13: a module change that changes what forward computes drops the compiled graphs (NOTE [module
guards]); a plain module holding an ORTModule round-trips its own state_dict (NOTE [nested wrapper])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortmodule import ORTModule

from .helpers import assert_close


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.act = nn.ReLU()
        self.out = nn.Linear(16, 4)
        self.scale_output = True
        self.temperature = 1.0
        self.mode = ("a", 1)

    def forward(self, x):
        h = self.act(self.lin(x))
        if self.scale_output:
            h = h * 3.0
        if self.mode[0] == "b":
            h = h.flip(-1)
        return self.out(h) / self.temperature


def _step(eager: nn.Module, wrapped: ORTModule, x: torch.Tensor, what: str, output_rtol: float = 1e-5) -> None:
    outs = []
    for m in (eager, wrapped):
        m.zero_grad(set_to_none=True)
        out = m(x)
        out.pow(2).sum().backward()
        outs.append(out)
    assert_close(outs[1], outs[0], output_rtol, f"output after {what}")
    for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
        assert_close(po.grad, pe.grad, 1e-5, f"{name}.grad after {what}")


@pytest.mark.filterwarnings("ignore:ORTModule.*changed between calls")  # it changes the module on purpose
def test_attribute_submodule_hook_and_forward_changes_reexport():
    torch.manual_seed(0)
    model = Branchy()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(32, 16)
    _step(eager, wrapped, x, "the first call")
    exports = wrapped.stats.exports

    changes = [
        ("a bool attribute set on the wrapper", lambda m: setattr(m, "scale_output", False)),
        ("a float attribute", lambda m: setattr(m, "temperature", 2.5)),
        ("a tuple attribute", lambda m: setattr(m, "mode", ("b", 1))),
        ("an attribute of a submodule", lambda m: setattr(m.act, "inplace", True)),
        ("a parameter-free submodule replaced", lambda m: setattr(m, "act", nn.Tanh())),
        ("a forward hook added", lambda m: (m.module if isinstance(m, ORTModule) else m).lin.register_forward_hook(
            lambda mod, inp, out: out * 0.5)),
    ]
    for what, change in changes:
        change(eager)
        change(wrapped)
        _step(eager, wrapped, x, what)
        assert wrapped.stats.exports > exports, f"{what}: no re-export"
        exports = wrapped.stats.exports
        _step(eager, wrapped, x, what + " (cached)")
        assert wrapped.stats.exports == exports, f"{what}: exported again without a change"


def test_instance_forward_patched_and_hook_removed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(16, 8)
    handles = [m[0].register_forward_hook(lambda mod, inp, out: out + 1.0) for m in (eager, wrapped.module)]
    _step(eager, wrapped, x, "a hook")
    for h in handles:
        h.remove()
    _step(eager, wrapped, x, "the hook removed")
    for m in (eager, wrapped.module):
        layer = m[1]
        layer.forward = lambda t, layer=layer: torch.tanh(t)  # patched on the instance
    _step(eager, wrapped, x, "forward patched on a submodule")


class Counting(nn.Module):
    """Sets an attribute in its own forward (a cache): that alone must not re-export every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cached_batch = None

    def forward(self, x):
        self.cached_batch = int(x.shape[1])
        return self.lin(x)


def test_attribute_written_by_the_forward_itself_is_not_a_change():
    torch.manual_seed(0)
    wrapped = ORTModule(Counting())
    for _ in range(4):
        wrapped(torch.randn(4, 8)).sum().backward()
    assert wrapped.stats.exports == 1
    assert wrapped.stats.cache_hits == 3


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = ORTModule(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x))


def test_module_holding_an_ortmodule_loads_its_own_state_dict():
    torch.manual_seed(0)
    a = Holder()
    a(torch.randn(16, 8)).sum().backward()  # BN statistics move
    state = a.state_dict()
    assert "body.0.weight" in state and not any("_original_module" in k for k in state)
    torch.manual_seed(1)
    b = Holder()
    result = b.load_state_dict(state)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in b.state_dict().items():
        assert torch.equal(v, state[k]), k
    plain = nn.Module()
    plain.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    plain.head = nn.Linear(8, 2)
    plain.load_state_dict(state)  # and into the unwrapped model
    c = Holder()
    c.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8)
    a.eval(), c.eval()
    assert torch.equal(a(x), c(x))


def test_buffer_and_parameter_registered_on_the_wrapper_are_the_modules():
    wrapped = ORTModule(nn.Linear(4, 4))
    wrapped.register_buffer("steps", torch.zeros((), dtype=torch.long))
    wrapped.register_parameter("gain", nn.Parameter(torch.ones(1)))
    assert "steps" in dict(wrapped.named_buffers())
    assert "gain" in dict(wrapped.named_parameters())
    assert {"steps", "gain"} <= set(wrapped.state_dict())
    assert wrapped.module.steps is wrapped.steps


class Annealed(nn.Module):
    """A forward that counts its own calls and anneals with the count (a Gumbel temperature, scheduled
    sampling), and sets a warn-once flag on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.step = 0
        self.warned = False

    def forward(self, x):
        self.step += 1
        self.warned = True
        tau = max(0.5, 2.0 - 0.25 * self.step)
        return torch.softmax(self.lin(x) / tau, -1)


def test_attribute_counted_on_every_call_falls_back_and_matches_eager():
    """NOTE [side effects]: before, the graph kept the traced temperature and (torch.export puts attributes
    back after its trace) the counter never moved: outputs off from the second call on, no warning."""
    torch.manual_seed(0)
    model = Annealed()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    x = torch.randn(32, 16)
    with pytest.warns(UserWarning, match=r"changes attribute\(s\) \['step'\] .* on every call"):
        for call in range(6):
            outs = []
            for m in (eager, wrapped):
                m.zero_grad(set_to_none=True)
                y = m(x)
                y.pow(2).sum().backward()
                outs.append(y.detach())
            assert_close(outs[1], outs[0], 1e-6, f"output of call {call}")
            assert_close(wrapped.lin.weight.grad, eager.lin.weight.grad, 1e-5, f"lin.weight.grad at call {call}")
            assert wrapped.module.step == eager.step == call + 1
    assert wrapped.stats.fallbacks == 1 and wrapped.stats.exports == 1


class SetsOnce(nn.Module):
    def __init__(self, number: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.number = number
        self.warned, self.problem_type, self.width = False, None, None

    def forward(self, x):
        if not self.warned:  # set on the first call only: the graphs stay
            self.warned, self.problem_type = True, "regression"
        if self.number:
            self.width = self.lin.in_features * 2  # a number: checked once by an eager second call
        return self.lin(x)


def test_attribute_set_on_the_first_call_only_keeps_the_graph():
    from .helpers import CallCounter

    for number in (False, True):
        torch.manual_seed(0)
        model = SetsOnce(number)
        counter = CallCounter(model)
        wrapped = ORTModule(model)
        for _ in range(5):
            wrapped(torch.randn(4, 8)).sum().backward()
        assert wrapped.stats.fallbacks == 0 and wrapped.stats.exports == 1
        assert counter.count == (2 if number else 1)  # the trace (and the eager call that saw the number stay)


def test_config_object_and_dict_attribute_changes_reexport():
    """NOTE [config guards]: ``model.config.output_hidden_states = True`` (an HF config shared by every
    layer) or an entry of a dict of options changed after the first call was served by the stale graph."""
    transformers = __import__("pytest").importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, num_labels=2, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(cfg)
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    ids = torch.randint(0, 50, (2, 12))
    for m in (eager, wrapped):
        assert m(input_ids=ids).hidden_states is None
        m.config.output_hidden_states = True
    hs_e, hs_o = eager(input_ids=ids).hidden_states, wrapped(input_ids=ids).hidden_states
    assert hs_o is not None and len(hs_o) == len(hs_e) == 3
    for a, b in zip(hs_o, hs_e):
        assert_close(a, b, 1e-5, "hidden state")

    class Options(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.opts = {"scale": 1.0, "act": "relu"}

        def forward(self, x):
            h = self.lin(x) * self.opts["scale"]
            return torch.relu(h) if self.opts["act"] == "relu" else torch.tanh(h)

    opts = ORTModule(Options())
    x = torch.randn(4, 8)
    opts(x)
    opts.module.opts["act"] = "tanh"
    opts.module.opts["scale"] = 3.0
    assert_close(opts(x), torch.tanh(opts.module.lin(x) * 3.0), 1e-6, "after the dict changed")
    assert opts.stats.exports == 2


class AnnealedFlatDropout(Annealed):
    """Annealed, with a dropout mask sized by an expression of the batch size (B * 16): its dynamic
    export is traced again as a static one within the same call."""

    def forward(self, x):
        y = super().forward(x)
        return torch.nn.functional.dropout(y.reshape(-1), 0.1).reshape(y.shape)


def test_counter_moves_once_when_a_call_traces_twice():
    """NOTE [side effects]: an export traced again within one call (a dynamic graph refused, then a
    static one) ran the forward's writes twice: the counter was a step ahead of eager from then on."""
    import warnings

    torch.manual_seed(0)
    model = AnnealedFlatDropout()
    eager, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the counter's fallback warning
        for call, batch in enumerate((32, 32, 48, 48, 64)):
            x = torch.randn(batch, 16)
            outs = []
            for m in (eager, wrapped):
                torch.manual_seed(call)
                outs.append(m(x).detach())
            assert wrapped.module.step == eager.step == call + 1, f"call {call}"
            assert_close(outs[1], outs[0], 1e-6, f"output of call {call}")


# NOTE [tensor constants]: plain tensor attributes and globals (not parameters, not buffers).
MASK = torch.ones(16)


class PlainTensors(nn.Module):
    """Tensors kept as plain attributes, as models written without register_buffer do."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.kind = kind
        self.scale = torch.linspace(0.5, 2.0, 16)  # never registered
        self.count = torch.zeros(())
        if kind == "grad_leaf":
            self.temperature = torch.ones((), requires_grad=True)  # meant as a parameter

    def forward(self, x):
        h = self.lin(x) * self.scale
        if self.kind == "global":
            h = h * MASK
        elif self.kind == "counter":
            with torch.no_grad():
                self.count += 1  # a memory the user forgot to register
            h = h * self.count
        elif self.kind == "grad_leaf":
            h = h / self.temperature
        return h.tanh()


def _plain(kind: str) -> tuple[nn.Module, ORTModule, torch.Tensor]:
    torch.manual_seed(0)
    model = PlainTensors(kind)
    return copy.deepcopy(model), ORTModule(copy.deepcopy(model)), torch.randn(64, 16)


def test_plain_tensor_attribute_written_between_calls_reexports():
    # before: the graph kept the export-time values of self.scale (and of a global tensor)
    eager, wrapped, x = _plain("global")
    _step(eager, wrapped, x, "the first call", output_rtol=1e-6)
    with torch.no_grad():
        eager.scale.mul_(3.0)
        wrapped.module.scale.mul_(3.0)
    _step(eager, wrapped, x, "scale written in place", output_rtol=1e-6)
    MASK[::2] = 0.0
    try:
        _step(eager, wrapped, x, "a global written in place", output_rtol=1e-6)
        _step(eager, wrapped, x, "a global written in place (cached)", output_rtol=1e-6)
    finally:
        MASK.fill_(1.0)
    assert wrapped.stats.exports == 3 and wrapped.stats.fallbacks == 0
    # a third change: each one is an export, which a change on every step would make silently slow
    with torch.no_grad():
        eager.scale.add_(1.0)
        wrapped.module.scale.add_(1.0)
    with pytest.warns(UserWarning, match=r"changed between calls 3 times .*register_buffer"):
        _step(eager, wrapped, x, "a third change", output_rtol=1e-6)


def test_plain_tensor_attribute_written_by_the_forward_falls_back_and_counts_once():
    # before: the trace wrote the counter, then the fallback's eager run wrote it again (2 after one call)
    eager, wrapped, x = _plain("counter")
    with pytest.warns(UserWarning, match=r"module\.count is mutated|attribute\(s\) \['count'\] in place"):
        for call in range(3):
            _step(eager, wrapped, x, f"call {call}", output_rtol=1e-6)
            assert float(wrapped.module.count) == float(eager.count) == call + 1


def test_tensor_attribute_that_requires_grad_falls_back_and_gets_its_gradient():
    # before: a constant of the graph, so temperature.grad stayed None (TorchScript: a raw tracer error)
    eager, wrapped, x = _plain("grad_leaf")
    with pytest.warns(UserWarning, match=r"\['temperature'\] with requires_grad=True"):
        _step(eager, wrapped, x, "the first call", output_rtol=1e-6)
    assert wrapped.module.temperature.grad is not None
    assert_close(wrapped.module.temperature.grad, eager.temperature.grad, 1e-5, "temperature.grad")


class MakesConstants(nn.Module):
    """Makes tensors in forward with the default dtype (a bias, a position table, a scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + torch.linspace(0, 1, 8) * 0.3 + torch.ones(8) * torch.tensor(0.1)


def test_default_dtype_changed_between_calls_reexports():
    """NOTE [default dtype]: the graph baked float32 constants; after torch.set_default_dtype(torch.float64)
    eager's output is float64 (the constants promote it), the graph's stayed float32 without a word."""
    torch.manual_seed(0)
    eager = MakesConstants()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(64, 8)
    for dtype in (torch.float32, torch.float64, torch.float32):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            ye, yo = eager(x), wrapped(x)
            assert yo.dtype == ye.dtype == dtype
            assert_close(yo, ye, 1e-6, f"output under default {dtype}")
            yo.sum().backward()
        finally:
            torch.set_default_dtype(previous)
    assert wrapped.stats.exports == 2 and wrapped.stats.fallbacks == 0
