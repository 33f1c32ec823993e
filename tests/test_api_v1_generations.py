"""/v1 generations through the head with a fake node link: what the client receives, what the node is asked,
what is recorded. (Real nodes: test_api_e2e.)"""

import asyncio
import base64
import json
import struct

import pytest
from asgiref.sync import sync_to_async

from api.grammars import JSON_GBNF
from sessions.models import Generation, Message
from sessions.services import grammar_handle_create, logit_bias_handle_create, session_create
from tests.api_support import FakeLink, Script, add_fake_node, request, start, written_rows

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat(**extra):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], **extra}


@sync_to_async
def generations(**filters):
    return list(Generation.objects.filter(**filters).values())


@pytest.fixture
def fast_sse(monkeypatch):
    """Headers after 50 ms without an event, keep-alives every 50 ms: streaming-path tests need no real waits."""
    monkeypatch.setattr("api.sse.HEADER_WAIT_S", 0.05)
    monkeypatch.setattr("api.sse.KEEPALIVE_S", 0.05)


async def test_chat_answer_says_its_node_and_cached_tokens_and_is_recorded_once(bearer, api_key_pair):
    link = add_fake_node()
    ex = await request("POST", CHAT, key=bearer, body=chat(temperature=0.2, top_k=7, min_p=0.1, seed=42, stop="END",
                                                         presence_penalty=0.5, frequency_penalty=-0.5,
                                                         repeat_penalty=1.1, ignore_eos=True, max_tokens=30,
                                                         logit_bias={"15": -100}))
    assert ex.status == 200 and ex.headers["x-fleet-node"] == "fake-node"
    body = ex.json()
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-" + ex.headers["x-fleet-generation"]
    assert body["system_fingerprint"] == "fleet:fake-node"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello, world!",
                                                        "refusal": None}, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    spec = link.specs[0]
    assert spec["messages"] == [{"role": "user", "content": "Hi"}]
    assert (spec["temperature"], spec["top_k"], spec["min_p"], spec["seed"], spec["stop"]) == (0.2, 7, 0.1, 42, ["END"])
    assert (spec["presence_penalty"], spec["frequency_penalty"], spec["repeat_penalty"]) == (0.5, -0.5, 1.1)
    assert spec["ignore_eos"] is True and spec["max_tokens"] == 30 and spec["logit_bias"] == {15: -100.0}
    rows = await generations()
    assert len(rows) == 1
    row = rows[0]
    assert row["id"].hex == ex.headers["x-fleet-generation"] and row["status"] == "done"
    assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == (11, 3, 4)
    assert row["api_key_id"] == api_key_pair[0].id and row["nodes_used"] == ["fake-node"] and row["kind"] == "chat"


async def test_chat_stream_is_openai_chunks_ending_with_usage_and_done(bearer):
    add_fake_node()
    ex = await request("POST", CHAT, key=bearer, body=chat(stream=True, stream_options={"include_usage": True}))
    assert ex.status == 200
    assert ex.headers["content-type"].startswith("text/event-stream")
    assert ex.headers["x-accel-buffering"] == "no" and ex.headers["cache-control"] == "no-cache"
    data = ex.data()
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello, world!"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert [r["status"] for r in await generations()] == ["done"]


