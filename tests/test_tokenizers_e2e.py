"""Tokenizers with real processes: a node sends the head its model's tokenizer at join; one whose model has another
tokenizer than the registry's model of the same name is refused; conversations are placed by real token keys."""

import httpx
import pytest

from nodes.agent.vocab import tokenizer_fingerprint
from tests.live import start_node, wait_for
from tests.test_tokenizers import BUNDLED, different_tokenizer_copy

pytestmark = pytest.mark.slow


def test_the_head_gets_a_nodes_tokenizer_and_refuses_another_one_under_a_registry_name(fresh_head, tmp_path):
    head = fresh_head
    fingerprint = tokenizer_fingerprint(BUNDLED)

    # A node serving a model the registry does not store sends its tokenizer when it joins
    node = start_node(head, "--max-batch", "2", identity="same-vocab")
    try:
        head.wait_nodes(1, timeout=180)
        sent = head.home / "tokenizers" / f"{fingerprint}.gguf"
        wait_for(sent.exists, 30, f"the node's tokenizer did not reach the head: {node.log()}")
        assert tokenizer_fingerprint(sent) == fingerprint and sent.stat().st_size < BUNDLED.stat().st_size / 20

        # Once the registry stores smollm2, a node serving a file with another tokenizer as smollm2 is refused,
        # with one line naming the model and both fingerprints
        head.manage("model_add", str(BUNDLED), "--name", "smollm2")
        other = different_tokenizer_copy(BUNDLED, tmp_path / "smollm2.gguf")  # its own name is the file's
        refused = start_node(head, "--max-batch", "1", identity="other-vocab", model=str(other))
        wait_for(lambda: refused.proc.poll() is not None, 180, f"the node was not refused: {refused.log()}")
        assert refused.proc.returncode == 2, refused.log()
        errors = [line for line in refused.log().splitlines() if line.startswith("node_join:")]
        theirs, ours = tokenizer_fingerprint(other)[:12], fingerprint[:12]
        assert len(errors) == 1 and "another tokenizer than the head's registry model" in errors[0], refused.log()
        assert f"tokenizer {theirs} differs from the registry's {ours} for model 'smollm2'" in errors[0]
        assert "Traceback" not in refused.log() and "Traceback" not in head.log()

        # And the node with the right tokenizer serves on: its next chat turn is placed by the tokens it holds
        http = httpx.Client(base_url=head.url, headers={"Authorization": f"Bearer {head.api_key}"}, timeout=120)
        messages = [{"role": "system", "content": "You answer questions about llama.cpp fleets. " * 12},
                    {"role": "user", "content": "What is a lane?"}]
        first = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages, "max_tokens": 8,
                                                         "temperature": 0}).json()
        answer = first["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And a node?"}]
        second = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages, "max_tokens": 8,
                                                          "temperature": 0}).json()
        assert "error" not in first and "error" not in second
        records = http.get("/api/generations/", params={"model": "smollm2"}).json()["results"]
        placed = [r["placement"] for r in sorted(records, key=lambda r: r["created_at"])]
        assert placed[0]["matched_tokens"] == 0 and placed[0]["prompt_tokens_estimate"] > 128
        assert placed[1]["matched_tokens"] > placed[0]["prompt_tokens_estimate"]  # the first turn and its answer
        assert placed[1]["matched_tokens"] < placed[1]["prompt_tokens_estimate"]
    finally:
        node.stop()
