"""nn.LSTM / nn.GRU / nn.RNN models in ORTModule under either front end: a torch node under torch.export;
under TorchScript, the exported ONNX LSTM / GRU / RNN node with torch's recurrent kernel as its
gradient (NOTE [onnx rnn as torch]; it fell back before). Eager's numbers over AdamW steps."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule
from tests.helpers import assert_close, train_side_by_side


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


class WordLanguageModel(nn.Module):
    """PyTorch's word_language_model example: dropout around a multi-layer recurrent net with dropout
    between its layers, the final states returned as well (NOTE [rnn dropout])."""

    def __init__(self, cell: str, bidirectional: bool, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(200, 32)
        kind = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell]
        self.rnn = kind(32, 32, num_layers=3, dropout=0.3, batch_first=batch_first, bidirectional=bidirectional)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(64 if bidirectional else 32, 200)

    def forward(self, tokens, hidden):  # tokens [B, T]
        x = self.drop(self.emb(tokens if self.batch_first else tokens.t()))
        out, state = self.rnn(x, hidden)
        out = self.head(self.drop(out))
        return (out if self.batch_first else out.transpose(0, 1)), state


@pytest.mark.parametrize("cell,bidirectional,batch_first",
                         [("lstm", False, False), ("lstm", True, True), ("gru", True, False), ("rnn", False, True)])
def test_dropout_between_layers_matches_eager_bit_for_bit(cell, bidirectional, batch_first):
    """Before, the masks inside the recurrent kernel made the whole model fall back to eager."""
    torch.manual_seed(0)
    eager = WordLanguageModel(cell, bidirectional, batch_first)
    wrapped = ORTModule(copy.deepcopy(eager))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, wrapped)]
    g = torch.Generator().manual_seed(1)
    rows = 3 * (2 if bidirectional else 1)
    for step in range(3):
        tokens = torch.randint(0, 200, (64, 128), generator=g)  # 8192 tokens
        h0 = torch.randn(rows, 64, 32, generator=g)
        hidden = (h0, torch.randn_like(h0)) if cell == "lstm" else h0
        results = []
        for m, opt in zip((eager, wrapped), opts):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            out, state = m(tokens, hidden)
            states = list(state) if cell == "lstm" else [state]
            loss = F.cross_entropy(out.flatten(0, 1), tokens.flatten()) + sum(s.square().mean() for s in states)
            loss.backward()
            opt.step()
            results.append((out.detach(), [s.detach() for s in states], torch.get_rng_state()))
        (out_e, states_e, rng_e), (out_o, states_o, rng_o) = results
        assert torch.equal(rng_o, rng_e), f"the generator after step {step} is not where eager leaves it"
        # torch.export: bit-identical; TorchScript: ORT runs the recurrent forward (rounding), and AdamW's
        # first steps amplify it. A mask other than eager's is off by ~1e-1.
        assert_close(out_o, out_e, 1e-4, f"output at step {step}")
        for i, (so, se) in enumerate(zip(states_o, states_e)):
            assert_close(so, se, 1e-4, f"final state {i} at step {step}")
        for (name, pe), (_, po) in zip(eager.named_parameters(), wrapped.named_parameters()):
            assert_close(po, pe, 1e-4, f"{name} after step {step}")
    assert wrapped.stats.fallbacks == 0
