"""``fastvision tune RECIPE``: from the profiler's verdict to the fastest configuration, measured on
the real step.

It profiles the start (recipe + ``--set``) with the engine's own build and ``train_step`` (data
pipeline included), orders the speed switches by the verdict (:mod:`~fastvision.planning.tune_switches`),
times each candidate against the incumbent in interleaved rounds and keeps it only when it is
faster by more than the rounds' spread and its probe losses match (:mod:`~fastvision.planning.tune_search`,
:mod:`~fastvision.planning.tune_trial`), within ``--budget``. Under ``--nproc`` / torchrun every rank
runs the same trials and rank 0 decides for all. Writes ``tuned.yaml`` (``extends:`` the recipe),
a bar chart beside it and optionally the trials as JSON; a second call with the same recipe,
overrides, hardware and data reuses the stored result (``--fresh`` re-measures).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from fastvision import __version__, config, distributed
from fastvision.errors import ConfigError, DataError
from fastvision.planning import tune_report
from fastvision.planning.tune_search import Comparison, Switch, Trial, judge, order, search
from fastvision.planning.tune_switches import SWITCH_KEYS, catalogue, check_keep, current, lr_line
from fastvision.planning.tune_trial import TrialRunner
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
    root = os.environ.get("FASTVISION_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastvision"
    return Path(root) / "tune" / f"{key}.json"


def _agree(value: Any) -> Any:
    """Rank 0's value for every rank; a trial is dropped on every rank when any rank's errored."""
    if not isinstance(value, Trial):
        return distributed.broadcast_object(value)
    every = distributed.gather_objects(value)  # all ranks receive the same list
    chosen = every[0]
    failed = next(((r, t) for r, t in enumerate(every) if t.reason.startswith("error")), None)
    if failed and not chosen.reason.startswith("error"):
        chosen = dataclasses.replace(chosen, kept=False, reason=f"{failed[1].reason} (rank {failed[0]})")
    return chosen


def run_tune(cfg: config.RunConfig, *, budget_s: float, keep: list[str], allow_batch: bool,
             runner: TrialRunner | None = None) -> dict[str, Any]:
    """Profile the start, search the switches, return the JSON-able result (every rank; rank 0's decisions)."""
    env, device = distributed.init(cfg.train.device, timeout_s=cfg.train.dist_timeout_s, backend=cfg.train.backend)
    switches = [s for s in catalogue(cfg, device, env.world_size, allow_batch) if s.key not in keep]
    start = current(cfg, sorted({s.key for s in switches}))
    runner = runner or TrialRunner(cfg)
    t0 = time.monotonic()
    report = runner.baseline(start)
    base_s = time.monotonic() - t0
    verdict = _agree(report["verdict"])
    trial_s = _agree(runner.trial_estimate())
    if base_s + trial_s > budget_s:
        raise ConfigError(f"--budget {budget_s:.0f} s cannot fit one trial here (the baseline took {base_s:.0f} s, "
                          f"a trial takes at least {trial_s:.0f} s more): raise --budget")
    # one trial's time is kept back for the final check of the whole tuned setting against the start
    result = search(start, order(switches, verdict), runner.measure, budget_s=budget_s, spent_s=base_s, reserve=1,
                    agree=_agree)
    best, final = final_check(runner, start, result.best, [t for t in result.trials if t.kept])
    chosen = {k: v for k, v in best.items() if v != start.get(k)}
    tc = cfg.train
    line = ""
    if "train.batch_size" in chosen or "train.accum_steps" in chosen:
        line = lr_line(cfg, best.get("train.batch_size", tc.batch_size),
                       best.get("train.accum_steps", tc.accum_steps), env.world_size)
    return {"verdict": verdict, "advice": report["advice"], "start": start, "chosen": chosen,
            "baseline": {"items_per_s": report["images_per_s"], "p90_ms": report["step_ms"]["p90"],
                         "data_share": report["shares"]["input"], "peak_mib": None, "seconds": base_s},
            "trials": [dataclasses.asdict(t) for t in result.trials], "untried": result.untried,
            "final": dataclasses.asdict(final) if final else None,
            "speedup": final.ratio if final and final.kept else 1.0, "lr_line": line, "seconds": result.seconds, "budget_s": budget_s,
            "steps_per_round": runner.k, "rounds": runner.rounds,
            "rank_settings": distributed.gather_objects(best)}


def final_check(runner: TrialRunner, start: dict[str, Any], best: dict[str, Any],
                kept: list[Trial]) -> tuple[dict[str, Any], Trial | None]:
    """The tuned setting against the start in one more interleaved trial: kept trials were each
    measured against their own incumbent, so their gains need not add up. The start stays when
    the tuned setting is not faster by more than the spread (never slower than the start)."""
    if not kept:
        return start, None
    kinds = {t.kind for t in kept}
    kind = "batch" if "batch" in kinds else "numeric" if "numeric" in kinds else "exact"
    switch = Switch("final", (), kind, "final")
    t0 = time.monotonic()
    try:
        comp = runner.measure(start, best, switch)
    except Exception as e:  # noqa: BLE001  (the start stays)
        comp = Comparison(error=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
    final = judge(switch, "tuned vs start", comp)
    final.seconds = time.monotonic() - t0
    final = _agree(final)
    return (best if final.kept else start), final


def cmd_tune(args) -> int:
    """``fastvision tune``: checks, cache, search, outputs (rank 0 writes)."""
    from fastvision.api import overrides_to_dicts, refuse_overwrite

    check_keep(args.keep)
    budget_s = parse_budget(args.budget)
    if budget_s < MIN_BUDGET_S:
        raise ConfigError(f"--budget {args.budget}: cannot fit one trial (a trial builds and times two runs: "
                          f"give at least {MIN_BUDGET_S:.0f} s)")
    out = Path(args.out)
    json_path = Path(args.json) if args.json else None
    for p, flag in ((out, "--out"), (out.with_suffix(".png"), "--out"), (json_path, "--json")):
        if p is not None:
            refuse_overwrite(p, args.force, flag)
    if args.nproc > 1 and distributed.detect_env().launcher == "single":
        return distributed.launch_local(args.nproc, ["-m", "fastvision.cli", *distributed.strip_option(args.argv, "--nproc")])
    flat = {k: v for k, v in {"data": args.data, "device": args.device}.items() if v is not None}
    cfg = config.load(args.recipe, [*overrides_to_dicts(flat), *[config.parse_override(s) for s in args.set]])
    data = data_fingerprint(cfg)  # a missing folder stops here, before any work
    env, device = distributed.init(cfg.train.device, timeout_s=cfg.train.dist_timeout_s, backend=cfg.train.backend)
    hw = hardware(device, env.world_size)
    key = cache_key(args.recipe, args.set, {"device": args.device, "keep": sorted(args.keep),
                                            "allow": sorted(args.allow)}, hw, data)
    stored = cache_path(key)
    result = None
    if not args.fresh and stored.is_file():
        result = json.loads(stored.read_text())
        log.info("reusing the stored tune result %s (--fresh measures again)", stored)
    if result is None:
        result = run_tune(cfg, budget_s=budget_s, keep=args.keep, allow_batch="batch" in args.allow)
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

    Console(width=max(150, shutil.get_terminal_size().columns)).print(tune_report.table(result))
    for p in tune_report.write_all(result, out, json_path):
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
    p.add_argument("--fresh", action="store_true", help="measure again even if a stored result matches")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out / --json")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key; a speed switch set here is a starting point unless pinned with --keep")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--nproc", type=int, default=1, help="tune N local workers through torch.distributed.run")
    p.set_defaults(func=cmd_tune)
