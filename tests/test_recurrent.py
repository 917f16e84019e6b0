"""nn.LSTM / nn.GRU / nn.RNN models in ORTModule under either front end: a torch node under torch.export;
under TorchScript, the exported ONNX LSTM / GRU / RNN node with torch's recurrent kernel as its
gradient (NOTE [onnx rnn as torch]; it fell back before). Eager's numbers over AdamW steps."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import train_side_by_side


class Tagger(nn.Module):
    """A sequence tagger: embedding, a 2-layer bidirectional recurrent net, a per-token head."""

    def __init__(self, cell: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        kind = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell]
        self.rnn = kind(16, 24, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, 5)

    def forward(self, tokens):
        out, _ = self.rnn(self.emb(tokens))
        return self.head(out)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_recurrent_taggers_train_like_eager_without_falling_back(cell):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (32, 40), generator=g), torch.randint(0, 5, (32, 40), generator=g))
               for _ in range(3)]
    def loss(out, b):
        return F.cross_entropy(out.flatten(0, 1), b[1].flatten())

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        om = train_side_by_side(Tagger(cell), batches, loss, rtol=1e-4, steps=3, kwargs_fn=lambda b: {"tokens": b[0]})
    assert om.stats.fallbacks == 0
