"""What only a GPU can show: training converges, AMP numerics, NCCL, the GPU cache's crops, fp16 skips.

Skipped without CUDA (see conftest.py). Run on a GPU machine with `pytest -m gpu` (or through
`python benchmarks/gpu_suite.py`, whose last row is these tests). Every model is built by
:func:`fastvision.engine.build` and trained by :func:`fastvision.engine.train_step`, the step
``fastvision train`` runs, on the task's synthetic batch (fixed, already on the device).
"""
from __future__ import annotations

import itertools
import os
import socket

import pytest
import torch

from fastvision import engine
from fastvision.benchmark.modes import setting_config
from fastvision.config import load

pytestmark = pytest.mark.gpu

# One small recipe per task, at sizes that train in seconds on a GPU.
TASKS = {
    "segmentation": ("unet2d-microscopy", {"task": {"args": {"sample_shape": [1, 64, 64]}}}),
    "classification": ("resnet18-imagefolder", {}),
    "detection": ("ssd320-small-shapes", {}),
}
DEVICE = "cuda"  # a module constant so that the API use can be dry-run on a CPU (the tests run on CUDA only)


def _run(task: str, precision: str = "fp32", batch_size: int = 8, adam: bool = True) -> engine.Run:
    """The task's recipe built for training on cuda:0 without a dataset (as the benchmark does).

    ``adam``: Adam 1e-3 at a constant rate instead of the recipe's schedule, so that a few dozen
    steps on one batch make the loss fall whatever the recipe's warm-up.
    """
    recipe, overrides = TASKS[task]
    cfg = setting_config(load(recipe, [overrides] if overrides else []), batch_size, precision, device=DEVICE)
    cfg.train.tf32 = False  # fp32 reference means fp32
    if adam:
        cfg.optim.name, cfg.optim.lr, cfg.optim.ref_batch, cfg.optim.weight_decay = "adam", 1e-3, None, 0.0
        cfg.sched.name, cfg.sched.warmup_epochs = "constant", 0.0
    return engine.build(cfg, data_info={}, train=True)


def _batch(run: engine.Run, batch_size: int = 8, seed: int = 0):
    torch.manual_seed(seed)  # the synthetic batch draws from the global generator: a fixed batch
    task = run.task
    return task.to_device(task.synthetic_batch(batch_size, run.device), run.device, run.cfg.train.channels_last)


def _loss(step) -> float:
    return float(step.loss)


@pytest.mark.parametrize("task", list(TASKS))
def test_loss_decreases_over_steps_on_a_fixed_batch(task):
    run = _run(task)
    batch = _batch(run)
    if task == "segmentation":  # a label the net can learn from its input (random labels need memorizing)
        batch["label"] = (batch["image"][:, 0] > 0).long()
    batches = itertools.repeat(batch)
    losses = [_loss(engine.train_step(run.step, batches)) for _ in range(40)]
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = losses[0], sum(losses[-5:]) / 5
    assert last < 0.8 * first, f"{task}: loss {first:.4f} -> {last:.4f} over 40 steps on one batch"


GRAD_SCALE = 2.0**12


def _loss_and_grads(run: engine.Run, batch, autocast: bool) -> tuple[float, torch.Tensor]:
    model, task = run.model, run.task
    model.train()
    model.zero_grad(set_to_none=True)
    ctx = run.precision.autocast() if autocast else torch.autocast(run.device.type, enabled=False)
    with ctx:
        loss = task.loss(task.forward(model, batch), batch)
    # scaled as GradScaler scales it (else fp16's small gradients fall into subnormals), then unscaled
    (loss.float() * GRAD_SCALE).backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]) / GRAD_SCALE
    return float(loss.detach()), grads


# Tolerances: bf16 keeps 8 mantissa bits (relative rounding 2^-9), fp16 11 bits (2^-12, 8x finer).
# Through the U-Net's layers the gradient error adds up: bf16 autocast on a CPU gives a loss within
# 0.01 % and a gradient 22 % off in norm at a cosine of 0.976 to fp32's on this batch (2026-11-23).
# Bounds: loss within 1 % / 0.5 %, gradient error norm within 35 % / 8 % of fp32's gradient norm,
# cosine at least 0.95 / 0.995 (bf16 / fp16).
AMP_TOL = {"bf16": (1e-2, 0.35, 0.95), "fp16": (5e-3, 0.08, 0.995)}


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_loss_and_gradients_close_to_fp32_on_a_fixed_batch(amp):
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    ref = _run("segmentation", "fp32")  # same seed: the same initial weights in both builds
    low = _run("segmentation", amp)
    for a, b in zip(ref.model.state_dict().values(), low.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    batch = _batch(ref)
    loss32, g32 = _loss_and_grads(ref, batch, autocast=False)
    loss16, g16 = _loss_and_grads(low, batch, autocast=True)
    loss_tol, norm_tol, min_cos = AMP_TOL[amp]
    assert abs(loss16 - loss32) <= loss_tol * abs(loss32), (loss16, loss32)
    assert (g16 - g32).norm() <= norm_tol * g32.norm()
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) >= min_cos


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dist_init_world_of_one_on_cuda(monkeypatch):
    """torchrun's variables for a world of one: distributed.init picks cuda:0, its collectives are the
    identity, barrier and shutdown work (no process group is needed for one rank)."""
    from fastvision import distributed

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    env, device = distributed.init("auto")
    try:
        assert (env.world_size, env.rank, device.type) == (1, 0, DEVICE)
        t = torch.arange(4.0, device=device)
        assert torch.equal(distributed.all_reduce_sum(t.clone()), t)
        distributed.barrier()
    finally:
        distributed.shutdown()


