"""Seed 001's microscopy walk: what a user of DLE's UNet_Medical meets with real folders, through the CLI."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tests.cli.input_checks import one_line_error, run_cli

TINY = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]", "--set", "data.num_workers=0"]


def _colour_masks(src, dst):
    """``src``'s pairs with every mask saved as RGB whose channels differ (training refuses it when it reads it)."""
    shutil.copytree(src, dst)
    for m in (dst / "masks").iterdir():
        a = np.asarray(Image.open(m))
        Image.fromarray(np.stack([a, 255 - a, a], -1).astype(np.uint8)).save(m)
    return dst


@pytest.mark.parametrize("out", ["default", "empty", "new"])
def test_a_mask_refused_when_read_leaves_no_run_folder(out, tiny_microscopy, tmp_path, monkeypatch, capsys):
    """A mask training refuses only when it reads it (a colour mask, a page stack read as channels) stopped
    the run after its folder was made: every attempt left runs/<recipe>-<time>/ with config.yaml,
    metrics.jsonl and an empty checkpoints/. The folder goes (an empty --out the user made is kept, empty)."""
    data = _colour_masks(tiny_microscopy, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    where = {"default": [], "empty": ["--out", tmp_path / "mine"], "new": ["--out", tmp_path / "new"]}[out]
    if out == "empty":
        (tmp_path / "mine").mkdir()
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", data, *where, *TINY)
    one_line_error(code, err, "colour mask", str(data / "masks"))
    assert not any((tmp_path / "runs").glob("*")), list((tmp_path / "runs").iterdir())
    assert not (tmp_path / "new").exists()
    if out == "empty":
        assert list((tmp_path / "mine").iterdir()) == []


def test_a_run_that_stops_after_its_first_checkpoint_keeps_its_folder(tiny_microscopy, tmp_path, capsys):
    """The clean-up is for runs that wrote nothing to keep: a finished run's folder stays."""
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", tmp_path / "r",
                           *TINY)
    assert code == 0 and (tmp_path / "r" / "checkpoints" / "last.pt").is_file(), err


def test_a_first_step_whose_peer_left_is_not_blamed_on_the_model(monkeypatch):
    """--nproc 2 with a bad mask on rank 1: rank 0's first step broke in gloo ('Connection closed by peer')
    and its line read 'the first training step failed: ... Check model unet2d-seed001 (model.args)'. The
    broken collective goes up as it is, so the CLI says another rank left first."""
    from fastvision.engine import loop
    from fastvision.errors import ConfigError

    def broken(*_):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    monkeypatch.setattr(loop, "train_step", broken)
    run = SimpleNamespace(step=None, cfg=SimpleNamespace(model=SimpleNamespace(name="m")))
    with pytest.raises(RuntimeError, match="closed by peer") as info:
        loop.first_step(run, iter(()), None)
    assert not isinstance(info.value, ConfigError)

    def shape(*_):
        raise RuntimeError("Given groups=1, weight of size [8, 1, 3, 3], expected input to have 1 channels")

    monkeypatch.setattr(loop, "train_step", shape)
    with pytest.raises(ConfigError, match="Check model 'm'"):
        loop.first_step(run, iter(()), None)


@pytest.mark.parametrize("imagej", [False, True])
def test_a_multi_page_mask_says_pages_not_colour(imagej, tiny_microscopy, tmp_path, capsys):
    """ISBI 2012 ships its labels as one multi-page TIFF (train-labels.tif). As a mask it stopped the run
    with 'colour mask; expected a single-channel mask', which its pages are not; an RGB-saved TIFF mask
    whose channels agree still reads as one plane."""
    import tifffile

    data = tmp_path / "data"
    shutil.copytree(tiny_microscopy, data)
    masks = sorted((data / "masks").iterdir())
    planes = np.stack([np.asarray(Image.open(m)) for m in masks[:5]])  # (4 or 3 pages: tifffile writes RGB(A))
    masks[0].unlink()
    tifffile.imwrite(data / "masks" / (masks[0].stem + ".tif"), planes, imagej=imagej)
    rgb = np.asarray(Image.open(masks[1]))
    masks[1].unlink()
    tifffile.imwrite(data / "masks" / (masks[1].stem + ".tif"), np.stack([rgb] * 3, -1), photometric="rgb")
    code, _, err = run_cli(capsys, "data", "inspect", data)
    assert code == 2 and "colour mask" not in err
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", data, "--out", tmp_path / "r", *TINY)
    line = one_line_error(code, err, masks[0].stem + ".tif", "a mask of 5 pages or channels", "one page per file")
    assert masks[1].stem not in line


