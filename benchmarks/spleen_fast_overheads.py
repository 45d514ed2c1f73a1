"""Where the wall time of the spleen benchmark's fast row goes: wall timers around ``fit``'s parts.

Runs the ``unet3d-spleen-fast`` row of ``spleen_fast_vs_baseline.py`` alone (same generated data and
options) with wall-clock timers wrapped around the module-level functions ``fit`` calls (build,
training epochs, validation, checkpoint snapshot/wait, logging, the end-of-run plot and summary),
replaced in ``fastvision.engine.loop``, where ``fit`` looks them up.
No profiler: the timers add microseconds per call. Threads (checkpoint writer, plot import) are not
timed themselves; they show as waits (``BackgroundWriter.join``) or as contention in other rows.

Usage: ``python benchmarks/spleen_fast_overheads.py [--out DIR]``; prints a Markdown table.
"""
from __future__ import annotations

import argparse
import collections
import functools
import shutil
import tempfile
import time
from pathlib import Path

from spleen_fast_vs_baseline import fastvision_run  # noqa: E402  (benchmarks/ is the script's folder)

import fastvision
from fastvision import config
from fastvision.data.synth.medical import synth_spleen
from fastvision.engine import checkpoint, log, loop

SECONDS: dict[str, float] = collections.defaultdict(float)


def _time(owner, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``SECONDS[label]``."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - t

    setattr(owner, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="working folder (default: a temp folder)")
    p.add_argument("--max-epochs", type=int, default=150)
    a = p.parse_args()
    import torch._dynamo  # noqa: F401  (as the benchmark: imported before any clock)

    torch.set_num_threads(1)
    out = a.out or Path(tempfile.mkdtemp(prefix="spleen-overheads-"))
    shutil.rmtree(out / "unet3d-spleen-fast", ignore_errors=True)
    data = synth_spleen(out / "Task09", seed=0, cases=10, test_cases=0, size=32, zoom=2.0)
    args = argparse.Namespace(target=0.8, max_epochs=a.max_epochs, spacing=[3.0, 3.0, 3.0], patch=[32, 32, 16],
                              seed=0)
    for owner, name, label in [
            (loop, "train_one_epoch", "training epochs (train_one_epoch)"),
            (loop, "evaluate", "validation (evaluate)"),
            (log.RunLogger, "plot_curves", "curves.png (plot_curves)"),
            (checkpoint.BackgroundWriter, "write", "checkpoints in the loop (wait for previous + snapshot)"),
            (checkpoint.BackgroundWriter, "join", "checkpoint waits (join; includes the waits inside the row above)"),
            (loop, "build", "build (model, loaders, cache fill)"),
            (log.RunLogger, "epoch_end", "per-epoch logging (epoch_end)"),
            (config, "load", "config load"),
            (log.RunLogger, "summary", "run summary")]:
        _time(owner, name, label)
    r = fastvision_run("unet3d-spleen-fast", data, out, args, [8, 16, 32, 64, 128], 4)
    print(f"\nfastvision {fastvision.__file__}, reached {r['reached']} at epoch {r['epochs']}\n")
    print("| part | seconds |\n|---|---|")
    for label, s in SECONDS.items():
        print(f"| {label} | {s:.2f} |")
    print(f"| wall (fastvision.train) | {r['wall_s']:.2f} |\n| wall - training | {r['wall_s'] - r['train_s']:.2f} |")


if __name__ == "__main__":
    main()
