"""``fastvision data synth | inspect | shard``: the data subcommands (their arguments in
:mod:`fastvision.cli_args`); :func:`fastvision.cli.build_parser` adds them through :func:`add_actions`."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fastvision import cli_args
from fastvision.errors import ConfigError, DataError


def add_actions(data: argparse.ArgumentParser) -> None:
    """The actions of the ``data`` subcommand (``build_parser`` adds ``data`` itself)."""
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = dsub.add_parser("synth", help="write a synthetic dataset in a real format", add_help=False,
                        description="Write a synthetic dataset. Extra --option VALUE pairs go to the generator; "
                                    "`fastvision data synth KIND --help` lists KIND's options.")
    cli_args.synth_args(p)
    p.set_defaults(func=cmd_synth, takes_extra=True, parser=p)
    p = dsub.add_parser("inspect", help="counts, shapes, dtypes, intensity range, class balance",
                        description="Report a dataset folder: counts, shapes, dtypes, intensity range, class "
                        "balance and every anomaly. Exits 2 (after the full report) when files would stop "
                        "training: unreadable (a truncated JPEG too), a Z/T stack, an image without its mask, "
                        "sizes that differ, validation classes the training split lacks.")
    cli_args.inspect_args(p)
    p.set_defaults(func=cmd_inspect)
    p = dsub.add_parser("shard", help="write a dataset as WebDataset tar shards + an index (train with --data OUT)",
                        description="Write an ImageFolder/ImageNet or COCO dataset as WebDataset tar shards and "
                        "shards.json: the files as they are plus labels, deterministic bytes, a sha256 per shard. "
                        "Rerun after an interruption to complete it; finished shards are never rewritten.")
    cli_args.shard_args(p)
    p.set_defaults(func=cmd_shard)


def cmd_synth(args: argparse.Namespace, extra: list[str]) -> int:
    from fastvision.data.synth import load_all
    from fastvision.registry import check_kwargs

    if args.help or args.kind is None or args.out is None:
        if not args.help:
            raise ConfigError("data synth: give KIND and OUT, e.g. fastvision data synth microscopy data/micro")
        print(args.parser.format_help() if args.kind is None else synth_help(args.kind), end="")
        return 0
    import inspect
    import re

    synth = load_all().get(args.kind)
    options = parse_options(extra)
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731  (as the user typed it)
    valid = [n for n in inspect.signature(synth).parameters if n not in ("out", "seed")]
    unknown = [k for k in options if k not in valid]
    if unknown:  # named as typed, with the options there are (data synth KIND --help)
        raise ConfigError(f"data synth {args.kind} {flag(unknown[0])}: no such option; valid: "
                          f"{', '.join(map(flag, ['seed', *valid]))}")
    try:
        check_kwargs(synth, options, f"data synth {args.kind}", exclude={"out"})
    except ConfigError as e:  # "data synth imagenet.per_class: expected int" -> "... --per-class: ..."
        raise ConfigError(re.sub(rf"^data synth {re.escape(args.kind)}\.(\w+)",
                                 lambda m: f"data synth {args.kind} {flag(m.group(1))}", str(e))) from None
    if args.seed < 0:  # numpy's seed sequences take non-negative integers only (a traceback deep in the generator)
        raise ConfigError(f"data synth {args.kind} --seed {args.seed}: must be at least 0")
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
    lines.append(f"  --{'seed':<22} default 0")
    for name, param in inspect.signature(synth).parameters.items():
        if name in ("out", "seed") or param.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        lines.append(f"  --{name.replace('_', '-'):<22} default {param.default!r}")
    doc = inspect.getdoc(synth)
    if doc:
        lines += ["", doc]
    return "\n".join(lines) + "\n"


def parse_options(extra: list[str]) -> dict[str, Any]:
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

    if args.json and not args.fingerprint:
        raise ConfigError("data inspect --json: needs --fingerprint (the JSON it writes is the fingerprint)")
    if args.fingerprint:
        from fastvision.data.fingerprint import cmd_fingerprint
        return cmd_fingerprint(Path(args.path), args.json)
    from fastvision.config import parse_override

    settings = {}  # KEY=VALUE of data.args, parsed as train's --set parses them
    for item in args.set:
        settings.update(parse_override("data.args." + item.strip().removeprefix("data.args."))["data"]["args"])
    from fastvision.data.shards.store import unfinished_set

    if unfinished := unfinished_set(args.path):  # a stopped `data shard`: not 'unrecognised dataset layout'
        raise DataError(unfinished)
    report = inspect_path(args.path if "://" in args.path else Path(args.path), settings)  # a URL: shards
    print_report(report)
    unusable = report.get("unusable") or {}
    if unusable:  # every anomaly is listed above; the exit code says the folder does not train as is
        raise DataError(f"{args.path}: {sum(unusable.values())} file(s) would stop training "
                        f"({'; '.join(unusable)}): listed above")
    return 0


def cmd_shard(args: argparse.Namespace) -> int:
    from fastvision.data.shards.writer import write_shards

    index = write_shards(args.src, args.out, args.shard_size, args.format, force=args.force,
                         skip_unreadable=args.skip_unreadable)
    for split, shards in index.splits.items():
        print(f"{split}: {sum(s.nsamples for s in shards)} samples in {len(shards)} shard(s), "
              f"{sum(s.filesize for s in shards) / 1e6:.1f} MB")
    print(f"shard set: {Path(args.out) / 'shards.json'} (train with --data {args.out})")
    return 0
