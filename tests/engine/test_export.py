"""Export: ONNX (checked with onnxruntime) and TorchScript round trips of a U-Net and a ResNet-18
with a dynamic batch axis, the task's real model input, and the CLI on a trained checkpoint."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import fastvision
from fastvision.cli import main
from fastvision.engine import checkpoint
from fastvision.errors import ConfigError, DataError
from fastvision.inference import export
from fastvision.models import create_model
from tests.cli.input_checks import one_line_error
from tests.conftest import tiny_overrides

HAS_ORT = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))
FORMATS = ["torchscript", pytest.param("onnx", marks=pytest.mark.skipif(not HAS_ORT, reason="needs onnx, "
                                                                          "onnxscript and onnxruntime"))]
# a U-Net of two levels (the fewest with a down- and an up-sampling and a skip concatenation): the ONNX
# exporter's cost (torch.export, decompositions, ONNX passes) grows with the number of ops, seconds a level
MODELS = [("unet2d-seed001", {"in_channels": 1, "out_channels": 2, "filters": [4, 8]}, 1),
          ("resnet18", {"num_classes": 3}, 3)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name, kwargs, channels", MODELS)
def test_round_trip_with_another_batch_size(name, kwargs, channels, fmt, tmp_path):
    torch.manual_seed(0)
    model = create_model(name, **kwargs).eval()
    path = export.export_model(model, torch.randn(2, channels, 32, 32), tmp_path / f"m{export.SUFFIX[fmt]}", fmt)
    assert path.is_file()
    x = torch.randn(3, channels, 32, 32)  # batch 3 != example batch 2: the batch axis is dynamic
    diff = export.max_abs_diff(path, fmt, model, x)
    assert diff is not None and diff <= 1e-4
    with torch.no_grad():
        assert model(x).abs().max() > 1e-3  # a non-trivial output, so the comparison means something


def test_torchscript_file_holds_the_model_weights(tmp_path):
    model = create_model("resnet18", num_classes=3).eval()
    path = export.export_model(model, torch.randn(2, 3, 32, 32), tmp_path / "r.pt", "torchscript")
    loaded = torch.jit.load(str(path)).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k


def test_classification_model_input_is_the_normalised_image():
    import fastvision.losses  # noqa: F401  (registers the losses)
    from fastvision.registry import LOSSES as REG
    from fastvision.tasks.classify import ClassificationTask

    task = ClassificationTask(num_classes=3, image_size=16, loss=REG.build("ce", {}))
    model = create_model("resnet18", num_classes=3)
    torch.manual_seed(5)
    captured = export.model_input(model, task, batch_size=2)
    torch.manual_seed(5)
    image = task.synthetic_batch(2, torch.device("cpu"))["image"]
    mean = torch.tensor([123.68, 116.28, 103.53]).view(1, 3, 1, 1)
    std = torch.tensor([58.395, 57.12, 57.385]).view(1, 3, 1, 1)
    torch.testing.assert_close(captured, (image * 255 - mean) / std, rtol=1e-5, atol=1e-5)


def test_bad_format_and_missing_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="--format"):
        export.export_model(torch.nn.Linear(2, 2), torch.randn(2, 2), tmp_path / "x", "tflite")
    with pytest.raises(DataError, match="not found"):
        export.export_checkpoint(tmp_path / "nope.pt", "onnx")
    with pytest.raises(DataError, match="no checkpoints"):
        export.export_checkpoint(tmp_path, "onnx")


def test_missing_onnx_package_is_a_config_error(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "onnxscript" else real(n, *a))
    with pytest.raises(ConfigError, match="pip install onnx onnxscript onnxruntime"):
        export.export_model(torch.nn.Linear(2, 2), torch.randn(2, 2), tmp_path / "x.onnx", "onnx")


@pytest.fixture(scope="module")
def trained_run(tiny_microscopy, tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    fastvision.train("unet2d-microscopy", out=str(run), **tiny_overrides(
        tiny_microscopy, epochs=1, examples=0, **{"task.args.sample_shape": [1, 32, 32], "model.args.filters": [4, 8]}))
    return run


@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_exports_a_trained_run(trained_run, fmt, tmp_path, capsys):
    out = tmp_path / f"unet{export.SUFFIX[fmt]}"
    assert main(["export", str(trained_run), "--format", fmt, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "max abs diff" in printed and ": ok" in printed and "batchx1x32x32" in printed
    if fmt == "torchscript":  # the trained weights, not a fresh initialisation
        ckpt = checkpoint.load(trained_run / "checkpoints" / "best.pt")["model"]
        loaded = torch.jit.load(str(out)).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in ckpt.items())


@pytest.mark.parametrize("args, needle", [
    (["--format", "torchscript", "--out", "{file}/m.pt"], "is a file, not a folder"),  # a FileExistsError traceback
    (["--format", "torchscript", "--out", "{folder}", "--force"], "is a folder; give a file path"),
    (["--opset", "0"], "--opset 0: must be >= 1"),  # torch wrote opset 18 and exited 0
    (["--opset", "17", "--format", "torchscript"], "--opset 17: an ONNX setting"),  # silently ignored
    pytest.param(["--opset", "999"], "knows opsets up to", marks=pytest.mark.skipif(not HAS_ORT, reason="needs onnx")),
    (["--format", "torchscript", "--tolerance", "-1"], "--tolerance -1: a finite number >= 0"),  # exported, exit 1
    (["--format", "torchscript", "--tolerance", "nan"], "--tolerance nan: a finite number >= 0"),  # every check failed
    (["--format", "torchscript", "--out", "{new}/"], "names a folder"),  # wrote a file named new
])
def test_bad_outputs_and_opsets_are_one_line_before_any_work(trained_run, args, needle, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x").write_text("mine")
    args = [a.format(file=tmp_path / "file", folder=tmp_path / "folder", new=tmp_path / "new") for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / f"m{export.SUFFIX[args[args.index('--format') + 1]]}"
                                                   if "--format" in args else tmp_path / "m.onnx")]
    code = main(["export", str(trained_run), *args, *out])
    one_line_error(code, capsys.readouterr().err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]


@pytest.mark.parametrize("name", ["best.pt", "last.pt"])  # last.pt: best.pt's hard link where the epoch improved
def test_out_over_the_checkpoint_being_exported_is_refused_even_with_force(trained_run, name, capsys):
    """``--out RUN/checkpoints/best.pt --force`` replaced the run's checkpoint with the exported model."""
    ckpt = trained_run / "checkpoints" / "best.pt"
    before = ckpt.read_bytes()
    if name == "last.pt" and not (trained_run / "checkpoints" / "last.pt").samefile(ckpt):
        pytest.skip("this run's last.pt is not best.pt's hard link")
    code = main(["export", str(trained_run), "--format", "torchscript", "--force",
                 "--out", str(trained_run / "checkpoints" / name)])
    one_line_error(code, capsys.readouterr().err, "is the checkpoint being exported")
    assert ckpt.read_bytes() == before