def _nccl_worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch.distributed as tdist

    from fastvision import distributed

    env, device = distributed.init("auto")
    try:
        t = torch.full((3,), float(rank + 1), device=device)
        out = distributed.all_reduce_sum(t)
        distributed.barrier()
        queue.put((rank, tdist.get_backend(), str(device), out.tolist()))
    finally:
        distributed.shutdown()


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank (2 GPUs)")
def test_nccl_through_fastvision_dist_init_two_ranks():
    """Two ranks through distributed.init: NCCL process group, all-reduce sums, barrier, shutdown."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_nccl_worker, args=(2, _free_port(), queue), nprocs=2, join=True)
    got = sorted(queue.get() for _ in range(2))
    assert got == [(0, "nccl", "cuda:0", [3.0, 3.0, 3.0]), (1, "nccl", "cuda:1", [3.0, 3.0, 3.0])]


def _volume_dataset(cases: int = 4):
    """Decathlon volumes (the spleen recipe's classes) of generated CT, preprocessed in memory."""
    import numpy as np

    from fastvision.data.formats.decathlon import VolumeDataset
    from fastvision.data.preprocess3d import PreprocessParams, window
    from fastvision.data.synth.medical import spleen_volume

    def compute(paths, params):
        index = int(paths["image"][0].split(":")[1])
        hu, label = spleen_volume(np.random.default_rng(index), (48, 40, 32), np.array([1.5, 1.5, 2.0]))
        return {"image": window(torch.from_numpy(hu.astype(np.float32))[None], *params.window),
                "label": torch.from_numpy(label), "meta": {}}

    items = [{"id": f"c{i}", "image": [f"gen:{i}"], "label": None} for i in range(cases)]
    return VolumeDataset(items, PreprocessParams(intensity="ct"), patch_size=(24, 24, 16), pos_fraction=0.5,
                         compute=compute)


def test_gpu_cache_and_device_crop_give_the_cpu_paths_items():
    """Same (seed, epoch, index): the crop drawn on the GPU from the GPU cache equals the CPU path's."""
    from fastvision.data.cache.select import wrap_train_set

    ds = _volume_dataset()
    cpu = wrap_train_set(ds, cache="none", device="cpu", seed=7)
    gpu = wrap_train_set(ds, cache="gpu", device=DEVICE, seed=7)
    assert gpu.num_cached == len(ds)
    for epoch in (0, 3):
        cpu.set_epoch(epoch)
        gpu.set_epoch(epoch)
        for i in range(len(ds)):  # the cache is indexed as the dataset (the sampler alone orders)
            a, b = cpu[i], gpu[i]
            assert b["image"].device.type == DEVICE
            assert a["image"].shape == (1, 24, 24, 16)
            assert torch.equal(a["image"], b["image"].cpu()) and torch.equal(a["label"], b["label"].cpu())
    # and the draws do move with the epoch (the comparison above is not between constant crops)
    cpu.set_epoch(0)
    first = [cpu[i]["image"] for i in range(len(ds))]
    cpu.set_epoch(1)
    assert any(not torch.equal(f, cpu[i]["image"]) for i, f in enumerate(first))


def test_fp16_overflow_skips_the_update():
    """Infinite gradients under fp16: the step changes no weight and the loss scale backs off."""
    run = _run("segmentation", "fp16", adam=False)  # the recipe's optimizer: momentum, weight decay
    batch = _batch(run)
    batches = itertools.repeat(batch)
    for _ in range(3):  # normal steps first: optimizer state exists, the loss scale has settled
        engine.train_step(run.step, batches)
    before = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    scale = run.precision.scaler.get_scale()
    param = next(p for p in run.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        engine.train_step(run.step, batches)
    finally:
        hook.remove()
    after = run.model.state_dict()
    for k, v in before.items():
        if v.is_floating_point() and "running_" not in k and "num_batches" not in k:  # BN stats move in forward
            assert torch.equal(v, after[k]), f"{k} changed in a step with infinite gradients"
    assert run.precision.scaler.get_scale() < scale
    for _ in range(5):  # and training goes on: a following step updates the weights (the dynamic
        engine.train_step(run.step, batches)  # scale may need a few halvings first)
        if any(not torch.equal(before[k], p) for k, p in run.model.named_parameters()):
            break
    else:
        pytest.fail("no weight changed in 5 steps after the overflow")


def test_monitor_matches_the_cuda_device_by_uuid():
    """NVML counts GPUs in PCI order, CUDA after CUDA_VISIBLE_DEVICES: the handle must be the same GPU."""
    pynvml = pytest.importorskip("pynvml")
    from fastvision.profiling.monitor import nvml_handle

    for index in range(torch.cuda.device_count()):
        handle = nvml_handle(index)
        got = pynvml.nvmlDeviceGetUUID(handle)
        got = got.decode() if isinstance(got, bytes) else got
        assert got == f"GPU-{torch.cuda.get_device_properties(index).uuid}"
