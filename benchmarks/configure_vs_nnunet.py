"""``fastvision configure`` side by side with nnU-Net v2's own planner on generated Decathlon datasets.

Five datasets of different geometry are written with ``fastvision data synth`` (isotropic-ish CT like
spleen, anisotropic two-channel MR like prostate, four-channel brain MR like BraTS, tiny crops like
hippocampus, a thin stack). For each, nnU-Net v2 (installed in its OWN virtual environment, never
fastvision's) converts the folder (``convert_msd_dataset``), extracts its fingerprint
(``DatasetFingerprintExtractor``) and plans (``ExperimentPlanner``) at its fixed 8 GB target and at
80 GB; fastvision's ``configure`` plans the same folder for an 8 GiB budget and for an A100-80GB.
The table lists target spacing, median shape after resampling, patch, pooling per axis, stages and
batch, all in fastvision's axis order (X, Y, Z, RAS voxel axes; nnU-Net's transposed SimpleITK
order is mapped back).

Usage (a few minutes on 2 CPU cores)::

    python3 -m venv /work/nnunet-venv && /work/nnunet-venv/bin/pip install torch==2.13.0 nnunetv2
    PYTHONPATH=$PWD python benchmarks/configure_vs_nnunet.py --nnunet-python /work/nnunet-venv/bin/python \
        --json configure_vs_nnunet.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DATASETS = [  # (MSD folder name, synth kind, options)
    ("Task09_Spleen", "spleen", {"cases": 8, "test_cases": 1, "size": 64}),
    ("Task05_Prostate", "prostate", {"cases": 8, "test_cases": 1, "size": 96, "slices": 18}),
    ("Task01_BrainTumour", "brats", {"cases": 6, "test_cases": 1, "size": 48}),
    ("Task04_Hippocampus", "hippocampus", {"cases": 12, "test_cases": 1}),
    ("Task10_ThinStack", "thinstack", {"cases": 8, "test_cases": 1, "size": 128, "slices": 5}),
]
BUDGETS = [(8, "8GiB", None), (80, None, "A100-80GB")]  # (nnU-Net target GB, our --memory, our --gpu)

NNUNET = r"""
import json, sys
from nnunetv2.dataset_conversion.convert_MSD_dataset import convert_msd_dataset
from nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor import DatasetFingerprintExtractor
from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import ExperimentPlanner
import nnunetv2
src, did, targets = sys.argv[1], int(sys.argv[2]), [float(v) for v in sys.argv[3].split(",")]
convert_msd_dataset(src, overwrite_target_id=did, num_processes=2)
DatasetFingerprintExtractor(did, num_processes=2).run(overwrite_existing=True)
out = {}
for gb in targets:
    out[str(gb)] = ExperimentPlanner(did, gpu_memory_target_in_gb=gb, plans_name=f"plans{int(gb)}").plan_experiment()
