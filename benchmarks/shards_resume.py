"""Exact resume from a shard set, and a killed ``data shard``.

1. A 2-rank torchrun job (CPU, gloo) trains resnet18-imagefolder from tiny shards, uninterrupted.
2. The same job is killed with SIGKILL (torchrun and every worker: torchrun starts each worker in its own
   session, so its process group alone would leave them running) after its step-3 checkpoint (mid
   epoch 0), then continued with ``--resume auto`` at 2 ranks: its final weights are compared with 1.
3. The killed run's checkpoint (a copy of its run folder as the kill left it) is also resumed by real
   ``--resume auto`` torchrun jobs at 1 rank (accumulation 2 keeps the global batch 4) and at 3 ranks
   (batch 2: 4 is no multiple of 6, so by the documented rule training goes on at global batch 6 from
   the saved sample). Every job here runs ``fastvision train`` through this script's worker mode, which
   appends the ids of each micro-batch the training step consumes (``Task.item_ids``, the ids the step
   already reads for the guard's messages; the batch's ``id`` field) to ``IDS/rank<r>.jsonl``. A rank
   takes every ``world``-th sample of the epoch's order, so the ranks' batches interleaved give the
   job's sample sequence; each resumed job's must equal the uninterrupted job's from the checkpoint's
   position on, to the end of epoch 1. The sampler alone is also checked from that position at 1, 2
   and 3 ranks (the global batches compared).
4. ``data shard`` of ``--big`` (a folder of JPEGs) is killed with SIGKILL after ``--kill-after`` s,
   then rerun: every shard left by the killed writer is whole, and the finished set is byte-identical
   to an uninterrupted write.

    python benchmarks/shards_resume.py --work /tmp/shardresume --big /tmp/shardbench/src
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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


IDS = "SHARDS_RESUME_IDS"  # the worker mode's folder for the consumed ids


def _env(ids: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", IDS))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **({IDS: str(ids)} if ids else {})}


def _job(data: Path, out: Path, nproc: int) -> list[str]:
    """The torchrun job; its workers run this script's worker mode (``fastvision train``, ids recorded)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(Path(__file__).resolve()), "train", "resnet18-imagefolder", "--data", str(data), "--out", str(out),
           "--device", "cpu", "--epochs", "2", "--batch-size", "2", "--resume", "auto"]
    for s in SETS:
        cmd += ["--set", s]
    return cmd


def _worker() -> None:
    """One torchrun worker: ``fastvision train`` (argv as given), appending the ids of every micro-batch
    the training step consumes to ``$SHARDS_RESUME_IDS/rank<r>.jsonl``, one JSON list a line."""
    from fastvision.cli import entry
    from fastvision.tasks.base import Task, ids_text

    path = Path(os.environ[IDS]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    item_ids = Task.item_ids

    def record(self, batch):
        ids = item_ids(self, batch)
        with path.open("a") as f:
            f.write(json.dumps(ids_text(ids)) + "\n")
        return ids

    Task.item_ids = record
    sys.argv = ["fastvision", *sys.argv[1:]]
    entry()


def _sequence(ids: Path, world: int) -> list[str]:
    """The job's consumed sample sequence: rank r's j-th item of a step is the step's sample
    ``r + j * world``, so the ranks' batches interleaved give the order (micro-batches in turn)."""
    ranks = [[json.loads(line) for line in (ids / f"rank{r}.jsonl").read_text().splitlines()] for r in range(world)]
    seq: list[str] = []
    for batches in zip(*ranks, strict=True):
        for items in zip(*batches, strict=True):
            seq += items
    return seq


def _weights(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]


def _kill_after(cmd: list[str], ready, timeout: float = 600, env: dict | None = None) -> float:
    proc = subprocess.Popen(cmd, env=env or _env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    t0 = time.perf_counter()
    while proc.poll() is None and not ready() and time.perf_counter() - t0 < timeout:
        time.sleep(0.01)
    job = _descendants(proc.pid)  # torchrun starts each worker in a session of its own: its group misses them
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in job:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in job):  # gone before the copy
        time.sleep(0.01)
    return time.perf_counter() - t0


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc's parent ids)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [root]
    while todo:
        top = todo.pop()
        kids = [pid for pid, pp in parent.items() if pp == top]
        found += kids
        todo += kids
    return found


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
    for name in ("whole", "cut", "cut-at-1", "cut-at-3", "ids-whole", "ids-killed", "ids-1", "ids-2", "ids-3",
                 "big-ref", "big-cut"):
        shutil.rmtree(work / name, ignore_errors=True)  # a rerun must train, not resume a finished run
    t0 = time.perf_counter()
    subprocess.run(_job(data, work / "whole", 2), env=_env(work / "ids-whole"), cwd=ROOT, check=True,
                   capture_output=True)
    whole = _sequence(work / "ids-whole", 2)
    step3 = work / "cut" / "checkpoints" / "step-00000003.pt"
    _kill_after(_job(data, work / "cut", 2), step3.exists, env=_env(work / "ids-killed"))
    position = torch.load(step3, weights_only=True)["position"]
    resumed_at = {k: v for k, v in torch.load(work / "cut" / "checkpoints" / "last.pt", weights_only=True)[
        "position"].items() if k in ("epoch", "step", "samples")}
    for world in (1, 3):  # the killed job's folder as the kill left it, for the resumes at another world size
        shutil.copytree(work / "cut", work / f"cut-at-{world}", symlinks=True)
    subprocess.run(_job(data, work / "cut", 2), env=_env(work / "ids-2"), cwd=ROOT, check=True, capture_output=True)
    same = all(torch.equal(a, b) for a, b in zip(_weights(work / "whole").values(), _weights(work / "cut").values(),
                                                  strict=True))
    report["kill -9 at 2 ranks, resume at 2: weights identical"] = same
    report["checkpoint position"] = position
    report["position --resume auto continues from (last.pt as the kill left it)"] = resumed_at
    start = resumed_at["epoch"] * len(whole) // 2 + resumed_at["samples"]  # 2 epochs of equal length
    report["uninterrupted job: samples consumed"] = len(whole)
    for world in (2, 1, 3):
        run = work / ("cut" if world == 2 else f"cut-at-{world}")
        if world != 2:
            res = subprocess.run(_job(data, run, world), env=_env(work / f"ids-{world}"), cwd=ROOT, capture_output=True,
                                 text=True)
            assert res.returncode == 0, res.stderr[-3000:]
            lines = [ln.split("resuming a ", 1)[1] for ln in res.stderr.splitlines() if "resuming a " in ln]
            report[f"resume at {world}: rule applied"] = lines[0] if lines else "(no line)"
        got = _sequence(work / f"ids-{world}", world)
        report[f"kill -9 at 2, resume at {world} rank(s): consumed sequence == uninterrupted from sample {start}"] = (
            f"{got == whole[start:]} ({len(got)} samples vs {len(whole) - start})")
        if world != 2:
            a, b = _weights(work / "whole"), _weights(run)  # not expected equal: other reductions, aug streams
            report[f"resume at {world}: final parameters, max |diff| vs uninterrupted"] = max(
                (a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point() and "running_" not in k)
    report["seconds (training jobs)"] = round(time.perf_counter() - t0)
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
    _worker() if os.environ.get(IDS) else main()
