"""``predict DIR``: the fold ensemble against an independent computation, mirroring, shards, resume."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from fastvision import cli
from tests.conftest import clean_env, cli_here

monai_inferers = pytest.importorskip("monai.inferers")


def _fold_model(out, k):
    """Fold k's network and its final weights, rebuilt from the checkpoint by the API."""
    from fastvision.api import load_run

    run, _ = load_run(out / f"fold-{k}" / "checkpoints" / "last.pt", "cpu", with_data=False)
    return run


def _reference_probs(runs, image, flips):
    """Mean over folds and mirrors of softmax(MONAI sliding window of each fold's model)."""
    total, n = 0, 0
    for run in runs:
        sw = run.task.sliding_window
        for f in flips:
            x = torch.flip(image[None], f) if f else image[None]
            with torch.no_grad():
                logits = monai_inferers.sliding_window_inference(x, sw["roi_size"], sw.get("sw_batch_size", 1),
                                                                 run.model, overlap=sw["overlap"], mode=sw["mode"])
            p = torch.softmax(torch.as_tensor(logits).float(), 1)
            total = total + (torch.flip(p, f) if f else p)
            n += 1
    return (total / n)[0]


@pytest.mark.parametrize("tta", [False, True])
def test_ensemble_is_the_mean_of_the_folds(spleen_folds, tmp_path, tta):
    from fastvision.data.preprocess3d import preprocess_case
    from fastvision.inference.nifti import labels_on_input, prediction_preprocessing
    from fastvision.inference.volumes import Ensemble

    data, out, _ = spleen_folds
    image = sorted((data / "imagesTs").glob("*.nii.gz"))[0]
    runs = [_fold_model(out, k) for k in (0, 1)]
    params, _ = prediction_preprocessing(runs[0].task, "decathlon", runs[0].cfg.data.args)
    pre = preprocess_case({"image": [image], "label": None}, params)
    flips = [(), (2,), (3,), (2, 3)] if tta else [()]  # the recipe flips axes 0 and 1: (B, C, X, Y, Z) dims 2, 3
    want = _reference_probs(runs, pre["image"], flips)
    # the single folds really differ, so the mean is not one of them
    assert not torch.allclose(_reference_probs(runs[:1], pre["image"], flips), want, atol=1e-4)

    states = [r.model.state_dict() for r in runs]
    ens = Ensemble(runs[0].task, _fold_model(out, 0).model, states, torch.device("cpu"), tta_axes=(0, 1) if tta else ())
    torch.testing.assert_close(ens.probabilities(pre["image"]), want, atol=1e-5, rtol=0)

    args = ["predict", str(out), str(image), "--out", str(tmp_path / "pred"), "--device", "cpu",
            "--postprocess", "none"] + (["--tta"] if tta else [])
    assert cli.main(args) == 0
    got = np.asarray(nib.load(str(tmp_path / "pred" / image.name)).dataobj)
    np.testing.assert_array_equal(got, labels_on_input(want, pre["meta"], lambda p: p.argmax(0), softmax=True))
    if tta:  # the same axes given by hand
        assert cli.main(args[:-1] + ["--tta-axes", "1,0", "--out", str(tmp_path / "axes")]) == 0
        np.testing.assert_array_equal(np.asarray(nib.load(str(tmp_path / "axes" / image.name)).dataobj), got)


def _predict_cmd(out, inputs, dest, *extra):
    return [sys.executable, "-m", "fastvision", "predict", str(out), *map(str, inputs), "--out", str(dest),
            "--device", "cpu", "--tta", *extra]


def _bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.nii.gz"))}


def _written(stdout: str) -> int:
    return sum(int(n) for n in re.findall(r"wrote (\d+) files", stdout))


