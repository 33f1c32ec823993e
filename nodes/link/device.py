"""What an engine worker runs on, as the node reports it in `register` and `heartbeat` (their `device` field).

One vocabulary for both ends: the node builds a DeviceReport (nodes.agent.gpu), the head reads it back with
`from_wire`, which keeps what it understands and drops the rest, so a damaged or older report never breaks a page.
An older node sends no `device`: backend "unknown", said as such, never guessed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

BACKENDS = ("cpu", "cuda", "rocm", "vulkan", "metal")
UNKNOWN = "unknown"
_SHOWN = {"cpu": "CPU", "cuda": "CUDA", "rocm": "ROCm", "vulkan": "Vulkan", "metal": "Metal"}
MAX_DEVICES = 64
MAX_NAME = 200


@dataclass(slots=True)
class DeviceMemory:
    """One GPU the engine offloads to: its name and its memory in bytes (0: not known)."""

    name: str
    total: int = 0
    free: int = 0


@dataclass(slots=True)
class DeviceReport:
    """Backend (BACKENDS, or UNKNOWN), the GPUs it uses, the model's layers offloaded of its total (llama.cpp counts
    the output layer as one: a 32-block model has 33), and the GPUs the host has whatever the build uses (nvidia-smi,
    rocm-smi, Apple silicon): a CPU backend beside them is a fallback, flagged on the pages and in /metrics."""

    backend: str = UNKNOWN
    devices: list[DeviceMemory] = field(default_factory=list)
    layers: int = 0
    layers_total: int = 0
    host_gpus: list[str] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> DeviceReport:
        """The report in `data` (a decoded msgpack map), with every field that is missing or of the wrong type at its
        default; {} or None (an older node) is UNKNOWN."""
        if not isinstance(data, dict):
            return cls()
        backend = data.get("backend")
        devices = [DeviceMemory(d["name"][:MAX_NAME], _count(d.get("total")), _count(d.get("free")))
                   for d in _list(data.get("devices")) if isinstance(d, dict) and isinstance(d.get("name"), str)]
        return cls(backend=backend if backend in BACKENDS else UNKNOWN, devices=devices[:MAX_DEVICES],
                   layers=_count(data.get("layers")), layers_total=_count(data.get("layers_total")),
                   host_gpus=[g[:MAX_NAME] for g in _list(data.get("host_gpus")) if isinstance(g, str)][:MAX_DEVICES])

    @property
    def cpu_fallback(self) -> bool:
        """On the CPU although the host has a GPU (`node_join --cpu`, which is the only way a node runs so)."""
        return self.backend == "cpu" and bool(self.host_gpus)

    def line(self) -> str:
        """One line for the pages: "CUDA: NVIDIA H100 80GB, 33/33 layers, 61.2 of 79.6 GB free"."""
        if self.backend == UNKNOWN:
            return "unknown (the node does not report its device)"
        if self.backend == "cpu":
            beside = f" although the host has {', '.join(self.host_gpus)} (--cpu)" if self.cpu_fallback else ""
            return f"CPU{beside}"
        parts = [", ".join(d.name for d in self.devices) or "no device named"]
        if self.layers_total:
            parts.append(f"{self.layers}/{self.layers_total} layers")
        total, free = sum(d.total for d in self.devices), sum(d.free for d in self.devices)
        if total:
            parts.append(f"{free / 1e9:.1f} of {total / 1e9:.1f} GB free")
        return f"{_SHOWN[self.backend]}: {', '.join(parts)}"


def merged_device(reports: list[Any]) -> dict[str, Any]:
    """One report for a node's replicas (`--replicas`, each on its own GPUs): the first's backend and layers, every
    replica's devices."""
    read = [DeviceReport.from_wire(r) for r in reports]
    if not read:
        return DeviceReport().to_wire()
    first = read[0]
    first.devices = [d for r in read for d in r.devices][:MAX_DEVICES]
    return first.to_wire()


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else 0


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []
