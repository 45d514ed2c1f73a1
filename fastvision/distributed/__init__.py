"""Distributed data parallelism: the one place that reads the launch environment.

One process, ``torchrun`` (one node or many) and ``srun`` under SLURM share one code path:
:func:`detect_env` turns the environment into a :class:`DistEnv`, :func:`init` starts the process
group (NCCL on CUDA, gloo on CPU) only when there is more than one process, and everything else
(reductions, the DDP wrap, samplers) degrades to a no-op or an identity in a single process, so
the engine never branches on the world size. With ``backend="horovod"`` the same functions go
through ``horovod.torch`` instead (:func:`wrap_optimizer`, :func:`broadcast_state`,
:func:`synchronized` are the horovod-only steps, identities under DDP). Environment parsing lives in
:mod:`fastvision.distributed.env`, the samplers in :mod:`fastvision.distributed.samplers`; both are re-exported here.

Samplers follow two different rules on purpose:

* :class:`TrainSampler` gives every rank the same number of indices (wrap-around padding), because
  DDP needs every rank to run the same number of steps. Rank ``r`` takes every ``world``-th index of
  a permutation fixed by ``(seed, epoch)``, so the union of the ranks' ``k``-th batches is exactly
  the ``k``-th batch of a one-process run with the same global batch.
* :class:`EvalSampler` gives contiguous, uneven shards with no duplicates, so metric sums reduced
  across ranks are exactly the whole-set sums. Evaluate with :func:`unwrap` (the bare module), never
  the DDP wrapper, because ranks run different numbers of validation steps.
"""
from fastvision.distributed.comm import (
                                  all_reduce_sum,
                                  barrier,
                                  broadcast_object,
                                  exit_process,
                                  gather_objects,
                                  horovod,
                                  init,
                                  is_main,
                                  joined,
                                  shutdown,
)
from fastvision.distributed.env import DistEnv, detect_env, expand_nodelist, job_key, outer_launcher
from fastvision.distributed.group import alone, rank, world_size
from fastvision.distributed.launch import (
    check_nproc,
    horovodrun_command,
    launch_local,
    relaunch_argv,
    strip_option,
)
from fastvision.distributed.samplers import EvalSampler, TrainSampler
from fastvision.distributed.wrap import (
                                  broadcast_buffers,
                                  broadcast_state,
                                  no_sync,
                                  synchronized,
                                  unwrap,
                                  wrap_model,
                                  wrap_optimizer,
)

__all__ = ["DistEnv", "EvalSampler", "TrainSampler", "all_reduce_sum", "alone", "barrier", "broadcast_object",
           "broadcast_buffers", "broadcast_state", "check_nproc",
           "detect_env", "exit_process", "expand_nodelist", "gather_objects", "horovod", "horovodrun_command", "init",
           "is_main", "job_key", "joined", "launch_local", "no_sync", "outer_launcher", "rank", "relaunch_argv",
           "shutdown", "strip_option",
           "synchronized", "unwrap", "world_size", "wrap_model", "wrap_optimizer"]
