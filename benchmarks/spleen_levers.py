"""Spleen against MONAI's fast tutorial: what makes ``unet3d-spleen-fast`` reach the target Dice sooner,
each lever alone against seed 003's settings (the recipe as shipped before issue 41), then together
(issue 41 item 4).

The setting is ``spleen_fast_vs_baseline.py``'s, made longer: 40 generated cases (fold 0 of 5 = 32
training / 8 validation volumes, as the tutorial's 32 / 9), finer spacing (2 mm) and larger volumes,
a harder target (per-case foreground Dice 0.85: the tutorial's ``DiceMetric``), the validation window
1.5-2x the training patch (the tutorial validates 160^3 windows on 96^3 patches) and validation every
5 epochs on both sides (the tutorial's ``val_interval``; the recipe's ``train.val_every``). Same
network (widths / 4), data, fold, patch, batch 4 (unless the lever is the batch), loss, optimizer and
seed on both sides; one patch per cached volume per step on both (the thread loader yields one crop per
item) unless the lever is ``data.args.num_samples`` (fastvision's side only: MONAI's stays at one). A
lever changes only what its name says, on fastvision's side. The epochs to the target depend
on the training seed (on both sides), so every lever runs with several seeds (``--seeds``);
``--rounds`` repeats them.

Each round runs, per seed, MONAI's pipeline, then every lever (the order rotated from run to run, so
none always runs first); the tables give medians over the runs and each run's ratio to the MONAI run of
the same seed and round. ``train_s`` counts training epochs only, ``wall_s`` everything from loading
the files to the validation that reached the target (preprocessing and caching from scratch unless the
lever is the warm disk cache), on fastvision's side to the end of ``train`` (its ``curves.png`` and
summary), ``target_wall_s`` the same clock stopped at that validation on both sides, ``cpu_s`` the
process CPU time of the run (less disturbed by other jobs on a shared machine than the wall time).

Usage: ``python benchmarks/spleen_levers.py [--seeds 0 1 2] [--rounds 1] [--levers NAME ...] [--combo NAME ...]
[--monai-also halves] [--json FILE]``
(``--list`` prints the levers; ``--validation-parts X Y Z`` times only the validation's scoring;
``--window-cost X Y Z`` only one validation volume's forward per ``task.args.val_window`` layout;
``--monai-also whole|halves`` also runs MONAI validating in that layout, the fair pair of a lever that
sets ``task.args.val_window``: the layout changes the score on both sides).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from spleen_fast_vs_baseline import fastvision_run, monai_run  # noqa: E402  (benchmarks/ is the script's folder)

from fastvision.data.synth.medical import synth_spleen

RECIPE = "unet3d-spleen-fast"
# name -> (--set overrides on top of the benchmark's, options of the run: batch, warm disk cache)
LEVERS: dict[str, tuple[dict, dict]] = {
    "seed 003's batch 4 (shipped before issue 41)": ({}, {"batch": 4}),
    "validate every epoch (val_every 1)": ({"train.val_every": 1}, {}),
    "validate every 2 epochs": ({"train.val_every": 2}, {}),
    "window overlap 0 (validation)": ({"task.args.sliding_window.overlap": 0.0}, {}),
    "pos_fraction 0.67": ({"data.args.pos_fraction": 0.67}, {}),
    "pos_fraction 1.0": ({"data.args.pos_fraction": 1.0}, {}),
    "half of each batch foreground (oversample batch_tail)": ({"data.args.oversample": "batch_tail"}, {}),
    "warm-up 1 epoch": ({"sched.warmup_epochs": 1.0, "sched.warmup_start_factor": 0.1}, {}),
    "poly decay over 40 epochs": ({"sched.name": "poly", "train.epochs": 40}, {}),
    "cosine decay over 40 epochs": ({"sched.name": "cosine", "train.epochs": 40}, {}),
    "lr 0.1": ({"optim.lr": 0.1}, {}),
    "weight decay on norms and biases too (as MONAI)": ({"optim.no_decay_norm_bias": False}, {}),
    "batch 2 (twice the steps; shipped since issue 41)": ({}, {"batch": 2}),
    "warm disk cache (second run)": ({}, {"warm_cache": True}),
    # round 2 (issue 41 item 4): levers against the shipped batch 2
    "batch 1": ({}, {"batch": 1}),
    "num_samples 2 at batch 1": ({"data.args.num_samples": 2}, {"batch": 1}),
    "num_samples 4 at batch 1": ({"data.args.num_samples": 4}, {"batch": 1}),
    "num_samples 2 at batch 2": ({"data.args.num_samples": 2}, {"batch": 2}),
    "num_samples 4 at batch 2": ({"data.args.num_samples": 4}, {"batch": 2}),
    "batch 2, no validation loss (task.args.val_loss false)": ({"task.args.val_loss": False}, {"batch": 2}),
    # round 3 (issue 41 item 4): deep supervision, validation cost and cadence, against the shipped batch 2
    "batch 2, deep supervision": ({"model.args.deep_supervision": True}, {"batch": 2}),
    "batch 2, whole-volume validation": ({"task.args.val_window": "whole"}, {"batch": 2}),
    "batch 2, validate every 2 epochs": ({"train.val_every": 2}, {"batch": 2}),
    "batch 2, whole-volume validation every 2 epochs": ({"task.args.val_window": "whole", "train.val_every": 2},
                                                        {"batch": 2}),
    "batch 2, whole-volume validation every epoch": ({"task.args.val_window": "whole", "train.val_every": 1},
                                                     {"batch": 2}),
    "batch 2, validation in two halves": ({"task.args.val_window": "halves"}, {"batch": 2}),
    "batch 2, validation in two halves every 2 epochs": ({"task.args.val_window": "halves", "train.val_every": 2},
                                                         {"batch": 2}),
    "batch 2, validation in two halves every epoch": ({"task.args.val_window": "halves", "train.val_every": 1},
                                                      {"batch": 2}),
    "batch 2, validate every epoch": ({"train.val_every": 1}, {"batch": 2}),
}
_BEST = {"task.args.val_window": "halves", "train.val_every": 1}  # round 3's best setting, with batch 2
LEVERS.update({  # round 4: the optimizer, on top of round 3's best setting
    "best + Adam 1e-3": ({**_BEST, "optim.name": "adam", "optim.lr": 1e-3, "optim.weight_decay": 0.0}, {"batch": 2}),
    "best + Adam 3e-3": ({**_BEST, "optim.name": "adam", "optim.lr": 3e-3, "optim.weight_decay": 0.0}, {"batch": 2}),
    "best + Novograd 1e-2": ({**_BEST, "optim.name": "novograd", "optim.lr": 1e-2, "optim.betas": [0.9, 0.98],
                              "optim.weight_decay": 0.0}, {"batch": 2}),
    "best + Novograd 3e-2": ({**_BEST, "optim.name": "novograd", "optim.lr": 3e-2, "optim.betas": [0.9, 0.98],
                              "optim.weight_decay": 0.0}, {"batch": 2}),
    "best + SGD 0.3": ({**_BEST, "optim.lr": 0.3}, {"batch": 2}),
    # round 5: the network's regularisation and norm, on top of round 3's best setting
    "best + no dropout": ({**_BEST, "model.args.dropout": 0.0}, {"batch": 2}),
    "best + instance norm": ({**_BEST, "model.args.norm": "instance"}, {"batch": 2}),
    "best + instance norm, no dropout": ({**_BEST, "model.args.norm": "instance", "model.args.dropout": 0.0},
                                         {"batch": 2}),
    # round 6: validate an exponential moving average of the weights (train.ema_decay), per step
    **{f"best + EMA {d}": ({**_BEST, "train.ema_decay": d}, {"batch": 2}) for d in (0.7, 0.8, 0.9, 0.95, 0.98)},
    # round 6: the batch norms' running-statistics momentum (train.bn_momentum; torch's and MONAI's 0.1)
    **{f"best + BN momentum {m}": ({**_BEST, "train.bn_momentum": m}, {"batch": 2}) for m in (0.2, 0.3, 0.5)},
    **{f"batch 2, BN momentum {m} (the recipe's windows, every 5)": ({"train.bn_momentum": m}, {"batch": 2})
       for m in (0.3, 0.5)},
    **{f"batch 2, BN momentum 0.5, the recipe's windows every {k} epoch(s)":
       ({"train.bn_momentum": 0.5, "train.val_every": k}, {"batch": 2}) for k in (1, 2)},
})


def run_lever(name: str, data: Path, out: Path, a: argparse.Namespace, filters: list[int]) -> dict:
    """One fastvision run of the recipe with lever ``name`` applied."""
    overrides, opts = LEVERS[name]
    ns = argparse.Namespace(**{**vars(a), "warm_cache": opts.get("warm_cache", False)})
    return fastvision_run(RECIPE, data, out, ns, filters, opts.get("batch", a.batch), dict(overrides), _folder(name))


def _folder(name: str) -> str:
    return "lever-" + "".join(c if c.isalnum() else "-" for c in name)


def timed(fn, *args) -> dict:
    """``fn(*args)`` plus the process CPU seconds it took (every thread of this process: training,
    cache fill, checkpoint writer), a figure the other jobs on a shared machine disturb less."""
    c = time.process_time()
    r = fn(*args)
    return {**r, "cpu_s": time.process_time() - c}


def per_round(rs: list[dict], monai: list[dict], key: str = "wall_s") -> list[str]:
    """Each round's summed wall time over its seeds, over MONAI's in the same round: long enough to
    steady the ratio, and the seeds' epochs are the same in every round. A run that missed the target
    counts its whole time (a lower bound of its time to target)."""
    rounds = sorted({r["round"] for r in rs})
    total = {k: sum(m[key] for m in monai if m["round"] == k) for k in rounds}
    return [f"{sum(r[key] for r in rs if r['round'] == k) / total[k]:.2f}" for k in rounds]


def table(runs: dict[str, list[dict]], monai: list[dict], monai_whole: list[dict] | None = None) -> list[str]:
    """Markdown rows: medians over the runs (seeds x rounds), and each run's wall ratio to the MONAI run
    of the same seed and round; with ``monai_whole`` (MONAI validating in ``--monai-also``'s layout) also
    each round's summed wall and CPU time over that MONAI's."""
    extra = monai_whole is not None
    rows = ["| pipeline | reached | epochs per seed | train s | wall s | train / MONAI | wall / MONAI "
            "| CPU s / MONAI | wall / MONAI, each run | all seeds' wall / MONAI's, each round |"
            + (" all seeds' wall; CPU / that MONAI's (validating as val_window), each round "
               "| the same, wall to the target |" if extra else ""),
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if extra else "")]
    pipelines = [("MONAI fast tutorial", monai)] + ([("MONAI, validation as val_window", monai_whole)] if extra else [])
    for name, rs in [*pipelines, *runs.items()]:
        med = {k: float(np.median([r[k] for r in rs])) for k in ("train_s", "wall_s")}
        ratio = {k: [r[k] / m[k] for r, m in zip(rs, monai, strict=True)] for k in ("train_s", "wall_s", "cpu_s")}
        n_seeds = len({r["seed"] for r in rs})
        epochs = "/".join(("" if r["reached"] else ">") + str(r["epochs"]) for r in rs[:n_seeds])
        mark = "" if all(r["reached"] for r in rs) else ">"
        rows.append(f"| {name} | {sum(r['reached'] for r in rs)}/{len(rs)} | {epochs} | {mark}{med['train_s']:.1f} | "
                    f"{mark}{med['wall_s']:.1f} | {np.median(ratio['train_s']):.2f} | "
                    f"**{np.median(ratio['wall_s']):.2f}** | {np.median(ratio['cpu_s']):.2f} | "
                    f"{', '.join(f'{w:.2f}' for w in ratio['wall_s'])} | {', '.join(per_round(rs, monai))} |"
                    + (f" {', '.join(per_round(rs, monai_whole))}; {', '.join(per_round(rs, monai_whole, 'cpu_s'))} |"
                       f" {', '.join(per_round(rs, monai_whole, 'target_wall_s'))} |" if extra else ""))
    return rows


def validation_parts(shape: list[int], rounds: int) -> None:
    """Milliseconds of one validation volume's scoring, old and new path, interleaved rounds (medians):
    the two-class argmax against :func:`~fastvision.tasks.seg_eval.foreground_of_two` (the same
    masks), and the evaluator's update with and without the validation loss (``task.args.val_loss``)."""
    import torch

    from fastvision.losses import DiceCELoss
    from fastvision.tasks.seg_eval import foreground_of_two
    from fastvision.tasks.segment import SegmentationTask

    logits = torch.randn(1, 2, *shape)
    batch = {"label": (torch.rand(1, *shape) > 0.9).long()}
    loss = DiceCELoss(include_background=False, softmax=True, squared_pred=True, batch=True)
    tasks = {v: SegmentationTask(num_classes=2, val_loss=v, loss=loss) for v in (True, False)}
    assert torch.equal(logits.argmax(1) == 1, foreground_of_two(logits))
    parts = {"argmax(1) == 1": lambda: logits.argmax(1) == 1, "foreground_of_two": lambda: foreground_of_two(logits),
             "update, val_loss on": lambda: tasks[True].evaluator().update(logits, batch),
             "update, val_loss off": lambda: tasks[False].evaluator().update(logits, batch)}
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(rounds):
        for k, fn in parts.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) * 1e3)
    for k, v in times.items():
        print(f"{k}: {np.median(v):.2f} ms (median of {rounds}; volume {shape}, "
              f"torch threads {torch.get_num_threads()})")


