"""What the head streams is JSON any client parses, the standard library's compact UTF-8 byte for byte but for a
float's exponent (1e-7 where it wrote 1e-07) (api/json_out.py): SSE chunks and client websocket frames."""

from __future__ import annotations

import json

import pytest

from api.consumers import ClientStreamConsumer
from api.json_out import json_bytes, json_text
from api.sse import sse_event

CHUNKS = [
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1796228955, "model": "smollm2",
     "system_fingerprint": "fleet:local",
     "choices": [{"index": 0, "delta": {"content": " déjà vu 😀 \"quoted\"\n\t"}, "logprobs": None,
                  "finish_reason": None}]},
    {"type": "token", "id": 7, "seq": 3, "text": "Hello,", "logprobs": [{"token": "Hello", "logprob": -0.25,
                                                                          "top_logprobs": [{"x": -1.5e-07}]}]},
    {"type": "done", "usage": {"prompt_tokens": 12, "completion_tokens": 0, "total_tokens": 12},
     "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": "{\"a\": [1, 2.5, true]}"}}],
     "empty": {}, "none": [], "flag": False},
]


def strict(data: bytes | str):
    """json.loads that refuses NaN and the infinities, as a browser's JSON.parse does."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(data, parse_constant=refuse)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunks_encode_as_the_standard_librarys_compact_utf8(chunk):
    standard = json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
    ours = json_bytes(chunk)
    assert strict(ours) == chunk
    assert ours.replace(b"e-7", b"e-07") == standard
    assert sse_event(chunk) == b"data: " + ours + b"\n\n"
    assert json_text(chunk) == ours.decode()


def test_what_the_fast_encoder_refuses_still_encodes():
    assert json_bytes({1: "a", "b": 2**70}) == b'{"1":"a","b":1180591620717411303424}'


async def test_sse_events_and_websocket_frames_are_strict_json_even_with_nan():
    value = {"logprob": float("nan"), "top": float("-inf"), "text": "é"}
    assert strict(sse_event(value)[len(b"data: "):-2]) == {"logprob": None, "top": None, "text": "é"}
    frame = await ClientStreamConsumer.encode_json(value)
    assert frame == '{"logprob":null,"top":null,"text":"é"}'
    assert strict(frame)["text"] == "é"
