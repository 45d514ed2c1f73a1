"""Exact resume from a shard set, and a killed ``data shard``.

1. A 2-rank torchrun job (CPU, gloo) trains resnet18-imagefolder from tiny shards, uninterrupted.
2. The same job is killed with SIGKILL (the whole process group) after its step-3 checkpoint (mid
   epoch 0), then continued with ``--resume auto`` at 2 ranks: its final weights are compared with 1.
3. The killed run's checkpoint position is continued at 1, 2 and 3 ranks by the training sampler
   (accumulation keeps the global batch): the global batches from the resume point are compared.
4. ``data shard`` of ``--big`` (a folder of JPEGs) is killed with SIGKILL after ``--kill-after`` s,
   then rerun: every shard left by the killed writer is whole, and the finished set is byte-identical
   to an uninterrupted write.

    python benchmarks/shards_resume.py --work /tmp/shardresume --big /tmp/shardbench/src
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastvision.data.formats.shard_sets import build_shards  # noqa: E402
from fastvision.data.shards.writer import write_shards  # noqa: E402
from fastvision.data.synth import load_all  # noqa: E402
from fastvision.distributed.samplers import TrainSampler  # noqa: E402

SETS = ["data.args.image_size=32", "data.args.resize_size=36", "task.args.num_classes=3", "model.args.num_classes=3",
        "train.target=null", "examples=0", "train.amp=off", "train.checkpoint_every=1", "train.keep_checkpoints=20",
        "data.num_workers=1", "train.seed=4"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _job(data: Path, out: Path, nproc: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "fastvision.cli", "train", "resnet18-imagefolder", "--data", str(data), "--out", str(out),
           "--device", "cpu", "--epochs", "2", "--batch-size", "2", "--resume", "auto"]
    for s in SETS:
        cmd += ["--set", s]
    return cmd


def _weights(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]


def _kill_after(cmd: list[str], ready, timeout: float = 600) -> float:
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    t0 = time.perf_counter()
    while proc.poll() is None and not ready() and time.perf_counter() - t0 < timeout:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return time.perf_counter() - t0


def follows_the_order(data: Path, world: int, per_rank: int, start: int, epoch: int = 0) -> tuple[bool, int]:
    """Whether step k of ``world`` ranks (``per_rank`` each) from sample ``start`` reads exactly the
    samples at positions ``[start + k G, start + (k+1) G)`` of the epoch's order (G the global batch),
    for every step inside the epoch; and how many steps were compared."""
    from fastvision.distributed.samplers import _mix_seed

    ds = build_shards(str(data), "imagefolder", {}).train
    order = ds.epoch_order(torch.Generator().manual_seed(_mix_seed(4, epoch)))
    ranks = []
    for r in range(world):
        s = TrainSampler(len(ds), num_replicas=world, rank=r, seed=4, order=ds.epoch_order)
        s.set_epoch(epoch, start=start)
        idx = list(s)
        ranks.append([idx[i:i + per_rank] for i in range(0, len(idx) - len(idx) % per_rank, per_rank)])
    g = world * per_rank
    steps = (len(order) - start) // g
    ok = all(set().union(*(set(b[k]) for b in ranks)) == set(order[start + k * g:start + (k + 1) * g])
             for k in range(steps))
    return ok, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/shardresume")
    ap.add_argument("--big", help="a JPEG folder for the killed `data shard` (step 4)")
    ap.add_argument("--kill-after", type=float, default=2.0)
    args = ap.parse_args()
    work = Path(args.work)
    src = load_all().get("imagenet")(work / "src", seed=0, classes=3, per_class=8, val_per_class=1, size=40)
    data = work / "shards"
    write_shards(src, data, "16KB")
    report: dict = {}
    subprocess.run(_job(data, work / "whole", 2), env=_env(), cwd=ROOT, check=True, capture_output=True)
    step3 = work / "cut" / "checkpoints" / "step-00000003.pt"
    _kill_after(_job(data, work / "cut", 2), step3.exists)
    position = torch.load(step3, weights_only=True)["position"]
    subprocess.run(_job(data, work / "cut", 2), env=_env(), cwd=ROOT, check=True, capture_output=True)
    same = all(torch.equal(a, b) for a, b in zip(_weights(work / "whole").values(), _weights(work / "cut").values(),
                                                  strict=True))
    report["kill -9 at 2 ranks, resume at 2: weights identical"] = same
    report["checkpoint position"] = position
    for world, per_rank in ((1, 4), (2, 2), (3, 2)):
        ok, steps = follows_the_order(data, world, per_rank, position["samples"])
        report[f"resume at {world} rank(s), batch {per_rank}: steps read the epoch order from the position"] = (
            f"{ok} ({steps} steps compared)")
    if args.big:
        ref = work / "big-ref"
        write_shards(args.big, ref, "16MB")
        cut = work / "big-cut"
        cmd = [sys.executable, "-m", "fastvision", "data", "shard", args.big, str(cut), "--shard-size", "16MB"]
        _kill_after(cmd, lambda: False, timeout=args.kill_after)
        left = sorted(p.name for p in cut.glob("*.tar"))
        whole = all((cut / n).read_bytes() == (ref / n).read_bytes() for n in left)
        subprocess.run(cmd, env=_env(), cwd=ROOT, check=True, capture_output=True)
        same_set = all((cut / p.name).read_bytes() == p.read_bytes() for p in ref.iterdir() if p.is_file())
        report["data shard killed: shards left"] = f"{len(left)} of {len(list(ref.glob('*.tar')))}"
        report["data shard killed: every shard left whole"] = whole
        report["data shard rerun: byte-identical to an uninterrupted write"] = same_set
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
