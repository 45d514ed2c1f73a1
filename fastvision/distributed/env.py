"""Launch-environment detection: where this process sits in a torchrun, srun or single-process job.

Pure functions of the environment variables (no process group, no torch collectives), so they are
tested from tables of environments. :mod:`fastvision.distributed` re-exports everything public here.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fastvision.errors import ConfigError

DEFAULT_PORT = 29500
# Port derived from a SLURM job id lands in [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN):
# above the common service ports and below the Linux ephemeral range (32768+), so two jobs sharing a
# node rarely collide and an outgoing connection never holds the port.
SLURM_PORT_BASE = 12000
SLURM_PORT_SPAN = 20000
# Slurm's id for the batch-script step (SLURM_BATCH_SCRIPT): not a task launched by srun.
_SLURM_BATCH_STEP = "4294967294"

@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank in ``[0, world_size)``.
        local_rank: rank among the processes on this node (selects the GPU).
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        launcher: ``"single"``, ``"torchrun"`` or ``"slurm"``.
        master_addr: host of rank 0 (rendezvous address).
        master_port: TCP port of the rendezvous store.
        restart: how often torchrun restarted this job's workers (``TORCHELASTIC_RESTART_COUNT``).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "single"
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    restart: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# --------------------------------------------------------------------------- environment


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    """``environ[key]`` as an integer; ``default`` when it is not set (None: required)."""
    if key not in environ and default is not None:
        return default
    try:
        return int(environ[key])
    except ValueError:
        raise ConfigError(f"environment variable {key}={environ[key]!r} is not an integer") from None


def _job_id(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")


def requeue_job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The SLURM job ``scontrol requeue`` takes: an array task's own ``<array id>_<task id>``."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else _job_id(environ)


def job_key(environ: Mapping[str, str] = os.environ) -> str:
    """A name the local ranks of one job share and other jobs do not (e.g. a /dev/shm folder).

    ``slurm<job id>.<step id>`` under SLURM; ``tr<agent pid>-<master port>`` under torchrun (its
    agent is the parent of every local rank); ``p<pid>`` for a single process.
    """
    job = _job_id(environ)
    if job:
        return f"slurm{job}.{environ.get('SLURM_STEP_ID', '0')}"
    if environ.get("TORCHELASTIC_RUN_ID") or environ.get("LOCAL_WORLD_SIZE"):
        return f"tr{os.getppid()}-{environ.get('MASTER_PORT', '')}"
    return f"p{os.getpid()}"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``"node[01-03,07],gpu5"`` into host names.

    Zero padding of range bounds is kept (``[08-10]`` -> ``08, 09, 10``); several bracket groups in
    one name expand to their product (``r[1-2]n[1-2]`` -> ``r1n1, r1n2, r2n1, r2n2``).
    """
    hosts: list[str] = []
    if nodelist.count("[") != nodelist.count("]") or re.search(r"\[[^\]]*\[", nodelist):
        raise ConfigError(f"cannot parse SLURM node list {nodelist!r} (unbalanced brackets)")
    for item in _split_top_level(nodelist.strip()):
        expanded = [""]
        for literal, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if not literal and not group:
                continue
            parts = [literal]
            if group:
                parts = [literal + n for n in _expand_range_group(group, nodelist)]
            expanded = [prefix + p for prefix in expanded for p in parts]
        hosts.extend(h for h in expanded if h)
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_range_group(group: str, nodelist: str) -> list[str]:
    out = []
    for part in group.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ConfigError(f"cannot parse SLURM node list {nodelist!r} (range {part!r})")
        if not hi:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from a SLURM spec such as ``"2(x3),1"``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"cannot parse SLURM tasks-per-node {tasks_per_node!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


def _slurm_port(environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" in environ:
        return _int(environ, "MASTER_PORT")
    job = _job_id(environ) or "0"
    digits = re.sub(r"\D", "", job) or "0"
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN


def _torchrun_env(environ: Mapping[str, str]) -> DistEnv:
    world = _int(environ, "WORLD_SIZE")
    env = DistEnv(rank=_int(environ, "RANK"), local_rank=_int(environ, "LOCAL_RANK", 0), world_size=world,
                  local_world_size=_int(environ, "LOCAL_WORLD_SIZE", world), launcher="torchrun",
                  master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                  master_port=_int(environ, "MASTER_PORT", DEFAULT_PORT),
                  restart=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0))
    _check(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if world > 1 and not environ.get(k)]
    if missing and _srun_task(environ) and (_int(environ, "SLURM_PROCID"), _srun_world(environ)) == (env.rank, world):
        # RANK / WORLD_SIZE copied from srun's variables (seed 001's setup_dist_env.sh): srun's rendezvous
        return _srun_env(environ)
    if missing:  # torchrun sets both; a hand-made environment without them was torch's traceback (env://)
        raise ConfigError(f"RANK={env.rank} WORLD_SIZE={world} set but not {' or '.join(missing)}: set "
                          "MASTER_ADDR (rank 0's host) and MASTER_PORT (a free port on it) on every rank, or "
                          "launch with torchrun")
    return env


