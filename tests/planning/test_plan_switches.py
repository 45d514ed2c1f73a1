"""`fastvision plan`'s switches: every row names `--set` overrides that exist (parsed and loaded
through the config, `args` keys checked against the registered builder), and the activation
checkpointing row traces what `train.activation_checkpointing` runs."""
from __future__ import annotations

import pytest
import torch

from fastvision import config
from fastvision.planning import estimate as est
from fastvision.planning.peak import measured_peak
from fastvision.planning.plan import Cluster, Workload, make_plan
from fastvision.planning.plan_report import text_report
from fastvision.registry import DATASETS, TASKS, check_kwargs


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _check_override(recipe: str, text: str) -> None:
    """Load ``--set text`` over the recipe: the key must exist and end up holding the value."""
    over = config.parse_override(text)
    cfg = config.load(recipe, [over])  # unknown dataclass keys raise ConfigError
    check_kwargs(TASKS.get(cfg.task.name), cfg.task.args, "task.args")
    check_kwargs(DATASETS.get(cfg.data.name), cfg.data.args, "data.args")
    key, raw = text.split("=", 1)
    assert _get(cfg, key) == config.parse_override(f"x={raw}")["x"], text


@pytest.mark.slow
def test_every_switch_plan_names_is_a_set_that_loads():
    recipe = "unet2d-microscopy"
    plan = make_plan(config.load(recipe), Cluster(gpu="A100-80GB"), Workload(dataset_size=64))
    rows = {s["switch"]: s for s in plan["switches"]}
    assert len(rows) == 4
    ck = rows["activation checkpointing on"]
    assert ck["set"] == ["train.activation_checkpointing=true"]
    assert ck["memory_gib"] < plan["estimate"]["memory_gib"]
    printed = []  # what the table tells the user to pass: "  [--set a=1 --set b=2]" ending each row
    for line in text_report(plan).splitlines():
        if line.endswith("]") and "  [--set " in line:
            printed += line.rsplit("  [", 1)[1][:-1].replace("--set ", "").split()
    assert sorted(printed) == sorted(t for s in plan["switches"] for t in s["set"])
    for text in printed:
        _check_override(recipe, text)


@pytest.mark.parametrize("recipe", ["unet3d-brats", "unet2d-microscopy", "resnet18-pathology", "ssd320-coco"])
def test_input_size_switch_sets_the_task_and_the_data(recipe):
    """The smaller-input row's overrides, loaded over the recipe, give the config it traced."""
    cfg = config.load(recipe)
    small, _, sets = est.with_input_scale(cfg, 0.75)
    for text in sets:
        _check_override(recipe, text)
    loaded = config.load(recipe, [config.parse_override(t) for t in sets])
    assert loaded.task.args == small.task.args and loaded.data.args == small.data.args
    assert len(sets) == 2  # the task's size (what the trace feeds) and the dataset's (what trains)


def test_recipe_setting_is_traced():
    """The estimate follows the recipe's switch: same trace as asking for it explicitly, less memory."""
    cfg = config.load("unet2d-microscopy", [{"train": {"activation_checkpointing": ["decoders"]}}])
    on = est.trace(cfg, 4)
    assert on.peak_bytes == est.trace(cfg, 4, checkpointing=["decoders.0", "decoders.1", "decoders.2",
                                                             "decoders.3"]).peak_bytes
    assert on.peak_bytes < est.trace(cfg, 4, checkpointing=False).peak_bytes


@pytest.mark.slow
def test_estimate_with_checkpointing_matches_the_measured_peak():
    """Plan's traced peak (no workspace margin) with the switch on vs the allocator's peak of the
    run the engine builds with it: within 15 % (2.4 % when written); the estimate without the
    switch would miss it by more."""
    cfg = config.load("unet2d-microscopy", [{"train": {"activation_checkpointing": True}}])
    measured = measured_peak(cfg, 2, torch.device("cpu"))  # the measurement benchmarks/plan_memory.py makes
    assert abs(est.trace(cfg, 2).peak_bytes / measured - 1) < 0.15
    assert est.trace(cfg, 2, checkpointing=False).peak_bytes > 1.15 * measured


@pytest.mark.slow
def test_a_host_bound_jpeg_recipe_is_told_to_decode_on_the_gpu(trace_memo):
    """resnet50-imagenet decodes JPEGs with Pillow on the host: on a DGX H100 (112 cores, 8 GPUs) at the
    published 130 img/s per core that caps a GPU at 14 x 130 = 1,820 img/s, below its GPU-side rate. The
    planner's first switch is then DALI's GPU decode: its `--set` loads, and its row is the same step
    without the host cap (the GPU-side rate the base row reports). A recipe already on DALI gets no row.

    The DALI plan traces the steps the Pillow plan traced (a trace reads the model, task, loss, optimizer
    and train settings, never ``data``: ``build_components`` without ``train``), so each distinct step is
    traced once, for real, and the second plan reuses it (~1-2 s of CPU a ResNet-50 trace)."""
    trace_memo({}, drop=("data",))
    recipe = "resnet50-imagenet"
    cfg = config.load(recipe)
    plan = make_plan(cfg, Cluster(gpus=64, hardware="dgx-h100"))
    base, first = plan["estimate"], plan["switches"][0]
    assert [s["limit"] for s in base["scale"]] == ["input pipeline"] * 2
    assert [s["items_per_s_gpu"] for s in base["scale"]] == pytest.approx([112 * 130.03125 / 8] * 2)
    assert first["switch"] == "decode on the GPU (DALI)" and first["set"] == ["data.args.backend=dali"]
    for text in first["set"]:
        _check_override(recipe, text)
    assert [s["items_per_s_gpu"] for s in first["scale"]] == pytest.approx(
        [s["gpu_items_per_s_gpu"] for s in base["scale"]])
    assert first["change"] < -0.4 and first["memory_gib"] == base["memory_gib"]
    assert all(s["change"] == pytest.approx(0, abs=0.005) for s in plan["switches"][1:])  # nothing else helps
    dali = config.load(recipe, [config.parse_override("data.args.backend=dali")])
    dali_plan = make_plan(dali, Cluster(gpus=64, hardware="dgx-h100"))  # the Pillow plan's traced steps
    assert "decode on the GPU (DALI)" not in {s["switch"] for s in dali_plan["switches"]}


@pytest.mark.parametrize("start,sets", [([], ["data.args.backend=dali"]),
                                        (["data.args.backend=dali", "data.args.dali_device=cpu"],
                                         ["data.args.dali_device=gpu"])])
def test_the_gpu_decode_rows_overrides_give_the_config_it_planned(start, sets):
    """Pillow, or DALI on the CPU: the row's `--set`s, loaded over the recipe, are the config it traced."""
    from fastvision.planning.plan import _gpu_input_switch

    recipe = "resnet50-imagenet"
    cfg = config.load(recipe, [config.parse_override(t) for t in start])
    _, got, planned = _gpu_input_switch(cfg)
    assert got == sets
    loaded = config.load(recipe, [config.parse_override(t) for t in start + got])
    assert loaded.data.args == planned.data.args and loaded.data.args["backend"] == "dali"
