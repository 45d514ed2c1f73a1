"""The non-finite guard (engine/guard.py) and the skipped step it relies on.

A forced non-finite loss comes from the registered test model ``probe`` (BatchNorm on the input, a
1x1 convolution), whose ``nonfinite_steps`` make the listed training forward calls NaN: the real
engine, the real CLI, no mock. References: the items at a step come from the epoch's permutation
(``TrainSampler``, seed 0) and the dataset's own ids; BatchNorm's running statistics are computed
by hand from the good batches (momentum 0.1, unbiased variance).
"""
from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fastvision import config, engine
from fastvision.distributed.samplers import TrainSampler
from fastvision.registry import DATASETS
from tests.conftest import ROOT, clean_env, cli_here, communicate_all, free_port

TINY = ["--device", "cpu", "--batch-size", "2", "--set", "data.args.image_size=[32,32]", "--set", "data.num_workers=0",
        "--set", "examples=0", "--set", "train.log_every=1", "--set", "model.name=probe",
        "--set", "sched.name=constant", "--set", "sched.warmup_epochs=0", "--set", "train.max_nonfinite=3"]


def _train(capfd, data: Path, out: Path, *more: str) -> subprocess.CompletedProcess:
    """``fastvision train`` in this process (what is tested is the guard and the CLI's exit status and
    messages, not a process of its own): its return code and what it wrote to stderr."""
    argv = ["train", "unet2d-microscopy", "--data", str(data), "--out", str(out), "--epochs", "2", *TINY, *more]
    capfd.readouterr()
    rc = cli_here(argv)
    return subprocess.CompletedProcess(argv, rc, "", capfd.readouterr().err)


def _items_at(data: Path, step: int, batch: int = 2) -> list[str]:
    """The ids of the training items step ``step`` (1-based) of epoch 0 reads: the permutation's
    positions [(step-1)*batch, step*batch) (one rank, seed 0)."""
    cfg = config.load("unet2d-microscopy", [{"data": {"args": {"path": str(data), "image_size": [32, 32]}}}])
    train = DATASETS.build(cfg.data.name, cfg.data.args, where="data.args").train
    sampler = TrainSampler(len(train), num_replicas=1, rank=0, seed=cfg.train.seed)
    sampler.set_epoch(0)
    return [train[i]["id"] for i in list(sampler)[(step - 1) * batch: step * batch]]


@pytest.mark.parametrize("action, factor", [("rollback_lower_lr", 0.5), ("rollback", 1.0)])
def test_a_forced_nonfinite_streak_rolls_back_and_names_the_items(action, factor, tiny_microscopy, tmp_path, capfd):
    """Steps 4-6 NaN, max_nonfinite 3, a checkpoint every 2 steps, an EMA: at step 6 the run rolls
    back to step 2's checkpoint (step 4's was written during the streak: not healthy), lowers the
    learning rate or not, and finishes with finite weights."""
    out = tmp_path / "run"
    res = _train(capfd, tiny_microscopy, out, "--set", "model.args.nonfinite_steps=[4,5,6]",
                 "--set", "train.checkpoint_every=2", "--set", f"train.on_nonfinite={action}",
                 "--set", "train.ema_decay=0.9")
    assert res.returncode == 0, res.stderr[-3000:]
    lowered = r", learning rate x0\.5" if factor != 1 else ""
    assert re.search(r"step 6: 3 consecutive steps skipped .*rolled back to \S*rollback\.pt \(step 2\)"
                     + lowered + "; continuing", res.stderr), res.stderr[-3000:]
    for step in (4, 5, 6):
        items = ", ".join(_items_at(tiny_microscopy, step))
        assert f"step {step} (non-finite loss; items {items})" in res.stderr, res.stderr[-3000:]
    last = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    for weights in (last["model"], last["eval_model"]):
        assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    assert last["step"] == 12  # 13 items, batch 2: 6 steps an epoch; the run went on after the rollback
    lr = config.load("unet2d-microscopy").optim.lr * 2 / 16  # linear scaling to batch 2 (ref_batch 16)
    assert last["optimizer"]["param_groups"][0]["lr"] == pytest.approx(lr * factor)


