"""``python -m fastvision.distributed.torchrun ARGS``: torchrun (``torch.distributed.run``, its own
argument parser and elastic agent) whose failure ends as the workers' own would.

torchrun reports a failed worker with its ``ChildFailedError`` traceback and a table, and exits 1
whatever the worker's code was: 2 (a bad setting), 124 (the hang doctor's stop), 128 + N (a
signal). ``--nproc`` runs through this module instead, so the command's exit status is the first
failed worker's (a worker killed by a signal: 128 + the signal) and the failure is one line naming
the rank; what the workers printed themselves (their one-line errors) is unchanged. A stop signal
torchrun itself gets (SIGTERM, ``--nproc``'s launcher passing one on) goes to the workers, and once they
have stopped (their checkpoint written) the command exits 128 + the signal, as they did, without
torchrun's ``SignalException`` traceback.
"""
from __future__ import annotations

import logging
import sys


def exit_code(code: int) -> int:
    """A worker's exit code as a shell reports it: a signal (negative from Popen) as 128 + N."""
    return 128 - code if code < 0 else code


def _how(failure) -> str:
    """``exited with code C`` / ``was stopped by SIGKILL`` for torch's ``ProcessFailure``."""
    if failure.exitcode < 0:
        return f"was stopped by {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def _first(e) -> tuple:
    """The failure that stopped the job: torch's first (the earliest), except that a worker that exited 1
    (a rank whose collective broke because its peer had left: ``cli.entry``'s line) yields to one with a
    code of its own (2: a bad input on that rank's shard; a signal), which is the cause: the job exits 2."""
    rank, failure = e.get_first_failure()
    if failure.exitcode == 1:
        causes = [(f.timestamp, r, f) for r, f in e.failures.items() if f.exitcode != 1]
        if causes:
            _, rank, failure = min(causes, key=lambda c: (c[0], c[1]))
    return rank, failure


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the agent's own error lines ("failed (exitcode: 2) local_rank: 0 ...") repeat what the line below says
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = _first(e)
        others = [f"rank {r} {_how(f)}" for r, f in sorted(e.failures.items()) if r != rank]
        also = f" (then {', '.join(others)})" if others else ""
        print(f"fastvision: rank {rank} {_how(failure)} first{also}; the job stopped", file=sys.stderr, flush=True)
        return exit_code(failure.exitcode) or 1
    except SignalException as e:  # torchrun passed the signal on to its workers and waited for them: they
        return 128 + int(e.sigval)  # printed their stop (checkpoint written); end as they did, no traceback
    return 0


if __name__ == "__main__":
    sys.exit(main())
