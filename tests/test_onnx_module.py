"""OnnxModule: train ONNX files (scikit-learn via skl2onnx, torch.onnx.export) and save them back."""

from __future__ import annotations

import copy
import io
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ortmodule import GradientRuleError, OnnxModule
from ortmodule.onnx_module import OnnxLoadError
from tests.helpers import assert_close

RTOL = 1e-4


# -- model files -------------------------------------------------------------------------------------
def _export(model: nn.Module, x: torch.Tensor, dynamic_batch: bool = True, opset: int = 17) -> onnx.ModelProto:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (x,), buf, dynamo=False, export_params=True, opset_version=opset,
            input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}} if dynamic_batch else None,
        )
    return onnx.load_from_string(buf.getvalue())


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc = nn.Linear(8 * 2 * 2, 4)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(x, 1))


def _param(om: OnnxModule, onnx_name: str) -> torch.Tensor:
    return getattr(om, om.attr_names[onnx_name])


def _ort_run(model: onnx.ModelProto | str, **feeds: np.ndarray) -> list[np.ndarray]:
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


def _linear_model(opset: int = 17, op: str | None = None) -> onnx.ModelProto:
    """y = op(x) @ W + b, with a float W ('lin.weight') and b ('lin.bias')."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "lin.weight")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "lin.bias")
    nodes, src = [], "x"
    if op is not None:
        nodes.append(helper.make_node(op, ["x"], ["pre"], name="pre_op"))
        src = "pre"
    nodes += [
        helper.make_node("MatMul", [src, "lin.weight"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "lin.bias"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "lin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _train_pair(model: nn.Module, x, y, loss_fn, steps=4, trainable=None, onnx_model=None):
    """AdamW steps on eager ``model`` and on OnnxModule(file of model); return both."""
    eager = copy.deepcopy(model)
    om = OnnxModule(onnx_model if onnx_model is not None else _export(model, x[:2]), trainable)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(om.parameters(), lr=1e-2)
    for step in range(steps):
        for m, opt in ((eager, opt_e), (om, opt_o)):
            opt.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()
            opt.step()
        for name, pe in eager.named_parameters():
            assert_close(_param(om, name), pe, RTOL, f"{name} after step {step}")
    return eager, om


# -- PyTorch files: parity with eager training ---------------------------------------------------------
def test_torch_mlp_file_trains_like_eager(tmp_path):
    torch.manual_seed(0)
    model, x, y = MLP(), torch.randn(32, 16), torch.randint(0, 5, (32,))
    eager, om = _train_pair(model, x, y, nn.functional.cross_entropy)
    assert sorted(om.onnx_state_dict()) == sorted(n for n, _ in model.named_parameters())
    # save() / reload: a plain InferenceSession computes what the trained OnnxModule computes
    path = tmp_path / "mlp.onnx"
    om.save(path)
    (got,) = _ort_run(str(path), x=x.numpy())
    with torch.no_grad():
        assert_close(torch.from_numpy(got), om.eval()(x), 1e-6, "reloaded output")
        assert_close(torch.from_numpy(got), eager(x), RTOL, "reloaded vs eager")
    reloaded = OnnxModule(path)
    for name, t in om.onnx_state_dict().items():
        assert torch.equal(reloaded.onnx_state_dict()[name], t), name


def test_torch_cnn_file_trains_like_eager(tmp_path):
    torch.manual_seed(0)
    model, x, y = CNN(), torch.randn(8, 1, 8, 8), torch.randint(0, 4, (8,))
    eager, om = _train_pair(model, x, y, nn.functional.cross_entropy)
    om.save(tmp_path / "cnn.onnx")
    (got,) = _ort_run(str(tmp_path / "cnn.onnx"), x=x.numpy())
    with torch.no_grad():
        assert_close(torch.from_numpy(got), eager(x), RTOL, "reloaded CNN output vs eager")


def test_dynamic_batch_one_entry():
    torch.manual_seed(0)
    model = MLP()
    om = OnnxModule(_export(model, torch.randn(2, 16)))
    for n in (8, 5, 1):
        x = torch.randn(n, 16)
        out = om(x)
        out.sum().backward()
        assert out.shape == (n, 5)
        with torch.no_grad():
            assert_close(out, model(x), 1e-5, f"batch {n}")
    assert len(om._entries) == 1
    with torch.no_grad():
        om(torch.randn(3, 16))
    assert len(om._entries) == 2  # the forward-only entry


def test_static_batch_file_refuses_other_batch():
    om = OnnxModule(_export(MLP(), torch.randn(4, 16), dynamic_batch=False))
    om(torch.randn(4, 16))
    with pytest.raises(ValueError, match="shape"):
        om(torch.randn(3, 16))
    with pytest.raises(TypeError, match="dtype"):
        om(torch.randn(4, 16, dtype=torch.float64))


def test_trainable_selection_freezes_the_rest():
    torch.manual_seed(0)
    model, x, y = MLP(), torch.randn(16, 16), torch.randint(0, 5, (16,))
    om = OnnxModule(_export(model, x[:2]), trainable=lambda n: n.startswith("out."))
    assert sorted(om.onnx_names[n] for n, _ in om.named_parameters()) == ["out.bias", "out.weight"]
    frozen = {n: t.clone() for n, t in om.onnx_state_dict().items() if not n.startswith("out.")}
    opt = torch.optim.AdamW(om.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(om(x), y).backward()
        opt.step()
    for name, before in frozen.items():
        t = _param(om, name)
        assert torch.equal(t, before), name
        assert t.grad is None
    assert not torch.equal(_param(om, "out.weight"), model.out.weight)
    # a list of ONNX names works too, and an unknown name is refused
    om2 = OnnxModule(_export(model, x[:2]), trainable=["fc1.weight"])
    assert [om2.onnx_names[n] for n, _ in om2.named_parameters()] == ["fc1.weight"]
    with pytest.raises(ValueError, match="nope"):
        OnnxModule(_export(model, x[:2]), trainable=["nope"])


def test_frozen_by_requires_grad_later():
    torch.manual_seed(0)
    model, x, y = MLP(), torch.randn(16, 16), torch.randint(0, 5, (16,))
    om = OnnxModule(_export(model, x[:2]))
    om.fc1_weight.requires_grad_(False)
    nn.functional.cross_entropy(om(x), y).backward()
    assert om.fc1_weight.grad is None and om.fc1_bias.grad is not None


def test_input_gradient():
    torch.manual_seed(0)
    model = MLP()
    om = OnnxModule(_export(model, torch.randn(2, 16)))
    x = torch.randn(4, 16, requires_grad=True)
    om(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    model(x2).square().sum().backward()
    assert_close(x.grad, x2.grad, 1e-5, "input grad")


def test_state_dict_round_trip_and_no_grad():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 16)
    om = OnnxModule(_export(model, x))
    sd = om.state_dict()
    assert "fc1_weight" in sd and om.onnx_names["fc1_weight"] == "fc1.weight"
    other = OnnxModule(_export(MLP(), x))
    other.load_state_dict(sd)
    with torch.no_grad():
        out = other(x)
        assert not out.requires_grad
        assert_close(out, model(x), 1e-5, "after load_state_dict")
    torch.save(sd, io.BytesIO())  # checkpointable
    clone = copy.deepcopy(om)  # after a run: the cached ORT sessions are not copied
    buf = io.BytesIO()
    torch.save(om, buf)
    with torch.no_grad():
        assert_close(clone(x), model(x), 1e-5, "deepcopy")
        assert_close(torch.load(io.BytesIO(buf.getvalue()), weights_only=False)(x), model(x), 1e-5, "pickle")


def test_opset_11_is_upgraded_and_old_opset_refused_when_conversion_fails(monkeypatch):
    om = OnnxModule(_linear_model(opset=11))
    x = torch.randn(5, 4)
    out = om(x)
    out.sum().backward()
    assert om.lin_weight.grad is not None
    assert om.to_onnx().opset_import[0].version >= 13

    def fail(model, version):
        raise RuntimeError("no adapter")

    monkeypatch.setattr(onnx.version_converter, "convert_version", fail)
    with pytest.raises(OnnxLoadError, match="opset 11.*no adapter"):
        OnnxModule(_linear_model(opset=11))


def test_kwargs_and_dict_outputs():
    inp = helper.make_tensor_value_info
    w = numpy_helper.from_array(np.ones((3,), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["a", "w"], ["prod"]), helper.make_node("Add", ["prod", "b"], ["sum"])],
        "two", [inp("a", TensorProto.FLOAT, ["N", 3]), inp("b", TensorProto.FLOAT, ["N", 3])],
        [inp("prod", TensorProto.FLOAT, ["N", 3]), inp("sum", TensorProto.FLOAT, ["N", 3])], [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    om = OnnxModule(model, output_format="dict")
    out = om(a, b=b)
    assert set(out) == {"prod", "sum"}
    assert torch.allclose(out["sum"], a + b)
    out["sum"].sum().backward()
    assert torch.allclose(om.w.grad, a.sum(0))
    prod, total = OnnxModule(model)(b=b, a=a)
    assert torch.allclose(total, a + b)
    assert torch.allclose(OnnxModule(model, outputs=["sum"])(a, b), a + b)
    with pytest.raises(TypeError, match="missing"):
        om(a)
    with pytest.raises(TypeError, match="unexpected"):
        om(a, b, c=b)


# -- gradient rules ------------------------------------------------------------------------------------
def test_missing_gradient_rule_reported_at_construction():
    model = _linear_model()
    # y -> LpNormalization (no rule) as the output: between the trainable weights and the output
    model.graph.node[-1].output[0] = "pre_norm"
    model.graph.node.append(helper.make_node("LpNormalization", ["pre_norm"], ["y"], name="norm_node"))
    with pytest.raises(GradientRuleError, match="LpNormalization.*norm_node.*lin.weight"):
        OnnxModule(model)
    frozen = OnnxModule(model, trainable=[])  # nothing trainable: fine, forward-only use
    assert frozen(torch.randn(2, 4)).shape == (2, 3)


def test_op_without_rule_on_input_preprocessing_is_fine():
    om = OnnxModule(_linear_model(op="LpNormalization"))
    om(torch.randn(3, 4)).sum().backward()
    assert om.lin_weight.grad is not None


# -- scikit-learn files ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return (X / 16).astype(np.float32), y


def _sk_mlp(digits, zipmap: bool):
    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPClassifier

    X, y = digits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = MLPClassifier(hidden_layer_sizes=(32,), max_iter=20, random_state=0).fit(X, y)
    return clf, to_onnx(clf, X[:1], options={id(clf): {"zipmap": zipmap}})


def test_sklearn_mlp_finetunes_to_lower_loss(digits, tmp_path):
    X, y = digits
    clf, model = _sk_mlp(digits, zipmap=False)
    om = OnnxModule(model, outputs=["probabilities"])
    x, t = torch.from_numpy(X), torch.from_numpy(y)
    with torch.no_grad():
        assert_close(om(x), torch.from_numpy(clf.predict_proba(X)).float(), 1e-5, "sklearn probabilities")
    loss = lambda: nn.functional.nll_loss(om(x).clamp_min(1e-7).log(), t)
    opt = torch.optim.Adam(om.parameters(), lr=1e-3)
    with torch.no_grad():
        before = loss().item()
    for _ in range(20):
        opt.zero_grad()
        loss().backward()
        opt.step()
    with torch.no_grad():
        after = loss().item()
    assert after < before - 0.01, (before, after)
    # saved back: sklearn's label output still works in a plain session, with the new weights
    om.save(tmp_path / "mlp.onnx")
    label, proba = _ort_run(str(tmp_path / "mlp.onnx"), X=X)
    with torch.no_grad():
        assert_close(torch.from_numpy(proba), om(x), 1e-6, "saved probabilities")
    assert (label == proba.argmax(1)).all()


def test_sklearn_zipmap_output_dropped_with_note(digits):
    _, model = _sk_mlp(digits, zipmap=True)
    with pytest.warns(UserWarning, match="non-tensor outputs.*zipmap"):
        om = OnnxModule(model)
    assert om.output_names == ["output_label"]
    with pytest.raises(OnnxLoadError, match="not a tensor"):
        OnnxModule(model, outputs=["output_probability"])


def test_sklearn_logistic_regression_has_nothing_to_train():
    from skl2onnx import to_onnx
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    X, y = load_iris(return_X_y=True)
    X = X.astype(np.float32)
    clf = LogisticRegression(max_iter=300).fit(X, y)
    model = to_onnx(clf, X[:1], options={id(clf): {"zipmap": False}})
    with pytest.warns(UserWarning, match="no trainable"):
        om = OnnxModule(model)
    label, proba = om(torch.from_numpy(X))
    assert_close(proba, torch.from_numpy(clf.predict_proba(X)).float(), 1e-5, "LinearClassifier")


# -- external data, untrusted files ------------------------------------------------------------------------
def _save_external(model: onnx.ModelProto, folder, name="m.onnx") -> str:
    path = os.path.join(folder, name)
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=name + ".data", size_threshold=0)
    return path


def test_external_data_save_and_load(tmp_path):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 16)
    om = OnnxModule(_save_external(_export(model, x), tmp_path))
    with torch.no_grad():
        assert_close(om(x), model(x), 1e-5, "external-data model")
        om.out_bias.add_(1.0)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    om.save(out_dir / "tuned.onnx", external_data=True)
    assert (out_dir / "tuned.onnx.data").exists()
    (got,) = _ort_run(str(out_dir / "tuned.onnx"), x=x.numpy())
    with torch.no_grad():
        assert_close(torch.from_numpy(got), om(x), 1e-6, "saved with external data")
    assert torch.equal(OnnxModule(out_dir / "tuned.onnx").out_bias, om.out_bias)


def _with_location(path: str, location: str) -> None:
    model = onnx.load(path, load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save_model(model, path)


@pytest.mark.parametrize("location", ["/etc/passwd", "../secret.data", "sub/../../secret.data"])
def test_external_data_escaping_the_folder_is_refused(tmp_path, location):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.data").write_bytes(b"\0" * 4096)
    path = _save_external(_linear_model(), folder)
    _with_location(path, location)
    with pytest.raises(OnnxLoadError, match="absolute|'\\.\\.'"):
        OnnxModule(path)


def test_external_data_symlink_outside_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    path = _save_external(_linear_model(), folder)
    real = tmp_path / "outside.data"
    os.replace(path + ".data", real)
    os.symlink(real, path + ".data")
    with pytest.raises(OnnxLoadError, match="outside the model's folder"):
        OnnxModule(path)


def test_truncated_external_data_is_refused(tmp_path):
    path = _save_external(_linear_model(), tmp_path)
    data = open(path + ".data", "rb").read()
    open(path + ".data", "wb").write(data[: len(data) - 8])
    with pytest.raises(OnnxLoadError, match="past the end|truncated"):
        OnnxModule(path)


def test_external_data_from_proto_needs_base_dir(tmp_path):
    path = _save_external(_linear_model(), tmp_path)
    proto = onnx.load(path, load_external_data=False)
    with pytest.raises(OnnxLoadError, match="base_dir"):
        OnnxModule(proto)
    om = OnnxModule(proto, base_dir=tmp_path)
    assert om.lin_weight.shape == (4, 3)


def test_truncated_and_garbage_files_are_refused(tmp_path):
    data = _export(MLP(), torch.randn(2, 16)).SerializeToString()
    for name, content in [("trunc.onnx", data[: len(data) // 2]), ("junk.onnx", b"\xff\x00garbage" * 10),
                          ("empty.onnx", b"")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(OnnxLoadError):
            OnnxModule(tmp_path / name)
    with pytest.raises(OnnxLoadError, match="cannot read"):
        OnnxModule(tmp_path / "missing.onnx")


def test_checker_failure_is_refused_and_proto_untouched():
    model = _linear_model()
    model.graph.node[0].input[0] = "undefined_value"
    before = model.SerializeToString()
    with pytest.raises(OnnxLoadError, match="checker"):
        OnnxModule(model)
    assert model.SerializeToString() == before
    good = _linear_model()
    before = good.SerializeToString()
    OnnxModule(good)
    assert good.SerializeToString() == before


def test_malformed_initializer_is_refused():
    model = _linear_model()
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:-4]
    with pytest.raises(OnnxLoadError):
        OnnxModule(model)


# -- composition -----------------------------------------------------------------------------------------
def test_composes_inside_a_torch_model():
    torch.manual_seed(0)
    body = MLP()
    head = nn.Linear(5, 2)
    combined = nn.Sequential(OnnxModule(_export(body, torch.randn(2, 16))), head)
    eager = nn.Sequential(copy.deepcopy(body), copy.deepcopy(head))
    combined[1].load_state_dict(eager[1].state_dict())
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    for m in (combined, eager):
        nn.functional.mse_loss(m(x), y).backward()
    assert_close(combined[0].fc1_weight.grad, eager[0].fc1.weight.grad, 1e-5, "fc1.weight grad")
    assert_close(combined[1].weight.grad, eager[1].weight.grad, 1e-5, "head grad")
    assert "0.fc1_weight" in combined.state_dict()


# -- vision decoders: Resize, DepthToSpace, ReduceProd ---------------------------------------------------
class Decoder(nn.Module):
    """A segmentation decoder as vision files have it: nearest, bilinear and bicubic upsampling (Resize),
    pixel_shuffle (DepthToSpace) and a product of gates (ReduceProd), per-pixel cross entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.sub = nn.Conv2d(16, 16, 3, padding=1)
        self.gate = nn.Linear(16, 15)
        self.out = nn.Conv2d(16, 5, 1)

    def forward(self, x):
        h = torch.relu(self.enc(x))
        near = nn.functional.interpolate(h[:, :4], scale_factor=2, mode="nearest")
        bil = nn.functional.interpolate(h[:, 4:8], scale_factor=2, mode="bilinear", align_corners=False)
        cub = nn.functional.interpolate(h[:, 8:12], scale_factor=2, mode="bicubic", align_corners=False)
        ps = nn.functional.pixel_shuffle(self.sub(h)[:, :16], 2)[:, :4]
        logits = self.out(torch.cat([near, bil, cub, ps], 1))
        gates = torch.prod(torch.sigmoid(self.gate(h.mean((2, 3)))).view(-1, 5, 3), -1)
        return logits * gates[:, :, None, None]


