"""grid_sample in ORTModule under either front end: ONNX GridSample runs in ORT and its gradient is torch's
grid sampler backward (NOTE [grid sample as torch]); eager's numbers over AdamW steps."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import train_side_by_side


class SpatialTransformer(nn.Module):
    """An STN classifier: a localisation net predicts an affine warp (affine_grid), the image is resampled
    (grid_sample), then classified."""

    def __init__(self, mode: str, padding: str) -> None:
        super().__init__()
        self.mode, self.padding = mode, padding
        self.loc = nn.Sequential(nn.Conv2d(1, 8, 5, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, 6))
        with torch.no_grad():  # start near the identity warp, as STNs do
            self.loc[-1].weight.mul_(0.1)
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
        self.head = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 28 * 28, 10))

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.head(F.grid_sample(x, grid, mode=self.mode, padding_mode=self.padding, align_corners=False))


@pytest.mark.parametrize("mode,padding", [("bilinear", "zeros"), ("bicubic", "border")])
def test_spatial_transformer_trains_like_eager(mode, padding):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g))
               for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        om = train_side_by_side(SpatialTransformer(mode, padding), batches, lambda out, b: F.cross_entropy(out, b[1]),
                                rtol=1e-4, steps=3, kwargs_fn=lambda b: {"x": b[0]})
    assert om.stats.fallbacks == 0 and om.stats.torch_nodes == 0
