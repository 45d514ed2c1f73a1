"""Host cores per GPU that the shipped recipes' input paths need at scale (issue 30, item 3).

For each recipe: generate data of its kind (``fastvision data synth``), measure its own input path
with ``fastvision benchmark RECIPE --mode data`` (items/s per host core: items over the CPU seconds
of the loader's threads and processes, the main thread's copy and augmentation included), then ask
``fastvision plan RECIPE --gpu GPU --hardware HW --gpus N --input-rate THAT.json`` what one GPU
consumes and how many host cores per GPU that takes, against the cores per GPU of the node.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/input_per_core.py [--gpu H200] [--hardware dgx-h100] [--gpus 8]

The per-core rate is a CPU-time ratio, so the machine's load moves it little; the host's CPU model
is in each JSON. The Markdown table goes to stdout and to ``--out``/input_per_core.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastvision import cli  # noqa: E402
from fastvision.data.synth import load_all  # noqa: E402

# recipe, synth kind and options (and what that data is beside the real one), batch, overrides
CASES = [
    ("resnet50-imagenet", "imagenet", dict(classes=4, per_class=48, val_per_class=1, size=500, height=375,
                                           quality=90), 32,
     ["task.args.num_classes=4", "model.args.num_classes=4", "data.num_workers=2"],
     "JPEG 500x375 q90 (ImageNet's typical photo)"),
    ("ssd320-coco", "coco", dict(train=160, val=8), 32, ["data.num_workers=2"],
     "JPEG 256-400 px wide (COCO's are about 640x480: decoding costs more there)"),
    ("unet2d-seed001", "microscopy", dict(count=60, size=1024), 8, ["data.num_workers=2"],
     "PNG 1024x1024 8-bit, padded/cropped to 768x1024"),
    ("unet3d-brats", "brats", dict(cases=10, test_cases=0, size=160), 2, [],
     "NIfTI 4 x 160^3 (BraTS: 4 x 240x240x155), disk cache, 128^3 crops"),
]


def measure(recipe: str, kind: str, opts: dict, batch: int, sets: list[str], tmp: Path, steps: int,
            out: Path) -> Path:
    data = load_all().get(kind)(tmp / kind, seed=0, **opts)
    argv = ["benchmark", recipe, "--mode", "data", "--data", str(data), "--device", "cpu", "--batch-sizes",
            str(batch), "--steps", str(steps), "--rounds", "2", "--warmup", "2", "--out", str(out / recipe),
            "--force"]
    for s in sets:
        argv += ["--set", s]
    if cli.main(argv) != 0:
        raise SystemExit(f"benchmark {recipe} failed")
    return out / recipe / f"{recipe}-data.json"


def plan(recipe: str, report: Path, gpu: str, hardware: str, gpus: int, out: Path) -> dict:
    path = out / recipe / "plan.json"
    argv = ["plan", recipe, "--gpu", gpu, "--hardware", hardware, "--gpus", str(gpus), "--no-switches",
            "--input-rate", str(report), "--json", str(path), "--force"]
    if cli.main(argv) != 0:
        raise SystemExit(f"plan {recipe} failed")
    return json.loads(path.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--hardware", default="dgx-h100", help="node preset (cores per GPU)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed batches per recipe")
    ap.add_argument("--only", help="comma-separated recipes")
    ap.add_argument("--out", type=Path, default=Path("runs/input-per-core"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe, kind, opts, batch, sets, what in CASES:
            if args.only and recipe not in args.only.split(","):
                continue
            report = measure(recipe, kind, opts, batch, sets, Path(tmp), args.steps, args.out)
            rep = json.loads(report.read_text())
            p = plan(recipe, report, args.gpu, args.hardware, args.gpus, args.out)
            sc = p["estimate"]["scale"]
            need = sorted(s["cores_per_gpu"] for s in sc)
            rows.append((recipe, what, rep["results"][0], rep.get("host_cpu"), p, sc, need))
    lines = [f"| recipe | data here | items/s per core (here) | {args.gpu} items/s per GPU (plan) | "
             f"host cores per GPU needed | cores per GPU on {args.hardware} | binding limit at {args.gpus} |",
             "|---|---|---:|---:|---:|---:|---|"]
    for recipe, what, row, _cpu, _plan, sc, need in rows:
        gpu_rate = sorted(s["gpu_items_per_s_gpu"] for s in sc)  # what the GPU takes if the host keeps up
        lines.append(f"| {recipe} | {what} | {row['items_per_cpu_s']:.1f} | "
                     f"{gpu_rate[0]:,.0f}-{gpu_rate[-1]:,.0f} | {need[0]:.1f}-{need[-1]:.1f} | "
                     f"{sc[0]['cores_available_per_gpu']:.1f} | "
                     f"{' / '.join(dict.fromkeys(s['limit'] for s in sc))} |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "input_per_core.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
