"""The host's GPUs against what this llama.cpp build can offload to, checked before a node loads its model.

`llama_supports_gpu_offload()` alone cannot tell: it is true for every build with llama.cpp's RPC backend, which
`make` always turns on, so a CPU build says "offloads" too. The build's own backend registry (ggml's public C API,
read through ctypes from the library llama-cpp-python ships) says which GPU backends it has and which devices they
see. The host's GPUs come from the vendors' tools (`nvidia-smi`, `rocm-smi`) and Apple silicon; a missing or failing
tool means none found. `offload_plan` compares the two and is a plain function of them, so tests give it made-up
inputs; `host_gpus` and `build_gpus` are what a real node passes.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nodes.link.device import DeviceMemory, DeviceReport

PROBE_TIMEOUT_S = 10
# ggml's enum ggml_backend_dev_type (ggml-backend.h): CPU, GPU, IGPU, ACCEL, META
_DEV_GPU, _DEV_IGPU = 1, 2
# the backend registry's names (ggml_backend_reg_name) of GPU backends, as `make node GPU=` spells them
_REG_BACKEND = {"cuda": "cuda", "rocm": "rocm", "hip": "rocm", "vulkan": "vulkan", "metal": "metal", "mtl": "metal"}


class GpuMismatch(Exception):
    """The host has a GPU this build cannot use; the message is the one line node_join prints (exit status 2)."""


@dataclass(frozen=True, slots=True)
class HostGpu:
    """A GPU found on the host, with the backend that drives it (`make node GPU=<backend>`) and who found it."""

    name: str
    backend: str
    found_by: str


@dataclass(frozen=True, slots=True)
class BuildGpu:
    """A GPU device this llama.cpp build sees, with its backend (cuda, rocm, vulkan, metal) and memory."""

    backend: str
    memory: DeviceMemory


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    """What the engine workers load with: the backend, and llama.cpp's n_gpu_layers (-1: all, 0: none)."""

    backend: str
    gpu_layers: int
    host_gpus: tuple[str, ...] = ()
    # One worker over several GPUs (--split-mode, --tensor-split): llama.cpp's split mode ("": its default, layer)
    # and each GPU's share of the model, in the order the build lists them (empty: by free memory).
    split_mode: str = ""
    tensor_split: tuple[float, ...] = ()


SPLIT_MODES = ("none", "layer", "row")


def offload_plan(*, host: list[HostGpu], build: list[BuildGpu], cpu: bool = False, gpu_layers: int | None = None,
                 split_mode: str = "", tensor_split: tuple[float, ...] = ()) -> OffloadPlan:
    """Offload to the build's GPUs when it sees any (all layers unless `gpu_layers`, split over them as
    `split_mode` and `tensor_split` say); the CPU when `cpu` says so or the host has no GPU. Raises GpuMismatch for
    a host GPU the build cannot use, and for a split the build's GPUs cannot take."""
    names = tuple(g.name for g in host)
    shares = ",".join(f"{share:g}" for share in tensor_split)
    split = " ".join(f"--{flag} {value}" for flag, value in (("split-mode", split_mode), ("tensor-split", shares))
                     if value)
    if split and (cpu or not (build or host)):  # a host GPU the build cannot use is said below, with its fix
        raise GpuMismatch(f"{split} splits a model over GPUs, and this node runs on the CPU; leave it out")
    if cpu:
        return OffloadPlan("cpu", 0, names)
    if build:
        if len(tensor_split) > len(build):
            raise GpuMismatch(f"--tensor-split gives {len(tensor_split)} shares, and this llama.cpp build sees "
                              f"{len(build)} GPU(s): one share a GPU, in the order the node's log lists them")
        return OffloadPlan(build[0].backend, -1 if gpu_layers is None else gpu_layers, names, split_mode,
                           tuple(tensor_split))
    if gpu_layers:
        raise GpuMismatch(f"--gpu-layers {gpu_layers} needs a GPU, and this llama.cpp build sees none; leave it out "
                          "to run on the CPU")
    if host:
        found = host[0]
        raise GpuMismatch(f"this host has a GPU ({found.name}, found by {found.found_by}) but this llama.cpp build "
                          f"cannot use it; rebuild it with `make node GPU={found.backend}` (make install GPU="
                          f"{found.backend}), or pass --cpu to run on the CPU on purpose")
    return OffloadPlan("cpu", 0, names)


# -- the host ----------------------------------------------------------------------------------------------------


Runner = Callable[[list[str]], str]