def window_cost(shape: list[int], roi: list[int], filters: list[int], rounds: int) -> None:
    """CPU milliseconds of one validation volume's forward, the recipe's sliding window against
    ``task.args.val_window`` ``whole`` and ``halves``, interleaved rounds (medians), eval mode and no
    autograd as in validation; and how far their logits and masks differ from the recipe's window's on
    an untrained net (border context only: a pointwise net gives the same logits either way,
    tests/tasks/test_val_window.py)."""
    import torch

    from fastvision.losses import DiceCELoss
    from fastvision.models import create_model
    from fastvision.tasks.segment import SegmentationTask

    torch.manual_seed(0)
    net = create_model("unet3d-spleen", filters=tuple(filters)).eval()
    window = {"roi_size": roi, "overlap": 0.25, "mode": "constant", "sw_batch_size": 4}
    tasks = {v: SegmentationTask(num_classes=2, sliding_window=window, val_window=v, loss=DiceCELoss())
             for v in ("roi", "whole", "halves")}
    x = torch.rand(1, 1, *shape)
    times: dict[str, list[float]] = {k: [] for k in tasks}
    with torch.no_grad():
        out = {k: t.eval_forward(net, {"image": x}) for k, t in tasks.items()}
        for _ in range(rounds):
            for k, t in tasks.items():
                c = time.process_time()
                t.eval_forward(net, {"image": x})
                times[k].append((time.process_time() - c) * 1e3)
    masks = {k: v.argmax(1) for k, v in out.items()}
    print(f"volume {shape}, window {roi}, widths {filters}, torch threads {torch.get_num_threads()}: CPU ms "
          + ", ".join(f"{k} {np.median(v):.1f}" for k, v in times.items()) + f" (median of {rounds})")
    for k in ("whole", "halves"):
        print(f"untrained net, {k} against roi: max |logit difference| {float((out['roi'] - out[k]).abs().max()):.3g}, "
              f"masks differ in {float((masks['roi'] != masks[k]).float().mean()) * 100:.2f} % of voxels")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float, default=0.85, help="per-case foreground Dice to reach")
    p.add_argument("--max-epochs", type=int, default=60)
    p.add_argument("--cases", type=int, default=40)
    p.add_argument("--size", type=int, default=48, help="in-plane voxels of the generated CT")
    p.add_argument("--zoom", type=float, default=1.333, help="spacing multiplier of the generator")
    p.add_argument("--spacing", type=float, nargs=3, default=[2.0, 2.0, 2.0], help="target spacing, mm")
    p.add_argument("--patch", type=int, nargs=3, default=[32, 32, 16])
    p.add_argument("--roi", type=int, nargs=3, default=[48, 48, 32], help="validation window (both sides)")
    p.add_argument("--val-every", type=int, default=5, help="validation cadence (both sides: the tutorial's)")
    p.add_argument("--batch", type=int, default=4, help="fastvision's batch unless a lever sets one (MONAI's: 4)")
    p.add_argument("--width", type=int, default=4, help="divide the recipe's channel widths by this")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (both sides)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the generated cases")
    p.add_argument("--rounds", type=int, default=1, help="repeats of every seed (timing stability)")
    p.add_argument("--levers", nargs="*", default=None, help="lever names (default: all); see --list")
    p.add_argument("--combo", nargs="*", default=None, help="also run these levers together (names)")
    p.add_argument("--no-monai", action="store_true", help="skip MONAI (exploring levers only)")
    p.add_argument("--monai-also", choices=("whole", "halves"), default=None,
                   help="also run MONAI validating in this layout (the fair pair of task.args.val_window)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--validation-parts", type=int, nargs=3, default=None, metavar=("X", "Y", "Z"),
                   help="only time the validation's scoring on one volume of this shape (old and new path)")
    p.add_argument("--window-cost", type=int, nargs=3, default=None, metavar=("X", "Y", "Z"),
                   help="only time one validation forward of a volume of this shape, --roi window against whole")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if a.list:
        print("\n".join(LEVERS))
        return
    import torch._dynamo  # noqa: F401  (imported before any clock, as in spleen_fast_vs_baseline.py)

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if a.window_cost:
        window_cost(a.window_cost, a.roi, [w // a.width for w in (32, 64, 128, 256, 512)], max(5, a.rounds))
        return
    if a.validation_parts:
        validation_parts(a.validation_parts, max(5, a.rounds))
        return
    names = a.levers or list(LEVERS)
    if a.combo:
        combo = "together: " + " + ".join(a.combo)
        LEVERS[combo] = ({k: v for n in a.combo for k, v in LEVERS[n][0].items()},
                         {k: v for n in a.combo for k, v in LEVERS[n][1].items()})
        names.append(combo)
    out = a.out or Path(tempfile.mkdtemp(prefix="spleen-levers-"))
    data = out / "Task09"
    if not (data / "dataset.json").exists():
        synth_spleen(data, seed=a.data_seed, cases=a.cases, test_cases=0, size=a.size, zoom=a.zoom)
    filters = [w // a.width for w in (32, 64, 128, 256, 512)]
    for name in names:  # a warm disk cache is filled once, untimed, before the rounds
        if LEVERS[name][1].get("warm_cache"):
            shutil.rmtree(out / f"cache-{_folder(name)}", ignore_errors=True)
            run_lever(name, data, out, argparse.Namespace(**{**vars(a), "max_epochs": 1, "seed": 0}), filters)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    monai: list[dict] = []
    monai_whole: list[dict] = []
    loads = []
    for rnd in range(a.rounds):  # a round: every seed; a seed: MONAI, then the levers in a rotated order
        for seed in a.seeds:
            loads.append(os.getloadavg()[0])
            t = time.perf_counter()
            sa = argparse.Namespace(**{**vars(a), "seed": seed})
            if not a.no_monai:
                monai.append({**timed(monai_run, data, sa, filters), "seed": seed, "round": rnd})
            if a.monai_also:
                wa = argparse.Namespace(**{**vars(sa), "monai_val_window": a.monai_also})
                monai_whole.append({**timed(monai_run, data, wa, filters), "seed": seed, "round": rnd})
                print(f"round {rnd + 1} seed {seed} MONAI {a.monai_also} validation: {monai_whole[-1]}", flush=True)
            k = (rnd * len(a.seeds) + a.seeds.index(seed)) % len(names)
            for name in names[k:] + names[:k]:
                runs[name].append({**timed(run_lever, name, data, out, sa, filters), "seed": seed, "round": rnd})
                print(f"round {rnd + 1} seed {seed} {name}: {runs[name][-1]}", flush=True)
            print(f"round {rnd + 1} seed {seed}: {time.perf_counter() - t:.0f} s, load {loads[-1]:.2f}; MONAI "
                  f"{monai[-1] if monai else None}", flush=True)
    print(f"\ntarget dice {a.target} (per case), {a.cases} cases {a.size}^2 x zoom {a.zoom}, spacing {a.spacing}, "
          f"patch {a.patch}, window {a.roi}, validation every {a.val_every} epochs, batch {a.batch}, "
          f"widths {filters}, torch threads {torch.get_num_threads()}, seeds {a.seeds} x {a.rounds} round(s), "
          f"1-min load at each round's start {', '.join(f'{x:.2f}' for x in loads)}: medians\n")
    if monai:
        print("\n".join(table(runs, monai, monai_whole if a.monai_also else None)))
    else:
        for name, rs in runs.items():
            print(name, [(r["seed"], r["epochs"], round(r["train_s"], 1), round(r["wall_s"], 1), r["reached"])
                         for r in rs])
    if a.json:
        a.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                                      "monai": monai, "monai_whole": monai_whole, "runs": runs, "loads": loads},
                                     indent=2))


if __name__ == "__main__":
    main()