@pytest.mark.skipif(not HAS_ORT, reason="needs onnx, onnxscript and onnxruntime")
def test_an_opset_the_exporter_cannot_reach_keeps_the_old_file(trained_run, tmp_path, capsys):
    """``--opset 9``: torch exports opset 18 and converts down; where the conversion fails it logged a traceback,
    kept 18 and exited 0. Now one line, and the file --force would have replaced is as it was (the export is
    written beside it and renamed only when finished)."""
    keep = tmp_path / "m.onnx"
    keep.write_text("mine")
    code = main(["export", str(trained_run), "--opset", "9", "--out", str(keep), "--force", "--no-check"])
    err = capsys.readouterr().err
    one_line_error(code, err, "--opset 9", "could not convert", "opset 18")
    assert keep.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


class _DictHead(torch.nn.Module):
    """A detector-shaped output: a dict of tensors, one of them batch-independent (as SSD's anchors)."""

    def __init__(self):
        super().__init__()
        self.cls, self.box = torch.nn.Linear(6, 3), torch.nn.Linear(6, 4)

    def forward(self, x):
        return {"cls_logits": self.cls(x), "box_codes": self.box(x), "anchors": self.box.weight * 2}


def test_output_names_follow_the_model_output():
    t = torch.zeros(1)
    assert export.output_names(t) == ["output"]
    assert export.output_names((t, [t, t])) == ["output0", "output1.0", "output1.1"]
    assert export.output_names({"a": t, "b": {"c": t}, "d": (t,)}) == ["a", "b.c", "d.0"]


