"""What step checkpoints cost: ``train.checkpoint_every: 50`` against none, in ``fastvision train``.

For each recipe, rounds alternate a run without step checkpoints and one with
``train.checkpoint_every=50`` (the same seed, data and steps: two epochs, each batch of the small
generated set echoed ``data.repeats`` times to make long epochs, validation at the end only),
through ``fastvision.api.run_training``, the path ``fastvision train`` takes. Reported per recipe: the
median training time (``train_time_s``: the epochs' steps, without validation and the epoch-end
checkpoint) of each setting and their ratio (the step-time overhead), the training thread's
stall per checkpoint (wait for the previous write + CPU snapshot), the time from a step's end to
its checkpoint being durable on disk (fsync + rename), and the checkpoint size. Data are generated
in the real file formats (PNG microscopy, NIfTI spleen) at CPU sizes.

    OMP_NUM_THREADS=2 python benchmarks/checkpoint_every.py [--rounds 3] [--every 50] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from fastvision import config
from fastvision.api import run_training
from fastvision.data.synth import load_all

RECIPES = {  # recipe -> (synth kind, synth options, CPU-sized overrides)
    "unet2d-microscopy": ("microscopy", {"count": 60, "size": 64},  # 48 to train: 12 steps x 10 repeats
                          ["data.args.image_size=[64,64]", "train.batch_size=4", "data.repeats=10"]),
    "unet3d-spleen-fast": ("spleen", {"cases": 8, "test_cases": 0, "size": 48},  # 6 to train: 3 steps x 25
                           ["data.args.patch_size=[32,32,32]", "task.args.sample_shape=[1,32,32,32]",
                            "task.args.sliding_window.roi_size=[32,32,32]", "data.args.num_folds=4",
                            "train.batch_size=2", "data.cache_dir=null", "data.val_batch_size=1", "data.repeats=25"]),
}


def _run(recipe: str, data: Path, out: Path, epochs: int, every: int | None) -> dict:
    _, _, tiny = RECIPES[recipe]
    sets = [f"data.args.path={data}", "train.device=cpu", f"train.epochs={epochs}", "train.val_every=1000",
            "train.target=null", "examples=0", "train.log_every=1000", "train.seed=0", *tiny]
    if every:
        sets.append(f"train.checkpoint_every={every}")
    extra = [config.parse_override(s) for s in sets] + [{"train": {"amp": "off"}}]  # YAML reads `off` as False
    summary = run_training(recipe, out=str(out), extra=extra, progress=False)
    last = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    return {"train_s": summary["train_time_s"], "stall_s": summary["checkpoint_stall_mean_s"],
            "durable_max_s": summary["checkpoint_durable_max_s"],
            "step_checkpoints": summary["checkpoints_written"] - epochs,
            "steps": last["step"], "mb": (out / "checkpoints" / "last.pt").stat().st_size / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--json")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-every-"))
    result = {"epochs": args.epochs, "every": args.every, "rounds": args.rounds, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.machine(), "recipes": {}}
    for recipe in args.recipes.split(","):
        kind, opts, _ = RECIPES[recipe]
        data = load_all().get(kind)(root / kind, seed=0, **opts)
        _run(recipe, data, root / f"{recipe}-warm", 1, None)  # imports, caches and allocator warm
        off, on = [], []
        for r in range(args.rounds):  # interleaved: the machine's drift hits both settings alike
            off.append(_run(recipe, data, root / f"{recipe}-off-{r}", args.epochs, None))
            on.append(_run(recipe, data, root / f"{recipe}-on-{r}", args.epochs, args.every))
        steps, step_ckpts = on[0]["steps"], on[0]["step_checkpoints"]
        med_off, med_on = statistics.median(x["train_s"] for x in off), statistics.median(x["train_s"] for x in on)
        result["recipes"][recipe] = {
            "train_s_without": med_off, "train_s_with": med_on, "overhead_ratio": med_on / med_off,
            "per_round_ratio": [b["train_s"] / a["train_s"] for a, b in zip(off, on, strict=True)],
            "ms_per_checkpoint_from_train_time": 1000 * (med_on - med_off) / step_ckpts,
            "stall_ms_median": 1000 * statistics.median(x["stall_s"] for x in on),
            "durable_ms_max": 1000 * max(x["durable_max_s"] for x in on),
            "steps": steps, "step_checkpoints_per_run": step_ckpts, "checkpoint_mb": on[0]["mb"],
            "step_ms_without": 1000 * med_off / steps}
        print(json.dumps({recipe: result["recipes"][recipe]}, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
