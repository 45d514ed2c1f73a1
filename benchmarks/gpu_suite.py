"""One command that measures a GPU against the published anchors (issue 13).

    python benchmarks/gpu_suite.py [--quick] [--device cuda|cpu] [--out DIR]

Needs only what a bare GPU machine has (torch with CUDA, pyyaml, rich; nvidia-ml-py optional): no
MONAI, nibabel or pycocotools. Training and inference rows go through fastvision's own benchmark
path (:func:`fastvision.benchmark.modes.run_benchmark`, whose training step is
:func:`fastvision.engine.train_step`: what is timed is what ``fastvision train`` runs) on the
task's synthetic batches. The data row times the GPU-cached spleen input path of the recipe
``unet3d-spleen-fast`` (:func:`fastvision.benchmark.data.run_data_benchmark`: dataset -> gpu
cache -> per-item crop on the device -> loader -> augmentation) on CT volumes generated in memory
(:func:`fastvision.data.synth.medical.spleen_volume`, windowed and cropped as the recipe's
preprocessing does), so no NIfTI reader is involved. The last row runs ``pytest -m gpu``.

Prints one rich table with the anchors beside each row and writes ``gpu_suite.json`` and
``gpu_suite.md`` (for benchmarks/RESULTS.md) to ``--out``. The full suite took 292 s on an H200
(2026-11-26; a time guard, ``--budget``, skips what would not fit, with a note); ``--quick`` is a ~2-minute
subset; ``--device cpu --quick`` runs every quick row at CI sizes (tests/engine/test_gpu_suite.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

# ------------------------------------------------------------------------------ the workloads
# One row per measurement. kind: train / inference (fastvision.benchmark.modes.run_benchmark), data
# (fastvision.benchmark.data.run_data_benchmark), tests (pytest -m gpu). "set": recipe overrides;
# "cpu": what changes on --device cpu (CI sizes: a few steps at tiny shapes, fp32). quick: in --quick.
WORKLOADS: list[dict[str, Any]] = [
    dict(name="ResNet-50 v1.5 train", recipe="resnet50-imagenet", kind="train", batch=256, precision="bf16",
         channels_last=True, compile=False, steps=30, warmup=10, unit="img/s", anchors=["rn50_dle", "rn50_mlperf"],
         goal=7000, quick=True, set={},
         cpu=dict(batch=2, steps=2, warmup=1, set={"task.args.image_size": 64, "model.args.num_classes": 10,
                                                   "task.args.num_classes": 10})),
    dict(name="ResNet-50 v1.5 train, compiled", recipe="resnet50-imagenet", kind="train", batch=256,
         precision="bf16", channels_last=True, compile=True, steps=30, warmup=15, unit="img/s",
         anchors=["rn50_dle", "rn50_mlperf"], goal=7000, quick=False, set={},
         cpu=dict(batch=2, steps=2, warmup=1, set={"task.args.image_size": 64, "model.args.num_classes": 10,
                                                   "task.args.num_classes": 10})),
    dict(name="3D U-Net (BraTS) 128^3 x 4 train", recipe="unet3d-brats", kind="train", batch=2, precision="bf16",
         channels_last=False, compile=False, steps=20, warmup=5, unit="vol/s", anchors=["unet3d_nnunet",
                                                                                        "unet3d_mlperf"],
         goal=70, quick=True, set={},
         cpu=dict(batch=1, steps=2, warmup=1, set={"task.args.sample_shape": [4, 16, 16, 16],
                                                   "model.args.filters": [4, 8, 8]})),
    dict(name="SSD320 train", recipe="ssd320-coco", kind="train", batch=64, precision="bf16", channels_last=True,
         compile=False, steps=20, warmup=5, unit="img/s", anchors=["ssd_dle", "ssd_mlperf"], goal=1500,
         quick=True, set={"model.args.pretrained": None},
         cpu=dict(batch=2, steps=1, warmup=1, set={"task.args.image_size": 64})),
    dict(name="Seed-001 U-Net 768x1024 train", recipe="unet2d-seed001", kind="train", batch=16, precision="bf16",
         channels_last=True, compile=False, steps=30, warmup=5, unit="img/s", anchors=["seed001_v100"],
         goal=1000, quick=True, set={},
         cpu=dict(batch=2, steps=2, warmup=1, set={"task.args.sample_shape": [1, 64, 64]})),
    dict(name="Seed-001 U-Net 768x1024 train, compiled", recipe="unet2d-seed001", kind="train", batch=16,
         precision="bf16", channels_last=True, compile=True, steps=30, warmup=10, unit="img/s",
         anchors=["seed001_v100"], goal=1000, quick=False, set={},
         cpu=dict(batch=2, steps=2, warmup=1, set={"task.args.sample_shape": [1, 64, 64]})),
    dict(name="ResNet-50 inference, batch 1", recipe="resnet50-imagenet", kind="inference", batch=1,
         precision="bf16", channels_last=True, compile=False, steps=100, warmup=20, unit="img/s",
         anchors=["rn50_inf_bs1"], goal=None, quick=True, set={},
         cpu=dict(batch=1, steps=3, warmup=1, set={"task.args.image_size": 64, "model.args.num_classes": 10,
                                                   "task.args.num_classes": 10})),
    dict(name="ResNet-50 inference, batch 256", recipe="resnet50-imagenet", kind="inference", batch=256,
         precision="bf16", channels_last=True, compile=False, steps=30, warmup=10, unit="img/s",
         anchors=["rn50_inf_peak"], goal=None, quick=True, set={},
         cpu=dict(batch=4, steps=3, warmup=1, set={"task.args.image_size": 64, "model.args.num_classes": 10,
                                                   "task.args.num_classes": 10})),
    dict(name="Spleen input path, data.cache gpu", recipe="unet3d-spleen-fast", kind="data", batch=4,
         precision=None, channels_last=False, compile=False, steps=40, warmup=None, unit="patch/s", anchors=[],
         goal=None, quick=True, cases=12, size=176, spacing=0.6, patch=96, set={},
         cpu=dict(batch=2, steps=4, warmup=None, cases=4, size=40, spacing=1.5, patch=32, set={})),
    dict(name="GPU tests (pytest -m gpu)", recipe=None, kind="tests", batch=None, precision=None,
         channels_last=False, compile=False, steps=None, warmup=None, unit="passed", anchors=[], goal=None,
         quick=False, set={}, cpu={}),
]

# Published figures, copied from ../shared/reference/perf_anchors.md with their sources.
ANCHORS: dict[str, tuple[str, str]] = {
    "rn50_dle": ("DLE PyTorch A100 AMP 2,470 img/s",
                 "NVIDIA/DeepLearningExamples:PyTorch/Classification/ConvNets/resnet50v1.5/README.md (bs 256)"),
    "rn50_mlperf": ("MLPerf v4.0 H100 ~7,160 img/s/GPU",
                    "mlcommons/training_results_v4.0:NVIDIA/results/eos_ngc24.04_mxnet/resnet (57,277 / 8)"),
    "unet3d_nnunet": ("nnU-Net A100 AMP 27.5 vol/s", "perf_anchors.md, 3D U-Net single-GPU (nnU-Net)"),
    "unet3d_mlperf": ("MLPerf v4.0 H100 72.5 vol/s/GPU",
                      "training_results_v4.0 NVIDIA unet3d, thr 580 samples/s on 8xH100"),
    "ssd_dle": ("DLE TF A100 180 img/s", "NVIDIA/DeepLearningExamples:TensorFlow/Detection/SSD README"),
    "ssd_mlperf": ("MLPerf v1.1 A100 1,527 img/s/GPU (SSD300)",
                   "mlcommons/training_results_v1.1:NVIDIA/results/dgxa100_ngc21.09_mxnet/ssd (12,214 / 8)"),
    "seed001_v100": ("seed 001 V100 ~48 img/s", "oekosheri/tensorflow_unet_scaling logs (perf_anchors.md)"),
    "rn50_inf_bs1": ("DLE TF A100 AMP bs1 5.76 ms; MXNet FP16 bs1 0.70 ms",
                     "DeepLearningExamples TF1 / MXNet RN50v1.5 READMEs"),
    "rn50_inf_peak": ("DLE MXNet A100 FP16 8,241 img/s (bs192)", "DeepLearningExamples MXNet RN50v1.5 README"),
}
# Goals of issue 13 for one H100/H200.
GOAL_SOURCE = "issue 13 goal on one H100/H200"
CPU_BUDGET_S, GPU_BUDGET_S, QUICK_BUDGET_S = 60.0, 8.5 * 60, 2 * 60.0

log = logging.getLogger("gpu_suite")


# ------------------------------------------------------------------------------ generated spleen data
def _register_generated_spleen() -> None:
    """``data.name: generated-spleen``: the decathlon dataset's classes on CT generated in memory."""
    from fastvision.registry import DATASETS

    if "generated-spleen" not in DATASETS:
        DATASETS.register("generated-spleen")(build_generated_spleen)


