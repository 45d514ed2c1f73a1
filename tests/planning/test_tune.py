"""``fastvision tune``: the search on a deterministic cost model, dropped switches, parity on the real
step, the CLI end to end (tuned.yaml trains as is, the stored result is reused), bad inputs, and
two ranks under torchrun agreeing."""
from __future__ import annotations

import itertools
import json
import os

import pytest
import yaml

from fastvision import cli, config
from fastvision.planning.tune.search import Comparison, Switch, order, search
from fastvision.planning.tune.trial import TrialRunner
from tests.conftest import ROOT, clean_env, cli_here

TINY = ["--set", "data.args.image_size=[32,32]", "--set", "model.args.filters=[4,8,16]",
        "--set", "train.batch_size=4", "--device", "cpu"]
# pin every switch but the cache (and in a test the workers too): a few trials keep the CLI tests short
PIN = ["--keep", "data.loader", "train.channels_last", "train.compile", "train.amp", "train.cpu_threads",
       "model.args.up", "model.args.drop_bias", "model.args.pad_in"]


# ------------------------------------------------------------------ the search on a stub cost model
COST = {  # seconds per item of each switch value; a setting costs the product (independent switches)
    "data.cache": {"none": 1.0, "ram": 0.5, "disk": 0.7},
    "data.num_workers": {0: 1.0, 2: 0.8, 4: 0.9},
    "train.channels_last": {False: 1.0, True: 1.3},
}


def cost(setting: dict) -> float:
    c = 1.0
    for key, table in COST.items():
        c *= table[setting[key]]
    return c


def stub_measure(incumbent: dict, candidate: dict, switch: Switch) -> Comparison:
    """Five identical rounds of items/s = 1 / cost: no spread."""
    return Comparison(incumbent_rates=[1 / cost(incumbent)] * 5, candidate_rates=[1 / cost(candidate)] * 5,
                      parity={"ok": True, "detail": "stub"})


SWITCHES = [Switch("train.channels_last", (True, False), "numeric", "compute"),
            Switch("data.cache", ("ram", "disk"), "exact", "input"),
            Switch("data.num_workers", (0, 2, 4), "exact", "input")]
START = {"data.cache": "none", "data.num_workers": 0, "train.channels_last": False}


def test_search_on_a_stub_cost_model_picks_the_grid_best():
    grid = [dict(zip(COST, values, strict=True)) for values in itertools.product(*(t.keys() for t in COST.values()))]
    best = min(grid, key=cost)  # brute force over every combination: the independent reference
    result = search(START, order(SWITCHES, "input-bound"), stub_measure, budget_s=1e9)
    assert result.best == best == {"data.cache": "ram", "data.num_workers": 2, "train.channels_last": False}
    # the verdict orders the groups: input switches are tried before compute ones
    assert [t.key for t in result.trials][:2] == ["data.cache", "data.cache"]
    assert result.trials[-1].key == "train.channels_last" and not result.trials[-1].kept
    assert [t.key for t in search(START, order(SWITCHES, "compute-bound"), stub_measure, budget_s=1e9).trials][0] \
        == "train.channels_last"


def test_budget_stops_the_search_and_names_what_it_did_not_try():
    now = [0.0]

    def measure(inc, cand, sw):
        now[0] += 10.0  # every trial takes 10 s on the stub clock
        return stub_measure(inc, cand, sw)

    result = search(START, order(SWITCHES, "input-bound"), measure, budget_s=25.0, clock=lambda: now[0])
    assert len(result.trials) == 2
    assert result.untried == ["data.num_workers=2", "data.num_workers=4", "train.channels_last=True"]