async def test_the_generation_endpoints_are_served_ahead_of_djangos_handler(bearer):
    """api.streaming_app: the four generation endpoints never enter Django's handler; the rest of /v1 does."""
    from django.core.signals import request_started

    add_fake_node()
    started: list[str] = []

    def note(scope=None, **_):
        started.append(scope["path"])

    request_started.connect(note)
    try:
        for path, body in ((CHAT, chat(stream=True)), ("/v1/completions", {"model": "smollm2", "prompt": "Hi"}),
                           ("/v1/responses", {"model": "smollm2", "input": "Hi"}),
                           ("/v1/messages", {"model": "smollm2", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": "Hi"}]})):
            assert (await request("POST", path, key=bearer, body=body)).status == 200, path
        assert (await request("GET", "/v1/models", key=bearer)).status == 200
    finally:
        request_started.disconnect(note)
    assert started == ["/v1/models"]


async def test_a_generation_requests_synchronous_work_runs_on_a_thread_of_its_own(bearer, monkeypatch):
    """api.streaming_app: as under Django's handler, a request's sync_to_async calls (here its parse, which a body
    with tools makes in a thread) run on a thread of the request's own, not on the one every caller outside a request
    shares, where one slow call would hold up every other request's."""
    import threading

    from api import v1

    parsed_on: list[threading.Thread] = []
    original = v1.chat_request

    def spy(*args, **kwargs):
        parsed_on.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(v1, "chat_request", spy)
    add_fake_node()
    assert (await request("POST", CHAT, key=bearer, body=chat(tools=[WEATHER]))).status == 200
    shared = await sync_to_async(threading.current_thread)()
    assert len(parsed_on) == 1 and parsed_on[0] is not shared and parsed_on[0] is not threading.current_thread()


async def test_a_client_gone_before_the_first_chunk_still_cancels_the_lane_and_leaves_a_record(bearer):
    """The view answered a stream, and the client left while its headers were being sent: the loop never started,
    and the app abandons the run itself (the node's lane cancelled, the record written as cancelled)."""
    from fleet.asgi import application

    link = add_fake_node(FakeLink(script=Script(hang=True)), lanes=1)
    payload = json.dumps(chat(stream=True)).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {bearer}".encode()),
                         (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}
    heading, gone = asyncio.Event(), asyncio.Event()
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):  # the headers never get out: the client hangs up meanwhile
        heading.set()
        await asyncio.Event().wait()

    serving = asyncio.ensure_future(application(scope, receive, send))
    await asyncio.wait_for(heading.wait(), 5)
    (gen_id,) = link.running
    gone.set()
    await asyncio.wait_for(serving, 5)
    assert gen_id in link.cancelled
    rows = await written_rows(lambda: list(Generation.objects.values_list("status", flat=True)))
    assert rows == ["cancelled"]


async def test_completion_with_logprobs_streamed_and_not(bearer):
    link = add_fake_node()
    body = {"model": "smollm2", "prompt": "Once upon", "max_tokens": 3, "logprobs": 1}
    whole = (await request("POST", "/v1/completions", key=bearer, body=body)).json()
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "Hello, world"
    assert whole["choices"][0]["finish_reason"] == "length"
    lp = whole["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hello", ",", " world"] and lp["token_logprobs"] == [-0.5] * 3
    assert lp["text_offset"] == [0, 5, 6] and lp["top_logprobs"][0] == {"Hello": -0.5}
    assert link.specs[0]["prompt"] == "Once upon" and link.specs[0]["top_logprobs"] == 1
    data = (await request("POST", "/v1/completions", key=bearer, body={**body, "stream": True})).data()
    assert "".join(c["choices"][0]["text"] for c in data[:-1]) == "Hello, world"
    assert data[-2]["choices"][0]["finish_reason"] == "length"
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in data[:2]] == [[0, 5], [6]]


async def test_chat_logprobs_have_openai_shape(bearer):
    add_fake_node()
    body = (await request("POST", CHAT, key=bearer, body=chat(logprobs=True, top_logprobs=2))).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", ",", " world", "!"]
    assert content[0] == {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}, {"token": "x", "logprob": -2.0, "bytes": [120]}]}


async def test_prompt_too_long_is_a_400_even_when_streaming(bearer):
    add_fake_node(FakeLink(script=Script(error=("context_length_exceeded", "The prompt is 9000 tokens; the "
                                                                           "context window is 2048."))))
    for stream in (False, True):
        ex = await request("POST", CHAT, key=bearer, body=chat(stream=stream))
        assert ex.status == 400 and ex.headers["content-type"] == "application/json"
        error = ex.json()["error"]
        assert error["code"] == "context_length_exceeded" and "2048" in error["message"]
        assert error["param"] == "messages"
    assert [r["status"] for r in await generations()] == ["failed", "failed"]


async def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event(bearer, fast_sse):
    add_fake_node(FakeLink(script=Script(start_delay=0.2, error=("invalid_grammar", "bad grammar at line 1"))))
    ex = await request("POST", CHAT, key=bearer, body=chat(stream=True))
    assert ex.status == 200
    events = ex.events()
    assert ": keep-alive" in events
    data = ex.data()
    assert data[-1] == "[DONE]"
    assert data[-2] == {"error": {"message": "bad grammar at line 1", "type": "invalid_request_error",
                                  "param": None, "code": "invalid_grammar"}}


async def test_no_lane_until_the_deadline_is_a_503_with_retry_after(bearer, fast_sse):
    link = add_fake_node(FakeLink(script=Script(hang=True)), lanes=1)
    busy = await start("POST", CHAT, key=bearer, body=chat(stream=True))
    await busy.wait(lambda e: e.status == 200)
    ex = await request("POST", CHAT, key=bearer, body=chat(deadline_ms=300))
    assert ex.status == 503 and ex.headers["retry-after"] == "1"
    assert ex.json()["error"]["code"] == "deadline_exceeded"
    streamed = await request("POST", CHAT, key=bearer, body=chat(stream=True, deadline_ms=400))
    assert streamed.status == 200  # headers went out before the deadline passed
    assert streamed.data()[-2]["error"]["code"] == "deadline_exceeded"
    await busy.close()
    assert len(link.specs) == 1  # the expired ones never reached the node
    statuses = sorted(r["status"] for r in await generations())
    assert statuses == ["cancelled", "expired", "expired"]


async def test_a_client_that_goes_away_cancels_the_node_lane_within_a_second(bearer):
    link = add_fake_node(FakeLink(script=Script(hang=True)), lanes=1)
    for stream in (True, False):
        ex = await start("POST", CHAT, key=bearer, body=chat(stream=stream))
        while not link.running:
            await asyncio.sleep(0.01)
        (gen_id,) = link.running
        hung_up_at = asyncio.get_running_loop().time()
        await ex.close()
        for _ in range(100):
            if gen_id in link.cancelled:
                break
            await asyncio.sleep(0.01)
        assert link.cancelled[gen_id] - hung_up_at < 1.0
    await asyncio.sleep(0.1)
    rows = await generations()
    assert [r["status"] for r in rows] == ["cancelled", "cancelled"]
    # the lane is free again: the next request runs at once
    link.script = Script()
    assert (await request("POST", CHAT, key=bearer, body=chat(deadline_ms=2000))).status == 200


