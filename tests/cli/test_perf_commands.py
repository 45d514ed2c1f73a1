"""The performance commands a user meets after training works (benchmark, plan, profile, tune, monitor):
an option a benchmark mode does not read is refused, not dropped; a report is whole or the file before
(a write the kernel stops at a file-size limit, RLIMIT_FSIZE, keeps the old one); a Ctrl-C (a real SIGINT)
says what was kept; plan --calibrate refuses a benchmark of another model or input size; monitor checks
its numbers before NVML."""
from __future__ import annotations

import contextlib
import errno
import json
import resource
import signal

import pytest

from fastvision import cli
from fastvision.cli import main

TINY_UNET = ["--set", "task.args.sample_shape=[1,32,32]", "--set", "model.args.filters=[4,8,16]"]


def _err_line(capsys) -> str:
    """The one line the command printed to stderr (its log lines, ``fastvision.<module>: ...``, aside)."""
    err = [e for e in capsys.readouterr().err.strip().splitlines() if not e.startswith("fastvision.")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("extra, flag", [
    (["--cache", "ram"], "--cache"),  # train mode timed no cache at all
    (["--variant", "data.cache=ram"], "--variant"),
    (["--rounds", "2"], "--rounds"),
    (["--seeds", "3"], "--seeds"),
    (["--data", "somewhere"], "--data"),
    (["--mode", "inference", "--augment"], "--augment"),
    (["--mode", "data", "--precision", "bf16"], "--precision"),
    (["--mode", "data", "--no-channels-last"], "--channels-last"),
    (["--mode", "data", "--batch-sizes", "2,4"], "--batch-sizes 2,4"),  # data mode timed the first alone
    (["--mode", "target", "--steps", "3"], "--steps"),
    (["--mode", "target", "--precision", "fp32"], "--precision"),
])
def test_benchmark_refuses_an_option_its_mode_does_not_read(tmp_path, capsys, extra, flag):
    out = tmp_path / "bench"
    assert main(["benchmark", "unet2d-microscopy", "--device", "cpu", "--out", str(out), *extra]) == 2
    line = _err_line(capsys)
    assert line.startswith(f"fastvision: error: {flag}") and not out.exists()


def test_benchmark_with_no_precision_this_device_runs_is_refused_before_writing(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["benchmark", "unet2d-microscopy", "--device", "cpu", "--precision", "fp16,tf32",
                 "--out", str(out), *TINY_UNET]) == 2
    line = _err_line(capsys)
    assert "--precision fp16,tf32: nothing to run on cpu" in line and not out.exists()


def test_benchmark_measures_a_setting_named_twice_once():
    from fastvision.benchmark.modes import run_benchmark
    from fastvision.config import load, parse_override

    cfg = load("unet2d-microscopy", [parse_override(s) for s in TINY_UNET[1::2]])
    report = run_benchmark(cfg, "train", [1, 1], ["fp32", "fp32"], steps=1, warmup=0)
    assert [(r["batch_size"], r["precision"]) for r in report["results"]] == [(1, "fp32")]
    assert report["input"] == {"sample_shape": [1, 32, 32]}  # what plan --calibrate checks


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """Regular files this process writes stop at ``nbytes`` (the kernel's EFBIG), as a full quota would."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not the signal that ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, before)


def _stopped_write_keeps(files, argv, limit):
    """``argv`` under a file-size limit of ``limit`` bytes stops at writing ``files`` (over old ones); called with
    ``capsys`` active, so the printed report goes to memory and not to pytest's capture file, which the limit
    would stop first."""
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("old")
    with _file_size_limit(limit), pytest.raises(OSError) as info:  # the command fails: its files may not
        main(argv)
    assert info.value.errno == errno.EFBIG  # stopped at the report's write, not before it
    for f in files:
        assert f.read_text() == "old", f  # not the first `limit` bytes of the new report
    assert not [p.name for p in files[0].parent.iterdir() if p.name.endswith(".tmp")]


def test_a_stopped_benchmark_report_write_keeps_the_report_before(tmp_path, capsys):
    out = tmp_path / "bench"
    files = [out / "unet2d-microscopy-train.json", out / "unet2d-microscopy-train.md"]
    _stopped_write_keeps(files, ["benchmark", "unet2d-microscopy", "--device", "cpu", "--batch-sizes", "1",
                                 "--precision", "fp32", "--steps", "1", "--warmup", "0", "--out", str(out),
                                 "--force", *TINY_UNET], limit=300)


def test_a_stopped_profile_report_write_keeps_the_report_before(tmp_path, capsys):
    out = tmp_path / "prof"
    argv = ["profile", "unet2d-microscopy", "--synthetic", "--steps", "1", "--warmup", "0", "--device", "cpu",
            "--batch-size", "1", "--out", str(out), "--force", *TINY_UNET]
    _stopped_write_keeps([out / "profile.json", out / "profile.txt"], argv, limit=800)


def test_a_stopped_plan_json_write_keeps_the_file_before(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    _stopped_write_keeps([plan], ["plan", "unet2d-microscopy", "--no-switches", "--json", str(plan), "--force",
                                  *TINY_UNET], limit=1000)


def test_plan_refuses_a_png_name_matplotlib_cannot_write_before_the_trace(tmp_path, capsys, monkeypatch):
    from fastvision.planning import plan

    monkeypatch.setattr(plan, "make_plan", lambda *a, **k: pytest.fail("traced before the --png check"))
    assert main(["plan", "unet2d-microscopy", "--json", str(tmp_path / "p.json"), "--png",
                 str(tmp_path / "p.txt")]) == 2
    assert "--png" in _err_line(capsys) and list(tmp_path.iterdir()) == []


def _bench_json(tmp_path, **fields):
    report = {"recipe": "unet2d-microscopy", "mode": "train", "model": "unet2d-seed001", "gpu": "NVIDIA H200",
              "input": {"sample_shape": [1, 128, 128]},
              "results": [{"batch_size": 8, "precision": "bf16", "items_per_s": 400.0},
                          {"batch_size": 32, "precision": "bf16", "items_per_s": 1200.0}]}
    report.update(fields)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("fields, says", [
    ({"model": "resnet50"}, "a benchmark of model resnet50"),
    ({"input": {"sample_shape": [1, 768, 1024]}}, "measured at task.args.sample_shape=[1, 768, 1024]"),
    ({"gpu": "RTX 9090"}, "its 'gpu' field: unknown GPU 'RTX 9090'"),
    ({"results": [["not", "a", "row"]]}, "no measured rows"),
])
def test_calibrate_refuses_a_benchmark_of_another_step_by_name(tmp_path, fields, says):
    from fastvision.errors import DataError
    from fastvision.planning import estimate as est

    path = _bench_json(tmp_path, **fields)
    with pytest.raises(DataError, match="bench.json: ") as info:
        est._read_train_benchmark(path, "unet2d-seed001", {"sample_shape": (1, 128, 128)})
    assert says in str(info.value)
    gpu, rows = est._read_train_benchmark(_bench_json(tmp_path), "unet2d-seed001", {"sample_shape": (1, 128, 128)})
    assert gpu.name == "H200" and len(rows) == 2


def test_calibrate_a_list_is_one_line(tmp_path, capsys):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")  # was AttributeError: 'list' object has no attribute 'get'
    assert main(["plan", "unet2d-microscopy", "--no-switches", "--calibrate", str(path), *TINY_UNET]) == 2
    assert "list.json: needs a train-mode benchmark" in _err_line(capsys)


def test_the_shipped_measurement_is_not_used_at_another_input_size():
    from fastvision.planning import estimate as est
    from fastvision.planning.devices import get_gpu

    h200 = get_gpu("H200")
    assert est.shipped_measurement("resnet50-imagenet", h200, "bf16", True, {"image_size": 224}) is not None
    assert est.shipped_measurement("resnet50-imagenet", h200, "bf16", True, {"image_size": 128}) is None


def _sigint(*_a, **_k):
    signal.raise_signal(signal.SIGINT)  # the real signal: Python's handler raises KeyboardInterrupt here
    pytest.fail("SIGINT did not interrupt")


def test_ctrl_c_in_profile_says_nothing_was_written(tmp_path, capsys, monkeypatch):
    import fastvision.profiling as profiling

    monkeypatch.setattr(profiling, "profile", _sigint)
    out, trace = tmp_path / "prof", tmp_path / "trace"
    assert main(["profile", "unet2d-microscopy", "--out", str(out), "--trace", str(trace)]) == 130
    line = _err_line(capsys)
    assert line.startswith("fastvision: profile interrupted: nothing written") and str(out) in line
    assert str(trace) in line and list(tmp_path.iterdir()) == []


def test_ctrl_c_in_benchmark_says_nothing_was_written(tmp_path, capsys, monkeypatch):
    from fastvision.benchmark import modes

    monkeypatch.setattr(modes, "_measure", _sigint)
    out = tmp_path / "bench"
    assert main(["benchmark", "unet2d-microscopy", "--device", "cpu", "--batch-sizes", "1", "--out", str(out),
                 *TINY_UNET]) == 130
    assert "benchmark interrupted: nothing written" in _err_line(capsys) and not out.exists()


def test_ctrl_c_in_tune_says_nothing_was_written_nor_stored(tmp_path, capsys, monkeypatch, tiny_microscopy):
    from fastvision.planning.tune import cli as tune_cli

    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tune_cli, "run_tune", _sigint)
    out = tmp_path / "t" / "tuned.yaml"
    assert main(["tune", "unet2d-microscopy", "--data", str(tiny_microscopy), "--device", "cpu", "--out", str(out),
                 "--json", str(tmp_path / "t" / "trials.json")]) == 130
    line = _err_line(capsys)
    assert line.startswith("fastvision: tune interrupted: nothing written") and "trials.json" in line
    assert not (tmp_path / "t").exists() and not (tmp_path / "cache").exists()


def test_tune_measures_again_over_an_unreadable_stored_result(tmp_path):
    from fastvision.planning.tune.cli import stored_result

    bad = tmp_path / "k.json"
    bad.write_text('{"chosen": {')  # was json.JSONDecodeError out of the command
    assert stored_result(bad) is None
    bad.write_text("[]")
    assert stored_result(bad) is None


@pytest.mark.parametrize("final, says", [
    (None, "no switch kept, so no final trial ran"),
    ({"kept": False, "ratio": 1.01, "reason": "not faster: +1% vs spread 4%"}, "measured x1.01 the start"),
    ({"kept": True, "ratio": 1.3, "reason": "kept"}, "measured speed-up over the start: x1.30 (final trial"),
])
def test_tune_summary_says_what_the_final_check_measured(final, says):
    from fastvision.planning.tune.report import summary_lines

    result = {"chosen": {"train.amp": "bf16"} if final and final["kept"] else {}, "final": final,
              "speedup": final["ratio"] if final and final["kept"] else 1.0, "untried": [], "budget_s": 60}
    lines = summary_lines(result)
    assert says in lines[1]
    if final is None:
        assert "(final trial" not in "\n".join(lines)  # no final trial was measured
    if final and not final["kept"]:
        assert "did not beat it" in lines[0]


@pytest.mark.parametrize("flag, value, says", [
    ("--interval", "0", "--interval 0: must be > 0"),  # a busy loop on the GPU's NVML
    ("--interval", "-1", "--interval -1: must be > 0"),  # a ValueError at the first sleep
    ("--duration", "0", "--duration 0: must be > 0"),
    ("--gpu", "-1", "--gpu -1: must be >= 0"),
])
def test_monitor_checks_its_numbers_before_nvml(tmp_path, capsys, flag, value, says):
    assert cli.main(["monitor", "--out", str(tmp_path / "gpu.csv"), flag, value]) == 2
    assert _err_line(capsys) == f"fastvision: error: {says}" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("items, gpus, batch, batches", [
    (896, 8, 16, 7), (896, 16, 16, 3),  # 56 a GPU: 3 batches, the last 8 dropped
    (900, 16, 16, 3),  # 3 whole global batches of 256 (768 items), the last 132 dropped
    (32, 16, 4, 1), (32, 64, 2, 1),  # under one global batch (64 ranks: 32 padded to 64): one short step
    (31, 2, 4, 3),  # a padded shard of 16 held a 4th batch with a repeated item; training drops it
])
def test_rank_batches_count_as_the_training_loader_does(items, gpus, batch, batches):
    from fastvision.distributed import TrainSampler
    from fastvision.planning.scale import rank_batches

    assert rank_batches(items, gpus, batch) == batches
    shard = len(TrainSampler(items, num_replicas=gpus, rank=0, batch_size=batch, full_batches=True))
    assert batches == (shard // batch if shard >= batch else 1)  # what the training loader steps


def test_plan_epoch_of_a_small_dataset_on_many_gpus_is_a_step_not_a_fraction_of_one(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "unet2d-microscopy", "--no-switches", "--gpus", "16", "--gpu", "H100-80GB",
                 "--dataset-size", "40", "--batch-size", "4", "--json", str(out), *TINY_UNET]) == 0
    plan = json.loads(out.read_text())
    e = plan["estimate"]
    for scale, epoch in zip(e["scale"], e["epoch_s"], strict=True):  # 40 / 16 -> 3 items a GPU, under 4
        assert epoch == pytest.approx(scale["step_s"])  # was 40 / rate: 0.625 of a step
    assert any("under one global batch of 16 x 4" in n and "at most 3 items" in n for n in plan["notes"])
    assert "a GPU's shard is at most 3 items" in capsys.readouterr().out


@pytest.mark.parametrize("items, gpus, batch, noted", [
    (15, 2, 8, True),  # shards of 8 and 7: the largest equals the batch, still one short step (was no note)
    (16, 2, 8, False), (31, 2, 4, False),  # whole global batches
    (3, 16, 4, True),
])
def test_shard_note_where_an_epoch_is_one_short_step(items, gpus, batch, noted):
    from fastvision.distributed import TrainSampler
    from fastvision.planning.scale import shard_note

    assert (shard_note(items, gpus, batch) is not None) == noted
    # what the training sampler gives the ranks: less than one global batch in all, so one step each
    shards = [len(TrainSampler(items, num_replicas=gpus, rank=r, batch_size=batch, full_batches=True))
              for r in range(gpus)]
    assert noted == (sum(shards) < gpus * batch) and (not noted or max(shards) <= batch)


@pytest.mark.parametrize("extra, says", [
    (["--gpus", "12"], "--gpus 12: not whole nodes of 8 GPUs; pass --nodes N to split them otherwise"),  # 1.5 nodes
    (["--gpus", "12", "--hardware", "dgx-h100"], "--gpus 12: not whole nodes of 8 GPUs (dgx-h100)"),
])
def test_plan_refuses_gpus_that_do_not_fill_whole_nodes(capsys, monkeypatch, extra, says):
    from fastvision.planning import estimate

    monkeypatch.setattr(estimate, "trace", lambda *a, **k: pytest.fail("traced before the node check"))
    assert main(["plan", "unet2d-microscopy", "--no-switches", *extra]) == 2
    assert _err_line(capsys) == f"fastvision: error: {says}"


@pytest.mark.parametrize("extra", [
    ["--out", "x.png"],  # the chart beside it is x.png too: it replaced the tuned recipe
    ["--out", "x.yaml", "--json", "x.yaml"],  # the JSON replaced the recipe
    ["--out", "x.yaml", "--json", "x.png"],  # the JSON replaced the chart
])
def test_tune_refuses_outputs_that_would_write_over_each_other(tmp_path, capsys, monkeypatch, extra):
    from fastvision.planning.tune import cli as tune_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tune_cli, "run_tune", lambda *a, **k: pytest.fail("tuned despite the outputs"))
    assert main(["tune", "unet2d-microscopy", "--device", "cpu", *extra]) == 2
    assert "need three files" in _err_line(capsys) and list(tmp_path.iterdir()) == []


def test_plan_refuses_one_file_for_json_and_png_before_the_trace(tmp_path, capsys, monkeypatch):
    from fastvision.planning import plan

    monkeypatch.setattr(plan, "make_plan", lambda *a, **k: pytest.fail("traced before the output check"))
    same = tmp_path / "plan.png"  # the chart was written over the JSON
    assert main(["plan", "unet2d-microscopy", "--json", str(same), "--png", str(same)]) == 2
    assert "one file for both" in _err_line(capsys) and list(tmp_path.iterdir()) == []
