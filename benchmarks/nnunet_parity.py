"""fastvision's nnU-Net training parts against nnU-Net v2's own modules, on one configured plan.

Runs in nnU-Net's venv with fastvision on the path (nnU-Net's packages are not fastvision's dependencies)::

    PYTHONPATH=$PWD /work/nnunet-venv/bin/python benchmarks/nnunet_parity.py \\
        --pre /tmp/s53/w/spleen/pre/Dataset981_Spleen --recipe /tmp/s53/w/spleen/nnunet.yaml

``--pre`` is nnU-Net's preprocessed dataset folder (its ``nnUNetPlans.json``, and for ``--placement`` the
``nnUNetPlans_3d_fullres`` cases and ``splits_final.json``); ``--recipe`` what ``configure --trainer nnunet``
wrote for the same data (``train_vs_nnunet.py`` leaves both under its ``--work``). The checks:

- **loss**: nnU-Net's ``DeepSupervisionWrapper(DC_and_CE_loss)`` (its trainer's weights, targets by its
  ``DownsampleSegForDSTransform``) against fastvision's ``DeepSupervisionLoss(DiceCELoss)`` with the recipe's
  ``loss.args``, on random logits: nnU-Net's Dice term is ``-dc``, fastvision's (MONAI's) ``1 - dc``, so the
  values differ by exactly 1 and the gradients must be equal.
- **network**: nnU-Net's network from the plan (its He initialisation), its weights copied into the recipe's
  model (axes reversed: nnU-Net's arrays are the transposed SimpleITK order; fastvision concatenates
  (skip, up) where nnU-Net concatenates (up, skip)); the outputs at every deep-supervision scale compared.
- **placement** (``--placement``): the share of padding and foreground in the final patch, forced-foreground
  and random, by nnU-Net's ``get_bbox`` on its preprocessed cases and by fastvision's ``nnunet_patch`` on the
  recipe's dataset (each with nnU-Net's initial patch). Not a pass/fail check: it shows where the two differ.
- **preprocess** (``--preprocess --data D``): ``data.args.resample: nnunet``'s ``preprocess_case`` against nnU-Net's
  preprocessed arrays, every case (the CT window from nnU-Net's plan: the fingerprints sample other voxels).
- **score** (``--score CKPT --like FV_CKPT --data D``): an nnU-Net checkpoint's network, in the recipe's model,
  predicting nnU-Net's validation cases through fastvision's prediction path (on nnU-Net's preprocessing, with
  ``task.args.sliding_window.style`` ``--style``: ``nnunet``, what ``configure --trainer nnunet`` writes, with the
  RAS-mirrored axes flipped back around the whole prediction, as nnU-Net's network saw its arrays and its
  predictor places windows on them; ``monai`` flips them around the network only), its Dice beside nnU-Net's own
  validation and the share of voxels where the two label maps differ.
Exit 1 when the loss, the network or the preprocessing differs beyond float rounding.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch


def reverse_axes(t: torch.Tensor, lead: int = 2) -> torch.Tensor:
    """``t`` with the axes after the first ``lead`` in reverse order: nnU-Net's (Z, Y, X) arrays as fastvision's
    (X, Y, Z) and back (``lead`` 2 for (N, C, ...) maps and conv weights, 1 for (N, ...) labels)."""
    return t.permute(*range(lead), *range(t.dim() - 1, lead - 1, -1))


def _report(side: str, force: bool, pad: list[float], fg: list[float], note: str = "") -> None:
    kind = "forced foreground" if force else "random           "
    print(f"  {side:<10} {kind}: padding {np.mean(pad):.3f}, foreground {np.mean(fg):.4f}{note}")


def loss_check(plans: dict, cfg, config: str) -> bool:
    from batchgeneratorsv2.transforms.utils.deep_supervision_downsampling import DownsampleSegForDSTransform
    from nnunetv2.training.loss.compound_losses import DC_and_CE_loss
    from nnunetv2.training.loss.deep_supervision import DeepSupervisionWrapper
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss

    from fastvision.losses.compound import DeepSupervisionLoss
    from fastvision.registry import LOSSES

    cm = plans["configurations"][config]
    pools = np.array(cm["architecture"]["arch_kwargs"]["strides"])
    scales = [tuple(s) for s in (1 / np.cumprod(pools, axis=0))[:-1]]  # nnUNetTrainer._get_deep_supervision_scales
    weights = np.array([1 / 2 ** i for i in range(len(scales))])
    weights[-1] = 0
    weights = weights / weights.sum()
    nn_loss = DeepSupervisionWrapper(DC_and_CE_loss({"batch_dice": cm["batch_dice"], "smooth": 1e-5, "do_bg": False,
                                                     "ddp": False}, {}, weight_ce=1, weight_dice=1, ignore_label=None,
                                                    dice_class=MemoryEfficientSoftDiceLoss), weights)
    fv_loss = DeepSupervisionLoss(LOSSES.build(cfg.loss.name, cfg.loss.args, where="loss.args"))
    gen = torch.Generator().manual_seed(0)
    patch, batch = cm["patch_size"], 2
    shapes = [tuple(int(round(p * s)) for p, s in zip(patch, sc, strict=True)) for sc in scales]
    logits = [(torch.randn(batch, 2, *sh, generator=gen) * 3).requires_grad_() for sh in shapes]
    label = torch.zeros(batch, *patch, dtype=torch.long)  # one sample with a blob, one with a sliver
    label[1, 2:patch[0] // 2, 4:patch[1] // 2, 4:patch[2] // 2] = 1
    label[0, :3, :4, :4] = 1
    ds = DownsampleSegForDSTransform(ds_scales=scales)
    per = [ds.apply({"segmentation": label[b][None].float()})["segmentation"] for b in range(batch)]
    targets = [torch.stack([p[i] for p in per]) for i in range(len(scales))]

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        loss.backward()
        out = [torch.zeros_like(x) if x.grad is None else x.grad.clone() for x in logits]
        for x in logits:
            x.grad = None
        return out

    a = nn_loss(logits, targets)
    ga = grads(a)
    # fastvision's logits are (X, Y, Z): the same tensors with the spatial axes reversed
    b = fv_loss([reverse_axes(x) for x in logits], reverse_axes(label, 1)[:, None])
    gb = grads(b)
    diff = float(b.detach() - a.detach())
    gmax = max(float((x - y).abs().max()) for x, y in zip(ga, gb, strict=True))
    ok = abs(diff - 1.0) < 1e-5 and gmax < 1e-7
    print(f"loss: nnU-Net {float(a.detach()):.6f}, fastvision {float(b.detach()):.6f} (difference {diff:.7f}, "
          f"expected 1: -dc against 1 - dc); gradients: largest difference {gmax:.2e} over {len(scales)} scales, "
          f"weights {[round(float(w), 4) for w in weights]} -> {'equal' if ok else 'DIFFERENT'}")
    return ok


def to_fastvision(src: dict, ours: torch.nn.Module) -> dict:
    """nnU-Net's ``PlainConvUNet`` state dict ``src`` as a state dict of fastvision's U-Net ``ours`` (the same plan):
    the axes reversed, decoder stages deepest first, the first decoder conv's input halves swapped ((up, skip) ->
    (skip, up)), nnU-Net's body conv biases dropped (an instance norm follows each)."""
    n = len(ours.encoders)
    sd = {}
    for s in range(n):
        for c in range(len(ours.encoders[s])):
            p = f"encoder.stages.{s}.0.convs.{c}"
            sd[f"encoders.{s}.{c}.conv.weight"] = reverse_axes(src[p + ".conv.weight"])
            sd[f"encoders.{s}.{c}.norm.weight"] = src[p + ".norm.weight"]
            sd[f"encoders.{s}.{c}.norm.bias"] = src[p + ".norm.bias"]
    for d in range(n - 1):  # nnU-Net's decoder stage d is fastvision's n - 2 - d (deepest first there)
        f = n - 2 - d
        for c in range(len(ours.decoders[f])):
            p = f"decoder.stages.{d}.convs.{c}"
            w = reverse_axes(src[p + ".conv.weight"])
            if c == 0:  # (up, skip) -> (skip, up)
                h = w.shape[1] // 2
                w = torch.cat([w[:, h:], w[:, :h]], 1)
            sd[f"decoders.{f}.{c}.conv.weight"] = w
            sd[f"decoders.{f}.{c}.norm.weight"] = src[p + ".norm.weight"]
            sd[f"decoders.{f}.{c}.norm.bias"] = src[p + ".norm.bias"]
        sd[f"ups.{f}.conv.weight"] = reverse_axes(src[f"decoder.transpconvs.{d}.weight"])
        sd[f"ups.{f}.conv.bias"] = src[f"decoder.transpconvs.{d}.bias"]
        head = "head" if f == 0 else f"ds_heads.{f - 1}"
        sd[head + ".weight"] = reverse_axes(src[f"decoder.seg_layers.{d}.weight"])
        sd[head + ".bias"] = src[f"decoder.seg_layers.{d}.bias"]
    return sd


