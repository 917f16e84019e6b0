"""explain() reports what a real call on the same inputs does (NOTE [explain runs a call])."""

import contextlib
import warnings

import pytest
import torch
from torch import nn

import ortmodule
from ortmodule import ORTModule

from .helpers import NoRule, NoSymbolic

# The no-rule cases check the fallback path: torch nodes off (NOTE [torch nodes]; tests/test_torch_nodes.py)
pytestmark = pytest.mark.usefixtures("ort_only")


def seeded(factory):
    torch.manual_seed(0)
    return factory()


def mha():
    return nn.MultiheadAttention(32, 4, batch_first=True)


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))


def bf16_linear():
    # onnxruntime's CPU provider has no bfloat16 Gemm: the export and gradients are fine, the
    # session cannot be created (the old explain said "runs in ONNX Runtime").
    return nn.Linear(4, 4).to(torch.bfloat16)


x32 = torch.randn(2, 5, 32)
CASES = {
    "mha": (mha, (x32, x32, x32), contextlib.nullcontext, False),
    "mlp": (mlp, (torch.randn(4, 8),), contextlib.nullcontext, False),
    "bf16-session": (bf16_linear, (torch.randn(3, 4, dtype=torch.bfloat16),), contextlib.nullcontext, True),
    "no-rule": (NoRule, (torch.randn(2, 3, 3),), contextlib.nullcontext, True),
    "no-rule-no-grad": (NoRule, (torch.randn(2, 3, 3),), torch.no_grad, False),
    "no-export": (NoSymbolic, (torch.randn(2, 8),), contextlib.nullcontext, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_explain_agrees_with_a_real_call(case):
    factory, inputs, ctx, falls_back = CASES[case]
    with ctx():
        report = ortmodule.explain(seeded(factory), *inputs)
        wrapped = ORTModule(seeded(factory))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped(*inputs)
    assert report.would_fall_back == (wrapped.stats.fallbacks > 0) == falls_back, str(report)
    assert report.fallback_reason == wrapped.stats.last_fallback_reason
    text = str(report)
    if falls_back:
        assert "fall back" in text and (report.exports or "FAILED" in text)
    else:
        assert "runs in ONNX Runtime" in text and "fall back" not in text


def test_session_failure_is_named():
    report = ortmodule.explain(seeded(bf16_linear), torch.randn(3, 4, dtype=torch.bfloat16))
    assert report.exports and not report.missing_rules
    assert "onnxruntime could not load" in report.fallback_reason and "onnxruntime could not load" in str(report)


def test_missing_rule_without_grad_does_not_fall_back():
    with torch.no_grad():
        report = ortmodule.explain(seeded(NoRule), torch.randn(2, 3, 3))
    assert [m.op_type for m in report.missing_rules] == ["Det"] and not report.needs_grad
    assert not report.would_fall_back and "need no gradients" in str(report).replace("needs no", "need no")


def test_explain_keeps_state_rng_and_the_wrappers_counters():
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)))
    wrapped = ORTModule(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    report = ortmodule.explain(wrapped, x)
    assert not report.would_fall_back and report.dropout_masks == 1
    assert report.mutated_buffers == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert wrapped.stats.exports == 0 and wrapped.stats.cache_misses == 0
