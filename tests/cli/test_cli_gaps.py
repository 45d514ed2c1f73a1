"""Bad-input gaps a new user hit: empty checkpoint, half-known --set keys, overwriting outputs,
``data synth KIND --help``, integer counts in ``evaluate``. Each is one line and exit 2, or works."""
from __future__ import annotations

import sys

import pytest

from fastvision.cli import _format_value, main

TINY = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]"]


pytestmark = pytest.mark.usefixtures("fresh_logging")


def _one_line(code, err, *needles):
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastvision: error:"), err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])


def test_empty_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    code = main(["predict", str(empty), str(tmp_path), "--out", str(tmp_path / "out")])
    _one_line(code, capsys.readouterr().err, empty, "empty")
    code = main(["evaluate", str(empty)])
    _one_line(code, capsys.readouterr().err, empty)


@pytest.mark.parametrize("key,needles", [
    ("no.such=1", ["unknown key no.such", "the top level of the config has no 'no'", "valid keys there:", "train"]),
    ("train.no.such=1", ["unknown key train.no.such", "section train has no 'no'", "epochs"]),
    ("data.nope=1", ["unknown key data.nope", "section data has no 'nope'", "args"]),
])
def test_unknown_set_key_names_whole_key_and_section(key, needles, tiny_microscopy, tmp_path, capsys):
    code = main(["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(tmp_path / "r"),
                 "--set", key, "--device", "cpu"])
    _one_line(code, capsys.readouterr().err, *needles)


@pytest.mark.parametrize("argv", [
    ["predict", "{ckpt}", "{ckpt}", "--out", "{full}"],
    ["export", "{ckpt}", "--out", "{file}"],
    ["profile", "unet2d-microscopy", "--out", "{full}"],
    ["benchmark", "unet2d-microscopy", "--out", "{bench}"],
])
def test_outputs_are_not_overwritten_without_force(argv, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("earlier results")
    file = tmp_path / "model.onnx"
    file.write_text("earlier export")
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "unet2d-microscopy-train.json").write_text("{}")
    ckpt = tmp_path / "missing.pt"
    argv = [a.format(ckpt=ckpt, full=full, file=file, bench=bench) for a in argv]
    code = main(argv)
    named = {"predict": full, "export": file, "profile": full, "benchmark": bench / "unet2d-microscopy-train.json"}
    _one_line(code, capsys.readouterr().err, named[argv[0]], "--force")
    assert (full / "keep.txt").read_text() == "earlier results" and file.read_text() == "earlier export"


@pytest.mark.slow
def test_predict_force_writes_into_a_non_empty_folder(tiny_microscopy, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(run), *TINY]) == 0
    out = tmp_path / "pred"
    out.mkdir()
    (out / "earlier.txt").write_text("x")
    inputs = tmp_path / "inputs"  # a folder as copied from a Mac: "._" companions beside the image
    inputs.mkdir()
    (inputs / "img_0000.png").write_bytes((tiny_microscopy / "images" / "img_0000.png").read_bytes())
    (inputs / "._img_0000.png").write_bytes(b"\x00\x05\x16\x07" + bytes(60))
    capsys.readouterr()
    assert main(["predict", str(run), str(inputs), "--out", str(out)]) == 2
    assert main(["predict", str(run), str(inputs), "--out", str(out), "--force"]) == 0
    # the companion was not taken for an image (decoding it would have failed with exit 2)
    assert sorted(p.name for p in out.iterdir()) == ["earlier.txt", "img_0000_mask.png", "img_0000_overlay.png"]


