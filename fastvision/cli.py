"""``fastvision`` command line: parses arguments, then calls library functions.

User errors (bad paths, unknown keys, corrupt files) print one line naming the file or key and
exit with code 2; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from fastvision.config import AMP_MODES
from fastvision.errors import ConfigError, DataError, DataWarning, FastvisionError, Preempted

# Every subcommand is one hop from here. ``train``, ``evaluate``, ``predict``, ``recipes`` and ``data``
# are defined in build_parser below; each feature subcommand by the function named here, which adds
# exactly that subparser (arguments, help, and ``func``) -- open the module to read it.
FEATURES = (
    ("benchmark", "fastvision.benchmark.modes:add_cli"),
    ("profile", "fastvision.profiling:add_profile_cli"),
    ("monitor", "fastvision.profiling:add_monitor_cli"),
    ("scale", "fastvision.scaling.sweep:add_cli"),
    ("cv", "fastvision.metrics.crossval:add_cli"),
    ("export", "fastvision.inference.export:add_cli"),
    ("froc", "fastvision.metrics.froc:add_cli"),
    ("plan", "fastvision.planning.plan:add_cli"),
    ("configure", "fastvision.planning.configure:add_cli"),
    ("tune", "fastvision.planning.tune:add_cli"),
)


def _common_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common options (override the recipe)")
    g.add_argument("--data", help="dataset folder (data.args.path); default: the recipe's built-in sample")
    g.add_argument("--out", help="run directory (default runs/<recipe>-<time>); never overwritten")
    g.add_argument("--epochs", type=int)
    g.add_argument("--batch-size", type=lambda v: v if v == "auto" else int(v),
                   help="per-worker batch size, or auto: the largest that fits on the device (LR scaled by the recipe)")
    g.add_argument("--lr", type=float, help="learning rate at the recipe's reference batch")
    g.add_argument("--amp", choices=AMP_MODES,
                   help="mixed precision: auto = bf16 where the GPU has it natively, else fp16 with dynamic loss "
                        "scaling; fp32 on CPU (fp16 needs CUDA); the precision used is logged")
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
    g.add_argument("--nproc", type=int, default=1, help="start N local workers through torch.distributed.run")
    g.add_argument("--emulate-workers", type=int, help="one process trains as N data-parallel workers would")
    g.add_argument("--backend", choices=["ddp", "horovod"], help="gradient all-reduce (default ddp)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, dotted, e.g. --set optim.weight_decay=1e-4 (repeatable)")


def cmd_train(args: argparse.Namespace) -> int:
    from fastvision import distributed
    from fastvision.api import run_training
    from fastvision.config import parse_override

    if args.nproc > 1 and distributed.detect_env().launcher == "single":
        # Re-run this very command under torch's launcher, one process per worker.
        return distributed.launch_local(args.nproc, ["-m", "fastvision.cli", *distributed.strip_option(args.argv, "--nproc")],
                                 backend=args.backend or "ddp")
    if args.pretrained:
        args.set.append(f"model.args.pretrained={args.pretrained}")
    flat = {k: getattr(args, k) for k in ("data", "epochs", "batch_size", "lr", "amp", "tf32", "compile",
                                          "channels_last", "device", "seed", "target", "tensorboard",
                                          "emulate_workers", "backend")
            if getattr(args, k) is not None}  # only the flags the user gave
    extra = [parse_override(s) for s in args.set]
    if args.folds is not None:
        from fastvision.inference.folds import train_folds
        from fastvision.metrics.crossval import print_fold_table

        if args.resume not in (None, "auto"):
            raise ConfigError("--folds resumes each fold by itself (from DIR/fold-<k>); drop --resume PATH")
        res = train_folds(args.recipe, args.out, args.folds, flat, extra, args.postprocess)
        if res is not None:  # rank 0
            print_fold_table(res, f"{args.out}: out-of-fold predictions, folds {res['folds']}")
            print(f"cross-validation: {Path(args.out) / 'crossval.json'}, postprocessing: "
                  f"{Path(args.out) / 'postprocessing.json'}")
        return 0
    summary = run_training(args.recipe, out=args.out, resume=args.resume, overrides=flat, extra=extra)
    _print_result(summary)
    return 0


def _print_result(summary: dict[str, Any]) -> None:
    keys = [k for k in ("iou", "dice", "top1", "map", "ap50") if isinstance(summary.get(k), float)]
    if keys:
        print("final " + "  ".join(f"{k} {summary[k]:.4f}" for k in keys))
    print(f"run directory: {summary['run_dir']}")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from fastvision.api import evaluate_path

    result = evaluate_path(args.run, device=args.device, data=args.data)
    for k, v in result.items():
        print(f"{k}: {_format_value(k, v)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


# Metrics that count things (COCO's "images", the evaluated "items"): whole numbers, shown as such.
_COUNT_KEYS = ("items", "images", "cases", "patches", "boxes")


def _format_value(key: str, value: Any) -> str:
    """Counts as integers (60, not 60.0000); other floats with four decimals."""
    if isinstance(value, float):
        if key in _COUNT_KEYS and value.is_integer():
            return str(int(value))
        return f"{value:.4f}"
    return str(value)


def cmd_predict(args: argparse.Namespace) -> int:
    from fastvision import distributed
    from fastvision.api import expand_inputs, is_volume_input, predict, refuse_overwrite
    from fastvision.inference.folds import is_folds_dir, predict_volumes

    volume_flags = bool(args.folds or args.tta or args.tta_axes or args.nproc > 1 or args.postprocess != "auto")
    try:
        volumes = is_folds_dir(args.checkpoint) or is_volume_input(expand_inputs(args.inputs))
    except DataError:  # a missing input: named below (after the --out check of a plain predict)
        volumes = volume_flags
    if not volumes:  # 2-D images (or a missing input)
        if volume_flags:
            raise ConfigError("--folds, --tta, --tta-axes, --nproc and --postprocess apply to NIfTI volumes")
        refuse_overwrite(args.out, args.force)
        written = predict(args.checkpoint, args.inputs, args.out, device=args.device)
        print(f"wrote {len(written)} files to {args.out}")
        return 0
    if args.nproc > 1 and distributed.detect_env().launcher == "single":
        # one process per shard of the cases, under torch's launcher (as train --nproc)
        return distributed.launch_local(args.nproc, ["-m", "fastvision.cli", *distributed.strip_option(args.argv, "--nproc")])
    tta = args.tta_axes if args.tta_axes else args.tta
    res = predict_volumes(args.checkpoint, args.inputs, args.out, folds=args.folds, tta=tta,
                          postprocess_mode=args.postprocess, device=args.device, force=args.force)
    where = f"rank {res['rank']} of {res['world']}: " if res["world"] > 1 else ""
    print(f"{where}wrote {len(res['written'])} files to {args.out} ({res['mine']} of {res['cases']} cases; "
          f"{res['skipped']} written already)")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from fastvision.config import list_recipes, recipe_path, recipe_summary

    if args.name:
        print(recipe_path(args.name).read_text(), end="")
        return 0
    rows = [recipe_summary(name) for name in list_recipes()]
    if args.names:
        print("\n".join(r["name"] for r in rows))
        return 0
    cols = ("name", "task", "model", "seed", "purpose")
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print("  ".join(c.upper().ljust(width[c]) for c in cols).rstrip())
    for r in rows:  # the data line under each row: the format and where to get it is too long for a column
        print("  ".join(r[c].ljust(width[c]) for c in cols).rstrip())
        print(" " * (width["name"] + 2) + "data " + r["data"])
    print("\n`fastvision recipes NAME` prints one; `fastvision train NAME --data DIR` trains it.")
    return 0


def cmd_synth(args: argparse.Namespace, extra: list[str]) -> int:
    from fastvision.data.synth import load_all
    from fastvision.registry import check_kwargs

    if args.help or args.kind is None or args.out is None:
        if not args.help:
            raise ConfigError("data synth: give KIND and OUT, e.g. fastvision data synth microscopy data/micro")
        print(args.parser.format_help() if args.kind is None else synth_help(args.kind), end="")
        return 0
    synth = load_all().get(args.kind)
    options = _parse_options(extra)
    check_kwargs(synth, options, f"data synth {args.kind}", exclude={"out"})
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out}: exists and is not an empty folder; choose a new output folder")
    out = synth(out, seed=args.seed, **options)
    print(f"wrote {args.kind} sample to {out}")
    return 0


def synth_help(kind: str) -> str:
    """``data synth KIND --help``: the generator's keyword options (its signature) and docstring."""
    import inspect

    from fastvision.data.synth import load_all

    synth = load_all().get(kind)
    lines = [f"usage: fastvision data synth {kind} OUT [--seed N] [--OPTION VALUE ...]", ""]
    lines.append(f"options of {kind} (defaults from the generator):")
    for name, param in inspect.signature(synth).parameters.items():
        if name in ("out", "seed") or param.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        lines.append(f"  --{name.replace('_', '-'):<22} default {param.default!r}")
    doc = inspect.getdoc(synth)
    if doc:
        lines += ["", doc]
    return "\n".join(lines) + "\n"


