"""Images in chat end to end: a real head, a real node started with `--mmproj eyes` (a random-weight projector built
for the bundled model at test time, added to the head's registry as the entry of its model and pulled by the node: it
proves the path, not the answer), one without, and the official `openai` client
sending a base64 image."""

from __future__ import annotations

import base64

import pytest
from openai import APIStatusError, BadRequestError, OpenAI

from nodes.agent.engine.local import bundled_model_path
from tests.live import blob_bytes_served, make_head, start_node, wait_for
from tests.vision_projector import IMAGE_TOKENS, build_projector, png

pytestmark = pytest.mark.slow

IMAGE = png(seed=7)
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def vision_head(tmp_path_factory):
    projector = build_projector(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf")
    head = make_head(tmp_path_factory.mktemp("vision"))
    # The projector as the registry's entry for its model: the seeing node names it and pulls it from the head.
    head.manage("model_add", bundled_model_path(), "--name", "smol-base")
    head.manage("model_add", str(projector), "--name", "eyes", "--base", "smol-base")
    head.start()
    seeing = start_node(head, "--mmproj", "eyes", "--max-batch", "2", "--max-context", "512", identity="seeing",
                        offline=False, extra_env={"FLEET_HOME": str(tmp_path_factory.mktemp("seeing"))})
    blind = start_node(head, "--max-batch", "2", "--max-context", "512", identity="blind",
                       extra_env={"FLEET_HOME": str(tmp_path_factory.mktemp("blind"))})  # a node key of its own
    head.wait_nodes(2, timeout=180)
    head.nodes = {"seeing": seeing, "blind": blind}
    yield head
    blind.stop()
    seeing.stop()
    head.stop()


def client_of(head) -> OpenAI:
    return OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0)


def asking(image: bytes = IMAGE) -> dict:
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    return {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def streamed(client: OpenAI, messages: list[dict]) -> tuple[str, object]:
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage


def test_an_image_streams_an_answer_whose_usage_counts_its_tokens_and_the_next_turn_moves_no_bytes(vision_head):
    client = client_of(vision_head)
    pulled = blob_bytes_served(vision_head)  # the projector the seeing node pulled from the registry when it joined
    text_only = client.chat.completions.create(model="smollm2", max_tokens=1, temperature=0,
                                               messages=[{"role": "user", "content": QUESTION}])
    answer, usage = streamed(client, [asking()])
    assert answer and usage.completion_tokens == 8
    assert usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS
    served = wait_for(lambda: blob_bytes_served(vision_head) - pulled, 10, "the node fetched no blob bytes") + pulled
    assert served - pulled == len(IMAGE)  # the image went to the node once, by its hash

    follow_up = [asking(), {"role": "assistant", "content": answer}, {"role": "user", "content": "And its colours?"}]
    _, usage = streamed(client, follow_up)
    assert blob_bytes_served(vision_head) == served  # the node had it: nothing moved
    assert usage.prompt_tokens > text_only.usage.prompt_tokens + IMAGE_TOKENS
    assert usage.prompt_tokens_details.cached_tokens > IMAGE_TOKENS  # the image's KV was reused, not embedded again


def test_an_image_the_node_cannot_decode_is_a_400_saying_so(vision_head):
    broken = IMAGE[:80]  # its header is whole, its pixels are cut off
    with pytest.raises(BadRequestError) as refused:
        client_of(vision_head).chat.completions.create(model="smollm2", messages=[asking(broken)], max_tokens=4)
    assert "could not be decoded" in refused.value.body["message"]


def test_with_only_a_node_without_a_projector_left_an_image_is_a_400_naming_vision_and_the_flag(vision_head):
    """Last in this module: it stops the node that has the projector."""
    vision_head.nodes["seeing"].stop()
    client = client_of(vision_head)

    def refusal() -> dict | None:
        try:
            client.chat.completions.create(model="smollm2", messages=[asking()], max_tokens=4,
                                           extra_body={"deadline_ms": 2000})
        except BadRequestError as exc:
            return exc.body
        except APIStatusError:  # placed before the head saw the node go
            return None
        return None

    error = wait_for(refusal, 30, "an image was never refused with only the blind node left")
    assert error["code"] == "capability_unavailable" and error["param"] == "vision"
    assert "--mmproj" in error["message"] and "blind" in error["message"]


def test_the_seeing_node_pulled_its_projector_from_the_registry(vision_head):
    from tests.vision_projector import build_projector

    size = build_projector(vision_head.home / "same-projector.gguf").stat().st_size  # the same seed: the same file
    assert blob_bytes_served(vision_head) >= size
    # its progress lines, then the engine loaded it (early in the log: the tail `log()` keeps has moved past them)
    assert "pulling eyes: " in vision_head.nodes["seeing"].log_path.read_text(errors="replace")