def test_the_budget_decision_is_the_agreed_one_not_this_ranks_clock():
    """Under torchrun a rank whose clock ran past the budget still runs the trials rank 0 runs (and
    one whose clock did not stops where rank 0 stops): otherwise the ranks' collectives mismatch."""
    now = [0.0]

    def measure(inc, cand, sw):
        now[0] += 10.0
        return stub_measure(inc, cand, sw)

    def rank0_within_budget(value):  # rank 0's answer: never over budget; trials pass through
        return False if isinstance(value, bool) else value

    result = search(START, order(SWITCHES, "input-bound"), measure, budget_s=25.0, clock=lambda: now[0],
                    agree=rank0_within_budget)
    assert len(result.trials) == 5 and result.untried == []  # this clock alone would stop after 2 (test above)

    def rank0_over_budget(value):
        return True if isinstance(value, bool) else value

    result = search(START, order(SWITCHES, "input-bound"), measure, budget_s=1e9, agree=rank0_over_budget)
    assert result.trials == [] and len(result.untried) == 5


def test_a_switch_that_raises_is_dropped_with_its_reason_and_the_search_goes_on():
    def measure(inc, cand, sw):
        if cand["data.cache"] == "ram":
            raise RuntimeError("out of memory while caching\nsecond line")
        return stub_measure(inc, cand, sw)

    result = search(START, order(SWITCHES, "input-bound"), measure, budget_s=1e9)
    first = result.trials[0]
    assert (first.key, first.value, first.kept) == ("data.cache", "ram", False)
    assert first.reason == "error: RuntimeError: out of memory while caching"
    assert result.best == {"data.cache": "disk", "data.num_workers": 2, "train.channels_last": False}


def test_not_faster_than_the_spread_is_not_kept():
    def noisy(inc, cand, sw):  # +5 % in the median, but rounds range over +-10 %
        return Comparison(incumbent_rates=[1.0] * 5, candidate_rates=[0.95, 1.05, 1.05, 1.15, 1.25], parity=None)

    result = search(START, [SWITCHES[1]], noisy, budget_s=1e9)
    assert [t.kept for t in result.trials] == [False, False]
    assert result.trials[0].reason.startswith("not faster: +5% vs spread 15%")


# ------------------------------------------------------------------ parity on the real step
def _cfg(data):
    return config.load("unet2d-microscopy", [config.parse_override(s) for s in (
        f"data.args.path={data}", "data.args.image_size=[32,32]", "model.args.filters=[4,8,16]",
        "train.batch_size=4", "train.device=cpu", "data.num_workers=0")])


@pytest.mark.slow
def test_parity_refuses_a_switch_that_changes_the_loss_and_passes_an_exact_one(tiny_microscopy):
    runner = TrialRunner(_cfg(tiny_microscopy), probe=2, rounds=1)
    runner.k = 2
    start = {"data.cache": "none", "optim.lr": 0.003}
    changed = runner.measure(start, {**start, "optim.lr": 0.3}, Switch("optim.lr", (0.3,), "exact", "compute"))
    assert changed.parity["ok"] is False and "exact switch" in changed.parity["detail"]
    same = runner.measure(start, {**start, "data.cache": "ram"}, Switch("data.cache", ("ram",), "exact", "input"))
    assert same.parity["ok"] is True and len(same.candidate_rates) == 1


# ------------------------------------------------------------------ the CLI
# The CLI tests check what tune writes and decides, not its timing: 2 interleaved rounds of about 0.05 s
# per run (tune's --rounds / --round-seconds) instead of the default 5 of 1 s: a few steps a round at
# these tiny steps (tune takes at least 3); each trial still builds both runs, checks parity on the probe
# steps and judges the rounds.
SHORT = ["--rounds", "2", "--round-seconds", "0.05"]


def _tune(data, out, *extra):
    return cli.main(["tune", "unet2d-microscopy", "--data", str(data), "--out", str(out / "tuned.yaml"),
                     "--json", str(out / "trials.json"), "--budget", "90s", *SHORT, *TINY, *PIN, *extra])