def _parse_options(extra: list[str]) -> dict[str, Any]:
    """``--per-class 100 --size 64`` -> ``{"per_class": 100, "size": 64}`` (values parsed as YAML)."""
    import yaml

    out, i = {}, 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or i + 1 >= len(extra):
            raise ConfigError(f"data synth: expected --option VALUE pairs, got {tok!r}")
        out[tok[2:].replace("-", "_")] = yaml.safe_load(extra[i + 1])
        i += 2
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    from fastvision.data.inspect import inspect_path, print_report

    if args.fingerprint:
        from fastvision.data.fingerprint import cmd_fingerprint
        return cmd_fingerprint(Path(args.path), args.json)
    from fastvision.config import parse_override

    settings = {}  # KEY=VALUE of data.args, parsed as train's --set parses them
    for item in args.set:
        settings.update(parse_override("data.args." + item.strip().removeprefix("data.args."))["data"]["args"])
    report = inspect_path(Path(args.path), settings)
    print_report(report)
    unusable = report.get("unusable") or {}
    if unusable:  # every anomaly is listed above; the exit code says the folder does not train as is
        raise DataError(f"{args.path}: {sum(unusable.values())} file(s) would stop training "
                        f"({'; '.join(unusable)}): listed above")
    return 0


def _fold_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cross-validation")
    g.add_argument("--folds", help="all, K or 0,2,4: train those folds of data.args.num_folds one after another "
                   "into --out DIR/fold-<k> (finished folds skipped, interrupted ones resumed), then write "
                   "DIR/crossval.json and DIR/postprocessing.json")
    g.add_argument("--postprocess", choices=["auto", "none", "lcc"], default="auto",
                   help="with --folds: auto = keep the largest component where cross-validation says it helps "
                        "(nnU-Net's rule); none; lcc = for every class")


