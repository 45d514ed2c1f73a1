"""GPU specification table for planning: memory, peak dense TFLOP/s by precision, memory bandwidth.

Figures are the vendors' published spec-sheet numbers for *dense* math (sparsity doubles the
tensor-core figures on Ampere and newer; those are not used). Memory is what ``nvidia-smi`` /
``torch.cuda.get_device_properties().total_memory`` reports for the board, in GiB, which is a
little less than the marketed GB for some boards. ``None`` means the precision has no hardware
path on that GPU (V100 and T4 have no TF32 or bf16 tensor cores).

Sources (spec sheets): NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe columns), NVIDIA H200
datasheet, NVIDIA A100 datasheet (40 GB and 80 GB SXM4, 80 GB PCIe), NVIDIA L40S datasheet, NVIDIA V100
datasheet (SXM2), NVIDIA T4 datasheet; cross-checked against /work/shared/reference/perf_anchors.md
section 7 (A100 312/156 TFLOP/s, 1.555/2.039 TB/s; H100 SXM 989.4/494.7, 3.35 TB/s; H200 4.8 TB/s).
Blackwell: NVIDIA's GB200 NVL72 / HGX B200 specification table (per GPU, with sparsity: GB200 5 / 2.5
PFLOP/s FP16-BF16 / TF32, 80 TFLOP/s FP32, 8 TB/s; B200 4.5 / 2.2 PFLOP/s, 75 TFLOP/s, 7.7 TB/s; dense is
half the sparse figure, 1.1 PFLOP/s TF32 dense per glennklockwood.com/garden/processors/B200); memory
as MLPerf v5.0's system descriptions state it (training_results_v5.0:NVIDIA/systems: GB200 189,471 MiB,
B200-SXM-180GB 183,359 MiB).
"""
from __future__ import annotations

from dataclasses import dataclass

from fastvision.errors import ConfigError


@dataclass(frozen=True)
class GPU:
    """One accelerator model.

    Attributes:
        name: table key, e.g. ``H100-80GB``.
        memory_gib: device memory in GiB (2**30 bytes).
        fp32, tf32, fp16, bf16: peak dense TFLOP/s (1e12 FLOP/s) for that math; None if absent.
        bandwidth_gbs: memory bandwidth in GB/s (1e9 bytes/s).
        aliases: substrings of ``torch.cuda.get_device_name`` that identify this model.
    """

    name: str
    memory_gib: float
    fp32: float
    tf32: float | None
    fp16: float | None
    bf16: float | None
    bandwidth_gbs: float
    aliases: tuple[str, ...] = ()

    def peak_tflops(self, precision: str) -> tuple[float, str]:
        """Peak dense TFLOP/s for a training precision and the math actually used.

        ``precision`` is ``fp32``, ``tf32``, ``fp16`` or ``bf16``; a precision the GPU lacks falls
        back to fp32 (TF32 off: plain fp32; bf16 on V100/T4 runs emulated, no faster than fp32).
        """
        value = getattr(self, precision, None)
        if value is None:
            return self.fp32, "fp32"
        return value, precision


# name: memory GiB, fp32, tf32, fp16, bf16 (dense TFLOP/s), bandwidth GB/s
GPUS: dict[str, GPU] = {g.name: g for g in (
    # GB200 before B200: "b200" is a substring of "gb200"
    GPU("GB200", 185.0, 80.0, 1250.0, 2500.0, 2500.0, 8000, ("gb200",)),
    GPU("B200", 179.1, 75.0, 1100.0, 2250.0, 2250.0, 7700, ("b200",)),
    GPU("H100-80GB", 79.6, 66.9, 494.7, 989.4, 989.4, 3350, ("h100 80gb hbm3", "h100 sxm", "h100-sxm")),
    GPU("H100-PCIe", 79.6, 51.2, 378.0, 756.0, 756.0, 2000, ("h100 pcie",)),
    GPU("H200", 140.4, 66.9, 494.7, 989.4, 989.4, 4800, ("h200",)),
    GPU("A100-40GB", 39.6, 19.5, 156.0, 312.0, 312.0, 1555, ("a100-sxm4-40gb", "a100-pcie-40gb", "a100 40gb")),
    GPU("A100-80GB", 80.0, 19.5, 156.0, 312.0, 312.0, 2039, ("a100-sxm4-80gb", "a100 80gb hbm")),
    GPU("A100-PCIe-80GB", 80.0, 19.5, 156.0, 312.0, 312.0, 1935, ("a100-pcie-80gb", "a100 80gb pcie")),
    GPU("L40S", 45.0, 91.6, 183.0, 362.0, 362.0, 864, ("l40s",)),
    GPU("V100-16GB", 15.8, 15.7, None, 125.0, None, 900, ("v100-sxm2-16gb", "v100-pcie-16gb", "v100 16gb")),
    GPU("V100-32GB", 31.7, 15.7, None, 125.0, None, 900, ("v100-sxm2-32gb", "v100-pcie-32gb", "v100 32gb")),
    GPU("T4", 15.0, 8.1, None, 65.0, None, 320, ("tesla t4",)),
)}


def get_gpu(name: str) -> GPU:
    """A table entry by its name (case-insensitive) or by a ``torch.cuda.get_device_name`` string."""
    low = name.strip().lower()
    for g in GPUS.values():
        if g.name.lower() == low:
            return g
    for g in GPUS.values():
        if any(a in low for a in g.aliases):
            return g
    raise ConfigError(f"--gpu: unknown GPU {name!r}; valid: {', '.join(GPUS)}")


def local_gpu(device: int | None = None) -> GPU:
    """This machine's CUDA device as a table entry; a model the table lacks (an RTX 4090, an L4) is
    planned on its own memory (``torch.cuda.get_device_properties``), with bf16 where its compute
    capability has it (8.0+), and an A100-80GB's speeds, which only ``plan``'s time figures use."""
    import dataclasses

    import torch

    name = torch.cuda.get_device_name(device)
    try:
        return get_gpu(name)
    except ConfigError:
        pass
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    bf16 = torch.cuda.get_device_capability(device) >= (8, 0)
    base = GPUS["A100-80GB"]
    return dataclasses.replace(base, name=f"{name} ({memory:.3g} GiB, not in the table: A100 speeds)",
                               memory_gib=memory, bf16=base.bf16 if bf16 else None, aliases=())


def training_precision(amp: str, tf32: bool) -> str:
    """The math of a training step: the autocast dtype, else TF32 or plain fp32."""
    if amp in ("fp16", "bf16"):
        return amp
    return "tf32" if tf32 else "fp32"
