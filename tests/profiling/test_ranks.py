"""The per-rank profile: each rank's medians and the slow rank, from hand-computed rows; and two real 2-rank gloo
jobs of ``fastvision profile`` on the CPU (``--nproc 2``, and two tasks under srun's variables) in which one rank
is made slow with ``FASTVISION_PROFILE_SLOW_RANK`` (it waits a known time for each batch): the table has a row per
rank, the JSON says the same, and the slow rank and its phase are named."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastvision.errors import ConfigError
from fastvision.profiling.ranks import SLOW_ENV, delayed, rank_row, slowest, waiting_advice
from tests.conftest import ROOT, clean_env, cli_here, communicate_all, free_port

INPUT = "its input pipeline (loading and per-item transforms on that rank's host)"
DELAY = 0.08  # seconds the slow rank waits for each batch: several times a step of the tiny U-Net here


def test_rank_row_by_hand():
    """Medians of three steps (ms): the compute and work columns are medians of per-step sums, not sums of medians."""
    per = {"data": [0.010, 0.030, 0.020], "h2d": [0.001] * 3, "augment": [0.0] * 3,
           "forward": [0.010, 0.012, 0.011], "backward": [0.020, 0.020, 0.026], "optimizer": [0.002] * 3,
           "comm": [0.005, 0.001, 0.003]}
    row = rank_row(3, per, [0.060, 0.070, 0.065])
    # compute per step 33, 35, 40 ms; work (data + compute) 43, 65, 60 ms
    assert row["rank"] == 3 and row["step_ms"] == pytest.approx(65)
    assert row["compute_ms"] == pytest.approx(35) and row["work_ms"] == pytest.approx(60)
    assert row["comm_ms"] == pytest.approx(3) and row["data_share"] == pytest.approx(20 / 65)
    assert row["phases_ms"] == pytest.approx({"data": 20, "h2d": 1, "augment": 0, "forward": 11, "backward": 20,
                                              "optimizer": 2})


def _row(rank, step, data, forward, backward, optimizer=1.0):
    phases = {"data": data, "h2d": 0.0, "augment": 0.0, "forward": forward, "backward": backward,
              "optimizer": optimizer}
    return {"rank": rank, "step_ms": step, "phases_ms": phases, "work_ms": sum(phases.values())}


CASES = [
    # three ranks, rank 1 waits for data: work 33, 91, 36 -> 91 / median(33, 36) = 2.64; data 60 - median(2, 4) = 57
    ([_row(0, 90, 2, 10, 20), _row(1, 92, 60, 10, 20), _row(2, 90, 4, 11, 20)],
     dict(rank=1, phase="data", stands_out=True, ratio=91 / 34.5, excess_ms=57, share=60 / 92, others_share=3 / 90),
     f"rank 1 is 2.64x the median rank's work per step (data wait + compute; the others wait for it in the "
     f"all-reduce): data wait 65 % of its step (others 3 %): {INPUT}"),
    # two ranks, rank 1 computes slowly: work 33 and 68; backward's excess 20 beats forward's 15
    ([_row(0, 70, 2, 10, 20), _row(1, 70, 2, 25, 40)],
     dict(rank=1, phase="backward", stands_out=True, ratio=68 / 33, excess_ms=20, share=40 / 70, others_share=20 / 70),
     "rank 1 is 2.06x the median rank's work per step (data wait + compute; the others wait for it in the "
     "all-reduce): backward 57 % of its step (others 29 %): its compute (backward)"),
    # balanced: 34 / 33 = 1.03 is under the 1.1 threshold
    ([_row(0, 70, 2, 10, 20), _row(1, 70, 3, 10, 20)],
     dict(rank=1, phase="data", stands_out=False, ratio=34 / 33, excess_ms=1, share=3 / 70, others_share=2 / 70),
     "no rank stands out: the slowest, rank 1, does 1.03x the median rank's work per step (largest difference: "
     "data wait 4 % of its step (others 3 %))"),
    # equals: the first of them, rank 0
    ([_row(0, 70, 2, 10, 20), _row(1, 70, 2, 10, 20)],
     dict(rank=0, phase="data", stands_out=False, ratio=1.0, excess_ms=0, share=2 / 70, others_share=2 / 70), None),
]


@pytest.mark.parametrize("rows,want,line", CASES)
def test_slowest_rank_and_its_phase_by_hand(rows, want, line):
    got = slowest(rows)
    assert {k: got[k] for k in want} == pytest.approx(want)
    if line is not None:
        assert got["line"] == line


def test_one_rank_has_no_slowest():
    assert slowest([_row(0, 70, 2, 10, 20)]) is None


SLOW = slowest(CASES[0][0])  # rank 1, input pipeline, stands out
EVEN = slowest(CASES[2][0])  # does not stand out


LEAD = "rank 1 holds every step back (per-rank table): speed up its input pipeline (loading and per-item " \
       "transforms on that rank's host) first"


@pytest.mark.parametrize("slow,verdict,rank,want", [
    # rank 0 waits for rank 1: its communication is that wait, so its own advice (accumulation, buckets) is dropped
    (SLOW, "communication-bound", 0, f"{LEAD}; this rank's communication is its wait for it, faster communication "
                                     "would not help"),
    (SLOW, "compute-bound", 0, f"{LEAD}; then, on this rank: OWN"),
    (SLOW, "communication-bound", 1, "OWN"),  # the slow rank's own report
    (EVEN, "communication-bound", 0, "OWN"),  # nobody stands out: the communication itself may be the cost
    (None, "compute-bound", 0, "OWN"),
])
def test_waiting_advice_leads_with_the_slow_rank_where_another_rank_stands_out(slow, verdict, rank, want):
    assert waiting_advice(slow, verdict, rank, "OWN") == want


@pytest.mark.parametrize("value", ["1", "x:0.1", "1:abc", "-1:0.1", "1:-2", "1:nan", "1:2:3"])
def test_slow_rank_variable_that_is_not_rank_colon_seconds_is_one_error(value):
    with pytest.raises(ConfigError, match=f"{SLOW_ENV}=.*RANK:SECONDS"):
        delayed(iter([]), 0, {SLOW_ENV: value})


def test_slow_rank_variable_delays_only_its_rank():
    batches = iter([1, 2, 3])
    assert delayed(batches, 0, {}) is batches and delayed(batches, 0, {SLOW_ENV: "1:0.5"}) is batches
    late = delayed(batches, 1, {SLOW_ENV: "1:0"})
    assert late is not batches and list(late) == [1, 2, 3]


def _profile_argv(data, out) -> list[str]:
    return ["profile", "unet2d-microscopy", "--data", str(data), "--device", "cpu", "--batch-size", "2",
            "--steps", "4", "--warmup", "1", "--set", "data.args.image_size=[32,32]",
            "--set", "model.args.filters=[4,8,16]", "--set", "data.num_workers=0", "--out", str(out)]


def _check_report(out, launcher: str, slow: int) -> dict:
    """What every 2-rank job must have written: two rows in rank order, the slow rank named by its input
    pipeline, the same table in profile.txt, and nothing else in the folder (rank 0 alone writes)."""
    report = json.loads((out / "profile.json").read_text())
    assert (report["world_size"], report["launcher"]) == (2, launcher)
    rows = report["ranks"]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert set(r) == {"rank", "step_ms", "work_ms", "compute_ms", "comm_ms", "data_share", "phases_ms"}
        assert r["step_ms"] > 0 and r["compute_ms"] > 0 and 0 <= r["data_share"] <= 1
    # the slow rank waited DELAY for each batch inside the step's data phase: a lower bound, not a timing
    assert rows[slow]["phases_ms"]["data"] >= 1e3 * DELAY
    s = report["slowest"]
    assert (s["rank"], s["phase"], s["stands_out"]) == (slow, "data", True) and s["ratio"] >= 1.1
    assert s["line"].startswith(f"rank {slow} is ") and s["line"].endswith(INPUT)
    text = (out / "profile.txt").read_text()
    assert "per rank: p50 ms of 4 steps" in text and "comm wait" in text
    assert " ".join(f"rank {slow} is".split()) in " ".join(text.split())
    assert sorted(p.name for p in out.iterdir()) == ["profile.json", "profile.txt"]
    return report


@pytest.mark.dist
def test_nproc_2_names_the_slow_rank(tiny_microscopy, tmp_path, monkeypatch, capfd):
    """``--nproc 2`` in this process starts torchrun as a user's command would; rank 1 waits for its batches:
    rank 0 spends much of its step waiting in the all-reduce, and its advice leads with rank 1's input
    pipeline."""
    from tests.distributed.test_dist import time_limit

    clean = clean_env(**{SLOW_ENV: f"1:{DELAY}"})
    for key in set(os.environ) - set(clean):
        monkeypatch.delenv(key)
    for key, value in clean.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "p"
    with time_limit(120):
        assert cli_here([*_profile_argv(tiny_microscopy, out), "--nproc", "2"], threads=1) == 0
    report = _check_report(out, "torchrun", slow=1)
    assert report["advice"].startswith("rank 1 holds every step back (per-rank table): speed up its input")
    assert capfd.readouterr().out.count("report: ") == 1  # rank 0 alone prints


@pytest.mark.dist
def test_srun_tasks_name_the_slow_rank_0(tiny_microscopy, tmp_path):
    """Two tasks with srun's variables (the user's own launch, no --nproc); rank 0, which also writes the
    report, is the slow one: no waiting advice, as its own step is the one the others wait for."""
    out, port, procs = tmp_path / "p", free_port(), []
    for r in range(2):
        env = clean_env(SLURM_JOB_ID="5151", SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                        SLURM_STEP_ID="0", SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2", SLURM_NODELIST="localhost",
                        MASTER_PORT=str(port), **{SLOW_ENV: f"0:{DELAY}"})
        procs.append(subprocess.Popen([sys.executable, "-m", "fastvision.cli", *_profile_argv(tiny_microscopy, out)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = communicate_all(procs, timeout=120)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(err[-2000:] for _, err in outs)
    report = _check_report(out, "slurm", slow=0)
    assert "holds every step back" not in report["advice"]
    assert "report: " in outs[0][0] and outs[1][0] == ""  # rank 1 prints nothing