def _predict_flags(p: argparse.ArgumentParser) -> None:
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


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage is one ``--help`` away), exit status 2 as before."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from fastvision import __version__

    parser = _Parser(prog="fastvision", description="Train image models fast: CPU, one GPU, many nodes.")
    parser.add_argument("--version", action="version", version=f"fastvision {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a recipe", description="Train a recipe (name or YAML path).")
    p.add_argument("recipe", help="shipped recipe name (see `fastvision recipes`) or a YAML file")
    _common_flags(p)
    _fold_flags(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="validation metrics of a run or checkpoint")
    p.add_argument("run", help="run directory (uses best.pt, else last.pt) or checkpoint file")
    p.add_argument("--device", default="auto")
    p.add_argument("--data", help="evaluate on another dataset folder of the same format")
    p.add_argument("--json", help="also write the metrics to this JSON file")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("predict", help="predict files with a checkpoint, a run or the ensemble of its folds")
    _predict_flags(p)
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("recipes", help="table of shipped recipes (task, model, data and where to get it, seed, "
                                        "purpose), or print one")
    p.add_argument("name", nargs="?", help="print this recipe's YAML")
    p.add_argument("--names", action="store_true", help="names only, one per line (for scripts)")
    p.set_defaults(func=cmd_recipes)

    data = sub.add_parser("data", help="synthetic data and dataset inspection")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = dsub.add_parser("synth", help="write a synthetic dataset in a real format", add_help=False,
                        description="Write a synthetic dataset. Extra --option VALUE pairs go to the generator; "
                                    "`fastvision data synth KIND --help` lists KIND's options.")
    p.add_argument("-h", "--help", action="store_true", help="show this help (with KIND: its options) and exit")
    p.add_argument("kind", nargs="?", help="microscopy, imagenet, coco, brats, spleen, prostate, hippocampus, thinstack, pathology")
    p.add_argument("out", nargs="?", help="output folder (must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_synth, takes_extra=True, parser=p)
    p = dsub.add_parser("inspect", help="counts, shapes, dtypes, intensity range, class balance",
                        description="Report a dataset folder: counts, shapes, dtypes, intensity range, class "
                        "balance and every anomaly. Exits 2 (after the full report) when files would stop "
                        "training: unreadable, a Z/T stack, an image without its mask, sizes that differ.")
    p.add_argument("path")
    p.add_argument("--fingerprint", action="store_true", help="every case (Decathlon): spacing, shape, shape after "
                   "crop, foreground intensity statistics per channel, class fractions; what `configure` plans from")
    p.add_argument("--json", help="with --fingerprint: also write it to this JSON file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="microscopy: check as training with these data.args would (channels, num_classes, "
                        "binarize; default the builder's: channels=1, num_classes=2, binarize=false)")
    p.set_defaults(func=cmd_inspect)

    for name, where in FEATURES:
        module, function = where.split(":")
        getattr(importlib.import_module(module), function)(sub)
        assert name in sub.choices, f"{where} did not add the {name!r} subcommand"
    return parser


def _log_data_warning(message, category, filename, lineno, file=None, line=None, *, shown=None) -> None:
    """``warnings.showwarning`` of the CLI: a :class:`DataWarning` (a data problem fastvision steps
    over; its message names the file) becomes one ``fastvision: warning: ...`` log line; any other
    warning keeps Python's format (``shown``), where the source line helps whoever reads it."""
    if issubclass(category, DataWarning):
        logging.getLogger("fastvision").warning("warning: %s", message)
    else:
        shown(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    import functools
    import warnings

    from fastvision.engine.log import setup_logging

    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    setup_logging(debug)
    shown = warnings.showwarning
    warnings.showwarning = functools.partial(_log_data_warning, shown=shown)
    clean = False  # the command ended on every rank alike: gloo's threads can be joined
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        args.argv = list(argv)
        if extra and not getattr(args, "takes_extra", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        rc = args.func(args, extra) if getattr(args, "takes_extra", False) else args.func(args)
        clean = True
        return rc
    except Preempted as e:  # a stop signal: the checkpoint is written; 128 + signal, as the shell reports one
        clean = True
        print(f"fastvision: {e}", file=sys.stderr)
        return e.exit_code
    except FastvisionError as e:
        if debug:
            raise
        print(f"fastvision: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastvision: interrupted", file=sys.stderr)
        return 130
    finally:
        _leave_process_group(clean)
        warnings.showwarning = shown
        logging.shutdown()


def _leave_process_group(clean: bool) -> None:
    """Leave a process group a command joined and did not leave (tune, benchmark, profile, predict
    under torchrun): gloo's worker threads must be joined before the interpreter finalizes, or one of
    them can abort the process at exit (``distributed.shutdown``). Torch is not imported for it."""
    if "torch.distributed" not in sys.modules:
        return
    from fastvision import distributed

    if distributed.joined():
        distributed.shutdown(join_threads=clean)


def entry() -> None:
    """The ``fastvision`` command: :func:`main`, then exit with its status. A command that left a
    process group after an error (its threads possibly inside a collective) exits without
    finalizing the interpreter (:func:`fastvision.distributed.exit_process`), so a peer leaving at the same
    moment cannot turn its exit status into SIGABRT."""
    code = main()
    comm = sys.modules.get("fastvision.distributed.comm")  # loaded only by commands that used torch.distributed
    if comm is not None:
        comm.exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
