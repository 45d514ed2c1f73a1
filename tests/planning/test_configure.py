"""``fastvision configure``: nnU-Net's planning rules on table cases worked out by hand, the batch
and patch against ``plan``'s estimate, and the written recipe loading and training.

Rules cited (nnU-Net v2, ``ExperimentPlanner.determine_fullres_target_spacing`` and
``network_topology.get_pool_and_conv_props``; Isensee et al., Nature Methods 18, 2021, online
methods "Rule-based parameters"): target spacing is the median; when the coarsest axis is more than
3x coarser than the others and has 3x fewer voxels, it takes the 10th percentile of its spacings
(not finer than the other axes); an axis is pooled while its map has >= 2 x 4 voxels and its
spacing is within 2x of the finest pooled axis; a single remaining axis needs >= 3 x 4 voxels; a
conv kernel is 3 along an axis once its spacing is within 2x of the smallest, else 1.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from fastvision.errors import ConfigError
from fastvision.planning.configure import planner, rules

pytestmark = pytest.mark.usefixtures("traced_once")  # tests/planning/conftest.py


@pytest.mark.parametrize(
    "spacings,shapes,expected,rule",
    [
        ([[1, 1, 1], [1, 1, 1.2], [1, 1, 1.4]], [[100, 100, 100]] * 3, [1, 1, 1.2], "median spacing"),
        # prostate-like: z 6x coarser, 16x fewer voxels -> 10th percentile of z: 3.0 + 0.4 x 0.6
        ([[0.6, 0.6, z] for z in (3.0, 3.6, 3.6, 4.0, 4.0)], [[320, 320, 20]] * 5, [0.6, 0.6, 3.24], "anisotropic"),
        # coarse spacing but as many voxels along z (a long thin field of view): the median stays
        ([[0.6, 0.6, z] for z in (3.0, 3.6, 4.0)], [[100, 100, 90]] * 3, [0.6, 0.6, 3.6], "median spacing"),
        # the 10th percentile (0.8) is finer than the other axes (1.0): clamped to 1.0 + 1e-5
        ([[1, 1, z] for z in (0.8, 0.8, 5, 5, 5)], [[200, 200, 20]] * 5, [1, 1, 1.00001], "anisotropic"),
    ],
)
def test_target_spacing(spacings, shapes, expected, rule):
    got, why = rules.target_spacing(spacings, shapes)
    assert got == pytest.approx(expected)
    assert rule in why


@pytest.mark.parametrize(
    "spacing,patch,strides,kernels,padded",
    [
        # isotropic 128^3: 5 pools to a 4^3 bottleneck, 3^3 kernels everywhere
        ((1, 1, 1), (128, 128, 128), [[1, 1, 1]] + [[2, 2, 2]] * 5, [[3, 3, 3]] * 6, [128, 128, 128]),
        # prostate-like: in-plane only until z is within 2x of x/y, then all axes; 3x3x1 kernels first
        ((0.6, 0.6, 3.6), (160, 160, 20),
         [[1, 1, 1], [2, 2, 1], [2, 2, 1], [2, 2, 2], [2, 2, 2], [2, 2, 1]],
         [[3, 3, 1], [3, 3, 1], [3, 3, 3], [3, 3, 3], [3, 3, 3], [3, 3, 3]], [160, 160, 20]),
        # one axis left: pooled only while its map has >= 12 voxels (44 -> 22 -> 11 stops)
        ((1, 1, 1), (8, 8, 44), [[1, 1, 1], [2, 2, 2], [1, 1, 2]], [[3, 3, 3]] * 3, [8, 8, 44]),
        # padding to the divisor: 100 -> 2^4 = 16 -> 112
        ((1, 1, 1), (100, 100, 100), [[1, 1, 1]] + [[2, 2, 2]] * 4, [[3, 3, 3]] * 5, [112, 112, 112]),
    ],
)
def test_topology(spacing, patch, strides, kernels, padded):
    t = rules.topology(spacing, patch)
    assert t.strides == strides and t.kernels == kernels and t.patch == padded
    assert t.divisor == [math.prod(s[a] for s in strides) for a in range(3)]


def test_initial_patch_keeps_the_voxel_aspect():
    assert rules.initial_patch((1, 1, 1), (100, 200, 300)) == [100, 200, 256]
    # 1 / spacing = (2, 2, 0.5) scaled to 256^3 voxels: x (256^3 / 2)^(1/3) = 203.19 -> 406, 406, 102
    assert rules.initial_patch((0.5, 0.5, 2.0), (500, 500, 80)) == [406, 406, 80]


def test_shrink_takes_the_axis_largest_against_the_median():
    # 160 / 160 < 20 / 10: z is the largest relative to the median; its divisor (4) comes off
    assert rules.shrink_patch((0.6, 0.6, 3.6), (160, 160, 20), (160, 160, 10)) == [160, 160, 16]


def test_normalisation():
    ct = [{"modality": "CT", "mean": 100.0, "std": 50.0, "percentile_00_5": -50.0, "percentile_99_5": 300.0}]
    args, why = rules.normalisation(ct)
    assert args == {"intensity": "ct", "window": [-50.0, 300.0, -3.0, 4.0]}  # (p - mean) / std
    assert "clip" in why
    assert rules.normalisation([{"modality": "T2"}, {"modality": "ADC"}])[0] == {"intensity": "mri"}


def test_thin_stack_plans_slice_wise():
    geo = {"spacing": [0.8, 0.8, 6.0], "median_shape": [96, 96, 5], "thin_axis": rules.thin_axis([96, 96, 5])}
    assert geo["thin_axis"] == 2
    t = planner.topology_for(geo, [96, 96, 1])
    assert all(s[2] == 1 for s in t.strides) and all(k[2] == 1 for k in t.kernels) and t.patch[2] == 1
    assert rules.thin_axis([40, 50, 35]) is None


@pytest.mark.parametrize("patch,spacing,thin,flip_axes,rotate_axes,degrees", [
    # nnU-Net's rule: dummy 2-D when max(patch) / patch[coarsest-spacing axis] > 3
    ([128, 128, 128], [1.0, 1.0, 1.0], None, [0, 1, 2], None, 30),
    ([160, 160, 48], [0.8, 0.8, 3.0], None, [0, 1, 2], [2], 180),   # 160 / 48 = 3.33 > 3
    ([160, 160, 56], [0.8, 0.8, 3.0], None, [0, 1, 2], None, 30),   # 160 / 56 = 2.86: full 3-D rotation
    ([40, 192, 160], [4.0, 0.7, 0.7], None, [0, 1, 2], [0], 180),   # the coarse axis may be any of the three
    ([96, 96, 1], [0.8, 0.8, 6.0], 2, [0, 1], [2], 180),            # thin stack: slice-wise, no flip of depth 1
])
def test_augmentation_follows_nnunet_rotation_and_mirroring(patch, spacing, thin, flip_axes, rotate_axes, degrees):
    from fastvision.data.augment.spatial import build_augment
    from fastvision.planning.configure.recipe import augmentation

    aug, why = augmentation(patch, spacing, thin)
    assert aug["flip"] == {"prob": 0.5, "axes": flip_axes}
    assert aug["affine"]["degrees"] == degrees and aug["affine"].get("rotate_axes") == rotate_axes
    assert aug["affine"]["scale"] == [0.7, 1.4] and aug["affine"]["prob"] == 0.2 and aug["affine"]["same_zoom"]
    if rotate_axes:  # zoom in the plane of the slices only
        assert aug["affine"]["zoom_axes"] == [a for a in range(3) if a != rotate_axes[0]]
    assert (aug["gamma"]["prob"], aug["noise"]["prob"], aug["brightness"]["prob"]) == (0.3, 0.1, 0.15)
    assert "nnU-Net" in why and build_augment(3, **aug) is not None  # every option is valid


def test_memory_budget_parsing():
    assert planner.memory_target(memory="24GiB").memory_gib == pytest.approx(24)
    assert planner.memory_target(gpu="H100-80GB").name == "H100-80GB"
    with pytest.raises(ConfigError, match="--memory"):
        planner.memory_target(memory="lots")


def _fingerprint(cases=20, shape=(48, 48, 8), spacing=(0.6, 0.6, 3.6)):
    rng = np.random.default_rng(0)
    recs = [{"id": f"c{i}", "shape": list(shape), "shape_after_crop": list(shape),
             "spacing": [s * rng.uniform(0.95, 1.05) for s in spacing]} for i in range(cases)]
    return {"cases": recs, "n_cases": cases, "name": "fake", "labels": {0: "bg", 1: "a", 2: "b"},
            "median_spacing": list(spacing), "anomalies": {},
            "channels": [{"channel": 0, "modality": "T2"}, {"channel": 1, "modality": "ADC"}]}


def test_batch_and_patch_fit_the_budget():
    """A budget too small for the median-shaped patch at batch 2: the patch shrinks; plan's estimate
    of the chosen batch fits, and one more item would not (or the 5 % coverage cap binds)."""
    from fastvision.planning import estimate as est

    budget = 0.85  # GiB, 0.75 of which is the fixed CUDA context / workspace margin
    plan = planner.configure("unused", fingerprint=_fingerprint(), memory=f"{budget}GiB")
    fit = plan["fit"]
    cfg, batch = fit["cfg"], fit["batch"]
    assert batch >= 2 and fit["shrunk"]
    assert list(fit["topology"].patch) != list(plan["geometry"]["patch"])
    assert est.memory(est.trace(cfg, batch)).total <= budget * 2**30
    if batch < fit["batch_cover"]:
        assert est.memory(est.trace(cfg, batch + 1)).total > budget * 2**30
    assert cfg.task.args["sample_shape"][1:] == list(fit["topology"].patch)


def test_recipe_loads_and_trains_one_epoch(tmp_path):
    """Anisotropic generated prostate at tiny size: configure, load the YAML, train one epoch on CPU."""
    pytest.importorskip("nibabel")
    from fastvision.api import run_training
    from fastvision.config import load
    from fastvision.data.synth import load_all
    from fastvision.planning.configure.recipe import write_recipe

    data = load_all().get("prostate")(tmp_path / "prostate", seed=0, cases=4, size=24, slices=14)
    plan = planner.configure(data, memory="8GiB", fingerprint=None)
    path = write_recipe(plan, tmp_path / "recipe.yaml")
    text = path.read_text()
    assert text.count("  # ") >= 8 and "extends: unet3d-spleen-fast" in text
    cfg = load(str(path))
    assert cfg.model.args["kernel_size"][0] == [3, 3, 1] and cfg.model.args["strides"][1] == [2, 2, 1]
    assert cfg.data.args["patch_size"] == list(plan["fit"]["topology"].patch)
    # nnU-Net's augmentation, the base's intensity shift off, and predict --tta mirrors what training mirrored
    from fastvision.inference.volumes import tta_axes

    assert cfg.data.augment["flip"]["axes"] == tta_axes(cfg) == [0, 1, 2] and cfg.data.augment["gamma"]["prob"] == 0.3
    assert "data.augment" in {k for k, _, _ in plan["choices"]} and "augment: {" in text
    summary = run_training(str(path), out=str(tmp_path / "run"), overrides={"epochs": 1},
                           extra=[{"model": {"args": {"filters": [4, 8, 16, 32][:len(cfg.model.args["filters"])]}},
                                   "data": {"cache": "ram", "cache_dir": None, "args": {"num_folds": 2}}}],
                           progress=False)
    # the base recipe targets dice=0.94: best.pt and best_* follow Dice (they followed IoU)
    assert "best_dice" in summary and "best_iou" not in summary


def test_segresnet_base_plans_an_anisotropic_segresnet():
    import torch

    from fastvision.models import create_model

    plan = planner.configure("unused", fingerprint=_fingerprint(cases=4, shape=(32, 32, 8)), memory="8GiB",
                             base="segresnet")
    cfg = plan["fit"]["cfg"]
    assert cfg.data.augment["intensity"] is None  # seed 003's intensity shift is replaced by nnU-Net's ops
    assert cfg.model.name == "segresnet" and cfg.task.args["mode"] == "softmax" and cfg.task.args["regions"] is None
    args = dict(cfg.model.args)
    assert args["strides"][0] == [2, 2, 1] and args["kernel_size"][0] == [3, 3, 1]
    model = create_model("segresnet", **{**args, "init_filters": 8})
    patch = plan["fit"]["topology"].patch
    assert model(torch.zeros(1, 2, *patch)).shape == (1, 3, *patch)


@pytest.mark.parametrize("memory", ["0GiB", "0", "nan", "inf"])
def test_memory_budget_must_be_positive(memory):
    """``float`` accepts these; ``0`` used to loop forever shrinking the patch."""
    with pytest.raises(ConfigError, match="positive size"):
        planner.memory_target(memory=memory)


@pytest.mark.parametrize("budget", ["0.3GiB", "1e-6GiB"])
def test_budget_too_small_for_any_unet_is_one_line(budget, tmp_path, capsys):
    """A budget below the smallest U-Net's need: one line, exit 2. It used to end in a ValueError
    traceback from the model builder (a patch with no pooling stage left) or never return."""
    from fastvision.cli import main
    from fastvision.data.synth import load_all

    # the small generated set of the tests below: a shorter patch to shrink, the same refusal
    data = load_all().get("prostate")(tmp_path / "Task05", seed=0, cases=4, size=24, slices=14)
    assert main(["configure", str(data), "--memory", budget]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "configure:" in err[0] and "GiB" in err[0] and "Traceback" not in "\n".join(err)


def test_an_existing_out_file_is_kept_unless_forced(tmp_path, capsys):
    """``--out`` over an existing recipe: one line naming it and --force, exit 2, the file untouched;
    checked before the fingerprint (the data folder here does not even exist)."""
    from fastvision.cli import main

    out = tmp_path / "recipe.yaml"
    out.write_text("mine: true\n")
    assert main(["configure", str(tmp_path / "no-such-data"), "--memory", "8GiB", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out) in err[0] and "--force" in err[0]
    assert out.read_text() == "mine: true\n"


@pytest.mark.parametrize("name,memory_gib,capability,amp", [
    ("NVIDIA GeForce RTX 4090", 23.99, (8, 9), "bf16"),
    ("NVIDIA L4", 22.03, (8, 9), "bf16"),
    ("Tesla P100-PCIE-16GB", 15.89, (6, 0), "fp16"),
])
def test_a_local_gpu_missing_from_the_table_is_planned_on_its_own_memory(monkeypatch, name, memory_gib, capability,
                                                                           amp):
    """A plain ``configure`` (no --gpu) on a CUDA device the table lacks used to stop with
    "unknown GPU". The device queries are replaced (this machine has no GPU): the name, memory and
    compute capability torch reports for that board."""
    import types

    import torch

    from fastvision.planning import estimate as est

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: types.SimpleNamespace(total_memory=int(memory_gib * 2**30)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    spec = planner.memory_target()
    assert spec.memory_gib == pytest.approx(memory_gib, rel=1e-6) and name in spec.name
    assert est.amp_for("auto", spec) == amp
    plan = planner.configure("unused", fingerprint=_fingerprint(cases=4, shape=(32, 32, 8)))
    assert plan["gpu_memory_gib"] == pytest.approx(memory_gib, rel=1e-6)
    with pytest.raises(ConfigError, match="unknown GPU"):  # a name the user typed is still checked
        planner.memory_target(gpu=name)


def _cropped_fingerprint(kept: list[float]):
    """Cases whose crop to the non-zero region keeps the given share of the voxels (along x)."""
    fp = _fingerprint(cases=len(kept), shape=(40, 40, 8))
    for c, k in zip(fp["cases"], kept, strict=True):
        c["shape_after_crop"] = [round(40 * k), 40, 8]
    return fp


@pytest.mark.parametrize("kept,intensity", [
    ([0.5, 0.7, 0.9], "mri"),  # median 0.7 < 3/4: nnU-Net z-scores inside the non-zero mask
    ([0.8, 0.8, 0.9], "zscore"),  # median 0.8: every voxel (nnU-Net's use_mask_for_norm False)
    ([0.5, 0.75, 1.0], "zscore"),  # exactly 3/4 is not below it (nnU-Net compares with <)
    ([1.0, 1.0, 1.0], "zscore"),  # nothing cropped (a scan that fills its field of view)
])
def test_mri_uses_the_nonzero_mask_only_where_the_crop_shrank_the_volume(kept, intensity):
    """nnU-Net v2 ``determine_normalization_scheme_and_whether_mask_is_used_for_norm``: the mask
    is used when ``median_relative_size_after_cropping < 3/4``. Today's rule was: always."""
    fp = _cropped_fingerprint(kept)
    assert planner.relative_size_after_crop(fp["cases"]) == pytest.approx(float(np.median(kept)), abs=0.013)
    plan = planner.configure("unused", fingerprint=fp, memory="8GiB")
    assert plan["overrides"]["data"]["args"]["intensity"] == intensity
    assert rules.normalisation(fp["channels"], float(np.median(kept)))[0] == {"intensity": intensity}


