"""A lane's context window sized for the device (nodes.agent.window) from the bundled model's own GGUF figures."""

from __future__ import annotations

import os

import pytest

from nodes.agent import gpu
from nodes.agent import window as window_module
from nodes.agent.engine.local import bundled_model_path
from nodes.agent.gguf_info import read_gguf
from nodes.agent.window import WindowError, mem_available, size_window

INFO = read_gguf(bundled_model_path())
GB = 10**9


def window(available: int, lanes: int = 4, workers: int = 1):
    return size_window(kv_bytes_per_token=INFO.kv_bytes_per_token, trained=INFO.context_length, lanes=lanes,
                       model_bytes=INFO.size, available=available, workers=workers)


def test_plenty_of_memory_gives_the_trained_context_and_says_so():
    sized = window(16 * GB)
    assert sized.tokens == 8192
    assert sized.why.startswith("the model's trained context (16.0 GB of RAM available, less 0.1 GB of weights")
    assert "23,040 bytes a token over 4 lanes" in sized.why


def test_little_memory_is_shared_by_the_lanes_and_rounded_down():
    # 0.5 GB free after the weights: 80% of it over 4 lanes of 23,040 bytes a token is 4,340 tokens, so 4,096
    sized = window(INFO.size + GB // 2)
    assert sized.tokens == 4096 and "sized for this device" in sized.why and "trained for 8,192" in sized.why
    assert window(INFO.size + GB // 2, lanes=8).tokens == 2048
    assert window(2 * INFO.size + GB, workers=2).tokens == 4096  # each replica loads the weights and its own KV


def test_a_device_too_small_for_any_window_is_refused_with_the_figures():
    with pytest.raises(WindowError) as info:
        window(INFO.size + 10 * 10**6, lanes=8)
    assert "cannot hold a 256-token window a lane" in str(info.value) and "--max-batch" in str(info.value)
    assert "0.1 GB of weights" in str(info.value) and "over 8 lanes: 43 tokens a lane" in str(info.value)


def test_free_memory_is_the_kernels_mem_available():
    with open("/proc/meminfo") as meminfo:
        line = next(x for x in meminfo if x.startswith("MemAvailable:"))
    assert abs(mem_available() - int(line.split()[1]) * 1024) < 256 * 2**20  # read a moment apart


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` on PATH that reports two GPUs with 6,000 and 10,000 MiB free, as the real one's query does."""
    exe = tmp_path / "nvidia-smi"
    exe.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=index,memory.free" ] || exit 9\nprintf "0, 6000\\n1, 10000\\n"\n')
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return exe


def test_on_a_gpu_the_window_is_sized_from_the_visible_gpus_free_vram(fake_nvidia_smi, monkeypatch):
    assert window_module.device_memory(offload=True) == (16000 << 20, "VRAM")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    available, memory = window_module.device_memory(offload=True)
    assert (available, memory) == (10000 << 20, "VRAM")
    sized = size_window(kv_bytes_per_token=INFO.kv_bytes_per_token, trained=INFO.context_length, lanes=4,
                        model_bytes=INFO.size, available=available, memory=memory)
    assert "10.5 GB of VRAM available" in sized.why


def test_without_gpu_offload_the_ram_is_the_device_memory_even_with_a_gpu_present(fake_nvidia_smi, monkeypatch):
    assert window_module.device_memory(offload=False)[1] == "RAM"  # a CPU run (--cpu) never uses the GPU
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: RAM, never a guess
    assert window_module.device_memory(offload=True)[1] == "RAM"


def test_node_join_and_deployments_size_from_the_device_memory(monkeypatch):
    import nodes.agent.deploy as deploy
    import nodes.agent.main as main

    for module in (main, deploy):
        monkeypatch.setattr(module, "device_memory", lambda offload: (INFO.size + GB // 2, "VRAM"))
    sized = main.device_window(bundled_model_path(), main.NodeOptions(head=None, model="smollm2", max_batch=4),
                               gpu.OffloadPlan("cuda", -1))
    assert sized.tokens == 4096 and "of VRAM available" in sized.why
    with pytest.raises(deploy.DeployRefused, match="of VRAM available"):
        deploy.deployed_window(bundled_model_path(), lanes=4, context=8192, available=INFO.size + GB // 2,
                               memory="VRAM")


def test_part_of_the_model_on_the_gpu_counts_its_layers_against_vram_and_the_rest_against_ram(monkeypatch):
    import nodes.agent.main as main

    monkeypatch.setattr(main, "device_memory", lambda offload: (16 * GB, "VRAM"))
    monkeypatch.setattr(main, "mem_available", lambda: INFO.size // 2 + GB // 4)  # RAM the tighter of the two
    total = INFO.blocks + 1
    options = main.NodeOptions(head=None, model="smollm2", max_batch=4)
    sized = main.device_window(bundled_model_path(), options, gpu.OffloadPlan("cuda", total // 2))
    assert f"of RAM ({total - total // 2} of {total} layers) available" in sized.why
    assert sized.tokens < 8192  # RAM alone would give the trained context to a whole-GPU load
    whole = main.device_window(bundled_model_path(), options, gpu.OffloadPlan("cuda", -1))
    assert whole.tokens == 8192 and "of VRAM available" in whole.why
