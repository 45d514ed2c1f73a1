"""Memory of a 2-rank CPU run of ``unet3d-spleen-fast``: does a node hold the data once?

Runs ``fastvision train unet3d-spleen-fast`` through the real CLI on generated spleen CT, once
with one rank and then with ``--nproc 2`` for several ``data.cache`` modes, and samples every
rank's memory every 0.1 s from /proc: the peak over time of the ranks' summed VmRSS, of their
summed PSS (proportional set size: a page shared by two processes counts half in each, so the
sum counts it once), and of what the node holds for them: non-shmem PSS plus every /dev/shm
entry the ranks mapped, whole (RSS and PSS count only the pages a rank touched, and the random
crops touch few of a mapped volume's pages: without the tmpfs files the shared cache would look
free). The figure to compare is the node total. Volumes are kept large
(``crop_foreground=false``) so the cached data, not the ~0.3 GB of torch per process, dominates.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shared_cache_rss.py [--cases 30] [--size 256]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
ROOT = Path(__file__).resolve().parents[1]


def _field(path: str, key: str) -> int:
    """A ``key:  N kB`` line of a /proc file, in bytes (0 when the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def ranks(root: int) -> list[int]:
    """The training processes under ``root``: those with LOCAL_RANK set, else ``root`` itself."""
    parent = _children()
    desc, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        desc += kids
        frontier += kids
    found = []
    for p in desc:
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if b"\0LOCAL_RANK=" in b"\0" + f.read():
                    found.append(p)
        except OSError:
            pass
    return found or [root]


def shm_files(pids: list[int]) -> set[str]:
    """Files under /dev/shm that the ranks have mapped (the node-shared cache's entries)."""
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/maps") as f:
                out |= {line.split(None, 5)[5].strip() for line in f if "/dev/shm/fastvision-" in line}
        except (OSError, IndexError):
            pass
    return out


def node_bytes(pids: list[int]) -> int:
    """What the node holds for the ranks: their non-shmem PSS plus every mapped /dev/shm file once
    (a tmpfs page counts whether or not a rank has touched it)."""
    private = sum(_field(f"/proc/{p}/smaps_rollup", "Pss") - _field(f"/proc/{p}/smaps_rollup", "Pss_Shmem")
                  for p in pids)
    shm = 0
    for path in shm_files(pids):
        try:
            shm += os.stat(path).st_size
        except OSError:
            pass
    return private + shm


def measure(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_rss = peak_pss = peak_node = 0
    n = 0
    while proc.poll() is None:
        pids = ranks(proc.pid)
        rss = sum(_field(f"/proc/{p}/status", "VmRSS") for p in pids)
        pss = sum(_field(f"/proc/{p}/smaps_rollup", "Pss") for p in pids)
        peak_rss, peak_pss, n = max(peak_rss, rss), max(peak_pss, pss), max(n, len(pids))
        peak_node = max(peak_node, node_bytes(pids))
        time.sleep(0.1)
    err = proc.stderr.read().decode()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return {"rss_gib": peak_rss / 2**30, "pss_gib": peak_pss / 2**30, "node_gib": peak_node / 2**30, "ranks": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=30, help="generated cases (one is the validation fold)")
    ap.add_argument("--size", type=int, default=256, help="in-plane edge in voxels")
    args = ap.parse_args()
    from fastvision.data.synth.medical import synth_spleen

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = synth_spleen(tmp / "spleen", seed=0, cases=args.cases, test_cases=0, size=args.size)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), FASTVISION_CACHE=str(tmp / "cache"))
        sets = [f"data.args.path={data}", "data.args.crop_foreground=false", "data.args.patch_size=[32,32,32]",
                f"data.args.num_folds={args.cases}", "task.args.sliding_window.roi_size=[128,128,128]",
                "model.args.filters=[4,8,16]", "train.batch_size=1", "train.steps_per_epoch=2", "train.target=null",
                "train.amp=off", "examples=0", "train.val_every=100"]
        base = [sys.executable, "-m", "fastvision", "train", "unet3d-spleen-fast", "--device", "cpu", "--epochs", "2"]
        rows = []
        warm = base + ["--out", str(tmp / "warm-disk")]
        for s in sets + ["data.cache=ram"]:  # cache_dir: auto -> fills through the disk cache
            warm += ["--set", s]
        measure(warm, env)  # preprocess once into the disk cache: every measured run reads it (a second run)
        for label, nproc, cache in [("1 rank, data.cache=gpu (recipe default; CPU device)", 1, "gpu"),
                                    ("1 rank, data.cache=ram", 1, "ram"),
                                    ("1 rank, data.cache=shared", 1, "shared"),
                                    ("2 ranks, data.cache=shared", 2, "shared"),
                                    ("2 ranks, data.cache=gpu (recipe default; CPU device)", 2, "gpu"),
                                    ("2 ranks, data.cache=ram (every item on each rank)", 2, "ram")]:
            cmd = base + ["--out", str(tmp / f"run-{nproc}-{cache}"), "--nproc", str(nproc)]
            for s in sets + [f"data.cache={cache}"]:
                cmd += ["--set", s]
            r = measure(cmd, env)
            rows.append((label, r))
            print(f"{label}: peak RSS {r['rss_gib']:.2f} GiB, peak PSS {r['pss_gib']:.2f} GiB, node total "
                  f"{r['node_gib']:.2f} GiB ({r['ranks']} ranks)", flush=True)
        one = rows[0][1]
        print("\n| run | ranks | peak RSS, ranks summed (GiB) | peak PSS, ranks summed (GiB) | peak node total (GiB) "
              "| node total vs 1 rank |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, r in rows:
            print(f"| {label} | {r['ranks']} | {r['rss_gib']:.2f} | {r['pss_gib']:.2f} | {r['node_gib']:.2f} "
                  f"| {r['node_gib'] / one['node_gib']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