def test_zscore_over_every_voxel_against_numpy():
    """``intensity: zscore``: each channel minus its mean over all voxels (zeros included), over the
    population std; a constant channel is only mean-shifted."""
    import torch

    from fastvision.data.preprocess3d import PreprocessParams, _intensity

    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, (2, 5, 6, 7)).astype(np.float32)
    x[0, :2] = 0.0  # background zeros count
    x[1] = 4.0
    out, _ = _intensity(torch.from_numpy(x), PreprocessParams(intensity="zscore"))
    ref0 = (x[0].astype(np.float64) - x[0].mean(dtype=np.float64)) / x[0].std(dtype=np.float64)
    np.testing.assert_allclose(out[0].numpy(), ref0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1].numpy(), 0.0, atol=1e-6)


@pytest.mark.parametrize("batch,gpus,per_gpu", [(2, 1, 2), (5, 2, 3), (8, 4, 2), (2, 8, 1)])
def test_cluster_splits_the_global_batch(batch, gpus, per_gpu):
    """ceil(batch / gpus) per GPU (fastvision's batch is per rank and equal on every rank)."""
    c = rules.cluster(batch, gpus, step_s=0.5, item_bytes=8e6, dataset_bytes=1e9, free_bytes=2**34)
    assert (c.per_gpu, c.global_batch, c.workers) == (per_gpu, per_gpu * gpus, 0)


