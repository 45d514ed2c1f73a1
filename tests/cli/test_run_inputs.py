"""evaluate / predict / export / train --resume given checkpoints, run folders, inputs and outputs of the wrong
kind: one line naming the file, exit 2, and nothing written or replaced (the CLI walk of 2026-12-04)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.cli.input_checks import one_line_error, run_cli
from tests.conftest import cli_here

SEG = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
       "--set", "model.args.filters=[4,8,16]", "--set", "data.num_workers=0", "--set", "examples=0"]
CLS = ["--set", "data.args.image_size=32", "--set", "data.args.resize_size=36", "--set", "task.args.num_classes=3",
       "--set", "model.args.num_classes=3", "--set", "train.batch_size=2", "--set", "train.target=null",
       "--set", "examples=0", "--set", "train.device=cpu", "--set", "train.epochs=1",
       "--set", "train.steps_per_epoch=2", "--set", "data.num_workers=0"]


@pytest.fixture(scope="module")
def runs(tiny_microscopy, tmp_path_factory):
    """A tiny 2-D segmentation run and a tiny classification run (one epoch each), and their data."""
    root = tmp_path_factory.mktemp("runs")
    assert cli_here(["data", "synth", "imagenet", str(root / "imnet"), "--classes", "3", "--per-class", "2",
                     "--val-per-class", "1", "--size", "32"]) == 0
    assert cli_here(["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(root / "seg"),
                     *SEG]) == 0
    assert cli_here(["train", "resnet18-imagefolder", "--data", str(root / "imnet"), "--out", str(root / "cls"),
                     *CLS]) == 0
    return {"seg": root / "seg", "cls": root / "cls", "imnet": root / "imnet", "micro": tiny_microscopy}


def _bad_checkpoint(runs, kind, tmp_path):
    """A torch.save file that is no usable run checkpoint, and the words its error line holds."""
    ckpt = torch.load(runs["seg"] / "checkpoints" / "best.pt", weights_only=True)
    path = tmp_path / f"{kind}.pt"
    if kind == "bare":  # a state dict alone (what another tool saves)
        torch.save({"model": ckpt["model"]}, path)
        return path, "no saved 'config'"
    if kind == "shapes":  # the recipe's model with other widths than the weights
        ckpt["config"]["model"]["args"]["filters"] = [4, 8, 8]
        ckpt.pop("eval_model", None)
        torch.save(ckpt, path)
        return path, "weights do not fit the model (unet2d-seed001): 13 of another shape"
    ckpt["config"]["train"]["epoks"] = 3  # a key this fastvision does not know
    torch.save(ckpt, path)
    return path, "its saved config does not load: unknown key train.epoks"


@pytest.mark.parametrize("kind", ["bare", "shapes", "config"])
@pytest.mark.parametrize("command", ["evaluate", "predict", "export"])
def test_a_checkpoint_that_is_no_run_of_its_own_is_one_line_naming_it(runs, kind, command, tmp_path, capsys):
    """A bare state dict was a KeyError traceback, weights of another shape torch's list of every key, and a saved
    config that no longer loads named a key without the file."""
    path, words = _bad_checkpoint(runs, kind, tmp_path)
    argv = {"evaluate": ["evaluate", path],
            "predict": ["predict", path, runs["micro"] / "images" / "img_0000.png", "--out", tmp_path / "p"],
            "export": ["export", path, "--format", "torchscript", "--out", tmp_path / "m.pt"]}[command]
    code, _, err = run_cli(capsys, *argv)
    one_line_error(code, err, path, words)
    assert not (tmp_path / "m.pt").exists() and not any((tmp_path / "p").glob("*"))


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resuming_another_recipes_run_is_one_line_and_leaves_it_as_it_was(runs, tmp_path, capsys):
    """``train unet2d-microscopy --out CLS_RUN --resume auto`` was torch's load_state_dict traceback listing every
    key of both models."""
    before = _files(runs["cls"])
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", runs["micro"], "--out", runs["cls"],
                           "--resume", "auto", *SEG)
    one_line_error(code, err, runs["cls"] / "checkpoints" / "last.pt", "recipe 'resnet18-imagefolder'",
                   "model 'resnet18'", "this run is 'unet2d-microscopy'", "its own recipe")
    assert _files(runs["cls"]) == before


@pytest.mark.parametrize("kind", ["weights", "folder", "checkpoints"])
def test_resume_from_weights_alone_or_a_run_folder_is_one_line(runs, kind, tmp_path, capsys):
    """A checkpoint without optimizer state was a KeyError traceback; a run folder was "checkpoint not found";
    its checkpoints/ folder was told to continue with --out RUN/checkpoints (RUN/checkpoints/checkpoints/last.pt)."""
    if kind == "weights":
        resume, words = tmp_path / "weights.pt", ["not a training checkpoint to resume", "no optimizer"]
        saved = torch.load(runs["seg"] / "checkpoints" / "best.pt", weights_only=True)
        torch.save({"model": saved["model"], "config": saved["config"]}, resume)
    else:
        resume = runs["seg"] / ("checkpoints" if kind == "checkpoints" else "")
        words = [f"--out {runs['seg']} --resume auto", f"--resume {runs['seg'] / 'checkpoints' / 'last.pt'}"]
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", runs["micro"], "--out", tmp_path / "r",
                           "--resume", resume, *SEG)
    one_line_error(code, err, resume, *words)
    assert not (tmp_path / "r").exists()


def test_a_2d_run_given_volumes_or_a_folder_of_folders_is_one_line(runs, tmp_path, capsys):
    """A classifier given NIfTI volumes was told its 1 channel was not 3, and a 2-D segmentation run given an
    ImageFolder's val folder (class folders) that there were no BraTS cases in it. A classifier takes that
    folder, sub-folders included (one predictions.csv row per image, as timm's folder reader)."""
    import nibabel as nib
    import numpy as np

    volume = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 4), np.float32), np.eye(4)), str(volume))
    for run, inputs, named in [("cls", [volume], volume),
                               ("seg", [runs["imnet"] / "val"], runs["imnet"] / "val" / "class000")]:
        code, _, err = run_cli(capsys, "predict", runs[run], *inputs, "--out", tmp_path / "p", "--device", "cpu")
        one_line_error(code, err, named, "is a 2-D run", "predicts image files")
        assert not (tmp_path / "p").exists()
    code, _, err = run_cli(capsys, "predict", runs["cls"], runs["imnet"] / "val", "--out", tmp_path / "p",
                           "--device", "cpu")
    assert code == 0, err
    rows = (tmp_path / "p" / "predictions.csv").read_text().splitlines()[1:]
    assert sorted(r.split(",")[0] for r in rows) == sorted(str(p) for p in (runs["imnet"] / "val").rglob("*.JPEG"))


