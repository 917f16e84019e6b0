"""Issue 2's bar: an MLP classifier trained through ORTModule matches eager PyTorch step by step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

from .helpers import CallCounter, assert_close, train_side_by_side


def mlp(act: type[nn.Module] = nn.ReLU) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), act(), nn.Linear(512, 512), act(), nn.Linear(512, 10))


def batches(n: int = 5, batch: int = 64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("act", [nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid])
def test_mlp_adamw_parity(act):
    data = batches()
    train_side_by_side(mlp(act), data, lambda out, b: F.cross_entropy(out, b[1]), rtol=1e-4,
                       kwargs_fn=lambda b: {"input": b[0]})


class Classifier(nn.Module):
    """Loss computed inside the module, so the exported graph includes SoftmaxCrossEntropyLoss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x, y):
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits


def test_loss_inside_graph_and_forward_not_rerun():
    data = batches()
    model = Classifier()
    wrapped = train_side_by_side(model, data, lambda out, b: out[0], rtol=1e-4)
    counter = CallCounter(wrapped.module.net)
    for x, y in data:
        loss, _ = wrapped(x, y)
        loss.backward()
    # The compiled entry is reused: the Python forward of the wrapped module never runs again.
    assert counter.count == 0
    assert wrapped.stats.exports == 1 and wrapped.stats.cache_misses == 1


def test_first_call_is_the_only_python_forward():
    model = Classifier()
    wrapped = ORTModule(model)
    counter = CallCounter(model.net)
    x, y = batches(1)[0]
    for _ in range(3):
        loss, _ = wrapped(x, y)
        loss.backward()
    assert counter.count == 1  # the export trace


def test_state_dict_keys_and_parameters_match_wrapped():
    model = mlp()
    wrapped = ORTModule(copy.deepcopy(model))
    assert list(wrapped.state_dict().keys()) == list(model.state_dict().keys())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert len(list(wrapped.parameters())) == len(list(model.parameters()))
    wrapped.load_state_dict(model.state_dict())
    assert wrapped.module[0].in_features == 784
    assert ORTModule(Classifier()).net[0].out_features == 512  # attribute access passes through


def test_train_eval_and_no_grad():
    model = Classifier()
    wrapped = ORTModule(copy.deepcopy(model))
    x, y = batches(1)[0]
    wrapped.eval()
    assert not wrapped.module.training
    with torch.no_grad():
        loss, logits = wrapped(x, y)
    assert not logits.requires_grad
    ref_loss, ref_logits = model.eval()(x, y)
    assert_close(logits, ref_logits, 1e-5, "eval logits")
    wrapped.train()
    assert wrapped.module.training
    loss, logits = wrapped(x, y)
    assert loss.requires_grad
    assert wrapped.stats.cache_misses == 2


def test_optimizer_step_is_seen_without_reexport():
    model = mlp()
    wrapped = ORTModule(model)
    x = torch.randn(8, 784)
    before = wrapped(x).detach().clone()
    with torch.no_grad():
        model[0].weight.add_(0.5)
    after = wrapped(x)
    assert_close(after, model(x), 1e-5, "output after in-place weight change")
    assert not torch.allclose(before, after)
    assert wrapped.stats.exports == 1
