"""Numerics and speed switches: precision (autocast + GradScaler), TF32, seeding, compile.

Everything here is chosen once per run from the config and passed explicitly; nothing is stored
in module globals.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fastvision.config import AMP_MODES
from fastvision.errors import ConfigError, error_line

log = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_amp(mode: str, device: torch.device) -> tuple[str, str]:
    """The precision ``train.amp`` means on ``device``, and why.

    ``auto``: on CUDA, bf16 where the GPU computes it natively (compute capability 8.0+: A100,
    H100, RTX 30xx and newer), else fp16 with dynamic loss scaling (V100, T4: seed 004's AMP);
    on CPU and other devices fp32 ("off"). On a CPU that computes bf16 natively (AMX bf16 tiles: Xeon
    Sapphire Rapids and newer; AVX-512 BF16: AMD Zen 4 and newer, Xeon Cooper Lake) the reason names
    ``train.amp: bf16`` as the faster opt-in (oneDNN runs bf16 convolutions on those units:
    benchmarks/RESULTS.md, "bf16 on the CPU"); not the default: it changes the numerics of every CPU
    run, and its speed-up is measured on the 3-D U-Net only.
    Other modes are returned unchanged.
    """
    if mode != "auto":
        return mode, "as configured"
    if device.type != "cuda":
        unit = cpu_native_bf16() if device.type == "cpu" else None
        hint = f"; this CPU has {unit}: train.amp=bf16 is faster" if unit else ""
        return "off", f"{device.type}: fp32{hint}"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if major >= 8 and torch.cuda.is_bf16_supported():
        return "bf16", f"{name} (sm_{major}{minor}) computes bf16 natively"
    return "fp16", f"{name} (sm_{major}{minor}) has no native bf16: fp16 with dynamic loss scaling"


CPU_BF16_UNITS = (("_is_amx_tile_supported", "AMX bf16 tiles"), ("_is_avx512_bf16_supported", "AVX-512 BF16"))


def cpu_native_bf16() -> str | None:
    """The unit on which this CPU computes bf16 natively and PyTorch's oneDNN can use it (AMX tiles
    first, then AVX-512 BF16), by torch's own CPU probes; None where it has neither, where oneDNN is
    missing, or where a probe is missing (torch builds before it, non-x86 CPUs)."""
    if not torch.backends.mkldnn.is_available():
        return None
    for attr, unit in CPU_BF16_UNITS:
        probe = getattr(torch.cpu, attr, None)
        if probe is not None and probe():
            return unit
    return None


def autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype ``train.amp`` means on ``device`` (None: fp32), by :func:`resolve_amp`.

    The one amp -> dtype rule: :class:`Precision` (train, evaluate), prediction and ``plan``'s trace
    all ask it, so ``auto`` means the same everywhere.
    """
    return _DTYPES.get(resolve_amp(mode, device)[0])


STATIC_GROWTH_INTERVAL = 1_000_000_000  # DLE's static scale: a growth interval no run reaches


def loss_scaler(device_type: str, enabled: bool, loss_scale: float | str = "dynamic") -> torch.amp.GradScaler:
    """fp16's loss scaler for ``train.loss_scale``: ``"dynamic"``, torch's defaults (from 2^16, doubled after
    2000 finite steps, halved on an overflow), or a positive number, DLE PyTorch's ``--static-loss-scale``
    (``GradScaler(init_scale=N, growth_interval=10^9)``: it starts at N and never grows; a step whose
    gradients overflow is still skipped and halves it). Seed 004's AMP runs use 128, which keeps the
    first steps from overflowing while the dynamic scale comes down from 2^16."""
    if loss_scale == "dynamic":
        return torch.amp.GradScaler(device_type, enabled=enabled)
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float) or not 0 < loss_scale < float("inf"):
        raise ConfigError(f"train.loss_scale: expected dynamic or a positive number (e.g. 128), got {loss_scale!r}")
    return torch.amp.GradScaler(device_type, init_scale=float(loss_scale), growth_interval=STATIC_GROWTH_INTERVAL,
                                enabled=enabled)


@dataclass
class Precision:
    """Autocast context and loss scaler for one of ``off``, ``fp16``, ``bf16`` or ``auto``.

    fp16 uses a GradScaler (skips steps whose gradients overflow; dynamic, or static with
    ``train.loss_scale``: :func:`loss_scaler`); bf16 has the fp32
    exponent range and needs no scaler. bf16 autocast also works on CPU (fast on CPUs with AMX
    bf16 tiles or AVX-512 BF16; ``auto`` keeps fp32 there and says so). ``auto`` is resolved
    once here (:func:`resolve_amp`); ``mode`` is then the precision actually used (``requested``
    keeps what was asked) and is logged.
    """

    mode: str
    device: torch.device
    loss_scale: float | str = "dynamic"

    def __post_init__(self) -> None:
        if self.mode not in AMP_MODES:
            raise ConfigError(f"train.amp: expected off, fp16, bf16 or auto, got {self.mode!r}")
        self.requested = self.mode
        self.mode, why = resolve_amp(self.mode, self.device)
        if self.requested == "auto":
            log.info("precision: %s (train.amp=auto; %s)", self.mode, why)
        if self.mode == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.amp=fp16 needs a CUDA device; on a CPU pass --amp off (fp32) or --amp bf16")
        self.scaler = loss_scaler(self.device.type, self.mode == "fp16", self.loss_scale)

    @property
    def dtype(self) -> torch.dtype | None:
        return autocast_dtype(self.mode, self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mode == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.mode])