def _one_thread_predict(out, inputs, dest) -> dict:
    """The reference: the cases predicted by this one process, on one thread as each rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run with OMP_NUM_THREADS=1 (clean_env)
    try:
        assert cli.main(_predict_cmd(out, [inputs], dest)[3:]) == 0
    finally:
        torch.set_num_threads(threads)
    return _bytes(dest)


@pytest.fixture(scope="module")
def one_process(spleen_folds, tmp_path_factory):
    data, out, _ = spleen_folds
    return _one_thread_predict(out, data / "imagesTs", tmp_path_factory.mktemp("one") / "pred")


@pytest.fixture
def sharded_here(monkeypatch, capfd):
    """``predict(cmd) -> (exit code, stdout, stderr)``: a ``predict --nproc 2`` command of :func:`_predict_cmd`
    through ``fastvision.cli.main`` in this process, in the environment :func:`clean_env` gives a
    subprocess. This process starts the real torchrun and its two ranks, as the command's own process
    would (which would only import torch to start them); ``capfd`` reads what the ranks print."""
    from tests.distributed.test_dist import time_limit

    clean = clean_env()
    for key in set(os.environ) - set(clean):
        monkeypatch.delenv(key)
    for key, value in clean.items():
        monkeypatch.setenv(key, value)

    def predict(cmd: list[str]) -> tuple[int, str, str]:
        capfd.readouterr()
        with time_limit(600):
            rc = cli_here(cmd[3:])
        out, err = capfd.readouterr()
        return rc, out, err

    return predict


@pytest.mark.dist
def test_two_processes_write_each_case_once_same_bytes(spleen_folds, one_process, tmp_path, sharded_here):
    data, out, _ = spleen_folds
    dest = tmp_path / "pred"
    rc, stdout, stderr = sharded_here(_predict_cmd(out, [data / "imagesTs"], dest, "--nproc", "2"))
    assert rc == 0, stderr
    lines = re.findall(r"rank (\d) of 2: wrote (\d+) files", stdout)
    assert sorted(rank for rank, _ in lines) == ["0", "1"]
    # every case exists and the ranks' counts add up to the case count: none written twice
    assert sum(int(n) for _, n in lines) == len(one_process) == 10
    assert _bytes(dest) == one_process
    assert not [p.name for p in dest.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.dist
def test_sharded_predict_of_a_refused_input_leaves_no_folder(spleen_folds, tmp_path, sharded_here):
    # the rank that reads the NaN case refuses it (one line, exit 2); the job's --out holds no case, so the
    # folder it made goes, record and all: a next, different predict into it is not refused as "another predict"
    data, out, _ = spleen_folds
    image = sorted((data / "imagesTs").glob("*.nii.gz"))[0]
    ref = nib.load(str(image))
    bad = np.asarray(ref.dataobj, np.float32).copy()
    bad[0, 0, 0] = np.nan
    nib.save(nib.Nifti1Image(bad, ref.affine), str(tmp_path / "nan_case.nii.gz"))
    dest = tmp_path / "pred"
    rc, _, stderr = sharded_here(_predict_cmd(out, [tmp_path / "nan_case.nii.gz"], dest, "--nproc", "2"))
    assert rc == 2 and "nan_case.nii.gz: 1 NaN/Inf value(s)" in stderr
    assert not dest.exists()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so a
    process-group kill would miss them), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.dist
def test_killed_sharded_predict_resumes(spleen_folds, tmp_path, sharded_here):
    """The killed job is a process of its own (the CLI's, torchrun and both ranks: all killed); the resume,
    the same command, runs through ``cli.main`` here (``sharded_here``: still torchrun and two ranks)."""
    from fastvision.data.synth import load_all

    _, out, _ = spleen_folds
    # larger cases than the fixture's (about a second each here), so the kill lands mid-way: 3 cases, 2 for
    # rank 0 and 1 for rank 1, and the first file written ends the job before rank 0 can finish its second
    # (the margin of 4 cases, 2 a rank: either rank's second case)
    data = load_all().get("spleen")(tmp_path / "big", seed=5, cases=1, test_cases=3, size=48)  # imagesTs read
    want = _one_thread_predict(out, data / "imagesTs", tmp_path / "one")
    dest = tmp_path / "pred"
    cmd = _predict_cmd(out, [data / "imagesTs"], dest, "--nproc", "2")
    job = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not list(dest.glob("*.nii.gz")) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in [job.pid, *_descendants(job.pid)]:  # the whole job (launchers and both ranks), mid-way
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.communicate()
    before = {p.name: p.stat().st_ino for p in dest.glob("*.nii.gz")}
    assert 0 < len(before) < len(want), "the kill did not land mid-way"
    rc, stdout, stderr = sharded_here(cmd)
    assert rc == 0, stderr
    assert _written(stdout) == len(want) - len(before)  # only what was missing
    assert _bytes(dest) == want
    assert all(dest.joinpath(n).stat().st_ino == ino for n, ino in before.items())  # not rewritten


def test_out_with_other_files_refused(spleen_folds, tmp_path, capsys):
    data, out, _ = spleen_folds
    dest = tmp_path / "pred"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    image = sorted((data / "imagesTs").glob("*.nii.gz"))[0]
    assert cli.main(["predict", str(out), str(image), "--out", str(dest), "--device", "cpu"]) == 2
    assert "notes.txt" in capsys.readouterr().err and sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    # a finished predict rerun into its own folder skips everything; another setting is refused
    dest2 = tmp_path / "pred2"
    assert cli.main(["predict", str(out), str(image), "--out", str(dest2), "--device", "cpu"]) == 0
    assert "wrote 1 files" in capsys.readouterr().out
    assert cli.main(["predict", str(out), str(image), "--out", str(dest2), "--device", "cpu"]) == 0
    assert "(1 of 1 cases; 1 written already)" in capsys.readouterr().out
    assert cli.main(["predict", str(out), str(image), "--out", str(dest2), "--device", "cpu", "--folds", "0"]) == 2
    assert "another predict" in capsys.readouterr().err


def test_input_refused_when_read_leaves_no_out_folder(spleen_folds, tmp_path, capsys):
    data, out, _ = spleen_folds
    src = nib.load(str(sorted((data / "imagesTs").glob("*.nii.gz"))[0]))
    arr = np.asarray(src.dataobj).astype(np.float32)
    arr[0, 0, 0] = np.nan  # found when the case is read, after --out was made
    (tmp_path / "in").mkdir()
    nan = tmp_path / "in" / "a_nan.nii.gz"
    nib.save(nib.Nifti1Image(arr, src.affine), str(nan))
    dest = tmp_path / "pred"
    assert cli.main(["predict", str(out), str(nan), "--out", str(dest), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert str(nan) in err[-1] and "NaN" in err[-1]
    assert not dest.exists()  # was a folder holding only the record, which refused the next predict with --tta
    # a folder holding a written case keeps it and the record that resumes it
    from fastvision.inference.volumes import MANIFEST, remove_if_empty

    dest.mkdir()
    (dest / MANIFEST).write_text("{}")
    (dest / "b.nii.gz").write_bytes(b"x")
    remove_if_empty(dest)
    assert sorted(p.name for p in dest.iterdir()) == [MANIFEST, "b.nii.gz"]


class _Threshold(torch.nn.Module):
    """Class 1 where the input exceeds 0.5 (a 1x1x1 convolution: the model's channel count is 1)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 2, 1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.tensor([0.0, 1.0]).view(2, 1, 1, 1, 1))
            self.conv.bias.copy_(torch.tensor([0.0, -0.5]))

    def forward(self, x):
        return self.conv(x)


def test_postprocessing_steps_reach_the_written_case(tmp_path):
    """Two bright blobs, a threshold model: with the step [1] only the larger blob is written."""
    import json

    from torch import nn

    from fastvision.config import RunConfig
    from fastvision.inference.folds import _postprocess_steps
    from fastvision.inference.nifti import predict_cases, prediction_cases
    from fastvision.inference.volumes import Ensemble, prepare_output
    from fastvision.tasks.segment import SegmentationTask

    vol = np.zeros((20, 16, 12), np.float32)
    vol[2:9, 2:9, 2:9] = 1.0  # 343 voxels
    vol[13:17, 10:14, 6:10] = 1.0  # 64 voxels, not touching the first
    image = tmp_path / "in" / "blobs.nii.gz"
    image.parent.mkdir()
    nib.save(nib.Nifti1Image(vol, np.diag([1.0, 1.0, 1.0, 1.0])), str(image))
    cfg = RunConfig()
    cfg.data.name, cfg.data.args = "decathlon", {"intensity": "none", "crop_foreground": False}
    task = SegmentationTask(num_classes=2, sample_shape=[1, 8, 8, 8], loss=nn.MSELoss(),
                            sliding_window={"roi_size": [8, 8, 8], "overlap": 0.5, "mode": "gaussian"})
    (tmp_path / "postprocessing.json").write_text(json.dumps({"steps": [[1]]}))
    both, larger = (vol > 0.5).astype(np.uint8), np.zeros(vol.shape, np.uint8)
    larger[2:9, 2:9, 2:9] = 1
    for mode, want in (("auto", larger), ("none", both), ("lcc", larger)):
        steps = _postprocess_steps(mode, task, tmp_path / "postprocessing.json")
        out = tmp_path / mode
        prepare_output(out, {"mode": mode}, force=False)
        predict_cases(Ensemble(task, _Threshold(), [], torch.device("cpu")), cfg, prediction_cases([image]), out,
                      steps=steps)
        np.testing.assert_array_equal(np.asarray(nib.load(str(out / image.name)).dataobj), want)


def test_a_3d_run_given_a_2d_image_is_one_line(spleen_folds, tiny_microscopy, tmp_path, capsys):
    """A fold's run (or the folds folder) given a PNG was the sliding window's ValueError traceback."""
    from tests.cli.input_checks import one_line_error

    _, out, _ = spleen_folds
    png = tiny_microscopy / "images" / "img_0000.png"
    for model in (out / "fold-0", out):
        code = cli.main(["predict", str(model), str(png), "--out", str(tmp_path / "p"), "--device", "cpu"])
        one_line_error(code, capsys.readouterr().err, png, "unet3d-spleen-baseline", "is a 3-D run",
                       ".nii / .nii.gz files")
        assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("steps", [[[2]], [[]], [[1, 3]]])
def test_postprocessing_json_of_other_labels_is_one_line(spleen_folds, tmp_path, capsys, steps):
    import json
    import shutil

    data, out, _ = spleen_folds
    cv = tmp_path / "cv"
    shutil.copytree(out, cv)
    (cv / "postprocessing.json").write_text(json.dumps({"steps": steps}))  # another run's (3 classes), or edited
    image = sorted((data / "imagesTs").glob("*.nii.gz"))[0]
    assert cli.main(["predict", str(cv), str(image), "--out", str(tmp_path / "pred"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(cv / "postprocessing.json") in err and "this model's labels (1)" in err
    assert not (tmp_path / "pred").exists()


def test_out_that_is_the_input_folder_is_refused_even_with_force(spleen_folds, tmp_path, capsys):
    data, out, _ = spleen_folds
    import shutil

    folder = tmp_path / "imagesTs"
    shutil.copytree(data / "imagesTs", folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert cli.main(["predict", str(out), str(folder), "--out", str(folder), "--force", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is an input" in err and str(folder.resolve()) in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the images were replaced by labels


@pytest.mark.parametrize("axes", ["", ","])
def test_tta_axes_naming_no_axis_is_one_line(spleen_folds, tmp_path, capsys, axes):
    """``--tta-axes ''`` (a script's empty variable) predicted without mirroring, as if it were not given."""
    data, out, _ = spleen_folds
    image = sorted((data / "imagesTs").glob("*.nii.gz"))[0]
    assert cli.main(["predict", str(out), str(image), "--out", str(tmp_path / "p"), "--tta-axes", axes]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--tta-axes {axes!r}: names no axis" in err[0] and not (tmp_path / "p").exists()
