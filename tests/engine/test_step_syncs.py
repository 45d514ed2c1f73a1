"""The training step queues its work without a host read, and skips non-finite updates on the device.

On the CPU :class:`fastvision.profiling.syncs.HostSyncDetector` sees every op that makes a CUDA
host wait (value reads, data-dependent shapes), so each task's recipe at a tiny size runs 6
steady-state ``engine.train_step`` calls under it (the GPU test under
``torch.cuda.set_sync_debug_mode("error")`` is the proof where a GPU exists). The skip tests check
the update really is a no-op: weights and optimizer state bit-identical after a NaN step, for each
optimizer kernel (fused, foreach, for-loop, Novograd) and precision.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from fastvision import config, engine
from fastvision.data.synth import load_all
from fastvision.profiling.syncs import HostSyncDetector
from tests.data.test_data_contract import KINDS, RECIPES, _extra

STEP_RECIPES = ["unet2d-microscopy", "unet3d-spleen-fast", "resnet18-imagefolder", "ssd320-small-shapes"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("syncs")


_DATA: dict[str, object] = {}  # each kind's dataset written once per folder: the GPU test runs a recipe 3 times


def _run(recipe, root, *sets):
    kind = RECIPES[recipe][0]
    where = str(root / kind)
    if where not in _DATA:
        _DATA[where] = load_all().get(kind)(root / kind, seed=0, **KINDS[kind])
    data = _DATA[where]
    cfg = config.load(recipe, _extra(recipe, data, "train.log_every=1000", "data.cache=none", *sets))
    return engine.build(cfg, train=True)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", STEP_RECIPES)
def test_steady_state_step_has_no_host_sync(recipe, data_root, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "fvcache"))
    # optim.impl=fused: what auto picks on CUDA (torch's foreach / for-loop Adam read their CPU step
    # counter on the host, harmless on a GPU but indistinguishable here); Novograd is always ours
    run = _run(recipe, data_root, "train.ema_decay=0.9", "train.clip_grad=1.0", "optim.impl=fused")
    batches = itertools.cycle(list(itertools.islice(run.train_loader, 2)))  # the loader runs outside
    run.step.model.train()
    for _ in range(2):  # warm-up: lazy optimizer state, first EMA copy
        engine.train_step(run.step, batches)
    # from here every step runs the same code on one of the two batches: 6 steps run each batch 3 times
    # and cross the end of the schedule's warm-up (one epoch: 3 or 4 steps here, or none)
    with HostSyncDetector(error=False) as d:
        for _ in range(6):
            out = engine.train_step(run.step, batches)
    assert d.events == [], d.report()
    assert float(out.skipped) == 0 and torch.isfinite(out.loss)  # it did train


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
@pytest.mark.parametrize("recipe", STEP_RECIPES)
def test_steady_state_step_has_no_cuda_sync(recipe, amp, data_root, tmp_path, monkeypatch):
    """The same on a GPU, with CUDA's own detector (optim.impl auto: fused), for each precision."""
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "fvcache"))
    run = _run(recipe, data_root, "train.ema_decay=0.9", "train.clip_grad=1.0", "train.device=cuda")
    run.precision = run.step.precision = type(run.precision)(amp, run.device)
    batches = itertools.cycle([run.task.to_device(b, run.device, False)
                               for b in itertools.islice(run.train_loader, 2)])
    run.step.model.train()
    for _ in range(2):
        engine.train_step(run.step, batches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            out = engine.train_step(run.step, batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss)


def test_compile_modes_reach_torch_compile():
    """``train.compile``: false, true (== default) or a mode; torch.compile is lazy (nothing compiles here)."""
    from fastvision.engine import runtime
    from fastvision.errors import ConfigError

    m = torch.nn.Linear(2, 2)
    assert runtime.maybe_compile(m, False) is m
    for mode in (True, "default", "reduce-overhead", "max-autotune"):
        assert isinstance(runtime.maybe_compile(m, mode), torch._dynamo.eval_frame.OptimizedModule)
    with pytest.raises(ConfigError, match="train.compile"):
        runtime.maybe_compile(m, "fast")
    assert config.from_dict({"compile": "reduce-overhead"}, config.TrainConfig).compile == "reduce-overhead"


# ------------------------------------------------------------------------------ the skip
def _tiny_run(tiny_microscopy, *sets):
    over = [f"data.args.path={tiny_microscopy}", "data.args.image_size=[32,32]", "model.args.filters=[4,8,16]",
            "train.device=cpu", "train.batch_size=4", "sched.name=constant", "sched.warmup_epochs=0",
            "train.ema_decay=0.5", *sets]
    cfg = config.load("unet2d-microscopy", [config.parse_override(s) for s in over] + [{"train": {"amp": "off"}}])
    cfg.data.augment = {}  # no random draws: runs compare step for step
    return engine.build(cfg, train=True, loaders=False, data_info={})


def _state(run):
    opt = {f"{i}.{k}": v.clone() for i, s in enumerate(run.step.optimizer.state.values())
           for k, v in s.items() if torch.is_tensor(v)}
    # parameters and buffers: the forward updates BatchNorm's running statistics before any skip
    # is decided (torch's GradScaler skip leaves them so); the step puts them back
    return ({k: v.detach().clone() for k, v in run.model.state_dict().items()}, opt,
            {k: v.clone() for k, v in run.step.ema.state_dict().items()})


def _equal(a, b):
    """Bit-equal, NaN equal to NaN (BatchNorm's running statistics after a NaN forward)."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.allclose(a[k], b[k], rtol=0, atol=0, equal_nan=True)
        if a[k].is_floating_point() else torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("opt, impl", [("adamw", "fused"), ("adamw", "foreach"), ("adam", "loop"),
                                       ("sgd", "fused"), ("sgd", "foreach"), ("sgd", "loop"),
                                       ("novograd", "auto")])
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_non_finite_step_is_a_no_op_on_the_device(opt, impl, amp, tiny_microscopy):
    run = _tiny_run(tiny_microscopy, f"optim.name={opt}", f"optim.impl={impl}", "optim.weight_decay=0.01")
    run.precision = run.step.precision = type(run.precision)(amp, run.device)
    g = torch.Generator().manual_seed(0)
    good = {"image": torch.rand(4, 1, 32, 32, generator=g), "label": (torch.rand(4, 32, 32, generator=g) > 0.5).long()}
    bad = {"image": good["image"].clone(), "label": good["label"]}
    bad["image"][0, 0, 3, 3] = float("nan")
    for first in (True, False):  # a skipped first step (no optimizer state yet) and a later one
        if not first:
            engine.train_step(run.step, iter([good]))
        before = _state(run)
        out = engine.train_step(run.step, iter([bad]))
        assert float(out.skipped) == 1
        after = _state(run)
        assert _equal(before[0], after[0]) and _equal(before[2], after[2])  # weights, EMA
        # optimizer state: unchanged; created by a skipped first step: zeros (a fresh state)
        assert _equal(before[1], {k: v for k, v in after[1].items() if k in before[1]})
        assert all(not v.any() for k, v in after[1].items() if k not in before[1])
    out = engine.train_step(run.step, iter([good]))  # and the next finite step trains
    assert float(out.skipped) == 0 and not _equal(before[0], _state(run)[0])
    assert all(torch.isfinite(v).all() for v in run.model.parameters())


def test_skipped_first_steps_leave_the_run_as_if_they_never_happened(tiny_microscopy):
    """State created by a skipped first step is reset: NaN, then two good steps == two good steps."""
    g = torch.Generator().manual_seed(1)
    good = [{"image": torch.rand(4, 1, 32, 32, generator=g), "label": (torch.rand(4, 32, 32, generator=g) > 0.5).long()}
            for _ in range(2)]
    bad = {"image": torch.full((4, 1, 32, 32), float("nan")), "label": good[0]["label"]}
    for opt in ("adam", "sgd", "novograd"):
        sets = (f"optim.name={opt}", "optim.impl=loop", "sched.name=constant")
        a, b = _tiny_run(tiny_microscopy, *sets), _tiny_run(tiny_microscopy, *sets)
        engine.train_step(a.step, iter([bad]))
        for batch in good:
            engine.train_step(a.step, iter([batch]))
            engine.train_step(b.step, iter([batch]))
        assert _equal(dict(a.model.named_parameters()), dict(b.model.named_parameters())), opt


def test_max_nonfinite_stops_the_run_at_a_log_interval(tiny_microscopy, tmp_path):
    from fastvision.api import run_training

    # 3 steps an epoch: step 1 makes the weights blow up, steps 2-6 are skipped; the streak goes on across the
    # epoch's end, so at the log interval of step 6 it is 5 (it was 3: the epoch's own, reset at its end)
    with pytest.raises(engine.NonFiniteLossError, match="stopping at step 6: 5 consecutive steps skipped"):
        run_training("unet2d-microscopy", out=str(tmp_path / "run"), progress=False, extra=[
            config.parse_override(s) for s in (
                f"data.args.path={tiny_microscopy}", "data.args.image_size=[32,32]", "model.args.filters=[4,8,16]",
                "train.device=cpu", "train.batch_size=4", "optim.lr=1e30", "optim.name=sgd",
                "train.max_nonfinite=3", "train.log_every=3", "train.epochs=2", "examples=0")])
