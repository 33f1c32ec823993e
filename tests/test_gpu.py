"""The node's GPU check and device report (nodes.agent.gpu, nodes.link.device): the host's GPUs against the build's,
given as made-up inputs; the host probe with stand-in tools; the report a real CPU engine makes; and `node_join` on
this CPU build with a stand-in `nvidia-smi` on PATH, which must stop with the one line (a real process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nodes.agent import gpu
from nodes.agent.main import NodeError, NodeOptions, offload
from nodes.link.device import DeviceMemory, DeviceReport, merged_device

H100 = gpu.HostGpu("NVIDIA H100 80GB HBM3", "cuda", "nvidia-smi")
BUILD_CUDA = gpu.BuildGpu("cuda", DeviceMemory("NVIDIA H100 80GB HBM3"))


def test_a_host_gpu_with_a_cpu_build_is_refused_with_the_gpu_and_the_make_line():
    with pytest.raises(gpu.GpuMismatch) as refused:
        gpu.offload_plan(host=[H100], build=[])
    line = str(refused.value)
    assert "\n" not in line and "NVIDIA H100 80GB HBM3, found by nvidia-smi" in line
    assert "`make node GPU=cuda`" in line and "--cpu" in line
    rocm = gpu.HostGpu("AMD Instinct MI300X", "rocm", "rocm-smi")
    with pytest.raises(gpu.GpuMismatch, match="GPU=rocm"):
        gpu.offload_plan(host=[rocm], build=[])


def test_cpu_on_purpose_runs_on_the_cpu_and_keeps_the_host_gpus_for_the_report():
    assert gpu.offload_plan(host=[H100], build=[], cpu=True) == gpu.OffloadPlan("cpu", 0, ("NVIDIA H100 80GB HBM3",))
    assert gpu.offload_plan(host=[H100], build=[BUILD_CUDA], cpu=True).gpu_layers == 0


def test_a_build_that_sees_a_gpu_offloads_every_layer_unless_gpu_layers_says_fewer():
    assert gpu.offload_plan(host=[H100], build=[BUILD_CUDA]) == gpu.OffloadPlan("cuda", -1, (H100.name,))
    assert gpu.offload_plan(host=[H100], build=[BUILD_CUDA], gpu_layers=10).gpu_layers == 10
    vulkan = gpu.BuildGpu("vulkan", DeviceMemory("llvmpipe (LLVM 15.0.6, 256 bits)"))
    assert gpu.offload_plan(host=[], build=[vulkan]).backend == "vulkan"  # a GPU no vendor tool lists


def test_no_gpu_anywhere_is_the_cpu_and_gpu_layers_there_is_refused():
    assert gpu.offload_plan(host=[], build=[]) == gpu.OffloadPlan("cpu", 0, ())
    assert gpu.offload_plan(host=[], build=[], gpu_layers=0).gpu_layers == 0
    with pytest.raises(gpu.GpuMismatch, match="--gpu-layers 8 needs a GPU"):
        gpu.offload_plan(host=[], build=[], gpu_layers=8)


def test_node_join_turns_a_mismatch_into_its_one_line_error_and_a_mock_engine_is_never_refused():
    with pytest.raises(NodeError, match="make node GPU=cuda"):
        offload(NodeOptions(head=None, model="m"), host=[H100], build=[])
    assert offload(NodeOptions(head=None, model="m", cpu=True), host=[H100], build=[]).backend == "cpu"
    assert offload(NodeOptions(head=None, model="m", mock={}), host=[H100], build=[]).host_gpus == (H100.name,)


def test_the_host_probe_reads_nvidia_smi_and_rocm_smi_and_a_missing_tool_is_none_found(tmp_path):
    outputs = {"nvidia-smi": "NVIDIA H100 80GB HBM3\nNVIDIA H100 80GB HBM3\n",
               "rocm-smi": "GPU[0]\t\t: Card Series: \t\tAMD Instinct MI300X\nGPU[0]\t\t: Card Vendor: \t\tAMD\n"}
    kfd = tmp_path / "kfd"
    found = gpu.host_gpus(run=lambda argv: outputs.get(argv[0], ""), kfd=kfd)
    assert [(g.name, g.backend) for g in found] == [(H100.name, "cuda")] * 2  # no /dev/kfd: rocm-smi not asked
    kfd.touch()
    found = gpu.host_gpus(run=lambda argv: outputs.get(argv[0], ""), kfd=kfd)
    assert found[-1] == gpu.HostGpu("AMD Instinct MI300X", "rocm", "rocm-smi")
    assert gpu.host_gpus(run=lambda argv: "", kfd=kfd) == []


def test_the_engine_report_counts_the_output_layer_and_clamps_gpu_layers():
    build = [BUILD_CUDA]
    assert gpu.engine_report(build=build, gpu_layers=-1, n_layer=32, host=[]).layers == 33
    partial = gpu.engine_report(build=build, gpu_layers=10, n_layer=32, host=[])
    assert (partial.backend, partial.layers, partial.layers_total) == ("cuda", 10, 33)
    assert gpu.engine_report(build=build, gpu_layers=99, n_layer=32, host=[]).layers == 33
    cpu = gpu.engine_report(build=build, gpu_layers=0, n_layer=32, host=[H100.name])
    assert (cpu.backend, cpu.layers, cpu.cpu_fallback) == ("cpu", 0, True)


def test_the_device_line_says_backend_devices_layers_and_memory():
    report = DeviceReport("cuda", [DeviceMemory("NVIDIA H100 80GB", 79_600_000_000, 61_200_000_000)], 33, 33)
    assert report.line() == "CUDA: NVIDIA H100 80GB, 33/33 layers, 61.2 of 79.6 GB free"
    assert DeviceReport.from_wire(report.to_wire()) == report
    assert DeviceReport.from_wire(None).line() == "unknown (the node does not report its device)"
    assert DeviceReport("cpu").line() == "CPU" and not DeviceReport("cpu").cpu_fallback


def test_replicas_on_their_own_gpus_report_every_gpu_once():
    one = DeviceReport("cuda", [DeviceMemory("GPU 0", 10, 5)], 33, 33).to_wire()
    two = DeviceReport("cuda", [DeviceMemory("GPU 1", 10, 7)], 33, 33).to_wire()
    merged = DeviceReport.from_wire(merged_device([one, two]))
    assert [d.name for d in merged.devices] == ["GPU 0", "GPU 1"] and merged.layers == 33


def test_this_cpu_build_sees_no_gpu_though_it_says_it_offloads():
    """The RPC backend makes llama_supports_gpu_offload() true on a CPU build; the device list is not fooled."""
    import llama_cpp

    assert llama_cpp.llama_supports_gpu_offload()  # this machine's build has RPC (make always turns it on)
    assert gpu.build_gpus(memory=True) == []


def test_a_real_cpu_engine_reports_the_cpu_its_layers_and_the_host_gpu_it_does_not_use():
    from nodes.agent.engine.base import EngineConfig
    from nodes.agent.engine.llama import LlamaEngine
    from nodes.agent.engine.local import bundled_model_path

    engine = LlamaEngine(EngineConfig(model_path=bundled_model_path(), lanes=1, max_context=256, gpu_layers=0,
                                      host_gpus=["NVIDIA L4"]))
    try:
        report = DeviceReport.from_wire(engine.info()["device"])
    finally:
        engine.close()
    assert report.backend == "cpu" and report.layers == 0 and report.layers_total == engine.model.n_layer + 1
    assert report.line() == "CPU although the host has NVIDIA L4 (--cpu)"


@pytest.mark.real_procs
def test_node_join_on_a_cpu_build_with_a_gpu_on_the_host_exits_2_with_one_line(tmp_path):
    smi = tmp_path / "nvidia-smi"  # a stand-in: what `nvidia-smi --query-gpu=name` prints on an H100 host
    smi.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=name" ] && echo "NVIDIA H100 80GB HBM3"\n')
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "FLEET_HOME": str(tmp_path / "home")}
    env.pop("FLEET_TOKEN", None)
    argv = [sys.executable, "manage.py", "node_join", "127.0.0.1:9", "--model", "smollm2", "--offline",
            "--token", "abcdef123456." + "A" * 43]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["node_join: this host has a GPU (NVIDIA H100 80GB HBM3, found by nvidia-smi) but this llama.cpp "
                     "build cannot use it; rebuild it with `make node GPU=cuda` (make install GPU=cuda), or pass "
                     "--cpu to run on the CPU on purpose"], done.stderr


def test_a_heartbeat_carries_the_engines_device_report():
    from nodes.agent.dialer import heartbeat_of

    report = DeviceReport("cuda", [DeviceMemory("GPU 0", 10, 5)], 33, 33).to_wire()
    assert heartbeat_of({"device": report}, engine_ready=True).device == report
    assert heartbeat_of({}, engine_ready=True).device == {}  # nothing to say yet: the head keeps the registered one


TWO_GPUS = [BUILD_CUDA, gpu.BuildGpu("cuda", DeviceMemory("NVIDIA H100 80GB HBM3"))]


def test_a_split_over_the_builds_gpus_is_carried_in_the_plan():
    plan = gpu.offload_plan(host=[H100, H100], build=TWO_GPUS, split_mode="row", tensor_split=(3.0, 1.0))
    assert (plan.backend, plan.split_mode, plan.tensor_split) == ("cuda", "row", (3.0, 1.0))
    assert gpu.offload_plan(host=[H100], build=TWO_GPUS).split_mode == ""  # llama.cpp's default: layer


def test_a_split_the_node_cannot_make_is_refused_in_one_line():
    with pytest.raises(gpu.GpuMismatch, match=r"^--split-mode row splits a model over GPUs, and this node runs on "):
        gpu.offload_plan(host=[H100], build=TWO_GPUS, cpu=True, split_mode="row")
    with pytest.raises(gpu.GpuMismatch, match=r"--tensor-split 1,1 splits"):
        gpu.offload_plan(host=[], build=[], tensor_split=(1.0, 1.0))
    with pytest.raises(gpu.GpuMismatch, match="gives 3 shares, and this llama.cpp build sees 2 GPU"):
        gpu.offload_plan(host=[H100], build=TWO_GPUS, tensor_split=(1.0, 1.0, 1.0))
    with pytest.raises(gpu.GpuMismatch, match="make node GPU=cuda"):  # a GPU the build cannot use: its fix first
        gpu.offload_plan(host=[H100], build=[], split_mode="layer")


def test_the_split_reaches_llamas_model_parameters():
    import llama_cpp

    from nodes.agent.engine.model import model_params

    params, shares = model_params(-1, "row", (3.0, 1.0))
    assert params.split_mode == llama_cpp.LLAMA_SPLIT_MODE_ROW
    assert [params.tensor_split[0], params.tensor_split[1], params.tensor_split[2]] == [3.0, 1.0, 0.0]
    assert len(shares) == llama_cpp.llama_max_devices()
    default, none = model_params()
    assert default.split_mode == llama_cpp.LLAMA_SPLIT_MODE_LAYER and not default.tensor_split and none is None
