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

# Decathlon-scale fingerprints (no images): each task's published median figures with per-case
# variation, as fastvision's fingerprint dict and as nnU-Net's dataset_fingerprint.json, so both
# planners meet patch sizes where the memory budget binds. (X, Y, Z) spacing choices and shapes.
SCALE = [  # name, modalities, labels, cases, in-plane spacings, z spacings, in-plane shapes, z shapes
    ("Spleen", ["CT"], 2, 41, (0.61, 0.98), (1.5, 2.5, 5.0, 5.0, 5.0, 8.0), (512, 512), (31, 168)),
    ("Prostate", ["T2", "ADC"], 3, 32, (0.6, 0.65), (3.0, 3.6, 3.6, 3.6, 4.0), (256, 384), (15, 24)),
    ("BrainTumour", ["FLAIR", "T1w", "t1gd", "T2w"], 4, 484, (1.0, 1.0), (1.0,), (130, 175), (125, 150)),
    ("Hippocampus", ["MRI"], 3, 260, (1.0, 1.0), (1.0,), (31, 56), (29, 41)),
    ("ThinStack", ["CT"], 2, 40, (0.65, 0.8), (5.0, 6.0, 7.0), (480, 544), (4, 7)),
]

NNUNET = r"""
import json, sys
from nnunetv2.dataset_conversion.convert_MSD_dataset import convert_msd_dataset
from nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor import DatasetFingerprintExtractor
from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import ExperimentPlanner
src, did, targets = sys.argv[1], int(sys.argv[2]), [float(v) for v in sys.argv[3].split(",")]
if src != "planner-only":  # else the raw folder and fingerprint were written by the caller
    convert_msd_dataset(src, overwrite_target_id=did, num_processes=2)
    DatasetFingerprintExtractor(did, num_processes=2).run(overwrite_existing=True)
out = {}
for gb in targets:
    out[str(gb)] = ExperimentPlanner(did, gpu_memory_target_in_gb=gb, plans_name=f"plans{int(gb)}").plan_experiment()
from importlib.metadata import version
print("PLANS_JSON" + json.dumps({"version": version("nnunetv2"), "plans": out}))
"""


def nnunet_plans(python: str, src: Path, did: int, work: Path) -> dict:
    env = dict(os.environ, nnUNet_raw=str(work / "raw"), nnUNet_preprocessed=str(work / "pre"),
               nnUNet_results=str(work / "res"), OMP_NUM_THREADS="1", PYTHONPATH="")
    for k in ("raw", "pre", "res"):
        (work / k).mkdir(parents=True, exist_ok=True)
    r = subprocess.run([python, "-c", NNUNET, str(src), str(did), ",".join(str(b[0]) for b in BUDGETS)],
                       env=env, capture_output=True, text=True, check=False)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PLANS_JSON")), None)
    if r.returncode or line is None:
        raise RuntimeError(f"nnU-Net failed on {src}:\n{r.stderr[-3000:]}")
    return json.loads(line[len("PLANS_JSON"):])


