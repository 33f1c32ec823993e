"""The API as application developers use it: a real head (daphne), a real SmolLM2 node, the official `openai`
client, a websocket client and plain HTTP. Answers are kept short: the machine has two cores."""

import asyncio
import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import websockets

pytestmark = pytest.mark.slow

MODEL = "smollm2"
HI = [{"role": "user", "content": "Say hello."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(live_head, live_node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_head.url}/v1", api_key=live_head.api_key, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def http(live_head, live_node) -> httpx.Client:
    return httpx.Client(base_url=live_head.url, headers={"Authorization": f"Bearer {live_head.api_key}"}, timeout=180)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_chat_and_completions_streaming_and_not(client, http):
    models = [m.id for m in client.models.list()]
    assert models == [MODEL]
    answer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.system_fingerprint == "fleet:node-a"
    assert answer.usage.completion_tokens <= 8 and answer.usage.prompt_tokens > 0
    again = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its prefix was kept

    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert streamed == completion.choices[0].text  # greedy: the same text either way

    record = http.get("/api/generations/", params={"model": MODEL, "node": "node-a"}).json()["results"][0]
    assert record["status"] == "done" and record["node_identity"] == "node-a" and record["completion_tokens"] > 0


def test_a_forced_tool_call_comes_back_as_tool_calls(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=30, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


def test_a_json_schema_answer_parses_and_matches_its_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person. Reply in JSON."}], max_tokens=30,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_logprobs_in_chat_and_completions(client):
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, logprobs=True, top_logprobs=2)
    tokens = chat.choices[0].logprobs.content
    assert len(tokens) == chat.usage.completion_tokens and all(t.logprob <= 0 for t in tokens)
    # a token may hold part of a character (an emoji is often three tokens): the bytes put the text together
    assert bytes(b for t in tokens for b in t.bytes).decode() == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 for t in tokens)
    completion = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, logprobs=2, temperature=0)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == completion.choices[0].text and lp.text_offset[0] == 0


def test_a_request_for_batch_invariance_on_a_default_node_is_a_400_naming_the_flag(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body={"batch_invariant": True})
    error = refused.value.body
    assert error["code"] == "capability_unavailable" and error["param"] == "batch_invariant"
    assert "node_join --batch-invariant" in error["message"]


def test_embeddings(client):
    result = client.embeddings.create(model=MODEL, input=["a cat", "a stock market report"])  # base64 on the wire
    first, second = (d.embedding for d in result.data)
    assert len(first) == len(second) > 8 and first != second
    assert result.usage.prompt_tokens > 0


def test_the_websocket_streams_two_generations_at_once(live_head, live_node):
    async def run():
        url = live_head.url.replace("http://", "ws://") + "/ws/v1/generate"
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {live_head.api_key}"}) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "chat", "model": MODEL, "messages": HI,
                                      "max_tokens": 6}))
            await ws.send(json.dumps({"type": "generate", "id": "text", "model": MODEL, "prompt": "One, two,",
                                      "max_tokens": 4}))
            frames, ended = [], set()
            while len(ended) < 2:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
                frames.append(frame)
                if frame["type"] in ("done", "error"):
                    ended.add(frame["id"])
            return frames

    frames = asyncio.run(run())
    for cid in ("chat", "text"):
        mine = [f for f in frames if f["id"] == cid]
        assert [f["seq"] for f in mine] == list(range(1, len(mine) + 1))
        assert mine[-1]["type"] == "done" and mine[-1]["node"] == "node-a"
        assert mine[-1]["usage"]["completion_tokens"] > 0 and "".join(f["text"] for f in mine[:-1])

    async def refused():
        url = live_head.url.replace("http://", "ws://") + "/ws/v1/generate?api_key=fk-0.wrong"
        async with websockets.connect(url) as ws:
            frame = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            return frame, closed.value.rcvd.code

    frame, code = asyncio.run(refused())
    assert code == 4401 and frame["code"] == "unauthorized"


