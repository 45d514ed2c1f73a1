"""The arguments of ``fastvision``'s built-in subcommands, one function per subcommand (its
positionals and flags); :func:`fastvision.cli.build_parser` adds the subparsers and their commands."""
from __future__ import annotations

import argparse

from fastvision.config import AMP_MODES


def train_args(p: argparse.ArgumentParser) -> None:
    """``fastvision train RECIPE``: the recipe, the options that override it, cross-validation."""
    p.add_argument("recipe", help="shipped recipe name (see `fastvision recipes`) or a YAML file")
    _common_flags(p)
    _fold_flags(p)


def _common_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common options (override the recipe)")
    g.add_argument("--data", help="dataset folder (data.args.path); default: the recipe's, e.g. "
                   "data/synth-imagenet for resnet18-imagefolder: a sample `fastvision data synth imagenet "
                   "data/synth-imagenet` makes")
    g.add_argument("--out", help="run directory (default runs/<recipe>-<time>); never overwritten")
    g.add_argument("--epochs", type=int)
    g.add_argument("--batch-size", type=lambda v: v if v == "auto" else int(v),
                   help="per-worker batch size, or auto: the largest that fits on the device (LR scaled by the recipe)")
    g.add_argument("--lr", type=float, help="learning rate at the recipe's reference batch")
    g.add_argument("--amp", choices=AMP_MODES,
                   help="mixed precision: auto = bf16 where the GPU has it natively, else fp16 with dynamic loss "
                        "scaling; fp32 on CPU (bf16 is faster on CPUs with AMX tiles or AVX-512 BF16; fp16 needs "
                        "CUDA); the precision used is logged")
    g.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None, help="TF32 matmul/conv (Ampere+)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    g.add_argument("--seed", type=int)
    g.add_argument("--resume", help="'auto' (continue the last checkpoint) or a checkpoint path")
    g.add_argument("--target", help="stop when METRIC=VALUE is reached, e.g. iou=0.9; logs time to target")
    g.add_argument("--tensorboard", action="store_true", default=None, help="also write TensorBoard events")
    g.add_argument("--pretrained", help="initial weights (model.args.pretrained): a torchvision-layout state dict, "
                                        "or 'imagenet' for torchvision's ImageNet ResNet weights via torch.hub's cache")
    g = p.add_argument_group("data parallelism")
    g.add_argument("--nproc", type=int, default=1,
                   help="start N local workers through torch.distributed.run (1 to this machine's GPUs, or its CPU "
                        "cores); a signal to this command reaches them (checkpoint, exit 128 + N)")
    g.add_argument("--emulate-workers", type=int, help="one process trains as N data-parallel workers would")
    g.add_argument("--backend", choices=["ddp", "horovod"], help="gradient all-reduce (default ddp)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, dotted, e.g. --set optim.weight_decay=1e-4 (repeatable)")


def _fold_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cross-validation")
    g.add_argument("--folds", help="all, K or 0,2,4: train those folds of data.args.num_folds one after another "
                   "into --out DIR/fold-<k> (finished folds skipped, interrupted ones resumed), then write "
                   "DIR/crossval.json and DIR/postprocessing.json")
    g.add_argument("--postprocess", choices=["auto", "none", "lcc"], default="auto",
                   help="with --folds: auto = keep the largest component where cross-validation says it helps "
                        "(nnU-Net's rule); none; lcc = for every class")


def evaluate_args(p: argparse.ArgumentParser) -> None:
    """``fastvision evaluate RUN``."""
    p.add_argument("run", help="run directory (uses best.pt, else last.pt) or checkpoint file")
    p.add_argument("--device", default="auto")
    p.add_argument("--data", help="evaluate on another dataset folder of the same format")
    p.add_argument("--json", help="also write the metrics to this JSON file (a new file unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")


