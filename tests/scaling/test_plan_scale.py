"""`fastvision plan RECIPE --gpus N` answering with the at-scale model: throughput, binding limit,
the input path as a limit, `--min-efficiency`, and bad input (one line, exit 2)."""
from __future__ import annotations

import json
import re

import pytest

from fastvision.cli import main
from fastvision.scaling.simulator import load_hardware
from fastvision.scaling.validation import fitted

PLAN = ["plan", "resnet18-imagefolder", "--no-switches", "--hardware", "dgx-h100"]


def test_plan_gpus_with_a_binding_input_path_and_min_efficiency_on_the_cli(tmp_path, capsys):
    out = tmp_path / "plan.json"
    # 1 item/s per host core: the host path binds at every GPU count, so every figure is hand-computable.
    # The CLI in this process (what it prints and writes is checked, not process behaviour): no
    # interpreter and torch import of its own.
    rc = main([*PLAN, "--gpus", "64", "--input-rate", "1", "--min-efficiency", "0.5", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"binding limit\s+input pipeline\n", stdout)
    assert re.search(r"largest N at >= 50% efficiency\s+2\n", stdout)
    plan = json.loads(out.read_text())
    cores = load_hardware("dgx-h100").cpu_cores  # 112 on a DGX H100
    for s in plan["estimate"]["scale"]:
        # 8 GPUs on a node share 112 cores at 1 item/s each; one GPU alone gets all 112
        assert s["items_per_s_gpu"] == pytest.approx(cores / 8)
        assert s["items_per_s"] == pytest.approx(64 * cores / 8)
        assert s["efficiency"] == pytest.approx(1 / 8)
        assert s["limit"] == "input pipeline"
        # to feed the GPU-side rate it needs that many 1-item/s cores; it has 112 / 8 = 14
        assert s["cores_per_gpu"] == pytest.approx(s["gpu_items_per_s_gpu"] / 1.0)
        assert s["cores_per_gpu"] > s["cores_available_per_gpu"]
        assert s["cores_available_per_gpu"] == pytest.approx(cores / 8)
    # 2 GPUs: 56 per GPU = 50 %; 4 GPUs: 28 = 25 %: the largest count at >= 50 % is 2
    assert plan["largest_gpus"] == [2, 2] and plan["min_efficiency"] == 0.5


def test_plan_without_an_input_limit_names_the_fabric_and_has_no_largest_line(capsys):
    # DALI on the GPU: no host limit; the answer is the GPU step, stragglers and the all-reduce
    assert main([*PLAN, "--gpus", "16", "--set", "data.args.backend=dali", "--set", "data.args.dali_device=gpu"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"input path\s+DALI decodes on the GPU: no host limit", text)
    assert "items/s on 16 GPUs" in text and "largest N" not in text
    # torchvision's nvJPEG backend decodes on the GPU too; its host side is bytes and crop draws
    assert main([*PLAN, "--gpus", "16", "--set", "data.args.backend=nvjpeg"]) == 0
    assert re.search(r"input path\s+nvJPEG \(torchvision\) decodes on the GPU: no host limit", capsys.readouterr().out)
    # the fixed per-step cost is the one fitted on the PyTorch DDP implementation (fastvision's own kind)
    fixed = fitted()["overhead_ms"]["mlperf-retinanet-pytorch"]
    assert f"+ {fixed:.2f} ms per step fixed, fitted on MLPerf RetinaNet, PyTorch DDP" in text


@pytest.mark.parametrize("args,needle", [
    (["--gpus", "0"], "--gpus 0"),
    (["--gpus", "-8"], "--gpus -8"),
    (["--gpus", "16", "--nodes", "3"], "--nodes 3"),
    (["--min-efficiency", "0"], "--min-efficiency 0.0"),
    (["--min-efficiency", "1.5"], "--min-efficiency 1.5"),
    (["--input-rate", "-3"], "--input-rate -3.0"),
    (["--set", "data.args.backnd=dali"], "unknown key data.args.backnd"),  # no dataset is built: checked anyway
])
def test_bad_input_is_one_line_exit_2(args, needle, capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main([*PLAN, *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and err.startswith("fastvision: error:")
    assert "None" not in err  # an option not given is not named
    assert not out.exists()  # nothing half-written


def test_scale_simulate_draws_1_to_n_with_the_published_points(tmp_path):
    out = tmp_path / "sim"
    args = ["scale", "--simulate", "--compute-ms", "55.87", "--batch", "400", "--grad-mb", "51.2", "--overhead-ms",
            "2.97", "--hardware", "dgx-h100", "--dali", "--sync", "horovod-mlperf", "--gpus", "3584", "--jitter-ms",
            "0.5", "--anchors", "resnet50", "--out", str(out)]
    assert main(args) == 0
    rows = json.loads((out / "simulation.json").read_text())["rows"]
    assert [r["workers"] for r in rows][:3] == [1, 2, 4] and rows[-1]["workers"] == 3584
    # the stragglers term: 0.5 ms x sqrt(2 ln 3584) (hand-computed: 2.0259 ms)
    assert rows[-1]["straggler_s"] * 1e3 == pytest.approx(0.5 * (2 * 8.18423) ** 0.5, rel=1e-4)
    assert (out / "simulation.png").stat().st_size > 0


@pytest.mark.parametrize("extra,needle", [(["--gpus", "0"], "--gpus 0"), (["--jitter-ms", "-1"], "--jitter-ms -1"),
                                          (["--anchors", "no-such-workload"], "--anchors 'no-such-workload'")])
def test_scale_simulate_bad_input_is_one_line_exit_2(extra, needle, tmp_path, capsys):
    args = ["scale", "--simulate", "--compute-ms", "50", "--batch", "64", "--grad-mb", "51.2", "--hardware",
            "dgx-h100", "--out", str(tmp_path / "sim"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err
    assert not (tmp_path / "sim" / "simulation.json").exists()
