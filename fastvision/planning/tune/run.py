"""One ``fastvision tune`` run: profile the start, search the switches in the verdict's order, then
check the tuned setting against the start; every rank runs the same trials and rank 0 decides."""
from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

from fastvision import config, distributed
from fastvision.errors import ConfigError, error_line
from fastvision.planning.tune.search import Comparison, Switch, Trial, judge, order, search
from fastvision.planning.tune.switches import catalogue, current, implied, lr_line
from fastvision.planning.tune.trial import TrialRunner


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
    auto = None
    if cfg.data.num_workers == "auto":  # the start stays auto (each trial's build resolves it): not a candidate
        from fastvision.data.workers import resolve

        auto = resolve(env, device, cfg.train.cpu_threads)
    switches = [s for s in catalogue(cfg, device, env.world_size, allow_batch, auto) if s.key not in keep]
    start = current(cfg, sorted({s.key for s in switches}))
    runner = runner or TrialRunner(cfg)
    # the imports' objects live as long as the process: with them frozen, the gc.collect() after each
    # trial scans only what the trials made (0.24 s a collection in a tune rank before, about 0 after)
    gc.freeze()
    t0 = time.monotonic()
    report = runner.baseline(start)
    # every time-based decision is rank 0's: each rank's own clock would send the ranks down
    # different paths (steps per round, the budget check) and hang them in a collective
    base_s = _agree(time.monotonic() - t0)
    verdict = _agree(report["verdict"])
    runner.k = _agree(runner.k)
    trial_s = _agree(runner.trial_estimate())
    if base_s + trial_s > budget_s:
        raise ConfigError(f"--budget {budget_s:.0f} s cannot fit one trial here (the baseline took {base_s:.0f} s, "
                          f"a trial takes at least {trial_s:.0f} s more): raise --budget")
    # one trial's time is kept back for the final check of the whole tuned setting against the start
    result = search(start, order(switches, verdict), runner.measure, budget_s=budget_s, spent_s=base_s, reserve=1,
                    agree=_agree, expand=implied)
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
            "speedup": final.ratio if final and final.kept else 1.0, "lr_line": line, "seconds": result.seconds,
            "budget_s": budget_s,
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
        comp = Comparison(error=error_line(e)[:240])
    final = judge(switch, "tuned vs start", comp)
    final.seconds = time.monotonic() - t0
    final = _agree(final)
    return (best if final.kept else start), final
