"""3-D training side by side: nnU-Net v2's ``nnUNetTrainer`` against fastvision on the configured
recipe of the same plan, on the same generated data, on the CPU, cut to the same iterations.

Per dataset (a CT one, ``data synth spleen``, an MR one, ``data synth hippocampus``, and an anisotropic
two-channel MR one, ``data synth prostate`` at 0.6 x 0.6 x 3.6 mm; >= 20 cases each): nnU-Net v2, in its
OWN virtual environment, converts, fingerprints, plans (8 GB target) and preprocesses the folder
(3d_fullres), then trains fold 0 on the CPU with its own trainer, cut by a subclass
defined in its script (``nnUNetTrainer`` with ``num_epochs`` x
``num_iterations_per_epoch`` = the run's iterations, the nnU-Net trainer ``nnUNetv2_train -device
cpu`` runs), its augmentation processes (``nnUNet_n_proc_DA``) = the cores given. Its validation
cases are fastvision's fold 0 (``splits_final.json`` is written from fastvision's split), so both
sides score the same cases. Every ``--val-every`` iterations it predicts them whole
(``perform_actual_validation``, sliding window, no mirroring) and records the mean foreground Dice.

fastvision plans the folder with ``configure --memory 8GiB --trainer T`` (T = nnunet and fast),
takes nnU-Net's patch and batch (``--set``; the network is the same by configure's rules, checked
by benchmarks/configure_vs_nnunet.py), and trains through the real CLI for the same iterations,
validating the same cases (sliding window, per-case Dice) at the same iterations. Each of those
validations is then scored as nnU-Net scores its own (:func:`score_as_nnunet`, outside the clocks): the
step checkpoint of that iteration predicts the validation images through ``fastvision predict``'s path
(labels on each file's own grid) and the Dice is taken against the label files. The training's own
figure (the network's grid, labels resampled there) is kept as ``dice_preprocessed``; runs saved before
2026-11-29 (night) hold only that one in ``dice``.

nnU-Net steps its poly schedule once per (cut) epoch; fastvision's `--trainer nnunet` side gets the same
steps (``--schedule epoch``, the default; :func:`cut_schedule`). ``--set KEY=JSON`` changes one key of
the fastvision side (one difference measured alone), ``--reuse-nnunet`` takes the nnU-Net side saved by
an earlier run in the same ``--work`` folder, ``--trainers`` picks the fastvision sides (none: nnU-Net's
alone). nnU-Net is not seeded, so its runs differ: ``--nnunet-runs N`` trains N of them, each saved
(:func:`nnunet_runs`; a repeat reuses the folder's preprocessed data), and ``--compare NAME=GLOB ...``
compares saved runs without training: each group's mean Dice per checkpoint and each group against the
first (bootstrap CI and permutation test of the difference of means, :func:`diff_stats`); ``--goal
NAME=GLOB ...`` gives issue 41's goal per paired run (:func:`goal`: fastvision's training time to nnU-Net's
last Dice within 0.02, over nnU-Net's time to that Dice).

Where the configured recipe cuts the network's patch from nnU-Net's enlarged initial patch
(``data.augment.affine.size``), the fastvision side's loader patch is the initial patch around nnU-Net's.

Reported per side: iterations/s of the training loop (augmentation and data waits included;
validation and preprocessing excluded), validation Dice after the same iterations, and the
training time to the highest Dice every side reaches (the first validation at or above it).

Usage (about 20 minutes on 2 shared cores at the defaults)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --nnunet-python /work/nnunet-venv/bin/python \\
        --work /tmp/tvn --json /tmp/tvn/out.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

DATASETS = [  # (MSD folder, synth kind, options, nnU-Net dataset id)
    ("Task09_Spleen", "spleen", {"cases": 20, "test_cases": 1, "size": 32}, 981),
    ("Task04_Hippocampus", "hippocampus", {"cases": 20, "test_cases": 1}, 982),
    # anisotropic two-channel MR (0.6 x 0.6 x 3.6 mm, 6x): nnU-Net's 3x rules on both sides (separate-z resampling,
    # 3 x 3 x 1 kernels in the first stages); its patch 48 / 16 = 3 is not above 3, so rotation about every axis
    ("Task05_Prostate", "prostate", {"cases": 20, "test_cases": 1, "size": 48, "slices": 18}, 983),
]

NNUNET = r"""
import json, os, sys, time
import numpy as np, torch
did, raw, iters, per_epoch, val_every, cores = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
split, prepare = json.loads(sys.argv[7]), sys.argv[8] == "1"
pre = os.environ["nnUNet_preprocessed"]
from nnunetv2.dataset_conversion.convert_MSD_dataset import convert_msd_dataset
from nnunetv2.experiment_planning.plan_and_preprocess_api import extract_fingerprints, plan_experiments, preprocess
if prepare:  # a repeated run in the same folder trains on the data its first run preprocessed
    convert_msd_dataset(raw, overwrite_target_id=int(did), num_processes=cores)
    extract_fingerprints([int(did)], num_processes=cores)
    plan_experiments([int(did)], gpu_memory_target_in_gb=8)
    preprocess([int(did)], configurations=("3d_fullres",), num_processes=(cores,))
