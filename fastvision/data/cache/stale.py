"""The node-shared cache's folders that a killed job left in ``/dev/shm``: found by the job their name records
(:func:`fastvision.data.cache.select.job_name`) and removed when it has ended."""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

# a shared cache's folder named by job_name(): this user's id, then a single process's pid or torchrun's agent pid
_JOB_FOLDER = re.compile(r"fastvision-(\d+)-(?:p(\d+)|tr(\d+)-\d*)-[0-9a-f]{16}-\d+")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_shared(root: str | Path, min_age_s: float = 600.0) -> list[Path]:
    """Remove this user's shared-cache folders under ``root`` whose job has ended without its exit clean-up (a
    ``kill -9``, an OOM kill): the single process or torchrun agent its name records is gone and nothing in it
    changed for ``min_age_s``. SLURM jobs' folders, other users' and names of another form are left alone."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    removed = []
    for d in Path(root).glob("fastvision-*"):
        m = _JOB_FOLDER.fullmatch(d.name)
        if not m or int(m[1]) != uid or not d.is_dir():
            continue
        pid = int(m[2] or m[3])
        if pid in (os.getpid(), os.getppid()) or _alive(pid):
            continue
        try:
            newest = max((q.stat().st_mtime for q in d.iterdir()), default=d.stat().st_mtime)
        except FileNotFoundError:  # another process removed it meanwhile
            continue
        if time.time() - newest >= min_age_s:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        log.info("removed %d shared cache folder(s) of ended jobs from %s: %s", len(removed), root,
                 ", ".join(d.name for d in removed))
    return removed