def set_tf32(enabled: bool) -> None:
    """TF32 tensor-core math for fp32 matmuls and convolutions (Ampere and newer)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def augment_seed(seed: int, rank: int, step: int = 0) -> int:
    """Seed of a rank's batched-augmentation generator: at the start of a run (``step`` 0), and when a
    checkpoint's per-rank streams cannot continue (another world size) at ``step``."""
    return seed * 1_000_003 + rank + 7_919 * step


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every RNG the training loop draws from, as tensors and plain types (weights_only-safe)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["augment"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "augment" in state:
        generator.set_state(state["augment"])


def prepare_model(model: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=_memory_format(model))
    return model


def _memory_format(model: nn.Module) -> torch.memory_format:
    from fastvision.models import spatial_dims

    return torch.channels_last_3d if spatial_dims(model) == 3 else torch.channels_last


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def maybe_compile(model: nn.Module, mode: bool | str) -> nn.Module:
    """``torch.compile`` (the seeds' XLA) for ``train.compile``: false, true (== default), auto, or a mode.

    ``reduce-overhead`` replays the step's kernels as CUDA graphs (for launch-bound small models);
    it needs static shapes (fixed crop sizes, ``drop_last`` loaders, no data-dependent shapes in
    the step); a new shape records a new graph. ``max-autotune`` also searches kernel configs (long
    first steps). ``auto`` compiles (default mode) and falls back to eager on an error or when the
    first compiled steps are slower (:class:`AutoCompile`).
    """
    if mode is False or mode in ("false", "off", "none"):
        return model
    if mode is True or mode in ("true", "on"):
        mode = "default"
    if mode != "auto" and mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile: expected false, true, auto or one of {', '.join(COMPILE_MODES)}, "
                          f"got {mode!r}")
    if not hasattr(torch, "compile"):
        raise ConfigError("train.compile needs torch >= 2.0")
    from fastvision.models.checkpointing import compile_conflict
    from fastvision.optim.torch_private import torch_version

    conflict = compile_conflict(model, torch_version())
    if conflict and mode == "auto":
        log.warning("train.compile auto: eager (%s)", conflict)
        return model
    if conflict:
        raise ConfigError(conflict)
    return AutoCompile(model) if mode == "auto" else torch.compile(model, mode=mode)


