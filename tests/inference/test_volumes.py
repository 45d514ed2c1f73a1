"""The predict pipeline's pieces: order and errors of the threads, shards, the --out rule."""
from __future__ import annotations

import threading

import pytest

from fastvision.errors import DataError
from fastvision.inference.volumes import MANIFEST, prepare_output, run_pipeline, shard


@pytest.mark.parametrize("overlap", [True, False])
def test_pipeline_keeps_order_and_runs_each_stage_once(overlap):
    seen, threads = [], {"prepare": set(), "infer": set(), "export": set()}

    def stage(name, f):
        def g(*a):
            threads[name].add(threading.current_thread().name)
            return f(*a)
        return g

    run_pipeline(range(7), stage("prepare", lambda i: i * 10), stage("infer", lambda p: p + 1),
                 stage("export", lambda i, p, y: seen.append((i, p, y))), overlap=overlap)
    assert seen == [(i, i * 10, i * 10 + 1) for i in range(7)]
    main = threading.main_thread().name
    assert threads["infer"] == {main}
    if overlap:  # reading and writing happen beside the network, not in its thread
        assert main not in threads["prepare"] | threads["export"]


@pytest.mark.parametrize("where", ["prepare", "infer", "export"])
def test_pipeline_raises_the_first_error_and_stops(where):
    exported = []

    def fail_at(name, f):
        def g(*a):
            if name == where and a[0] == 3:
                raise DataError(f"case 3 broke in {name}")
            return f(*a)
        return g

    with pytest.raises(DataError, match=f"case 3 broke in {where}"):
        run_pipeline(range(50), fail_at("prepare", lambda i: i), fail_at("infer", lambda p: p),
                     fail_at("export", lambda i, p, y: exported.append(i)))
    assert 3 not in exported and len(exported) < 50
    assert not [t for t in threading.enumerate() if t.name in ("predict-read", "predict-write")]  # joined


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shards_partition_the_sorted_cases(world):
    cases = [{"id": f"case_{i:02d}"} for i in (7, 3, 11, 0, 5, 8, 1)]
    parts = [shard(cases, r, world) for r in range(world)]
    ids = [c["id"] for p in parts for c in p]
    assert sorted(ids) == sorted(c["id"] for c in cases) and len(ids) == len(set(ids))
    # the same share whatever order the inputs came in
    assert [shard(list(reversed(cases)), r, world) for r in range(world)] == parts


def test_out_rule(tmp_path):
    out = tmp_path / "pred"
    prepare_output(out, {"model": "a"}, force=False)  # new folder: created, record written
    assert (out / MANIFEST).is_file()
    (out / "case.nii.gz").write_bytes(b"x")
    (out / ".case.nii.gz.abc.tmp").write_bytes(b"partial")  # a killed writer's temp file
    prepare_output(out, {"model": "a"}, force=False)  # the same predict again: resumes
    with pytest.raises(DataError, match="another predict"):
        prepare_output(out, {"model": "b"}, force=False)
    prepare_output(out, {"model": "b"}, force=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.csv").write_text("mine")
    with pytest.raises(DataError, match="results.csv"):
        prepare_output(other, {"model": "a"}, force=False)
    assert sorted(p.name for p in other.iterdir()) == ["results.csv"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is a file"):
        prepare_output(tmp_path / "file", {"model": "a"}, force=True)


_KILLED_MID_WRITE = r"""
import os, signal, sys, time
from pathlib import Path
from fastvision.inference.volumes import run_pipeline
from fastvision.utils.files import atomic_write

out = Path(sys.argv[1])

def slow_write(f):
    time.sleep(0.4)
    f.write(b"case")

def infer(p):
    if p == 2:  # case 2 in the network while case 0 is being written and case 1 waits for the writer
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    return p

run_pipeline(range(4), lambda i: i, infer, lambda i, p, y: atomic_write(out / f"case{i}", slow_write))
"""


def test_a_kill_mid_predict_keeps_the_finished_cases_and_no_temp_file(tmp_path):
    # torchrun stops the other ranks with SIGTERM when one refused an input: the cases already through the
    # network are written, nothing half-written stays, and the exit is 128 + SIGTERM
    import signal
    import subprocess
    import sys

    script = tmp_path / "kill.py"
    script.write_text(_KILLED_MID_WRITE)
    out = tmp_path / "out"
    out.mkdir()
    rc = subprocess.run([sys.executable, str(script), str(out)], timeout=60).returncode
    assert rc == 128 + signal.SIGTERM
    assert sorted(p.name for p in out.iterdir()) == ["case0", "case1"]
    assert all(p.read_bytes() == b"case" for p in out.iterdir())
