"""Shared helpers of the CLI input-check tests: run ``fastvision.cli.main`` and check a one-line error."""
from __future__ import annotations

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
