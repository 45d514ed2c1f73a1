"""The tuner's search: speed switches in the order the profiler's verdict suggests, each candidate
timed against the incumbent in interleaved rounds, kept only when faster by more than the spread.

Pure logic: what a trial measures comes from a ``measure(incumbent, candidate, switch)`` callable
(:func:`fastvision.planning.tune.trial.TrialRunner.measure` in ``fastvision tune``; a deterministic
cost model in the tests), and what the ranks agree on from an ``agree`` callable (rank 0 decides).
A setting is a flat mapping of dotted config keys to values (``{"data.cache": "ram"}``).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from fastvision.errors import error_line

GROUPS = ("input", "compute", "host", "communication")  # the order when the verdict names none
MIN_GAIN = 0.03  # a candidate must also beat the incumbent by 3 %: a few rounds can agree by chance
EXACT_RTOL = 1e-5  # "exact" switches: the same losses up to float32 rounding of a reordered sum
NUMERIC_RTOL = 0.03  # numeric switches: every probe step's loss within 3 % of the incumbent's


@dataclass(frozen=True)
class Switch:
    """One speed switch: a config key, the values worth trying, and how it may change results.

    Attributes:
        key: dotted config key, e.g. ``data.num_workers``.
        values: candidate values, tried in this order against the incumbent of the moment.
        kind: ``exact`` (same losses by construction: checked), ``numeric`` (changes rounding:
            the loss trajectory must stay within :data:`NUMERIC_RTOL`) or ``batch`` (changes the
            global batch: only with ``--allow batch``, LR rescaled by the recipe's rule).
        group: the verdict it answers: ``input``, ``compute``, ``host`` or ``communication``.
    """

    key: str
    values: tuple
    kind: str
    group: str


@dataclass
class Comparison:
    """What one trial measured: items/s per interleaved round for both settings, figures of the
    candidate, parity of its probe-step losses, or the error that stopped it."""

    incumbent_rates: list[float] = field(default_factory=list)
    candidate_rates: list[float] = field(default_factory=list)
    p90_ms: float | None = None
    peak_mib: float | None = None
    data_share: float | None = None
    parity: dict[str, Any] | None = None  # {"ok": bool, "detail": str}
    error: str | None = None
    note: str = ""  # e.g. train.compile auto's choice


@dataclass
class Trial:
    """A judged trial: the row of the table."""

    key: str
    value: Any
    kind: str
    group: str
    items_per_s: float | None
    ratio: float | None  # median over rounds of candidate / incumbent items/s
    spread: float | None  # half the range of those ratios
    p90_ms: float | None
    peak_mib: float | None
    data_share: float | None
    kept: bool
    reason: str
    seconds: float = 0.0
    implies: dict[str, Any] = field(default_factory=dict)  # what the candidate also changed (``expand``)


@dataclass
class SearchResult:
    best: dict[str, Any]
    trials: list[Trial]
    untried: list[str]  # "key=value" the budget left out
    seconds: float


def order(switches: list[Switch], verdict: str | None) -> list[Switch]:
    """The verdict's group first (``input-bound`` -> input switches), then :data:`GROUPS` in order;
    switches keep their catalogue order inside a group."""
    first = (verdict or "").replace("-bound", "").replace("host-sync", "host")
    rank = {g: i + 1 for i, g in enumerate(GROUPS)}
    rank[first] = 0
    return sorted(switches, key=lambda s: rank.get(s.group, len(GROUPS) + 1))  # stable


def judge(switch: Switch, value: Any, comp: Comparison, min_gain: float = MIN_GAIN) -> Trial:
    """Kept or not, and why: an error or a failed parity check drops it; otherwise it is kept when
    the median round ratio beats 1 by more than the rounds' spread (half their range) and ``min_gain``."""
    rates = comp.candidate_rates
    row = dict(key=switch.key, value=value, kind=switch.kind, group=switch.group,
               items_per_s=median(rates) if rates else None, ratio=None, spread=None, p90_ms=comp.p90_ms,
               peak_mib=comp.peak_mib, data_share=comp.data_share)
    if comp.error:
        return Trial(**row, kept=False, reason=f"error: {comp.error}")
    ratios = [c / i for c, i in zip(rates, comp.incumbent_rates, strict=True) if i > 0]
    if not ratios:
        return Trial(**row, kept=False, reason="error: no timed rounds")
    ratio, spread = median(ratios), (max(ratios) - min(ratios)) / 2
    row.update(ratio=ratio, spread=spread)
    note = f"; {comp.note}" if comp.note else ""
    if comp.parity is not None and not comp.parity["ok"]:
        return Trial(**row, kept=False, reason=f"parity: {comp.parity['detail']}{note}")
    gain = ratio - 1
    if gain > max(spread, min_gain):
        return Trial(**row, kept=True, reason=f"kept: {gain:+.0%} > spread {spread:.0%}{note}")
    return Trial(**row, kept=False, reason=f"not faster: {gain:+.0%} vs spread {spread:.0%}{note}")


def search(start: dict[str, Any], switches: list[Switch], measure: Callable[[dict, dict, Switch], Comparison], *,
           budget_s: float, spent_s: float = 0.0, reserve: int = 0, clock: Callable[[], float] = time.monotonic,
           agree: Callable[[Any], Any] = lambda t: t,
           expand: Callable[[dict, Switch], dict] = lambda cand, sw: cand) -> SearchResult:
    """Greedy search in ``switches`` order from ``start``: each value of each switch is tried
    against the incumbent of the moment and becomes the incumbent when kept.

    Args:
        start: the starting setting (keys of ``switches`` and anything else they read).
        switches: ordered (see :func:`order`); ``--keep`` keys already removed.
        measure: times ``candidate`` against ``incumbent`` (interleaved rounds), checks parity.
        budget_s: total seconds; a trial starts only when the mean trial so far still fits.
        spent_s: seconds already spent (the baseline profile).
        reserve: trials (of the mean duration) to leave in the budget for what follows (the final check).
        clock: seconds, monotonic (injected by tests).
        agree: every rank's judged trial, or its budget decision -> the one all ranks act on
            (rank 0's): ranks whose clocks disagree would otherwise run different trials and hang
            in the first collective one of them skips.
        expand: adds what a candidate implies (a batch change: the scaled LR).
    """
    t0 = clock() - spent_s
    incumbent, trials, untried, durations = dict(start), [], [], []
    for sw in switches:
        seen = {repr(incumbent.get(sw.key))}  # a value once beaten is not tried again
        for value in sw.values:
            if repr(value) in seen:
                continue
            seen.add(repr(value))
            mean = sum(durations) / len(durations) if durations else 0.0
            if agree(clock() - t0 + mean * (1 + reserve) > budget_s):  # rank 0's clock decides for all
                untried.append(f"{sw.key}={value}")
                continue
            cand = expand({**incumbent, sw.key: value}, sw)
            t = clock()
            try:
                comp = measure(incumbent, cand, sw)
            except Exception as e:  # noqa: BLE001  (a switch that errors is dropped; the search goes on)
                comp = Comparison(error=error_line(e)[:240])
            trial = judge(sw, value, comp)
            trial.seconds = clock() - t
            trial.implies = {k: v for k, v in cand.items() if k != sw.key and incumbent.get(k) != v}
            durations.append(trial.seconds)
            trial = agree(trial)
            trials.append(trial)
            if trial.kept:
                incumbent = cand
    return SearchResult(incumbent, trials, untried, clock() - t0)
