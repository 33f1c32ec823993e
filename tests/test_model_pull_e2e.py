"""Pulling registry models with real processes: a head (daphne) with a model added under a new name, and
`manage.py node_join --model NAME` nodes that pull it over HTTP with a grant from their link, resume a pull that was
killed, pull again over a corrupted copy, size their windows for the device, and serve the model under that name."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from nodes.agent.engine.local import bundled_model_path
from tests.live import make_head, start_node, wait_for

pytestmark = pytest.mark.slow

MODEL = bundled_model_path()
SIZE = os.path.getsize(MODEL)
SHA256 = hashlib.sha256(Path(MODEL).read_bytes()).hexdigest()
NAME = "tiny-chat"


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    head = make_head(tmp_path_factory.mktemp("pull"))
    head.manage("model_add", MODEL, "--name", NAME)
    head.start()
    yield head
    head.stop()


def head_log_size(head) -> int:
    return head.log_path.stat().st_size


def bytes_served(head, since: int) -> int:
    """Bytes of the model file the head was asked for since log offset `since` (each Range request logs its span)."""
    text = head.log_path.read_bytes()[since:].decode(errors="replace")
    spans = re.findall(rf"model file {SHA256[:12]}… bytes (\d+)-(\d+) of", text)
    return sum(int(last) - int(first) + 1 for first, last in spans)


def pulling_node(head, home: Path, identity: str, *args: str):
    return start_node(head, "--max-batch", "2", *args, identity=identity, model=NAME, offline=False,
                      extra_env={"FLEET_HOME": str(home)})


def copy_of(home: Path) -> Path:
    return home / "models" / NAME / f"{SHA256}.gguf"


def joined(node) -> bool:
    return " joined " in node.log()


def test_two_nodes_pull_a_model_added_on_the_head_and_serve_it_under_its_name(head, tmp_path):
    since = head_log_size(head)
    nodes = [pulling_node(head, tmp_path / "pull-a", "pull-a", "--label", "gpu=a100", "--label", "zone=eu-1"),
             pulling_node(head, tmp_path / "pull-b", "pull-b")]
    try:
        head.wait_nodes(2, timeout=240)
        for name, node in zip(("pull-a", "pull-b"), nodes, strict=True):
            assert hashlib.sha256(copy_of(tmp_path / name).read_bytes()).hexdigest() == SHA256
            log = node.log_path.read_text()
            # stderr is a log file here, not a terminal: one line per 10%, no redrawn bar
            steps = re.findall(rf"pulling {NAME}: +(\d+)% \(", log)
            assert steps == [str(p) for p in range(0, 101, 10)], log
            assert b"\r" not in node.log_path.read_bytes()  # (read_text would turn a \r into a \n)
            # a load's steps on one line; llama.cpp reports in jumps
            line = re.search(r"loading tiny-chat:((?: \d+%)+)\n", log).group(1)
            loading = [int(p) for p in re.findall(r"(\d+)%", line)]
            assert loading[0] == 0 and loading[-1] == 100 and loading == sorted(set(loading)), log
            assert all(p % 10 == 0 for p in loading), log
            # SmolLM2's 23,040 KV bytes a token fit its whole trained context in this machine's RAM
            assert re.search(r"loaded, context window 8192 tokens \(the model's trained context \(.* GB of RAM "
                             r"available, .* 23,040 bytes a token over 2 lanes", log), log
        assert bytes_served(head, since) == 2 * SIZE
        client = openai.OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=120)
        assert NAME in [m.id for m in client.models.list().data]
        listed = httpx.get(f"{head.url}/api/nodes/", headers={"Authorization": f"Bearer {head.api_key}"}).json()
        assert {n["identity"]: n["labels"] for n in listed["results"]} == {"pull-a": {"gpu": "a100", "zone": "eu-1"},
                                                                          "pull-b": {}}
        served = set()
        for i in range(6):
            answer = client.chat.completions.create(model=NAME, max_tokens=4, temperature=0,
                                                    messages=[{"role": "user", "content": f"Count to {i}"}])
            assert answer.choices[0].message.content
            served.add(answer.system_fingerprint)
        assert served == {"fleet:pull-a", "fleet:pull-b"}
    finally:
        for node in nodes:
            node.stop()


def test_a_pull_killed_halfway_resumes_and_a_corrupted_copy_is_pulled_again(head, tmp_path):
    home = tmp_path / "resume"
    part = home / "models" / NAME / f"{SHA256}.gguf.part"
    since = head_log_size(head)
    node = pulling_node(head, home, "pull-resume")
    try:
        wait_for(lambda: part.exists() and part.stat().st_size >= SIZE * 0.3, 120, f"no pull: {node.log()}",
                 interval=0.005)
        head.proc.send_signal(signal.SIGSTOP)  # freeze the transfer so the kill lands mid-file
        node.stop(signal.SIGKILL)
        head.proc.send_signal(signal.SIGCONT)
        kept = part.stat().st_size
        assert SIZE * 0.3 <= kept < SIZE
        node = pulling_node(head, home, "pull-resume")
        wait_for(lambda: joined(node), 240, f"the node did not join: {node.log()}")
        assert f"resuming the pull of {NAME} at {kept} of {SIZE} bytes" in node.log_path.read_text()
        assert copy_of(home).exists() and not part.exists()
        fetched = bytes_served(head, since)
        assert SIZE <= fetched <= 1.1 * SIZE, fetched
        node.stop()

        with open(copy_of(home), "r+b") as handle:  # one byte flipped
            handle.seek(SIZE // 2)
            byte = handle.read(1)
            handle.seek(SIZE // 2)
            handle.write(bytes([byte[0] ^ 0xFF]))
        since = head_log_size(head)
        node = pulling_node(head, home, "pull-resume")
        wait_for(lambda: joined(node), 240, f"the node did not join: {node.log()}")
        assert "is corrupt (its sha256 differs); discarded" in node.log_path.read_text()
        assert bytes_served(head, since) == SIZE
        assert hashlib.sha256(copy_of(home).read_bytes()).hexdigest() == SHA256
        node.stop()

        since = head_log_size(head)  # a verified copy is used as it is: nothing is pulled
        node = pulling_node(head, home, "pull-resume")
        wait_for(lambda: joined(node), 240, f"the node did not join: {node.log()}")
        assert bytes_served(head, since) == 0
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("model", "args", "line"),
    [
        (NAME, ("--offline",), f"node_join: model '{NAME}' is not on this node"),
        ("no-such-model", (), "node_join: the head has no model named 'no-such-model'"),
    ],
    ids=["offline-pulls-nothing", "unknown-name"],
)
def test_a_model_the_node_cannot_get_stops_it_with_one_line(head, tmp_path, model, args, line):
    node = start_node(head, *args, identity="pull-refused", model=model, offline=False,
                      extra_env={"FLEET_HOME": str(tmp_path)})
    try:
        wait_for(lambda: node.proc.poll() is not None, 120, f"node_join did not stop: {node.log()}")
        assert node.proc.returncode == 2
        errors = [text for text in node.log().splitlines() if text.startswith("node_join:")]
        assert len(errors) == 1 and errors[0].startswith(line), node.log()
        assert "Traceback" not in node.log() and not (tmp_path / "models" / NAME / f"{SHA256}.gguf").exists()
    finally:
        node.stop()


def test_a_pull_that_outlives_its_grant_asks_for_a_new_one_and_goes_on(tmp_path):
    head = make_head(tmp_path / "short-grants", extra_env={"FLEET_PULL_GRANT_S": "2"})
    head.manage("model_add", MODEL, "--name", NAME)
    head.start()
    home = tmp_path / "node"
    part = home / "models" / NAME / f"{SHA256}.gguf.part"
    node = pulling_node(head, home, "pull-slow")
    try:
        wait_for(lambda: part.exists() and part.stat().st_size >= SIZE * 0.3, 120, f"no pull: {node.log()}",
                 interval=0.005)
        head.proc.send_signal(signal.SIGSTOP)  # the pull stalls past its grant's 2 s
        time.sleep(3.5)
        head.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: joined(node), 240, f"the node did not join: {node.log()}")
        log = node.log_path.read_text()
        assert f"the grant to pull {NAME} expired; asking the head for a new one" in log
        assert node.proc.poll() is None and hashlib.sha256(copy_of(home).read_bytes()).hexdigest() == SHA256
    finally:
        node.stop()
        head.stop()


def test_with_no_head_answering_a_node_serves_the_copy_it_has_and_joins_when_the_head_is_back(tmp_path):
    head = make_head(tmp_path / "away")
    head.manage("model_add", MODEL, "--name", NAME)
    head.start()
    home = tmp_path / "node"
    node = pulling_node(head, home, "pull-away")
    try:
        wait_for(lambda: joined(node), 240, f"the node did not join: {node.log()}")
        node.stop()
        head.stop()
        node = pulling_node(head, home, "pull-away")
        wait_for(lambda: "context window 8192 tokens" in node.log(), 240, f"the node did not load: {node.log()}")
        assert f"no head answered; serving this node's copy of {NAME}" in node.log_path.read_text()
        since = head_log_size(head)
        head.start()
        wait_for(lambda: joined(node), 120, f"the node did not join: {node.log()}")
        assert bytes_served(head, since) == 0
    finally:
        node.stop()
        head.stop()
