"""``fastvision profile`` and ``fastvision monitor``: bad counts (``--nproc 0`` too, refused before any worker
starts), a header-only CSV, a plot name matplotlib cannot write, a folder or an existing plot are one line naming
the option or file (exit 2), through the real CLI."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.input_checks import one_line_error, run_cli

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "images" / "monitor_example.csv"


@pytest.mark.parametrize("flag,value", [("--steps", "0"), ("--steps", "-2"), ("--warmup", "-1"), ("--nproc", "0"),
                                        ("--nproc", "-3")])
def test_profile_refuses_step_counts_out_of_range(flag, value, tiny_microscopy, tmp_path, capsys):
    code, _, err = run_cli(capsys, "profile", "unet2d-microscopy", "--data", tiny_microscopy, "--device", "cpu",
                           flag, value, "--out", tmp_path / "p0")
    one_line_error(code, err, f"{flag} {value}")
    assert not (tmp_path / "p0").exists()


@pytest.mark.parametrize("flag", ["--out", "--trace"])
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_profile_refuses_a_file_as_its_report_or_trace_folder(flag, force, tiny_microscopy, tmp_path, capsys):
    """A file where the folder is to be: one line, even with --force (which was a FileExistsError traceback
    after the steps had run), the file kept."""
    there = tmp_path / "notes.txt"
    there.write_text("mine")
    code, _, err = run_cli(capsys, "profile", "unet2d-microscopy", "--data", tiny_microscopy, "--device", "cpu",
                           "--steps", "1", "--warmup", "0", flag, there, *force)
    one_line_error(code, err, f"{flag} {there}: is a file")
    assert there.read_text() == "mine"


def test_monitor_replot_header_only_csv(tmp_path, capsys):
    hdr = tmp_path / "hdr.csv"
    hdr.write_text(EXAMPLE.read_text().splitlines()[0] + "\n")
    code, _, err = run_cli(capsys, "monitor", "--replot", hdr)
    one_line_error(code, err, str(hdr), "no readings")
    assert not hdr.with_suffix(".png").exists()


@pytest.mark.parametrize("name", ["m.txt", "noext"])
def test_monitor_replot_refuses_a_plot_name_it_cannot_write(name, tmp_path, capsys):
    code, _, err = run_cli(capsys, "monitor", "--replot", EXAMPLE, "--plot", tmp_path / name)
    one_line_error(code, err, "--plot", name)
    assert list(tmp_path.iterdir()) == []


def test_monitor_replot_default_plot_is_csv_name_with_png_and_not_replaced(tmp_path, capsys):
    csv = tmp_path / "m.csv"
    csv.write_text(EXAMPLE.read_text())
    code, out, _ = run_cli(capsys, "monitor", "--replot", csv)
    assert code == 0 and out.strip() == str(tmp_path / "m.png")  # as --help says: m.csv -> m.png
    (tmp_path / "m.png").write_bytes(b"keep")
    code, _, err = run_cli(capsys, "monitor", "--replot", csv)
    one_line_error(code, err, "m.png", "--force")
    assert (tmp_path / "m.png").read_bytes() == b"keep"
    code, _, _ = run_cli(capsys, "monitor", "--replot", csv, "--force")
    assert code == 0 and (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        run_cli(capsys, "monitor", "--help")
    out = capsys.readouterr().out
    assert "--force" in out and "m.csv" not in out and "with .png" in out


def test_monitor_replot_refuses_a_folder_as_plot(tmp_path, capsys):
    (tmp_path / "mic").mkdir()
    for force in ([], ["--force"]):
        code, _, err = run_cli(capsys, "monitor", "--replot", EXAMPLE, "--plot", tmp_path / "mic", *force)
        one_line_error(code, err, "--plot", "mic", "folder")
    assert not (tmp_path / "mic.png").exists()
