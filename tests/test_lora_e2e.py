"""LoRA adapters end to end: a real head, a real node started with `--lora style=PATH` (an adapter built for the
bundled model at test time), and the official `openai` client choosing it by model name or with the lora field."""

from __future__ import annotations

import subprocess

import pytest
from openai import BadRequestError, OpenAI

from tests.live import PYTHON, ROOT, make_head, start_node, wait_for
from tests.lora_adapter import build_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_head(tmp_path_factory):
    adapter = build_adapter(tmp_path_factory.mktemp("lora") / "style.gguf")
    head = make_head(tmp_path_factory.mktemp("lora-head"))
    head.start()
    node = start_node(head, "--lora", f"style={adapter}", "--max-batch", "2", "--max-context", "512",
                      identity="tuned")
    head.wait_nodes(1, timeout=180)
    yield head
    node.stop()
    head.stop()


def client_of(head) -> OpenAI:
    return OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0)


def answer(client: OpenAI, model: str, question: str, **extra) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           temperature=0, max_tokens=12, extra_body=extra or None)
    return reply.choices[0].message.content


def test_the_adapter_is_listed_as_a_model_and_changes_the_answer(lora_head):
    client = client_of(lora_head)
    wait_for(lambda: {"smollm2", "smollm2:style"} <= {m.id for m in client.models.list()}, 30,
             f"/v1/models lacks smollm2:style: {lora_head.log()}")

    plain = answer(client, "smollm2", "Name three colours.")
    tuned = answer(client, "smollm2:style", "Name three colours.")
    by_field = answer(client, "smollm2", "Name two fruits.", lora=[{"name": "style", "scale": 1.0}])

    assert tuned and tuned != plain
    assert by_field != answer(client, "smollm2", "Name two fruits.")


def test_an_adapter_no_node_has_is_a_400_that_names_it_and_the_flag(lora_head):
    client = client_of(lora_head)
    with pytest.raises(BadRequestError) as refused:
        answer(client, "smollm2", "Hi", lora=[{"name": "nope"}])
    error = refused.value.body
    assert error["code"] == "capability_unavailable" and error["param"] == "lora:nope"
    assert "--lora NAME=PATH" in error["message"]

    with pytest.raises(BadRequestError) as malformed:
        answer(client, "smollm2", "Hi", lora=[{"name": "style", "scale": "high"}])
    assert malformed.value.body["param"] == "lora" and "from -16 to 16" in malformed.value.body["message"]


def test_a_missing_adapter_file_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run([PYTHON, str(ROOT / "manage.py"), "node_join", "127.0.0.1:9", "--model", "smollm2",
                             "--lora", f"style={tmp_path / 'absent.gguf'}"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert "no LoRA adapter file at" in result.stderr and "Traceback" not in result.stderr
