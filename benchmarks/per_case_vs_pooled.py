"""Per-case vs pooled Dice on generated spleen CT and BraTS (issue 11): how far apart the two
definitions are on the same predictions, and what the empty-truth convention changes.

Trains tiny CPU runs of ``unet3d-spleen-fast``, ``unet3d-brats`` and ``segresnet-brats`` (narrowed
networks, 32-voxel patches, 2 folds so 5 validation cases each; every second BraTS case has its
enhancing tumour relabelled as core, so ET is empty in its truth), then evaluates each run's last
checkpoint on its validation cases three times, with ``task.args.empty`` = ignore (MONAI), one
(BraTS) and zero (seed 000's TF formula). Per-case and pooled figures come from the same
evaluation pass (``SegEvaluator`` keeps both), so their difference is the definition alone.

Usage: ``python benchmarks/per_case_vs_pooled.py [--epochs 20] [--out DIR] [--json FILE]``.
Prints Markdown tables. A metric-definition check on tiny synthetic data, not a result on real data.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

import fastvision
from fastvision.api import load_run
from fastvision.data.synth.medical import synth_brats, synth_spleen
from fastvision.engine import evaluate, make_loader, runtime

RUNS = {  # recipe -> (dataset kind, overrides that shrink it to a CPU)
    "unet3d-spleen-fast": ("spleen", {"model.args.filters": [8, 16, 32, 64, 128],
                                      "data.args.target_spacing": [3.0, 3.0, 3.0], "data.args.patch_size": [32, 32, 16],
                                      "task.args.sliding_window.roi_size": [32, 32, 16]}),
    "unet3d-brats": ("brats", {"model.args.filters": [8, 16, 32, 64], "optim.lr": 0.002,
                               "data.args.patch_size": [32, 32, 32],
                               "task.args.sliding_window.roi_size": [32, 32, 32]}),
    "segresnet-brats": ("brats", {"model.args.init_filters": 8, "optim.lr": 0.001,
                                  "data.args.patch_size": [32, 32, 32],
                                  "task.args.sliding_window.roi_size": [32, 32, 32]}),
}


def drop_enhancing(task01: Path) -> list[str]:
    """Relabel the enhancing tumour (MSD id 3) of every second case as non-enhancing core (2), so
    ET is empty in their truth, as in many low-grade BraTS cases; returns those case ids."""
    import nibabel as nib
    import numpy as np

    changed = []
    for i, f in enumerate(sorted((task01 / "labelsTr").glob("*.nii.gz"))):
        if i % 2:
            img = nib.load(str(f))
            lab = np.asarray(img.dataobj).copy()
            lab[lab == 3] = 2
            nib.save(nib.Nifti1Image(lab.astype(np.uint8), img.affine, img.header), str(f))
            changed.append(f.name.split(".")[0])
    return changed


def train(recipe: str, data: Path, out: Path, epochs: int, seed: int) -> Path:
    kind, over = RUNS[recipe]
    os.environ["FASTVISION_CACHE"] = str(out / "cache")
    fastvision.train(recipe, out=str(out / recipe), data=str(data), epochs=epochs, device="cpu", amp="off",
                     seed=seed, batch_size=2, **{"train.val_every": epochs, "train.target": None, "examples": 0,
                                                 "data.args.num_folds": 2, "data.args.workers": 2,
                                                 "data.num_workers": 0, "data.loader": "threads", **over})
    return out / recipe


def evaluate_conventions(run_dir: Path) -> dict[str, dict[str, float]]:
    run, _ = load_run(run_dir, "cpu")
    loader = make_loader(run.val_set, run.task, run.cfg, 1, False, run.device)
    precision = runtime.Precision("off", run.device)
    out = {}
    for empty in ("ignore", "one", "zero"):
        run.task.empty = empty
        out[empty] = evaluate(run.model, run.task, loader, run.device, precision)
    out["cases"] = len(run.val_set)
    return out


def table(recipe: str, res: dict) -> str:
    keys = [k for k in res["one"] if k.startswith("dice") and "_case" not in k and k != "val_loss"]
    lines = [f"**{recipe}** ({res['cases']} validation cases)", "",
             "| metric | empty=ignore (MONAI) | empty=one (BraTS) | empty=zero (seed 000) |", "|---|---:|---:|---:|"]
    for k in keys:
        lines.append(f"| `{k}` | " + " | ".join(f"{res[e][k]:.4f}" for e in ("ignore", "one", "zero")) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    out = a.out or Path(tempfile.mkdtemp(prefix="per-case-"))
    data = {"spleen": synth_spleen(out / "Task09", seed=a.seed, cases=10, test_cases=0, size=32, zoom=2.0),
            "brats": synth_brats(out / "Task01", seed=a.seed, cases=10, test_cases=0, size=32)}
    print("no enhancing tumour in:", ", ".join(drop_enhancing(data["brats"])), flush=True)
    results = {}
    for recipe, (kind, _) in RUNS.items():
        results[recipe] = evaluate_conventions(train(recipe, data[kind], out, a.epochs, a.seed))
        print(table(recipe, results[recipe]), "\n", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
