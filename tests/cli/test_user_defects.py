"""Issue 19's user-facing defects, through the real CLI: each is one line naming what to do, exit 2,
or the sensible behaviour (never a traceback)."""
from __future__ import annotations

import pytest
import torch

from fastvision.cli import main
from tests.cli.input_checks import one_line_error, run_cli

TINY = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]"]


def test_fp16_run_evaluates_and_predicts_on_cpu(tiny_microscopy, tmp_path, capsys):
    """A run trained with train.amp=fp16 (unet3d-spleen-fast's setting) on a GPU: evaluate and predict
    on a CPU run in fp32 instead of stopping with "fp16 needs a CUDA device; use --amp bf16", a flag
    these commands do not have."""
    run = tmp_path / "run"
    assert run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", run, *TINY)[0] == 0
    ckpt = run / "checkpoints" / "last.pt"
    state = torch.load(ckpt, weights_only=True)
    state["config"]["train"]["amp"] = "fp16"  # as if trained on a GPU with fp16
    for name in ("best.pt", "last.pt"):
        torch.save(state, run / "checkpoints" / name)
    code, out, err = run_cli(capsys, "evaluate", run, "--device", "cpu")
    assert code == 0 and "iou:" in out, err
    code, _, err = run_cli(capsys, "predict", ckpt, tiny_microscopy / "images" / "img_0000.png",
                           "--out", tmp_path / "p", "--device", "cpu")
    assert code == 0 and (tmp_path / "p" / "img_0000_mask.png").is_file(), err


RECIPES_3D = ["unet3d-spleen-fast", "unet3d-spleen-baseline", "unet3d-brats", "segresnet-brats"]


@pytest.mark.parametrize("command", [["train"], ["profile"], ["benchmark", "--mode", "data"]])
@pytest.mark.parametrize("recipe", RECIPES_3D)
def test_3d_recipe_without_data_names_the_flag(recipe, command, tmp_path, capsys):
    """The 3-D recipes set no data folder: without --data they ended in a TypeError traceback
    (build_decathlon() missing 'path'), exit 1."""
    code, _, err = run_cli(capsys, command[0], recipe, *command[1:], "--out", tmp_path / "out")
    one_line_error(code, err, "decathlon dataset folder", "data.args.path", "--data DIR")