def _run(argv: list[str]) -> str:
    """A tool's stdout; "" when it is not installed, fails or hangs."""
    exe = shutil.which(argv[0])
    if exe is None:
        return ""
    try:
        return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def host_gpus(run: Runner = _run, kfd: Path = Path("/dev/kfd")) -> list[HostGpu]:
    """The host's GPUs: NVIDIA's by nvidia-smi, AMD's by rocm-smi where the amdgpu driver is loaded (/dev/kfd), and
    Apple silicon's (Metal)."""
    found = [HostGpu(line.strip(), "cuda", "nvidia-smi")
             for line in run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).splitlines() if line.strip()]
    if kfd.exists():
        found += [HostGpu(name, "rocm", "rocm-smi") for name in _rocm_names(run(["rocm-smi", "--showproductname"]))]
    if sys.platform == "darwin" and platform.machine() == "arm64":
        found.append(HostGpu("Apple silicon GPU", "metal", "the platform (arm64 macOS)"))
    return found


def _rocm_names(out: str) -> list[str]:
    """rocm-smi's "GPU[0] : Card series: ..." lines (or "Card Series"), one per GPU."""
    names = []
    for line in out.splitlines():
        head, _, value = line.rpartition(":")
        if line.startswith("GPU[") and "card series" in head.lower() and value.strip():
            names.append(value.strip())
    return names


# -- the build ---------------------------------------------------------------------------------------------------


def build_gpus(*, memory: bool = False) -> list[BuildGpu]:
    """The GPU devices this process's llama.cpp build sees (none for a CPU build, or when llama-cpp-python is not
    installed). In an engine worker, the ones CUDA_VISIBLE_DEVICES leaves. `memory` asks each device its memory: only
    in an engine worker, because asking CUDA opens a context on the GPU that the asking process then holds."""
    lib = _ggml()
    if lib is None:
        return []
    gpus = []
    for index in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(index)
        if lib.ggml_backend_dev_type(dev) not in (_DEV_GPU, _DEV_IGPU):
            continue
        reg = (lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)) or b"").decode(errors="replace")
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if memory:
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = (lib.ggml_backend_dev_description(dev) or lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace")
        gpus.append(BuildGpu(_REG_BACKEND.get(reg.lower(), reg.lower()), DeviceMemory(name, total.value, free.value)))
    return gpus


def build_problem(backend: str) -> str:
    """What keeps this process's llama.cpp build from offloading to `backend` (`make ... GPU=`), in one line; ""
    when it sees a device of that backend. `make` runs it after installing a GPU build (python -m nodes.agent.gpu)."""
    if _ggml() is None:
        return "llama-cpp-python is not installed, or its library has no ggml backend registry"
    found = build_gpus()
    if any(g.backend == backend for g in found):
        return ""
    seen = ", ".join(sorted({g.backend for g in found})) or "none"
    hint = {"vulkan": "; a CPU Vulkan device (Mesa's llvmpipe) is used only when named: GGML_VK_VISIBLE_DEVICES=0",
            "cuda": "; check `nvidia-smi` and CUDA_VISIBLE_DEVICES"}.get(backend, "")
    return (f"this GPU={backend} build of llama.cpp sees no {backend} device (GPU devices it sees: {seen}): check "
            f"the toolkit it was built with and the drivers{hint}; then make clean-wheels GPU={backend}")


def _ggml() -> ctypes.CDLL | None:
    try:
        import llama_cpp
    except (ImportError, OSError):
        return None
    folder = Path(llama_cpp.__file__).parent / "lib"
    path = next((p for p in (folder / "libggml.so", folder / "libggml.dylib", folder / "ggml.dll") if p.exists()), None)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))  # the one llama_cpp loaded already: the same handle, the same registry
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, restype, argtypes in (
        ("ggml_backend_dev_count", sz, []), ("ggml_backend_dev_get", vp, [sz]),
        ("ggml_backend_dev_type", ctypes.c_int, [vp]), ("ggml_backend_dev_backend_reg", vp, [vp]),
        ("ggml_backend_reg_name", ctypes.c_char_p, [vp]), ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_description", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
    ):
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def engine_report(*, build: list[BuildGpu], gpu_layers: int, n_layer: int, host: list[str]) -> DeviceReport:
    """What an engine worker that loaded a model of `n_layer` blocks with `gpu_layers` (llama.cpp's n_gpu_layers)
    runs on, with `build` its GPUs (their memory as asked now) and `host` the host's GPU names."""
    total = n_layer + 1  # llama.cpp offloads the output layer as one more
    if not build or gpu_layers == 0:
        return DeviceReport("cpu", [], 0, total, list(host))
    layers = total if gpu_layers < 0 else min(gpu_layers, total)
    return DeviceReport(build[0].backend, [g.memory for g in build], layers, total, list(host))


if __name__ == "__main__":  # `python -m nodes.agent.gpu BACKEND`: exit 1 with one line when the build cannot offload
    problem = build_problem(sys.argv[1]) if len(sys.argv) == 2 else "usage: python -m nodes.agent.gpu BACKEND"
    sys.exit(f"make: {problem}" if problem else 0)