def _export_dynamo(model: nn.Module, x: torch.Tensor, optimize: bool = True) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(model, (x,), dynamo=True, verbose=False, optimize=optimize,
                                 dynamic_shapes=({0: torch.export.Dim("batch", min=2)},))
    return prog.model_proto


@pytest.mark.parametrize("exporter", ["torchscript", "torchscript-opset11",
                                      pytest.param("dynamo", marks=pytest.mark.exports)])
def test_vision_decoder_file_with_resize_trains_like_eager(exporter):
    """NOTE [resize adjoint]: the files' Resize (nearest, linear, cubic at scale 2, where onnxruntime and
    torch resample alike), DepthToSpace and ReduceProd train at eager's numbers: outputs, every gradient
    and the parameters after AdamW steps, at 32x32 with 8 images and then a batch of another size."""
    torch.manual_seed(0)
    model = Decoder()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 5, (8, 32, 32))
    if exporter == "dynamo":
        file = _export_dynamo(model, x[:2])
    else:  # opset 11's Resize (roi and scales required) is upgraded to 17 at load
        file = _export(model, x[:2], opset=11 if exporter.endswith("opset11") else 17)
    ops = {n.op_type for n in file.graph.node}
    assert {"Resize", "DepthToSpace", "ReduceProd"} <= ops, ops
    eager, om = _train_pair(model, x, y, nn.functional.cross_entropy, onnx_model=file)
    x2, y2 = torch.randn(3, 3, 32, 32), torch.randint(0, 5, (3, 32, 32))
    for m in (eager, om):
        m.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(x2), y2).backward()
    assert_close(om(x2), eager(x2), RTOL, "output at batch 3")
    for name, pe in eager.named_parameters():
        assert_close(_param(om, name).grad, pe.grad, RTOL, f"{name}.grad at batch 3")