@pytest.mark.parametrize("run", ["seg", "cls"])
def test_predict_refuses_two_inputs_that_would_write_the_same_file(runs, run, tmp_path, capsys):
    """``predict RUN a/ b/`` with an img_0000.png in each wrote the second's mask over the first's. A classifier
    lists both in predictions.csv by their paths: nothing collides there."""
    for sub, src in (("a", "img_0000.png"), ("b", "img_0001.png")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "img_0000.png").write_bytes((runs["micro"] / "images" / src).read_bytes())
    code, out, err = run_cli(capsys, "predict", runs[run], tmp_path / "a", tmp_path / "b", "--out", tmp_path / "p",
                             "--device", "cpu")
    if run == "seg":
        one_line_error(code, err, tmp_path / "a" / "img_0000.png", tmp_path / "b" / "img_0000.png",
                       "img_0000_mask")
        assert not any((tmp_path / "p").glob("*"))
    else:
        assert code == 0, err
        rows = (tmp_path / "p" / "predictions.csv").read_text().splitlines()
        assert [r.split(",")[0] for r in rows[1:]] == [str(tmp_path / s / "img_0000.png") for s in "ab"]


def test_outputs_under_a_file_or_a_file_as_the_out_folder_are_refused_before_any_work(runs, tmp_path, capsys):
    """``predict --out FILE --force`` was a FileExistsError traceback; ``evaluate --json FILE/m.json`` evaluated
    first and then failed; ``--json NEW_FOLDER/m.json`` evaluated and then was a FileNotFoundError traceback."""
    image = runs["micro"] / "images" / "img_0000.png"
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    code, _, err = run_cli(capsys, "predict", runs["seg"], image, "--out", a_file, "--force")
    one_line_error(code, err, a_file, "must be a folder")
    code, _, err = run_cli(capsys, "predict", runs["seg"], image, "--out", a_file / "p")
    one_line_error(code, err, a_file, "is a file, not a folder")
    code, out, err = run_cli(capsys, "evaluate", runs["seg"], "--json", a_file / "m.json")
    one_line_error(code, err, a_file / "m.json", "is a file, not a folder")
    assert out == "" and a_file.read_text() == "mine"
    code, out, err = run_cli(capsys, "evaluate", runs["seg"], "--json", tmp_path / "new" / "m.json")
    assert code == 0, err
    assert json.loads((tmp_path / "new" / "m.json").read_text())["items"] > 0


