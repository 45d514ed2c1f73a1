"""``fastvision predict`` against nnU-Net v2's own predictor (``nnUNetPredictor``) on the same cases.

One generated spleen-like CT set (``fastvision data synth spleen``: a few training cases and
``--cases`` test cases in ``imagesTs``). nnU-Net v2, in its OWN virtual environment (never
fastvision's), converts the folder, fingerprints and plans it (``ExperimentPlanner``, 8 GB target),
builds ``PlainConvUNet`` from those plans and predicts with ``nnUNetPredictor.manual_initialization``
(random weights: speed does not depend on them): step 0.5, Gaussian weighting, on the CPU, with and
without mirroring on all three axes. fastvision plans the same folder with ``configure --memory
8GiB`` (the script checks that patch, strides and stages are nnU-Net's), trains that recipe for one
step to get a checkpoint, and predicts through the real CLI: ``python -m fastvision predict RUN
inputs... --out DIR`` (mirroring: ``--tta`` where ``predict`` has it, else a run whose recipe sets
``task.args.sliding_window.tta_flips: [0, 1, 2]``). So once a faster ``predict`` lands, the same
command measures it.

Both sides run as whole processes (imports, model build, every case read, preprocessed, predicted,
resampled back and written), timed by their wall clock, in interleaved rounds; the figure is the
ratio of the medians. Agreement around the network, per case: the written segmentation's shape and
affine against the input's (both tools), and the preprocessed network input (target spacing, shape,
and values where the shapes match) of fastvision's ``preprocess_case`` against nnU-Net's
``DefaultPreprocessor.run_case``.

Usage (about 10-20 minutes on 2 shared CPU cores)::

    python3 -m venv /work/nnunet-venv && /work/nnunet-venv/bin/pip install torch==2.13.0 && \\
        /work/nnunet-venv/bin/pip install torch==2.13.0 nnunetv2
    PYTHONPATH=$PWD python benchmarks/predict_vs_nnunet.py --nnunet-python /work/nnunet-venv/bin/python \\
        --work /tmp/pvn --json /tmp/pvn/out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATASET_ID = 990

NNUNET = r"""
import json, os, sys, time
mode, did = sys.argv[1], int(sys.argv[2])
import torch
from nnunetv2.utilities.plans_handling.plans_handler import PlansManager
pre = os.path.join(os.environ["nnUNet_preprocessed"])
def load():
    name = [d for d in os.listdir(pre) if d.startswith(f"Dataset{did}_")][0]
    plans = json.load(open(os.path.join(pre, name, "nnUNetPlans.json")))
    ds = json.load(open(os.path.join(pre, name, "dataset.json")))
    pm = PlansManager(plans)
    return pm, pm.get_configuration("3d_fullres"), ds
if mode == "plan":
    from nnunetv2.dataset_conversion.convert_MSD_dataset import convert_msd_dataset
    from nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor import DatasetFingerprintExtractor
    from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import ExperimentPlanner
    convert_msd_dataset(sys.argv[3], overwrite_target_id=did, num_processes=2)
    DatasetFingerprintExtractor(did, num_processes=2).run(overwrite_existing=True)
    plans = ExperimentPlanner(did, gpu_memory_target_in_gb=8).plan_experiment()
    from importlib.metadata import version
    print("NNUNET_JSON" + json.dumps({"version": version("nnunetv2"), "plans": plans}))
elif mode == "predict":
    mirror, out, procs, files = sys.argv[3] == "1", sys.argv[4], int(sys.argv[5]), sys.argv[6:]
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
    pm, cm, ds = load()
    arch = cm.network_arch_class_name, cm.network_arch_init_kwargs, cm.network_arch_init_kwargs_req_import
    net = get_network_from_plans(*arch, len(ds["channel_names"]), len(ds["labels"]), deep_supervision=False)
    predictor = nnUNetPredictor(tile_step_size=0.5, use_gaussian=True, use_mirroring=mirror,
                                perform_everything_on_device=False, device=torch.device("cpu"), allow_tqdm=False)
    predictor.manual_initialization(net, pm, cm, [net.state_dict()], ds, "nnUNetTrainer", (0, 1, 2))
    t0 = time.perf_counter()
    predictor.predict_from_files([[f] for f in files], out, save_probabilities=False, overwrite=True,
                                 num_processes_preprocessing=procs, num_processes_segmentation_export=procs)
    print("NNUNET_JSON" + json.dumps({"predict_s": time.perf_counter() - t0,
                                      "parameters": sum(p.numel() for p in net.parameters())}))
