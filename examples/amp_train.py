"""Mixed precision with ORTModule: torch.autocast(fp16) + GradScaler, unchanged from eager PyTorch.

    python examples/amp_train.py

On CPU, onnxruntime has float16 kernels for MatMul/Gemm/activations but (almost) no bfloat16 ones,
so use dtype=torch.float16 here; on CUDA both work.
"""

import copy

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

from ortmodule import ORTModule


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, desc: str) -> tuple[float, float]:
    """fp16 autocast + GradScaler, as in eager PyTorch; returns (last loss, train accuracy)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)  # the same batches for both runs
    bar = tqdm(range(steps), desc=desc)
    for step in bar:
        idx = torch.randint(0, len(x), (128,), generator=g)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x[idx])  # with ORTModule: computed in fp16 inside ONNX Runtime
            loss = F.cross_entropy(logits.float(), y[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", scale=scaler.get_scale())
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        acc = (model(x).argmax(1) == y).float().mean().item()
    return loss.item(), acc


def main() -> None:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    results = {
        "eager": train(copy.deepcopy(net), x, y, 200, "eager fp16"),
        "ORTModule": train(model := ORTModule(copy.deepcopy(net)), x, y, 200, "ORTModule fp16"),
    }
    print("            final loss  train acc")
    for name, (loss, acc) in results.items():
        print(f"{name:10s} {loss:11.4f} {acc:10.3f}")
    s = model.stats
    print(f"ORTModule: {s.exports} exports, {s.gradient_builds} gradient builds, {s.cache_hits} cached calls, "
          f"{s.fallbacks} fallbacks")


if __name__ == "__main__":
    main()