def _generated_case(paths: dict[str, Any], params: Any) -> dict[str, Any]:
    """The recipe's preprocessing (CT window, crop to the body) of a volume generated from its name.

    ``paths["image"][0]`` is ``generated:SEED:INDEX:SIZE:SPACING``; the volume is drawn on the
    output grid (no resampling). The generator's abdomen is about 92 x 68 mm across, so the suite
    draws it at 0.6 mm to give a cropped volume larger than the recipe's 96^3 patch, as real CT is.
    """
    from fastvision.data.preprocess3d import foreground_box, window
    from fastvision.data.synth.medical import spleen_volume

    _, seed, index, size, spacing = paths["image"][0].split(":")
    rng = np.random.default_rng([int(seed), int(index)])
    hu, label = spleen_volume(rng, (int(size),) * 3, np.full(3, float(spacing)))
    image = torch.from_numpy(hu.astype(np.float32))[None]
    fg = (image > params.window[0]).any(0)
    image = window(image, *params.window)
    sl = tuple(slice(a, b) for a, b in foreground_box(fg, params.crop_margin))
    return {"image": image[(slice(None),) + sl].contiguous().float(),
            "label": torch.from_numpy(label)[sl].contiguous(), "meta": {}}


def build_generated_spleen(*, cases: int = 12, size: int = 176, spacing: float = 0.6, seed: int = 0,
                           patch_size=(96, 96, 96), pos_fraction: float = 0.5, window=(-57.0, 164.0, 0.0, 1.0)):
    """Train/val splits of ``cases`` generated CT volumes of ``size``^3 voxels of ``spacing`` mm."""
    from fastvision.data.formats.base import DatasetSplits
    from fastvision.data.formats.decathlon import VolumeDataset
    from fastvision.data.preprocess3d import PreprocessParams

    params = PreprocessParams(intensity="ct", window=tuple(map(float, window)), crop_foreground=True)
    items = [{"id": f"gen{i}", "image": [f"generated:{seed}:{i}:{size}:{spacing}"], "label": None}
             for i in range(cases)]
    train = VolumeDataset(items, params, patch_size=patch_size, pos_fraction=pos_fraction, compute=_generated_case)
    val = VolumeDataset(items[:1], params, compute=_generated_case)
    info = {"num_classes": 2, "class_names": ["background", "spleen"], "in_channels": 1, "channels": ["CT"],
            "spatial_dims": 3, "train_cases": cases, "val_cases": 1}
    return DatasetSplits(train, val, info)


