"""``fastvision tune`` and the model levers of issue 40, and the switch classes by what they do to
the numbers: which levers a recipe offers, the start read from the model's defaults, channels-last
bringing the layout-keeping norm along, ``train.cpu_threads`` as a numeric switch that the parity
rule now lets through (a microscopy start's step-2 loss 1.7187 vs 1.71873), and the levers' parity
on the real step."""
from __future__ import annotations

import pytest
import torch

from fastvision import config
from fastvision.planning.tune.search import Comparison, Switch, search
from fastvision.planning.tune.switches import SWITCH_KEYS, catalogue, current, implied
from fastvision.planning.tune.trial import TrialRunner, parity

CPU = torch.device("cpu")


def _switches(recipe: str, *sets: str) -> dict[str, Switch]:
    recipe, *more = recipe.split(" --set ")
    cfg = config.load(recipe, [config.parse_override(s) for s in (*more, *sets)])
    return {s.key: s for s in catalogue(cfg, CPU, 1, False)}


@pytest.mark.parametrize("recipe,offered", [
    ("unet3d-brats", {"model.args.norm": ("instance_cl",), "model.args.up": ("shuffle",),
                      "model.args.pad_in": (8,)}),  # 4 MR channels: already a multiple of 4
    ("unet2d-microscopy", {"model.args.up": ("shuffle",), "model.args.drop_bias": (True,),
                           "model.args.pad_in": (4, 8)}),
    ("unet3d-spleen-fast", {"model.args.drop_bias": (True,), "model.args.pad_in": (4, 8)}),  # 3x3 up-convs: no shuffle
    ("resnet18-imagefolder", {"model.args.pad_in": (4, 8)}),
    ("resnet18-imagefolder --set model.args.in_channels=8", {}),
])
def test_each_recipe_offers_the_levers_its_model_takes(recipe, offered):
    switches = _switches(recipe)
    got = {k: s.values for k, s in switches.items() if k.startswith("model.args.")}
    assert got == offered
    assert all(switches[k].kind == "numeric" and switches[k].group == "compute" for k in got)
    assert set(got) <= set(SWITCH_KEYS)  # --keep accepts them


def test_a_lever_already_set_is_not_offered_and_the_start_reads_the_models_defaults():
    assert "model.args.norm" not in _switches("unet3d-brats", "model.args.norm=instance_cl")
    assert "model.args.up" not in _switches("unet3d-brats", "model.args.up=shuffle")
    assert "model.args.pad_in" not in _switches("unet3d-brats", "model.args.pad_in=8")
    cfg = config.load("unet3d-brats")  # the recipe sets neither: the model's own defaults are the start
    assert current(cfg, ["model.args.norm", "model.args.up"]) == {"model.args.norm": "instance",
                                                                   "model.args.up": "transpose"}


def test_channels_last_brings_the_layout_keeping_norm_along_and_the_trial_says_so():
    cl = Switch("train.channels_last", (True, False), "numeric", "compute")
    start = {"train.channels_last": False, "model.args.norm": "instance"}
    assert implied({**start, "train.channels_last": True}, cl)["model.args.norm"] == "instance_cl"
    assert implied({**start, "train.channels_last": False}, cl) == start  # back to NCDHW: nothing implied
    assert "model.args.norm" not in implied({"train.channels_last": True}, cl)  # the norm pinned by --keep
    seen = []

    def measure(inc, cand, sw):
        seen.append(cand)
        return Comparison(incumbent_rates=[1.0] * 3, candidate_rates=[1.5] * 3, parity={"ok": True, "detail": ""})

    result = search(start, [cl, Switch("model.args.norm", ("instance_cl",), "numeric", "compute")], measure,
                    budget_s=1e9, expand=implied)
    assert seen[0] == {"train.channels_last": True, "model.args.norm": "instance_cl"}
    assert result.trials[0].implies == {"model.args.norm": "instance_cl"} and result.trials[0].kept
    assert len(result.trials) == 1  # the norm switch's value is the incumbent's by then: not tried again
    assert result.best == {"train.channels_last": True, "model.args.norm": "instance_cl"}


def test_cpu_threads_is_numeric_and_a_faster_thread_count_within_tolerance_is_kept():
    """The issue's case: another thread count gave step 2's loss 1.71873 for 1.7187 (relative 1.7e-5,
    beyond the exact rule's 1e-5), and tune refused a 1.43x faster setting. Classed numeric, the same
    losses pass and the faster setting is kept; the exact rule would still refuse them."""
    threads = _switches("unet2d-microscopy").get("train.cpu_threads")
    if threads is None:  # one core and torch already on it: no other count to try
        pytest.skip("no other CPU thread count on this machine")
    assert threads.kind == "numeric"
    ref, cand = [1.9012, 1.71873, 1.6021], [1.9012, 1.7187, 1.60212]
    assert parity("exact", ref, cand)["ok"] is False
    assert parity(threads.kind, ref, cand)["ok"] is True

    def measure(inc, cnd, sw):
        return Comparison(incumbent_rates=[1.0, 1.0, 1.0], candidate_rates=[1.42, 1.43, 1.44],
                          parity=parity(sw.kind, ref, cand))

    value = threads.values[0]
    result = search({"train.cpu_threads": None}, [threads], measure, budget_s=1e9)
    assert result.trials[0].kept and result.best["train.cpu_threads"] == value
    assert result.trials[0].reason.startswith("kept: +43%")


@pytest.mark.slow
def test_the_levers_pass_parity_on_the_real_step(tiny_microscopy):
    """Both seed-001 levers at once, built and stepped by the engine: the probe losses agree with the
    stock model's to well inside the numeric tolerance (same initial weights, same batches)."""
    cfg = config.load("unet2d-microscopy", [config.parse_override(s) for s in (
        f"data.args.path={tiny_microscopy}", "data.args.image_size=[32,32]", "model.args.filters=[4,8,16]",
        "train.batch_size=4", "train.device=cpu", "data.num_workers=0")])
    runner = TrialRunner(cfg, probe=3, rounds=1)
    runner.k = 2
    start = current(cfg, ["model.args.up", "model.args.drop_bias"])
    assert start == {"model.args.up": "transpose", "model.args.drop_bias": False}
    comp = runner.measure(start, {"model.args.up": "shuffle", "model.args.drop_bias": True},
                          Switch("model.args.up", ("shuffle",), "numeric", "compute"))
    assert comp.error is None and comp.parity["ok"], comp.parity
    worst = float(comp.parity["detail"].split("within ")[1].split()[0])
    assert worst < 1e-4  # rounding, not a different model