def test_predicted_masks_are_whole_files_in_the_inputs_format(runs, tmp_path, capsys):
    """Masks and overlays are written atomically (a temp file renamed): a PNG and a TIFF input each give a
    readable mask of its size and no temp file is left."""
    import numpy as np
    import tifffile
    from PIL import Image

    png = runs["micro"] / "images" / "img_0000.png"
    tif = tmp_path / "in" / "other.tif"
    tif.parent.mkdir()
    tifffile.imwrite(tif, np.asarray(Image.open(png)))
    code, _, err = run_cli(capsys, "predict", runs["seg"], png, tif, "--out", tmp_path / "p", "--device", "cpu")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "img_0000_mask.png", "img_0000_overlay.png", "other_mask.tif", "other_overlay.png"]
    assert np.asarray(Image.open(tmp_path / "p" / "img_0000_mask.png")).shape == (32, 32)
    assert tifffile.imread(tmp_path / "p" / "other_mask.tif").shape == (32, 32)


def test_a_bad_image_part_way_says_what_is_written_and_how_to_go_on(runs, tmp_path, capsys):
    """A 2-D predict that meets an unreadable file after writing the masks of the inputs before it names the
    file, what is in --out and the way on (--out is no longer empty, so a plain rerun is refused)."""
    import shutil

    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(runs["micro"] / "images" / "img_0000.png", inputs / "a.png")
    (inputs / "b.png").write_text("not an image")
    code, _, err = run_cli(capsys, "predict", runs["seg"] / "checkpoints" / "best.pt", inputs, "--out", tmp_path / "o",
                           "--device", "cpu")
    one_line_error(code, err, str(inputs / "b.png"), "cannot read image", f"are in {tmp_path / 'o'}", "--force")
    assert (tmp_path / "o" / "a_mask.png").is_file()


@pytest.mark.parametrize("given", [False, True])
def test_resume_without_data_continues_on_the_runs_data(runs, given, tmp_path, capsys):
    """``train unet2d-microscopy --out RUN --resume auto`` without ``--data`` trained on the recipe's default
    data (the built-in sample), not the run's; ``--data`` still names other data."""
    import shutil

    import yaml

    run = tmp_path / "seg"
    shutil.copytree(runs["seg"], run)
    other = tmp_path / "other"
    shutil.copytree(runs["micro"], other)
    args = ["--epochs", "2", *SEG[2:]] + (["--data", other] if given else [])
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--out", run, "--resume", "auto", *args)
    assert code == 0, err
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]["args"]["path"]
    assert saved == str(other if given else runs["micro"])
    assert json.loads((run / "summary.json").read_text())["epochs"] == 2  # the second epoch trained


def test_resume_path_into_a_new_out_without_data_reads_the_checkpoints_data(runs, tmp_path, capsys):
    """``--resume RUN/checkpoints/last.pt --out NEW`` without ``--data``: the data of the checkpoint's run."""
    import yaml

    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--out", tmp_path / "new",
                           "--resume", runs["seg"] / "checkpoints" / "last.pt", "--epochs", "2", *SEG[2:])
    assert code == 0, err
    assert yaml.safe_load((tmp_path / "new" / "config.yaml").read_text())["data"]["args"]["path"] == str(runs["micro"])


def test_a_misspelt_resume_auto_names_the_word(runs, tmp_path, monkeypatch, capsys):
    """``--resume aut`` said 'checkpoint not found: aut' and no more."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", runs["micro"], "--resume", "aut", *SEG)
    one_line_error(code, err, "checkpoint not found: aut", "--resume auto")
    assert not (tmp_path / "runs").exists()