# ------------------------------------------------------------------------------ measuring
def _settings(w: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The row's settings with the CPU overrides applied on a CPU (fp32 there: bf16 convs crawl)."""
    s = {k: v for k, v in w.items() if k != "cpu"}
    if device.type == "cpu":
        s.update({k: v for k, v in w["cpu"].items() if k != "set"})
        s["set"] = {**w["set"], **w["cpu"].get("set", {})}
        if s["precision"] in ("bf16", "fp16"):
            s["precision"] = "fp32"
    return s


def _load(recipe: str, overrides: dict[str, Any]):
    from fastvision.config import load

    nested = []
    for key, value in overrides.items():  # "a.b.c": v -> {"a": {"b": {"c": v}}}, as --set does
        for part in reversed(key.split(".")):
            value = {part: value}
        nested.append(value)
    return load(recipe, nested)


def measure_model(s: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A train or inference row through :func:`fastvision.benchmark.modes.run_benchmark`."""
    from fastvision.benchmark.modes import run_benchmark

    cfg = _load(s["recipe"], s["set"])
    rep = run_benchmark(cfg, s["kind"], [s["batch"]], [s["precision"]], steps=s["steps"], warmup=s["warmup"],
                        compile=s["compile"], channels_last=s["channels_last"], device=device)
    if not rep["results"]:
        return {"skip": "; ".join(rep["notes"]) or "precision not available"}
    r = rep["results"][0]
    if "error" in r:
        return {"error": r["error"]}
    out = {"value": r["items_per_s"], "p50_ms": r["latency_p50_ms"], "p99_ms": r["latency_p99_ms"]}
    out.update({k: r[k] for k in ("peak_memory_mb", "peak_reserved_mb", "device_used_mb") if k in r})
    return out


def measure_data(s: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The spleen recipe's input path with ``data.cache: gpu`` on generated volumes."""
    from fastvision.benchmark.data import run_data_benchmark

    _register_generated_spleen()
    patch = [s["patch"]] * 3
    cfg = _load(s["recipe"], {"data.cache_dir": None, "task.args.sample_shape": [1, *patch],
                              "train.batch_size": s["batch"], **s["set"]})
    # the recipe's dataset, cache, loader and crop; its NIfTI reader replaced by generated volumes
    cfg.data.name = "generated-spleen"
    cfg.data.args = {"cases": s["cases"], "size": s["size"], "spacing": s["spacing"], "patch_size": patch,
                     "pos_fraction": cfg.data.args.get("pos_fraction", 0.5), "window": cfg.data.args["window"]}
    cfg.train.device = str(device)
    rep = run_data_benchmark(cfg, ["gpu"], batches=s["steps"], rounds=2, warmup=s["warmup"])
    r = rep["results"][0]
    return {"value": r["items_per_s"], "note": f"{s['cases']} generated {s['size']}^3 volumes at {s['spacing']} mm, "
                                               f"{r['pipeline']}"}


def gpu_test_files() -> list[Path]:
    """The test modules that hold ``pytest.mark.gpu`` tests: collecting only these needs none of the
    optional packages (MONAI, nibabel, pycocotools) that other test modules import."""
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def measure_tests(device: torch.device, timeout_s: float) -> dict[str, Any]:
    """``pytest -m gpu`` in a subprocess (stopped after ``timeout_s``); passed / failed / skipped counts."""
    if device.type != "cuda":
        return {"skip": "needs a CUDA device"}
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                               "-rfE", "--tb=line", *map(str, gpu_test_files())],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"pytest -m gpu did not finish in {timeout_s:.0f} s (the suite's time budget)"}
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-200:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|error)", tail)}
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    out = {"value": float(counts.get("passed", 0)), "tests": counts, "note": tail, "failed": failed}
    if counts.get("failed") or counts.get("error") or proc.returncode not in (0, 5):
        out["error"] = tail + "".join(f"; {f.split()[1].split('::')[-1]}" for f in failed if len(f.split()) > 1)
    return out