print("PLANS_JSON" + json.dumps({"version": getattr(nnunetv2, "__version__", "?"), "plans": out}))
"""


def nnunet_plans(python: str, src: Path, did: int, work: Path) -> dict:
    env = dict(os.environ, nnUNet_raw=str(work / "raw"), nnUNet_preprocessed=str(work / "pre"),
               nnUNet_results=str(work / "res"), OMP_NUM_THREADS="1", PYTHONPATH="")
    for k in ("raw", "pre", "res"):
        (work / k).mkdir(parents=True, exist_ok=True)
    r = subprocess.run([python, "-c", NNUNET, str(src), str(did), ",".join(str(b[0]) for b in BUDGETS)],
                       env=env, capture_output=True, text=True)
    line = next((l for l in r.stdout.splitlines() if l.startswith("PLANS_JSON")), None)
    if r.returncode or line is None:
        raise RuntimeError(f"nnU-Net failed on {src}:\n{r.stderr[-3000:]}")
    return json.loads(line[len("PLANS_JSON"):])


def _to_ours(values, transpose_forward, fill=None):
    """nnU-Net's transposed (z, y, x) order -> fastvision's (X, Y, Z): original axis i is our 2 - i."""
    out = [fill] * 3
    for k, v in enumerate(values):
        out[2 - transpose_forward[k]] = v
    return out


def nnunet_row(plans: dict) -> dict:
    tf = plans["transpose_forward"]
    conf = plans["configurations"]["3d_fullres"]
    arch = conf["architecture"]["arch_kwargs"]
    strides = [_to_ours(s, tf) for s in arch["strides"]]
    pools = [sum(1 for s in strides if s[a] > 1) for a in range(3)]
    row = {"spacing": _to_ours(conf["spacing"], tf), "median_shape": _to_ours(conf["median_image_size_in_voxels"], tf),
           "patch": _to_ours(conf["patch_size"], tf), "pools": pools, "stages": arch["n_stages"],
           "batch": conf["batch_size"], "first_kernel": _to_ours(arch["kernel_sizes"][0], tf)}
    two = plans["configurations"].get("2d")
    if two:
        row["2d"] = {"patch": two["patch_size"], "batch": two["batch_size"], "stages": two["architecture"]["arch_kwargs"]["n_stages"]}
    return row


def ours_row(data: Path, memory: str | None, gpu: str | None) -> dict:
    from fastvision.planning.configure import configure

    plan = configure(data, memory=memory, gpu=gpu)
    topo, geo = plan["fit"]["topology"], plan["geometry"]
    return {"spacing": geo["spacing"], "median_shape": geo["median_shape"], "patch": topo.patch,
            "pools": topo.pools_per_axis, "stages": len(topo.strides), "batch": plan["fit"]["batch"],
            "first_kernel": topo.kernels[0], "thin": geo["thin_axis"] is not None,
            "memory_gib": round(plan["fit"]["memory_gib"], 2), "batch_fit": plan["fit"]["batch_fit"],
            "batch_cover": plan["fit"]["batch_cover"]}


def _v(x, digits=3):
    return " x ".join(f"{float(v):.{digits}g}" for v in x)


def table(results: list[dict]) -> str:
    head = ("| dataset | planner (budget) | target spacing mm | median shape resampled | patch | pools per axis | "
            "stages | batch |")
    lines = [head, "|" + "---|" * 8]
    for r in results:
        for who, budget, row in r["rows"]:
            extra = " (2-D, slice-wise)" if row.get("thin") else ""
            lines.append(f"| {r['name']} | {who} ({budget}){extra} | {_v(row['spacing'])} | {_v(row['median_shape'], 4)} | "
                         f"{_v(row['patch'], 4)} | {row['pools']} | {row['stages']} | {row['batch']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nnunet-python", default="/work/nnunet-venv/bin/python")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="also write every figure as JSON")
    args = ap.parse_args()
    from fastvision.data.synth import load_all

    synth = load_all()
    work = args.work or Path(tempfile.mkdtemp(prefix="configure_vs_nnunet_"))
    results, version = [], "?"
    for i, (name, kind, opts) in enumerate(DATASETS):
        src = work / "msd" / name
        if not src.exists():
            synth.get(kind)(src, seed=0, **opts)
            (src / "imagesTs").mkdir(exist_ok=True)
        got = nnunet_plans(args.nnunet_python, src, 900 + i, work / f"nnunet{i}")
        version = got["version"]
        rows = []
        for (gb, memory, gpu) in BUDGETS:
            rows.append(("nnU-Net v2", f"{gb:g} GB target", nnunet_row(got["plans"][str(float(gb))])))
            rows.append(("fastvision", memory or gpu, ours_row(src, memory, gpu)))
        results.append({"name": name, "kind": kind, "options": opts, "rows": rows})
        print(f"{name}: done", file=sys.stderr)
    print(f"nnunetv2 {version}; python {sys.version.split()[0]}")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"nnunetv2": version, "results": results}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
