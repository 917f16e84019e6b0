"""Issue 6: export a trained model's eval-mode forward for deployment; run it with plain onnxruntime."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule
from ortmodule.export.inference import export_inference


def _session(path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _run(path, **feeds) -> list[np.ndarray]:
    return _session(path).run(None, {k: v.numpy() for k, v in feeds.items()})


def _close(got: np.ndarray, want: torch.Tensor, tol: float = 1e-5, what: str = "output") -> None:
    want = want.detach().numpy()
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < tol, f"{what}: relative error {err:.3g}"


def _train(wrapped: nn.Module, data, steps: int = 3) -> None:
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for i in range(steps):
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()


def test_mlp_export_after_training(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    wrapped = ORTModule(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    _train(wrapped, data)
    assert wrapped.training
    x = torch.randn(8, 16, generator=g)
    path = wrapped.export_onnx(tmp_path / "mlp.onnx", x, optimized_path=tmp_path / "mlp.opt.onnx")
    assert wrapped.training and model[2].training  # train/eval state restored
    proto = onnx.load(str(path))
    assert [i.name for i in proto.graph.input] == ["input"]  # weights are initializers, not inputs
    assert len(proto.graph.initializer) == 4
    assert not any(n.op_type == "Dropout" for n in proto.graph.node)
    with torch.no_grad():
        want = model.eval()(x)
        model.train()
        for b in (8, 3):  # dynamic batch
            xb = torch.randn(b, 16, generator=g)
            _close(_run(path, input=xb)[0], model.eval()(xb), what=f"batch {b}")
            _close(_run(tmp_path / "mlp.opt.onnx", input=xb)[0], model(xb), what=f"optimized, batch {b}")
    _close(_run(path, input=x)[0], want)
    # The wrapper keeps training after the export.
    _train(wrapped, data, 1)


def test_cnn_batchnorm_running_stats(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )
    wrapped = ORTModule(model)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(6, 3, 12, 12, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(3)]
    _train(wrapped, data, 4)
    bn = model[1]
    assert int(bn.num_batches_tracked) == 4 and not torch.allclose(bn.running_mean, torch.zeros(8))
    path = tmp_path / "cnn.onnx"
    export_inference(wrapped, path, (data[0][0],), dynamic_axes="auto", optimized_path=tmp_path / "cnn.opt.onnx")
    assert wrapped.training
    model.eval()
    with torch.no_grad():
        for b in (6, 2):
            x = torch.randn(b, 3, 12, 12, generator=g)
            want = model(x)
            _close(_run(path, input=x)[0], want, what=f"batch {b}")
            _close(_run(tmp_path / "cnn.opt.onnx", input=x)[0], want, what=f"optimized batch {b}")
            # Train-mode (batch-statistics) output differs: the export really used running stats.
            # (On a copy: a train-mode forward would update the running stats.)
            assert not np.allclose(_run(path, input=x)[0], copy.deepcopy(model).train()(x).numpy(), atol=1e-4)


def test_dynamic_axes_dict_and_static(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    static = export_inference(model, tmp_path / "s.onnx", x)
    dims = onnx.load(str(static)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [3, 4]
    dyn = export_inference(model, tmp_path / "d.onnx", x, dynamic_axes={"input": {0: "n"}, "output": {0: "n"}})
    dims = onnx.load(str(dyn)).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "n" and dims[1].dim_value == 4
    with pytest.raises(ValueError, match="neither inputs"):
        export_inference(model, tmp_path / "e.onnx", x, dynamic_axes={"nope": {0: "n"}})


def test_hf_bert_dynamic_batch_and_sequence(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, num_labels=3,
    )
    model = transformers.BertForSequenceClassification(cfg)
    wrapped = ORTModule(model)
    g = torch.Generator().manual_seed(3)

    def batch(b, s):
        ids = torch.randint(0, 500, (b, s), generator=g)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, s // 2 :] = 0  # one padded row
        return ids, mask

    ids, mask = batch(4, 16)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        wrapped(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 3, (4,), generator=g)).loss.backward()
        opt.step()
    path = wrapped.export_onnx(tmp_path / "bert.onnx", input_ids=ids, attention_mask=mask)
    sess = _session(path)
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask"]
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    model.eval()
    with torch.no_grad():
        for b, s in ((4, 16), (2, 24), (5, 7)):
            ids, mask = batch(b, s)
            want = model(input_ids=ids, attention_mask=mask).logits
            got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
            _close(got, want, 1e-4, f"BERT logits at batch {b}, sequence {s}")


def test_deployment_export_uses_torch_export_and_keeps_the_legacy_tracer_as_an_option(tmp_path, monkeypatch):
    """Issue 14: the deployment export runs on torch.onnx's torch.export-based exporter; the legacy
    TorchScript tracer (deprecated by torch) only where asked for. Both graphs match eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
    calls = []
    real = torch.onnx.export

    def spy(*args, **kwargs):
        calls.append(kwargs.get("dynamo"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", spy)
    x = torch.randn(1, 4)  # a batch of 1 must still give a dynamic batch axis
    new = export_inference(model, tmp_path / "new.onnx", x, dynamic_axes="auto")
    old = export_inference(model, tmp_path / "old.onnx", x, dynamic_axes="auto", exporter="torchscript")
    assert calls == [True, False]
    with torch.no_grad():
        for b in (1, 5):
            xb = torch.randn(b, 4)
            _close(_run(new, input=xb)[0], model(xb), what=f"torch.export graph, batch {b}")
            _close(_run(old, input=xb)[0], model(xb), what=f"TorchScript graph, batch {b}")
    assert onnx.load(str(new)).graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    with pytest.raises(ValueError, match="exporter must be"):
        export_inference(model, tmp_path / "x.onnx", x, exporter="jit")


class _ScaleByBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) * float(x.shape[0])  # a size read into Python


class _BranchOnBatch(_ScaleByBatch):
    def forward(self, x):
        return self.lin(x) * (2.0 if x.shape[0] == 3 else 1.0)


def test_deployment_export_keeps_sizes_symbolic_or_refuses(tmp_path):
    """A size read into Python stays an expression of the dynamic batch (the legacy tracer baked it);
    a branch on a dynamic size is an error naming the way out, never a graph for one batch size."""
    torch.manual_seed(0)
    model = _ScaleByBatch()
    path = export_inference(model, tmp_path / "scale.onnx", torch.randn(3, 4), dynamic_axes="auto")
    with torch.no_grad():
        for b in (3, 5):
            x = torch.randn(b, 4)
            _close(_run(path, x=x)[0], model(x), what=f"batch {b}")
    from ortmodule.errors import ExportError

    with pytest.raises(ExportError, match="dynamic_axes=None"):
        export_inference(_BranchOnBatch(), tmp_path / "branch.onnx", torch.randn(3, 4), dynamic_axes="auto")
    static = export_inference(_BranchOnBatch(), tmp_path / "static.onnx", torch.randn(3, 4))
    assert [d.dim_value for d in onnx.load(str(static)).graph.input[0].type.tensor_type.shape.dim] == [3, 4]


class LogEps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = F.relu(self.lin(x))
        return torch.log(h + 1e-12) + torch.sqrt(h + 1e-10) * 0.9999999


def test_deployment_export_keeps_small_epsilons(tmp_path):
    """NOTE [near-identity constants]: the deployed graph lost ``+ 1e-12`` (onnxscript's optimizer
    matched it as ``+ 0``): -inf wherever the ReLU is zero."""
    torch.manual_seed(0)
    model = LogEps()
    x = torch.randn(64, 16)
    path = ORTModule(model).export_onnx(tmp_path / "logeps.onnx", x)
    got = _run(path, x=x)[0]
    with torch.no_grad():
        want = model(x)
        assert (F.relu(model.lin(x)) == 0).any()  # the epsilon decides some outputs
    assert np.isfinite(got).all()
    _close(got, want)
