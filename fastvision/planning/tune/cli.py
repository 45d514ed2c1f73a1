"""``fastvision tune RECIPE``: the subcommand's arguments, the budget, the stored result and the
outputs; rank 0 writes ``tuned.yaml``, its chart and the JSON.

A result is stored under a key of the recipe (its whole ``extends`` chain), the overrides, the
hardware and the dataset's files; a second call with the same key reuses it (``--fresh`` measures
again).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from fastvision import __version__, config, distributed
from fastvision.errors import ConfigError, DataError, interrupted
from fastvision.planning.tune import report
from fastvision.planning.tune.run import run_tune
from fastvision.planning.tune.switches import SWITCH_KEYS, check_keep
from fastvision.planning.tune.trial import TrialRunner
from fastvision.utils.files import atomic_write
from fastvision.utils.hostcpu import host_cpu_name

log = logging.getLogger(__name__)

MIN_BUDGET_S = 20.0  # below this not even the baseline and one trial of the smallest recipe fit


def parse_budget(text: str) -> float:
    """``"10min"``, ``"90s"``, ``"1.5h"`` or plain seconds -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)?", str(text).strip().lower())
    if not m:
        raise ConfigError(f"--budget {text!r}: expected a duration such as 10min, 90s or 1h")
    return float(m.group(1)) * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[m.group(2) or "s"]


def data_fingerprint(cfg: config.RunConfig) -> str:
    """Names, sizes and modification times of the dataset folder's files (cheap; no file is read).

    Raises:
        DataError: the folder set in ``data.args.path`` does not exist.
    """
    path = cfg.data.args.get("path")
    if path is None:
        return "built-in sample"
    from fastvision.data.shards.remote import is_remote

    if is_remote(path):  # a shard set (or TFRecord folder) at a URL: its index names its shards' sha256
        return remote_fingerprint(str(path))
    root = Path(path)
    if not root.exists():
        raise DataError(f"{root}: dataset folder not found (data.args.path; pass --data DIR)")
    h = hashlib.sha256()
    for i, p in enumerate(sorted(root.rglob("*"))):
        if i >= 200_000:
            break
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def remote_fingerprint(url: str) -> str:
    """The URL and its ``shards.json`` (whose sha256s change with every rewrite of the set); the URL alone
    where there is none to read (a TFRecord folder, an unreachable host: the build names that)."""
    from fastvision.data.shards.remote import Remote
    from fastvision.data.shards.store import INDEX

    base = url.rstrip("/")
    try:
        index = Remote(base, 0, 10.0).get(f"{base}/{INDEX}")
    except (DataError, OSError):
        index = b""
    return hashlib.sha256(base.encode() + b"\0" + index).hexdigest()


def hardware(device: torch.device, world_size: int) -> dict[str, Any]:
    cpu = host_cpu_name()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    where = f"{gpu or cpu} x{world_size}" if world_size > 1 else (gpu or f"{cpu}, {os.cpu_count()} cores")
    return {"device": str(device), "gpu": gpu, "cpu": cpu, "cores": os.cpu_count(), "world_size": world_size,
            "torch": torch.__version__, "where": where}


