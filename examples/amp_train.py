"""Mixed precision with ORTModule: torch.autocast(fp16) + GradScaler, unchanged from eager PyTorch.

    python examples/amp_train.py

On CPU, onnxruntime has float16 kernels for MatMul/Gemm/activations but (almost) no bfloat16 ones,
so use dtype=torch.float16 here; on CUDA both work.
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

from ortmodule import ORTModule


def main() -> None:
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    model = ORTModule(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    steps = 200
    bar = tqdm(range(steps), desc="amp fp16")
    for step in bar:
        idx = torch.randint(0, len(x), (128,))
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x[idx])  # computed in fp16 inside ONNX Runtime
            loss = F.cross_entropy(logits.float(), y[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", scale=scaler.get_scale())
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        acc = (model(x).argmax(1) == y).float().mean().item()
    print(f"final loss {loss.item():.4f}, train accuracy {acc:.3f}, logits dtype {logits.dtype}")
    print(model.stats)


if __name__ == "__main__":
    main()
