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

from fastvision import cli_args, cli_data
from fastvision.errors import (
    ConfigError,
    DataError,
    DataWarning,
    FastvisionError,
    Preempted,
    ReportedByPeer,
    first_report,
    missing_extra,
    peer_lost,
)

# Every subcommand is one hop from here. ``train``, ``evaluate``, ``predict``, ``recipes`` and ``data``
# are defined in build_parser below (their arguments in fastvision.cli_args); each feature subcommand
# by the function named here, which adds exactly that subparser (arguments, help, and ``func``) --
# open the module to read it.
FEATURES = (
    ("benchmark", "fastvision.benchmark.modes:add_cli"),
    ("profile", "fastvision.profiling:add_profile_cli"),
    ("monitor", "fastvision.profiling:add_monitor_cli"),
    ("scale", "fastvision.scaling.sweep:add_cli"),
    ("cv", "fastvision.metrics.crossval:add_cli"),
    ("export", "fastvision.inference.export:add_cli"),
    ("froc", "fastvision.metrics.froc_cli:add_cli"),
    ("plan", "fastvision.planning.plan:add_cli"),
    ("configure", "fastvision.planning.configure:add_cli"),
    ("tune", "fastvision.planning.tune:add_cli"),
)


def cmd_train(args: argparse.Namespace) -> int:
    from fastvision import distributed
    from fastvision.api import run_training
    from fastvision.config import parse_override

    single = distributed.outer_launcher(args.nproc) == "single"
    distributed.check_nproc(args.nproc if single else 1, args.device)  # under torchrun / srun --nproc is unused
    if args.pretrained:
        args.set.append(f"model.args.pretrained={args.pretrained}")
    flat = {k: getattr(args, k) for k in ("data", "epochs", "batch_size", "lr", "amp", "tf32", "compile",
                                          "channels_last", "device", "seed", "target", "tensorboard",
                                          "emulate_workers", "backend")
            if getattr(args, k) is not None}  # only the flags the user gave
    extra = [parse_override(s) for s in args.set]
    if args.nproc > 1 and single:
        from fastvision import config
        from fastvision.api import overrides_to_dicts

        # the recipe, every --set and a local --data that is not there checked here, once: a typo is one
        # line, not one per worker
        cfg = config.load(args.recipe, [*overrides_to_dicts(flat), *extra])
        if cfg.train.emulate_workers > 1:  # said here once, not by every worker after the group is made
            raise ConfigError("--emulate-workers runs in one process; do not combine it with --nproc or a launcher")
        from fastvision.distributed.watchdog import check_timeouts

        check_timeouts(cfg.train.hang_timeout_s, cfg.train.dist_timeout_s)  # before the workers start
        if args.data and "://" not in args.data and not Path(args.data).exists():
            from fastvision.data.formats.base import dataset_folder

            dataset_folder(args.data)
        # Re-run this very command under torch's launcher, one process per worker.
        return distributed.launch_local(args.nproc, distributed.relaunch_argv(args.argv), backend=args.backend or "ddp")
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
    if summary.get("rank", 0) == 0:  # one result line and run directory per job, not one per rank
        _print_result(summary)
    return 0


