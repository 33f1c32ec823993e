"""Codex CLI and Claude Code as npm ships them (the versions pinned below), unchanged, against a real head (daphne)
and a real SmolLM2 node whose window holds their prompts (about 9,000 and 12,500 tokens): a one-shot prompt, a
second turn whose repeated prefix the node reads from its cache (the CLI's own usage says so), and a tool round trip.

SmolLM2-135M never calls an agent's tool on its own, so in the round trip the first turn is a scripted call
(tests/agent_proxy.py, in front of the head); the CLI runs its tool and sends the result, and from there every
request is the head's, answered by the real model. The first-request shapes, without the CLIs: test_api_agents."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.agent_proxy import AgentProxy, ToolCall
from tests.live import make_head, start_node

# Minutes of prompt reading on two cores (a first turn reads 9,000-12,500 tokens): run on purpose, not in every
# `make test`: FLEET_AGENT_CLIS_E2E=1 .venv/bin/python -m pytest tests/test_agents_cli_e2e.py
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400), pytest.mark.skipif(
    os.environ.get("FLEET_AGENT_CLIS_E2E") != "1",
    reason="the agent CLIs' run takes 10-20 minutes here: set FLEET_AGENT_CLIS_E2E=1 to run it")]

CODEX, CLAUDE = ("@openai/codex", "0.171.0"), ("@anthropic-ai/claude-code", "2.1.332")
CLIS = Path(os.environ.get("FLEET_AGENT_CLIS", Path.home() / ".cache" / "fleet" / "agent-clis")) / (
    f"codex-{CODEX[1]}+claude-code-{CLAUDE[1]}")
MODEL = "smollm2"
MARKER = "fleet-marker-7341"
RUN_S = 900  # one CLI run on two cores: a first turn reads its whole prompt (about 80 s for Codex's, 180 for Claude's)


@pytest.fixture(scope="module")
def clis() -> Path:
    """The pinned CLIs, installed from npm once per machine (kept under ~/.cache/fleet/agent-clis)."""
    bin_dir = CLIS / "node_modules" / ".bin"
    if not (bin_dir / "codex").exists() or not (bin_dir / "claude").exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: Codex CLI and Claude Code come from npm (apt-get install npm)")
        part = CLIS.with_name(f"{CLIS.name}.part-{os.getpid()}")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        done = subprocess.run([npm, "install", "--prefix", str(part), "--no-audit", "--no-fund",
                               f"{CODEX[0]}@{CODEX[1]}", f"{CLAUDE[0]}@{CLAUDE[1]}"],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"npm install failed: {done.stderr[-3000:]}"
        shutil.rmtree(CLIS, ignore_errors=True)
        part.rename(CLIS)
    return bin_dir


def fleet(tmp_path: Path, window: int):
    """A head and one real node with a `window`-token lane (one lane: the CLIs' turns run one at a time)."""
    head = make_head(tmp_path)
    head.start()
    node = start_node(head, "--max-context", str(window), "--max-batch", "1", identity="agents")
    head.wait_nodes(1, timeout=240)
    return head, node


@pytest.fixture
def workdir(tmp_path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(f"{MARKER}\n")
    return work


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_S,
                          stdin=subprocess.DEVNULL)


def told(done: subprocess.CompletedProcess, *logs: str) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}\n" + "\n".join(logs)


# --- Codex CLI (the Responses API) --------------------------------------------------------------------------------


def codex_home(tmp_path: Path, base_url: str, name: str) -> Path:
    home = tmp_path / name
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "fleet"\n\n[model_providers.fleet]\nname = "Fleet"\n'
        f'base_url = "{base_url}/v1"\nenv_key = "FLEET_KEY"\nwire_api = "responses"\n')
    return home