def _check(env: DistEnv, rank: str, world: str, local_rank: str, local_world: str) -> None:
    """One line naming the variables where the ranks do not fit the world (a rank at or past the world size
    waited for ever for a peer that does not exist)."""
    if env.world_size < 1:
        raise ConfigError(f"environment variable {world}={env.world_size}: must be >= 1")
    if not 0 <= env.rank < env.world_size:
        raise ConfigError(f"environment variable {rank}={env.rank} is outside [0, {world}={env.world_size})")
    if not 1 <= env.local_world_size <= env.world_size:
        raise ConfigError(f"environment variable {local_world}={env.local_world_size} is outside "
                          f"[1, {world}={env.world_size}]")
    if not 0 <= env.local_rank < env.local_world_size:
        raise ConfigError(f"environment variable {local_rank}={env.local_rank} is outside "
                          f"[0, {local_world}={env.local_world_size})")
    if not 0 < env.master_port < 65536:
        raise ConfigError(f"environment variable MASTER_PORT={env.master_port}: must be a port in [1, 65535]")


def _srun_task(environ: Mapping[str, str]) -> bool:
    """This process is a task of an ``srun`` job step (not the batch script's shell)."""
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    return _job_id(environ) is not None and "SLURM_PROCID" in environ and step not in (None, _SLURM_BATCH_STEP)


def _srun_world_key(environ: Mapping[str, str]) -> str:
    return "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"


def _srun_world(environ: Mapping[str, str]) -> int:
    return _int(environ, _srun_world_key(environ), 1)


def _srun_env(environ: Mapping[str, str]) -> DistEnv:
    """A task started by ``srun``: rank, node and rendezvous from the SLURM step variables."""
    world_key = _srun_world_key(environ)
    world = _int(environ, world_key, 1)
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    hosts = expand_nodelist(nodelist) if nodelist else ["127.0.0.1"]
    if not hosts:
        raise ConfigError(f"SLURM node list {nodelist!r} names no host")
    master = environ.get("MASTER_ADDR") or hosts[0]
    env = DistEnv(
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        world_size=world,
        local_world_size=_tasks_on_node(per_node, _int(environ, "SLURM_NODEID", 0)) if per_node else world,
        launcher="slurm",
        master_addr=master,
        master_port=_slurm_port(environ),
    )
    _check(env, "SLURM_PROCID", world_key, "SLURM_LOCALID", "SLURM_TASKS_PER_NODE")
    return env


def detect_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read the launch environment.

    Precedence: torchrun variables (``RANK``/``WORLD_SIZE``, also set by ``torchrun`` inside a SLURM
    job), then a task started by ``srun``, then a single process.

    Args:
        environ: the environment to read (a plain dict in tests).

    Returns:
        The process's place in the job.

    Raises:
        ConfigError: a multi-task SLURM allocation entered without ``srun`` (every task would think
            it is alone and train on the whole data set), or malformed variables.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _torchrun_env(environ)
    half = [k for k, alone in (("RANK", "0"), ("WORLD_SIZE", "1")) if environ.get(k, alone) != alone]
    if half:  # one of the pair: the process trained alone on the whole data set, saying nothing
        other = "WORLD_SIZE" if half[0] == "RANK" else "RANK"
        raise ConfigError(f"environment variable {half[0]}={environ[half[0]]} is set but {other} is not: set both "
                          "(and MASTER_ADDR, MASTER_PORT), or launch with torchrun")
    job_id = _job_id(environ)
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    under_srun = "SLURM_PROCID" in environ and step is not None and step != _SLURM_BATCH_STEP
    if job_id is not None and under_srun:
        return _srun_env(environ)
    if job_id is not None:
        ntasks = _int(environ, "SLURM_NTASKS", 1)
        if ntasks > 1:
            raise ConfigError(
                f"SLURM job {job_id} has {ntasks} tasks (SLURM_NTASKS) but this process was not started by "
                "srun (no SLURM_PROCID/SLURM_STEP_ID): launch with `srun fastvision train ...` "
                "(see scripts/slurm/train.sbatch), with torchrun, or on this node with --nproc N"
            )
    elif under_srun and _int(environ, "SLURM_NTASKS", 1) > 1:  # srun always sets the job id: a hand-made half
        raise ConfigError(f"SLURM_PROCID={environ['SLURM_PROCID']} and SLURM_NTASKS={environ['SLURM_NTASKS']} set "
                          "without SLURM_JOB_ID: this process would train alone on the whole data set; launch with "
                          "srun, or set torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    return DistEnv()


def outer_launcher(nproc: int, environ: Mapping[str, str] = os.environ) -> str:
    """The launcher a command with ``--nproc nproc`` runs under (:func:`detect_env`'s). With ``nproc`` > 1 the
    shell of a multi-task SLURM allocation (``salloc -n 4``, the batch script) is ``"single"``: ``--nproc``
    starts the tasks itself, through torchrun, so none trains alone (without it the command is refused there)."""
    try:
        return detect_env(environ).launcher
    except ConfigError:
        if nproc > 1 and _job_id(environ) is not None and not _srun_task(environ) and "RANK" not in environ:
            return "single"
        raise
