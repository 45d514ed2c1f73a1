"""scripts/check_sizes.py, the size rule `make lint` runs: limits hit exactly, and the exit codes."""

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "check_sizes.py"


def _function(name: str, lines: int) -> str:
    """A function of exactly ``lines`` lines, counted from its def line."""
    return f"def {name}():\n" + "    x = 1\n" * (lines - 2) + "    return x\n"


def _run(root):
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def test_limits_are_inclusive(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = _function("at_limit", 60)
    (pkg / "ok.py").write_text(body + "\n" * (400 - body.count("\n")))  # 400 lines, a 60-line function
    proc = _run(pkg)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout == ""


def test_reports_a_long_file_and_a_long_method(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "long.py").write_text("x = 1\n" * 401)
    method = "class A:\n" + "\n".join("    " + line for line in _function("too_long", 61).splitlines()) + "\n"
    (pkg / "sub" / "m.py").write_text(method)
    proc = _run(pkg)
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        f"{pkg / 'long.py'}: 401 lines (limit 400)",
        f"{pkg / 'sub' / 'm.py'}:2: too_long is 61 lines (limit 60)",
    ]


def test_a_missing_folder_is_an_error(tmp_path):
    proc = _run(tmp_path / "absent")
    assert proc.returncode == 2
    assert "absent is not a folder" in proc.stderr
