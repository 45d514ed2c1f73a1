"""Re-score finished fastvision runs of train_vs_nnunet.py with another ``task.args.sliding_window.style``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/runs/2026-12-02-predict-parity/rescore.py \
        --work /tmp/s53/w --style nnunet --out OUT IN.json ...

Each IN.json is a ``train_vs_nnunet.py --json`` report; its run folder (``run-nnunet<tag>`` under ``--work``/<set>,
the set and tag taken from the file name: ``fv<prec>-<set>-r<r>.json`` -> ``-p<prec>-r<r>``) still holds the step
checkpoints. Every checkpoint is copied with the style set, scored by ``score_as_nnunet`` (the same function,
cases and Dice as the run), and the report is written to OUT with the curve's Dice replaced (``dice_before``
keeps the old one). Training is not repeated: the style changes the prediction, not the weights."""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from train_vs_nnunet import score_as_nnunet  # noqa: E402

from fastvision.data.formats.decathlon import kfold_split  # noqa: E402
from fastvision.engine import checkpoint  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--work", type=Path, required=True)
p.add_argument("--style", default="nnunet", choices=("nnunet", "monai"))
p.add_argument("--out", type=Path, required=True)
p.add_argument("reports", nargs="+", type=Path)
a = p.parse_args()
a.out.mkdir(parents=True, exist_ok=True)
for f in a.reports:
    m = re.match(r"fv(\w+?)-(\w+)-r(\d+)\.json", f.name)
    if not f.is_file() or m is None:
        p.error(f"{f}: not a train_vs_nnunet.py report named fv<prec>-<set>-r<round>.json")
    if not (a.work / m[2]).is_dir():
        p.error(f"{a.work / m[2]}: no such folder (--work: train_vs_nnunet.py's --work)")
    kind = m[2]
    data = next((a.work / kind).glob("Task*"))
    ids = sorted(Path(c["image"]).name.replace(".nii.gz", "")
                 for c in json.load(open(data / "dataset.json"))["training"])
    _, val = kfold_split(ids, 0, 5)
    run = a.work / kind / f"run-nnunet-p{m[1]}-r{m[3]}"
    rep = json.load(open(f))
    side = rep[kind]["fastvision-nnunet"]
    dst = a.out / "runs" / run.name
    (dst / "checkpoints").mkdir(parents=True, exist_ok=True)
    for point in side["curve"]:
        name = f"step-{point['iterations']:08d}.pt"
        ck = checkpoint.load(run / "checkpoints" / name)
        ck["config"]["task"]["args"]["sliding_window"]["style"] = a.style
        torch.save(ck, dst / "checkpoints" / name)
    curve = copy.deepcopy(side["curve"])
    for point in curve:
        point["dice_before"] = point["dice"]
        point["dice"] = point["dice_preprocessed"]  # score_as_nnunet moves "dice" to "dice_preprocessed"
    score_as_nnunet(dst, data, val, curve)
    side["curve"] = curve
    side["style"] = a.style
    json.dump(rep, open(a.out / f.name, "w"), indent=1)
    print(f.name, " ".join(f"{p['dice_before']:.3f}->{p['dice']:.3f}" for p in curve), flush=True)