@pytest.mark.slow
def test_tune_writes_a_recipe_that_trains_as_is_and_reuses_its_result(tiny_microscopy, tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "t"
    assert _tune(tiny_microscopy, out, "--set", "data.num_workers=0", "--keep", "data.num_workers") == 0
    first = json.loads((out / "trials.json").read_text())
    assert (out / "tuned.png").read_bytes()[:4] == b"\x89PNG"
    assert {t["key"] for t in first["trials"]} == {"data.cache"}
    assert first["verdict"].endswith("-bound") and first["trials"]
    assert first["rounds"] == 2 and 3 <= first["steps_per_round"] <= 30
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert tuned["extends"] == "unet2d-microscopy" and tuned["model"]["args"]["filters"] == [4, 8, 16]
    cfg = config.load(str(out / "tuned.yaml"))
    for key, value in first["chosen"].items():
        assert config.to_dict(cfg)[key.split(".")[0]][key.split(".")[1]] == value
    assert cli.main(["train", str(out / "tuned.yaml"), "--data", str(tiny_microscopy), "--epochs", "1",
                     "--out", str(tmp_path / "run"), "--set", "examples=0"]) == 0
    assert (tmp_path / "run" / "summary.json").is_file()

    # the same recipe, overrides, hardware and data: the stored result, not a new measurement
    again = ["--set", "data.num_workers=0", "--keep", "data.num_workers"]
    assert _tune(tiny_microscopy, out, *again) == 2  # --out exists: refused
    assert "--force" in capsys.readouterr().err
    assert _tune(tiny_microscopy, out, *again, "--force") == 0
    assert json.loads((out / "trials.json").read_text()) == first
    assert "reusing the stored tune result" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--keep", "train.epochs"], "--keep train.epochs: not a speed switch"),
    (["--budget", "5s"], "cannot fit one trial"),
    (["--budget", "soon"], "--budget 'soon'"),
    (["--rounds", "1"], "--rounds 1: a trial needs at least 2 timed rounds"),
    (["--round-seconds", "0"], "--round-seconds 0.0: must be a positive"),
    (["--round-seconds", "inf"], "--round-seconds inf: must be a positive, finite"),  # was a traceback
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tiny_microscopy, tmp_path, capsys, extra, message):
    out = tmp_path / "t"
    assert _tune(tiny_microscopy, out, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_missing_data_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    out = tmp_path / "t"
    assert _tune(tmp_path / "nowhere", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere" in err[0] and "not found" in err[0]
    assert not out.exists()


def test_nproc_beyond_this_machine_is_one_line_before_any_worker_starts(tmp_path, capsys):
    """``tune --nproc`` is checked as ``train --nproc`` is (before, 0 tuned one process silently and 99 on a
    2-core machine started 99 torch workers): refused before the data folder is even looked at."""
    from fastvision.utils.hostcpu import process_cores

    for n, message in ((0, "--nproc 0: must be >= 1"), (len(process_cores()) + 1, "more workers than this machine")):
        out = tmp_path / "t"
        assert _tune(tmp_path / "nowhere", out, "--nproc", str(n)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not out.exists()


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_run_the_same_trials_and_agree(tiny_microscopy, tmp_path, monkeypatch, capfd):
    """``tune --nproc 2`` through ``fastvision.cli.main`` in this process, in the environment
    :func:`clean_env` gives a subprocess: it starts the real torchrun and its two ranks, as the CLI's own
    process would (a process of its own would only import torch to start them); ``capfd`` reads what
    the ranks print."""
    from tests.distributed.test_dist import time_limit

    out = tmp_path / "t"
    clean = clean_env(FASTVISION_CACHE=str(tmp_path / "cache"))
    for key in set(os.environ) - set(clean):
        monkeypatch.delenv(key)
    for key, value in clean.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    argv = ["tune", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(out / "tuned.yaml"),
            "--json", str(out / "trials.json"), "--budget", "30s", "--nproc", "2",
            *SHORT, *TINY, *PIN, "--keep", "data.num_workers", "train.ddp_bucket_mb", "train.ddp_comm_hook",
            "--set", "train.batch_size=2"]
    capfd.readouterr()
    with time_limit(600):
        rc = cli_here(argv)
    stdout, stderr = capfd.readouterr()
    assert rc == 0, stderr[-3000:]
    result = json.loads((out / "trials.json").read_text())
    assert result["hardware"]["world_size"] == 2
    assert result["rounds"] == 2  # the ranks ran --rounds 2
    assert [t["key"] for t in result["trials"]] == ["data.cache"] * len(result["trials"]) and result["trials"]
    ranks = result["rank_settings"]
    assert len(ranks) == 2 and ranks[0] == ranks[1]  # every rank ends on rank 0's choice
    assert stdout.count("wrote ") == 3  # rank 0 alone writes


def test_allow_batch_adds_the_batch_switch_and_says_the_lr_rule_in_one_line():
    import torch

    from fastvision.planning.tune.switches import catalogue, lr_line

    cfg = config.load("unet2d-microscopy")  # batch 16, optim.lr 0.003 at ref_batch 16
    keys = lambda allow: {s.key: s for s in catalogue(cfg, torch.device("cpu"), 1, allow)}  # noqa: E731
    assert "train.batch_size" not in keys(False)
    batch = keys(True)["train.batch_size"]
    assert (batch.values, batch.kind) == ((32, 64), "batch")
    line = lr_line(cfg, 32, 1, 1)
    assert "\n" not in line and "= 0.006 at global batch 32" in line  # 0.003 x 32 / 16
    cfg.optim.ref_batch = None
    assert "optim.lr stays 0.003" in lr_line(cfg, 32, 1, 1)


def test_the_cache_switch_never_offers_smart_nor_leaves_a_smart_window():
    """Cache tiers are exact switches (they serve the sampler's items); a smart window smaller than
    the set trains on other samples, so tune neither tries it nor switches away from it."""
    import torch

    from fastvision.planning.tune.switches import catalogue

    cfg = config.load("unet2d-microscopy")
    cache = {s.key: s for s in catalogue(cfg, torch.device("cpu"), 2, False)}["data.cache"]
    assert cache.kind == "exact" and "smart" not in cache.values and "shared" in cache.values
    cfg.data.cache, cfg.data.cache_num = "smart", 64
    assert "data.cache" not in {s.key for s in catalogue(cfg, torch.device("cpu"), 1, False)}
    cfg.data.cache_num = None  # MONAI's default window: the whole set, served as uncached
    assert "data.cache" in {s.key for s in catalogue(cfg, torch.device("cpu"), 1, False)}


@pytest.mark.parametrize("bf16", [True, False])
def test_cuda_catalogue_tries_fp16_after_bf16(monkeypatch, bf16):
    """On CUDA the precision switch offers bf16 then fp16 (fp16 convolutions measured 1.13-1.30x bf16 on
    an H200), fp16 alone where the GPU has no bf16; the GPU-only switches follow. The capability query
    is the one hardware fact patched: the catalogue makes no other CUDA call."""
    import torch

    from fastvision.planning.tune.switches import catalogue

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    cfg = config.load("unet2d-microscopy")
    switches = catalogue(cfg, torch.device("cuda"), 1, False)
    amp = [s for s in switches if s.key == "train.amp"]
    assert len(amp) == 1 and amp[0].kind == "numeric"
    assert amp[0].values == (("bf16", "fp16") if bf16 else ("fp16",))
    assert ("train.tf32", (True,)) in [(s.key, s.values) for s in switches]
    assert "train.cpu_threads" not in {s.key for s in switches}


def test_an_auto_start_offers_the_counts_around_its_resolved_number():
    """``data.num_workers: auto`` stays the start; the number it resolves to here is not tried again."""
    import os

    import torch

    from fastvision.planning.tune.switches import catalogue

    cfg = config.load("unet2d-microscopy", [{"data": {"num_workers": "auto"}}])
    workers = lambda auto: {s.key: s for s in catalogue(cfg, torch.device("cpu"), 1, False, auto)}[  # noqa: E731
        "data.num_workers"].values
    every = tuple(n for n in (0, 2, 4, 8) if n <= max(2, 2 * len(os.sched_getaffinity(0))))
    assert workers(2) == tuple(n for n in every if n != 2) and workers(None) == every


@pytest.mark.slow
def test_tune_from_auto_workers_keeps_auto_as_the_start(tiny_microscopy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "t"
    assert _tune(tiny_microscopy, out, "--set", "data.num_workers=auto", "--set", "train.cpu_threads=1",
                 "--keep", "data.cache") == 0
    report = json.loads((out / "trials.json").read_text())
    resolved = [x for x in capsys.readouterr().err.splitlines() if "data.num_workers auto:" in x]
    auto = int(resolved[0].split("auto: ")[1].split(" ")[0])  # the first: tune's own, before any trial
    tried = [t["value"] for t in report["trials"] if t["key"] == "data.num_workers"]
    assert report["start"]["data.num_workers"] == "auto" and tried and auto not in tried
    assert all(isinstance(v, int) for v in tried)
    chosen = report["chosen"].get("data.num_workers", "auto")
    assert yaml.safe_load((out / "tuned.yaml").read_text()).get("data", {}).get("num_workers", "auto") == chosen


def test_a_shard_set_at_a_url_is_fingerprinted_by_its_index_not_refused_as_a_missing_folder(tmp_path):
    """``tune --data http://host/set`` took the URL for a folder (``http:/host/set: dataset folder not found``)
    though train reads it; its stored result is keyed by the index, so a rewritten set is measured again."""
    from fastvision.data.shards.writer import write_shards
    from fastvision.data.synth import load_all
    from fastvision.planning.tune.cli import data_fingerprint
    from tests.data.test_shards_http import serve

    site, make, prints = tmp_path / "site", load_all().get("imagenet"), []
    for seed in (0, 1):
        src = make(tmp_path / f"src{seed}", seed=seed, classes=2, per_class=4, val_per_class=1, size=32)
        for old in site.glob("*"):
            old.unlink()
        write_shards(src, site, "14KB")
        with serve(site) as url:
            cfg = config.load("resnet18-imagefolder", [{"data": {"args": {"path": f"{url}/"}}}])
            prints.append(data_fingerprint(cfg))
            assert data_fingerprint(config.load("resnet18-imagefolder", [{"data": {"args": {"path": url}}}])) \
                == prints[-1]
    assert prints[0] != prints[1]


def test_dali_decoding_is_not_a_candidate_for_a_shard_set_which_the_builder_reads_with_pillow_only(tmp_path,
                                                                                                  monkeypatch):
    """Where DALI is installed, tune offered data.args.backend=dali for a shard set too: a trial of the budget
    spent on a build that refuses it ("shard sets are read by the pillow backend")."""
    import torch

    from fastvision.data.shards.writer import write_shards
    from fastvision.data.synth import load_all
    from fastvision.errors import ConfigError
    from fastvision.planning.tune import switches
    from fastvision.registry import DATASETS

    src = load_all().get("imagenet")(tmp_path / "src", classes=2, per_class=2, val_per_class=1, size=32)
    write_shards(src, tmp_path / "sh", "1MB")
    monkeypatch.setattr(switches, "_has_dali", lambda: True)
    keys = lambda path: {s.key for s in switches.catalogue(  # noqa: E731
        config.load("resnet18-imagefolder", [{"data": {"args": {"path": str(path)}}}]), torch.device("cpu"), 1, False)}
    assert "data.args.backend" in keys(src) and "data.args.backend" not in keys(tmp_path / "sh")
    with pytest.raises(ConfigError, match="pillow backend"):  # what the trial would have met
        DATASETS.build("imagefolder", {"path": str(tmp_path / "sh"), "backend": "dali"})


def test_the_charts_title_fits_inside_the_figure_with_few_trials(tmp_path):
    """The one-line title of a chart of the start and two trials (a 5-inch figure) ran past its right edge."""
    from fastvision.planning.tune.report import chart

    trial = {"key": "train.channels_last", "value": True, "items_per_s": 8.6, "ratio": 1.6, "kept": False,
             "reason": "not faster"}
    result = {"recipe": "resnet18-imagefolder", "baseline": {"items_per_s": 4.5}, "trials": [trial],
              "final": {**trial, "key": "final", "value": "tuned vs start"}}
    fig = chart(result, tmp_path / "t.png")
    renderer = fig.canvas.get_renderer()
    box, frame = fig.axes[0].title.get_window_extent(renderer), fig.bbox
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