async def test_tools_required_constrains_the_reply_and_returns_tool_calls(bearer):
    reply = ['{"name": "get_weather", ', '"arguments": {"city": "Paris"}}']
    link = add_fake_node(FakeLink(script=Script(tokens=reply)))
    body = chat(tools=[WEATHER], tool_choice="required")
    answer = (await request("POST", CHAT, key=bearer, body=body)).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    spec = link.specs[0]
    assert spec["messages"][0]["role"] == "system" and "get_weather" in spec["messages"][0]["content"]
    schema = json.loads(spec["json_schema"])
    assert schema["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]

    data = (await request("POST", CHAT, key=bearer, body={**body, "stream": True})).data()
    deltas = [c["choices"][0]["delta"] for c in data[:-1]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"]["name"] == "get_weather"
    assert not any(d.get("content") for d in deltas)
    assert data[-2]["choices"][0]["finish_reason"] == "tool_calls"


async def test_tools_auto_lets_prose_through_and_sends_back_earlier_calls_as_text(bearer):
    link = add_fake_node()
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    data = (await request("POST", CHAT, key=bearer, body={"model": "smollm2", "messages": history, "tools": [WEATHER],
                                                        "stream": True})).data()
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in data[:-1]) == "Hello, world!"
    assert data[-2]["choices"][0]["finish_reason"] == "stop"
    messages = link.specs[0]["messages"]
    assert link.specs[0]["json_schema"] is None
    assert json.loads(messages[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


async def test_response_formats_become_the_node_grammar(bearer):
    link = add_fake_node()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    assert (await request("POST", CHAT, key=bearer, body=chat(response_format=fmt))).status == 200
    assert (await request("POST", CHAT, key=bearer, body=chat(response_format={"type": "json_object"}))).status == 200
    assert json.loads(link.specs[0]["json_schema"]) == schema and link.specs[0]["grammar"] is None
    assert link.specs[1]["grammar"] == JSON_GBNF
    both = chat(response_format={"type": "json_object"}, grammar='root ::= "a"')
    ex = await request("POST", CHAT, key=bearer, body=both)
    assert ex.status == 400 and ex.json()["error"]["param"] == "grammar"


async def test_handles_and_inline_grammar_travel_with_the_generation(api_user, bearer):
    link = add_fake_node()
    grammar = await sync_to_async(grammar_handle_create)(kind="gbnf", source='root ::= "yes" | "no"', owner=api_user)
    schema = await sync_to_async(grammar_handle_create)(kind="json_schema", source={"type": "integer"}, owner=api_user)
    bias = await sync_to_async(logit_bias_handle_create)(bias={"7": 5, "8": -100}, owner=api_user)
    for body in (chat(grammar=str(grammar.id)), chat(grammar=str(schema.id)), chat(grammar='root ::= "ok"'),
                 chat(logit_bias_handle=str(bias.id), logit_bias={"8": 1})):
        assert (await request("POST", CHAT, key=bearer, body=body)).status == 200, body
    assert link.specs[0]["grammar"] == 'root ::= "yes" | "no"'
    assert json.loads(link.specs[1]["json_schema"]) == {"type": "integer"}
    assert link.specs[2]["grammar"] == 'root ::= "ok"'
    assert link.specs[3]["logit_bias"] == {7: 5.0, 8: 1.0}


async def test_a_session_is_continued_over_three_turns_and_written_once_per_turn(api_user, bearer):
    link = add_fake_node(FakeLink(script=lambda spec: Script(tokens=[f"answer {len(spec['messages'])}"])))
    session = await sync_to_async(session_create)(model="smollm2", owner=api_user, system_prompt="Be brief.")
    for turn in range(3):
        body = {"model": "smollm2", "session": str(session.id), "messages": [{"role": "user", "content": f"q{turn}"}]}
        ex = await request("POST", CHAT, key=bearer, body={**body, "stream": turn == 1})
        assert ex.status == 200
    assert link.specs[2]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q0"}, {"role": "assistant", "content": "answer 2"},
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "answer 4"},
        {"role": "user", "content": "q2"},
    ]
    stored = await sync_to_async(lambda: list(Message.objects.filter(session=session).values_list(
        "index", "role", "content")))()
    assert stored == [(0, "user", "q0"), (1, "assistant", "answer 2"), (2, "user", "q1"), (3, "assistant", "answer 4"),
                      (4, "user", "q2"), (5, "assistant", "answer 6")]
    assert len(await generations(session_id=session.id)) == 3


async def test_embeddings_as_floats_and_base64(bearer):
    link = add_fake_node(FakeLink(embeddings=[[0.5, -0.25], [1.0, 0.0]]))
    body = {"model": "smollm2", "input": ["a", "b"]}
    answer = (await request("POST", "/v1/embeddings", key=bearer, body=body)).json()
    assert answer["object"] == "list" and answer["model"] == "smollm2" and answer["usage"]["prompt_tokens"] == 5
    assert [d["embedding"] for d in answer["data"]] == [[0.5, -0.25], [1.0, 0.0]]
    assert link.state_ops[0] == ("embed", {"texts": ["a", "b"], "model": "smollm2"})
    encoded = (await request("POST", "/v1/embeddings", key=bearer, body={**body, "encoding_format": "base64"})).json()
    assert list(struct.unpack("<2f", base64.b64decode(encoded["data"][0]["embedding"]))) == [0.5, -0.25]
    missing = await request("POST", "/v1/embeddings", key=bearer, body={**body, "model": "bert"})
    assert missing.status == 404 and missing.json()["error"]["code"] == "model_not_found"
    empty = await request("POST", "/v1/embeddings", key=bearer, body={"model": "smollm2", "input": []})
    assert empty.status == 400 and empty.json()["error"]["param"] == "input"


def test_a_character_split_across_tokens_comes_back_whole_from_the_bytes():
    from api.responses import chat_logprobs
    star = "🌟".encode()
    pieces = [star[:2], star[2:3], star[3:]]
    entries = [{"token": p.decode(errors="replace"), "bytes": list(p), "logprob": -0.1,
                "top": [{"token": p.decode(errors="replace"), "bytes": list(p), "logprob": -0.1}]} for p in pieces]
    content = chat_logprobs(None, entries)
    assert bytes(b for c in content for b in c["bytes"]).decode() == "🌟"
    assert content[1]["top_logprobs"][0]["bytes"] == list(star[2:3])


async def test_a_batch_invariant_request_goes_only_to_a_batch_invariant_node(bearer):
    fast = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "fast-node"), lanes=4)
    steady = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "steady-node"), lanes=1,
                           capabilities=["chat", "completion", "grammar", "logprobs", "batch_invariant"])
    for _ in range(3):  # the fast node is idler and has more lanes: only the capability sends these elsewhere
        answer = await request("POST", CHAT, key=bearer, body=chat(batch_invariant=True))
        assert answer.status == 200, answer.json()
    assert len(steady.specs) == 3 and not fast.specs
    assert all(s["batch_invariant"] is True for s in steady.specs)
    other = chat(messages=[{"role": "user", "content": "Something else entirely"}])
    plain = await request("POST", CHAT, key=bearer, body=other)
    assert plain.status == 200 and len(fast.specs) == 1  # without the need, the other node is as good again