elif mode == "preprocess":
    import numpy as np
    from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor
    pm, cm, ds = load()
    out, files = sys.argv[3], sys.argv[4:]
    for f in files:
        data, _, props = DefaultPreprocessor(verbose=False).run_case([f], None, pm, cm, ds)
        np.save(os.path.join(out, os.path.basename(f).replace(".nii.gz", ".npy")), data.astype(np.float32))
    print("NNUNET_JSON" + json.dumps({"transpose_forward": pm.transpose_forward, "spacing": cm.spacing}))
"""


CPU_S: list[float] = []  # CPU seconds (user + system, the process and the children it waited for) of each run()


def run(cmd: list[str], env: dict, timeout: float) -> tuple[float, str]:
    """(wall seconds, stdout) of a whole process; a hang or a failure stops the benchmark with its tail.
    Its CPU seconds are appended to ``CPU_S``: on a shared machine the work done is steadier than the wall."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"timed out after {timeout:.0f} s: {' '.join(cmd[:6])} ...") from None
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_S.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd[:6])} ...\n{r.stderr[-3000:]}")
    return wall, r.stdout


def nnunet(python: str, work: Path, args: list[str], timeout: float) -> tuple[float, dict]:
    env = dict(os.environ, nnUNet_raw=str(work / "raw"), nnUNet_preprocessed=str(work / "pre"),
               nnUNet_results=str(work / "res"), PYTHONPATH="")
    for k in ("raw", "pre", "res"):
        (work / k).mkdir(parents=True, exist_ok=True)
    wall, out = run([python, "-c", NNUNET, *args], env, timeout)
    line = next((x for x in out.splitlines() if x.startswith("NNUNET_JSON")), None)
    if line is None:
        raise SystemExit(f"nnU-Net printed no result for {args[:2]}")
    return wall, json.loads(line[len("NNUNET_JSON"):])


def fastvision(args: list[str], timeout: float) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return run([sys.executable, "-m", "fastvision", *args], env, timeout)


def to_ours(values, transpose_forward):
    """nnU-Net's transposed (z, y, x) order -> fastvision's (X, Y, Z): original axis i is our 2 - i."""
    out = [None] * 3
    for k, v in enumerate(values):
        out[2 - transpose_forward[k]] = v
    return out


def same_plan(plan: dict, nn_plans: dict) -> dict:
    """configure's patch / strides / stages against nnU-Net's 3d_fullres (in X, Y, Z)."""
    tf = nn_plans["transpose_forward"]
    conf = nn_plans["configurations"]["3d_fullres"]
    arch = conf["architecture"]["arch_kwargs"]
    ours = plan["fit"]["topology"]
    theirs = {"patch": to_ours(conf["patch_size"], tf), "strides": [to_ours(s, tf) for s in arch["strides"]],
              "spacing": to_ours(conf["spacing"], tf)}
    return {"nnunet": theirs, "fastvision": {"patch": ours.patch, "strides": ours.strides,
                                             "spacing": plan["geometry"]["spacing"]},
            "match": theirs["patch"] == ours.patch and theirs["strides"] == ours.strides}


def geometry_agreement(inputs: list[Path], folders: dict[str, Path]) -> list[dict]:
    """Per case: each tool's segmentation on the input's grid (shape equal, affine within 1e-4 mm)."""
    import nibabel as nib
    import numpy as np

    rows = []
    for f in inputs:
        case = f.name[: -len(".nii.gz")]
        ref = nib.load(str(f))
        row = {"case": case}
        for who, folder in folders.items():
            seg = nib.load(str(folder / f"{case}.nii.gz"))
            row[who] = bool(seg.shape == ref.shape and np.allclose(seg.affine, ref.affine, atol=1e-4))
        rows.append(row)
    return rows


