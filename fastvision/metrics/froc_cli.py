"""``fastvision froc HEATMAP_DIR MASK_DIR``: the Camelyon16 FROC of :mod:`fastvision.metrics.froc` from
the command line (its range checks, printout and JSON)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastvision.errors import ConfigError, check_low
from fastvision.metrics.froc import EVAL_FP_RATES, camelyon16_distances, froc_files


def _check_args(args: argparse.Namespace) -> None:
    """Refuse a setting out of its range, naming the option, and a --json that would replace a file."""
    from fastvision.api import refuse_overwrite

    for flag, low, inclusive in (("stride", 1, 1), ("patch", 1, 1), ("mask_downsample", 1, 1), ("nms_radius", 0, 1),
                                 ("dilation_px", 0, 1), ("itc_max_px", 0, 1), ("um_per_px", 0, 0)):
        check_low(f"--{flag.replace('_', '-')}", getattr(args, flag), low, inclusive)
    if not 0 <= args.threshold <= 1:
        raise ConfigError(f"--threshold {args.threshold:g}: must be a probability in [0, 1]")
    if args.json:
        refuse_overwrite(args.json, args.force, "--json", file=True)


def cmd_froc(args: argparse.Namespace) -> int:
    _check_args(args)
    dilation, itc = args.dilation_px, args.itc_max_px
    if args.um_per_px is not None:
        d, i = camelyon16_distances(args.um_per_px)
        dilation = d if dilation is None else dilation
        itc = i if itc is None else itc
    out = froc_files(args.heatmaps, args.masks, stride=args.stride, patch=args.patch,
                     mask_downsample=args.mask_downsample,
                     threshold=args.threshold, nms_radius=args.nms_radius, dilation_px=dilation or 0.0,
                     itc_max_px=itc or 0.0)
    print(f"FROC {out['froc']:.4f}  ({int(out['slides'])} slides, {int(out['tumour_slides'])} with lesions, "
          f"{int(out['lesions'])} lesions counted)")
    print("sensitivity at FPs/slide  " + "  ".join(f"{r:g}: {out[f'sens@{r:g}']:.4f}" for r in EVAL_FP_RATES))
    if args.json:
        from fastvision.utils.files import atomic_write

        text = json.dumps(out, indent=2).encode()
        atomic_write(Path(args.json), lambda f: f.write(text))  # never a half-written result
    return 0


def add_cli(subparsers) -> None:
    """``fastvision froc HEATMAP_DIR MASK_DIR``: Camelyon16 FROC of predicted heat maps."""
    p = subparsers.add_parser(
        "froc", help="FROC of slide heat maps against lesion masks (Camelyon16)",
        description="Score tumour heat maps (as `fastvision predict` writes for slides) against lesion masks: "
                    "NAME_heatmap.tif in HEATMAP_DIR pairs with NAME.tif in MASK_DIR; a slide without a mask "
                    "(or with an all-zero one) is a normal slide. Prints the FROC score (mean sensitivity at "
                    "1/4..8 false positives per slide).")
    p.add_argument("heatmaps", help="folder of heat maps (float TIFF, or 8-bit PNG with 255 = 1)")
    p.add_argument("masks", help="folder of lesion masks (TIFF/PNG, non-zero = tumour) at the slide resolution")
    p.add_argument("--stride", type=int, help="mask pixels per heat-map pixel (default: the stride "
                   "`fastvision predict` recorded in the heat map, else mask height // heat height)")
    p.add_argument("--patch", type=int, help="side in mask pixels of the patch each heat-map pixel scored, "
                   "looked up at its centre (default: the patch `fastvision predict` recorded, else the stride)")
    p.add_argument("--mask-downsample", type=int, default=1, help="read every N-th mask pixel (large masks)")
    p.add_argument("--threshold", type=float, default=0.5, help="lowest probability kept as a detection")
    p.add_argument("--nms-radius", type=int, default=1, help="suppression half-side in heat-map pixels")
    p.add_argument("--dilation-px", type=float, help="grow lesions by this many mask pixels (default 0)")
    p.add_argument("--itc-max-px", type=float, help="lesions shorter than this (mask px) are ignored ITCs")
    p.add_argument("--um-per-px", type=float,
                   help="mask pixel size: sets Camelyon16's 75 um dilation and 275 um ITC limit")
    p.add_argument("--json", help="also write the result to this JSON file (a new file unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    p.set_defaults(func=cmd_froc)
