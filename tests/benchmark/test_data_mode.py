"""``benchmark --mode data``: items/s per host core from the process tree's CPU time, and interleaved
modes that do not time a loader's head start as its rate; ``plan`` and ``scale`` read the result.

The dataset burns a known CPU time per item, so the true rates are known by hand: one core makes
``1 / cost`` items/s, and ``W`` loader workers at most ``W / cost``.
"""
from __future__ import annotations

import json
import time

import pytest
import torch
from torch.utils.data import Dataset

from fastvision import cli
from fastvision.benchmark.data import read_input_rate
from fastvision.data.formats import DatasetSplits
from fastvision.errors import ConfigError
from fastvision.registry import DATASETS
from fastvision.utils.hostcpu import tree_cpu_seconds, wait_idle

COST = 0.01  # CPU seconds each item burns in whichever thread or process builds it


class Burn(Dataset):
    """Tiny segmentation items, each costing ``cost`` seconds of the building thread's CPU (or of
    sleep, ``sleep=True``: wall time that other work cannot slow down)."""

    def __init__(self, n: int, cost: float, sleep: bool = False):
        self.n, self.cost, self.sleep = n, cost, sleep

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep:
            time.sleep(self.cost)
        end = time.thread_time() + (0 if self.sleep else self.cost)
        while time.thread_time() < end:  # busy: CPU time, not a sleep
            pass
        image = torch.full((1, 16, 16), float(i % 7) / 7)
        return {"image": image, "label": (image[0] > 0.5).long(), "id": str(i)}


if "burn-blobs" not in DATASETS.names():
    @DATASETS.register("burn-blobs")
    def _burn(*, image_size: list[int] = (16, 16), val_fraction: float = 0.2, split_seed: int = 0,
              count: int = 64, cost: float = COST, sleep: bool = False) -> DatasetSplits:
        return DatasetSplits(Burn(count, cost, sleep), Burn(4, 0.0), {})


def _data_mode(tmp_path, *extra, steps: int = 24, rounds: int = 2):
    out = tmp_path / "out"
    argv = ["benchmark", "unet2d-microscopy", "--mode", "data", "--device", "cpu", "--batch-sizes", "4",
            "--steps", str(steps), "--rounds", str(rounds), "--out", str(out), "--set", "data.name=burn-blobs",
            "--set", "data.augment={}", *extra]
    assert cli.main(argv) == 0
    return json.loads((out / "unet2d-microscopy-data.json").read_text()), out / "unet2d-microscopy-data.json"


def test_tree_cpu_counts_a_worker_process_and_idle_waits_for_it():
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    before, complete = tree_cpu_seconds()
    p = ctx.Process(target=Burn(1, 0.3).__getitem__, args=(0,))  # 0.3 s of the child's CPU
    p.start()
    assert wait_idle(timeout=20)  # returns once the child has finished burning
    during, _ = tree_cpu_seconds()
    p.join()
    after, _ = tree_cpu_seconds()  # reaped: now in os.times' children, counted once
    assert complete
    assert 0.25 < during - before < 0.6 and after - during < 0.05


@pytest.mark.parametrize("loader", ["processes", "threads"])
def test_items_per_core_is_one_over_the_cpu_cost_of_an_item(tmp_path, loader):
    report, _ = _data_mode(tmp_path, "--set", f"data.loader={loader}", "--set", "data.num_workers=2")
    row = report["results"][0]
    # each item costs COST of some thread's CPU: at most 1/COST items per core; the main thread's
    # copy and the loader's collation add a little. A worker process's CPU time is read in clock
    # ticks (10 ms) at each turn's start and end, so the sum is good to a few ticks either way;
    # a count that missed the workers would read several times 1/COST
    assert row["items"] == 24 * 4 and row["cpu_s"] > 24 * 4 * COST * 0.85
    assert 0.6 / COST < row["items_per_cpu_s"] <= 1.15 / COST, row
    # ready: 2 workers x 2 (DataLoader) or a window of 2 x 2 less the one handed out (threads); + 1 per worker
    assert row["prefetch_untimed"] == (4 if loader == "processes" else 3) + 2