def test_scale_simulate_from_a_cpu_sweep_says_the_step_is_not_a_gpus(tiny_microscopy, tmp_path, capsys):
    """``scale unet2d-microscopy --simulate`` on a laptop: the 1-worker run's CPU step (hundreds of ms) was
    drawn as a DGX A100's, 100% efficiency to 1024 GPUs, without a word. simulation.md and stderr say whose
    step it is; a step given as numbers (--compute-ms, --grad-mb) has no such line."""
    code, _, err = run_cli(capsys, "scale", "unet2d-microscopy", "--workers", "1", "--epochs", "2", "--simulate",
                           "--hardware", "dgx-a100", "--gpus", "8", "--data", tiny_microscopy, "--out", tmp_path / "s",
                           "--device", "cpu", *TINY[6:])
    assert code == 0, err
    md = (tmp_path / "s" / "simulation.md").read_text()
    assert "1-worker run's on cpu, not a GPU's" in md and "--compute-ms" in md
    assert "1-worker run's on cpu" in err
    code, _, err = run_cli(capsys, "scale", "--simulate", "--compute-ms", "100", "--batch", "16", "--grad-mb", "2",
                           "--hardware", "dgx-a100", "--gpus", "8", "--out", tmp_path / "n")
    assert code == 0 and "not a GPU's" not in (tmp_path / "n" / "simulation.md").read_text() + err


def test_microscopy_folds_split_every_stem_once_and_train_folds_runs(tiny_microscopy, tmp_path, capsys):
    """DLE UNet_Medical's 5-fold cross-validation: ``train unet2d-microscopy --folds`` stopped with 'its reader has
    no folds (data.args.fold)'. The microscopy reader splits its stems as the 3-D readers split cases: each stem
    is validated in exactly one fold, train and val are disjoint, and the out-of-fold table holds fold k's
    validation stems."""
    import json

    from fastvision.data.formats.microscopy import microscopy

    stems = sorted(p.stem for p in (tiny_microscopy / "images").iterdir())
    seen = []
    for k in range(5):
        s = microscopy(path=str(tiny_microscopy), image_size=[32, 32], fold=k, num_folds=5)
        train, val = [p[0].stem for p in s.train.pairs], [p[0].stem for p in s.val.pairs]
        assert not set(train) & set(val) and sorted(train + val) == stems
        seen += val
    assert sorted(seen) == stems
    want = [p[0].stem for p in microscopy(path=str(tiny_microscopy), image_size=[32, 32], fold=1,
                                          num_folds=3).val.pairs]
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--folds", "1",
                           "--out", tmp_path / "cv", "--set", "data.args.num_folds=3", *TINY)
    assert code == 0, err
    cases = json.loads((tmp_path / "cv" / "crossval.json").read_text())["cases"]
    assert sorted(c["id"] for c in cases) == sorted(want) and {c["fold"] for c in cases} == {1}
    # the folds' ensemble is 3-D: a 2-D folds folder to predict said 'expected a NIfTI file' of the first image
    code, _, err = run_cli(capsys, "predict", tmp_path / "cv", tiny_microscopy / "images", "--out", tmp_path / "p")
    one_line_error(code, err, "a train --folds folder of a 2-D run", "fold-0")
    assert not (tmp_path / "p").exists()
    (tmp_path / "t.txt").write_text(stems[0])
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--folds", "all",
                           "--out", tmp_path / "cv2", "--set", f"data.args.train_list={tmp_path / 't.txt'}",
                           "--set", f"data.args.val_list={tmp_path / 't.txt'}", *TINY)
    one_line_error(code, err, "data.args.fold", "train_list")
    assert not (tmp_path / "cv2").exists()