def network_check(plans: dict, cfg, config: str) -> bool:
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    from fastvision.models import create_model

    arch = plans["configurations"][config]["architecture"]
    torch.manual_seed(0)
    ref = get_network_from_plans(arch["network_class_name"], arch["arch_kwargs"], arch["_kw_requires_import"],
                                 cfg.model.args["in_channels"], cfg.model.args["out_channels"], allow_init=True,
                                 deep_supervision=True)
    ours = create_model(cfg.model.name, **cfg.model.args)
    src = ref.state_dict()
    sd = to_fastvision(src, ours)
    ours.load_state_dict(sd, strict=True)
    body_bias = max(float(v.abs().max()) for k, v in src.items() if k.endswith("conv.bias"))
    x = torch.randn(2, cfg.model.args["in_channels"], *plans["configurations"][config]["patch_size"],
                    generator=torch.Generator().manual_seed(1))
    ref.train(), ours.train()
    with torch.no_grad():
        a = ref(x)
        b = ours(reverse_axes(x))
    # nnU-Net's outputs: full resolution first; fastvision's the same order
    diffs = [float((u - reverse_axes(v)).abs().max()) for u, v in zip(a, b, strict=True)]
    scale = max(float(u.abs().max()) for u in a)
    ok = max(diffs) < 1e-4 * max(scale, 1.0)
    print(f"network: {sum(p.numel() for p in ref.parameters())} parameters in nnU-Net's (its body conv biases "
          f"{body_bias:.1e}: an instance norm follows each), {sum(p.numel() for p in ours.parameters())} in "
          f"fastvision's; outputs at {len(a)} scales, largest difference {max(diffs):.2e} (outputs up to "
          f"{scale:.2f}) -> {'equal' if ok else 'DIFFERENT'}")
    return ok