def test_interleaved_modes_are_not_timed_on_their_head_start(tmp_path):
    # two identical settings take turns, one worker process each, 4 batches a turn; an item takes COST
    # of sleep, so one process builds at most 1 / COST items/s whatever else runs. While one mode is
    # timed the other's worker refills its queue (2 batches): timed on that head start a mode read
    # about twice that; untimed, at most that.
    out = tmp_path / "out"
    assert cli.main(["benchmark", "unet2d-microscopy", "--mode", "data", "--device", "cpu", "--batch-sizes", "4",
                     "--steps", "16", "--rounds", "4", "--out", str(out), "--set", "data.name=burn-blobs",
                     "--set", "data.augment={}", "--set", "data.loader=processes", "--set", "data.args.sleep=true",
                     "--variant", "data.num_workers=1", "--variant", "data.num_workers=1"]) == 0
    report = json.loads((out / "unet2d-microscopy-data.json").read_text())
    for row in report["results"]:
        assert row["items_per_s"] <= 1.15 / COST, row
        assert row["unsettled_chunks"] == 0 and row["prefetch_untimed"] == 2 + 1


def test_plan_and_scale_take_the_per_core_rate_from_the_report(tmp_path, capsys):
    # what is tested is the report's figure reaching plan, not the figure: a short report (16 items,
    # one epoch of warm-up; 8 batches, one round), and plan traces a two-level U-Net (the ops of the
    # recipe's five levels cost seconds of tracing and change nothing here)
    report, path = _data_mode(tmp_path, "--set", "data.loader=threads", "--set", "data.num_workers=1",
                              "--set", "data.args.count=16", steps=8, rounds=1)
    rate, what = read_input_rate(path, cache=report["results"][0]["cache"])
    assert rate == report["results"][0]["items_per_cpu_s"] and "measured per core" in what
    capsys.readouterr()
    assert cli.main(["plan", "unet2d-microscopy", "--gpu", "H100-80GB", "--gpus", "16", "--no-switches",
                     "--set", "model.args.filters=[4,8]", "--set", "data.name=burn-blobs",
                     "--input-rate", str(path), "--json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["input_rate_per_core"] == pytest.approx(rate)
    assert "host cores per GPU to feed it" in capsys.readouterr().out
    # a report without a per-core figure (older, or measured without /proc): items/s per loader process
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"recipe": "r", "num_workers": 4, "results": [{"cache": "none", "items_per_s": 520.0}]}))
    assert read_input_rate(old)[0] == pytest.approx(130.0)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="bad.json"):
        read_input_rate(bad)
    assert cli.main(["plan", "unet2d-microscopy", "--gpus", "8", "--no-switches", "--input-rate", str(bad)]) == 2
    # the report of another dataset's input path: refused, naming both (it planned with it before)
    assert report["data"] == "burn-blobs"
    capsys.readouterr()
    assert cli.main(["plan", "unet2d-microscopy", "--gpus", "8", "--no-switches", "--input-rate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'burn-blobs' input path of unet2d-microscopy" in err and "'microscopy'" in err, err


@pytest.mark.parametrize("extra,needle", [
    (["--variant", "data.cache=none"], "--variant data.cache=none: the cache modes are --cache's"),
    (["--variant", "data.loader=threads,data.cache=ram"], "the cache modes are --cache's"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--cache", "none,ramm"], "--cache: unknown ramm"),
])
def test_a_bad_data_mode_flag_is_named_before_the_output_and_a_variant_cannot_set_the_cache(
        tmp_path, capsys, extra, needle):
    """Before, ``--variant data.cache=none`` was timed with the --cache mode in its place and reported under
    the variant's name (a row claiming ``none`` measured ``ram``), and a bad --rounds / --cache / --variant was
    hidden behind "file exists" when --out held an earlier report."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "unet2d-microscopy-data.json").write_text("{}")  # an earlier report, kept
    argv = ["benchmark", "unet2d-microscopy", "--mode", "data", "--device", "cpu", "--batch-sizes", "4",
            "--steps", "2", "--out", str(out), "--set", "data.name=burn-blobs", "--set", "data.augment={}",
            "--cache", "ram", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert (out / "unet2d-microscopy-data.json").read_text() == "{}"
