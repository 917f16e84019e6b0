"""One process of the persistent-cache tests (tests/test_compile_cache.py): trains a small HF BERT
(dropout on) and an MLP returning a dataclass through ORTModule with ``cache_dir``, and eagerly
from the same seeds; prints one JSON line with losses, parameter digests and the cache counters.

    python tests/cache_worker.py CACHE_DIR [--frontend export|torchscript]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from ortmodule import ORTModule  # noqa: E402


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    hidden: torch.Tensor


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        return Out(y=self.fc2(h), hidden=h)


def bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def mlp_loss(model, batch):
    out = model(*batch)
    return out.y.square().mean() + out.hidden.mean()


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(model, batches, loss_of, steps: int = 2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # the dropout masks
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, batches[step % len(batches)])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache_dir")
    parser.add_argument("--frontend", default=None)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(0)
    text = [{"input_ids": torch.randint(0, 64, (4, 16), generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}
            for _ in range(2)]
    xs = [(torch.randn(8, 16, generator=g),) for _ in range(2)]
    result = {}
    for name, build, batches, loss_of in (
        ("bert", bert, text, lambda m, b: m(**b).loss),
        ("mlp", Mlp, xs, mlp_loss),
    ):
        torch.manual_seed(0)
        model = build()
        eager = copy.deepcopy(model)
        om = ORTModule(model, cache_dir=args.cache_dir, frontend=args.frontend, fallback="raise")
        losses = train(om, batches, loss_of)
        eager_losses = train(eager, batches, loss_of)
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager.parameters()))
        s = om.stats
        result[name] = dict(losses=losses, eager_losses=eager_losses, max_param_diff=diff, digest=digest(model),
                            exports=s.exports, gradient_builds=s.gradient_builds, disk_cache_hits=s.disk_cache_hits,
                            disk_cache_stores=s.disk_cache_stores, fallbacks=s.fallbacks)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