def _print_result(summary: dict[str, Any]) -> None:
    keys = [k for k in ("iou", "dice", "top1", "map", "ap50") if isinstance(summary.get(k), float)]
    if keys:
        print("final " + "  ".join(f"{k} {summary[k]:.4f}" for k in keys))
    print(f"run directory: {summary['run_dir']}")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from fastvision.api import evaluate_path, refuse_overwrite

    if args.json:  # checked before evaluating: a refusal costs nothing
        refuse_overwrite(args.json, args.force, "--json", file=True)
    result = evaluate_path(args.run, device=args.device, data=args.data)
    for k, v in result.items():
        print(f"{k}: {_format_value(k, v)}")
    if args.json:  # atomic (its folder made): a stopped evaluate leaves no half-written file
        from fastvision.utils.files import atomic_write

        text = json.dumps(result, indent=2).encode()
        atomic_write(Path(args.json), lambda f: f.write(text))
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

    distributed.check_nproc(args.nproc if distributed.outer_launcher(args.nproc) == "single" else 1, args.device)
    if args.tta_axes is not None and not args.tta_axes.strip(" ,"):  # '' predicted without mirroring, silently
        raise ConfigError(f"--tta-axes {args.tta_axes!r}: names no axis; give them (e.g. 0,1,2) or use --tta")
    volume_flags = bool(args.folds or args.tta or args.tta_axes or args.nproc > 1 or args.postprocess != "auto")
    try:
        volumes = is_folds_dir(args.checkpoint) or is_volume_input(expand_inputs(args.inputs))
    except DataError:  # a missing input: named below (after the --out check of a plain predict)
        volumes = volume_flags
    if not volumes:  # 2-D images (or a missing input)
        if volume_flags:
            raise ConfigError("--folds, --tta, --tta-axes, --nproc and --postprocess apply to NIfTI volumes")
        refuse_overwrite(args.out, args.force, folder=True)
        written = predict(args.checkpoint, args.inputs, args.out, device=args.device, coco_ids=args.coco_ids)
        print(f"wrote {len(written)} files to {args.out}")
        return 0
    if args.coco_ids != "auto":
        raise ConfigError("--coco-ids applies to a detection run's images, not to NIfTI volumes")
    if args.nproc > 1 and distributed.outer_launcher(args.nproc) == "single":
        # one process per shard of the cases, under torch's launcher (as train --nproc)
        from fastvision.inference.volumes import remove_if_empty

        fresh = not Path(args.out).exists()
        rc = distributed.launch_local(args.nproc, distributed.relaunch_argv(args.argv))
        if rc and fresh:  # an input refused when read: the --out this job made holds no case, not even its record
            remove_if_empty(Path(args.out))
        return rc
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
    cli_args.train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="validation metrics of a run or checkpoint")
    cli_args.evaluate_args(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("predict", help="predict files with a checkpoint, a run or the ensemble of its folds")
    cli_args.predict_args(p)
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("recipes", help="table of shipped recipes (task, model, data and where to get it, seed, "
                                        "purpose), or print one")
    cli_args.recipes_args(p)
    p.set_defaults(func=cmd_recipes)

    cli_data.add_actions(sub.add_parser("data", help="synthetic data, dataset inspection and sharding"))

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
    import errno
    import functools
    import os
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
        if first_report(f"fastvision: {e}"):  # under --nproc the job says it once, not once per rank
            print(f"fastvision: {e}", file=sys.stderr)
        return e.exit_code
    except FastvisionError as e:
        if debug:
            raise
        line = f"fastvision: error: {e}"
        if not isinstance(e, ReportedByPeer) and first_report(line):  # else another rank printed it
            print(line, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastvision: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`| head`): stop quietly, as a SIGPIPE'd tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        return 128 + 13
    except Exception as e:  # one line for: an optional extra not installed, a full, read-only or forbidden
        from fastvision.utils.files import os_error_in  # place, a path under a file

        cause, extra = os_error_in(e), missing_extra(e)
        if (cause is None and extra is None) or debug:
            raise
        line = extra or f"{cause.filename or 'a file'}: {cause.strerror}"
        if cause is not None and cause.errno == errno.ENOENT:  # mkdir's: the place takes no folder
            line = f"{cause.filename}: cannot make this folder ({cause.strerror})"
        print(f"fastvision: error: {line}", file=sys.stderr)
        return 2
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
    moment cannot turn its exit status into SIGABRT. That holds for an error :func:`main` does not catch too
    (a collective whose peer died raises gloo's ``RuntimeError``): its traceback is printed as the interpreter
    would print it, and the exit status is 1."""
    try:
        code = main()
    except Exception as e:
        if "fastvision.distributed.comm" not in sys.modules:
            raise
        lost = peer_lost(e)
        if lost and "--debug" not in sys.argv:
            # a consequence, not the cause: the rank that stopped first said why (its error line, or the
            # launcher's line naming it); a traceback of the broken collective here would bury that
            print(f"fastvision: error: this rank's collective failed because another rank left the job first "
                  f"({lost}); that rank's message or the launcher's line above says why", file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
        code = 1
    comm = sys.modules.get("fastvision.distributed.comm")  # loaded only by commands that used torch.distributed
    if comm is not None:
        comm.exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
