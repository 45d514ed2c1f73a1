"""Checkpoint policy, in one place: when a checkpoint is due, which files it becomes, what is pruned.

Rank 0 writes ``checkpoints/last.pt`` at every checkpoint (epoch end, step, stop signal); the other
names are hard links of the same file (:class:`fastvision.engine.checkpoint.BackgroundWriter`):

* ``best.pt`` when the epoch improved the primary metric;
* ``step-N.pt`` for a step checkpoint when ``train.keep_checkpoints`` > 0, the newest that many kept;
* ``rollback.pt`` when the run was healthy at that step (no skipped-step streak, every weight
  finite): what a rollback on non-finite numbers loads (:mod:`fastvision.engine.guard`).

Every rank asks the same questions at the same step (names are decided on every rank, so each
knows where a rollback loads from); only rank 0 lists, writes and prunes files.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from fastvision.errors import ConfigError

STEP_NAME = "step-{:08d}.pt"
_PERIOD = {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}


class Every:
    """When a step checkpoint is due: ``train.checkpoint_every`` as steps (``500``), a period
    (``"20min"``, ``"90s"``, ``"2h"``) or whichever comes first (``"500,20min"``); None: never.

    Steps count optimizer steps of the whole run. The period runs from the last checkpoint (step or
    epoch); only rank 0's clock decides, and the ranks agree on the step through the loop's
    per-step agreement.
    """

    def __init__(self, spec: int | str | None):
        self.steps: int | None = None
        self.seconds: float | None = None
        for part in ([] if spec is None else str(spec).replace(" ", "").split(",")):
            m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|sec|m|min|h)?", part.lower())
            if not m or float(m.group(1)) <= 0 or (m.group(2) is None and not m.group(1).isdigit()):
                raise ConfigError(f"train.checkpoint_every: {spec!r}; expected steps (500), a period "
                                  "(20min, 90s, 2h) or both (500,20min)")
            if m.group(2) is None:
                self.steps = int(m.group(1))
            else:
                self.seconds = float(m.group(1)) * _PERIOD[m.group(2)]
        self.last = time.monotonic()

    def due_by_steps(self, global_step: int) -> bool:
        """Due at this step count (the same on every rank: no agreement needed)."""
        return self.steps is not None and global_step % self.steps == 0

    def due_by_time(self) -> bool:
        """Rank 0's clock says the period is over (the ranks agree on it one step later)."""
        return self.seconds is not None and time.monotonic() - self.last >= self.seconds

    def reset(self) -> None:
        """A checkpoint was just taken: the period starts again."""
        self.last = time.monotonic()


def step_checkpoints(folder: Path) -> list[Path]:
    """The kept step checkpoints (``step-N.pt``) in ``folder``, oldest first."""
    return sorted(Path(folder).glob("step-*.pt"))


def _number(path: Path) -> int:
    digits = re.sub(r"\D", "", path.stem)
    return int(digits) if digits else -1


class CheckpointPolicy:
    """Which files a checkpoint becomes and which step checkpoints go (see the module doc).

    Args:
        folder: the run's ``checkpoints`` folder.
        every: ``train.checkpoint_every``.
        keep: ``train.keep_checkpoints`` (0: no ``step-N.pt``).
    """

    def __init__(self, folder: Path, every: Every, keep: int):
        self.folder, self.every, self.keep = Path(folder), every, keep
        self.good: tuple[Path, int] | None = None  # (rollback.pt, its step) once a healthy one is written

    @classmethod
    def from_config(cls, tc, folder: Path) -> CheckpointPolicy:
        """``train.checkpoint_every`` and ``keep_checkpoints``, checked (before anything is built)."""
        if tc.keep_checkpoints < 0:
            raise ConfigError(f"train.keep_checkpoints must be >= 0, got {tc.keep_checkpoints}")
        return cls(folder, Every(tc.checkpoint_every), tc.keep_checkpoints)

    def files(self, global_step: int, *, best: bool, step: bool, healthy: bool) -> list[Path]:
        """The names of the checkpoint taken at ``global_step``: written to the first, linked to the rest."""
        paths = [self.folder / "last.pt"]
        if best:
            paths.append(self.folder / "best.pt")
        if step and self.keep:
            paths.append(self.folder / STEP_NAME.format(global_step))
        if healthy:
            paths.append(self.folder / "rollback.pt")
            self.good = (paths[-1], global_step)
        return paths

    def resumed(self, step: int, saved_step: Callable[[Path], int | None]) -> None:
        """After a resume at ``step``: this folder's ``rollback.pt``, written while the run was healthy before
        the stop, is where a rollback goes until a newer healthy checkpoint is written (before, a run that
        diverged before its first checkpoint after a preemption stopped with 'no healthy checkpoint'). Not
        one ahead of ``step``: that belongs to a branch abandoned by resuming an older ``step-N.pt``."""
        path = self.folder / "rollback.pt"
        at = saved_step(path) if path.is_file() else None
        if at is not None and at <= step:
            self.good = (path, at)

    def prune(self, global_step: int) -> list[Path]:
        """Rank 0, before writing ``step-<global_step>.pt`` (the previous write on disk): the step
        checkpoints that go so that ``keep`` remain, oldest first. Never the file being written,
        nor one numbered above it: after ``--resume`` from an older ``step-N.pt`` those belong to
        the abandoned branch; they are overwritten as the run passes their steps, or pruned as old."""
        if not self.keep:
            return []
        older = [p for p in step_checkpoints(self.folder) if _number(p) < global_step]
        return older[: max(0, len(older) - (self.keep - 1))]
