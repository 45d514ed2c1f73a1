"""A command that needs an optional extra the install lacks (`make demo` installs the base package alone)
stops with one line naming the extra to install, exit 2, never a ModuleNotFoundError traceback; and the
files commands write atomically get the mode a plain open() gives (the umask's), not mkstemp's 0600."""
from __future__ import annotations

import os
import stat
import sys

import pytest

from tests.cli.input_checks import one_line_error, run_cli


@pytest.mark.parametrize("kind", ["hippocampus", "spleen", "brats", "thinstack"])
def test_nifti_synth_without_nibabel_names_the_medical_extra(kind, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "nibabel", None)  # as on a base install: `import nibabel` raises
    code, _, err = run_cli(capsys, "data", "synth", kind, tmp_path / "d", "--cases", "1", "--test-cases", "0")
    one_line_error(code, err, "nibabel", "pip install 'fastvision[medical]'")


def test_missing_extra_with_debug_keeps_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "nibabel", None)
    with pytest.raises(ModuleNotFoundError):
        run_cli(capsys, "--debug", "data", "synth", "spleen", tmp_path / "d", "--cases", "1")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_follow_the_umask(tiny_microscopy, tmp_path, capsys):
    """config.yaml, summary.json, checkpoints, predicted masks and overlays were 0600 whatever the umask
    (mkstemp's mode): a colleague in the group could not read a shared run or its predictions."""
    umask = os.umask(0o022)  # read it (the process's, as the CLI started with it) ...
    os.umask(umask)  # ... and put it back
    run, pred = tmp_path / "run", tmp_path / "pred"
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", run,
                           "--epochs", "1", "--batch-size", "4", "--device", "cpu",
                           "--set", "data.args.image_size=[32,32]", "--set", "model.args.filters=[4,8,16]")
    assert code == 0, err
    code, _, err = run_cli(capsys, "predict", run, tiny_microscopy / "images" / "img_0000.png", "--out", pred)
    assert code == 0, err
    files = [run / "config.yaml", run / "summary.json", run / "checkpoints" / "last.pt",
             pred / "img_0000_mask.png", pred / "img_0000_overlay.png"]
    assert {f.name: oct(_mode(f)) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}
