"""The command line: every kind of bad input is one line naming the file or key, exit code 2."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from PIL import Image

from fastvision.cli import main
from tests.cli.input_checks import one_line_error, run_cli
from tests.conftest import tiny_overrides

TINY = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]"]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def data(tiny_microscopy, tmp_path):
    return _copy(tiny_microscopy, tmp_path / "data")




@pytest.mark.parametrize("case", ["missing_dir", "no_mask", "shape_mismatch", "corrupt", "empty", "bad_mask_values"])
def test_bad_data_exits_2_naming_the_file(case, data, tmp_path, capsys):
    if case == "missing_dir":
        target, named = tmp_path / "nope", tmp_path / "nope"
    elif case == "no_mask":
        (data / "masks" / "img_0003.png").unlink()
        target, named = data, data / "images" / "img_0003.png"
    elif case == "shape_mismatch":
        Image.fromarray(np.zeros((20, 32), np.uint8)).save(data / "masks" / "img_0004.png")
        target, named = data, "img_0004.png"
    elif case == "corrupt":
        (data / "images" / "img_0005.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
        target, named = data, data / "images" / "img_0005.png"
    elif case == "empty":
        for f in (data / "images").iterdir():
            f.unlink()
        target, named = data, data / "images"
    else:
        Image.fromarray(np.full((32, 32), 7, np.uint8)).save(data / "masks" / "img_0006.png")
        target, named = data, data / "masks" / "img_0006.png"
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", str(target), "--out",
                           str(tmp_path / "run"), *TINY)
    one_line_error(code, err, named)


@pytest.mark.parametrize("argv,needle", [
    (["train", "no-such-recipe"], "unknown recipe 'no-such-recipe' (valid: resnet18-imagefolder"),
    (["recipes", "unet2d-microscop"], "unknown recipe 'unet2d-microscop'; did you mean unet2d-microscopy?"),
    (["recipes", "spleen-fast"], "did you mean unet3d-spleen-fast?"),
    (["recipes", "resnet50"], "did you mean resnet50-imagenet or resnet50-imagenet-250ep?"),
    (["train", "unet2d-microscopy", "--set", "train.epoks=3"],
     "unknown key train.epoks: section train has no 'epoks' (did you mean train.epochs?); valid keys there:"),
    (["train", "unet2d-microscopy", "--set", "train.xyz=3"], "section train has no 'xyz'; valid keys there:"),
    (["train", "unet2d-microscopy", "--set", "model.args.filter=[1]"],
     "unknown key model.args.filter (did you mean model.args.filters?); valid keys:"),
    (["train", "unet2d-microscopy", "--set", "train.epochs=three"], "train.epochs: expected int"),
    (["train", "unet2d-microscopy", "--set", "model.args.widths=[1]"], "unknown key model.args.widths"),
    (["train", "unet2d-microscopy", "--set", "loss.name=dicee"], "unknown loss 'dicee'"),
    (["train", "unet2d-microscopy", "--set", "optim.name=lion"], "optim.name: expected"),
    (["train", "unet2d-microscopy", "--target", "iou"], "--target 'iou'"),
    (["train", "unet2d-microscopy", "--amp", "fp16", "--device", "cpu"], "fp16 needs a CUDA device"),
    (["evaluate", "/no/such/run.pt"], "/no/such/run.pt"),
    (["data", "synth", "imaginary", "/tmp/x"], "unknown synthetic data kind 'imaginary'"),
    (["data", "inspect", "/no/such/folder"], "/no/such/folder"),
])
def test_bad_arguments_exit_2(argv, needle, tiny_microscopy, tmp_path, capsys):
    if argv[0] == "train":
        argv = [*argv, "--data", str(tiny_microscopy), "--out", str(tmp_path / "r"), *TINY]
    code, _, err = run_cli(capsys, *argv)
    one_line_error(code, err, needle)


def test_corrupt_checkpoint_exits_2(tmp_path, capsys):
    bad = tmp_path / "last.pt"
    bad.write_bytes(b"truncated")
    code, _, err = run_cli(capsys, "evaluate", str(bad))
    one_line_error(code, err, bad)


def test_debug_shows_the_traceback(capsys):
    from fastvision.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["--debug", "train", "no-such-recipe"])


def test_train_evaluate_predict_roundtrip(tiny_microscopy, tmp_path, capsys):
    run = tmp_path / "run"
    code, out, _ = run_cli(capsys, "train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(run),
                           *TINY)
    assert code == 0 and f"run directory: {run}" in out and "final iou" in out
    code, out, _ = run_cli(capsys, "evaluate", str(run))
    assert code == 0 and "iou:" in out
    code, out, _ = run_cli(capsys, "predict", str(run / "checkpoints" / "best.pt"),
                           str(tiny_microscopy / "images" / "img_0000.png"), "--out", str(tmp_path / "p"))
    assert code == 0 and (tmp_path / "p" / "img_0000_mask.png").is_file()
    # a second train into the same directory must not overwrite it
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(run),
                           *TINY)
    one_line_error(code, err, run, "--resume auto")


def test_recipes_list_and_show(capsys):
    import yaml

    from fastvision.config import list_recipes, recipe_path

    code, out, _ = run_cli(capsys, "recipes")
    assert code == 0 and "unet2d-microscopy" in out.split()
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line and not line.startswith(" ")
            and not line.startswith("`")}
    assert out.splitlines()[0].split() == ["NAME", "TASK", "MODEL", "SEED", "PURPOSE"]
    assert sorted(rows) == list_recipes()
    def named(name, section):  # the section's name in the YAML or the recipe it extends
        raw = yaml.safe_load(recipe_path(name).read_text())
        return (raw.get(section) or {}).get("name") or named(raw["extends"], section)

    for name, cells in rows.items():  # task and model as the YAML names them; a seed and a purpose
        assert cells[1:3] == [named(name, "task"), named(name, "model")], name
        assert cells[3].isdigit() and len(cells) > 4, name
    assert rows["unet3d-spleen-fast"][3] == "003" and rows["unet2d-seed001"][3] == "001"
    data = [line.split("data ", 1)[1] for line in out.splitlines() if line.lstrip().startswith("data ")]
    assert len(data) == len(rows) and all("synth" in d or "docs/" in d for d in data)
    code, out, _ = run_cli(capsys, "recipes", "--names")
    assert out.split() == list_recipes()
    code, out, _ = run_cli(capsys, "recipes", "unet2d-microscopy")
    assert code == 0 and "unet2d-seed001" in out


def test_data_synth_and_inspect(tmp_path, capsys):
    out = tmp_path / "m"
    code, _, _ = run_cli(capsys, "data", "synth", "microscopy", str(out), "--count", "3", "--size", "24")
    assert code == 0 and len(list((out / "images").glob("*.png"))) == 3
    code, text, _ = run_cli(capsys, "data", "inspect", str(out))
    assert code == 0 and "pairs" in text and "(24, 24)" in text and "uint8" in text
    code, _, err = run_cli(capsys, "data", "synth", "microscopy", str(tmp_path / "n"), "--colour", "red")
    one_line_error(code, err, "colour")


def test_python_api_train_returns_summary(tiny_microscopy, tmp_path):
    import fastvision

    summary = fastvision.train("unet2d-microscopy", out=str(tmp_path / "api"), **tiny_overrides(tiny_microscopy))
    assert summary["epochs"] == 2 and (tmp_path / "api" / "config.yaml").is_file()
    assert "unet2d-seed001" in fastvision.list_models()
    assert "probe" not in fastvision.list_models()  # the NaN-making test model builds by name, unlisted
    assert sum(p.numel() for p in fastvision.create_model("probe", in_channels=1, out_channels=2).parameters()) == 6
    assert sum(p.numel() for p in fastvision.create_model("unet2d-seed001").parameters()) == 487_145


def test_unknown_target_metric_is_an_error(tiny_microscopy, tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out",
                           str(tmp_path / "r"), "--target", "accuracy=0.9", *TINY)
    one_line_error(code, err, "--target accuracy", "iou")


def test_synth_refuses_a_non_empty_folder(tmp_path, capsys):
    out = tmp_path / "full"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for kind in ("microscopy", "imagenet", "coco"):
        code, _, err = run_cli(capsys, "data", "synth", kind, str(out))
        one_line_error(code, err, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("kind,options,needles", [
    ("imagenet", ["--classes", "3", "--per-class", "4", "--val-per-class", "2", "--size", "32"],
     ["imagefolder dataset", "train images", "12", "class002: 4"]),
    ("coco", ["--train", "6", "--val", "3"], ["coco dataset", "train2017 images", "val2017 boxes"]),
    ("spleen", ["--cases", "3", "--test-cases", "1", "--size", "24"],
     ["decathlon dataset", "Spleen", "training cases"]),
])
def test_inspect_other_layouts(kind, options, needles, tmp_path, capsys):
    out = tmp_path / kind
    assert run_cli(capsys, "data", "synth", kind, str(out), *options)[0] == 0
    code, text, _ = run_cli(capsys, "data", "inspect", str(out))
    assert code == 0
    for n in needles:
        assert n in text, (n, text)


def test_every_subcommand_is_named_in_cli_py():
    """cli.py names every subcommand: the built-ins in build_parser, the rest in its FEATURES table."""
    import ast
    import inspect

    from fastvision import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    tree = ast.parse(inspect.getsource(cli.build_parser))
    builtins = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", None) == "add_parser" and isinstance(n.args[0], ast.Constant)}
    features = {name for name, _ in cli.FEATURES}
    assert set(sub.choices) == (builtins - {"synth", "inspect", "shard"}) | features  # data ACTIONs
    assert {"train", "evaluate", "predict", "benchmark", "profile", "monitor", "export"} <= set(sub.choices)


def test_inspect_json_without_fingerprint_is_refused_and_synth_help_lists_seed(tiny_microscopy, tmp_path, capsys):
    """`data inspect --json` writes the fingerprint: without --fingerprint it wrote nothing and exited 0."""
    code, _, err = run_cli(capsys, "data", "inspect", str(tiny_microscopy), "--json", str(tmp_path / "x.json"))
    one_line_error(code, err, "--json", "--fingerprint")
    assert not (tmp_path / "x.json").exists()
    from fastvision.cli_data import synth_help

    assert "--seed" in synth_help("microscopy").split("options of microscopy")[1]
