"""What the pipelined ``fastvision predict`` gains, and what one large case costs in host memory.

Speed: generated spleen CT cases (``fastvision data synth spleen``), one model (the
``unet3d-spleen-baseline`` network built by the engine's ``build_components``, random weights:
speed does not depend on them; the recipe's preprocessing: resampling to 1.5 x 1.5 x 2 mm, CT
window, foreground crop, and back at export) predicted through ``inference.nifti.predict_cases``, the function
``fastvision predict`` runs, with ``overlap=True`` (reader and writer threads beside the network)
and ``overlap=False`` (read, predict, write one after another), in interleaved rounds. Reported:
median wall time of each and the ratio per round.

Memory (``--memory``, in a fresh process per mode): the peak resident set (VmRSS polled every 2 ms) over one
predict of a single case of ``--edge``^2 x slices voxels, minus the resident set before it,
divided by the voxels on the network's grid; next to ``docs/segmentation3d.md``'s estimate
``4 * (4 K + 2 C + 1)`` bytes per voxel (K = 2 classes, C = 1 channel: 44).

Usage: OMP_NUM_THREADS=1 python benchmarks/predict_pipeline.py [--cases 8] [--size 96] [--rounds 3]
       OMP_NUM_THREADS=1 python benchmarks/predict_pipeline.py --memory --size 160
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from fastvision import config
from fastvision.data.synth import load_all
from fastvision.engine.build import build_components
from fastvision.inference.nifti import predict_cases, prediction_cases
from fastvision.inference.volumes import Ensemble

OVERRIDES = {"task": {"args": {"sliding_window": {"roi_size": [64, 64, 64], "overlap": 0.5, "mode": "gaussian",
                                                  "sw_batch_size": 2}}},
             "model": {"args": {"filters": [8, 16, 32, 64]}}}
# --memory: the network's grid is the input's, so bytes per voxel are per input voxel
SAME_GRID = {"data": {"args": {"target_spacing": None, "crop_foreground": False}}}


def _setup(data: Path, *more: dict):
    cfg = config.load("unet3d-spleen-baseline", [OVERRIDES, *more, {"data": {"args": {"path": str(data)}}}])
    torch.manual_seed(0)
    task, model = build_components(cfg, {}, "cpu")
    return cfg, Ensemble(task, model.eval(), [], torch.device("cpu"))


def _run(cfg, ens, cases, out: Path, overlap: bool) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        predict_cases(ens, cfg, cases, out, force=True, overlap=overlap)
    return time.perf_counter() - t0


def speed(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = load_all().get("spleen")(Path(tmp) / "sp", seed=0, cases=2, test_cases=args.cases, size=args.size)
        cfg, ens = _setup(data)
        cases = prediction_cases(sorted((data / "imagesTs").glob("*.nii.gz")))
        _run(cfg, ens, cases[:1], Path(tmp) / "warm", True)  # warm-up
        times = {"serial": [], "pipelined": []}
        for r in range(args.rounds):
            order = ("serial", "pipelined") if r % 2 == 0 else ("pipelined", "serial")
            for mode in order:
                times[mode].append(_run(cfg, ens, cases, Path(tmp) / f"{mode}{r}", mode == "pipelined"))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"cases": args.cases, "size": args.size, "rounds": args.rounds, "times_s": times, "median_s": med,
            "ratio_pipelined_over_serial": med["pipelined"] / med["serial"],
            "ratio_per_round": [p / s for p, s in zip(times["pipelined"], times["serial"], strict=True)]}


def _rss() -> int:
    """This process's resident set now (bytes), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_child(data: Path, overlap: bool) -> dict:
    """In a fresh process (the data written by the parent, so its generation is not the peak)."""
    import nibabel as nib

    with tempfile.TemporaryDirectory() as tmp:
        cfg, ens = _setup(data, SAME_GRID)
        cases = prediction_cases(sorted((data / "imagesTs").glob("*.nii.gz")))
        voxels = int(torch.tensor(nib.load(str(cases[0]["image"][0])).shape).prod())
        import scipy.ndimage  # noqa: F401  (loaded by predict's first case otherwise: not the case's memory)

        before = _rss()  # imports and the model
        peak, done = [before], threading.Event()

        def sample() -> None:  # ru_maxrss would be the import-time high-water mark: poll instead
            while not done.wait(0.002):
                peak.append(_rss())

        sampler = threading.Thread(target=sample)
        sampler.start()
        _run(cfg, ens, cases, Path(tmp) / "out", overlap)
        done.set()
        sampler.join()
        peak = max(peak)
    return {"voxels": voxels, "rss_before_bytes": before, "rss_peak_bytes": peak,
            "bytes_per_voxel": (peak - before) / voxels, "estimate_bytes_per_voxel": 4 * (4 * 2 + 2 * 1 + 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=8)
    p.add_argument("--size", type=int, default=96, help="in-plane edge of the generated cases (voxels)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--child", choices=["serial", "pipelined"], help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--json")
    args = p.parse_args()
    if args.child:
        print(json.dumps(memory_child(Path(args.data), args.child == "pipelined")))
        return
    if args.memory:
        res = {}
        with tempfile.TemporaryDirectory() as tmp:
            data = load_all().get("spleen")(Path(tmp) / "sp", seed=0, cases=2, test_cases=1, size=args.size)
            for mode in ("serial", "pipelined"):
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--data", str(data)],
                                     capture_output=True, text=True, check=True).stdout
                res[mode] = json.loads(out.strip().splitlines()[-1])
    else:
        res = speed(args)
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