async def test_a_batch_invariant_request_with_no_such_node_is_a_400_that_names_the_flag(bearer):
    link = add_fake_node(FakeLink(identity="fast-node"))
    for stream in (False, True):
        answer = await request("POST", CHAT, key=bearer, body=chat(batch_invariant=True, stream=stream))
        assert answer.status == 400
        error = answer.json()["error"]
        assert error["code"] == "capability_unavailable" and error["param"] == "batch_invariant"
        assert "fast-node" in error["message"] and "node_join --batch-invariant" in error["message"]
    assert not link.specs  # never silently served without the guarantee


async def test_a_request_needing_a_capability_skips_nodes_without_it(bearer):
    plain = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "no-grammar"), lanes=4,
                          capabilities=["chat", "completion"])
    able = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "full"), lanes=1)
    answer = await request("POST", CHAT, key=bearer, body=chat(response_format={"type": "json_object"}, logprobs=True))
    assert answer.status == 200 and len(able.specs) == 1 and not plain.specs


@pytest.mark.parametrize("stream", [False, True])
async def test_a_node_lost_mid_stream_hands_the_next_node_exactly_what_was_streamed(bearer, stream):
    first = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "node-a",
                                   script=Script(tokens=["One", ",", " two", ",", " three"], per_batch=1,
                                                 lose_after=3)), lanes=4)
    second = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "node-b",
                                    script=Script(tokens=[",", " three", "."], first_id=500)), lanes=1)
    holds_the_prompt(first)
    answer = await request("POST", CHAT, key=bearer, body=chat(max_tokens=6, stream=stream))
    assert answer.status == 200
    text = answer_text(answer, stream)
    assert text == "One, two, three."  # no token lost or repeated across the two nodes
    resumed = second.specs[0]
    assert resumed["resume_text"] == "One, two" and resumed["resume_ids"] == [100, 101, 102]
    assert resumed["max_tokens"] == 3 and first.specs[0]["resume_ids"] == []
    record = (await generations())[0]
    assert record["nodes_used"] == ["node-a", "node-b"] and record["completion_tokens"] == 6
    # the placement evidence is stored with the record: the first choice, and the failover's
    evidence = record["placement"]
    assert evidence["node"] == "node-a" and evidence["candidates"] == 2 and "cost" in evidence
    assert [f["node"] for f in evidence["failover"]] == ["node-b"]