@pytest.mark.parametrize("kind,options", [
    ("microscopy", ["--count", "--size"]),
    ("brats", ["--cases", "--test-cases", "--size", "--layout"]),
    ("coco", ["--train", "--val", "--max-objects"]),
])
def test_synth_kind_help_lists_the_generator_options(kind, options, capsys):
    assert main(["data", "synth", kind, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fastvision data synth {kind} OUT")
    for opt in options:
        assert opt in out
    assert main(["data", "synth", "--help"]) == 0
    assert "KIND --help" in capsys.readouterr().out


def test_evaluate_prints_counts_as_integers():
    assert _format_value("images", 60.0) == "60"
    assert _format_value("items", 7) == "7"
    assert _format_value("map", 0.25) == "0.2500"
    assert _format_value("iou", 1.0) == "1.0000"  # a ratio stays a ratio even when whole


def test_an_uncaught_error_after_torch_distributed_exits_1_without_finalizing(monkeypatch, capsys):
    """A collective whose peer died raises gloo's RuntimeError, which ``main`` does not catch. Once the
    distributed layer is loaded, ``entry`` says so in one line (the peer that left first printed the cause; a
    traceback of the broken collective buried it) and ends through ``exit_process(1)`` (no interpreter
    finalization, where a gloo thread left running aborts the process: SIGABRT, seen as -6 by torchrun); any
    other uncaught error keeps its traceback; without the layer the error propagates as Python's own."""
    import types

    from fastvision import cli

    def boom():
        raise RuntimeError("gloo: Read error: Connection reset by peer")

    monkeypatch.setattr(cli, "main", boom)
    monkeypatch.delitem(sys.modules, "fastvision.distributed.comm", raising=False)
    with pytest.raises(RuntimeError, match="Connection reset"):
        cli.entry()
    codes = []
    monkeypatch.setitem(sys.modules, "fastvision.distributed.comm", types.SimpleNamespace(exit_process=codes.append))
    with pytest.raises(SystemExit) as ended:  # the stand-in returns, so entry goes on to its sys.exit
        cli.entry()
    assert codes == [1] and ended.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "another rank left the job first (Connection reset by peer)" in err

    def bug():
        raise RuntimeError("shape mismatch in my own code")

    monkeypatch.setattr(cli, "main", bug)
    with pytest.raises(SystemExit):
        cli.entry()
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: shape mismatch in my own code" in err and codes == [1, 1]


@pytest.mark.parametrize("args, needle", [
    (["--epochs", "0"], "train.epochs must be >= 1, got 0"),
    (["--epochs", "-1"], "train.epochs must be >= 1, got -1"),
    (["--set", "train.val_every=0"], "train.val_every must be >= 1, got 0"),  # a ZeroDivisionError before
    (["--lr", "-1"], "optim.lr must be > 0, got -1.0"),  # torch's ValueError traceback before
    (["--set", "optim.momentum=1"], "optim.momentum must be in [0, 1), got 1"),
    (["--set", "sched.min_lr_factor=1.5"], "sched.min_lr_factor must be in [0, 1], got 1.5"),
    (["--set", "data.num_workers=-2"], "data.num_workers must be >= 0, got -2"),
    (["--set", "optim.lr=nan"], "optim.lr must be a finite number, got nan"),  # NaN passed every comparison
    (["--lr", "inf"], "optim.lr must be a finite number, got inf"),  # trained to a non-finite stop
])
def test_a_number_out_of_its_range_is_one_line_before_anything_is_written(args, needle, tiny_microscopy, tmp_path,
                                                                          capsys):
    """``--epochs 0`` trained nothing and exited 0, ``--epochs -1`` wrote ``epochs: -1`` into config.yaml;
    val_every 0 and a negative LR were tracebacks. Each is now the key's one line, and no run folder."""
    code = main(["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(tmp_path / "run"),
                 *TINY, *args])
    _one_line(code, capsys.readouterr().err, needle)
    assert not (tmp_path / "run").exists()


def test_a_recipe_file_with_a_number_out_of_range_names_the_file(tmp_path, capsys):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("extends: unet2d-microscopy\ntrain:\n  log_every: 0\n")
    code = main(["train", str(recipe), "--out", str(tmp_path / "run"), "--device", "cpu"])
    _one_line(code, capsys.readouterr().err, str(recipe), "train.log_every must be >= 1, got 0")