def codex_events(done: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def codex_usage(done: subprocess.CompletedProcess) -> dict:
    return next(e["usage"] for e in reversed(codex_events(done)) if e.get("type") == "turn.completed")


def codex_answer(done: subprocess.CompletedProcess) -> str:
    return "".join(e["item"].get("text", "") for e in codex_events(done)
                   if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message")


def test_codex_cli_answers_reads_its_prefix_from_cache_and_round_trips_a_tool(clis, tmp_path, workdir):
    # Codex sends no max_output_tokens, so an answer may run to the window: 10,240 tokens keeps a babbling reply short
    head, node = fleet(tmp_path, 10240)
    try:
        env = {**os.environ, "HOME": str(tmp_path), "FLEET_KEY": head.api_key,
               "CODEX_HOME": str(codex_home(tmp_path, head.url, "codex"))}
        exec_ = [str(clis / "codex"), "exec", "--skip-git-repo-check", "--json"]

        first = run([*exec_, "Say hello in one short sentence."], env, workdir)
        assert first.returncode == 0 and codex_answer(first), told(first, head.log(), node.log())

        second = run([*exec_, "resume", "--last", "Now say goodbye."], env, workdir)
        assert second.returncode == 0 and codex_answer(second), told(second, head.log())
        # Codex's usage counts the whole session so far: the second turn's own is what it added
        before, after = codex_usage(first), codex_usage(second)
        read, cached = (after[k] - before[k] for k in ("input_tokens", "cached_input_tokens"))
        assert cached >= 0.9 * read > 5000, (before, after)

        proxy = AgentProxy(head.address, ToolCall("exec_command", {"cmd": "cat notes.txt"}))
        try:
            env["CODEX_HOME"] = str(codex_home(tmp_path, proxy.url, "codex-proxied"))
            third = run([*exec_, "What is in notes.txt?"], env, workdir)
        finally:
            proxy.close()
        assert third.returncode == 0 and codex_answer(third), told(third, head.log())
        assert proxy.scripted == ["/v1/responses"]
        turns = [f for f in proxy.forwarded if f.path.startswith("/v1/responses")]
        results = [i for i in turns[0].body["input"] if isinstance(i, dict) and i.get("type") == "function_call_output"]
        assert MARKER in json.dumps(results), turns[0].body["input"][-3:]
        assert all(f.status == 200 and b"event: response.completed" in f.answer for f in turns), turns[-1].answer[-500:]
    finally:
        node.stop()
        head.stop()


# --- Claude Code (the Messages API) -------------------------------------------------------------------------------


def claude_result(done: subprocess.CompletedProcess) -> dict:
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))


def fleet_answered(done: subprocess.CompletedProcess, *logs: str) -> dict:
    """Claude Code's result for a run every request of which the fleet answered. Claude Code ends a turn whose answer
    ran to the output limit (CLAUDE_CODE_MAX_OUTPUT_TOKENS, kept small here) as its own error, exit 1, with no HTTP
    status; a refusal or failure of the fleet's carries its status, and fails this."""
    assert done.stdout.strip(), told(done, *logs)
    result = claude_result(done)
    assert result.get("api_error_status") is None, told(done, *logs)
    assert done.returncode == 0 or result.get("api_error") == "max_output_tokens", told(done, *logs)
    return result


def test_claude_code_answers_reads_its_prefix_from_cache_and_round_trips_a_tool(clis, tmp_path, workdir):
    head, node = fleet(tmp_path, 14336)
    try:
        env = {**os.environ, "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": head.url, "ANTHROPIC_API_KEY": head.api_key,
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "96"}
        claude = [str(clis / "claude"), "-p", "--model", MODEL, "--output-format", "json"]

        first = fleet_answered(run([*claude, "Say hello in one short sentence."], env, workdir), head.log())
        assert first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"] > 5000, first["usage"]

        second = fleet_answered(run([*claude, "--continue", "Now say goodbye."], env, workdir), head.log())
        usage = second["usage"]
        assert usage["cache_read_input_tokens"] >= 0.9 * (usage["input_tokens"] + usage["cache_read_input_tokens"]), \
            usage

        proxy = AgentProxy(head.address, ToolCall("Bash", {"command": "cat notes.txt", "description": "Show notes"}))
        try:
            env["ANTHROPIC_BASE_URL"] = proxy.url
            third = run([*claude, "--allowedTools", "Bash(cat:*)", "What is in notes.txt?"], env, workdir)
        finally:
            proxy.close()
        fleet_answered(third, head.log())
        assert proxy.scripted[:1] == ["/v1/messages?beta=true"]
        turns = [f for f in proxy.forwarded if f.path.startswith("/v1/messages?")]
        results = [b for m in turns[0].body["messages"] if isinstance(m["content"], list) for b in m["content"]
                   if b.get("type") == "tool_result"]
        assert MARKER in json.dumps(results), turns[0].body["messages"][-1]
        assert all(f.status == 200 and b"event: message_stop" in f.answer for f in turns), turns[-1].answer[-500:]
    finally:
        node.stop()
        head.stop()