def placement(pre: Path, cfg, config: str, draws: int) -> None:
    import os

    os.environ.setdefault("nnUNet_preprocessed", str(pre.parent))
    os.environ.setdefault("nnUNet_raw", str(pre.parent))
    os.environ.setdefault("nnUNet_results", str(pre.parent))
    from acvl_utils.cropping_and_padding.bounding_boxes import crop_and_pad_nd
    from nnunetv2.training.dataloading.data_loader import nnUNetDataLoader
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    import fastvision.data.formats.decathlon  # noqa: F401  (registers the dataset)
    from fastvision.data.formats.patches import nnunet_patch
    from fastvision.registry import DATASETS

    plans = json.loads((pre / "nnUNetPlans.json").read_text())
    plans["continue_training"] = False
    dataset = json.loads((pre / "dataset.json").read_text())
    trainer = nnUNetTrainer(plans, config, 0, dataset, device=torch.device("cpu"))
    trainer.initialize()
    tr, _ = trainer.get_tr_and_val_datasets()
    final = trainer.configuration_manager.patch_size
    _, _, initial, _ = trainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size()
    loader = nnUNetDataLoader(tr, 2, initial, final, trainer.label_manager, 0.33)
    cut = [slice((i - f) // 2, (i - f) // 2 + f) for i, f in zip(initial, final, strict=True)]
    np.random.seed(0)
    print(f"placement: nnU-Net's initial patch {[int(v) for v in initial]}, final {[int(v) for v in final]} "
          f"(its axes); {draws} draws per case")
    for force in (True, False):
        pad, fg = [], []
        for key in loader.indices:
            data, seg, _, props = tr.load_case(key)
            for _ in range(draws):
                lo, hi = loader.get_bbox(data.shape[1:], force, props["class_locations"])
                box = [[a, b] for a, b in zip(lo, hi, strict=True)]
                inside = crop_and_pad_nd(np.ones_like(data[:1]), box, 0)[(0, *cut)]
                s = crop_and_pad_nd(np.asarray(seg[:1]), box, -1)[(0, *cut)]
                pad.append(1 - inside.mean())
                fg.append((s > 0).mean())
        _report("nnU-Net", force, pad, fg)
    splits = DATASETS.build(cfg.data.name, cfg.data.args, where="data.args")
    size, fin = list(reversed(list(initial))), list(reversed(list(final)))
    gen = torch.Generator().manual_seed(0)
    cut = [slice((i - f) // 2, (i - f) // 2 + f) for i, f in zip(size, fin, strict=True)]
    for force in (True, False):
        pad, fg = [], []
        for i in range(len(splits.train)):
            item = splits.train[i]
            for _ in range(draws):
                x, y = nnunet_patch(torch.ones_like(item["image"]), item["label"], size, force, gen, fin)
                pad.append(1 - float(x[(0, *cut)].float().mean()))
                fg.append(float((y[tuple(cut)] > 0).float().mean()))
        _report("fastvision", force, pad, fg, " (its volumes reoriented to RAS; nnU-Net's in the files' voxel order)")


def preprocess_check(pre: Path, plans: dict, cfg, config: str, data: Path) -> bool:
    """fastvision's ``preprocess_case`` with ``data.args.resample: nnunet`` against nnU-Net's preprocessed arrays,
    every case: the image (CT window from nnU-Net's own intensity properties, so that the fingerprint's sampled
    statistics are not what is compared) and the label (nnU-Net's -1, outside the non-zero mask, read as the 0
    its training makes of it). fastvision's arrays are RAS; nnU-Net's the files' order transposed."""
    import blosc2
    import nibabel as nib

    from fastvision.data.preprocess3d import PreprocessParams, mirrored_axes, preprocess_case

    cm = plans["configurations"][config]
    args = dict(cfg.data.args)
    window = nnunet_window(plans, args.get("intensity")) or tuple(map(float, args.get("window", (0.0, 1.0, 0.0, 1.0))))
    params = PreprocessParams(target_spacing=tuple(map(float, args["target_spacing"])), intensity=args["intensity"],
                              window=window, crop_foreground=args.get("crop_foreground", True), resample="nnunet")
    folder = pre / cm["data_identifier"]
    # nnU-Net's axes: the files' (i, j, k) reversed, then permuted by transpose_forward; ours: (i, j, k) in RAS
    back = [int(x) for x in np.argsort(plans["transpose_forward"])]
    worst_image, labels_off, voxels, n = 0.0, 0, 0, 0
    for f in sorted(folder.glob("*_seg.b2nd")):
        case = f.name[: -len("_seg.b2nd")]
        ref = blosc2.open(str(folder / f"{case}.b2nd"), mode="r")[:]
        ref_seg = blosc2.open(str(f), mode="r")[:][0]
        image, label = data / "imagesTr" / f"{case}.nii.gz", data / "labelsTr" / f"{case}.nii.gz"
        ours = preprocess_case({"image": [image], "label": label}, params)
        a = reverse_axes(torch.from_numpy(ref.transpose(0, *[1 + x for x in back])), 1).numpy()
        s = reverse_axes(torch.from_numpy(ref_seg.transpose(*back)), 0).numpy()
        flips = mirrored_axes(nib.load(str(image)).affine)
        a, s = np.flip(a, [1 + x for x in flips]), np.flip(s, flips)
        b, t = ours["image"].numpy(), ours["label"].numpy()
        if a.shape != b.shape:
            print(f"  {case}: shape nnU-Net {a.shape[1:]} (as RAS), fastvision {b.shape[1:]}")
            return False
        worst_image = max(worst_image, float(np.abs(a - b).max()))
        labels_off += int((np.where(s < 0, 0, s) != t).sum())
        voxels += t.size
        n += 1
    ok = worst_image < 1e-4 and labels_off == 0
    print(f"preprocess: {n} cases, image largest difference {worst_image:.2e}, labels differing {labels_off} of "
          f"{voxels} voxels -> {'equal' if ok else 'DIFFERENT'}")
    return ok


def nnunet_window(plans: dict, intensity: str | None) -> tuple[float, float, float, float] | None:
    """nnU-Net's CT normalisation as fastvision's window, from the plan's own intensity properties (None: not CT)."""
    if intensity != "ct":
        return None
    p = plans["foreground_intensity_properties_per_channel"]["0"]
    lo, hi, mean, std = p["percentile_00_5"], p["percentile_99_5"], p["mean"], p["std"]
    return (lo, hi, (lo - mean) / std, (hi - mean) / std)


def score_check(nn_ckpt: Path, like: Path, data: Path, validation: Path, work: Path,
                window: tuple[float, float, float, float] | None, style: str = "nnunet") -> None:
    """nnU-Net's trained network scored by fastvision's prediction path: its weights (``nn_ckpt``, an nnU-Net
    ``checkpoint_*.pth``) in the model of a fastvision checkpoint of the same plan (``like``), fp32 as nnU-Net
    predicts on a CPU, on nnU-Net's preprocessing (``resample: nnunet``, the plan's CT window), predicting
    nnU-Net's validation cases (the ``.nii.gz`` in ``validation``, nnU-Net's own predictions, and its
    ``summary.json``) through ``fastvision predict``'s path; per case Dice against the label files beside
    nnU-Net's, and the voxels where the two predictions differ."""
    import nibabel as nib

    from fastvision import api, config
    from fastvision.data.preprocess3d import mirrored_axes
    from fastvision.engine import checkpoint
    from fastvision.inference.postprocess import case_dice, defined_means
    from fastvision.models import create_model

    # nnU-Net's checkpoint holds numpy scalars (its logged losses): allowed by name, no pickled code run
    allowed = [np._core.multiarray.scalar, np.dtype, *{type(np.dtype(t)) for t in ("float64", "float32", "int64")}]
    with torch.serialization.safe_globals(allowed):
        src = torch.load(nn_ckpt, map_location="cpu", weights_only=True)["network_weights"]
    ckpt = checkpoint.load(like)
    cfg = config.from_dict(ckpt["config"])
    ckpt["model"] = to_fastvision({k.removeprefix("_orig_mod."): v for k, v in src.items()},
                                  create_model(cfg.model.name, **cfg.model.args))
    ckpt.pop("eval_model", None)
    ckpt["config"]["train"]["amp"] = "off"  # nnU-Net predicts in fp32 on a CPU
    data_args = ckpt["config"]["data"]["args"]
    data_args["resample"] = "nnunet"  # the arrays the network trained on (preprocess_check)
    ckpt["config"]["task"]["args"]["sliding_window"]["style"] = style
    if window is not None:
        data_args["window"] = list(window)
    work.mkdir(parents=True, exist_ok=True)
    swapped = work / "nnunet-in-fastvision.pt"
    torch.save(ckpt, swapped)
    cases = sorted(p.name[:-len(".nii.gz")] for p in validation.glob("*.nii.gz"))
    files = [data / "imagesTr" / f"{c}.nii.gz" for c in cases]
    # fastvision's arrays are RAS, nnU-Net's in the files' voxel order, and an 8-iteration network is far from
    # mirror-invariant: it sees the arrays it trained on, the RAS-mirrored axes flipped back. Style nnunet: around
    # the whole prediction, so the windows are padded and placed in the files' order as nnU-Net's predictor places
    # them; monai: around the network, the windows placed in RAS order as fastvision places them for its own nets
    flips = {mirrored_axes(nib.load(str(f)).affine) for f in files}
    if len(flips) != 1:
        raise SystemExit(f"--score: the validation images differ in orientation ({sorted(flips)}): not supported")
    dims = [2 + a for a in flips.pop()]
    run, _ = api.load_run(swapped, "cpu", with_data=False)
    (work / "pred").mkdir(exist_ok=True)
    if style == "nnunet":
        from fastvision.inference.nifti import predict_cases, prediction_cases
        from fastvision.inference.volumes import Ensemble

        class InFileOrderPrediction(Ensemble):
            def probabilities(self, image: torch.Tensor) -> torch.Tensor:
                d = [a - 1 for a in dims]  # (C, *S)
                return super().probabilities(torch.flip(image, d)).flip(d) if d else super().probabilities(image)

        with torch.no_grad():
            predict_cases(InFileOrderPrediction(run.task, run.model, [], run.device), run.cfg,
                          prediction_cases(files), work / "pred", force=True)
    else:
        class InFileOrder(torch.nn.Module):
            def __init__(self, net: torch.nn.Module):
                super().__init__()
                self.net = net

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.flip(self.net(torch.flip(x, dims)), dims) if dims else self.net(x)

        run.task.predict_files(InFileOrder(run.model).eval(), files, work / "pred", run.cfg, run.device)
    classes = [[int(k)] for k in json.loads((data / "dataset.json").read_text())["labels"] if int(k) > 0]
    ours, theirs, differ = [], [], []
    for c in cases:
        label = np.asarray(nib.load(str(data / "labelsTr" / f"{c}.nii.gz")).dataobj)
        a = np.asarray(nib.load(str(validation / f"{c}.nii.gz")).dataobj)
        b = np.asarray(nib.load(str(work / "pred" / f"{c}.nii.gz")).dataobj)
        theirs.append(case_dice(a, label, classes))
        ours.append(case_dice(b, label, classes))
        differ.append(float((a != b).mean()))
        print(f"  {c}: Dice nnU-Net's prediction {float(np.nanmean(theirs[-1])):.3f}, fastvision's path "
              f"{float(np.nanmean(ours[-1])):.3f}; voxels differing {differ[-1]:.4f}")
    summary = json.loads((validation / "summary.json").read_text())["foreground_mean"]["Dice"]
    print(f"score: nnU-Net's network ({nn_ckpt.name}) on {len(cases)} cases: nnU-Net's validation {summary:.4f} "
          f"(recomputed {float(np.mean(defined_means(np.stack(theirs)))):.4f}), fastvision's prediction path "
          f"{float(np.mean(defined_means(np.stack(ours)))):.4f} (style {style}; voxels differing "
          f"{np.mean(differ):.5f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pre", type=Path, required=True, help="nnU-Net's preprocessed dataset folder")
    ap.add_argument("--recipe", type=Path, required=True, help="the recipe configure --trainer nnunet wrote")
    ap.add_argument("--config", default="3d_fullres")
    ap.add_argument("--placement", action="store_true",
                    help="also compare the patch placement (slow: loads every case)")
    ap.add_argument("--draws", type=int, default=50, help="placement draws per case and kind")
    ap.add_argument("--preprocess", action="store_true",
                    help="also compare data.args.resample: nnunet's preprocessing with nnU-Net's arrays (needs --data)")
    ap.add_argument("--score", type=Path, metavar="NNUNET_CKPT",
                    help="also score this nnU-Net checkpoint through fastvision's prediction path (needs --like, "
                         "--data; its validation folder beside it)")
    ap.add_argument("--like", type=Path, help="a fastvision checkpoint of the same plan (its config and model)")
    ap.add_argument("--data", type=Path, help="the Decathlon folder both sides trained on (imagesTr, labelsTr)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/nnunet_parity"), help="where --score writes")
    ap.add_argument("--style", choices=("nnunet", "monai"), default="nnunet",
                    help="--score's task.args.sliding_window.style (default nnunet, what configure writes)")
    args = ap.parse_args()
    plans_file = args.pre / "nnUNetPlans.json"
    if args.preprocess and not args.data:
        ap.error("--preprocess needs --data (the Decathlon folder nnU-Net converted)")
    if args.score and not (args.like and args.data):
        ap.error("--score needs --like (a fastvision checkpoint) and --data (the Decathlon folder)")
    for f in (plans_file, args.recipe, *(p for p in (args.score, args.like) if p)):
        if not f.is_file():
            ap.error(f"{f}: no such file")
    try:
        import nnunetv2  # noqa: F401
    except ImportError:
        ap.error("nnunetv2 is not importable: run this with nnU-Net's venv's python and fastvision on PYTHONPATH")
    from fastvision import config
    from fastvision.errors import ConfigError

    try:
        cfg = config.load(str(args.recipe))
    except ConfigError as e:
        ap.error(str(e))
    plans = json.loads(plans_file.read_text())
    if args.config not in plans["configurations"]:
        ap.error(f"{plans_file}: no configuration {args.config!r}; has {', '.join(plans['configurations'])}")
    ok = loss_check(plans, cfg, args.config) & network_check(plans, cfg, args.config)
    if args.placement:
        placement(args.pre, cfg, args.config, args.draws)
    if args.preprocess:
        ok &= preprocess_check(args.pre, plans, cfg, args.config, args.data)
    if args.score:
        score_check(args.score, args.like, args.data, args.score.parent / "validation", args.work,
                    nnunet_window(plans, cfg.data.args.get("intensity")), args.style)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
