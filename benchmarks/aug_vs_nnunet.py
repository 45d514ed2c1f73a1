"""nnU-Net v2's training augmentation: fastvision's batched ops against batchgeneratorsv2's transforms,
on the same patch and probabilities, one CPU thread each (patches/s per core), plus each op's cost.

nnU-Net's side runs in its OWN virtual environment (``--nnunet-python``): the pipeline is
``nnUNetTrainer.get_training_transforms`` itself (3-D, rotation +-30 degrees, mirroring on every
axis, no deep supervision), applied per patch as nnU-Net's data loader does. fastvision's is the
spec ``configure --trainer nnunet`` writes (``planning.configure.recipe.augmentation``), applied to a
batch of ``--batch`` patches at once. Per-op cost: each op alone with every probability (and its
per-channel probability) at 1, i.e. its cost when it fires; the pipeline figure uses the real
probabilities. Rounds interleave the two sides; the figures are medians. Per core = the process's CPU
time (``time.process_time``: one thread each, so a neighbour's load on a shared machine does not count);
the pipeline's wall-clock ratio is printed beside it. ``--labels`` sets the classes in the label patch
(nnU-Net resamples labels per class); two more affine rows time ``label_mode: linear`` and the network's
patch sampled from nnU-Net's enlarged initial patch (``affine.size``); ``--initial`` feeds both pipelines
the initial patch, as nnU-Net's loader feeds its transforms. Two more rows split the affine: rotation
only and scale only (fastvision resamples a zoom without rotation separably, one 1-D pass per axis). The
"in pipeline" column times each op as the pipeline runs it after an earlier op's copy: in place, as
nnU-Net's transforms update their (cloned) input. Labels: ``--label-dtype`` (uint8 by default, what
fastvision's 3-D loader gives; the second pass fed int64 labels, copied and narrowed to uint8 in each call).
Host memory: fastvision's side runs under ``train.cpu_heap`` as ``train`` sets it (``--cpu-heap``, default the
config's ``keep``: glibc keeps freed tensor memory instead of faulting in fresh pages for each new tensor);
nnU-Net's under the C library's defaults, as it runs, unless ``--nnunet-heap keep`` gives it the same
parameters through glibc's environment variables (the allocator's share of the ratio).

Usage (about 3 minutes on 2 shared cores; the figures in RESULTS.md use ``--n 512 --rounds 5``, about 7
minutes a set: with 128 patches a round, single rounds of fastvision's side moved by up to 1.35x)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/aug_vs_nnunet.py --nnunet-python /work/nnunet-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from fastvision.config import TrainConfig

NNUNET = r"""
import json, sys, time
import numpy as np, torch
torch.set_num_threads(1)
from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer
from batchgeneratorsv2.transforms.utils.random import RandomTransform
cfg = json.loads(sys.argv[1])
patch, c, n = cfg["patch"], cfg["channels"], cfg["n"]
rot = (-30 / 360 * 2 * np.pi, 30 / 360 * 2 * np.pi)
def pipeline():
    return nnUNetTrainer.get_training_transforms(patch, rot, None, (0, 1, 2), False)
NAMES = {"SpatialTransform": "affine", "GaussianNoiseTransform": "noise", "GaussianBlurTransform": "blur",
         "MultiplicativeBrightnessTransform": "brightness", "ContrastTransform": "contrast",
         "SimulateLowResolutionTransform": "lowres", "MirrorTransform": "flip"}
def ops():
    out = {}
    for t in pipeline().transforms:
        inner = t.transform if isinstance(t, RandomTransform) else t
        name = type(inner).__name__
        if name == "GammaTransform":
            name = "gamma_inverted" if inner.p_invert_image == 1 else "gamma"
        else:
            name = NAMES.get(name)
        if name is None:
            continue
        for k in ("p_per_channel", "p_rotation", "p_scaling"):
            if hasattr(inner, k):
                setattr(inner, k, 1.0)
        out[name] = inner
    return out
