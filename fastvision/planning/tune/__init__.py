"""``fastvision tune RECIPE``: from the profiler's verdict to the fastest configuration, measured on
the real step.

It profiles the start (recipe + ``--set``) with the engine's own build and ``train_step`` (data
pipeline included), orders the speed switches by the verdict (:mod:`~fastvision.planning.tune.switches`),
times each candidate against the incumbent in interleaved rounds and keeps it only when it is
faster by more than the rounds' spread and its probe losses match (:mod:`~fastvision.planning.tune.search`,
:mod:`~fastvision.planning.tune.trial`), within ``--budget`` (:mod:`~fastvision.planning.tune.run`).
Under ``--nproc`` / torchrun every rank runs the same trials and rank 0 decides for all. Writes
``tuned.yaml`` (``extends:`` the recipe), a bar chart beside it and optionally the trials as JSON
(:mod:`~fastvision.planning.tune.report`); a second call with the same recipe, overrides, hardware
and data reuses the stored result (:mod:`~fastvision.planning.tune.cli`; ``--fresh`` re-measures).
"""
from fastvision.planning.tune.cli import add_cli
from fastvision.planning.tune.run import run_tune

__all__ = ["add_cli", "run_tune"]