def predict_args(p: argparse.ArgumentParser) -> None:
    """``fastvision predict CHECKPOINT INPUTS... --out DIR``."""
    p.add_argument("checkpoint", help="checkpoint file, run directory, or a train --folds folder (ensemble)")
    p.add_argument("inputs", nargs="+", help="input files or folders")
    p.add_argument("--out", required=True, help="output folder: new or empty, or (NIfTI) one holding this same "
                   "predict's partial output, which is resumed; anything else needs --force")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing files")
    p.add_argument("--device", default="auto")
    p.add_argument("--folds", help="with a folds folder: the folds to ensemble, e.g. 0,1 (default: all trained)")
    p.add_argument("--tta", action="store_true", help="also average mirrored inputs on the recipe's flip axes")
    p.add_argument("--tta-axes", help="mirror these spatial axes instead, e.g. 0,1,2 (implies --tta)")
    p.add_argument("--postprocess", choices=["auto", "none", "lcc"], default="auto",
                   help="auto = the folder's postprocessing.json (cross-validated), none, lcc = largest "
                        "component of every class")
    p.add_argument("--nproc", type=int, default=1, help="shard the cases over N local processes (torchrun)")
    p.add_argument("--coco-ids", metavar="FILE|auto|none", default="auto",
                   help="detection: image ids of detections.json from this COCO instances or image-info file "
                        "(test-dev's image_info_test-dev2017.json), matched by file name; auto = "
                        "ROOT/annotations/instances_<folder>.json of the COCO layout where it lists every "
                        "image, else the images' positions; none = positions")


def recipes_args(p: argparse.ArgumentParser) -> None:
    """``fastvision recipes [NAME]``."""
    p.add_argument("name", nargs="?", help="print this recipe's YAML")
    p.add_argument("--names", action="store_true", help="names only, one per line (for scripts)")


def synth_args(p: argparse.ArgumentParser) -> None:
    """``fastvision data synth KIND OUT``; the generator's own ``--option VALUE`` pairs are not
    declared here (they depend on KIND): the command reads them from the unparsed rest."""
    p.add_argument("-h", "--help", action="store_true", help="show this help (with KIND: its options) and exit")
    p.add_argument("kind", nargs="?", help="microscopy, imagenet, coco, brats, spleen, prostate, hippocampus, "
                                           "thinstack, pathology")
    p.add_argument("out", nargs="?", help="output folder (must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0)


def inspect_args(p: argparse.ArgumentParser) -> None:
    """``fastvision data inspect PATH``."""
    p.add_argument("path")
    p.add_argument("--fingerprint", action="store_true", help="every case (Decathlon): spacing, shape, shape after "
                   "crop, foreground intensity statistics per channel, class fractions; what `configure` plans from")
    p.add_argument("--json", help="with --fingerprint: also write it to this JSON file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="microscopy: check as training with these data.args would (channels, num_classes, "
                        "binarize, nonfinite; default the builder's: channels=1, num_classes=2, binarize=false, "
                        "nonfinite=error); "
                        "imagefolder: val_labels=FILE, the labels of a flat val/ (as data.args.val_labels)")


def shard_args(p: argparse.ArgumentParser) -> None:
    """``fastvision data shard SRC OUT``."""
    p.add_argument("src", help="an ImageFolder/ImageNet or COCO dataset folder")
    p.add_argument("out", help="the shard set folder (an unfinished one is completed; finished shards are kept)")
    p.add_argument("--shard-size", default=None,
                   help="target bytes per shard, e.g. 256MB, 1GB (default 256MB; rerun on a finished set: its own)")
    p.add_argument("--format", choices=("imagefolder", "coco"), help="the source layout (default: detected)")
    p.add_argument("--force", action="store_true", help="write into an existing folder that is not a shard set "
                                                        "(shards already there must still be this source's)")
    p.add_argument("--skip-unreadable", action="store_true", help="leave out (one warning) images that do "
                   "not decode, a truncated JPEG too (COCO: and listed images missing); without it they stop the "
                   "command before it writes")
