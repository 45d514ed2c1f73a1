"""Host CPU time of this process and its children, and waiting until they are idle.

:func:`tree_cpu_seconds` adds this process's user + system time (``time.process_time``: all its
threads, loader threads, DALI's threads, the main thread), the time of children already reaped
(``os.times``) and, on Linux,
the time of live children from ``/proc/PID/stat`` (multiprocessing children: a ``DataLoader``'s
worker processes). A child reaped between two readings is counted once: its live value leaves the
sum as its total enters the reaped one.

:func:`wait_idle` waits until that sum stops growing and no thread or child of the tree is runnable,
i.e. every background producer (loader threads and processes that run ahead of their consumer) has
filled its queue and blocked (not merely waiting for a core on a loaded machine).
"""
from __future__ import annotations

import multiprocessing
import os
import platform
import threading
import time

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


def _live_child_seconds(pid: int) -> float | None:
    """User + system seconds of live process ``pid`` from ``/proc`` (None where there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15 of proc(5))


def tree_cpu_seconds() -> tuple[float, bool]:
    """``(CPU seconds, complete)`` of this process, its reaped children and its live ones.

    ``complete`` is False when a live child's time could not be read (no ``/proc``: not Linux); the
    sum then holds this process and its reaped children only.
    """
    live, complete = 0.0, True
    for child in multiprocessing.active_children():  # also reaps the finished ones into os.times
        s = _live_child_seconds(child.pid) if child.pid else None
        if s is None:
            complete = False
        else:
            live += s
    t = os.times()  # children in clock ticks; this process from the finer per-process clock
    return time.process_time() + t.children_user + t.children_system + live, complete


def _state(path: str) -> str | None:
    """The scheduler state letter of a ``/proc/.../stat`` file (``R``: running or waiting for a core)."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split(maxsplit=1)[0]


def _runnable() -> bool:
    """Whether a live child process or another thread of this process is running or waiting for a core
    (Linux ``/proc``; False elsewhere). On a loaded machine a producer waiting for a core uses no CPU
    time, so the CPU clock alone would read it as idle."""
    me = threading.get_native_id()
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task") if int(t) != me]
    except OSError:
        return False
    paths = [f"/proc/self/task/{t}/stat" for t in threads]
    paths += [f"/proc/{c.pid}/stat" for c in multiprocessing.active_children() if c.pid]
    return any(_state(p) == "R" for p in paths)


def wait_idle(*, interval: float = 0.05, busy_share: float = 0.1, calm: int = 2, timeout: float = 30.0) -> bool:
    """Wait until this process tree uses under ``busy_share`` of one core for ``calm`` intervals in a row,
    with no child process or other thread of it running or runnable (Linux) at their ends.

    Returns False when ``timeout`` seconds pass first (something keeps a core busy: the caller says so).
    """
    end = time.monotonic() + timeout
    quiet, (last, _) = 0, tree_cpu_seconds()
    while time.monotonic() < end:
        time.sleep(interval)
        now, _ = tree_cpu_seconds()
        quiet = quiet + 1 if now - last < busy_share * interval and not _runnable() else 0
        last = now
        if quiet >= calm:
            return True
    return False


def process_cores() -> frozenset[int]:
    """The CPUs this process may run on (its affinity: what a cpuset, ``taskset`` or SLURM grants; all of
    ``os.cpu_count()`` where there is none)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return frozenset(range(os.cpu_count() or 1))


def host_cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s model name; else what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