def test_cluster_counts_host_workers_where_the_cache_does_not_fit():
    """10 GiB of data, 1 GiB free per GPU on 4 GPUs: patches are cut on the host. 2 items of 300 MB
    per 0.2 s step need 3 GB/s: 3 cores at 1 GB/s each."""
    c = rules.cluster(4, 2, step_s=0.2, item_bytes=3e8, dataset_bytes=10 * 2**30, free_bytes=2**30)
    assert c.per_gpu == 2 and c.workers == 3 and "host" in c.why_workers


def test_configure_gpus_writes_the_per_gpu_batch(tmp_path, capsys):
    """``configure --gpus 2``: train.batch_size is half the one-GPU plan's batch (rounded up) and
    the table states the workers; the recipe loads."""
    from fastvision.cli import main
    from fastvision.config import load
    from fastvision.data.synth import load_all

    data = load_all().get("prostate")(tmp_path / "Task05", seed=0, cases=4, size=24, slices=14)
    one = planner.configure(data, memory="8GiB")
    assert main(["configure", str(data), "--memory", "8GiB", "--gpus", "2", "--out", str(tmp_path / "r.yaml")]) == 0
    out = capsys.readouterr().out
    assert "num_workers" in out and "split over 2 GPUs" in out
    cfg = load(str(tmp_path / "r.yaml"))
    assert cfg.train.batch_size == math.ceil(one["fit"]["batch"] / 2)
    assert cfg.data.num_workers == one["cluster"].workers


