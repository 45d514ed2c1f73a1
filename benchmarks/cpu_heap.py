"""``train.cpu_heap``: keep (glibc malloc serves every tensor from its heap and keeps freed memory)
against system (the C library's defaults: an mmap per large tensor, the heap trimmed as soon as its top is
free), side by side, interleaved, on a CPU.

Each measurement is its own process (the setting is process-wide and cannot be undone), the two modes
alternating within a round and their order swapped from round to round:

* ``train`` rows: ``fastvision benchmark RECIPE --mode train --device cpu`` (the recipe's own build and
  ``train_step`` on synthetic batches), p50 step latency;
* the ``augment`` row: nnU-Net's augmentation as ``configure --trainer nnunet`` writes it
  (``planning.configure.recipe.augmentation``), batch 2, CPU time per patch on one thread, after
  ``runtime.set_heap`` (the call ``engine.build`` makes).

Page faults: the child's minor faults (``wait4``'s rusage) per step or per patch; per step beyond what its
import, build and first step fault in (measured by a run of one step). The report gives medians over the
rounds and the ratio keep / system, and each round's ratio.

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cpu_heap.py --rounds 5 [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (recipe, batch, extra --set): 3-D and 2-D U-Nets as CPU users train them
TRAIN = [("unet3d-spleen-fast", 2, ["model.args.filters=[16,32,64,128,256]", "task.args.sample_shape=[1,64,64,64]"]),
         ("unet2d-microscopy", 8, [])]

AUGMENT = """
import sys, time, resource, torch
from fastvision.engine import runtime
from fastvision.data.augment.spatial import build_augment
from fastvision.planning.configure.recipe import augmentation
runtime.set_heap(sys.argv[1])
torch.set_num_threads(1)
n = int(sys.argv[2])
spec, _ = augmentation([64, 64, 64], [1.0] * 3, None, "nnunet")
aug = build_augment(3, **spec)
g = torch.Generator().manual_seed(0)
img = torch.randn(2, 2, 64, 64, 64, generator=g)
seg = torch.randint(0, 2, (2, 64, 64, 64), generator=g).to(torch.uint8)
for _ in range(8):
    aug(img.clone(), seg.clone(), g)
f, c = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
for _ in range(n):
    aug(img.clone(), seg.clone(), g)
print((time.process_time() - c) / (2 * n) * 1e3, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f) / (2 * n))
"""


def _child(cmd: list[str]) -> tuple[str, int]:
    """Run ``cmd``; its stdout and its minor page faults (``wait4``)."""
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.DEVNULL,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}")
    return text, usage.ru_minflt


def train_step(recipe: str, batch: int, sets: list[str], mode: str, steps: int, work: Path) -> tuple[float, float]:
    """p50 step ms, and minor faults per step beyond a one-step run's."""
    def run(n: int) -> tuple[dict, int]:
        cmd = [sys.executable, "-m", "fastvision", "benchmark", recipe, "--mode", "train", "--device", "cpu",
               "--precision", "fp32", "--batch-sizes", str(batch), "--steps", str(n), "--warmup", "2",
               "--out", str(work), "--force", "--set", f"train.cpu_heap={mode}"]
        for s in sets:
            cmd += ["--set", s]
        _, faults = _child(cmd)
        return json.loads((work / f"{recipe}-train.json").read_text())["results"][0], faults

    res, faults = run(steps)
    _, base = run(1)
    return res["latency_p50_ms"], (faults - base) / (steps - 1)


def augment(mode: str, n: int) -> tuple[float, float]:
    out, _ = _child([sys.executable, "-c", AUGMENT, mode, str(n)])
    ms, faults = out.split()
    return float(ms), float(faults)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per process")
    ap.add_argument("--patches", type=int, default=64, help="augmented batches of 2 per process")
    ap.add_argument("--skip-train", action="store_true", help="the augmentation row only")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for mode in ("system", "keep") if r % 2 == 0 else ("keep", "system"):
                if not a.skip_train:
                    for recipe, batch, sets in TRAIN:
                        got = train_step(recipe, batch, sets, mode, a.steps, Path(tmp))
                        rows.setdefault(f"train {recipe} batch {batch}", {}).setdefault(mode, []).append(got)
                got = augment(mode, a.patches)
                rows.setdefault("augment nnU-Net spec, 64^3 x 2 ch, per patch", {}).setdefault(mode, []).append(got)
            last = {k: ", ".join(f"{m} {v[m][-1][0]:.1f} ms" for m in ("system", "keep")) for k, v in rows.items()}
            print(f"round {r + 1}: " + "; ".join(f"{k}: {v}" for k, v in last.items()), flush=True)
    print("\n| workload | system ms | keep ms | keep / system (median) | each round "
          "| page faults per unit, system / keep |")
    print("|---|---:|---:|---:|---|---|")
    for name, by in rows.items():
        s, k = ([x[0] for x in by[m]] for m in ("system", "keep"))
        fs, fk = (statistics.median(x[1] for x in by[m]) for m in ("system", "keep"))
        print(f"| {name} | {statistics.median(s):.1f} | {statistics.median(k):.1f} | "
              f"**{statistics.median(kk / ss for kk, ss in zip(k, s, strict=True)):.2f}** | "
              f"{', '.join(f'{kk / ss:.2f}' for kk, ss in zip(k, s, strict=True))} | {fs:.0f} / {fk:.0f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