def _nearest_resize(x_shape, out_shape, extra_nodes=(), inits=()) -> onnx.ModelProto:
    sizes = numpy_helper.from_array(np.array(out_shape, dtype=np.int64), "sizes")
    src = "h" if extra_nodes else "x"
    resize = helper.make_node("Resize", [src, "", "", "sizes"], ["y"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    graph = helper.make_graph([*extra_nodes, resize], "r",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], [*inits, sizes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_resize_gradient_is_the_adjoint_of_onnxruntimes_resize():
    """Sizes where ORT's nearest picks other pixels than torch's (6 -> 74 and 2 -> 82, NOTE [upsample as
    torch]): the gradient
    follows the file's own forward, <Resize(x), v> = <x, dx(v)>, not torch's."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((1, 3, 6, 2)).astype(np.float32), "w")
    om = OnnxModule(_nearest_resize([2, 3, 6, 2], [2, 3, 74, 82], [helper.make_node("Add", ["x", "w"], ["h"])], [w]))
    y = om(torch.randn(2, 3, 6, 2))
    v = torch.randn_like(y)
    (y * v).sum().backward()
    # dW = J^T (v summed over the batch), J probed one input position at a time by a plain InferenceSession
    sess = ort.InferenceSession(_nearest_resize([1, 3, 6, 2], [1, 3, 74, 82]).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    v1 = v.sum(0, keepdim=True).double().numpy()
    eye = np.eye(3 * 6 * 2, dtype=np.float32)
    want = np.array([(sess.run(None, {"x": e.reshape(1, 3, 6, 2)})[0] * v1).sum() for e in eye]).reshape(1, 3, 6, 2)
    np.testing.assert_allclose(_param(om, "w").grad.double().numpy(), want, rtol=1e-5, atol=1e-5)
    # torch's upsampling sends part of it elsewhere at these sizes: the check can tell the two apart
    t_w = torch.zeros(1, 3, 6, 2, dtype=torch.float64, requires_grad=True)
    up = nn.functional.interpolate(t_w.expand(2, -1, -1, -1), size=(74, 82), mode="nearest")
    (up * v.double()).sum().backward()
    assert not np.allclose(t_w.grad.numpy(), want, rtol=1e-5, atol=1e-5)


class TextRNN(nn.Module):
    """A text classifier as speech and text files have it: embedding, a 2-layer bidirectional LSTM
    or GRU, the last step's features to a linear head."""

    def __init__(self, cell: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 12)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(12, 16, num_layers=2, bidirectional=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        out, _ = self.rnn(self.emb(x))  # x: [seq, batch]
        return self.head(out[-1])


@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.exports)])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_recurrent_file_trains_like_eager(cell, exporter):
    """NOTE [onnx rnn as torch]: LSTM / GRU nodes (forward and reverse directions, two layers) train at
    eager's numbers, the gradient from torch's own recurrent kernel."""
    torch.manual_seed(0)
    model = TextRNN(cell)
    x, y = torch.randint(0, 40, (20, 16)), torch.randint(0, 4, (16,))
    if exporter == "torchscript":
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x[:, :2],), buf, dynamo=False, opset_version=17, input_names=["x"],
                              output_names=["y"], dynamic_axes={"x": {1: "batch"}, "y": {0: "batch"}})
        file = onnx.load_from_string(buf.getvalue())
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            file = torch.onnx.export(model, (x[:, :2],), dynamo=True, verbose=False,
                                     dynamic_shapes=({1: torch.export.Dim("batch", min=2)},)).model_proto
    assert cell.upper() in {n.op_type for n in file.graph.node}
    # The TorchScript exporter repacks the recurrent weights under new names and layouts, so the check is
    # on what every weight feeds: the outputs and losses at each AdamW step, and the gradients of the
    # weights that keep their names (a wrong recurrent gradient moves the next step's outputs).
    eager, om = copy.deepcopy(model), OnnxModule(file)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(om.parameters(), lr=1e-2)
    named = [n for n, _ in eager.named_parameters() if n in om.attr_names]
    assert {"emb.weight", "head.weight"} <= set(named)
    for step in range(4):
        outs = []
        for m, opt in ((eager, opt_e), (om, opt_o)):
            opt.zero_grad(set_to_none=True)
            out = m(x)
            nn.functional.cross_entropy(out, y).backward()
            outs.append(out.detach())
        assert_close(outs[1], outs[0], RTOL, f"output at step {step}")
        for name in named:
            assert_close(_param(om, name).grad, eager.get_parameter(name).grad, RTOL, f"{name}.grad at step {step}")
        opt_e.step()
        opt_o.step()