@pytest.mark.skipif(not HAS_ORT, reason="needs onnx, onnxscript and onnxruntime")
def test_onnx_outputs_of_a_dict_model_keep_its_keys(tmp_path, caplog):
    """An SSD's ONNX outputs were named cat, cat_1, cat_7: a deployment had to guess which was the logits
    (and onnx_ir printed a warning about the constant anchors output)."""
    import logging

    import onnx

    torch.manual_seed(0)
    model = _DictHead().eval()
    with caplog.at_level(logging.WARNING):
        path = export.export_model(model, torch.randn(2, 6), tmp_path / "m.onnx", "onnx")
    assert not [r for r in caplog.records if "deduplication" in r.getMessage()]
    assert [o.name for o in onnx.load(str(path)).graph.output] == ["cls_logits", "box_codes", "anchors"]
    assert export.max_abs_diff(path, "onnx", model, torch.randn(3, 6)) <= 1e-5


def test_ssd_exports_without_setting_its_anchor_cache():
    """torch.export warned (on every `fastvision export` of a detection run) that SSD's anchor cache was
    assigned during export; exporting now computes the anchors in the graph and leaves the cache alone."""
    import warnings

    torch.manual_seed(0)
    model = create_model("ssd320-small", num_classes=2).eval()
    x = torch.randn(2, 3, 64, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = torch.export.export(model, (x,), strict=False)
    assert not [w for w in caught if "assigned during export" in str(w.message)]
    assert model._anchor_cache == {}
    with torch.no_grad():
        assert torch.equal(program.module()(x)["anchors"], model(x)["anchors"]) and len(model._anchor_cache) == 1


def test_a_checkpoint_of_another_version_names_the_file_and_version(trained_run, tmp_path, capsys):
    """A checkpoint whose saved model this version does not have: ``unknown model 'unet9'`` named neither the
    file nor that another fastvision wrote it."""
    state = checkpoint.load(trained_run / "checkpoints" / "best.pt")
    state["fastvision"], state["config"]["model"]["name"] = "99.0", "unet9"
    other = tmp_path / "other.pt"
    torch.save(state, other)
    code = main(["export", str(other), "--format", "torchscript", "--out", str(tmp_path / "m.pt")])
    err = capsys.readouterr().err
    one_line_error(code, err, str(other))
    assert "fastvision 99.0" in err and "unet9" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt"]


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGTERM"), reason="POSIX signals")
def test_sigterm_mid_export_leaves_no_partial_file(tmp_path):
    """``kill`` during an export ended the process on the spot: the half-written file stayed in a
    ``.m.onnx.xxxx`` folder beside ``--out`` (77 MB for unet3d-spleen-fast) and the earlier file was kept."""
    import os
    import signal
    import time

    out = tmp_path / "m.onnx"
    out.write_text("earlier export")
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped, export.staged(out) as tmp:
        tmp.write_bytes(b"half a model")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at the next bytecode; never reached
    assert stopped.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"] and out.read_text() == "earlier export"
    assert signal.getsignal(signal.SIGTERM) is handler  # the handler from before is back


@pytest.mark.parametrize("fmt,out,fit", [
    ("torchscript", "x.onnx", "x.torchscript.pt"),
    ("onnx", "m.pt", "m.onnx"),  # the default format, a TorchScript name
    ("onnx", "m.torchscript.pt", "m.onnx"),
])
def test_an_out_named_as_the_other_format_is_one_line(tmp_path, capsys, fmt, out, fit):
    # was exported in the format asked for under the other format's name: onnxruntime / torch.jit.load then fail on it
    ckpt = tmp_path / "run.pt"
    ckpt.write_bytes(b"never read")  # refused before the checkpoint is opened
    assert main(["export", str(ckpt), "--format", fmt, "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--out {tmp_path / out}" in err and f"--format {fmt}" in err, err
    assert str(tmp_path / fit) in err and sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]
