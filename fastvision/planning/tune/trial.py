"""One tuner trial on the real thing: both settings built by ``engine.build`` (data pipeline and all)
and stepped by ``engine.train_step``, the step ``fit`` runs, in interleaved timed rounds.

A trial builds the incumbent and the candidate afresh under the recipe's seed, so their first
steps start from the same weights and see the same batches: those probe steps' losses are the
parity check (exact switches: equal up to float32 rounding; numeric ones: within a tolerance).
The runs then warm up (``train.compile: auto`` decides here) and take turns: round r times K
steps of one, then K of the other, the order alternating, so load from other jobs falls on both.
"""
from __future__ import annotations

import copy
import gc
import logging
import os
import time
from typing import Any

import numpy as np
import torch

from fastvision import config, distributed, engine
from fastvision.config import RunConfig
from fastvision.data.loader import endless_batches
from fastvision.engine import runtime
from fastvision.engine.meter import DataWait
from fastvision.planning.tune.search import EXACT_RTOL, NUMERIC_RTOL, Comparison, Switch

log = logging.getLogger(__name__)


def apply(cfg: RunConfig, setting: dict[str, Any]) -> RunConfig:
    """``cfg`` with each dotted key of ``setting`` set (checked like ``--set``)."""
    over: dict[str, Any] = {}
    for key, value in setting.items():
        if value is not None or key != "data.args.backend":
            over = config.merge(over, config.nested(key, value))
    data = config.merge(config.to_dict(copy.deepcopy(cfg)), over)
    return config.from_dict(data)


class _Live:
    """A built run being stepped: its batches, and the settings that are process-wide (threads, TF32)."""

    def __init__(self, cfg: RunConfig, default_threads: int):
        self.cfg, self.threads = cfg, cfg.train.cpu_threads or default_threads
        self.run = engine.build(cfg, train=True)
        self.batches = endless_batches(self.run.train_loader)
        self.run.step.model.train()
        self.rates: list[float] = []
        self.steps: list[float] = []
        self.data_s = self.total_s = 0.0

    def activate(self) -> None:
        runtime.set_tf32(self.cfg.train.tf32)
        torch.set_num_threads(self.threads)

    def steps_losses(self, n: int, keep: int) -> list[float]:
        """``n`` untimed steps; the first ``keep`` losses (one host read each, outside the step)."""
        self.activate()
        losses = [engine.train_step(self.run.step, self.batches).loss for _ in range(n)]
        return [float(x) for x in losses[:keep]]

    def timed(self, k: int, limit_s: float) -> None:
        """One round: ``k`` steps, or fewer (at least 2) once ``limit_s`` passed (a much slower
        candidate ends its round early); items/s over the round, per-step seconds, data-wait seconds."""
        self.activate()
        cuda = self.run.device.type == "cuda"
        wait = DataWait()
        t0 = last = time.perf_counter()
        done = 0
        while done < k and (done < 2 or last - t0 < limit_s):
            engine.train_step(self.run.step, self.batches, wait)
            done += 1
            if cuda:
                torch.cuda.synchronize(self.run.device)  # deliberate: a measured step ends when the GPU is done
            now = time.perf_counter()
            self.steps.append(now - last)
            last = now
        self.rates.append(done * self.run.global_batch / (last - t0))
        self.data_s += wait.seconds
        self.total_s += last - t0

    def close(self) -> None:
        if hasattr(self.run.train_set, "shutdown"):  # smart cache threads
            self.run.train_set.shutdown()