g = torch.Generator().manual_seed(0)
def inputs(size):
    return torch.randn(c, *size, generator=g), torch.randint(0, cfg["labels"], (1, *size), generator=g).to(torch.int16)
img, seg = inputs(patch)
def rate(t, n, clock=time.process_time, img=img, seg=seg):
    for _ in range(8):  # warm-up; the blur's fft-or-conv choice is timed once per size and kernel, then cached
        t(image=img.clone(), segmentation=seg.clone())
    t0, c0 = time.perf_counter(), clock()
    for _ in range(n):
        t(image=img.clone(), segmentation=seg.clone())
    return (clock() - c0) / n, (time.perf_counter() - t0) / n
# the pipeline's input: the network's patch, or (--initial) the enlarged initial patch nnU-Net's loader cuts
pipe_img, pipe_seg = inputs(cfg["initial"]) if cfg["from_initial"] else (img, seg)
pipe = rate(pipeline(), n, img=pipe_img, seg=pipe_seg)
res = {"pipeline_s": pipe[0], "pipeline_wall_s": pipe[1],
       "ops_s": {k: rate(t, max(2, n // 4))[0] for k, t in ops().items()}}
# SpatialTransform (its labels always per class, linear) from nnU-Net's enlarged initial patch
big_img, big_seg = inputs(cfg["initial"])
res["ops_s"]["affine, from the initial patch"] = rate(ops()["affine"], max(2, n // 4), img=big_img, seg=big_seg)[0]
# the affine split: rotation (with no scaling) and scaling alone, each forced
for key, (p_rot, p_scale) in {"affine, rotation only": (1.0, 0.0), "affine, scale only": (0.0, 1.0)}.items():
    t = ops()["affine"]
    t.p_rotation, t.p_scaling = p_rot, p_scale
    res["ops_s"][key] = rate(t, max(2, n // 4))[0]
print("NNUNET_JSON" + json.dumps(res))
"""


def fastvision_times(patch: list[int], channels: int, batch: int, n: int, compiled: bool = False,
                     labels: int = 2, from_initial: bool = False, label_dtype: str = "uint8", seed: int = 0) -> dict:
    """Seconds per patch: the nnU-Net pipeline as ``configure --trainer nnunet`` writes it, and each op alone;
    ``compiled``: with ``affine.compiled`` (the fused kernel, compiled before the clock starts). More affine
    rows: labels resampled per class (``label_mode: linear``, nnU-Net's rule), the network's patch sampled
    from nnU-Net's enlarged initial patch (``size``), rotation only and scale only, all forced to fire.
    ``ops_inplace_s``: each op as it runs inside the pipeline, on a tensor an earlier op made (which it
    updates in place; alone, an op leaves the caller's input as it was and writes a new tensor). ``seed``: the
    generator of the inputs and of every draw (each round passes its own, so the rounds' medians average over
    draws, as nnU-Net's side, whose transforms draw from numpy's unseeded global generator)."""
    import torch

    from fastvision.data.augment.spatial import _Rng, affine, build_augment
    from fastvision.planning.configure.recipe import augmentation
    from fastvision.planning.configure.trainer import initial_patch

    torch.set_num_threads(1)
    spec, _ = augmentation(patch, [1.0] * 3, None, "nnunet")
    big = initial_patch(patch, spec["affine"]["degrees"], False, 0)
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(batch, channels, *patch, generator=g)
    seg = torch.randint(0, labels, (batch, *patch), generator=g).to(getattr(torch, label_dtype))
    if compiled:
        spec["affine"]["compiled"] = True
        for k in range(1, batch + 1):  # compile for every count of firing samples
            affine(img[:k], seg[:k].to(torch.uint8), torch.full((k, 3), 0.1), torch.ones(k, 3), compiled=True)

    def rate(aug, n: int, img=img, seg=seg) -> tuple[float, float]:
        for _ in range(8):  # warm-up, as the other side
            aug(img.clone(), seg.clone(), g)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            aug(img.clone(), seg.clone(), g)
        return (time.process_time() - c0) / (n * batch), (time.perf_counter() - t0) / (n * batch)

    def _owner(gen, batch: int, device) -> _Rng:
        """A random source whose caller holds no tensor: the op owns its input, as after an earlier op."""
        rng = _Rng(gen, batch, device)
        rng.caller = set()
        return rng

    def forced(opts: dict) -> dict:
        return {k: (1.0 if k.endswith("prob") else v) for k, v in opts.items()}

    ops, inplace, n_op = {}, {}, max(1, n // (4 * batch))
    for name, opts in spec.items():
        if opts is None:
            continue
        ops[name] = rate(build_augment(3, **{name: forced(opts)}), n_op)[0]
        op = build_augment(3, **{name: forced(opts)}).ops[0][1]
        inplace[name] = rate(lambda x, y, gen, op=op: op(x, y, _owner(gen, batch, x.device)), n_op)[0]
    aff = forced(spec["affine"])
    ops["affine, linear labels"] = rate(build_augment(3, affine={**aff, "label_mode": "linear"}), n_op)[0]
    big_img = torch.randn(batch, channels, *big, generator=g)
    big_seg = torch.randint(0, labels, (batch, *big), generator=g).to(seg.dtype)
    ops["affine, from the initial patch"] = rate(
        build_augment(3, affine={**aff, "label_mode": "linear", "size": list(patch)}), n_op, big_img, big_seg)[0]
    for key, (p_rot, p_scale) in {"affine, rotation only": (1.0, 0.0), "affine, scale only": (0.0, 1.0)}.items():
        ops[key] = rate(build_augment(3, affine={**aff, "rotate_prob": p_rot, "zoom_prob": p_scale}), n_op)[0]
    if from_initial:  # the affine samples the network's patch from the loader's enlarged one
        spec["affine"].update(size=list(patch), label_mode="linear")
    pipe = rate(build_augment(3, **spec), max(1, n // batch), *((big_img, big_seg) if from_initial else ()))
    return {"pipeline_s": pipe[0], "pipeline_wall_s": pipe[1], "ops_s": ops, "ops_inplace_s": inplace}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nnunet-python", default="/work/nnunet-venv/bin/python")
    ap.add_argument("--patch", type=int, nargs=3, default=[64, 64, 64])
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2, help="fastvision's batch (nnU-Net augments one patch at a time)")
    ap.add_argument("--n", type=int, default=16, help="patches per pipeline measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="fastvision's affine with its compiled CPU kernel")
    ap.add_argument("--labels", type=int, default=2, help="classes in the label patch (background included)")
    ap.add_argument("--label-dtype", default="uint8", choices=["uint8", "int16", "int64"],
                    help="fastvision's label patch dtype (uint8: what its 3-D loader gives, preprocess3d; "
                         "nnU-Net's side gets int16, its own)")
    ap.add_argument("--initial", action="store_true",
                    help="both pipelines start from nnU-Net's enlarged initial patch (fastvision: affine.size, "
                         "label_mode linear), as nnU-Net's loader feeds its transforms")
    ap.add_argument("--cpu-heap", choices=["keep", "system"], default=TrainConfig().cpu_heap,
                    help="fastvision's train.cpu_heap (default: the config's, what train sets in engine.build)")
    ap.add_argument("--nnunet-heap", choices=["keep", "system"], default="system",
                    help="keep: nnU-Net's process gets the same malloc parameters through glibc's environment "
                         "variables (MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_), to see the allocator's share")
    ap.add_argument("--seed", type=int, default=0, help="fastvision's draws: round r uses seed + r")
    ap.add_argument("--json")
    args = ap.parse_args()
    from fastvision.engine import runtime
    from fastvision.planning.configure.trainer import initial_patch

    runtime.set_heap(args.cpu_heap)  # in this process, as engine.build does for train

    cfg = {"patch": args.patch, "channels": args.channels, "n": args.n, "labels": args.labels,
           "from_initial": args.initial,
           "initial": initial_patch(args.patch, 30, False, 0)}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="", nnUNet_raw="/tmp", nnUNet_preprocessed="/tmp",
               nnUNet_results="/tmp")
    if args.nnunet_heap == "keep":
        env.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(runtime.HEAP_KEEP_TRIM))
    fv, nn = [], []
    for rnd in range(args.rounds):  # interleaved: a neighbour's load hits both sides alike
        fv.append(fastvision_times(args.patch, args.channels, args.batch, args.n, args.compiled, args.labels,
                                   args.initial, args.label_dtype, seed=args.seed + rnd))
        r = subprocess.run([args.nnunet_python, "-c", NNUNET, json.dumps(cfg)], env=env, capture_output=True,
                           text=True, check=False)
        line = next((x for x in r.stdout.splitlines() if x.startswith("NNUNET_JSON")), None)
        if line is None:
            raise SystemExit(f"nnU-Net side failed:\n{r.stderr[-3000:]}")
        nn.append(json.loads(line[len("NNUNET_JSON"):]))

    def med(rows, key, op=None):
        return statistics.median(r["ops_s"][op] if op else r[key] for r in rows)

    f_pipe, n_pipe = med(fv, "pipeline_s"), med(nn, "pipeline_s")
    f_wall, n_wall = med(fv, "pipeline_wall_s"), med(nn, "pipeline_wall_s")
    out = {"patch": args.patch, "channels": args.channels, "batch": args.batch, "rounds": args.rounds,
           "seed": args.seed,
           "cpu_heap": args.cpu_heap, "nnunet_heap": args.nnunet_heap,
           "from_initial": args.initial, "label_dtype": args.label_dtype,
           "compiled": args.compiled,
           "fastvision_patches_per_s_per_core": 1 / f_pipe, "nnunet_patches_per_s_per_core": 1 / n_pipe,
           "ratio": n_pipe / f_pipe, "wall_ratio": n_wall / f_wall, "ops_ms": {}}
    print(f"patch {args.patch} x {args.channels} ch, 1 thread each, median of {args.rounds} interleaved rounds; "
          f"heap: fastvision {args.cpu_heap}, nnU-Net {args.nnunet_heap}")
    print(f"pipeline (CPU time): fastvision {1 / f_pipe:.2f} patches/s (batch {args.batch}), nnU-Net "
          f"{1 / n_pipe:.2f} patches/s: {n_pipe / f_pipe:.2f}x; wall clock {1 / f_wall:.2f} vs {1 / n_wall:.2f}: "
          f"{n_wall / f_wall:.2f}x")
    rounds = [(1 / f["pipeline_s"], 1 / m["pipeline_s"]) for f, m in zip(fv, nn, strict=True)]
    out["rounds_patches_per_s"] = [{"fastvision": a, "nnunet": b} for a, b in rounds]
    out["round_ratio_median"] = statistics.median(a / b for a, b in rounds)
    print("per round (fastvision / nnU-Net patches/s, ratio): "
          + "; ".join(f"{a:.1f} / {b:.1f}, {a / b:.2f}x" for a, b in rounds)
          + f"; median of the rounds' ratios {out['round_ratio_median']:.2f}x")
    print(f"{'op (fires, p = 1)':<32} {'fastvision ms':>14} {'in pipeline':>12} {'nnU-Net ms':>11} {'ratio':>6} "
          f"{'ratio in pipeline':>18}  (CPU time per patch)")
    for op in fv[0]["ops_s"]:
        theirs = "affine" if op == "affine, linear labels" else op  # SpatialTransform's labels are always linear
        a, b = med(fv, None, op) * 1e3, (med(nn, None, theirs) * 1e3 if theirs in nn[0]["ops_s"] else float("nan"))
        c = (statistics.median(r["ops_inplace_s"][op] for r in fv) * 1e3 if op in fv[0]["ops_inplace_s"]
             else float("nan"))
        out["ops_ms"][op] = {"fastvision": a, "fastvision_in_pipeline": c, "nnunet": b}
        print(f"{op:<32} {a:>14.2f} {c:>12.2f} {b:>11.2f} {b / a:>6.2f} {b / c:>18.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