def answer_text(answer, stream: bool) -> str:
    """The assistant's text of a chat answer, streamed (SSE chunks) or not."""
    if stream:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in answer.data()[:-1] if c["choices"])
    return answer.json()["choices"][0]["message"]["content"]


def holds_the_prompt(link, messages=None):
    """Placement believes `link`'s node holds this chat's prompt, making it the cheapest choice for it."""
    from fleet.links import registry

    registry().placement.record(link.node_id, "earlier-generation", head_keys(messages or chat()["messages"]))


def head_keys(messages):
    """The keys the head makes for a chat to these fake nodes, which report no tokenizer (so: UTF-8 bytes)."""
    from nodes.agent.vocab import BUILTINS, BYTES
    from nodes.link.lifecycle import placement_keys
    from nodes.link.spec import GenerateSpec

    return placement_keys(GenerateSpec(gen_id="-", model="smollm2", messages=messages), BUILTINS[BYTES])


@pytest.mark.parametrize(("prompt", "cached", "completion", "expected"), [
    (-10_000_000, -5, -3, (0, 0)),  # negative counts: none
    (10**9, 10**9, 10**6, (None, None)),  # more than the request sent: at most the bound
])
async def test_node_reported_usage_is_bounded_before_the_client_the_quota_and_placement_see_it(
        bearer, monkeypatch, prompt, cached, completion, expected):
    from fleet.reported import TEMPLATE_TOKENS
    from nodes.link.lifecycle import PlacementLifecycle

    add_fake_node(FakeLink(script=Script(prompt_tokens=prompt, cached_tokens=cached,
                                         reported_completion=completion)), lanes=1)
    told: list[int] = []  # the completion tokens placement records for the node
    adone = PlacementLifecycle.adone

    async def spy(self, *args, usage, **kwargs):
        told.append(usage["completion_tokens"])
        return await adone(self, *args, usage=usage, **kwargs)
    monkeypatch.setattr(PlacementLifecycle, "adone", spy)
    body = chat()
    answer = await request("POST", CHAT, key=bearer, body=body)
    assert answer.status == 200
    usage = answer.json()["usage"]
    sent = sum(len(m["content"].encode()) + len("role") + len("content") + len(m["role"]) for m in body["messages"])
    bound = sent + TEMPLATE_TOKENS
    if expected[0] == 0:
        assert usage["prompt_tokens"] == 0 and usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert told == [0]
    else:
        assert usage["prompt_tokens"] == bound and usage["prompt_tokens_details"]["cached_tokens"] == bound
        assert told == [4]  # the four tokens it streamed, not the million it claimed
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == usage["prompt_tokens"] + 4
    record = (await generations())[0]
    assert record["prompt_tokens"] == usage["prompt_tokens"]


async def test_node_reported_embedding_tokens_are_bounded_by_the_texts_sent(bearer, monkeypatch):
    link = add_fake_node(FakeLink())

    async def state_op(op, args, timeout):
        return {"embeddings": [[0.5] for _ in args["texts"]], "prompt_tokens": -10_000_000}
    monkeypatch.setattr(link, "state_op", state_op)
    answer = await request("POST", "/v1/embeddings", key=bearer, body={"model": "smollm2", "input": ["hello"]})
    assert answer.status == 200 and answer.json()["usage"] == {"prompt_tokens": 0, "total_tokens": 0}

    async def inflated(op, args, timeout):
        return {"embeddings": [[0.5] for _ in args["texts"]], "prompt_tokens": 10**9}
    monkeypatch.setattr(link, "state_op", inflated)
    answer = await request("POST", "/v1/embeddings", key=bearer, body={"model": "smollm2", "input": ["hello"]})
    assert answer.json()["usage"]["prompt_tokens"] == len("hello") + 2


async def test_an_embedding_whose_node_link_closes_is_answered_by_another_node(bearer, monkeypatch):
    from nodes.link.messages import LinkClosed

    closing = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "closing"), lanes=4)  # tried first
    able = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "able", embeddings=[[1.0, 2.0]]))

    async def closes(op, args, timeout):
        closing.state_ops.append((op, args))
        raise LinkClosed("the node link closed")
    monkeypatch.setattr(closing, "state_op", closes)
    body = {"model": "smollm2", "input": "hello"}
    answer = await request("POST", "/v1/embeddings", key=bearer, body=body)
    assert answer.status == 200 and answer.headers["x-fleet-node"] == "able"
    assert answer.json()["data"][0]["embedding"] == [1.0, 2.0]
    assert len(closing.state_ops) == 1 and len(able.state_ops) == 1
    monkeypatch.setattr(able, "state_op", closes)  # now every node's link closes: a clear 502, no traceback
    answer = await request("POST", "/v1/embeddings", key=bearer, body=body)
    assert answer.status == 502 and answer.json()["error"]["code"] == "node_lost"