def run_suite(device: torch.device, quick: bool, budget: float | None = None,
              only: list[str] | None = None) -> dict[str, Any]:
    """Every selected row, each timed, with a time guard: no row starts after ``budget`` seconds (default:
    the device's and mode's), and what would not fit is skipped with a note. ``only``: run just the rows
    whose name contains one of these strings (a session re-measures only what a change touched)."""
    if budget is None:
        budget = CPU_BUDGET_S if device.type == "cpu" else QUICK_BUDGET_S if quick else GPU_BUDGET_S
    start, rows = time.perf_counter(), []
    for w in WORKLOADS:
        s = _settings(w, device)
        row = {"name": w["name"], "kind": w["kind"], "recipe": w["recipe"], "unit": w["unit"],
               "settings": {k: s[k] for k in ("batch", "precision", "channels_last", "compile", "steps", "warmup")},
               "overrides": s["set"], "anchors": [ANCHORS[a][0] for a in w["anchors"]],
               "anchor_sources": [ANCHORS[a][1] for a in w["anchors"]], "goal": w["goal"]}
        t0 = time.perf_counter()
        if only and not any(o.lower() in w["name"].lower() for o in only):
            row["skip"] = "not in --only"
        elif quick and not w["quick"]:
            row["skip"] = "not in --quick"
        elif t0 - start > budget:
            row["skip"] = f"time budget ({budget:.0f} s) spent"
        else:
            log.info("gpu_suite: %s", w["name"])
            try:
                if w["kind"] in ("train", "inference"):
                    row.update(measure_model(s, device))
                elif w["kind"] == "data":
                    row.update(measure_data(s, device))
                else:
                    row.update(measure_tests(device, max(60.0, budget + 30 - (t0 - start))))
            except Exception as e:  # one failing row must not hide the others' figures
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if device.type == "cpu" and s["set"] != w["set"] and "value" in row:
            row["note"] = "; ".join(x for x in (row.get("note"), "CI size " + ", ".join(
                f"{k}={v}" for k, v in s["set"].items() if w["set"].get(k) != v)) if x)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        if "value" in row and w["goal"] and device.type == "cuda":
            row["vs_goal"] = row["value"] / w["goal"]
        rows.append(row)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"suite": "gpu_suite", "issue": 13, "device": str(device), "gpu": gpu,
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
            else None, "quick": quick, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:]),
            "seconds": round(time.perf_counter() - start, 1), "goal_source": GOAL_SOURCE, "rows": rows}


