"""GPU utilisation and memory through NVML (``nvidia-ml-py``), as seed 003's monitoring script.

``fastvision monitor`` samples one GPU every ``interval`` seconds into a CSV
(``time_s, gpu_util, mem_util, mem_used_mib, mem_total_mib, mem_ratio``; seed 003 wrote time,
gpu_util, used, total, ratio) and plots it to a PNG. :class:`NvmlSampler` is the same sampling in
a background thread, used by the profiler while it runs. ``pynvml`` is imported only here and only
when asked for, so the rest of fastvision runs without it.
"""
from __future__ import annotations

import csv
import threading
import time
from pathlib import Path
from typing import Any

import torch

from fastvision.errors import FastvisionError

COLUMNS = ("time_s", "gpu_util", "mem_util", "mem_used_mib", "mem_total_mib", "mem_ratio")


def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise FastvisionError("monitor: NVML is not available (pip install nvidia-ml-py; needs an NVIDIA "
                              "driver)") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise FastvisionError(f"monitor: NVML cannot start ({e})") from None
    return pynvml


def cuda_identity(index: int) -> tuple[str | None, str | None]:
    """``(uuid, pci_bus_id)`` of CUDA device ``index`` as this process numbers it, in NVML's spelling.

    CUDA numbers the devices that ``CUDA_VISIBLE_DEVICES`` leaves, in its own order (fastest first
    unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); NVML numbers every GPU of the machine in PCI order. The
    two indices agree only by chance, so the device is matched by UUID (or PCI bus id) instead.
    """
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None, None
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    uuid = f"GPU-{uuid}" if uuid is not None and not str(uuid).startswith(("GPU-", "MIG-")) else uuid
    bus = getattr(props, "pci_bus_id", None)
    pci = (f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
           if bus is not None else None)
    return (str(uuid) if uuid is not None else None), pci


def nvml_handle(index: int = 0) -> Any:
    """NVML handle of CUDA device ``index`` (this process's numbering, ``CUDA_VISIBLE_DEVICES``
    honoured), matched by UUID, else PCI bus id; without CUDA in this process (a monitor started
    beside the job) ``index`` is NVML's own index, as ``nvidia-smi -i`` counts.

    Raises:
        FastvisionError: NVML or the driver is missing, or no GPU matches (one line).
    """
    pynvml = _pynvml()
    uuid, pci = cuda_identity(index)
    try:
        if uuid is not None:
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError:
                if pci is None:
                    raise
        if pci is not None:
            return pynvml.nvmlDeviceGetHandleByPciBusId(pci)
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError as e:
        raise FastvisionError(f"monitor: NVML cannot open GPU {index} ({uuid or pci or 'by index'}: {e})") from None


def sample(handle: Any) -> dict[str, float]:
    """One reading: utilisation % (SM and memory controller) and framebuffer memory in MiB."""
    import pynvml

    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    used, total = mem.used / 2**20, mem.total / 2**20
    return {"gpu_util": float(util.gpu), "mem_util": float(util.memory), "mem_used_mib": used,
            "mem_total_mib": total, "mem_ratio": 100.0 * used / max(total, 1.0)}