name = [d for d in os.listdir(pre) if d.startswith(f"Dataset{did}_")][0]
json.dump([split], open(os.path.join(pre, name, "splits_final.json"), "w"))
plans = json.load(open(os.path.join(pre, name, "nnUNetPlans.json")))
ds = json.load(open(os.path.join(pre, name, "dataset.json")))
from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer
curve, clock = [], {"train": 0.0}
class Cut(nnUNetTrainer):
    def __init__(self, plans, configuration, fold, dataset_json, device=torch.device("cpu")):
        super().__init__(plans, configuration, fold, dataset_json, device)  # nnU-Net reads this signature
        self.num_iterations_per_epoch, self.num_epochs = per_epoch, iters // per_epoch
        self.num_val_iterations_per_epoch, self.save_every = 1, 10 ** 9
    def on_train_start(self):
        super().on_train_start()
        self.inference_allowed_mirroring_axes = None  # validation without mirroring, as fastvision's
    def on_train_epoch_start(self):
        super().on_train_epoch_start()
        self._t0 = time.perf_counter()
    def on_train_epoch_end(self, outputs):
        clock["train"] += time.perf_counter() - self._t0
        super().on_train_epoch_end(outputs)
    def on_epoch_end(self):
        done = (self.current_epoch + 1) * self.num_iterations_per_epoch
        super().on_epoch_end()
        if done % val_every == 0:
            self.perform_actual_validation(False)
            s = json.load(open(os.path.join(self.output_folder, "validation", "summary.json")))
            curve.append({"iterations": done, "train_s": clock["train"], "dice": s["foreground_mean"]["Dice"]})
            self.set_deep_supervision_enabled(True)
    def perform_actual_validation(self, save=False):
        if curve and curve[-1]["iterations"] == self.current_epoch * self.num_iterations_per_epoch:
            return  # run_training's closing validation: the last one is recorded already
        super().perform_actual_validation(save)
cm = plans["configurations"]["3d_fullres"]
plans["continue_training"] = False  # what nnunetv2.run.run_training sets
t = Cut(plans, "3d_fullres", 0, ds, device=torch.device("cpu"))
t0 = time.perf_counter()
t.run_training()
print("NNUNET_JSON" + json.dumps({"curve": curve, "wall_s": time.perf_counter() - t0, "patch": cm["patch_size"],
      "batch": cm["batch_size"], "features": cm["architecture"]["arch_kwargs"]["features_per_stage"],
      "strides": cm["architecture"]["arch_kwargs"]["strides"], "spacing": cm["spacing"],
      "transpose_forward": plans["transpose_forward"]}))