@pytest.mark.dist
def test_two_ranks_roll_back_together_and_name_every_ranks_items(tiny_microscopy, tmp_path):
    """2 gloo ranks at batch 1, each a real ``python -m fastvision.cli`` process with the variables
    torchrun gives its workers (env:// rendezvous; no launcher process, which would only add its own
    torch import): the same global batches as one process at batch 2, so the same items are named
    (both ranks' together), and both ranks load the rollback and finish (13 items: 6 whole global batches of 2,
    the 13th left out as one process at batch 2 leaves it: 6 steps)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastvision.cli", "train", "unet2d-microscopy", "--data", str(tiny_microscopy),
           "--out", str(out), "--epochs", "1", *TINY, "--batch-size", "1",
           "--set", "model.args.nonfinite_steps=[4,5,6]", "--set", "train.checkpoint_every=2"]
    port = str(free_port())
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    stderr = "".join(err for _, err in communicate_all(procs, timeout=300))
    assert [p.returncode for p in procs] == [0, 0], stderr[-3000:]
    assert re.search(r"step 6: 3 consecutive steps skipped .*rolled back to \S*rollback\.pt \(step 2\)", stderr)
    for step in (4, 5, 6):
        assert f"step {step} (non-finite loss; items {', '.join(_items_at(tiny_microscopy, step))})" in stderr
    last = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert last["step"] == 6 and all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("every, expect", [("2", r"last healthy checkpoint is \S*rollback\.pt \(step 2\)"),
                                           (None, "no healthy checkpoint of this run to roll back to")])
def test_on_nonfinite_stop_names_the_checkpoint_to_resume_from(every, expect, tiny_microscopy, tmp_path, capfd):
    more = ["--set", f"train.checkpoint_every={every}"] if every else []
    res = _train(capfd, tiny_microscopy, tmp_path / "run", "--set", "model.args.nonfinite_steps=[4,5,6]",
                 "--set", "train.on_nonfinite=stop", *more)
    assert res.returncode == 2, res.stderr[-3000:]
    line = res.stderr.strip().splitlines()[-1]
    assert "stopping at step 6: 3 consecutive steps skipped" in line and re.search(expect, line), line


def test_a_streak_goes_on_across_the_epochs_end_and_a_resume(tiny_microscopy, tmp_path, capfd):
    """6 steps an epoch, max_nonfinite 3: steps 5-8 NaN are 4 consecutive skipped steps, 2 in each epoch. The
    streak was the epoch's (reset at its end), so a run of fewer steps an epoch than max_nonfinite (the
    microscopy demo's 10 against 20) never acted on a divergence; and a resume at the epoch's end restarted
    it. Both now stop at step 7 (the probe's forward calls count from 1 in each process: the resumed
    process's first call is step 7)."""
    res = _train(capfd, tiny_microscopy, tmp_path / "a", "--set", "model.args.nonfinite_steps=[5,6,7,8]",
                 "--set", "train.on_nonfinite=stop")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "stopping at step 7: 3 consecutive steps skipped" in res.stderr.strip().splitlines()[-1], res.stderr
    out = tmp_path / "b"
    res = _train(capfd, tiny_microscopy, out, "--epochs", "1", "--set", "model.args.nonfinite_steps=[5,6]")
    assert res.returncode == 0, res.stderr[-3000:]
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["nonfinite_streak"] == 2
    res = _train(capfd, tiny_microscopy, out, "--resume", "auto", "--set", "model.args.nonfinite_steps=[1,2]",
                 "--set", "train.on_nonfinite=stop")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "stopping at step 7: 3 consecutive steps skipped" in res.stderr.strip().splitlines()[-1], res.stderr


def test_non_finite_weights_roll_back_and_a_run_that_keeps_diverging_stops(tiny_microscopy, tmp_path, capfd):
    """SGD at lr 1e38 makes the weights infinite at each applied step: each time the run rolls back
    (to the checkpoint of the step before) and halves the rate; the fourth time within
    10 x max_nonfinite steps it stops, exit 2, naming the last healthy checkpoint."""
    res = _train(capfd, tiny_microscopy, tmp_path / "run", "--set", "optim.name=sgd", "--set", "optim.lr=1e38",
                 "--set", "train.checkpoint_every=1")
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("a weight is not finite; rolled back to") == 3, res.stderr[-3000:]
    line = res.stderr.strip().splitlines()[-1]
    assert "a weight is not finite; rolled back 3 times in the last 30 steps already" in line, line
    assert re.search(r"last healthy checkpoint: \S*rollback\.pt", line), line


def _probe_run(tiny_microscopy, nonfinite_steps):
    over = [f"data.args.path={tiny_microscopy}", "data.args.image_size=[32,32]", "model.name=probe",
            f"model.args.nonfinite_steps={nonfinite_steps}", "train.device=cpu", "train.batch_size=4",
            "sched.name=constant", "sched.warmup_epochs=0", "optim.impl=loop"]
    cfg = config.load("unet2d-microscopy", [config.parse_override(s) for s in over])
    cfg.data.augment = {}
    return engine.build(cfg, train=True, loaders=False, data_info={})


def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were(tiny_microscopy):
    """Forward calls 1 and 3 are NaN (a skipped first step, then a later one): the running statistics
    are those of the good batches 2 and 4 alone, computed by hand; no torch scheduler warning."""
    run = _probe_run(tiny_microscopy, "[1,3]")
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(4, 1, 32, 32, generator=g) * (k + 1) for k in range(4)]
    label = (torch.rand(4, 32, 32, generator=g) > 0.5).long()
    bn = run.model.norm
    run.step.model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.train_step(run.step, iter([{"image": xs[0], "label": label}]))
    assert float(out.skipped) == 1
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert torch.equal(bn.running_mean, torch.zeros(1)) and torch.equal(bn.running_var, torch.ones(1))
    assert int(bn.num_batches_tracked) == 0
    for x in xs[1:]:
        engine.train_step(run.step, iter([{"image": x, "label": label}]))
    mean, var = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    for x in (xs[1], xs[3]):  # momentum 0.1; the running variance takes the unbiased batch variance
        mean = 0.9 * mean + 0.1 * x.double().mean()
        var = 0.9 * var + 0.1 * x.double().var(unbiased=True)
    assert torch.allclose(bn.running_mean.double(), mean, rtol=1e-5)
    assert torch.allclose(bn.running_var.double(), var, rtol=1e-5)
    assert int(bn.num_batches_tracked) == 2
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_an_early_stop_exits_with_no_import_thread_left_running(tiny_microscopy, tmp_path):
    """A run stopped at step 6 ends while the logger's background matplotlib import may still run: the
    thread is joined before the interpreter finalizes (a thread that asks for the GIL then can abort
    the process, exit -6 for an exit 2; seen once in CI). A hook registered before the CLI runs after
    the CLI's own exit handlers and finds no such thread alive."""
    argv = ["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(tmp_path / "run"),
            "--epochs", "2", *TINY, "--set", "model.args.nonfinite_steps=[4,5,6]", "--set", "train.on_nonfinite=stop"]
    # the race made certain: finding matplotlib.figure takes 3 s longer (then the normal import runs),
    # so the run stops at step 6 while the thread is still importing
    script = ("import atexit, sys, threading, time\n"
              "class Slow:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'matplotlib.figure':\n"
              "            time.sleep(3)\n"
              "        return None\n"
              "sys.meta_path.insert(0, Slow())\n"
              "atexit.register(lambda: print('ALIVE AT EXIT:', sorted(t.name for t in threading.enumerate()"
              " if t.is_alive() and t is not threading.main_thread()), file=sys.stderr))\n"
              "from fastvision import cli\n"
              f"sys.exit(cli.main({argv!r}))\n")
    res = subprocess.run([sys.executable, "-c", script], env=clean_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "ALIVE AT EXIT: []" in res.stderr, res.stderr[-1000:]


def test_non_finite_batchnorm_statistics_without_a_skipped_step_are_named_once(caplog):
    """Adam at lr 1e6 on the microscopy U-Net: no loss is ever non-finite (no step skipped), but the decoder's
    BatchNorm running variances overflow to inf, so validation and every checkpoint were garbage and no
    rollback.pt was written, without a word. The checkpoint's health check names them, once while they
    stay so, again after the model was finite in between."""
    from fastvision.engine.guard import NonFiniteGuard

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))
    guard = NonFiniteGuard(20, "rollback_lower_lr", model)
    with caplog.at_level("WARNING", logger="fastvision.engine.guard"):
        assert guard.healthy(4) and not caplog.records
        model[1].running_var[1] = float("inf")
        assert not guard.healthy(8) and not guard.healthy(12)
        model[1].running_var[1] = 1.0
        assert guard.healthy(16)
        model[0].weight.data[0] = float("nan")
        assert not guard.healthy(20)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 8: 1 tensor(s) of the model are not finite (1.running_var): the run diverged")
    assert "rollback.pt is not updated" in lines[0] and lines[1].startswith("step 20: 1 tensor(s)")
    assert "(0.weight)" in lines[1]


def test_a_resumed_run_rolls_back_to_the_rollback_checkpoint_written_before_the_stop(tiny_microscopy, tmp_path,
                                                                                     capfd):
    """Epoch 0 ends healthy (rollback.pt at step 6); the resumed process diverges at once (its forward calls
    1-3: steps 7-9). It used to stop with 'no healthy checkpoint of this run to roll back to' (the resumed
    process knew only the healthy checkpoints it wrote itself: a preempted, requeued job lost its rollback)."""
    out = tmp_path / "run"
    assert _train(capfd, tiny_microscopy, out, "--epochs", "1").returncode == 0
    res = _train(capfd, tiny_microscopy, out, "--resume", "auto", "--set", "model.args.nonfinite_steps=[1,2,3]",
                 "--set", "train.on_nonfinite=rollback")
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"step 9: 3 consecutive steps skipped .*rolled back to \S*rollback\.pt \(step 6\)", res.stderr)
