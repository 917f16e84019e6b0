"""Which gradient rules use a fused ATen kernel instead of a chain of ONNX ops (NOTE [ATen kernels]).

Each op's choice was measured (A/B in the commit that made it; ``benchmarks/bench_train.py``).
``ORTMODULE_ATEN_KERNELS`` sets it: ``1`` (default) every op below, ``0`` none, or a comma list.
"""

from __future__ import annotations

import os

# op -> the kernel. Measured and NOT chosen: the MatMul gradients as torch GEMMs (BERT-4L step
# 309 -> 330 ms; [2048, 256] x [256, 1024] 6.07 ms in torch against 5.06 in ORT on this host), and
# LayerNormalization / Softmax by aten::native_layer_norm_backward / _softmax_backward_data (BERT-4L
# fwd+loss+bwd median 325 -> 355 / 351 ms, benchmarks/ab_kernels.py --model bert: the kernels take
# 4-5 ms, the split backward loses more than they save); the Gather (embedding) gradient by
# aten::embedding_dense_backward (bench_zoo.py, vocab 8192, AVX-512 Xeon, ORT fwd+bwd median, two
# interleaved rounds: bert-cls 123.5/129.0 -> 138.0/137.4 ms, gpt2-lm 214/213 -> 224/224, llama-lm
# 191/203 -> 211/206: the exact ScatterElements stays).
KERNELS = {
    "Conv": "aten::convolution_backward (oneDNN; grouped/depthwise 2-d on channels-last copies)",
    "MaxPool": "ortmodule::max_pool2d_backward (torch's channels-last pooling)",
    "BatchNormalization": "aten::native_batch_norm_backward (batch-statistics BN)",
}


def aten_kernels() -> frozenset[str]:
    """The ops whose gradient rule uses an ATen kernel now (read from the environment each build)."""
    value = os.environ.get("ORTMODULE_ATEN_KERNELS", "1").strip()
    if value.lower() in ("", "1", "true", "on", "all"):
        return frozenset(KERNELS)
    if value.lower() in ("0", "false", "off", "none"):
        return frozenset()
    chosen = frozenset(v.strip() for v in value.split(",") if v.strip())
    unknown = chosen - set(KERNELS)
    if unknown:
        raise ValueError(f"ORTMODULE_ATEN_KERNELS names {sorted(unknown)}; the ops with an ATen kernel are "
                         f"{sorted(KERNELS)} (or 1 / 0)")
    return chosen