def record(out: str | Path, *, interval: float = 1.0, duration: float | None = None, index: int = 0) -> Path:
    """Append readings to ``out`` every ``interval`` s for ``duration`` s (None: until Ctrl-C)."""
    handle = nvml_handle(index)
    out = Path(out)
    new = not out.exists() or out.stat().st_size == 0
    t0 = time.monotonic()
    with open(out, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(COLUMNS)
        try:
            while duration is None or time.monotonic() - t0 < duration:
                s = sample(handle)
                w.writerow([f"{time.monotonic() - t0:.3f}", *(f"{s[c]:.2f}" for c in COLUMNS[1:])])
                f.flush()  # readable while it runs
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
    return out


def read_csv(path: str | Path) -> dict[str, list[float]]:
    """Columns of a monitor CSV (comma- or tab-separated, as seed 003's ``nvidia_smi.csv``)."""
    text = Path(path).read_text().strip().splitlines()
    if not text:
        raise FastvisionError(f"{path}: empty monitor CSV")
    sep = "\t" if "\t" in text[0] else ","
    header = [h.strip() for h in text[0].split(sep)]
    # seed 003 names: time, gpu_util, used, total, ratio
    header = [{"time": "time_s", "used": "mem_used_mib", "total": "mem_total_mib", "ratio": "mem_ratio"}.get(h, h)
              for h in header]
    cols: dict[str, list[float]] = {h: [] for h in header}
    for n, line in enumerate(text[1:], start=2):
        parts = line.split(sep)
        if len(parts) != len(header):
            raise FastvisionError(f"{path}:{n}: {len(parts)} fields, header has {len(header)}")
        try:
            for h, v in zip(header, parts, strict=True):
                cols[h].append(float(v))
        except ValueError:
            raise FastvisionError(f"{path}:{n}: not a number in {line.strip()!r}") from None
    if len(text) < 2:
        raise FastvisionError(f"{path}: no readings, only a header line")
    for need in ("time_s", "gpu_util", "mem_used_mib"):
        if need not in cols:
            raise FastvisionError(f"{path}: no column {need!r} (have {', '.join(header)})")
    return cols


def plot_csv(path: str | Path, png: str | Path, title: str | None = None) -> Path:
    """Utilisation (%) and memory (GiB) over time, two panels sharing the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = read_csv(path)
    t = cols["time_s"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 4.2), sharex=True, constrained_layout=True)
    ax1.plot(t, cols["gpu_util"], color="#1f77b4", lw=1.4, label="GPU (SM) utilisation")
    if "mem_util" in cols:
        ax1.plot(t, cols["mem_util"], color="#ff7f0e", lw=1.0, alpha=0.8, label="memory controller")
    ax1.set_ylabel("utilisation %")
    ax1.set_ylim(0, 105)
    ax1.legend(loc="lower right", fontsize=8, frameon=False)
    ax1.grid(alpha=0.3)
    ax2.plot(t, [v / 1024 for v in cols["mem_used_mib"]], color="#2ca02c", lw=1.4, label="used")
    if "mem_total_mib" in cols:
        ax2.axhline(max(cols["mem_total_mib"]) / 1024, color="grey", ls="--", lw=1, label="total")
    ax2.set_ylabel("memory GiB")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("time (s)")
    ax2.legend(loc="lower right", fontsize=8, frameon=False)
    ax2.grid(alpha=0.3)
    ax1.set_title(title or f"GPU monitor: {Path(path).name}", fontsize=10)
    from fastvision.utils.files import save_figure

    png = save_figure(fig, Path(png), dpi=110)  # whole, or the file before: never half a picture
    plt.close(fig)
    return png


class NvmlSampler:
    """Background readings while a block runs (``with NvmlSampler(device): ...``); no-op without NVML."""

    def __init__(self, device: torch.device, interval: float = 0.1):
        self.interval, self.readings = interval, []
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            self.handle = nvml_handle(index)
        except FastvisionError:
            self.handle = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastvision-nvml", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.readings.append(sample(self.handle))
            self._stop.wait(self.interval)

    def __enter__(self) -> NvmlSampler:
        if self.handle is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self) -> dict[str, Any] | None:
        """Mean utilisation and peak memory over the readings (None without NVML)."""
        if not self.readings:
            return None
        n = len(self.readings)
        return {"util_mean": sum(r["gpu_util"] for r in self.readings) / n,
                "mem_util_mean": sum(r["mem_util"] for r in self.readings) / n,
                "mem_used_peak_mib": max(r["mem_used_mib"] for r in self.readings),
                "mem_total_mib": self.readings[0]["mem_total_mib"], "samples": n}