# Each node error code, by whose fault it is (nodes.link.codes.REQUEST_FAULTS says it once for the head).
REQUEST_FAULT_CODES = ["context_length_exceeded", "invalid_grammar", "invalid_request"]
NODE_FAULT_CODES = ["engine_unavailable", "engine_crashed", "engine_failed", "media_unavailable", "unknown_op",
                    "adapter_in_use", "node_lost", "node_silent"]


def test_every_node_error_code_is_classified_here():
    from nodes.link.codes import ErrorCode

    assert sorted(REQUEST_FAULT_CODES + NODE_FAULT_CODES) == sorted(c.value for c in ErrorCode)


@pytest.mark.parametrize("code", REQUEST_FAULT_CODES)
async def test_a_request_fault_before_the_first_token_is_answered_not_placed_again(bearer, code):
    broken = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "refusing",
                                    script=Script(error=(code, "the node refused the request"))), lanes=4)
    able = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "able"), lanes=1)
    holds_the_prompt(broken)  # so placement tries it first
    answer = await request("POST", CHAT, key=bearer, body=chat())
    assert answer.status == 400 and answer.json()["error"]["code"] == code
    assert len(broken.specs) == 1 and not able.specs  # another node would refuse it alike


@pytest.mark.parametrize("code", NODE_FAULT_CODES)
async def test_a_node_that_cannot_start_a_generation_hands_it_to_another_at_once(bearer, code):
    from fleet.links import registry

    broken = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "restarting",
                                    script=Script(error=(code, "the engine worker is not running"))), lanes=4)
    able = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "able"), lanes=1)
    holds_the_prompt(broken)  # so placement tries the broken node first
    answer = await request("POST", CHAT, key=bearer, body=chat())
    assert answer.status == 200 and answer.json()["choices"][0]["message"]["content"] == "Hello, world!"
    assert len(broken.specs) == 1 and len(able.specs) == 1
    record = (await generations())[0]
    assert record["status"] == "done" and record["nodes_used"] == ["restarting", "able"]
    slots = {s.identity: s.schedulable for s in registry().placement.nodes()}
    # a restarting engine gets nothing more until its heartbeat says it is back; a crash is for the heartbeat to say
    assert slots["restarting"] is (code != "engine_unavailable")


async def test_an_engine_that_dies_after_the_first_token_is_a_clear_error_not_a_retry(bearer):
    def script(spec):
        return Script(tokens=["Hi"], hang=True)

    crashing = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "crashing", script=script))
    other = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "other"), lanes=1)
    task = asyncio.ensure_future(request("POST", CHAT, key=bearer, body=chat(stream=True)))
    for _ in range(100):
        if crashing.specs or other.specs:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    served_by = crashing if crashing.specs else other
    gen_id = next(iter(served_by.running))
    from fleet.links import registry
    from nodes.link.messages import Error

    served_by.running[gen_id].cancel()
    registry().relay_push(gen_id, Error(gen_id=gen_id, code="engine_crashed", message="the engine worker died"))
    answer = await task
    data = answer.data()
    assert data[-2]["error"]["code"] == "engine_crashed"
    assert len(crashing.specs) + len(other.specs) == 1


def _echo_or_hang(spec):
    """A node that answers a message with its own text, and never ends the one that says "blocker"."""
    content = spec["messages"][-1]["content"]
    return Script(tokens=[content], hang=content == "blocker")


def _asker(bearer):
    def ask(content, deadline_ms):
        body = chat(messages=[{"role": "user", "content": content}], deadline_ms=deadline_ms)
        return asyncio.ensure_future(request("POST", CHAT, key=bearer, body=body))

    return ask


async def test_waiting_generations_get_a_free_lane_in_deadline_order(bearer):
    link = add_fake_node(FakeLink(script=_echo_or_hang), lanes=1)
    ask = _asker(bearer)
    blocker = ask("blocker", 60_000)
    while not link.running:
        await asyncio.sleep(0.01)
    late = ask("late", 50_000)  # asks first, but may wait longer
    await asyncio.sleep(0.2)
    early = ask("early", 20_000)
    await asyncio.sleep(0.2)
    assert len(link.specs) == 1  # both wait for the one lane
    await link.send_cancel(next(iter(link.running)), "test")
    await asyncio.gather(blocker, late, early)
    assert [s["messages"][-1]["content"] for s in link.specs] == ["blocker", "early", "late"]


async def test_a_newcomer_does_not_take_a_free_lane_from_an_earlier_deadline_still_waiting(bearer, monkeypatch):
    """The waiting room's `ahead` guard: a lane freed while the waiter has not yet woken goes to the waiter, not to
    a generation with a later deadline that happens to look first."""
    from fleet.links import registry

    monkeypatch.setattr("fleet.placing.WAKE_CHECK_S", 3600.0)  # only wakes move the waiter
    link = add_fake_node(FakeLink(script=_echo_or_hang), lanes=1)
    ask = _asker(bearer)
    blocker = ask("blocker", 60_000)
    while not link.running:
        await asyncio.sleep(0.01)
    early = ask("early", 20_000)
    await asyncio.sleep(0.2)
    lanes = registry().lanes
    # the lane frees, and the waiter is not woken yet (every wake, this process's or Redis's, passes here)
    lanes._schedule = lambda: None
    try:
        await link.send_cancel(next(iter(link.running)), "test")
        await blocker
        late = ask("late", 50_000)  # looks while the lane is free and "early" still sleeps
        await asyncio.sleep(0.3)
        assert [s["messages"][-1]["content"] for s in link.specs] == ["blocker"]
    finally:
        del lanes._schedule
    lanes.notify()
    await asyncio.wait_for(asyncio.gather(early, late), 30)
    assert [s["messages"][-1]["content"] for s in link.specs] == ["blocker", "early", "late"]