def preprocessing_agreement(recipe: Path, inputs: list[Path], nn_dir: Path, transpose_forward) -> list[dict]:
    """fastvision's network input against nnU-Net's, per case, in fastvision's axes (RAS X, Y, Z):
    the shape the network sees (fastvision crops to its foreground box), and the values of the whole
    resampled, normalised volume (fastvision without the crop; nnU-Net keeps every non-zero voxel,
    all of a CT) where the shapes match."""
    import dataclasses

    import nibabel as nib
    import numpy as np

    from fastvision.config import load
    from fastvision.data.preprocess3d import orientation_to_ras, preprocess_case, reorient
    from fastvision.inference.nifti import prediction_preprocessing

    cfg = load(str(recipe))
    params, _ = prediction_preprocessing(None, cfg.data.name, cfg.data.args)
    whole = dataclasses.replace(params, crop_foreground=False)
    rows = []
    for f in inputs:
        seen = preprocess_case({"image": [f], "label": None}, params)["image"][0].numpy()
        ours = preprocess_case({"image": [f], "label": None}, whole)["image"][0].numpy()
        theirs = np.load(nn_dir / f.name.replace(".nii.gz", "_0000.npy"))[0]
        theirs = np.transpose(theirs, np.argsort(transpose_forward)).transpose(2, 1, 0)  # stored voxel order
        affine = nib.load(str(f)).affine
        theirs, _ = reorient(theirs, affine, orientation_to_ras(affine))
        row = {"case": f.name[: -len(".nii.gz")], "fastvision_network_input": list(seen.shape),
               "fastvision_uncropped": list(ours.shape), "nnunet": list(theirs.shape)}
        if ours.shape == theirs.shape:
            row["mean_abs_diff"] = float(np.abs(ours - theirs).mean())
            row["correlation"] = float(np.corrcoef(ours.ravel(), theirs.ravel())[0, 1])
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nnunet-python", default="/work/nnunet-venv/bin/python")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    ap.add_argument("--cases", type=int, default=20, help="test cases predicted by both")
    ap.add_argument("--size", type=int, default=32, help="in-plane voxels of the generated CT")
    ap.add_argument("--zoom", type=float, default=2.0, help="spacing multiplier (the body fits at size 32)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds per setting")
    ap.add_argument("--first-round", type=int, default=0, help="start the order's rotation here (a second run)")
    ap.add_argument("--nnunet-procs", type=int, default=2,
                    help="nnU-Net's preprocessing and export processes (its CLI default is 3; 2 cores here)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before one process is given up")
    ap.add_argument("--predict-args", default="", help="more `fastvision predict` flags, e.g. '--nproc 2'")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="predict_vs_nnunet_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "Task09_Spleen"
    if not data.exists():
        fastvision(["data", "synth", "spleen", str(data), "--cases", "4", "--test-cases", str(args.cases),
                    "--size", str(args.size), "--zoom", str(args.zoom)], args.timeout)
    inputs = sorted((data / "imagesTs").glob("*.nii.gz"))
    nn = work / "nnunet"
    if not (nn / "plans.json").exists():
        _, got = nnunet(args.nnunet_python, nn, ["plan", str(DATASET_ID), str(data)], args.timeout)
        (nn / "plans.json").write_text(json.dumps(got))
    got = json.loads((nn / "plans.json").read_text())
    nn_plans, version = got["plans"], got["version"]
    nn_inputs = sorted((nn / "raw").glob(f"Dataset{DATASET_ID}_*/imagesTs/*.nii.gz"))
    assert len(nn_inputs) == len(inputs), (len(nn_inputs), len(inputs))

    from fastvision.planning.configure import configure

    recipe = work / "recipe.yaml"
    if not recipe.exists():
        fastvision(["configure", str(data), "--memory", "8GiB", "--out", str(recipe)], args.timeout)
    plan = same_plan(configure(data, memory="8GiB"), nn_plans)
    print(f"plan: fastvision {plan['fastvision']} / nnU-Net {plan['nnunet']}: "
          f"{'same' if plan['match'] else 'DIFFERENT'}", file=sys.stderr)
    _, help_text = fastvision(["predict", "--help"], args.timeout)
    # the 3 axes nnU-Net mirrors, named (recipes configured before 2026-11-26 trained no flips)
    has_tta = "--tta-axes" in help_text
    train = ["--epochs", "1", "--set", "train.steps_per_epoch=1", "--set", "data.cache=ram",
             "--set", "data.cache_dir=null", "--set", "data.args.num_folds=2"]
    # "fastvision": the recipe as configured (its CT crop to the voxels above the window's lower
    # bound: fewer voxels than nnU-Net's crop to non-zero); "fastvision-whole": crop_foreground off,
    # so the network sees nnU-Net's voxels (a CT has no zero voxel to crop)
    variants = {"fastvision": [], "fastvision-whole": ["--set", "data.args.crop_foreground=false"]}
    runs = {}
    for who, extra in variants.items():
        for mirror in (False, True):
            tta = mirror and not has_tta
            run_dir = work / f"run{'-whole' if extra else ''}{'-tta' if tta else ''}"
            runs[who, mirror] = run_dir
            if not (run_dir / "summary.json").exists():  # trained already (a rerun with the same --work)
                more = ["--set", "task.args.sliding_window.tta_flips=[0,1,2]"] if tta else []
                fastvision(["train", str(recipe), "--out", str(run_dir), *train, *extra, *more], args.timeout)

    sides = ["nnunet", *variants]
    times = {m: {**{w: [] for w in sides}, **{f"{w}_cpu": [] for w in sides}, "nnunet_predict_s": []}
             for m in (False, True)}
    params = None
    for r in range(args.rounds):
        for mirror in (False, True):
            tag = "mirror" if mirror else "plain"
            k = (r + args.first_round) % 3
            order = sides[k:] + sides[:k]  # rotated each round: the shared machine's load falls on all
            for who in order:
                if who == "nnunet":
                    wall, res = nnunet(args.nnunet_python, nn, ["predict", str(DATASET_ID), "1" if mirror else "0",
                                                                str(work / f"out-nn-{tag}"), str(args.nnunet_procs),
                                                                *map(str, nn_inputs)], args.timeout)
                    times[mirror]["nnunet_predict_s"].append(res["predict_s"])
                    params = res["parameters"]
                else:
                    cmd = ["predict", str(runs[who, mirror]), *map(str, inputs),
                           "--out", str(work / f"out-{who}-{tag}"), "--force"]
                    cmd += (["--tta-axes", "0,1,2"] if mirror and has_tta else []) + args.predict_args.split()
                    wall, _ = fastvision(cmd, args.timeout)
                times[mirror][who].append(wall)
                times[mirror][f"{who}_cpu"].append(CPU_S[-1])
                print(f"round {r} {tag} {who}: {wall:.1f} s wall, {CPU_S[-1]:.1f} s CPU", file=sys.stderr)

    pre_dir = work / "nn-preprocessed"
    pre_dir.mkdir(exist_ok=True)
    _, pre = nnunet(args.nnunet_python, nn, ["preprocess", str(DATASET_ID), str(pre_dir), *map(str, nn_inputs)],
                    args.timeout)
    geometry = geometry_agreement(inputs, {"nnunet": work / "out-nn-plain", "fastvision": work / "out-fastvision-plain",
                                           "fastvision-whole": work / "out-fastvision-whole-plain"})
    prep = preprocessing_agreement(recipe, inputs, pre_dir, pre["transpose_forward"])
    report = {"nnunetv2": version, "cases": len(inputs), "plan": plan, "nnunet_parameters": params,
              "fastvision_tta_flag": has_tta, "predict_args": args.predict_args, "nnunet_procs": args.nnunet_procs,
              "rounds": args.rounds,
              "times": {("mirror" if m else "plain"): t for m, t in times.items()},
              "geometry": geometry, "preprocessing": prep}
    print(text(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def text(rep: dict) -> str:
    lines = [f"nnunetv2 {rep['nnunetv2']}, {rep['cases']} cases, "
             f"plan {'the same' if rep['plan']['match'] else 'DIFFERS'}"
             f" (patch {rep['plan']['fastvision']['patch']} / {rep['plan']['nnunet']['patch']}), "
             f"nnU-Net network {rep['nnunet_parameters']:,} parameters", "",
             "| mirroring | time | nnU-Net process | fastvision predict (as configured) | ratio "
             "| fastvision predict, whole volume | ratio |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for tag, t in rep["times"].items():
        for kind, suffix in (("wall s", ""), ("CPU s", "_cpu")):
            nn = statistics.median(t["nnunet" + suffix])
            fv, whole = statistics.median(t["fastvision" + suffix]), statistics.median(t["fastvision-whole" + suffix])
            lines.append(f"| {'8 flips, 3 axes' if tag == 'mirror' else 'none'} | {kind} | {nn:.1f} | {fv:.1f} | "
                         f"{fv / nn:.2f} | {whole:.1f} | {whole / nn:.2f} |")
    geo = rep["geometry"]
    lines.append("")
    lines.append("output on the input's grid (shape and affine): " + ", ".join(
        f"{who} {sum(g[who] for g in geo)}/{len(geo)}" for who in ("nnunet", "fastvision", "fastvision-whole")))
    prep = rep["preprocessing"]
    same = [p for p in prep if "mean_abs_diff" in p]
    lines.append(f"resampled volume shape equal (fastvision uncropped vs nnU-Net) in {len(same)}/{len(prep)} cases" + (
        f"; where equal: mean |difference| {statistics.median(p['mean_abs_diff'] for p in same):.3g} "
        f"(median over cases, z-scored units), correlation {min(p['correlation'] for p in same):.4f} (lowest)"
        if same else ""))
    for p in prep[:5]:
        lines.append(f"  {p['case']}: fastvision's network input {p['fastvision_network_input']} (uncropped "
                     f"{p['fastvision_uncropped']}), nnU-Net's {p['nnunet']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
