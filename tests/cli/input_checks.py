"""Shared helpers of the CLI input-check tests: run ``fastvision.cli.main`` and check a one-line error."""
from __future__ import annotations

from pathlib import Path

from fastvision.cli import main


def run_cli(capsys, *argv):
    """``(exit code, stdout, stderr)`` of ``fastvision ARGV`` run in this process."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *needles) -> str:
    """Exit 2, no traceback, one ``fastvision: error:`` line holding every needle; that line."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("fastvision: error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


def guarded_json(capsys, argv, tmp_path) -> Path:
    """``ARGV --json F`` keeps an existing F without --force (refused before any work: nothing on stdout),
    replaces it with --force, and refuses a folder even with --force; returns F, as written with --force."""
    keep = tmp_path / "keep.json"
    keep.write_text("mine")
    code, out, err = run_cli(capsys, *argv, "--json", keep)
    one_line_error(code, err, str(keep), "--force")
    assert keep.read_text() == "mine" and out == ""
    assert run_cli(capsys, *argv, "--json", keep, "--force")[0] == 0
    folder = tmp_path / "a-folder"
    folder.mkdir()
    code, _, err = run_cli(capsys, *argv, "--json", folder, "--force")
    one_line_error(code, err, "--json", "folder")
    return keep
