"""A process forked while the run logger's background import of matplotlib runs (``data.loader: processes``'
workers start right after the logger) must not inherit that import's locks: the worker that imported one of
those modules waited for ever and the run hung before its first step. Fresh interpreters (matplotlib not yet
imported), a real fork, no mock."""
from __future__ import annotations

import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from fastvision.engine.log import RunLogger

    logger = RunLogger(Path(sys.argv[1]), enabled=True, progress=False)  # starts the plot import thread
    pid = os.fork()  # at once, as the first batch of a process loader does
    if pid == 0:
        signal.alarm(20)  # a deadlocked import ends here, killed by SIGALRM
        import matplotlib.figure  # noqa: F401
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status))
    logger.close()
""")


def test_a_fork_while_the_plot_import_runs_does_not_deadlock_the_child(tmp_path):
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "0", r.stdout  # -14: the child hung in the import (SIGALRM)