def test_configure_writes_the_data_folder_absolute(tmp_path, monkeypatch):
    """``configure sp --out r.yaml`` run in one folder, ``train r.yaml`` in another: the recipe's
    data.args.path is the folder itself, not a path relative to where configure ran."""
    from fastvision.cli import main
    from fastvision.config import load
    from fastvision.data.synth import load_all

    load_all().get("prostate")(tmp_path / "Task05", seed=0, cases=4, size=24, slices=14)
    monkeypatch.chdir(tmp_path)
    assert main(["configure", "Task05", "--memory", "8GiB", "--out", "r.yaml"]) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load(str(tmp_path / "r.yaml")).data.args["path"] == str((tmp_path / "Task05").resolve())


def test_configure_gpus_counts_nnunets_iterations_in_global_steps(tmp_path):
    """``--trainer nnunet --gpus 2``: 1000 x 250 iterations are steps of the global batch. 4 cases, 5 folds:
    fold 0 trains on 3; one GPU at batch 2 steps 3 // 2 = 1 per pass (250,000 epochs); two GPUs at batch 1
    each step through ceil(3 / 2) = 2 cases (the sampler pads): 2 steps, 125,000 epochs (not 3 steps'
    83,334, which counts every case on every GPU)."""
    from fastvision.data.synth import load_all

    data = load_all().get("prostate")(tmp_path / "Task05", seed=0, cases=4, size=24, slices=14)
    one = planner.configure(data, memory="8GiB", trainer="nnunet")
    two = planner.configure(data, memory="8GiB", trainer="nnunet", gpus=2)
    assert (one["overrides"]["train"]["batch_size"], two["overrides"]["train"]["batch_size"]) == (2, 1)
    assert (one["overrides"]["train"]["epochs"], two["overrides"]["train"]["epochs"]) == (250_000, 125_000)
    assert two["overrides"]["train"]["val_every"] == 1250
    why = dict((k, w) for k, _, w in two["choices"])["train.epochs"]
    assert "2 steps per pass" in why and "on each of 2 GPUs" in why