async def test_a_waiting_generation_is_woken_when_the_lane_frees_not_by_a_timer(bearer, monkeypatch):
    monkeypatch.setattr("fleet.placing.WAKE_CHECK_S", 3600.0)  # no periodic look: only the lane's end wakes it
    link = add_fake_node(FakeLink(script=lambda spec: Script(tokens=["x"], hang=spec["messages"][-1]["content"]
                                                               == "blocker")), lanes=1)
    blocker = asyncio.ensure_future(request("POST", CHAT, key=bearer,
                                            body=chat(messages=[{"role": "user", "content": "blocker"}])))
    while not link.running:
        await asyncio.sleep(0.01)
    waiter = asyncio.ensure_future(request("POST", CHAT, key=bearer, body=chat()))
    await asyncio.sleep(0.3)
    assert len(link.specs) == 1 and not waiter.done()
    await link.send_cancel(next(iter(link.running)), "test")
    assert (await asyncio.wait_for(waiter, 30)).status == 200
    await blocker


@pytest.mark.parametrize("stream", [False, True])
async def test_a_token_batch_lost_in_transit_is_regenerated_elsewhere_not_skipped(bearer, stream):
    """The channel layer between head processes can drop a message: a gap in a node's batch numbers is a lost
    node, so the generation resumes on another from exactly what arrived (and the first node's later batches,
    still coming, are not mixed in)."""
    first = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "node-a",
                                   script=Script(tokens=["One", ",", " two", ",", " three", "."], per_batch=1,
                                                 drop_seq=3, delay=0.05)), lanes=4)
    second = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "node-b",
                                    script=Script(tokens=[" two", ",", " three", "."], first_id=500,
                                                  start_delay=0.2)), lanes=1)
    holds_the_prompt(first)
    answer = await request("POST", CHAT, key=bearer, body=chat(max_tokens=6, stream=stream))
    assert answer.status == 200
    text = answer_text(answer, stream)
    assert text == "One, two, three."
    assert second.specs[0]["resume_ids"] == [100, 101] and second.specs[0]["resume_text"] == "One,"
    assert (await generations())[0]["nodes_used"] == ["node-a", "node-b"]
    assert first.cancelled  # the first node, still generating, was told to stop


async def test_a_generation_whose_link_was_replaced_while_silent_is_placed_again(bearer, monkeypatch):
    """A node that rejoined (a new link) never sends the frames of a generation sent over its old one."""
    from fleet.links import registry

    monkeypatch.setattr("fleet.dispatch.LINK_CHECK_S", 0.05)
    stale = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "node-a",
                                   script=Script(tokens=["One"], hang=True)), lanes=4)
    add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "node-b",
                           script=Script(tokens=[",", " two"], first_id=500)), lanes=1)
    holds_the_prompt(stale)
    task = asyncio.ensure_future(request("POST", CHAT, key=bearer, body=chat(max_tokens=3)))
    while not stale.running:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    registry().links[stale.node_id] = FakeLink(stale.node_id, "node-a")  # the node's new link
    answer = await asyncio.wait_for(task, 10)
    assert answer.status == 200 and answer.json()["choices"][0]["message"]["content"] == "One, two"
    assert (await generations())[0]["nodes_used"] == ["node-a", "node-b"]


async def test_a_node_lost_after_the_last_asked_for_token_ends_the_answer_without_one_more(bearer):
    """Lost between its last token and its done: the answer is complete (finish reason length), and no other node
    is asked for a token the client did not ask for."""
    first = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "node-a",
                                   script=Script(tokens=["One", ",", " two"], per_batch=1, lose_after=3)), lanes=4)
    second = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "node-b",
                                    script=Script(tokens=[" extra"])), lanes=1)
    holds_the_prompt(first)
    answer = await request("POST", CHAT, key=bearer, body=chat(max_tokens=3))
    body = answer.json()
    assert answer.status == 200 and body["choices"][0]["message"]["content"] == "One, two"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    assert not second.specs


