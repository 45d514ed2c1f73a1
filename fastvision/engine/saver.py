"""The run's checkpoint saver: :class:`Checkpoints` writes the checkpoints the policy names
(:mod:`fastvision.engine.policy`), at the step every rank agrees on, in the background (rank 0)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastvision import distributed
from fastvision.distributed.preempt import Preemption
from fastvision.engine import checkpoint, runtime
from fastvision.engine.build import Run
from fastvision.engine.guard import NonFiniteGuard
from fastvision.engine.meter import EpochMeter
from fastvision.engine.policy import CheckpointPolicy
from fastvision.engine.state import Position, checkpoint_state


class Checkpoints:
    """The checkpoints of a run as it trains.

    Which files and when: :class:`CheckpointPolicy`; this writes them, always in the background and
    atomically (rank 0). Every rank takes part in deciding (through ``preemption``, which owns the
    signals and the ranks' agreement) and sends its random-generator states, so all ranks act at the
    same step.
    """

    def __init__(self, run: Run, resolved: dict, wall: Callable[[], float], policy: CheckpointPolicy,
                 preemption: Preemption, guard: NonFiniteGuard):
        self.run, self.resolved, self.wall, self.policy = run, resolved, wall, policy
        self.folder, self.every, self.preemption, self.guard = policy.folder, policy.every, preemption, guard
        self.writer = checkpoint.BackgroundWriter()

    @property
    def good(self) -> tuple[Path, int] | None:
        """The newest healthy checkpoint of this run (``rollback.pt``, its step), or None."""
        return self.policy.good

    def wait_written(self) -> None:
        """Every rank: the checkpoints rank 0 queued are on disk (before a rank reads one)."""
        self.writer.join()
        distributed.barrier()

    def _timed(self) -> bool:
        """Rank 0's clock says a period's checkpoint is due (the ranks agree on it)."""
        return self.run.env.is_main and self.every.due_by_time()

    def after_step(self, state: dict, epoch: int, i: int, meter: EpochMeter) -> bool:
        """After step ``i`` of ``epoch``: write a step checkpoint when due; True when the run must stop
        (its checkpoint is then written). A checkpoint write that failed (a full disk) raises here."""
        self.writer.raise_failed()
        stop, timed = self.preemption.after_step(state["step"], self._timed())
        if stop or timed or self.every.due_by_steps(state["step"]):
            self._save_position(state, epoch, i, meter)
        return stop

    def agree_stop(self, state: dict, epoch: int, steps: int | None, meter: EpochMeter | None) -> bool:
        """At an epoch's end (``steps`` given: before validation, else after the epoch checkpoint):
        whether the ranks stop now. Before validation its checkpoint is of the last step, so a resume
        validates the epoch."""
        stop, _ = self.preemption.agree_now()
        if not stop:
            return False
        if steps is not None:
            self._save_position(state, epoch, steps, meter)
        return True

    def _save_position(self, state: dict, epoch: int, i: int, meter: EpochMeter) -> None:
        """A step checkpoint: the loop state at step ``i`` of ``epoch``, the epoch's counters with it."""
        state["position"] = Position(epoch, i, meter.samples, meter.state())
        self.save(state, step=True)
        state["position"] = None

    def save(self, state: dict, best: bool = False, step: bool = False) -> None:
        """Every rank calls this at the same step; rank 0 snapshots now and writes in the background."""
        rng_ranks = distributed.gather_objects(runtime.rng_state(self.run.step.generator))
        self.every.reset()
        state["wall_time"] = self.wall()
        paths = self.policy.files(state["step"], best=best, step=step, healthy=self.guard.healthy(state["step"]))
        state["nonfinite_streak"] = self.guard.streak  # read by healthy(): a resume continues the count
        if not self.run.env.is_main:
            return
        prune = []
        if step:
            self.writer.join()  # the previous step-N.pt is on disk (write() would wait for it anyway)
            prune = self.policy.prune(state["step"])
        self.writer.write(checkpoint_state(self.run, state, self.resolved, rng_ranks), paths, prune)

    def report(self) -> dict[str, float]:
        """Checkpoint latencies for the summary: seconds from a step's end to its file being durable."""
        lat = self.writer.latencies
        return {"checkpoints_written": len(lat), "checkpoint_durable_max_s": max(lat) if lat else None,
                "checkpoint_stall_mean_s": sum(self.writer.snapshot_s) / len(lat) if lat else None}

    def close(self) -> None:
        self.writer.join(raise_errors=False)  # after an error: still wait for (and log) a write in flight