def test_nnunet_trainer_writes_nnunet_training(tmp_path):
    """``--trainer nnunet``: nnUNetTrainer's values (read from nnU-Net v2.8's source) in the recipe, each
    commented; the recipe loads, builds a deep-supervised U-Net and trains one epoch on CPU."""
    pytest.importorskip("nibabel")
    from fastvision.api import run_training
    from fastvision.config import load
    from fastvision.data.synth import load_all
    from fastvision.planning.configure.recipe import write_recipe
    from fastvision.planning.configure.trainer import steps_per_epoch

    data = load_all().get("prostate")(tmp_path / "prostate", seed=0, cases=4, size=24, slices=14)
    plan = planner.configure(data, memory="8GiB", trainer="nnunet")
    text = write_recipe(plan, tmp_path / "recipe.yaml").read_text()
    assert "--trainer nnunet" in text and "# Training: nnunet" in text and "optim: {" in text
    cfg = load(str(tmp_path / "recipe.yaml"))
    o, s, lo = cfg.optim, cfg.sched, cfg.loss.args
    assert (o.name, o.lr, o.momentum, o.nesterov, o.weight_decay, o.no_decay_norm_bias) == ("sgd", 0.01, 0.99, True,
                                                                                              3e-5, False)
    assert (s.name, s.power, s.warmup_epochs) == ("poly", 0.9, 0.0)
    assert (lo["lambda_dice"], lo["lambda_ce"], lo["squared_pred"], lo["include_background"]) == (1.0, 1.0, False,
                                                                                                 False)
    assert cfg.model.args["deep_supervision"] is True and cfg.data.args["pos_fraction"] == 0.33
    assert cfg.model.args["init"] == "he_heads"  # He on the logit heads only (issue 41's fourth pass)
    # 1000 x 250 iterations at this data's steps per pass (4 cases: 3 in fold 0's training set)
    assert cfg.train.epochs == math.ceil(250_000 / steps_per_epoch(4, cfg.train.batch_size))
    aug = cfg.data.augment
    assert aug["affine"]["rotate_prob"] == aug["affine"]["zoom_prob"] == 0.2 and aug["blur"]["prob"] == 0.2
    assert aug["lowres"]["prob"] == 0.25 and aug["gamma_inverted"]["prob"] == 0.1 and aug["gamma"]["retain_stats"]
    # nnUNetTrainer: clip_grad_norm_(.., 12); batchgeneratorsv2's noise uses its (0, 0.1) "variance" draw as the
    # std; SpatialTransform's scale multiplies the sampling coordinates; nnUNetDataLoader's last-items oversampling
    assert cfg.train.clip_grad == 12.0 and aug["noise"]["std"] == 0.1 and aug["affine"]["sampling_scale"] is True
    assert (cfg.data.args["oversample"], cfg.data.args["placement"]) == ("batch_tail", "nnunet")
    assert cfg.data.args["resample"] == "nnunet"  # DefaultPreprocessor's crop -> normalise -> spline resample
    assert cfg.task.args["sliding_window"]["style"] == "nnunet"  # nnUNetPredictor's steps, Gaussian, export
    run_training(str(tmp_path / "recipe.yaml"), out=str(tmp_path / "run"), overrides={"epochs": 1},
                 extra=[{"model": {"args": {"filters": [4, 8, 16, 32][:len(cfg.model.args["filters"])]}},
                         "data": {"cache": "ram", "cache_dir": None, "args": {"num_folds": 2}}}], progress=False)


