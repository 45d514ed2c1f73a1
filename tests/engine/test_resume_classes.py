"""A classifier resumed on a dataset whose class folders are not the ones it trained on (renamed,
one added in front, one gone) is one line before any step: labels are indices into the sorted
folder names, so every later label would be another class, with the checkpoint's class names kept."""
from __future__ import annotations

from tests.conftest import cli_here


def _args(data, out, epochs: int) -> list[str]:
    return ["train", "resnet18-imagefolder", "--data", str(data), "--out", str(out), "--epochs", str(epochs),
            "--batch-size", "2", "--device", "cpu", "--set", "data.args.image_size=16", "--set",
            "data.args.resize_size=16", "--set", "task.args.num_classes=3", "--set", "model.args.num_classes=3",
            "--set", "train.steps_per_epoch=1", "--set", "train.target=null", "--set", "examples=0"]


def test_a_resume_on_other_class_folders_is_one_line_and_writes_nothing(tmp_path, capsys):
    from fastvision.data.synth.imagenet import synth

    data = synth(tmp_path / "d", classes=3, per_class=2, val_per_class=1, size=16)
    out = tmp_path / "run"
    assert cli_here(_args(data, out, 1)) == 0
    before = (out / "metrics.jsonl").read_bytes(), (out / "checkpoints/last.pt").read_bytes()
    for split in ("train", "val"):  # class000 -> a_new: sorted first, every index moves
        (data / split / "class000").rename(data / split / "a_new")
    capsys.readouterr()
    assert cli_here(_args(data, out, 2) + ["--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its classes are not those" in err[0] and "last.pt" in err[0], err
    assert "class 0 is 'a_new' there, 'class000' in training" in err[0]
    assert ((out / "metrics.jsonl").read_bytes(), (out / "checkpoints/last.pt").read_bytes()) == before
    for split in ("train", "val"):  # the run's own classes again: it continues
        (data / split / "a_new").rename(data / split / "class000")
    assert cli_here(_args(data, out, 2) + ["--resume", "auto"]) == 0