def test_recurrent_node_torch_cannot_differentiate_is_refused_by_name():
    """A GRU with linear_before_reset=0 (torch's GRU has the other form): refused at construction."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("W", (1, 12, 3)), ("R", (1, 12, 4)))]
    node = helper.make_node("GRU", ["x", "W", "R"], ["y"], name="gru0", hidden_size=4, linear_before_reset=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 1, 2, 4])], inits)
    with pytest.raises(GradientRuleError, match="gru0.*linear_before_reset=0"):
        OnnxModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_one_element_initializers_stay_constants_unless_named():
    """NOTE [scalar constants]: y = (x @ W + b) * scale with a one-element ``scale`` initializer (as the
    exporters store fill values, epsilons and scales): kept frozen with a warning naming it, so AdamW
    leaves it as the file has it; naming it in ``trainable`` trains it."""
    model = _linear_model()
    model.graph.node[-1].output[0] = "pre_scale"
    model.graph.node.append(helper.make_node("Mul", ["pre_scale", "scale"], ["y"], name="scale_node"))
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "scale"))
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match=r"one-element float initializer.*'scale'"):
        om = OnnxModule(model)
    assert "scale" not in dict(om.named_parameters()) and om.scale.item() == 0.5
    opt = torch.optim.AdamW(om.parameters(), lr=0.1)
    om(x).square().sum().backward()
    opt.step()
    assert om.scale.item() == 0.5 and om.lin_weight.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trained = OnnxModule(model, trainable=["scale", "lin.weight"])
    trained(x).square().sum().backward()
    assert trained.scale.grad is not None and trained.lin_bias.grad is None


# -- what exporters change: merged, dropped and doubled initializers ------------------------------------
class _Logits(nn.Module):
    """An HF model's logits: what the files below are exported from."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).logits


