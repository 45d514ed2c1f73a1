"""Run logging: progress bar or plain lines, DLLogger-style ``metrics.jsonl``, plots, summary.

Only rank 0 logs (the engine passes ``enabled=False`` elsewhere). ``metrics.jsonl`` holds one JSON
event per line with DLLogger's fields (``timestamp``, ``elapsedtime``, ``type``, ``step``,
``data``): ``step`` is ``"PARAMETER"`` for the config and environment, ``[epoch, iteration]`` for
training steps, ``[epoch]`` for epoch-end validation and ``[]`` for the run summary.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

log = logging.getLogger("fastvision")


def setup_logging(debug: bool = False) -> None:
    """Plain ``fastvision: message`` lines on stderr for warnings and info."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root = logging.getLogger("fastvision")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


class RunLogger:
    """Writes events for one run.

    Args:
        run_dir: directory for ``metrics.jsonl``, ``curves.png`` and TensorBoard files.
        enabled: False on non-zero ranks (everything becomes a no-op).
        tensorboard: also write TensorBoard event files (needs the ``tensorboard`` package).
        progress: show a rich progress bar; default: only when stdout is a terminal.
    """

    def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = False,
                 progress: bool | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.start = time.time()
        self.console = Console()
        self.history: list[dict[str, Any]] = []  # one dict per epoch, for curves and summary
        self._file = open(self.run_dir / "metrics.jsonl", "a") if enabled else None
        self._tb = _tensorboard_writer(self.run_dir) if enabled and tensorboard else None
        use_bar = sys.stdout.isatty() if progress is None else progress
        self._progress = _make_progress(self.console) if enabled and use_bar else None
        self._task = None
        # curves.png needs matplotlib (seconds to import on a small CPU): import it in a thread now,
        # while the run trains, so the plot at the end only draws.
        self._plot_import = _start_plot_import() if enabled else None

    # -- events ----------------------------------------------------------------
    def event(self, step: Any, data: dict[str, Any]) -> None:
        if not self.enabled:
            return
        now = time.time()
        rec = {"timestamp": now, "elapsedtime": now - self.start, "type": "LOG",
               "step": step, "data": _jsonable(data)}
        try:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: the CLI's one line names this file
            e.filename = e.filename or str(self.run_dir / "metrics.jsonl")
            raise

    def rewind(self, epochs_done: int, position: tuple[int, int] | None) -> int:
        """After a resume: drop the events that the resumed run writes again, so ``metrics.jsonl``
        keeps one record per step; returns how many went. Kept: training steps up to ``position``
        (``(epoch, step)`` of a mid-epoch checkpoint) or of the epochs done, epoch events up to
        ``epochs_done`` (0-based), configs and summaries. A line a kill cut short goes too."""
        if not self.enabled:
            return 0
        from fastvision.utils.files import atomic_write

        cut = position or (epochs_done, float("inf"))
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _before(line, epochs_done, cut)]
        if len(kept) < len(lines):
            self._file.close()
            atomic_write(path, lambda f: f.write("".join(kept).encode()))
            self._file = open(path, "a")
        return len(lines) - len(kept)

    def parameters(self, config: dict[str, Any], environment: dict[str, Any]) -> None:
        self.event("PARAMETER", {"config": config, "environment": environment})

    def step(self, epoch: int, it: int, global_step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.event([epoch, it], values)
        if self._tb:
            for k, v in values.items():
                self._tb.add_scalar(f"train/{k}", v, global_step)
        if self._progress is None:
            text = " ".join(f"{k} {_fmt(v)}" for k, v in values.items())
            print(f"epoch {epoch} step {it}: {text}", flush=True)
        elif self._task is not None:  # the bar shows the latest loss and throughput
            info = {k: values[k] for k in ("loss", "images_per_s") if k in values}
            self._progress.update(self._task, info="  ".join(f"{k} {_fmt(v)}" for k, v in info.items()))

    def epoch_end(self, epoch: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.history.append({"epoch": epoch, **values})
        self.event([epoch], values)
        if self._tb:
            for k, v in values.items():
                self._tb.add_scalar(f"epoch/{k}", v, epoch)
        text = "  ".join(f"{k} {_fmt(v)}" for k, v in values.items())
        # one line whatever the width (piped output is 80 columns): a wrap split "dice" from its value
        self.console.print(f"[bold]epoch {epoch}[/bold]  {text}", highlight=False, soft_wrap=True)

    # -- progress bar -------------------------------------------------------------
    def start_epoch(self, epoch: int, epochs: int, steps: int) -> None:
        if self._progress is None:
            return
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task("train", total=steps, epoch=f"{epoch + 1}/{epochs}", info="")
        else:
            self._progress.reset(self._task, total=steps, epoch=f"{epoch + 1}/{epochs}", info="")

    def advance(self, info: dict[str, float] | None = None) -> None:
        if self._progress is None:
            return
        fields = {"info": "  ".join(f"{k} {_fmt(v)}" for k, v in info.items())} if info else {}
        self._progress.update(self._task, advance=1, **fields)

    # -- end of run ---------------------------------------------------------------
    def summary(self, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.event([], values)
        table = Table(title="run summary", show_header=False)
        for k, v in values.items():
            table.add_row(k, _fmt(v) if isinstance(v, float) else str(v))
        self.console.print(table)

    def plot_curves(self, metric: str) -> Path | None:
        """``curves.png``: training loss and the validation metric per epoch."""
        if not self.enabled or not self.history:
            return None
        if self._plot_import is not None:
            self._plot_import.join()  # an import error there is raised again by the import below
            atexit.unregister(self._plot_import.join)
        # The object API with the Agg canvas: no pyplot, so the user's backend and figures are untouched.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ep = [h["epoch"] + 1 for h in self.history if "train_loss" in h]
        handles = ax.plot(ep, [h["train_loss"] for h in self.history if "train_loss" in h], "o-", label="train loss")
        ax.set_xlabel("epoch")
        ax.set_ylabel("train loss")
        ax.xaxis.get_major_locator().set_params(integer=True)
        val = [(h["epoch"] + 1, h[metric]) for h in self.history if metric in h]
        if val:
            ax2 = ax.twinx()
            handles += ax2.plot(*zip(*val, strict=True), "s-", color="tab:orange", label=f"validation {metric}")
            ax2.set_ylabel(f"validation {metric}")
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        from fastvision.utils.files import save_figure

        return save_figure(fig, self.run_dir / "curves.png", dpi=100)  # a stop never leaves half a PNG

    def close(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.stop()
        if self._file:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:  # only the unwritten rest of a write that failed (event flushes each): that write's
                pass  # error, naming the file, is already on its way; this one, nameless, would replace it
        if self._tb:
            self._tb.close()


def _before(line: str, epochs_done: int, cut: tuple[int, float]) -> bool:
    """Whether a ``metrics.jsonl`` line belongs to the run before its resume point."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return False
    if isinstance(step, list) and len(step) == 2:
        return tuple(step) <= cut
    if isinstance(step, list) and len(step) == 1:
        return step[0] <= epochs_done
    return True


PLOT_IMPORT_JOIN_S = 60.0  # at exit, the longest wait for the import to finish


def _start_plot_import() -> threading.Thread:
    """A daemon thread importing what :meth:`RunLogger.plot_curves` uses; errors are left to that call.

    Joined at exit (``atexit`` runs before the interpreter finalizes). A run that ends early (a config
    error at step 1, ``train.on_nonfinite: stop``) would otherwise exit while the thread is still
    importing matplotlib's C/C++ extensions; a thread that asks for the GIL while the interpreter
    finalizes is ended by CPython with a forced unwind, which through a C++ frame that must not
    throw aborts the process (``terminate called without an active exception``, SIGABRT): a run that
    should exit 2 exits -6. Seen once in CI on a loaded machine (tests/engine/test_guard.py).
    """
    def run() -> None:
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
            from matplotlib.figure import Figure  # noqa: F401
        except Exception:  # noqa: BLE001  (plot_curves imports again and reports it)
            pass

    thread = threading.Thread(target=run, name=_PLOT_IMPORT, daemon=True)
    thread.start()
    atexit.register(thread.join, PLOT_IMPORT_JOIN_S)
    return thread


_PLOT_IMPORT = "fastvision-plot-import"


def _finish_plot_import_before_fork() -> None:
    """``os.fork`` waits for the plot import: a process forked while it runs (``data.loader: processes``'
    workers start right after the logger, at the first epoch's first batch) inherits the import locks it
    holds, with no thread left to release them, and a worker that then imports one of those modules
    waits for ever: the run hung before its first step (1 launch in 3 of resnet18-imagefolder with 2
    worker processes on 2 cores). The import takes a few seconds once; later forks find it done."""
    for thread in threading.enumerate():
        if thread.name == _PLOT_IMPORT and thread is not threading.current_thread():
            thread.join(PLOT_IMPORT_JOIN_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_finish_plot_import_before_fork)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _make_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("epoch {task.fields[epoch]}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, transient=True,
    )


def _tensorboard_writer(run_dir: Path):
    from fastvision.errors import ConfigError

    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'fastvision[tensorboard]' "
                          "(or pip install tensorboard)") from e
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))