@pytest.mark.parametrize("argv, key", [
    (["--trainer", "nnUnet"], "--trainer 'nnUnet'"),
    (["--trainer", "nnunet", "--base", "segresnet"], "--trainer nnunet needs deep supervision"),
])
def test_bad_trainer_is_one_line(argv, key, tmp_path, capsys):
    from fastvision.cli import main

    assert main(["configure", str(tmp_path / "no-such-data"), "--memory", "8GiB", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0]


def test_initial_patch_is_nnunets_get_patch_size_with_even_margins():
    """nnU-Net v2.8's get_patch_size(patch, 30 deg x 3, (0.85, 1.25)) gives (60, 67, 51) for (32, 48, 32) and
    (43, 51, 46) for (24, 32, 32); dummy 2-D (180 deg) gives (188, 188, 188) for (12, 160, 128), the coarse axis
    then set back to 12. Odd margins are rounded up to even (67 -> 68, 51 -> 52, 43 -> 44, 51 -> 52)."""
    from fastvision.planning.configure.trainer import initial_patch

    assert initial_patch([32, 48, 32], 30, False, 0) == [60, 68, 52]
    assert initial_patch([24, 32, 32], 30, False, 0) == [44, 52, 46]
    assert initial_patch([12, 160, 128], 180, True, 0) == [12, 188, 188]


def test_nnunet_trainer_options_of_issue_41_third_pass(tmp_path, monkeypatch):
    """With He initialisation, the enlarged initial patch and linear label resampling switched on, the
    recipe writes them (the loader's patch the initial one, the affine's the network's) and trains."""
    pytest.importorskip("nibabel")
    from fastvision.api import run_training
    from fastvision.config import load
    from fastvision.data.synth import load_all
    from fastvision.planning.configure import trainer
    from fastvision.planning.configure.recipe import write_recipe

    for flag in ("HE_INIT", "ENLARGED_PATCH", "LINEAR_LABELS"):
        monkeypatch.setattr(trainer, flag, True)
    data = load_all().get("hippocampus")(tmp_path / "hip", seed=0, cases=4, shape=(20, 28, 20))
    plan = planner.configure(data, memory="8GiB", trainer="nnunet")
    write_recipe(plan, tmp_path / "recipe.yaml")
    cfg = load(str(tmp_path / "recipe.yaml"))
    net, aff = cfg.task.args["sample_shape"][1:], cfg.data.augment["affine"]
    assert aff["size"] == net and aff["label_mode"] == "linear" and cfg.model.args["init"] == "he"
    assert aff["label_classes"] == 3  # background and the two hippocampus labels
    assert cfg.data.args["patch_size"] == trainer.initial_patch(net, aff["degrees"], "rotate_axes" in aff,
                                                               (aff.get("rotate_axes") or [0])[0])
    assert all(p > n for p, n in zip(cfg.data.args["patch_size"], net, strict=True))
    run_training(str(tmp_path / "recipe.yaml"), out=str(tmp_path / "run"), overrides={"epochs": 1},
                 extra=[{"model": {"args": {"filters": [4, 8, 16, 32, 64][:len(cfg.model.args["filters"])]}},
                         "data": {"cache": "ram", "cache_dir": None, "args": {"num_folds": 2}}}], progress=False)


def test_fewer_cases_than_five_folds_get_one_case_a_fold(tmp_path, capsys):
    """3 cases cannot be cut into nnU-Net's 5 folds (train stopped on the configured recipe with "3 cases
    cannot be split into 5 folds"): configure writes data.args.num_folds 3, commented, and every fold
    trains; a single case is one line naming the folder, exit 2, nothing written."""
    pytest.importorskip("nibabel")
    from fastvision.api import run_training
    from fastvision.cli import main
    from fastvision.config import load
    from fastvision.data.synth import load_all

    data = load_all().get("prostate")(tmp_path / "three", seed=0, cases=3, size=24, slices=14)
    assert main(["configure", str(data), "--memory", "8GiB", "--out", str(tmp_path / "r.yaml")]) == 0
    text = (tmp_path / "r.yaml").read_text()
    assert "num_folds: 3  # one case a fold: 3 cases cannot be cut into nnU-Net's 5 folds" in text
    cfg = load(str(tmp_path / "r.yaml"))
    assert cfg.data.args["num_folds"] == 3
    run_training(str(tmp_path / "r.yaml"), out=str(tmp_path / "run"), overrides={"epochs": 1},
                 extra=[{"model": {"args": {"filters": [4, 8, 16, 32][:len(cfg.model.args["filters"])]}},
                         "data": {"cache": "none", "cache_dir": None, "args": {"fold": 2}}}], progress=False)
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()

    one = load_all().get("prostate")(tmp_path / "one", seed=0, cases=1, size=24, slices=14)
    capsys.readouterr()
    assert main(["configure", str(one), "--memory", "8GiB", "--out", str(tmp_path / "one.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(one) in err[0] and "1 training case" in err[0], err
    assert not (tmp_path / "one.yaml").exists()