def _hf_file(net: nn.Module, batch: int, trained: bool, optimize: bool = True):
    """_Logits(net), a batch of tokens and its torch.onnx (dynamo) file; ``trained`` moves every weight
    first, as in a fine-tuned checkpoint (no two weights alike, no zero bias)."""
    if trained:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    model, x = _Logits(net), torch.randint(0, 100, (batch, 16))
    return model, x, _export_dynamo(model, x[:2], optimize)


def _assert_logits_train_alike(model: nn.Module, om: OnnxModule, x: torch.Tensor, steps: int = 3):
    """As many trained numbers as eager; logits at eager's numbers at each AdamW step; returns the eager copy."""
    eager = copy.deepcopy(model)
    assert sum(p.numel() for p in om.parameters()) == sum(p.numel() for p in eager.parameters())
    opt_e, opt_o = torch.optim.AdamW(eager.parameters(), lr=1e-3), torch.optim.AdamW(om.parameters(), lr=1e-3)
    for step in range(steps):
        outs = []
        for m, opt in ((eager, opt_e), (om, opt_o)):
            opt.zero_grad(set_to_none=True)
            out = m(x)
            out.square().mean().backward()
            opt.step()
            outs.append(out.detach())
        assert_close(outs[1], outs[0], RTOL, f"logits at step {step}")
    return eager


def _hf_bert_file(trained: bool):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  num_labels=3)
    return _hf_file(transformers.BertForSequenceClassification(cfg).eval(), 8, trained)


@pytest.mark.exports
def test_hf_bert_checkpoint_file_trains_like_eager():
    """A fine-tuned HF BERT exported by torch.onnx (dynamo, default optimisation) trains at eager's numbers:
    outputs at each of 3 AdamW steps, then on a new batch."""
    model, x, file = _hf_bert_file(trained=True)
    om = OnnxModule(file)
    eager = _assert_logits_train_alike(model, om, x)
    x2 = torch.randint(0, 100, (5, 16))
    with torch.no_grad():
        assert_close(om(x2), eager(x2), RTOL, "logits after training")


@pytest.mark.exports
def test_merged_initializers_warn_and_untie():
    """NOTE [merged initializers]: a fresh HF BERT's file reads one zero [32] bias in 15 places (every
    bias and LayerNorm shift); OnnxModule warns, and untie=True trains a copy per reader, saved under
    their own names."""
    _, x, file = _hf_bert_file(trained=False)
    with pytest.warns(UserWarning, match=r"exporter merged.*LayerNorm.bias' \(all 0, read by 15 nodes\)"):
        tied = OnnxModule(file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        untied = OnnxModule(file, untie=True)
    assert not [w for w in caught if "merged" in str(w.message)]
    n_tied, n_untied = len(list(tied.parameters())), len(list(untied.parameters()))
    assert n_untied == n_tied + 14 + 4 + 1, (n_tied, n_untied)  # 14 bias copies, 4 LayerNorm weights, 1 FFN bias
    out = untied(x)
    out.square().mean().backward()
    grads = [untied.get_parameter(untied.attr_names[f"net.bert.embeddings.LayerNorm.bias.{k}"]).grad for k in (1, 2)]
    assert not torch.equal(grads[0], grads[1])  # each reader its own gradient
    with torch.no_grad():
        again = OnnxModule(untied.to_onnx())
        assert_close(again(x), untied(x), 1e-6, "the untied file reloaded")


def test_a_weight_stored_twice_is_named():
    """A tied weight that the exporter stored as W and W^T: they would train apart, and the warning says so."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "emb"), numpy_helper.from_array(np.ascontiguousarray(w.T), "head")]
    nodes = [helper.make_node("MatMul", ["x", "head"], ["h"]), helper.make_node("MatMul", ["h", "emb"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    file = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match=r"'emb' and 'head' \(transposed\) hold the same values"):
        OnnxModule(file)
    # tie=True: one weight, read twice, as the model had it; its gradient is both uses'
    tied = OnnxModule(file, tie=True)
    assert [n for n, _ in tied.named_parameters()] == ["emb"]
    x = torch.randn(5, 3)
    tied(x).square().sum().backward()
    ref = torch.from_numpy(w).requires_grad_()
    ((x @ ref.T) @ ref).square().sum().backward()
    assert_close(tied.emb.grad, ref.grad, 1e-5, "tied gradient")


@pytest.mark.exports
def test_hf_gpt2_checkpoint_file_with_tied_embeddings_trains_like_eager():
    """GPT-2's LM head is its token embedding; torch.onnx stores it twice (once transposed). tie=True
    trains one weight again: logits at eager's numbers over 3 AdamW steps."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model, x, file = _hf_file(transformers.GPT2LMHeadModel(cfg).eval(), 4, trained=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        om = OnnxModule(file, tie=True)
    _assert_logits_train_alike(model, om, x)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)  # a one-unit bias: a weight, not a constant

    def forward(self, x):
        return self.out(torch.relu(self.body(x)))


