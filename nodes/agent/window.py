"""A lane's context window sized for the device when `node_join --max-context` is not given.

The memory free for the KV cache is the device's: the free VRAM of the visible GPUs when the node offloads to a GPU
(nodes.agent.gpu.offload_plan) and `nvidia-smi` reports one, else the RAM the kernel says is available (MemAvailable);
less what the model's weights will take (its file size, once per engine worker), of which KV_SHARE is given to the
cache (the rest stays for llama.cpp's compute buffers and the system). With part of the model offloaded
(`--gpu-layers`), the layers on the GPU and their KV count against VRAM, the rest against RAM, and the window is the
smaller of the two. That over the KV bytes of one token (from the GGUF's metadata) and the
lanes is each lane's window, clamped to the context the model was trained for and rounded down to STEP tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

KV_SHARE = 0.8
STEP = 256
MIN_WINDOW = 256
MEMINFO = Path("/proc/meminfo")


class WindowError(Exception):
    """The device cannot hold even MIN_WINDOW tokens a lane; the message gives the figures and what to change."""


@dataclass(frozen=True)
class Window:
    tokens: int
    why: str


def mem_available() -> int:
    """Bytes of RAM available to start new work without swapping (the kernel's MemAvailable)."""
    for line in MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise WindowError(f"{MEMINFO} has no MemAvailable line; give the window with --max-context")


def device_memory(*, offload: bool) -> tuple[int, str]:
    """(bytes free for weights and KV, which memory that is): the visible GPUs' free VRAM where the node offloads
    to a GPU and nvidia-smi says, else the RAM available."""
    if offload and (free := vram_free()):
        return free, "VRAM"
    return mem_available(), "RAM"


def vram_free() -> int:
    """Free bytes over the GPUs CUDA_VISIBLE_DEVICES leaves visible (llama.cpp splits layers over all of them), as
    `nvidia-smi` reports them; 0 when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = {v.strip() for v in visible.split(",")} if visible else None
    free_mib = 0
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if mib.strip().isdigit() and (wanted is None or index.strip() in wanted):
            free_mib += int(mib)
    return free_mib << 20


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def size_window(*, kv_bytes_per_token: int, trained: int, lanes: int, model_bytes: int, available: int,
                workers: int = 1, memory: str = "RAM") -> Window:
    """Each lane's window on a device with `available` bytes free, for `workers` engine workers of `lanes` lanes."""
    free = (available - workers * model_bytes) * KV_SHARE / workers
    fits = int(free // (kv_bytes_per_token * lanes)) if free > 0 else 0
    figures = (f"{_gb(available)} of {memory} available, less {_gb(model_bytes)} of weights"
               f"{f' per worker x {workers}' if workers > 1 else ''}, {int(KV_SHARE * 100)}% of the rest for KV at "
               f"{kv_bytes_per_token:,} bytes a token over {lanes} lanes: {fits:,} tokens a lane")
    if fits < MIN_WINDOW:
        raise WindowError(f"this device cannot hold a {MIN_WINDOW}-token window a lane ({figures}); "
                          "run fewer lanes (--max-batch) or free memory")
    if fits >= trained:
        return Window(trained, f"the model's trained context ({figures})")
    return Window(fits // STEP * STEP, f"sized for this device ({figures}; trained for {trained:,})")