class AutoCompile(nn.Module):
    """``train.compile: auto``: the compiled model while it works and is faster, else the eager one.

    The first call runs compiled; an exception there (no C++ compiler, an unsupported op, out of
    memory while compiling) logs one line with the reason and the step goes on eagerly. Then
    ``trial`` calls run compiled and ``trial`` eagerly, each timed from its start to the next
    call's start (a whole step with one micro-batch per step); when the compiled median is slower,
    it falls back to eager for good. A compiled forward that raises later (a recompile for a new
    input shape) falls back too, with its line. ``choice`` is ``"trying"``, ``"compiled"`` or
    ``"eager"``, ``reason`` says why. A compile error raised only in the backward is not caught here.

    In a job of several ranks the decision is the job's: at the decision call every rank sums its
    failure flag and its two medians with the others' (a rank whose compile failed goes on eagerly
    and still counts its calls to that one), so all ranks compile or none do, by the mean timings.

    Args:
        model: the (DDP-wrapped) model, registered as ``_orig_mod`` (torch.compile's name), so
            ``parameters()``, ``distributed.unwrap`` and ``no_sync`` see it; the compiled view shares it.
        trial: timed calls of each kind.
        backend: ``torch.compile``'s backend (default Inductor).
    """

    def __init__(self, model: nn.Module, trial: int = 3, backend: Any = "inductor"):
        from fastvision import distributed

        super().__init__()
        self._orig_mod = model  # torch.compile's name: distributed.unwrap / no_sync and checkpoint keys see through it
        self.__dict__["compiled"] = torch.compile(model, backend=backend)  # not a submodule: no second parameter set
        self.trial, self.choice, self.reason = trial, "trying", ""
        self._calls, self._starts = 0, []
        self._pending = distributed.world_size() > 1  # the job's decision call is still to come

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.choice == "compiled":
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001  (a later compile: the run goes on eagerly)
                self._fall_back(f"a later compile failed: {error_line(e)[:200]}")
                return self._orig_mod(*args, **kwargs)
        if self.choice == "eager":
            if self._pending:  # this rank's compile failed: it still joins the job's decision
                self._calls += 1
                if self._calls == 2 + 2 * self.trial:
                    self._decide()
            return self._orig_mod(*args, **kwargs)
        self._calls += 1
        if self._calls > 1:  # call 1 compiles: its time is not a step's
            self._stamp(args)
        if self._calls == 2 + 2 * self.trial:
            self._decide()
            return self.forward(*args, **kwargs)
        if self._calls > 1 + self.trial:  # the eager half of the trial
            return self._orig_mod(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (any compile failure: the run goes on eagerly)
            self._fall_back(f"compile failed: {error_line(e)[:200]}")
            return self._orig_mod(*args, **kwargs)

    def _stamp(self, args: tuple) -> None:
        device = next((a.device for a in args if torch.is_tensor(a)), None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)  # deliberate, during the 2 x trial timed calls only
        self._starts.append(time.perf_counter())

    def _decide(self) -> None:
        failed = self.choice == "eager"
        compiled = eager = 0.0
        if not failed:
            steps = np.diff(self._starts)
            compiled, eager = float(np.median(steps[: self.trial])), float(np.median(steps[self.trial: 2 * self.trial]))
        if self._pending:  # every rank reaches this call: one sum decides for the job
            from fastvision import distributed

            self._pending = False
            device = next((p.device for p in self._orig_mod.parameters()), torch.device("cpu"))
            t = distributed.all_reduce_sum(torch.tensor([float(failed), compiled, eager, float(not failed)],
                                                        dtype=torch.float64, device=device)).tolist()
            if failed:
                return  # this rank said why when its compile failed
            if t[0] > 0:
                self._fall_back(f"the compile failed on {int(t[0])} of {distributed.world_size()} ranks")
                return
            compiled, eager = t[1] / t[3], t[2] / t[3]
        if compiled > eager:
            self._fall_back(f"compiled steps were slower ({compiled * 1e3:.1f} ms vs eager {eager * 1e3:.1f} ms)")
        else:
            self.choice, self.reason = "compiled", f"{compiled * 1e3:.1f} ms per step vs eager {eager * 1e3:.1f} ms"
            log.info("train.compile auto: compiled (%s)", self.reason)

    def _fall_back(self, reason: str) -> None:
        self.choice, self.reason = "eager", reason
        log.warning("train.compile auto: eager (%s)", reason)


def set_threads(n: int | None) -> None:
    """CPU intra-op threads (``train.cpu_threads``); None leaves torch's default (OMP_NUM_THREADS).

    Process-wide: whoever builds several runs in one process (``tune``) sets it before each one's steps.
    """
    if n is not None:
        if n < 1:
            raise ConfigError(f"train.cpu_threads must be >= 1, got {n}")
        torch.set_num_threads(n)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
HEAP_KEEP_TRIM = 1 << 30  # freed memory at the heap's top handed back only beyond this


def set_heap(mode: str) -> bool:
    """``train.cpu_heap``: ``keep`` asks glibc's malloc to serve every tensor from its heap (no ``mmap`` of
    its own, ``M_MMAP_MAX`` 0) and to keep up to 1 GB of freed memory for the next ones (``M_TRIM_THRESHOLD``);
    ``system`` leaves the C library's defaults.

    Why: by default a tensor of 128 KB or more gets its own ``mmap`` (the threshold adapts, up to 32 MB, and
    the heap is trimmed as soon as its free top passes twice that), so each new 3-D patch, augmentation copy
    or activation faults in fresh zeroed pages: about 950 page faults per 64^3 two-channel patch in nnU-Net's
    augmentation and 19,000 per step of a 64^3 3-D U-Net, against 12 and 200 kept
    (``benchmarks/cpu_heap.py``). This is what the jemalloc / tcmalloc ``LD_PRELOAD`` of PyTorch's CPU
    performance guides buys, without a preload. The cost: the process keeps its peak heap until it exits
    (its RSS does not shrink after a peak). Process-wide, like the thread count, and inherited by forked loader
    workers; setting it again is harmless, and ``system`` after ``keep`` in the same process does not undo
    it. A thread's arena that cannot hold a large block hands it to the main heap, which grows as needed.
    Returns whether the parameters are set (False: ``system``, or not glibc: macOS, musl and Windows keep
    their allocator)."""
    if mode not in ("keep", "system"):
        raise ConfigError(f"train.cpu_heap must be keep or system, got {mode!r}")
    if mode == "system" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, HEAP_KEEP_TRIM) == 1
    if not ok:
        log.debug("train.cpu_heap keep: mallopt refused the parameters; the C library's defaults stay")
    return ok