def test_a_one_unit_bias_trains_like_eager():
    """NOTE [scalar constants]: the one-element bias of nn.Linear(16, 1) is a layer's bias and trains."""
    torch.manual_seed(0)
    model, x, y = Regressor(), torch.randn(32, 8), torch.randn(32, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_pair(model, x, y, nn.functional.mse_loss)


# -- unoptimised exports: sequence splits, shapes the file declares ------------------------------------
def test_sequence_split_read_at_constant_positions_trains():
    """NOTE [sequence splits]: SplitToSequence (chunks of 2; unit pieces squeezed) read by constant
    SequenceAt, as unoptimised torch.onnx files split a fused projection: gradients as torch's."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 6)).astype(np.float32)
    const = lambda name, v: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(  # noqa: E731
        np.array(v, dtype=np.int64)))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), const("two", 2), const("p0", 0), const("p1", 1),
             helper.make_node("SplitToSequence", ["h", "two"], ["seq"], axis=1),
             helper.make_node("SequenceAt", ["seq", "p0"], ["a"]),
             helper.make_node("SequenceAt", ["seq", "p1"], ["b"]),
             helper.make_node("SplitToSequence", ["h"], ["units"], axis=1, keepdims=0),
             helper.make_node("SequenceAt", ["units", "p1"], ["u"]),
             helper.make_node("Mul", ["a", "b"], ["ab"]),
             helper.make_node("Unsqueeze", ["u", "p1"], ["u1"]),
             helper.make_node("Add", ["ab", "u1"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
                              [numpy_helper.from_array(w, "W")])
    om = OnnxModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = torch.randn(5, 6)
    om(x).square().sum().backward()
    ref = torch.from_numpy(w).requires_grad_()
    h = x @ ref
    (h[:, 0:2] * h[:, 2:4] + h[:, 1:2]).square().sum().backward()
    assert_close(om.W.grad, ref.grad, 1e-5, "W.grad")


@pytest.mark.exports
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_unoptimised_hf_files_train_like_eager(arch):
    """Fresh HF models exported with optimize=False (what README advises for untrained weights): GPT-2
    splits q, k, v with sequences (NOTE [sequence splits]); Llama's file needs its declared shapes (NOTE
    [declared shapes]) and keeps the rotary inv_freq buffer as an initializer, left out by trainable=."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if arch == "gpt2":
        net = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            use_cache=False)).eval()
    else:
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, use_cache=False)).eval()
    model, x, file = _hf_file(net, 4, trained=False, optimize=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        om = OnnxModule(file)
    if arch == "llama":  # NOTE [position tables]: its inv_freq buffer stays one
        assert any("'net.model.rotary_emb.inv_freq'" in str(w.message) for w in caught)
    _assert_logits_train_alike(model, om, x)


@pytest.mark.exports
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rotary_checkpoint_files_train_like_eager(arch):
    """Fine-tuned rotary LMs exported by torch.onnx (dynamo, default optimisation) fold their cos / sin
    tables into initializers; they stay buffers (NOTE [position tables]) and the file trains at eager's
    numbers over 3 AdamW steps (trained, the tables had moved the logits 1.3e-4 off in two)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    kind = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
            "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[arch]
    net = kind[0](kind[1](vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, use_cache=False)).eval()
    model, x, file = _hf_file(net, 4, trained=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        om = OnnxModule(file, tie=True)
    assert any("position encodings" in str(w.message) for w in caught)
    _assert_logits_train_alike(model, om, x)


def _train_against(om: OnnxModule, reference, params: list, x: torch.Tensor, steps: int = 3) -> None:
    """``om`` and ``reference(x)``, a torch formula over ``params``, trained side by side with AdamW on the
    mean square of their outputs: the outputs agree at every step."""
    opt_o, opt_r = torch.optim.AdamW(om.parameters(), lr=1e-2), torch.optim.AdamW(params, lr=1e-2)
    for step in range(steps):
        want = reference(x)
        got = om(x)
        assert_close(got, want, RTOL, f"output at step {step}")
        for opt, out in ((opt_o, got), (opt_r, want)):
            opt.zero_grad(set_to_none=True)
            out.square().mean().backward()
            opt.step()


def _rotary_tables(positions: int, dim: int, base: float = 10000.0, scale: float = 1.0):
    """inv_freq, cos and sin as an HF rotary embedding computes them (float32), [1, 1, S, D]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return inv_freq, (emb.cos() * scale)[None, None], (emb.sin() * scale)[None, None]


def test_position_tables_are_told_from_weights_by_their_values():
    """NOTE [position tables]: rotary frequencies and cos / sin tables (also scaled, as YaRN's are, and the
    classic interleaved sinusoidal table) are recognised; weights of every usual kind are not: random,
    zero, one, identity and ramp tables, LayerNorm weights, a sinusoidal table fine-tuned off its values,
    a table of 4 positions."""
    from ortmodule.onnx_module import _position_tables

    torch.manual_seed(0)
    inv_freq, cos, sin = _rotary_tables(16, 16)
    _, ycos, ysin = _rotary_tables(64, 32, base=500000.0, scale=1.17)
    pos = torch.arange(50).float()[:, None] * torch.exp(torch.arange(0, 24, 2).float() * (-np.log(10000.0) / 24))
    sinusoidal = torch.stack((pos.sin(), pos.cos()), -1).flatten(1)  # [50, 24], sin and cos interleaved
    tables = {"inv_freq_renamed": inv_freq, "unsqueeze_14": cos, "unsqueeze_15": sin, "yarn_cos": ycos,
              "yarn_sin": ysin, "pe": sinusoidal, "rotary_emb.inv_freq": torch.rand(8)}
    weights = {"w": torch.randn(64, 64) * 0.02, "zeros": torch.zeros(16, 16), "ones": torch.ones(1, 1, 16, 16),
               "eye": torch.eye(32), "ramp": torch.arange(16.0)[:, None].expand(16, 8).clone(),
               "ln.weight": torch.ones(32), "bias": torch.zeros(32), "decay": torch.full((8,), 0.5),
               "tuned_pe": sinusoidal + 0.02 * torch.randn_like(sinusoidal), "short": cos[..., :4, :],
               "emb": torch.randn(100, 32)}
    found = _position_tables({n: t.numpy() for n, t in {**tables, **weights}.items()})
    assert sorted(found) == sorted(tables)


def _rotary_graph(positions: int = 16, dim: int = 16):
    """q = x W rotated by cos / sin tables (half rotation, as Llama's), then an output projection."""
    rng = np.random.default_rng(0)
    _, cos, sin = _rotary_tables(positions, dim)
    arrays = {"wq": rng.standard_normal((dim, dim)) * 0.3, "wo": rng.standard_normal((dim, 4)) * 0.3,
              "unsqueeze_14": cos[0, 0].numpy(), "unsqueeze_15": sin[0, 0].numpy()}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
    inits.append(numpy_helper.from_array(np.array([dim // 2, dim // 2], dtype=np.int64), "halves"))
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]),
             helper.make_node("Split", ["q", "halves"], ["q1", "q2"], axis=-1),
             helper.make_node("Neg", ["q2"], ["nq2"]),
             helper.make_node("Concat", ["nq2", "q1"], ["rot"], axis=-1),
             helper.make_node("Mul", ["q", "unsqueeze_14"], ["qc"]),
             helper.make_node("Mul", ["rot", "unsqueeze_15"], ["qs"]),
             helper.make_node("Add", ["qc", "qs"], ["qr"]),
             helper.make_node("MatMul", ["qr", "wo"], ["y"])]
    graph = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                           ["N", positions, dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", positions, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), arrays


def test_rotary_tables_of_a_file_stay_buffers_and_the_weights_train_like_torch():
    """NOTE [position tables]: an optimised rotary file's folded cos / sin tables are kept frozen, with a
    warning naming them (trained, they moved a Llama file's logits off eager's); the weights train at
    torch's numbers over 3 AdamW steps; trainable= naming a table still trains it."""
    file, arrays = _rotary_graph()
    with pytest.warns(UserWarning, match=r"position encodings.*'unsqueeze_14', 'unsqueeze_15'"):
        om = OnnxModule(file)
    assert sorted(om.onnx_names[n] for n, _ in om.named_parameters()) == ["wo", "wq"]
    ref = {k: torch.tensor(v, dtype=torch.float32, requires_grad=k in ("wq", "wo")) for k, v in arrays.items()}

    def rotary(x):
        q = x @ ref["wq"]
        rot = torch.cat((-q[..., 8:], q[..., :8]), -1)
        return (q * ref["unsqueeze_14"] + rot * ref["unsqueeze_15"]) @ ref["wo"]

    _train_against(om, rotary, [ref["wq"], ref["wo"]], torch.randn(8, 16, 16))
    assert torch.equal(om.get_buffer(om.attr_names["unsqueeze_14"]), ref["unsqueeze_14"])
    named = OnnxModule(file, trainable=["wq", "wo", "unsqueeze_14"])
    assert sorted(named.onnx_names[n] for n, _ in named.named_parameters()) == ["unsqueeze_14", "wo", "wq"]


def test_batchnorm_running_statistics_are_not_trained():
    """NOTE [bn statistics]: an inference-mode BatchNormalization's running mean and variance stay buffers
    (trained, they moved the outputs 2% off eager's after one AdamW step); its scale and shift train."""
    rng = np.random.default_rng(0)
    arrays = {"conv.weight": rng.standard_normal((4, 3, 3, 3)), "bn.weight": rng.uniform(0.5, 1.5, 4),
              "bn.bias": rng.standard_normal(4), "bn.running_mean": rng.standard_normal(4) * 0.3,
              "bn.running_var": rng.uniform(0.5, 2.0, 4)}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
    nodes = [helper.make_node("Conv", ["x", "conv.weight"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean",
                                                     "bn.running_var"], ["y"], epsilon=1e-5)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 4, 4])], inits)
    om = OnnxModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert sorted(om.onnx_names[n] for n, _ in om.named_parameters()) == ["bn.bias", "bn.weight", "conv.weight"]
    ref = {k: torch.tensor(v, dtype=torch.float32, requires_grad=k in ("conv.weight", "bn.weight", "bn.bias"))
           for k, v in arrays.items()}
    _train_against(om, lambda x: F.batch_norm(F.conv2d(x, ref["conv.weight"]), ref["bn.running_mean"],
                                              ref["bn.running_var"], ref["bn.weight"], ref["bn.bias"],
                                              training=False, eps=1e-5),
                   [ref["conv.weight"], ref["bn.weight"], ref["bn.bias"]], torch.randn(8, 3, 6, 6))
    assert torch.equal(om.get_buffer(om.attr_names["bn.running_mean"]), ref["bn.running_mean"])


