"""The node a data-parallel job runs on: :class:`Link`, :class:`Hardware` and their YAML presets
(``fastvision/scaling/hardware/*.yaml``), read by :func:`load_hardware`. Used by the simulator
(:mod:`fastvision.scaling.simulator` re-exports every name here).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

HARDWARE_DIR = Path(__file__).resolve().parent / "hardware"


@dataclass(frozen=True)
class Link:
    """An interconnect as one all-reduce sees it.

    Attributes:
        name: preset name.
        bandwidth_gbps: achievable bandwidth in GB/s (1e9 bytes/s): NCCL bus bandwidth within a
            node; per GPU (its NIC) between nodes.
        latency_us: per-hop latency in microseconds (wire + software).
    """

    name: str
    bandwidth_gbps: float
    latency_us: float


@dataclass(frozen=True)
class Hardware:
    """One node type, repeated: GPUs, host cores, the intra-node link and the NIC per GPU.

    Attributes:
        name: preset name (file stem in ``fastvision/scaling/hardware/``).
        gpu: GPU model name (its peak figures live in ``fastvision.planning.devices``, not here).
        gpus_per_node: GPUs per node.
        cpu_cores: physical CPU cores per node.
        cpu_threads: hardware threads per node (SMT); loader processes beyond it share a thread.
        intra: NCCL all-reduce bus bandwidth and hop latency inside a node.
        nic: achieved network bandwidth per GPU and hop latency between nodes.
        description: one line on what the preset is.
        sources: where the figures come from.
        nvls_gbps: NCCL bus bandwidth of NVLink SHARP (NVLS) inside the node, where the switch has it
            (``node.intra.nvls_gbps``); 0: none.
    """

    name: str
    gpu: str
    gpus_per_node: int
    cpu_cores: int
    intra: Link
    nic: Link
    cpu_threads: int = 0
    description: str = ""
    sources: tuple[str, ...] = ()
    nvls_gbps: float = 0.0


def hardware_presets() -> list[str]:
    """Names of the shipped hardware profiles (``fastvision/scaling/hardware/*.yaml``)."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A :class:`Hardware` from a preset name or a YAML file (format: ``fastvision/hardware/dgx-a100.yaml``).

    Raises:
        ConfigError: unknown preset, unreadable file, or a missing or invalid key (named).
    """
    from fastvision.errors import ConfigError

    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ConfigError(f"--hardware: unknown preset {name_or_path!r}; presets: {', '.join(hardware_presets())}, "
                              "or a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read hardware profile: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a hardware profile is a mapping (see fastvision/hardware/dgx-a100.yaml)")
    try:
        node = data["node"]
        links = {k: Link(k, float(node[k]["bandwidth_gbps"]), float(node[k]["latency_us"])) for k in ("intra", "nic")}
        hw = Hardware(name=str(data.get("name", path.stem)), gpu=str(data["gpu"]), gpus_per_node=int(node["gpus"]),
                      cpu_cores=int(node["cpu_cores"]), cpu_threads=int(node.get("cpu_threads", node["cpu_cores"])),
                      intra=links["intra"], nic=links["nic"],
                      description=str(data.get("description", "")), sources=tuple(data.get("sources", ())),
                      nvls_gbps=float(node["intra"].get("nvls_gbps", 0.0)))
    except KeyError as e:
        raise ConfigError(f"{path}: hardware profile misses key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: invalid hardware profile value: {e}") from None
    if hw.gpus_per_node < 1 or hw.cpu_cores < 1 or min(hw.intra.bandwidth_gbps, hw.nic.bandwidth_gbps) <= 0:
        raise ConfigError(f"{path}: node.gpus and node.cpu_cores must be >= 1 and bandwidths > 0")
    return hw
