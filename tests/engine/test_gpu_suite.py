"""benchmarks/gpu_suite.py end to end at CI sizes (``--device cpu --quick``), as on a bare GPU machine.

The suite runs in a subprocess in which MONAI, nibabel and pycocotools cannot be imported (a
``sys.meta_path`` finder raises ImportError for them), so the test also shows that nothing the suite
imports needs them. Checked: the JSON and Markdown structure, and that every row is a real
measurement (items/s > 0) or an explicit skip note; no row failed. benchmarks/gpu_levers.py runs
after it in the same blocked subprocess (one torch import for both scripts, seconds of CPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, runpy, sys
BLOCKED = ("monai", "nibabel", "pycocotools")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU machine does not have it)",
                                      name=name)
        return None
sys.meta_path.insert(0, Block())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
sys.argv = [%r, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# The two benchmark scripts, one after the other, in one process under the blocker: each as
# ``python SCRIPT --device cpu --quick --out DIR`` would run it (``__main__``, its own argv), its exit code
# printed; the process exits with the first nonzero one.
BOTH_SCRIPTS = BLOCKER.split("sys.argv = [")[0] + """
codes = []
for script, out in %r:
    sys.argv = [script, "--device", "cpu", "--quick", "--out", out]
    try:
        runpy.run_path(script, run_name="__main__")
        codes.append(0)
    except SystemExit as e:
        codes.append(e.code)
    print(f"== {script}: exit code {codes[-1]}", flush=True)
sys.exit(next((c for c in codes if c), 0))
"""


@pytest.mark.slow
def test_cpu_quick_suite_and_levers_run_end_to_end_without_monai_nibabel_pycocotools(tmp_path):
    """The suite's checks and the levers' checks (the two functions below) on the output of one blocked
    subprocess that runs both scripts: what each checks (the script runs at CI sizes with none of the
    three packages importable, and writes what a GPU session brings back) is as with a process of its own."""
    suite_out, levers_out = tmp_path / "suite", tmp_path / "levers"
    runs = ((str(ROOT / "benchmarks" / "gpu_suite.py"), str(suite_out)),
            (str(ROOT / "benchmarks" / "gpu_levers.py"), str(levers_out)))
    script = BOTH_SCRIPTS % (runs,)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTVISION_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=340)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "blocked" not in proc.stdout + proc.stderr  # nothing tried to import them
    assert "gpu_suite.py: exit code 0" in proc.stdout and "gpu_levers.py: exit code 0" in proc.stdout
    _check_quick_suite(suite_out)
    _check_quick_levers(levers_out)


def _check_quick_suite(out: Path) -> None:
    """benchmarks/gpu_suite.py's JSON and Markdown of a ``--device cpu --quick`` run in ``out``."""
    report = json.loads((out / "gpu_suite.json").read_text())
    assert report["device"] == "cpu" and report["quick"] is True and report["issue"] == 13
    rows = {r["name"]: r for r in report["rows"]}
    from benchmarks.gpu_suite import (
        WORKLOADS,  # the table at the top of the script: every workload has a row
    )

    assert list(rows) == [w["name"] for w in WORKLOADS]
    for name, r in rows.items():
        assert "error" not in r, (name, r["error"])
        assert r["value"] > 0 if "value" in r else r["skip"], name
    measured = [n for n, r in rows.items() if "value" in r]
    # every --quick row measured on the CPU, except the GPU tests (need CUDA, not in --quick)
    assert set(measured) == {w["name"] for w in WORKLOADS if w["quick"] and w["kind"] != "tests"}
    assert rows["GPU tests (pytest -m gpu)"]["skip"] == "not in --quick"
    assert rows["ResNet-50 v1.5 train"]["anchors"] == ["DLE PyTorch A100 AMP 2,470 img/s",
                                                       "MLPerf v4.0 H100 ~7,160 img/s/GPU"]
    assert rows["3D U-Net (BraTS) 128^3 x 4 train"]["goal"] == 70
    for r in rows.values():
        if r["kind"] in ("train", "inference") and "value" in r:
            assert 0 < r["p50_ms"] <= r["p99_ms"]
    assert "DeviceCacheDataset" in rows["Spleen input path, data.cache gpu"]["note"]

    md = (out / "gpu_suite.md").read_text().splitlines()
    table = [line for line in md if line.startswith("|")]
    assert table[0].startswith("| workload | setting | measured |")
    assert len(table) == 2 + len(WORKLOADS)  # header, rule, one line per row
    assert all(line.count("|") == table[0].count("|") for line in table)  # no cell broke the table