def test_train_mode_dropout_without_a_mask_output_gets_one():
    """NOTE [dropout mask]: torch.onnx's dynamo exporter writes a train-mode model's dropout as
    Dropout(x, ratio, training_mode=True) with no mask output; such files were refused ("no mask
    output"). The mask output is added at load, and the gradient is dY * mask / (1 - p) for the mask
    onnxruntime drew: W.grad = x^T (dY * [y != 0] / (1 - p)) with dY = 1."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Constant", [], ["ratio"], value=numpy_helper.from_array(np.array(0.3, np.float32))),
             helper.make_node("Constant", [], ["train"], value=numpy_helper.from_array(np.array(True))),
             helper.make_node("Dropout", ["h", "ratio", "train"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])],
                              [numpy_helper.from_array(w, "w")])
    om = OnnxModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = torch.randn(256, 16)
    y = om(x)
    y.sum().backward()
    kept = (y.detach() != 0).float()
    assert 0.6 < float(kept.mean()) < 0.8  # p = 0.3 dropped
    assert_close(y.detach(), (x @ torch.from_numpy(w)) * kept / 0.7, 1e-5, "output")
    assert_close(om.w.grad, x.T @ (kept / 0.7), 1e-5, "w.grad")


def test_training_mode_batchnorm_file_moves_its_running_statistics_once_per_call():
    """NOTE [running stats]: a file exported in training mode (BatchNormalization training_mode=1) moves its
    running mean and variance by ONNX's formula once per call, with or without grad, and the module's
    buffers hold them (written back, not left to onnxruntime writing into the bound memory)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=0.2), nn.ReLU(), nn.Flatten(),
                        nn.Linear(8 * 10 * 10, 4)).train()
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(net), (torch.randn(4, 3, 12, 12),), f, dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, input_names=["x"],
                          dynamic_axes={"x": {0: "b"}})
    om = OnnxModule(f.getvalue())
    mean_buf, var_buf = (om.get_buffer(om.attr_names[k]) for k in ("1.running_mean", "1.running_var"))
    conv_w, conv_b = om.get_parameter(om.attr_names["0.weight"]), om.get_parameter(om.attr_names["0.bias"])
    opt = torch.optim.AdamW(om.parameters(), lr=1e-2)
    for step in range(4):
        x = torch.randn(16, 3, 12, 12)
        with torch.no_grad():
            h = F.conv2d(x, conv_w, conv_b)
            want_mean = 0.8 * mean_buf + 0.2 * h.mean((0, 2, 3))
            want_var = 0.8 * var_buf + 0.2 * h.var((0, 2, 3), unbiased=False)
        if step % 2:
            with torch.no_grad():
                om(x)
        else:
            opt.zero_grad()
            om(x).square().mean().backward()
            opt.step()
        assert om.get_buffer(om.attr_names["1.running_mean"]) is mean_buf
        assert_close(mean_buf, want_mean, 1e-5, f"running mean at step {step}")
        assert_close(var_buf, want_var, 1e-5, f"running var at step {step}")