def scale_fingerprint(name, mods, n_labels, cases, inplane, zs, shape_xy, shape_z, seed=0):
    """fastvision's fingerprint dict for a Decathlon-scale task (per-case spacing and crop shape)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    recs = []
    for i in range(cases):
        a = float(rng.uniform(*inplane))
        sh = [int(rng.integers(shape_xy[0], shape_xy[1] + 1))] * 2 + [int(rng.integers(shape_z[0], shape_z[1] + 1))]
        recs.append({"id": f"{name.lower()}_{i:03d}", "spacing": [a, a, float(rng.choice(zs))], "shape": sh,
                     "shape_after_crop": sh})
    stats = {"mean": 100.0, "std": 50.0, "median": 100.0, "min": -100.0, "max": 300.0,
             "percentile_00_5": -50.0, "percentile_99_5": 250.0}
    return {"cases": recs, "n_cases": cases, "name": name, "labels": {i: f"c{i}" for i in range(n_labels)},
            "median_spacing": np.median([r["spacing"] for r in recs], 0).tolist(), "anomalies": {},
            "channels": [{"channel": c, "modality": m, **stats} for c, m in enumerate(mods)]}


def write_nnunet_inputs(fp: dict, did: int, work: Path) -> None:
    """nnU-Net's raw folder (dummy 2^3 volumes: the planner only lists them) and its fingerprint."""
    import nibabel as nib
    import numpy as np

    name = f"Dataset{did}_{fp['name']}"
    raw, pre = work / "raw" / name, work / "pre" / name
    for d in (raw / "imagesTr", raw / "labelsTr", pre):
        d.mkdir(parents=True, exist_ok=True)
    tiny = nib.Nifti1Image(np.zeros((2, 2, 2), np.float32), np.eye(4))
    for r in fp["cases"]:
        for c in range(len(fp["channels"])):
            nib.save(tiny, str(raw / "imagesTr" / f"{r['id']}_{c:04d}.nii.gz"))
        nib.save(tiny, str(raw / "labelsTr" / f"{r['id']}.nii.gz"))
    meta = {"channel_names": {str(c["channel"]): c["modality"] for c in fp["channels"]},
            "labels": {("background" if v == 0 else k): v for v, k in fp["labels"].items()},
            "numTraining": fp["n_cases"], "file_ending": ".nii.gz", "name": fp["name"]}
    (raw / "dataset.json").write_text(json.dumps(meta))
    stats = {str(c["channel"]): {k: c[k] for k in ("mean", "std", "median", "min", "max", "percentile_00_5",
                                                    "percentile_99_5")} for c in fp["channels"]}
    nn_fp = {"spacings": [r["spacing"][::-1] for r in fp["cases"]],  # SimpleITK order (z, y, x)
             "shapes_after_crop": [r["shape_after_crop"][::-1] for r in fp["cases"]],
             "foreground_intensity_properties_per_channel": stats, "median_relative_size_after_cropping": 1.0}
    (pre / "dataset_fingerprint.json").write_text(json.dumps(nn_fp))


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
        row["2d"] = {"patch": two["patch_size"], "batch": two["batch_size"],
                     "stages": two["architecture"]["arch_kwargs"]["n_stages"]}
    return row


def ours_row(data: Path, memory: str | None, gpu: str | None, fp: dict | None = None) -> dict:
    from fastvision.planning.configure import configure

    plan = configure(data, memory=memory, gpu=gpu, fingerprint=fp)
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
            lines.append(f"| {r['name']} | {who} ({budget}){extra} | {_v(row['spacing'])} | "
                         f"{_v(row['median_shape'], 4)} | {_v(row['patch'], 4)} | {row['pools']} | "
                         f"{row['stages']} | {row['batch']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nnunet-python", default="/work/nnunet-venv/bin/python")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="also write every figure as JSON")
    ap.add_argument("--no-scale", dest="scale", action="store_false",
                    help="skip the Decathlon-scale fingerprints (planners only)")
    ap.add_argument("--only-scale", action="store_true", help="skip the generated datasets")
    args = ap.parse_args()
    from fastvision.data.synth import load_all

    synth = load_all()
    work = args.work or Path(tempfile.mkdtemp(prefix="configure_vs_nnunet_"))
    results, version = [], "?"
    for i, (name, kind, opts) in enumerate([] if args.only_scale else DATASETS):
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
    scale = []
    for i, spec in enumerate(SCALE if args.scale else []):
        fp = scale_fingerprint(*spec)
        nn_work = work / f"scale{i}"
        write_nnunet_inputs(fp, 950 + i, nn_work)
        got = nnunet_plans(args.nnunet_python, "planner-only", 950 + i, nn_work)
        version = got["version"]
        rows = []
        for (gb, memory, gpu) in BUDGETS:
            rows.append(("nnU-Net v2", f"{gb:g} GB target", nnunet_row(got["plans"][str(float(gb))])))
            rows.append(("fastvision", memory or gpu, ours_row(Path(fp["name"]), memory, gpu, fp)))
        scale.append({"name": f"{fp['name']} ({fp['n_cases']} cases)", "rows": rows})
        print(f"{fp['name']} at scale: done", file=sys.stderr)
    print(f"nnunetv2 {version}; python {sys.version.split()[0]}")
    print("\nGenerated datasets (fingerprints extracted from the files by each tool):\n")
    print(table(results))
    if scale:
        print("\nDecathlon-scale fingerprints (published median figures, no images; planners only):\n")
        print(table(scale))
    if args.json:
        args.json.write_text(json.dumps({"nnunetv2": version, "results": results, "scale": scale}, indent=2,
                                        default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