def test_a_server_side_session_over_three_turns(client, http):
    session = http.post("/api/sessions/", json={"model": MODEL, "system_prompt": "You are terse."}).json()
    for question in ("My name is Ada.", "What is my name?", "Thanks."):
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                max_tokens=8, extra_body={"session": session["id"]})
        assert answer.choices[0].message.content
    messages = http.get(f"/api/sessions/{session['id']}/messages/").json()["results"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert [m["content"] for m in messages[::2]] == ["My name is Ada.", "What is my name?", "Thanks."]
    records = http.get("/api/generations/", params={"session": session["id"]}).json()["results"]
    assert len(records) == 3 and all(r["status"] == "done" for r in records)
    # the last turn re-read little: the conversation so far was still in the node's cache
    assert records[0]["cached_tokens"] > 0


@pytest.mark.parametrize("call, status, code, words", [
    (lambda c: c.chat.completions.create(model=MODEL, messages=[]), 400, "invalid_request", "messages"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=HI, max_tokens=-1), 400, "invalid_request",
     "max_tokens"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=HI, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}), 400,
     "invalid_json_schema", "schema"),
    (lambda c: c.chat.completions.create(model="gpt-unknown", messages=HI), 404, "model_not_found", MODEL),
    # past SmolLM2's trained 8,192 tokens, the most a node's window is sized to without --max-context
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 10000}],
                                         max_tokens=4), 400, "context_length_exceeded", "context"),
])
def test_bad_inputs_get_the_right_status_and_a_clear_message(client, call, status, code, words):
    with pytest.raises(openai.APIStatusError) as caught:
        call(client)
    error = caught.value
    assert error.status_code == status and error.code == code and words in error.message


def test_malformed_bodies_and_content_types(live_head, http):
    bad = http.post("/v1/chat/completions", content=b"{oops", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    plain = http.post("/v1/chat/completions", content=b"hello", headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
    anonymous = httpx.post(f"{live_head.url}/v1/chat/completions", json={"model": MODEL, "messages": HI})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "missing_api_key"


def fleet(http) -> dict:
    return http.get("/api/fleet/").json()


def test_a_client_that_goes_away_cancels_its_generation(client, http):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to 1000."}],
                                            max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    while not next(chunks).choices[0].delta.content:
        pass
    gen_id = stream.response.headers["x-fleet-generation"]
    stream.close()
    record = wait_until(lambda: http.get(f"/api/generations/{gen_id}/").json().get("status"), 10,
                        "the generation record")
    record = http.get(f"/api/generations/{gen_id}/").json()
    assert record["status"] == "cancelled" and record["completion_tokens"] < 1500
    wait_until(lambda: fleet(http)["lanes_busy"] == 0, 5, "the lane to free")


def test_with_every_lane_busy_a_request_expires_at_its_deadline(live_head, client, http):
    lanes = fleet(http)["lanes_total"]
    started = threading.Barrier(lanes + 1, timeout=180)
    stop = threading.Event()
    firsts = []

    def occupy():
        # Keep reading: a client that stops reading and drops the connection has gone away, and its lane is freed.
        with httpx.stream("POST", f"{live_head.url}/v1/completions", timeout=180, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True},
                headers={"Authorization": f"Bearer {live_head.api_key}"}) as response:
            running = False
            for line in response.iter_lines():
                if not running and line.startswith("data: {") and '"text":""' not in line:
                    firsts.append(line)
                    running = True
                    started.wait()
                if stop.is_set():
                    break

    threads = [threading.Thread(target=occupy, daemon=True) for _ in range(lanes)]
    for thread in threads:
        thread.start()
    try:
        started.wait()
        status = fleet(http)
        assert status["lanes_free"] == 0, (status, firsts)
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, extra_body={"deadline_ms": 1500})
        assert 1.4 < time.monotonic() - began < 10
        assert caught.value.status_code == 503 and caught.value.code == "deadline_exceeded"
        assert caught.value.response.headers["retry-after"] == "1"
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    wait_until(lambda: fleet(http)["lanes_busy"] == 0, 10, "the lanes to free after their clients left")
    expired = http.get("/api/generations/", params={"status": "expired"}).json()["results"]
    assert expired and expired[0]["node"] is None and expired[0]["completion_tokens"] == 0