# ------------------------------------------------------------------------------ reports
HEAD = ["workload", "setting", "measured", "p50 / p99 ms", "anchors", "goal", "x goal", "note"]


def _cells(row: dict[str, Any]) -> list[str]:
    st = row["settings"]
    setting = ", ".join(str(x) for x in (f"bs {st['batch']}" if st["batch"] else None, st["precision"],
                                         "NHWC" if st["channels_last"] else None,
                                         "compiled" if st["compile"] else None) if x)
    if "value" in row and "error" not in row:
        measured = f"{row['value']:,.1f} {row['unit']}" if row["kind"] != "tests" else f"{row['value']:.0f} passed"
    else:
        measured = "-"
    lat = f"{row['p50_ms']:.2f} / {row['p99_ms']:.2f}" if "p50_ms" in row else ""
    note = row.get("error") or row.get("skip") or row.get("note", "")
    if "error" in row:
        note = f"FAILED: {note}"
    elif "skip" in row:
        note = f"skipped: {note}"
    goal = f"{row['goal']:,} {row['unit']}" if row["goal"] else ""
    vs = f"{row['vs_goal']:.2f}" if "vs_goal" in row else ""
    return [row["name"], setting, measured, lat, "; ".join(row["anchors"]), goal, vs, note]


def title(report: dict[str, Any]) -> str:
    where = report["gpu"] or f"{report['device']} ({report['cpu']})"
    cudnn = f", cuDNN {report['cudnn']}" if report.get("cudnn") else ""
    return (f"fastvision GPU suite{' (quick)' if report['quick'] else ''} on {where}, torch {report['torch']}"
            f"{cudnn}, {report['date']}, {report['seconds']} s")


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown section for benchmarks/RESULTS.md."""
    lines = [f"**{title(report)}**", "", f"Command: `{report['command']}`", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |" for r in report["rows"]]
    lines += ["", f"Goals: {report['goal_source']}. Anchors: ../shared/reference/perf_anchors.md "
                  f"(sources in the JSON's anchor_sources)."]
    return "\n".join(lines) + "\n"


def rich_table(report: dict[str, Any]):
    from rich.table import Table

    table = Table(title=title(report))
    for h in HEAD:
        table.add_column(h, justify="right" if h in ("measured", "x goal") else "left", overflow="fold")
    for r in report["rows"]:
        table.add_row(*_cells(r))
    return table


def resolve_device(name: str) -> torch.device:
    """``--device``: ``auto`` is CUDA where present, else the CPU; a CUDA device becomes the current
    one (a bare ``cuda`` means the current device: ``set_device`` needs an index)."""
    device = torch.device("cuda" if name == "auto" and torch.cuda.is_available() else
                          "cpu" if name == "auto" else name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a ~2-minute subset (no compiled rows, no GPU tests)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cuda, cuda:N or cpu (CI sizes)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds after which no row starts (default 60 on cpu, 120 --quick, 510 on a GPU)")
    p.add_argument("--out", type=Path, default=Path("runs/gpu_suite"), help="folder for gpu_suite.json / .md")
    p.add_argument("--only", nargs="+", metavar="TEXT", help="run only the rows whose name contains TEXT, "
                                                             "e.g. --only 'GPU tests' 'compiled'")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from rich.console import Console

    device = resolve_device(args.device)
    report = run_suite(device, args.quick, args.budget, args.only)
    Console(width=200).print(rich_table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_suite.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gpu_suite.md").write_text(markdown(report))
    print(f"wrote {args.out / 'gpu_suite.json'} and {args.out / 'gpu_suite.md'}")
    return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