def _check_quick_levers(out: Path) -> None:
    """benchmarks/gpu_levers.py (issue 40) at CI sizes, without MONAI, nibabel or pycocotools (run by the
    test above, into ``out``): every --quick row measured, each lever's ratio to its own group's
    baseline, a kernel table per row, the header with the versions, and the three files a GPU session
    brings back."""
    report = json.loads((out / "levers.json").read_text())
    assert report["issue"] == 40 and report["device"] == "cpu" and report["torch"] and "cudnn" in report
    from benchmarks.gpu_levers import ROWS

    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == [r["name"] for r in ROWS]
    measured = [r for r in report["rows"] if "items_per_s" in r]
    assert {r["name"] for r in measured} == {r["name"] for r in ROWS if r["quick"]}
    for r in measured:
        assert "error" not in r and r["items_per_s"] > 0 and r["kernels"] and r["flops_per_item"] > 0
        assert 0 < sum(k["share"] for k in r["kernels"]) <= 1 + 1e-9
        assert r["settings"]["precision"] == "fp32"  # CI sizes: fp32 on a CPU
        if r["base"]:  # the ratio is to the baseline of the lever's own group
            base = rows[r["base"]]
            assert base["group"] == r["group"] and r["vs_base"] == r["items_per_s"] / base["items_per_s"]
    lever = rows["unet3d NDHWC instance_cl bf16 bs2"]
    assert lever["channels_last"] and lever["settings"]["overrides"]["model.args.norm"] == "instance_cl"
    table = [ln for ln in (out / "levers.md").read_text().splitlines() if ln.startswith("|")]
    assert len(table) == 2 + len(ROWS) and all(ln.count("|") == table[0].count("|") for ln in table)
    kernels = (out / "kernels.txt").read_text()
    assert kernels.count("== ") == len(measured) and "convolution" in kernels


def test_the_suites_gpu_test_files_hold_every_gpu_test_and_collect_without_optional_packages():
    """The tests row runs `pytest -m gpu` on `gpu_test_files()` only: the same GPU tests as the whole tree
    (collected here in-process), collected in a subprocess where MONAI, nibabel and pycocotools are blocked."""
    from benchmarks.gpu_suite import gpu_test_files

    files = gpu_test_files()
    script = BLOCKER % "-m"  # argv[0] is replaced below: run pytest's module instead of the suite
    script = script.replace('runpy.run_path(sys.argv[0], run_name="__main__")',
                            'runpy.run_module("pytest", run_name="__main__")')
    args = ["--co", "-q", "-m", "gpu", "-p", "no:cacheprovider", *map(str, files)]
    sub = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    ids = lambda out: {ln for ln in out.splitlines() if "::" in ln}  # noqa: E731
    assert sub.returncode == 0, sub.stdout[-2000:] + sub.stderr[-2000:]
    assert "blocked" not in sub.stdout + sub.stderr
    assert len(ids(sub.stdout)) >= 20 and ids(sub.stdout) == _gpu_test_ids_of_the_whole_tree()


def _gpu_test_ids_of_the_whole_tree() -> set[str]:
    """``pytest --co -m gpu tests`` in this process (most test modules are imported already; a
    subprocess would import torch and every test module again): the node ids as ``--co -q`` prints them."""

    class Ids:
        found: set[str] = set()

        def pytest_collection_finish(self, session):
            self.found = {item.nodeid for item in session.items}

    ids, cwd = Ids(), os.getcwd()
    os.chdir(ROOT)  # node ids relative to the root, as the subprocess's
    try:
        rc = pytest.main(["--co", "-m", "gpu", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist",
                          "-p", "no:terminal", str(ROOT / "tests")], plugins=[ids])
    finally:
        os.chdir(cwd)
    assert rc == 0, rc
    return ids.found


def test_only_runs_the_named_rows_and_skips_the_others_with_a_note():
    """A session re-measures only what a change touched: ``--only 'GPU tests'`` leaves every other row
    skipped (on a CPU the tests row itself is skipped: it needs CUDA)."""
    from benchmarks.gpu_suite import WORKLOADS, run_suite

    report = run_suite(torch.device("cpu"), quick=False, only=["gpu TESTS"])
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["GPU tests (pytest -m gpu)"]["skip"] == "needs a CUDA device"
    assert all(r["skip"] == "not in --only" for n, r in rows.items() if n != "GPU tests (pytest -m gpu)")
    assert len(rows) == len(WORKLOADS) and "cudnn" in report
