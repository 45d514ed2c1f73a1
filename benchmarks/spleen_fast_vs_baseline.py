"""Time to a target Dice on generated spleen CT: unet3d-spleen-fast vs unet3d-spleen-baseline vs MONAI.

Seed 003's comparison (MONAI's fast-training tutorial: 13,063 s baseline vs 120 s fast to Dice 0.94
on an A100), shrunk to run in minutes on a CPU: small generated volumes (``data synth spleen`` with
``--zoom`` so the whole body is in view), coarser target spacing, small patches, and every network
narrowed by the same factor (``--width``). All three pipelines see the same files, the same
preprocessing (RAS, resampling, CT window -57..164 HU -> 0..1, crop to foreground), the same fold,
patch size and validation (sliding window; the mean over validation cases of each case's foreground
Dice, the tutorial's ``DiceMetric`` and the recipes' ``dice``; until issue 41 MONAI's side pooled the
cases) and stop at the same target. ``spleen_levers.py`` reuses both runners with a validation cadence
(``val_every``, MONAI's ``val_interval``) and window (``roi``) of its own, and ``--set`` overrides;
``monai_val_window: whole`` / ``halves`` validates MONAI's side in fastvision's ``task.args.val_window``
layout (:func:`monai_window`).

1. ``fastvision.train("unet3d-spleen-fast", target=...)``: DiceCE, SGD 0.2, thread loader.
2. ``fastvision.train("unet3d-spleen-baseline", target=...)``: Dice, Adam 2e-4, process loader.
3. MONAI's fast-tutorial pipeline written with MONAI: ``CacheDataset`` + ``ThreadDataLoader`` +
   ``DiceCELoss`` + SGD and MONAI's ``UNet`` (residual units, batch norm), the fast recipe's settings.

Times: ``train_s`` sums training epochs only (what fastvision's time to target counts: no
validation, no set-up); ``wall_s`` is everything from dataset loading to the target (preprocessing
and caching from scratch: each run gets a fresh cache folder), and on fastvision's side to the end of
``train``, whose ``curves.png`` and summary come after the target; ``target_wall_s`` stops both clocks
at the validation that reached the target (fastvision's ``time_to_target_wall_s`` plus its set-up
before ``fit``). Every library's modules are imported
before its clock starts (MONAI's at the top of ``monai_run``, fastvision's at the top of this script).
Both run in this process under one host-memory setting: ``train.cpu_heap``'s default, set at the top
(``runtime.set_heap``; fastvision's build would set it after the first run otherwise).

Usage: ``python benchmarks/spleen_fast_vs_baseline.py [--target 0.8] [--max-epochs 150] [--out DIR]
[--repeats 5 --baseline-once]``. Prints a Markdown table (medians over the rounds, and each round's
fast / MONAI ratios); ``--json`` also writes every round.
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
import torch

import fastvision
import fastvision.api  # noqa: F401  (library imports before the clocks, as for MONAI's below)
import fastvision.engine  # noqa: F401
from fastvision.config import TrainConfig
from fastvision.data.formats.decathlon import kfold_split, read_dataset_json
from fastvision.data.synth.medical import synth_spleen
from fastvision.engine import runtime

# One process, one allocator: fastvision's build sets train.cpu_heap process-wide, so it is set here,
# before any run, and MONAI's runs share it (the comparison does not credit fastvision with it).
runtime.set_heap(TrainConfig().cpu_heap)


def fastvision_run(recipe: str, data: Path, out: Path, a: argparse.Namespace, filters: list[int],
                   batch: int, extra: dict | None = None, name: str | None = None) -> dict:
    """One fastvision run to the target; returns seconds and epochs. ``extra``: ``--set`` overrides on
    top of the benchmark's (a lever); ``name``: the run's folder (default: the recipe's name)."""
    name = name or recipe
    cache = out / f"cache-{name}"
    if not getattr(a, "warm_cache", False):
        shutil.rmtree(cache, ignore_errors=True)  # preprocessing from scratch
    os.environ["FASTVISION_CACHE"] = str(cache)
    shutil.rmtree(out / name, ignore_errors=True)
    t0 = time.perf_counter()
    s = fastvision.train(recipe, out=str(out / name), data=str(data), device="cpu", amp="off",
                         target=f"dice={a.target}", seed=a.seed, **{
                             "train.epochs": a.max_epochs, "train.batch_size": batch,
                             "train.val_every": getattr(a, "val_every", 1), "examples": 0,
                             "model.args.filters": filters, "data.args.target_spacing": a.spacing,
                             "data.args.patch_size": a.patch,
                             "task.args.sliding_window.roi_size": getattr(a, "roi", None) or a.patch,
                             "task.args.sliding_window.sw_batch_size": 4,
                             **({"data.num_workers": 2} if recipe.endswith("baseline") else {}), **(extra or {})})
    wall = time.perf_counter() - t0
    after = s["wall_time_s"] - s.get("time_to_target_wall_s", s["wall_time_s"])  # curves.png, summary
    return {"reached": bool(s.get("target_reached")), "train_s": s.get("time_to_target_s", s["train_time_s"]),
            "wall_s": wall, "target_wall_s": wall - after, "epochs": s.get("target_epoch", s["epochs"]),
            "dice": s.get("dice"), "curve": dice_curve(out / name / "metrics.jsonl")}


def dice_curve(metrics: Path) -> list[tuple[int, float]]:
    """(epoch, per-case Dice) of every validation of a fastvision run (its ``metrics.jsonl``)."""
    curve = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        rec = json.loads(line)
        step, data = rec.get("step"), rec.get("data") or {}
        if isinstance(step, list) and len(step) == 1 and "dice" in data:
            curve.append((step[0] + 1, round(float(data["dice"]), 4)))
    return curve


def monai_window(a: argparse.Namespace, shape: tuple[int, ...], divisor: int) -> tuple[list[int], float]:
    """MONAI's validation window and overlap: the benchmark's ``roi`` (overlap 0.25), or with
    ``monai_val_window`` ``whole`` / ``halves`` the layout of fastvision's ``task.args.val_window``
    (:func:`fastvision.tasks.seg_eval.validation_window`): the volume rounded up to the network's
    divisor in one window, or two along its longest axis (overlap 0; MONAI pads symmetrically, as
    fastvision, and places the two windows at 0 and the far end, as fastvision)."""
    how = getattr(a, "monai_val_window", "roi")
    if how == "roi":
        return list(getattr(a, "roi", None) or a.patch), 0.25
    roi = [-(-s // divisor) * divisor for s in shape]
    if how == "halves":
        k = max(range(len(shape)), key=lambda i: shape[i])
        half = (shape[k] + 1) // 2
        roi[k] = min(roi[k], -(-half // divisor) * divisor)
    return roi, 0.0


def monai_run(data: Path, a: argparse.Namespace, filters: list[int]) -> dict:
    """MONAI's fast-training tutorial pipeline on the same files, fold, patches and target."""
    from monai.data import CacheDataset, ThreadDataLoader
    from monai.inferers import sliding_window_inference
    from monai.losses import DiceCELoss
    from monai.networks.layers import Norm
    from monai.networks.nets import UNet
    from monai.transforms import (
        Compose,
        CropForegroundd,
        EnsureChannelFirstd,
        LoadImaged,
        Orientationd,
        RandCropByPosNegLabeld,
        ScaleIntensityRanged,
        Spacingd,
        SpatialPadd,
    )
    from monai.utils import set_determinism

    set_determinism(seed=a.seed)  # as the tutorial: its random crops draw from seeded generators
    t0 = time.perf_counter()
    cases = read_dataset_json(data)["training"]
    train_ids, val_ids = kfold_split([c["id"] for c in cases], 0, 5, 0)  # fastvision's fold 0
    files = {c["id"]: {"image": str(c["image"][0]), "label": str(c["label"])} for c in cases}
    prep = [LoadImaged(["image", "label"]), EnsureChannelFirstd(["image", "label"]),
            Orientationd(["image", "label"], axcodes="RAS"),
            Spacingd(["image", "label"], pixdim=a.spacing, mode=("bilinear", "nearest")),
            ScaleIntensityRanged("image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
            CropForegroundd(["image", "label"], source_key="image", allow_smaller=True)]
    rand = [SpatialPadd(["image", "label"], spatial_size=a.patch),
            RandCropByPosNegLabeld(["image", "label"], label_key="label", spatial_size=a.patch, pos=1, neg=1,
                                   num_samples=1, image_key="image", image_threshold=0)]  # the tutorials' crop
    train_ds = CacheDataset([files[i] for i in train_ids], Compose(prep + rand), num_workers=2, progress=False)
    val_ds = CacheDataset([files[i] for i in val_ids], Compose(prep), num_workers=2, progress=False)
    loader = ThreadDataLoader(train_ds, batch_size=4, shuffle=True, num_workers=0, drop_last=True)
    model = UNet(3, 1, 2, channels=filters, strides=(2,) * (len(filters) - 1), num_res_units=2, norm=Norm.BATCH,
                 dropout=0.2)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False, squared_pred=True, batch=True,
                         lambda_dice=0.5, lambda_ce=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=4e-5)
    train_s, dice, curve = 0.0, 0.0, []
    for epoch in range(a.max_epochs):
        model.train()
        e0 = time.perf_counter()
        for batch in loader:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            opt.step()
        train_s += time.perf_counter() - e0
        if (epoch + 1) % getattr(a, "val_every", 1) and epoch + 1 != a.max_epochs:
            continue  # the tutorial's val_interval
        model.eval()
        scores = []
        with torch.no_grad():  # the mean over cases of each case's foreground Dice: the tutorial's DiceMetric
            for item in val_ds:
                roi, overlap = monai_window(a, tuple(item["image"].shape[1:]), 2 ** (len(filters) - 1))
                logits = sliding_window_inference(item["image"][None].as_tensor(), roi, 4, model, mode="constant",
                                                  overlap=overlap)
                pred, lab = logits.argmax(1)[0] == 1, item["label"][0].as_tensor() == 1
                tp, fp, fn = int((pred & lab).sum()), int((pred & ~lab).sum()), int((~pred & lab).sum())
                scores.append(2 * tp / max(1, 2 * tp + fp + fn))
        dice = float(np.mean(scores))
        curve.append((epoch + 1, round(dice, 4)))
        if dice >= a.target:
            wall = time.perf_counter() - t0
            return {"reached": True, "train_s": train_s, "wall_s": wall, "target_wall_s": wall, "epochs": epoch + 1,
                    "dice": dice, "curve": curve}
    wall = time.perf_counter() - t0
    return {"reached": False, "train_s": train_s, "wall_s": wall, "target_wall_s": wall, "epochs": a.max_epochs,
            "dice": dice, "curve": curve}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float, default=0.8, help="foreground Dice to reach")
    p.add_argument("--max-epochs", type=int, default=150)
    p.add_argument("--cases", type=int, default=10)
    p.add_argument("--size", type=int, default=32, help="in-plane voxels of the generated CT")
    p.add_argument("--zoom", type=float, default=2.0, help="spacing multiplier of the generator")
    p.add_argument("--spacing", type=float, nargs=3, default=[3.0, 3.0, 3.0], help="target spacing, mm")
    p.add_argument("--patch", type=int, nargs=3, default=[32, 32, 16])
    p.add_argument("--width", type=int, default=4, help="divide every recipe's channel widths by this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="working folder (default: a temp folder)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved rounds (fast, baseline, MONAI per round); the table shows medians")
    p.add_argument("--baseline-once", action="store_true", help="run the slow baseline in the first round only")
    a = p.parse_args()
    # torch imports torch._dynamo (~3 s here) the first time any optimizer is built: import it now,
    # or whichever pipeline runs first pays it and the others get it free.
    import torch._dynamo  # noqa: F401
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "2"))))
    out = a.out or Path(tempfile.mkdtemp(prefix="spleen-bench-"))
    data = synth_spleen(out / "Task09", seed=a.seed, cases=a.cases, test_cases=0, size=a.size, zoom=a.zoom)
    fast = [w // a.width for w in (32, 64, 128, 256, 512)]  # fast recipe and MONAI tutorial widths
    base = [w // a.width for w in (16, 32, 64, 128, 256)]  # baseline recipe widths
    names = ["fastvision unet3d-spleen-fast", "fastvision unet3d-spleen-baseline",
             "MONAI fast tutorial (CacheDataset+ThreadDataLoader)"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(a.repeats):  # interleaved rounds: the machine's drift hits every pipeline alike
        sub = out / f"round{rep}"
        runs[names[0]].append(fastvision_run("unet3d-spleen-fast", data, sub, a, fast, 4))
        if rep == 0 or not a.baseline_once:
            runs[names[1]].append(fastvision_run("unet3d-spleen-baseline", data, sub, a, base, 2))
        runs[names[2]].append(monai_run(data, a, fast))
    rows = {n: {k: (float(np.median([r[k] for r in rs])) if k in ("train_s", "wall_s") else rs[0][k])
                for k in rs[0]} for n, rs in runs.items()}
    ref = rows[names[0]]
    print(f"\ntarget dice {a.target}, {a.cases} cases {a.size}^2 x zoom {a.zoom}, spacing {a.spacing}, "
          f"patch {a.patch}, widths fast {fast} / baseline {base}, max {a.max_epochs} epochs, "
          f"torch threads {torch.get_num_threads()}, {a.repeats} interleaved round(s): medians\n")
    print("| pipeline | reached | epochs | train s | wall s | final dice | train s / fast | wall s / fast |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        mark = "" if r["reached"] else ">"
        print(f"| {name} | {'yes' if r['reached'] else 'no'} | {mark}{r['epochs']} | {mark}{r['train_s']:.1f} | "
              f"{mark}{r['wall_s']:.1f} | {r['dice']:.3f} | {mark}{r['train_s'] / ref['train_s']:.2f} | "
              f"{mark}{r['wall_s'] / ref['wall_s']:.2f} |")
    if a.repeats > 1:  # each round's fast / MONAI ratio, side by side in that round
        ratios = [(f["wall_s"] / m["wall_s"], f["train_s"] / m["train_s"])
                  for f, m in zip(runs[names[0]], runs[names[2]], strict=True)]
        print("\nper round, fastvision fast / MONAI: wall " + ", ".join(f"{w:.2f}" for w, _ in ratios)
              + "; train " + ", ".join(f"{t:.2f}" for _, t in ratios)
              + f" (median wall {np.median([w for w, _ in ratios]):.2f}, "
                f"train {np.median([t for _, t in ratios]):.2f})")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                                      "rows": rows, "rounds": runs}, indent=2))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
