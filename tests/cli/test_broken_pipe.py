"""A reader of stdout that leaves early (`fastvision configure DIR --out r.yaml | head`): the command stops
quietly with 128 + SIGPIPE, as a tool killed by SIGPIPE does, with no traceback, and configure's files are
written before its table is printed, so the recipe is not lost."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT, clean_env


def _no_reader(argv: list[str]) -> subprocess.CompletedProcess:
    r, w = os.pipe()
    os.close(r)  # nobody reads: the first write to stdout fails with EPIPE
    try:
        return subprocess.run([sys.executable, "-m", "fastvision", *argv], stdout=w, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=clean_env(), timeout=300)
    finally:
        os.close(w)


def test_configure_into_a_closed_pipe_writes_the_recipe_and_stops_quietly(tmp_path):
    from fastvision.data.synth.medical import synth_spleen

    data = synth_spleen(tmp_path / "sp", cases=4, size=24)
    res = _no_reader(["configure", str(data), "--out", str(tmp_path / "r.yaml")])
    assert res.returncode == 141 and "Traceback" not in res.stderr and "Error" not in res.stderr, res.stderr
    assert "model:" in (tmp_path / "r.yaml").read_text()