"""


def run(cmd: list[str], env: dict, timeout: float) -> str:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd[:5])} ...\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def nnunet_side(python: str, work: Path, data: Path, did: int, args, split: dict) -> dict:
    env = dict(os.environ, nnUNet_raw=str(work / "raw"), nnUNet_preprocessed=str(work / "pre"),
               nnUNet_results=str(work / "res"), nnUNet_n_proc_DA=str(args.cores),
               nnUNet_def_n_proc=str(args.cores), OMP_NUM_THREADS=str(args.cores),
               PYTHONPATH="")
    for k in ("raw", "pre", "res"):
        (work / k).mkdir(parents=True, exist_ok=True)
    prepared = any((d / "nnUNetPlans_3d_fullres").is_dir() for d in (work / "pre").glob(f"Dataset{did}_*"))
    out = run([python, "-c", NNUNET, str(did), str(data), str(args.iterations), str(args.per_epoch),
               str(args.val_every), str(args.cores), json.dumps(split), "0" if prepared else "1"],
              env, args.timeout)
    line = next(x for x in out.splitlines() if x.startswith("NNUNET_JSON"))
    return json.loads(line[len("NNUNET_JSON"):])


def nnunet_runs(args, work: Path, data: Path, did: int, split: dict) -> list[dict]:
    """The nnU-Net side: ``--nnunet-runs`` fresh trainings (nnU-Net is not seeded, so its runs differ),
    each saved as WORK/KIND/nnunet_side-N.json (N the next free index, so several invocations gather
    runs) and the latest also as nnunet_side.json, which ``--reuse-nnunet`` takes instead of training."""
    saved = work / "nnunet_side.json"
    if args.reuse_nnunet and saved.is_file():
        return [json.loads(saved.read_text())]
    runs = []
    for _ in range(args.nnunet_runs):
        nn = nnunet_side(args.nnunet_python, work, data, did, args, split)
        index = len(list(work.glob("nnunet_side-*.json")))
        (work / f"nnunet_side-{index}.json").write_text(json.dumps(nn))
        saved.write_text(json.dumps(nn))
        runs.append(nn)
    return runs


def cut_schedule(nn_epochs: int, per_epoch: int, steps: int) -> dict:
    """nnU-Net's ``PolyLRScheduler`` as its cut run steps it: once per nnU-Net epoch (``per_epoch``
    iterations), factor (1 - e / epochs) ** 0.9, as fastvision's piecewise schedule (milestones in
    fastvision epochs of ``steps`` steps). Per iteration, the same poly reaches 0 at the run's end and
    gives 0.53 of the peak lr on average against 0.65 for 4 steps: a cut-run artefact (0.4 % at 1000 epochs)."""
    return {"sched.name": "piecewise", "sched.milestones": [e * per_epoch / steps for e in range(1, nn_epochs)],
            "sched.factors": [(1 - e / nn_epochs) ** 0.9 for e in range(nn_epochs)]}


def score_as_nnunet(run: Path, data: Path, val: list[str], curve: list[dict]) -> None:
    """Each validation of ``curve`` scored where nnU-Net scores its own: the step checkpoint of that iteration
    predicts the validation images with ``fastvision predict``'s path (:func:`fastvision.api.predict`: the labels
    taken on each file's own grid) and the Dice is taken against the label files, as nnU-Net's
    ``foreground_mean`` (per class the mean over cases, then over classes). The training's own figure, on the
    preprocessed grid against the resampled labels, is kept as ``dice_preprocessed``. Outside the clocks."""
    import nibabel as nib

    from fastvision import api
    from fastvision.inference.postprocess import case_dice, defined_means

    classes = [[int(k)] for k in json.load(open(data / "dataset.json"))["labels"] if int(k) > 0]
    images = [data / "imagesTr" / f"{c}.nii.gz" for c in val]
    for point in curve:
        ckpt = run / "checkpoints" / f"step-{point['iterations']:08d}.pt"
        out = run / "scored" / str(point["iterations"])
        api.predict(ckpt, [str(p) for p in images], out, device="cpu")
        per_case = [case_dice(np.asarray(nib.load(str(out / f"{c}.nii.gz")).dataobj),
                              np.asarray(nib.load(str(data / "labelsTr" / f"{c}.nii.gz")).dataobj), classes)
                    for c in val]
        point["dice_preprocessed"] = point["dice"]
        point["dice"] = float(np.mean(defined_means(np.stack(per_case))))


def fastvision_side(data: Path, work: Path, trainer: str, nn: dict, args, extra: dict | None = None,
                    tag: str = "", val: list[str] | None = None) -> dict:
    """configure --trainer, nnU-Net's patch and batch, the same iterations; the curve from metrics.jsonl,
    each validation then scored as nnU-Net scores its own (:func:`score_as_nnunet`, the cases ``val``).
    ``extra``: further ``--set`` overrides (one difference at a time); ``tag`` names the run folder."""
    from fastvision.data.formats.decathlon import kfold_split

    recipe = work / f"{trainer}.yaml"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.cores), FASTVISION_CACHE=str(work / "cache"))
    run([sys.executable, "-m", "fastvision", "configure", str(data), "--memory", "8GiB", "--trainer", trainer,
         "--out", str(recipe), "--force"], env, 600)
    tf = nn["transpose_forward"]  # nnU-Net's axes are the transposed SimpleITK (Z, Y, X) order
    patch = [0, 0, 0]
    for i, a in enumerate(tf):
        patch[2 - a] = nn["patch"][i]
    cases = len(json.load(open(data / "dataset.json"))["training"])
    steps = len(kfold_split([str(i) for i in range(cases)], 0, 5)[0]) // nn["batch"]
    epochs, val_every = max(1, round(args.iterations / steps)), max(1, round(args.val_every / steps))
    sets = {"data.args.patch_size": patch, "task.args.sample_shape": None, "train.batch_size": nn["batch"],
            "task.args.sliding_window.roi_size": patch, "train.epochs": epochs, "train.val_every": val_every,
            "train.target": None, "data.num_workers": args.cores, "data.cache": "ram", "data.cache_dir": None,
            "examples": 0, "train.device": "cpu",
            # a step checkpoint at every validation, each kept, for score_as_nnunet
            "train.checkpoint_every": val_every * steps, "train.keep_checkpoints": 10 ** 6}
    affine = ((yaml.safe_load(recipe.read_text()).get("data") or {}).get("augment") or {}).get("affine") or {}
    if "size" in affine:  # nnU-Net's enlarged initial patch around nnU-Net's patch (configure's rule)
        from fastvision.planning.configure.trainer import initial_patch

        rot = affine.get("rotate_axes")
        sets["data.args.patch_size"] = initial_patch(patch, affine["degrees"], rot is not None, rot[0] if rot else 0)
        sets["data.augment.affine.size"] = patch
    if trainer == "nnunet":  # nnU-Net's poly over its cut run, stepped per its epoch as it is stepped there
        sets.update(cut_schedule(args.iterations // args.per_epoch, args.per_epoch, steps)
                    if args.schedule == "epoch" else {"sched.name": "poly"})
    sets.update(extra or {})
    out = work / f"run-{trainer}{tag}"
    argv = [sys.executable, "-m", "fastvision", "train", str(recipe), "--out", str(out)]
    for k, v in sets.items():
        if k == "task.args.sample_shape":
            v = [len(json.load(open(data / "dataset.json"))["modality"]), *patch]
        argv += ["--set", f"{k}={json.dumps(v)}"]
    t0 = time.perf_counter()
    run(argv, env, args.timeout)
    wall = time.perf_counter() - t0
    curve, clock = [], 0.0
    for line in open(out / "metrics.jsonl"):
        rec = json.loads(line)
        d = rec.get("data") or {}
        if "epoch_time_s" in d and rec.get("step"):  # an epoch's event (the closing summary repeats the last)
            clock += d["epoch_time_s"]
            if "dice" in d:
                ep = len([1 for _ in curve]) + 1
                curve.append({"iterations": ep * val_every * steps, "train_s": clock, "dice": d["dice"]})
    if val:
        score_as_nnunet(out, data, val, curve)
    return {"curve": curve, "wall_s": wall, "steps_per_epoch": steps, "epochs": epochs}


def summarise(sides: dict[str, dict]) -> dict:
    """it/s, Dice at the last common iteration, and train time to the best Dice every side reaches."""
    out = {}
    common = min(max(p["iterations"] for p in s["curve"]) for s in sides.values())
    reach = min(max(p["dice"] for p in s["curve"]) for s in sides.values())
    for name, s in sides.items():
        last = [p for p in s["curve"] if p["iterations"] <= common][-1]
        hit = next(p for p in s["curve"] if p["dice"] >= reach)
        first = s["curve"][0]  # after the first validation: warm-up, worker start and cache fill left out
        steady = (last["iterations"] - first["iterations"]) / max(last["train_s"] - first["train_s"], 1e-9)
        out[name] = {"it_per_s": last["iterations"] / last["train_s"], "iterations": last["iterations"],
                     "steady_it_per_s": steady if last is not first else None,
                     "dice": last["dice"], "time_to_dice_s": hit["train_s"], "curve": s["curve"]}
    out["_dice_reached_by_all"] = reach
    return out


def load_curves(pattern: str) -> list[list[dict]]:
    """The validation curves in the JSON files ``pattern`` matches (a glob): an nnU-Net side saved by
    :func:`nnunet_runs` (``{"curve": ...}``) or a ``--json`` report (each ``fastvision-*`` side of it)."""
    import glob

    curves = []
    for f in sorted(glob.glob(pattern)):
        try:
            d = json.load(open(f))
        except ValueError as e:
            raise ValueError(f"{f}: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{f}: neither an nnU-Net side nor a --json report")
        if "curve" in d:
            curves.append(d["curve"])
            continue
        for kind in (v for k, v in d.items() if k != "args"):
            curves += [v["curve"] for k, v in kind.items() if k.startswith("fastvision-")]
    return curves


def named_groups(groups: list[str]) -> list[tuple[str, list[list[dict]]]]:
    """``NAME=GLOB`` arguments of ``--compare`` / ``--goal`` as (name, curves); an argument without ``=`` or a
    glob that matches no curve is a ValueError naming it (``main`` prints it on one line and exits 2)."""
    out = []
    for g in groups:
        name, sep, pattern = g.partition("=")
        if not sep or not name or not pattern:
            raise ValueError(f"{g!r}: expected NAME=GLOB (e.g. 'nnU-Net=/tmp/w/nnunet-*.json')")
        curves = load_curves(pattern)
        if not curves:
            raise ValueError(f"{name}={pattern}: no saved curve matches (nnU-Net sides or --json reports)")
        out.append((name, curves))
    return out


def diff_stats(a, b, n: int = 20000, seed: int = 0) -> dict:
    """mean(a) - mean(b) with a 95 % percentile bootstrap CI (each group resampled with replacement, ``n``
    times) and a two-sided permutation p-value (``n`` random relabellings of the pooled runs; numpy only)."""
    import numpy as np

    a, b = np.asarray(a, float), np.asarray(b, float)
    rng = np.random.default_rng(seed)
    boot = (a[rng.integers(0, len(a), (n, len(a)))].mean(1) - b[rng.integers(0, len(b), (n, len(b)))].mean(1))
    d = a.mean() - b.mean()
    pooled = np.concatenate([a, b])
    perm = np.argsort(rng.random((n, len(pooled))), axis=1)
    diffs = pooled[perm[:, :len(a)]].mean(1) - pooled[perm[:, len(a):]].mean(1)
    p = (np.sum(np.abs(diffs) >= abs(d) - 1e-12) + 1) / (n + 1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"diff": float(d), "ci95": [float(lo), float(hi)], "p": float(p)}


def compare(groups: list[str], low: float = 0.5, high: float = 0.8) -> dict:
    """Print each group's mean Dice per checkpoint, its runs below ``low`` / between / at or above ``high``
    at the first and the last checkpoint (two-class MR's modes: about 0.44-0.48, one class not yet predicted,
    and above 0.8; a run still below ``low`` at the end has stalled), and each group against the first
    (:func:`diff_stats`). Returns, per group, the mean curve, those counts and the differences."""
    import numpy as np

    def bands(col):
        return (int((col < low).sum()), int(((col >= low) & (col < high)).sum()), int((col >= high).sum()))

    named = named_groups(groups)
    its = [p["iterations"] for p in named[0][1][0]]
    table, out = {}, {}
    for name, curves in named:
        try:
            table[name] = np.array([[next(p["dice"] for p in c if p["iterations"] == i) for i in its]
                                    for c in curves])
        except StopIteration:
            raise ValueError(f"{name}: a run has no validation at one of {its} iterations") from None
        m = table[name].mean(0)
        first, last = bands(table[name][:, 0]), bands(table[name][:, -1])
        out[name] = {"mean": [float(x) for x in m], "first": first, "last": last}
        print(f"{name:<12} n={len(curves)}  mean " + " / ".join(f"{x:.3f}" for x in m) +
              "".join(f"  at {i}: {b[0]} < {low}, {b[1]} between, {b[2]} >= {high}"
                      for i, b in ((its[0], first), (its[-1], last))))
    ref = named[0][0]
    for name, _ in named[1:]:
        out[name]["diff"] = []
        for j, i in enumerate(its):
            r = diff_stats(table[name][:, j], table[ref][:, j])
            out[name]["diff"].append(r)
            print(f"  {name} - {ref} at {i:>3}: {r['diff']:+.3f}  95% CI [{r['ci95'][0]:+.3f}, "
                  f"{r['ci95'][1]:+.3f}]  p={r['p']:.3f}")
    return out


def goal(groups: list[str], tolerance: float = 0.02) -> dict:
    """Issue 41's goal per paired run: the first group is nnU-Net's runs, each other group fastvision's,
    paired by sorted file order (round i against round i). Target D = the nnU-Net run's last Dice; its
    time = the first validation at or above D; fastvision's = the first at or above D - ``tolerance``
    (the same Dice within 0.02); ratio = fastvision / nnU-Net training time (None: never reached).
    Beside it, without the tolerance: each side's time to the highest Dice both runs reach."""
    import numpy as np

    named = named_groups(groups)
    (ref, nn_curves), out = named[0], {}
    for name, curves in named[1:]:
        if len(curves) != len(nn_curves):
            raise ValueError(f"{name}: {len(curves)} runs against {ref}'s {len(nn_curves)} "
                             "(runs pair by sorted file order)")
        rows = []
        for nn, fv in zip(nn_curves, curves, strict=True):
            target = nn[-1]["dice"]
            t_nn = next(p["train_s"] for p in nn if p["dice"] >= target)
            hit = next((p for p in fv if p["dice"] >= target - tolerance), None)
            common = min(max(p["dice"] for p in nn), max(p["dice"] for p in fv))  # both reach it, no tolerance
            strict = (next(p["train_s"] for p in fv if p["dice"] >= common)
                      / next(p["train_s"] for p in nn if p["dice"] >= common))
            rows.append({"target": target, "nnunet_s": t_nn, "fastvision_s": hit and hit["train_s"],
                         "fastvision_it": hit and hit["iterations"],
                         "ratio": hit and hit["train_s"] / t_nn, "last_dice": fv[-1]["dice"],
                         "common": common, "common_ratio": strict})
            r = rows[-1]
            print(f"{name:<12} target {target:.3f}: {ref} {t_nn:6.1f} s, {name} "
                  + (f"{r['fastvision_s']:6.1f} s ({r['fastvision_it']} it) = {r['ratio']:.2f}x"
                     if hit else "not reached") + f"; last Dice {r['last_dice']:.3f} vs {nn[-1]['dice']:.3f}"
                  + f"; highest common Dice {common:.3f} at {strict:.2f}x")
        ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
        print(f"{name:<12} {len(ratios)}/{len(rows)} reached; median ratio "
              + (f"{np.median(ratios):.2f}x" if ratios else "-")
              + f"; median ratio to the highest common Dice {np.median([r['common_ratio'] for r in rows]):.2f}x")
        out[name] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nnunet-python", default="/work/nnunet-venv/bin/python")
    ap.add_argument("--work", type=Path, default=Path("/tmp/tvn"))
    ap.add_argument("--iterations", type=int, default=120, help="training iterations per side")
    ap.add_argument("--per-epoch", type=int, default=20, help="nnU-Net iterations per epoch (its cut)")
    ap.add_argument("--val-every", type=int, default=40, help="iterations between validations (both sides)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--datasets", nargs="+", default=[d[1] for d in DATASETS])
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trainers", nargs="*", default=["nnunet", "fast"], choices=["nnunet", "fast"],
                    help="the fastvision sides (none: the nnU-Net side alone)")
    ap.add_argument("--nnunet-runs", type=int, default=1,
                    help="fresh nnU-Net runs per dataset (nnU-Net is not seeded; each is saved, see nnunet_runs)")
    ap.add_argument("--schedule", choices=["epoch", "iteration"], default="epoch",
                    help="fastvision's poly stepped as nnU-Net's cut run steps it (epoch) or per iteration")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="an extra override of the fastvision side (one difference measured alone)")
    ap.add_argument("--tag", default="", help="suffix of the fastvision run folders")
    ap.add_argument("--reuse-nnunet", action="store_true",
                    help="take the nnU-Net side from WORK/KIND/nnunet_side.json of an earlier run")
    ap.add_argument("--compare", nargs="+", metavar="NAME=GLOB",
                    help="no training: compare saved runs' curves, each group against the first (see compare)")
    ap.add_argument("--goal", nargs="+", metavar="NAME=GLOB",
                    help="no training: issue 41's goal per paired run, nnU-Net's group first (see goal)")
    args = ap.parse_args()
    if args.compare or args.goal:
        try:
            compare(args.compare) if args.compare else goal(args.goal)
            return None
        except ValueError as e:  # a bad NAME=GLOB, a file that is not a saved run, unequal run counts
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    from fastvision.data.formats.decathlon import kfold_split
    from fastvision.data.synth import load_all

    report = {"args": {k: str(v) for k, v in vars(args).items()}}
    for folder, kind, opts, did in DATASETS:
        if kind not in args.datasets:
            continue
        work = args.work / kind
        data = load_all().get(kind)(work / folder, seed=0, **opts)
        ids = sorted(Path(c["image"]).name.replace(".nii.gz", "")
                     for c in json.load(open(data / "dataset.json"))["training"])
        train, val = kfold_split(ids, 0, 5)
        runs = nnunet_runs(args, work, data, did, {"train": train, "val": val})
        nn = runs[0]
        extra = dict(kv.split("=", 1) for kv in args.set)
        extra = {k: json.loads(v) for k, v in extra.items()}
        sides = {**{"nnunet" + (f"-{i}" if i else ""): r for i, r in enumerate(runs)},
                 **{f"fastvision-{t}": fastvision_side(data, work, t, nn, args, extra, args.tag, val)
                    for t in args.trainers}}
        report[kind] = {"plan": {k: nn[k] for k in ("patch", "batch", "features", "strides", "spacing")},
                        **summarise(sides)}
        r = report[kind]
        print(f"{kind}: patch {nn['patch']} batch {nn['batch']}; Dice reached by all: {r['_dice_reached_by_all']:.3f}")
        for name in sides:
            x = r[name]
            print(f"  {name:<20} {x['it_per_s']:.3f} it/s  Dice {x['dice']:.3f} at {x['iterations']} it  "
                  f"to Dice {r['_dice_reached_by_all']:.3f}: {x['time_to_dice_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