async def test_the_next_turn_goes_back_to_the_node_that_holds_the_conversation_with_its_answer(bearer):
    from fleet.links import registry

    add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "node-a"))
    add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "node-b"))
    first = await request("POST", CHAT, key=bearer, body=chat())
    served = first.json()["choices"][0]["message"]["content"]
    answered = [*chat()["messages"], {"role": "assistant", "content": served}]
    served_by = (await generations())[0]["nodes_used"][0]
    node_id = next(s.node_id for s in registry().placement.nodes() if s.identity == served_by)

    # done recorded the answer too (not only the prompt), and freed the lane
    assert registry().placement.holders(head_keys(answered)[-1].key) == {node_id}
    assert [s.running for s in registry().placement.nodes()] == [0, 0]
    more = [*answered, {"role": "user", "content": "More"}]
    second = await request("POST", CHAT, key=bearer, body=chat(messages=more))
    assert second.status == 200
    records = sorted(await generations(), key=lambda r: r["created_at"])
    assert records[1]["nodes_used"] == [served_by]
    assert records[1]["placement"]["matched_tokens"] > records[0]["placement"]["prompt_tokens_estimate"]


async def test_placement_counts_the_prompt_in_the_tokens_of_the_model_its_nodes_serve(bearer, settings, tmp_path):
    # Given a node that reported its model's tokenizer, whose file the head holds
    from fleet.links import registry
    from nodes.agent.models import resolve_model
    from nodes.agent.vocab import Vocab, tokenizer_fingerprint, vocab_gguf
    from nodes.link.prefix import _message_text
    from nodes.tokenizers import tokenizer_store

    settings.FLEET_HOME = tmp_path
    path, _ = resolve_model("smollm2")
    fingerprint = tokenizer_fingerprint(path)
    await asyncio.to_thread(tokenizer_store, fingerprint, vocab_gguf(path))
    link = add_fake_node()
    registry().placement.node_tokenizers(link.node_id, {"smollm2": fingerprint})
    messages = [{"role": "system", "content": "Tokens, not characters: ünïcödé counts differently. " * 8},
                {"role": "user", "content": "How many tokens is this?"}]

    # When a chat is placed there
    assert (await request("POST", CHAT, key=bearer, body=chat(messages=messages))).status == 200

    # Then its evidence counts the prompt in that tokenizer's tokens, exactly
    vocab = Vocab(path, fingerprint)
    [record] = await generations()
    assert record["placement"]["prompt_tokens_estimate"] == sum(len(vocab.tokenize(_message_text(m))) for m in messages)


async def test_embeddings_with_a_speech_model_are_a_400_naming_the_text_models(bearer):
    """A node serving a speech model beside its text model embeds with the text model: never under the speech
    model's name."""
    from fleet.links import registry
    from nodes.link.placement import NodeSlot
    from tests.factories import NodeFactory

    link = FakeLink(embeddings=[[0.5]])
    registry().links[link.node_id] = link
    registry().placement.node_up(NodeSlot(link.node_id, link.identity, ["smollm2", "whisper-tiny.en"], 2, 2048,
                                          capabilities=["chat", "completion", "embeddings", "transcribe"]))
    await sync_to_async(NodeFactory)(models_served=["smollm2", "whisper-tiny.en"],
                                     capabilities={"transcribe": True, "speech_models": ["whisper-tiny.en"]})
    refused = await request("POST", "/v1/embeddings", key=bearer, body={"model": "whisper-tiny.en", "input": "a"})
    error = refused.json()["error"]
    assert refused.status == 400 and error["param"] == "model" and error["code"] == "model_not_supported"
    assert "speech model" in error["message"] and "smollm2" in error["message"] and not link.state_ops
    answer = await request("POST", "/v1/embeddings", key=bearer, body={"model": "smollm2", "input": "a"})
    assert answer.status == 200


class _LeavingLink(FakeLink):
    """A node killed mid-stream: its link closes, so the head takes it out of placement too."""

    def _end(self, gen_id, frame):
        from fleet.links import NodeLost, registry

        if isinstance(frame, NodeLost):
            registry().placement.node_down(self.node_id)
        super()._end(gen_id, frame)


async def test_the_last_node_of_a_model_lost_mid_stream_is_an_error_naming_it_not_model_not_found(bearer):
    add_fake_node(_LeavingLink("11111111-1111-1111-1111-111111111111", "only-node",
                               script=Script(tokens=["One", ",", " two", "."], per_batch=1, lose_after=2)))
    answer = await request("POST", CHAT, key=bearer, body=chat(max_tokens=6))
    error = answer.json()["error"]
    assert answer.status == 502 and error["code"] == "node_lost", error
    assert "only-node" in error["message"] and "no other node serves 'smollm2'" in error["message"]


async def test_a_model_whose_every_node_is_drained_is_a_503_at_once_and_not_listed(bearer):
    from fleet.links import registry
    from nodes.models import Node
    from tests.factories import NodeFactory

    link = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "held-node"))
    await sync_to_async(NodeFactory)(id=link.node_id, identity="held-node", state=Node.State.DRAINING)
    registry().placement.set_schedulable(link.node_id, False)
    answer = await request("POST", CHAT, key=bearer, body=chat(deadline_ms=3000))
    error = answer.json()["error"]
    assert answer.status == 503 and error["code"] == "model_unavailable", error
    assert "'held-node' (draining)" in error["message"] and not link.specs
    listed = (await request("GET", "/v1/models", key=bearer)).json()["data"]
    assert listed == []