@pytest.mark.parametrize("recipe,argv,needles", [
    ("resnet50-imagenet", [], ["dataset folder not found", "data/imagenet"]),
    ("ssd320-coco", [], ["COCO dataset folder not found", "data/coco"]),
    ("resnet18-pathology", [], ["dataset folder not found", "data/synth-pathology",
                                "or make the recipe's sample: fastvision data synth pathology data/synth-pathology)"]),
    ("resnet18-imagefolder", [], ["or make the recipe's sample: fastvision data synth imagenet data/synth-imagenet)"]),
    ("unet2d-microscopy", ["--data", "NOPE"], ["dataset folder not found", "NOPE"]),
    ("unet3d-spleen-fast", ["--data", "NOPE"], ["Decathlon dataset folder not found", "NOPE"]),
    ("unet3d-brats", ["--data", "NOPE", "--set", "data.name=brats"], ["BraTS folder not found", "NOPE"]),
])
def test_missing_dataset_folder_names_it_and_the_flag(recipe, argv, needles, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the recipes' default folders (data/...) are relative
    argv = [str(tmp_path / a) if a == "NOPE" else a for a in argv]
    code, _, err = run_cli(capsys, "train", recipe, *argv, "--out", tmp_path / "out")
    one_line_error(code, err, *needles, "(pass --data DIR")


def test_a_file_given_as_the_dataset_folder_says_so(tmp_path, capsys):
    """--data pointing at the COCO annotation file (not its folder) said 'folder not found' of a file
    that exists; now it says it is a file and names the dataset folder (the one above annotations/: it
    named annotations/ itself)."""
    ann = tmp_path / "coco" / "annotations" / "instances_train2017.json"
    ann.parent.mkdir(parents=True)
    ann.write_text("{}")
    code, _, err = run_cli(capsys, "train", "ssd320-small-shapes", "--data", ann, "--out", tmp_path / "out")
    one_line_error(code, err, f"{ann} is a file; --data takes the COCO dataset folder ({ann.parent.parent}, which")
    assert not (tmp_path / "out").exists()


def test_a_builder_missing_a_required_argument_is_a_config_error():
    """Any builder called without a required keyword is one line naming it, not a TypeError."""
    from fastvision.errors import ConfigError
    from fastvision.registry import Registry

    reg = Registry("model")
    reg.register("needs-width")(lambda *, width: width)
    with pytest.raises(ConfigError, match=r"model.args: model 'needs-width' needs width"):
        reg.build("needs-width", {})


def test_inspect_lists_every_unusable_file_then_exits_2(tiny_microscopy, tmp_path, capsys):
    """``data inspect`` stopped at the first file it could not use; it now reports each problem
    (corrupt file, missing mask, size mismatch, time-lapse stack) and exits 2 after the report."""
    import shutil

    import numpy as np
    import tifffile
    from PIL import Image

    from fastvision.data.inspect import inspect_path

    root = shutil.copytree(tiny_microscopy, tmp_path / "d")
    (root / "images" / "img_0001.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    (root / "masks" / "img_0002.png").unlink()
    Image.fromarray(np.zeros((20, 32), np.uint8)).save(root / "masks" / "img_0003.png")
    tifffile.imwrite(root / "images" / "movie.tif", np.zeros((5, 32, 32), np.uint8), imagej=True,
                     metadata={"axes": "TYX"})  # a 5-frame time-lapse
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(root / "masks" / "movie.png")
    code, out, err = run_cli(capsys, "data", "inspect", root)
    line = one_line_error(code, err, "4 file(s) would stop training")
    assert "pairs" in out  # the report came first
    an = inspect_path(root)["anomalies"]
    assert an["images without a mask of the same stem"] == "1 (img_0002.png)"
    assert an["image and mask of different sizes"].startswith("1 (img_0003.png (32, 32) vs img_0003.png (20, 32)")
    bad = an["unreadable files, or Z / T stacks (items are 2-D)"]
    assert bad.startswith("2 (") and "img_0001.png: cannot read image" in bad
    assert "movie.tif: a T stack of 5 planes" in bad, line  # frames, not "5 channels"
    assert inspect_path(root)["pairs"] == 16 - 3


@pytest.mark.parametrize("axes,kw", [("TYX", {"imagej": True}), ("TYX", {"ome": True}), ("TYX", {}),
                                     ("ZYX", {"imagej": True})])
def test_time_lapse_tiff_is_frames_not_channels(axes, kw, tmp_path):
    """tifffile's series axes tell frames (T) and planes (Z) from channels (C, S): a 5-frame
    time-lapse is refused as a stack, naming the file, never read as a 5-channel image."""
    import numpy as np
    import tifffile

    from fastvision.data.formats.microscopy import read_array
    from fastvision.errors import DataError

    f = tmp_path / "movie.tif"
    tifffile.imwrite(f, np.zeros((5, 16, 16), np.uint8), metadata={"axes": axes}, **kw)
    with pytest.raises(DataError, match=rf"movie.tif: a {axes[0]} stack of 5 planes"):
        read_array(f)
    tifffile.imwrite(tmp_path / "rgb.tif", np.zeros((3, 16, 16), np.uint8), imagej=True, metadata={"axes": "CYX"})
    assert read_array(tmp_path / "rgb.tif").shape == (16, 16, 3)


def test_a_first_step_failure_is_blamed_on_the_augmentation_or_the_loss_where_it_was_raised():
    """The first step's one line names ``data.augment`` (or the loss) where the error came from there, not the
    model (a thin stack's blur once failed there and the line said "Check model 'unet3d'"): the real
    augmentation, the real loss and the real model each raising on a batch they cannot take."""
    from fastvision.data.augment.spatial import build_augment
    from fastvision.engine.step import _failed_in
    from fastvision.losses.dice import DiceLoss
    from fastvision.registry import MODELS

    def raised(fn):
        try:
            fn()
        except (RuntimeError, ValueError, IndexError) as e:
            return _failed_in(e)
        raise AssertionError("no error")

    aug = build_augment(3, affine={"prob": 1.0})
    where = raised(lambda: aug(torch.rand(2, 1, 8, 8), None, torch.Generator().manual_seed(0)))
    assert where is not None and where[1] == "data.augment" and where[0].startswith("fastvision.data.augment.")
    where = raised(lambda: DiceLoss(softmax=True)(torch.rand(2, 3, 8, 8), torch.zeros(2, 1, 4, 4)))
    assert where is not None and where[1].startswith("loss")
    model = MODELS.build("unet2d", {"in_channels": 1, "out_channels": 2, "filters": [4, 8]})
    assert raised(lambda: model(torch.rand(1, 3, 16, 16))) is None  # the model's own: the old line


# --------------------------------------------------- settings the model cannot take (README audit)
@pytest.mark.parametrize("setting, needles", [
    # the network's strides do not divide the size: engine.build.check_patch, before the run folder
    ("data.args.image_size=[30,30]", ["data.args.image_size=[30, 30]", "multiple of the model's divisor"]),
    # a 3-channel model on 1-channel images: torch's conv RuntimeError, at the first step
    ("model.args.in_channels=3", ["first training step failed", "channels", "model.args", "data.args"]),
    # a builder refusing a value: named by its config path
    ("model.args.filters=[8]", ["model.args", "filters"]),
])
def test_a_setting_the_model_cannot_take_is_one_line_and_the_folder_can_be_reused(
        setting, needles, tiny_microscopy, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", run, *TINY]
    code, _, err = run_cli(capsys, *argv, "--set", setting)
    one_line_error(code, err, *needles)
    # one in the build makes no folder; one in the first step (before any checkpoint) removes the one it made
    assert not run.exists()
    # the same command, mended, in the same --out
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert (run / "checkpoints" / "last.pt").is_file() and "starting from scratch" not in err
    assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text().count('"parameters"') <= 1


def test_an_attempt_killed_before_its_first_checkpoint_restarts_in_place(tmp_path):
    """A worker killed at its first step: the watchdog of the rank left waiting dumps stacks into run/hang before
    torchrun restarts the job, whose --resume auto then starts afresh (it found the dumps beside no checkpoint and
    refused, once, in CI on a loaded 2-core machine); a folder with anything else in it is still refused."""
    from fastvision.api import prepare_run_dir
    from fastvision.errors import DataError

    run = tmp_path / "run"
    (run / "hang").mkdir(parents=True)
    (run / "hang" / "rank0.txt").write_text("stacks")
    (run / "config.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    assert prepare_run_dir("r", str(run), "auto") == (run, None)
    assert (run / "metrics.previous.jsonl").is_file() and (run / "hang" / "rank0.txt").is_file()  # kept
    (run / "notes.txt").write_text("a user's file")
    with pytest.raises(DataError, match="no checkpoints/last.pt"):
        prepare_run_dir("r", str(run), "auto")


def test_a_run_folder_with_a_checkpoint_is_still_refused(tiny_microscopy, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", run, *TINY]
    assert run_cli(capsys, *argv)[0] == 0
    one_line_error(*run_cli(capsys, *argv)[::2], "already exists", "--resume auto")


@pytest.mark.parametrize("device", ["tpu", "mps"])
def test_an_unsupported_device_is_one_line(device, tiny_microscopy, tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", tmp_path / "r",
                           *TINY[:-4], "--device", device)
    one_line_error(code, err, "--device", device)
    assert not (tmp_path / "r").exists()


def test_a_target_the_run_does_not_report_is_refused_before_training(tiny_microscopy, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", run, *TINY,
                           "--target", "dice2=0.5")
    line = one_line_error(code, err, "--target dice2", "not a metric", "dice", "iou")
    assert "epoch" not in err.replace(line, "")  # no epoch ran: the check is before training
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("target", ["dice=90", "iou=-0.1"])
def test_a_percent_dice_target_is_refused_before_training(tiny_microscopy, tmp_path, capsys, target):
    """--target dice=90 (a percent, as nnU-Net's summaries and many papers print Dice) trained to the end without
    stopping: Dice and IoU are fractions, as top-1 was already checked."""
    run = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", run, *TINY,
                           "--target", target)
    name = target.split("=")[0]
    one_line_error(code, err, f"--target {target}: {name} is a fraction from 0 to 1")
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("argv, needle", [(["train", "unet2d-microscopy", "--amp", "fp8"], "--amp"),
                                          (["benchmark", "unet2d-microscopy", "--mode", "trian"], "--mode"),
                                          (["trian"], "COMMAND")])
def test_a_misspelled_choice_is_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert needle in err and "invalid choice" in err and "--help" in err


@pytest.mark.parametrize("command", ["train", "predict", "profile"])
def test_nproc_below_one_or_above_this_machines_cores_is_one_line_before_any_work(command, tmp_path, capsys):
    """``--nproc 0`` or ``-1`` trained one process silently, and more workers than the CPU has cores started
    them all (99 torch processes on 2 cores); each is now one line naming --nproc, exit 2, nothing written."""
    import os

    cores = len(os.sched_getaffinity(0))
    args = {"train": ["train", "unet2d-microscopy", "--out", tmp_path / "run"],
            "predict": ["predict", tmp_path / "no-run", tmp_path / "no-images", "--out", tmp_path / "run"],
            "profile": ["profile", "unet2d-microscopy", "--out", tmp_path / "run"]}[command]
    for n in ("0", "-1", str(cores + 1)):
        code, _, err = run_cli(capsys, *args, "--nproc", n, "--device", "cpu")
        one_line_error(code, err, f"--nproc {n}", "CPU cores" if n == str(cores + 1) else ">= 1")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="--nproc 2 needs 2 cores")
@pytest.mark.parametrize("bad", [["--set", "train.epochz=3"], ["--set", "optim.lr=fast"], ["--data", "no-such-folder"],
                                 ["--emulate-workers", "2"]])  # each worker said it, after the group was made
def test_nproc_checks_the_recipe_and_data_once_before_starting_workers(bad, tmp_path, capsys):
    """``train --nproc 2`` with a --set typo, a wrong type or a --data folder that is not there: one line
    from the launcher, exit 2, no worker started (each of the two workers printed the same line)."""
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--nproc", "2", "--out", tmp_path / "run", *bad)
    one_line_error(code, err, bad[1].split("=")[0] if bad[0] != "--emulate-workers" else "--emulate-workers")
    assert "launching" not in err and not (tmp_path / "run").exists()