class TrialRunner:
    """Times settings of one config against each other on the engine's own build and step.

    Args:
        cfg: the starting config (recipe + overrides); settings are applied on top of it.
        probe: first steps whose losses are compared (parity).
        rounds: interleaved timed rounds per trial.
        round_s: target seconds of one run's round; steps per round follow from the baseline.
    """

    def __init__(self, cfg: RunConfig, *, probe: int = 3, rounds: int = 5, round_s: float = 1.0):
        self.cfg, self.probe, self.rounds, self.round_s = cfg, probe, rounds, round_s
        self.k, self.step_s = 5, 0.0  # steps per round, seconds per step: set by the baseline
        self.default_threads = torch.get_num_threads()

    def baseline(self, setting: dict[str, Any], steps: int = 10, warmup: int = 3) -> dict[str, Any]:
        """The profiler's report (verdict, phases, images/s) of ``setting`` on the real step; sets
        the steps per round from its median step time."""
        from fastvision.profiling import profile_run

        torch.set_num_threads(self.default_threads)
        run = engine.build(apply(self.cfg, setting), train=True)
        try:
            report = profile_run(run, steps=steps, warmup=warmup)
        finally:
            if hasattr(run.train_set, "shutdown"):
                run.train_set.shutdown()
        self.step_s = report["step_ms"]["p50"] / 1e3
        self.k = int(min(30, max(3, round(self.round_s / max(self.step_s, 1e-3)))))
        return report

    def trial_estimate(self) -> float:
        """Seconds one trial takes at least: both runs' probe and warm-up steps and their rounds
        at the baseline's step time (the two builds come on top)."""
        return 2 * self.step_s * (self.probe + 2 + self.rounds * self.k)

    def measure(self, incumbent: dict[str, Any], candidate: dict[str, Any], switch: Switch) -> Comparison:
        """Parity of the probe steps, then interleaved rounds: :class:`Comparison` of the candidate."""
        live: list[_Live] = []
        try:
            for setting in (incumbent, candidate):
                run = _Live(apply(self.cfg, setting), self.default_threads)
                live.append(run)
                if run.run.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(run.run.device)
                run.losses = run.steps_losses(self._warmup(setting), self.probe)  # right after its build: same RNG
                run.peak = _peak_mib(run.run.device)
            inc, cand = live
            note = _compile_note(cand)
            if note.startswith("eager"):
                return Comparison(error=f"train.compile auto fell back to {note}")
            # a round ends early on a slow candidate in one process only: under DDP each step is a
            # collective, and ranks that stopped after different step counts would hang
            limit = 3 * self.round_s if distributed.world_size() == 1 else float("inf")
            for r in range(self.rounds):
                for one in ((inc, cand) if r % 2 == 0 else (cand, inc)):
                    one.timed(self.k, limit)
            return Comparison(incumbent_rates=inc.rates, candidate_rates=cand.rates,
                              p90_ms=float(np.percentile(cand.steps, 90)) * 1e3, peak_mib=cand.peak,
                              data_share=cand.data_s / max(cand.total_s, 1e-9),
                              parity=parity(switch.kind, inc.losses, cand.losses), note=note)
        finally:
            for run in live:
                run.close()
            del live
            gc.collect()
            torch.set_num_threads(self.default_threads)
            if "train.compile" in (*incumbent, *candidate):
                torch._dynamo.reset()  # the next trial compiles afresh: no stale graphs, no recompile limit

    def _warmup(self, setting: dict[str, Any]) -> int:
        # compile auto: 1 compiling call + 3 compiled + 3 eager timed calls decide before timing
        extra = 2 + 2 * 3 if setting.get("train.compile") == "auto" else 2
        return self.probe + extra


def parity(kind: str, reference: list[float], losses: list[float]) -> dict[str, Any] | None:
    """Do the candidate's probe-step losses match the incumbent's? None for a batch change
    (another batch gives other losses per step: allowed only with ``--allow batch``)."""
    if kind == "batch":
        return None
    rtol = EXACT_RTOL if kind == "exact" else NUMERIC_RTOL
    for i, (a, b) in enumerate(zip(reference, losses, strict=True)):
        if not (abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)):  # NaN fails too
            return {"ok": False, "detail": f"step {i + 1} loss {b:.6g} vs {a:.6g} ({kind} switch: "
                                           f"relative tolerance {rtol:g})"}
    worst = max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, losses, strict=True)), default=0.0)
    return {"ok": True, "detail": f"{len(losses)} probe losses within {worst:.1e} (tolerance {rtol:g})"}


def _compile_note(one: _Live) -> str:
    model = one.run.step.model
    choice = getattr(model, "choice", None)
    return f"{choice}: {model.reason}" if choice in ("eager", "compiled") else ""


def _peak_mib(device: torch.device) -> float | None:
    """CUDA: peak allocated by the probe and warm-up steps; CPU: the process's resident set now."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None
