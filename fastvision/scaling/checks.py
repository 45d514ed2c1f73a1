"""Checks of the ``fastvision scale`` options, before any run or simulation: one line naming the option
(numbers in range, the world sizes, the backends)."""
from __future__ import annotations

from fastvision.errors import ConfigError, check_low

# option -> (attribute, lowest value, whether the lowest value itself is allowed)
_LIMITS = {
    "--epochs": ("epochs", 1, True), "--repeats": ("repeats", 1, True), "--batch": ("batch", 1, True),
    "--compute-ms": ("compute_ms", 0, False), "--grad-mb": ("grad_mb", 0, False),
    "--bucket-mb": ("bucket_mb", 0, False), "--overhead-ms": ("overhead_ms", 0, True),
    "--gpus-per-node": ("gpus_per_node", 1, True), "--input-rate": ("input_rate", 0, False),
    "--input-workers": ("input_workers", 1, True), "--gpus": ("gpus", 1, True), "--jitter-ms": ("jitter_ms", 0, True),
}


def check_args(args) -> None:
    """Refuse a ``scale`` command that would do nothing, and every numeric option out of its range.

    Raises:
        ConfigError: naming the option and its valid range.
    """
    if not args.recipe and not args.simulate:
        raise ConfigError("scale: give a recipe to sweep, or --simulate (with --compute-ms and --grad-mb)")
    for flag, (attr, low, inclusive) in _LIMITS.items():
        check_low(flag, getattr(args, attr, None), low, inclusive)


def world_sizes(args) -> list[int]:
    """The ``--workers`` world sizes, checked (and ``--repeats`` with them)."""
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise ConfigError(f"--workers {args.workers!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if any(w < 1 for w in workers):
        raise ConfigError(f"--workers {args.workers!r}: world sizes must be >= 1")
    if len(set(workers)) != len(workers):  # the second would reuse the first's run and count as a repeat of it
        raise ConfigError(f"--workers {args.workers!r}: a world size given twice; use --repeats for more runs of one")
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats}: must be >= 1")
    return workers


def sweep_backends(args, workers: list[int]) -> list[str]:
    """The ``--backends`` of a sweep, checked with its world sizes before any run trains: each a known
    backend, horovod importable, the largest world size one this machine can start (before, the ddp runs
    trained first and the sweep then stopped at the first horovod run, or at ``--nproc`` 99)."""
    from fastvision.distributed import check_nproc
    from fastvision.distributed.comm import horovod

    backends = [b.strip() for b in args.backends.split(",")]
    unknown = [b for b in backends if b not in ("ddp", "horovod")]
    if unknown or not backends:
        raise ConfigError(f"--backends {args.backends!r}: unknown backend {unknown[0] if unknown else ''!r}; "
                          "valid: ddp, horovod")
    if "horovod" in backends:
        try:
            horovod()
        except ConfigError as e:
            raise ConfigError(str(e).replace("--backend horovod", "--backends horovod", 1)) from None
    check_nproc(max(workers), args.device, flag="--workers")
    return backends