def cache_key(recipe: str, sets: list[str], flags: dict[str, Any], hw: dict[str, Any], data: str) -> str:
    recipe_data = config.read_recipe(config.recipe_path(recipe))  # the whole extends chain, as read
    blob = json.dumps({"recipe": recipe_data, "sets": sets, "flags": flags, "hardware": hw, "data": data,
                       "fastvision": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_path(key: str) -> Path:
    root = (os.environ.get("FASTVISION_CACHE")
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastvision")
    return Path(root) / "tune" / f"{key}.json"


def stored_result(stored: Path) -> dict[str, Any] | None:
    """The stored result of an earlier identical tune, or None (measure again) where it cannot be read."""
    try:
        result = json.loads(stored.read_text())
    except (OSError, ValueError) as e:
        log.warning("the stored tune result %s cannot be read (%s): measuring again", stored, e)
        return None
    if not isinstance(result, dict) or not {"chosen", "trials", "baseline"} <= result.keys():
        log.warning("the stored tune result %s is not a tune result: measuring again", stored)
        return None
    log.info("reusing the stored tune result %s (--fresh measures again)", stored)
    return result


def check_outputs(out: Path, json_path: Path | None, force: bool) -> tuple[Path, Path | None]:
    """``(out, json_path)``: three files (the recipe, its chart beside it, the JSON), none over another
    (``--out x.png`` wrote the chart over the recipe; ``--json`` = ``--out`` the JSON), none over an
    existing file without ``force``, none where a folder is.

    Raises:
        ConfigError / DataError: one line naming the option.
    """
    from fastvision.api import refuse_overwrite

    png = out.with_suffix(".png")
    if out.suffix.lower() == ".png" or (json_path and json_path.resolve() in (out.resolve(), png.resolve())):
        raise ConfigError(f"--out {out}{f' / --json {json_path}' if json_path else ''}: the tuned recipe, its chart "
                          f"({png}) and the JSON need three files; give --out a .yaml name and --json another")
    for p, flag in ((out, "--out"), (png, "--out"), (json_path, "--json")):
        if p is not None:
            refuse_overwrite(p, force, flag, file=True)  # files: a folder there is refused even with --force
    return out, json_path


def cmd_tune(args) -> int:
    """``fastvision tune``: checks, cache, search, outputs (rank 0 writes)."""
    from fastvision.api import overrides_to_dicts

    check_keep(args.keep)
    single = distributed.outer_launcher(args.nproc) == "single"
    distributed.check_nproc(args.nproc if single else 1, args.device)  # 0, or 99 workers on 2 cores: one line
    budget_s = parse_budget(args.budget)
    if args.rounds < 2:
        raise ConfigError(f"--rounds {args.rounds}: a trial needs at least 2 timed rounds (their spread is the noise)")
    if not 0 < args.round_seconds < math.inf:
        raise ConfigError(f"--round-seconds {args.round_seconds}: must be a positive, finite number of seconds")
    if budget_s < MIN_BUDGET_S:
        raise ConfigError(f"--budget {args.budget}: cannot fit one trial (a trial builds and times two runs: "
                          f"give at least {MIN_BUDGET_S:.0f} s)")
    out, json_path = check_outputs(Path(args.out), Path(args.json) if args.json else None, args.force)
    if args.nproc > 1 and single:
        return distributed.launch_local(args.nproc, distributed.relaunch_argv(args.argv))
    flat = {k: v for k, v in {"data": args.data, "device": args.device}.items() if v is not None}
    cfg = config.load(args.recipe, [*overrides_to_dicts(flat), *[config.parse_override(s) for s in args.set]])
    data = data_fingerprint(cfg)  # a missing folder stops here, before any work
    env, device = distributed.init(cfg.train.device, timeout_s=cfg.train.dist_timeout_s, backend=cfg.train.backend)
    hw = hardware(device, env.world_size)
    key = cache_key(args.recipe, args.set, {"device": args.device, "keep": sorted(args.keep),
                                            "allow": sorted(args.allow),
                                            "rounds": args.rounds, "round_s": args.round_seconds}, hw, data)
    stored = cache_path(key)
    result = None
    if not args.fresh and stored.is_file():
        result = stored_result(stored)
    if result is None:
        runner = TrialRunner(cfg, rounds=args.rounds, round_s=args.round_seconds)
        try:
            result = run_tune(cfg, budget_s=budget_s, keep=args.keep, allow_batch="batch" in args.allow,
                              runner=runner)
        except KeyboardInterrupt:  # Ctrl-C: say what is kept (nothing: the outputs come from the whole search)
            raise interrupted("tune", [out, out.with_suffix(".png"), json_path], "the search ends") from None
        result.update(recipe=cfg.recipe, hardware=hw, date=time.strftime("%Y-%m-%d %H:%M"), sets=list(args.set),
                      extends=str(Path(args.recipe).resolve()) if Path(args.recipe).suffix in (".yaml", ".yml")
                      else args.recipe, cache_key=key)
        if args.device:
            result["sets"].append(f"train.device={args.device}")
        if env.is_main:
            blob = json.dumps(result, indent=2, default=str).encode()
            atomic_write(stored, lambda f: f.write(blob))
    if not env.is_main:
        return 0
    from rich.console import Console

    Console(width=max(150, shutil.get_terminal_size().columns)).print(report.table(result))
    for p in report.write_all(result, out, json_path):
        print(f"wrote {p}")
    return 0


def add_cli(subparsers) -> None:
    """``fastvision tune RECIPE``."""
    p = subparsers.add_parser(
        "tune", help="find the fastest speed switches for a recipe on this machine (measured, parity-checked)",
        description="Profile RECIPE's real training step, try speed switches in the order the verdict suggests, "
                    "time each against the incumbent in interleaved rounds, keep only what is faster by more than "
                    "the spread and keeps the losses; write tuned.yaml (extends the recipe), a chart and the table.")
    p.add_argument("recipe", help="shipped recipe name or YAML file")
    p.add_argument("--data", help="dataset folder (data.args.path)")
    p.add_argument("--budget", default="10min", help="total time, e.g. 10min, 90s (default 10min)")
    p.add_argument("--out", default="tuned.yaml", help="the tuned recipe (default tuned.yaml); the PNG goes beside it")
    p.add_argument("--json", help="also write every trial to this JSON file")
    p.add_argument("--keep", nargs="+", action="extend", default=[], metavar="KEY",
                   help=f"pin these switches at the start's value; valid: {', '.join(SWITCH_KEYS)}")
    p.add_argument("--allow", nargs="+", action="extend", default=[], choices=["batch"],
                   help="batch: the search may change train.batch_size (LR by the recipe's scaling rule)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved timed rounds per trial (default 5, at least 2): more on a noisy machine")
    p.add_argument("--round-seconds", type=float, default=1.0, metavar="S",
                   help="seconds of steps per round (default 1); the baseline's step time sets the steps")
    p.add_argument("--fresh", action="store_true", help="measure again even if a stored result matches")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out / --json")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key; a speed switch set here is a starting point unless pinned with --keep")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--nproc", type=int, default=1, help="tune N local workers through torch.distributed.run")
    p.set_defaults(func=cmd_tune)