def test_a_folded_broadcast_is_warned_and_tied_back_into_one_tensor():
    """NOTE [merged initializers]: an export at a fixed batch folds ``cls_token.expand(batch, -1, -1)``
    into a [batch, 1, hidden] initializer whose copies train apart. It is named in a warning; with
    tie=True it becomes the one token and an Expand, and its gradient is the sum over the copies, as in
    the model."""
    rng = np.random.default_rng(0)
    token = rng.standard_normal((1, 1, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(np.repeat(token, 4, axis=0), "expand"), numpy_helper.from_array(w, "w")]
    nodes = [helper.make_node("Concat", ["expand", "x"], ["seq"], axis=1),
             helper.make_node("MatMul", ["seq", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6, 3])], inits)
    file = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match=r"'expand' \[4, 1, 8\] \(repeated along axis 0\)"):
        OnnxModule(file)
    om = OnnxModule(file, tie=True)
    assert sorted((om.onnx_names[n], tuple(p.shape)) for n, p in om.named_parameters()) == \
        [("expand.one", (1, 1, 8)), ("w", (8, 3))]
    ref_token, ref_w = torch.tensor(token, requires_grad=True), torch.tensor(w, requires_grad=True)
    x = torch.randn(4, 5, 8)
    want = torch.cat([ref_token.expand(4, -1, -1), x], 1) @ ref_w
    got = om(x)
    assert_close(got, want, 1e-6, "output")
    got.square().sum().backward()
    want.square().sum().backward()
    assert_close(om.get_parameter(om.attr_names["expand.one"]).grad, ref_token.grad, 1e-5, "token.grad")
    assert_close(om.w.grad, ref_w.grad, 1e-5, "w.grad")


@pytest.mark.exports
def test_vit_file_exported_at_a_fixed_batch_trains_like_eager_with_tie():
    """A fine-tuned HF ViT exported by torch.onnx at a fixed batch (no dynamic_shapes) folds its cls token's
    expand into a [batch, 1, hidden] initializer; with tie=True it trains at eager's numbers over 3 AdamW
    steps (its copies had trained apart: 2.4e-2 off at the second step)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    net = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.02)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(pixel_values=x).logits

    model, x = Logits(), torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        file = torch.onnx.export(model, (x,), dynamo=True, verbose=False).model_proto
        om = OnnxModule(file, tie=True)
    _assert_logits_train_alike(model, om, x)


def test_folded_masks_stay_buffers_and_zero_initialised_weights_train():
    """NOTE [folded constants]: an additive causal mask (-inf above the diagonal) and a mask of zeros over
    [batch, 1, S, S], which an export at fixed shapes folds into initializers, stay buffers with a warning
    naming them; a layer-scale of ones [1, 1, C] and a zero bias [C] are weights and train."""
    from ortmodule.onnx_module import _folded_constant

    causal = np.triu(np.full((4, 4), -np.inf, np.float32), 1)[None, None]
    zeros = np.zeros((2, 1, 4, 4), np.float32)
    assert _folded_constant(causal) and _folded_constant(zeros)
    assert _folded_constant(np.full((3, 5), np.finfo(np.float32).min, np.float32))
    for weight in (np.ones((1, 1, 8), np.float32), np.zeros(8, np.float32), np.zeros((8, 1), np.float32),
                   np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)):
        assert not _folded_constant(weight)
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(causal, "mask"), numpy_helper.from_array(zeros, "zero_mask"),
             numpy_helper.from_array(np.ones((1, 1, 4), np.float32), "scale"),
             numpy_helper.from_array(np.zeros(4, np.float32), "bias"),
             numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Transpose", ["h"], ["hT"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["h", "hT"], ["scores"]),
             helper.make_node("Add", ["scores", "mask"], ["s1"]),
             helper.make_node("Add", ["s1", "zero_mask"], ["s2"]),
             helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "h"], ["ctx"]),
             helper.make_node("Mul", ["ctx", "scale"], ["c1"]),
             helper.make_node("Add", ["c1", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1, 4, 4])], inits)
    file = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match=r"folded.*'mask', 'zero_mask'"):
        om = OnnxModule(file)
    assert sorted(om.onnx_names[n] for n, _ in om.named_parameters()) == ["bias", "scale", "w"]
    om(torch.randn(2, 1, 4, 4)).square().sum().backward()
    assert all(p.grad is not None for p in om.parameters())
    assert sorted(om.onnx_names[n] for n, _ in OnnxModule(file, trainable=["w", "zero_mask"]).named_parameters()) \
        == ["w", "zero_mask"]


def test_torch_func_transform_raises_naming_it_and_the_module_keeps_working():
    """NOTE [functorch transforms]: OnnxModule has no eager forward to run instead, so a torch.func
    transform gets an error that names it (torch's named no cause), and plain calls keep working."""
    from ortmodule import ORTModuleError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    om = OnnxModule(_export(model, torch.randn(3, 4)))
    x = torch.randn(5, 4)
    with pytest.raises(ORTModuleError, match="torch.func transform"):
        torch.vmap(om)(x[:, None])
    assert_close(om(x), model(x), 1e-6, "a plain call after the error")
