"""The agents' APIs through the head with a fake node link: OpenAI's Responses API and Anthropic's Messages API
(validation, shapes, event order, stored responses, errors). The official clients against a real node:
test_agents_e2e."""

import json

import pytest
from asgiref.sync import sync_to_async

from sessions.models import Generation, StoredResponse
from tests.api_support import FakeLink, Script, add_fake_node, request
from tests.test_metrics import fresh_store  # noqa: F401 - a metrics store of each test's own

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = ['{"name": "get_weather", ', '"arguments": {"city": "Paris"}}']


@sync_to_async
def generations():
    return list(Generation.objects.order_by("created_at").values("kind", "status"))


@pytest.fixture
def fast_sse(monkeypatch):
    monkeypatch.setattr("api.sse.HEADER_WAIT_S", 0.05)
    monkeypatch.setattr("api.sse.KEEPALIVE_S", 0.05)


def sse(ex) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    out = []
    for block in ex.events():
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line and not line.startswith(":"))
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


@pytest.fixture
def other_bearer():
    from api.services import api_key_create
    from tests.factories import UserFactory

    return api_key_create(owner=UserFactory(is_staff=False, is_superuser=False), name="other")[1]


@pytest.fixture
def staff_bearer():
    from api.services import api_key_create
    from tests.factories import UserFactory

    return api_key_create(owner=UserFactory(is_staff=True), name="staff")[1]


# --- /v1/responses ------------------------------------------------------------------------------------------------


async def test_a_response_is_answered_stored_listed_and_deleted_by_its_owner_only(bearer, other_bearer, staff_bearer):
    link = add_fake_node()
    ex = await request("POST", "/v1/responses", key=bearer, body={
        "model": "smollm2", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 30, "temperature": 0.5,
        "metadata": {"run": "1"}, "include": ["message.output_text.logprobs"], "top_logprobs": 1})
    assert ex.status == 200
    body = ex.json()
    assert body["id"] == "resp_" + ex.headers["x-fleet-generation"] and body["object"] == "response"
    assert body["status"] == "completed" and body["metadata"] == {"run": "1"} and body["max_output_tokens"] == 30
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    (part,) = item["content"]
    assert part["type"] == "output_text" and part["text"] == "Hello, world!"
    assert [t["token"] for t in part["logprobs"]] == ["Hello", ",", " world", "!"]
    assert len(part["logprobs"][0]["top_logprobs"]) == 1
    assert body["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 4,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    spec = link.specs[0]
    assert spec["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (spec["max_tokens"], spec["temperature"], spec["logprobs"], spec["top_logprobs"]) == (30, 0.5, True, 1)
    assert await generations() == [{"kind": "responses", "status": "done"}]

    path = f"/v1/responses/{body['id']}"
    assert (await request("GET", path, key=bearer)).json() == body
    assert (await request("GET", path, key=staff_bearer)).status == 200  # staff see every owner's
    items = (await request("GET", path + "/input_items", key=bearer)).json()
    assert items["object"] == "list" and items["has_more"] is False
    assert items["data"][0]["content"] == [{"type": "input_text", "text": "Hi"}]
    for method in ("GET", "DELETE"):
        theirs = await request(method, path, key=other_bearer)
        assert theirs.status == 404 and theirs.json()["error"]["code"] == "not_found"
    assert (await request("DELETE", path, key=bearer)).json() == {"id": body["id"], "object": "response",
                                                                 "deleted": True}
    assert (await request("GET", path, key=bearer)).status == 404

    unstored = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi",
                                                                        "store": False})
    assert unstored.status == 200 and not await sync_to_async(StoredResponse.objects.exists)()


async def test_a_response_streams_the_whole_event_sequence_numbered(bearer):
    add_fake_node()
    ex = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi", "stream": True})
    assert ex.status == 200 and ex.headers["content-type"].startswith("text/event-stream")
    events = sse(ex)
    kinds = [kind for kind, _ in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == kind for kind, data in events)
    assert "".join(d["delta"] for k, d in events if k == "response.output_text.delta") == "Hello, world!"
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello, world!"
    stored = await request("GET", f"/v1/responses/{final['id']}", key=bearer)
    assert stored.json()["output"] == final["output"]


async def test_a_function_call_round_trip_continues_the_stored_conversation(bearer, other_bearer):
    link = add_fake_node(FakeLink(script=lambda spec: Script(tokens=CALL if spec["json_schema"] else ["18 C."])))
    first = await request("POST", "/v1/responses", key=bearer, body={
        "model": "smollm2", "input": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
        "tool_choice": "required"})
    body = first.json()
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and body["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    assert json.loads(link.specs[0]["json_schema"])["properties"]["name"]["enum"] == ["get_weather"]
    stored = await sync_to_async(StoredResponse.objects.get)(pk=body["id"])
    assert stored.messages[-1]["tool_calls"][0]["id"] == call["call_id"]  # what the next turn's output answers

    turn = {"model": "smollm2", "previous_response_id": body["id"], "tools": [WEATHER],
            "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"}]}
    assert (await request("POST", "/v1/responses", key=other_bearer, body=turn)).status == 404
    ex = await request("POST", "/v1/responses", key=bearer, body={**turn, "stream": True})
    final = sse(ex)[-1][1]["response"]
    assert final["previous_response_id"] == body["id"] and final["output"][0]["content"][0]["text"] == "18 C."
    messages = link.specs[-1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert json.loads(messages[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3] == {"role": "tool", "content": "18 C", "tool_call_id": call["call_id"]}

    # a streamed call: its arguments in one delta, then done
    ex = await request("POST", "/v1/responses", key=bearer, body={
        "model": "smollm2", "input": "Weather?", "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                   "name": "get_weather"},
        "stream": True})
    kinds = [kind for kind, _ in sse(ex)]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]


REFUSED = [
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "very"}}, "reasoning.effort"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"max_output_tokens": 999_999}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
]


async def test_what_a_fleet_cannot_honour_is_a_4xx_naming_the_field(bearer):
    link = add_fake_node()
    for extra, param in REFUSED:
        ex = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi", **extra})
        assert ex.status in (400, 404) and ex.json()["error"]["param"] == param, (extra, ex.json())
    assert not link.specs


async def test_a_nul_in_what_a_response_keeps_is_a_400_and_with_store_false_it_is_answered(bearer):
    """PostgreSQL cannot hold a NUL character: a request that would be stored with one is refused on every backend
    (the stored conversation is what was sent, or nothing), naming the field; unstored, it is answered."""
    link = add_fake_node()
    for extra, param in [({"input": "Hi\u0000"}, "input"), ({"instructions": "\u0000"}, "instructions"),
                         ({"metadata": {"k\u0000": "v"}}, "metadata")]:
        ex = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi", **extra})
        assert ex.status == 400 and ex.json()["error"]["param"] == param, (extra, ex.json())
        assert "NUL" in ex.json()["error"]["message"]
    assert not link.specs
    ex = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi\u0000",
                                                                  "store": False})
    assert ex.status == 200 and len(link.specs) == 1
    assert not await sync_to_async(StoredResponse.objects.exists)()


async def test_text_format_json_schema_is_the_node_grammar_and_a_length_cut_is_incomplete(bearer):
    link = add_fake_node()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = (await request("POST", "/v1/responses", key=bearer, body={
        "model": "smollm2", "input": "Hi", "max_output_tokens": 2,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}})).json()
    assert json.loads(link.specs[0]["json_schema"]) == schema
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["text"]["format"]["type"] == "json_schema"


async def test_codex_clis_first_request_shape_is_served_and_says_what_it_left_out(bearer):
    """Codex CLI's first request, as it sends it (namespace and hosted tools, reasoning, developer messages), with
    our own text: the model sees every function tool, the namespace's under their own names; the hosted tool and the
    reasoning effort are left out, and the answer's X-Fleet-Left-Out header says so."""
    link = add_fake_node()
    spawn = {**WEATHER, "name": "spawn_agent", "description": "Start a helper agent"}
    ex = await request("POST", "/v1/responses", key=bearer, body={
        "model": "smollm2", "instructions": "You are a coding agent.", "stream": True, "store": False,
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        "tools": [WEATHER, {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                            "tools": [spawn]},
                  {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "c0dex", "client_metadata": {"a": "b"}})
    assert ex.status == 200, ex.body
    assert sse(ex)[-1][0] == "response.completed"
    seen = json.dumps(link.specs[0]["messages"])
    assert "get_weather" in seen and "spawn_agent" in seen and "web_search" not in seen
    left = ex.headers["x-fleet-left-out"]
    assert "tools[2] (web_search)" in left and "reasoning.effort medium" in left


async def test_a_namespaced_tools_call_comes_back_under_its_namespace(bearer):
    """A call to a namespace's function is a function_call item with the namespace named (OpenAI's shape for a
    namespaced tool), in the answer and in the stream's items."""
    spawn = ['{"name": "spawn_agent", ', '"arguments": {"city": "X"}}']
    add_fake_node(FakeLink(script=lambda spec: Script(tokens=spawn)))
    tools = [WEATHER, {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                       "tools": [{**WEATHER, "name": "spawn_agent"}]}]
    body = (await request("POST", "/v1/responses", key=bearer, body={
        "model": "smollm2", "input": "Start one.", "tools": tools, "tool_choice": "required"})).json()
    call = body["output"][0]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1")
    ex = await request("POST", "/v1/responses", key=bearer, body={
        "model": "smollm2", "input": "Start one.", "tools": tools, "tool_choice": "required", "stream": True})
    done = [data["item"] for name, data in sse(ex) if name == "response.output_item.done"]
    assert done[0]["namespace"] == "multi_agent_v1"


async def test_a_response_without_max_output_tokens_runs_to_the_window_not_a_default(bearer):
    """Codex CLI sends no max_output_tokens: the answer may run to the model's window, as on OpenAI's API (a 512
    default cut its answers short, "incomplete", and Codex exited 1); a client's own limit is kept."""
    link = add_fake_node(context_window=4096)
    await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi"})
    await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi",
                                                              "max_output_tokens": 7})
    assert [spec["max_tokens"] for spec in link.specs] == [4096, 7]


async def test_fields_an_api_does_not_know_are_accepted_ignored_and_named(bearer):
    """A top-level field from a newer client is no 400 on either agents' API: the answer comes, and
    X-Fleet-Left-Out names the field, as OpenAI's and Anthropic's servers accept what they do not know."""
    add_fake_node()
    answered = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi",
                                                                          "future_knob": {"x": 1}})
    assert answered.status == 200, answered.body
    assert "future_knob: a field Fleet does not know" in answered.headers["x-fleet-left-out"]
    answered = await request("POST", "/v1/messages", key=bearer, body=msg(future_knob=True))
    assert answered.status == 200, answered.body
    assert "future_knob: a field Fleet does not know" in answered.headers["x-fleet-left-out"]
    known = await request("POST", "/v1/messages", key=bearer, body=msg(metadata={"user_id": "u"}))
    assert "x-fleet-left-out" not in known.headers


async def test_unknown_field_names_no_header_can_carry_are_named_in_escapes(bearer):
    """A field name with a newline, characters beyond Latin-1 or no end (the fuzzer's: a 500 once, as no header can
    carry them) is named in a JSON string's escapes, cut short, and a crowd of them is counted rather than listed."""
    add_fake_node()
    odd = {"r\U0001f600\n": 1, "x" * 500: 2} | {f"k{i}": i for i in range(12)}
    answered = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi"} | odd)
    assert answered.status == 200, answered.body
    header = answered.headers["x-fleet-left-out"]
    assert header.isascii() and "\n" not in header
    assert "r\\ud83d\\ude00\\n: a field Fleet does not know" in header
    assert "x" * 48 + "...: a field" in header and "x" * 49 not in header
    assert "6 more fields Fleet does not know, ignored" in header
    hosted = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi",
                                                                        "tools": [{"type": "web\nsearch"}]})
    assert hosted.status == 200 and "tools[0] (web\\nsearch)" in hosted.headers["x-fleet-left-out"]


# --- /v1/messages -------------------------------------------------------------------------------------------------


async def test_claude_codes_first_request_shape_is_served_and_says_what_it_left_out(bearer):
    """Claude Code's first request, as it sends it (thinking, context management, effort, cache_control, a system
    message inside messages, 32,000 max_tokens), with our own text: answered, the system texts joined first."""
    link = add_fake_node()
    ex = await request("POST", "/v1/messages?beta=true", key=bearer, body={
        "model": "smollm2", "max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}, "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "system", "content": "Mind the repo."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi",
                                                   "cache_control": {"type": "ephemeral"}}]}]})
    assert ex.status == 200, ex.body
    assert sse(ex)[-1][0] == "message_stop"
    assert link.specs[0]["messages"] == [{"role": "system", "content": "You are Claude Code.\n\nMind the repo."},
                                         {"role": "user", "content": "Hi"}]
    assert "thinking (adaptive)" in ex.headers["x-fleet-left-out"]
    refused = await request("POST", "/v1/messages", key=bearer, body=msg(thinking={"type": "pondering"}))
    assert refused.status == 400 and "thinking" in refused.json()["error"]["message"]




def msg(**extra):
    return {"model": "smollm2", "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}], **extra}


async def test_a_message_with_x_api_key_answers_in_anthropic_shape_and_names_its_stop_sequence(bearer):
    link = add_fake_node(FakeLink(script=Script(stop_index=1)))
    headers = {"x-api-key": bearer, "anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-05-16"}
    ex = await request("POST", "/v1/messages?beta=true", headers=headers, body=msg(
        system=[{"type": "text", "text": "Be brief."}], stop_sequences=["END", "STOP"], top_k=5, temperature=0.3,
        metadata={"user_id": "u1"}))
    assert ex.status == 200
    body = ex.json()
    assert body == {"id": "msg_" + ex.headers["x-fleet-generation"], "type": "message", "role": "assistant",
                    "model": "smollm2", "content": [{"type": "text", "text": "Hello, world!"}],
                    "stop_reason": "stop_sequence", "stop_sequence": "STOP",
                    "usage": {"input_tokens": 8, "output_tokens": 4, "cache_read_input_tokens": 3,
                              "cache_creation_input_tokens": 0}}
    spec = link.specs[0]
    assert spec["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (spec["stop"], spec["top_k"], spec["max_tokens"]) == (["END", "STOP"], 5, 50)
    link.script = Script()
    assert (await request("POST", "/v1/messages", key=bearer, body=msg())).json()["stop_reason"] == "end_turn"
    assert (await request("POST", "/v1/messages", key=bearer, body=msg(max_tokens=2))).json()["stop_reason"] == \
        "max_tokens"
    assert [g["kind"] for g in await generations()] == ["messages"] * 3


async def test_a_message_streams_anthropic_events_with_pings_while_it_waits(bearer, fast_sse):
    add_fake_node(FakeLink(script=Script(start_delay=0.2)))
    ex = await request("POST", "/v1/messages", key=bearer, body=msg(stream=True))
    events = sse(ex)
    kinds = [k for k, _ in events if k != "ping"]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert "ping" in [k for k, _ in events]
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == "Hello, world!"
    delta = next(d for k, d in events if k == "message_delta")
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4 and delta["usage"]["cache_read_input_tokens"] == 3


async def test_a_tool_use_round_trip_in_messages(bearer):
    link = add_fake_node(FakeLink(script=lambda spec: Script(tokens=CALL if spec["json_schema"] else ["18 C."])))
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["parameters"]}]
    forced = msg(tools=tools, tool_choice={"type": "any"})
    body = (await request("POST", "/v1/messages", key=bearer, body=forced)).json()
    assert body["stop_reason"] == "tool_use"
    (use,) = body["content"]
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["input"] == {"city": "Paris"}
    ex = await request("POST", "/v1/messages", key=bearer, body=msg(tools=tools, tool_choice={"type": "any"},
                                                                     stream=True))
    events = sse(ex)
    block = events[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert json.loads(events[2][1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert next(d for k, d in events if k == "message_delta")["delta"]["stop_reason"] == "tool_use"

    turn = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": body["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "18 C"}]}]
    answer = (await request("POST", "/v1/messages", key=bearer, body=msg(tools=tools, messages=turn))).json()
    assert answer["content"] == [{"type": "text", "text": "18 C."}] and answer["stop_reason"] == "end_turn"
    messages = link.specs[-1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[3] == {"role": "tool", "content": "18 C", "tool_call_id": use["id"]}


ERRORS = [  # in this order: the last one leaves the node's one lane busy
    ("no max_tokens", 400, "invalid_request_error"),
    ("bad key", 401, "authentication_error"),
    ("unknown model", 404, "not_found_error"),
    ("prompt over the window", 400, "invalid_request_error"),
    ("server tool", 400, "invalid_request_error"),
    ("no lane", 529, "overloaded_error"),
]


async def test_messages_errors_are_anthropic_errors_with_anthropic_statuses(bearer, fast_sse):
    too_long = Script(error=("context_length_exceeded", "The prompt is 9000 tokens; the context window is 2048."))
    add_fake_node(FakeLink(script=lambda spec: too_long if spec["messages"][-1]["content"] == "LONG" else
                           Script(hang=True)), lanes=1)
    for case, status, kind in ERRORS:
        body, key = msg(), bearer
        if case == "no max_tokens":
            del body["max_tokens"]
        elif case == "bad key":
            key = "fk-wrong"
        elif case == "unknown model":
            body["model"] = "nope"
        elif case == "prompt over the window":
            body["messages"] = [{"role": "user", "content": "LONG"}]
        elif case == "server tool":
            body["tools"] = [{"type": "web_search_20250305", "name": "web_search"}]
        elif case == "no lane":
            await start_hanging(bearer)
            body["deadline_ms"] = 200
        ex = await request("POST", "/v1/messages", headers={"x-api-key": key}, body=body)
        error = ex.json()
        assert ex.status == status and error["type"] == "error" and error["error"]["type"] == kind, (case, error)
        assert error["error"]["message"]
        if case == "prompt over the window":
            assert "2048" in error["error"]["message"] and "9000" in error["error"]["message"]


async def test_a_key_over_its_quota_is_anthropics_rate_limit_error_with_retry_after(api_user):
    from api.services import api_key_create

    add_fake_node()
    _, key = await sync_to_async(api_key_create)(owner=api_user, name="slow", quotas={"requests_per_minute": 1})
    assert (await request("POST", "/v1/messages", headers={"x-api-key": key}, body=msg())).status == 200
    ex = await request("POST", "/v1/messages", headers={"x-api-key": key}, body=msg())
    assert ex.status == 429 and int(ex.headers["retry-after"]) >= 1
    assert ex.json()["error"]["type"] == "rate_limit_error"


async def start_hanging(bearer):
    from tests.api_support import start

    ex = await start("POST", "/v1/messages", key=bearer, body=msg())
    from fleet.links import registry

    for _ in range(100):
        if any(s.running for s in registry().placement.nodes()):
            return ex
        import asyncio

        await asyncio.sleep(0.02)
    raise AssertionError("the first message never took the lane")


async def test_count_tokens_reads_the_prompt_with_the_models_tokenizer_on_the_head(bearer):
    link = add_fake_node()
    short = await request("POST", "/v1/messages/count_tokens", key=bearer, body={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]})
    longer = await request("POST", "/v1/messages/count_tokens", key=bearer, body={
        "model": "smollm2", "system": "Be brief.", "messages": [{"role": "user", "content": "Hi there"}]})
    assert short.status == 200 and short.json()["input_tokens"] > 0
    assert longer.json()["input_tokens"] > short.json()["input_tokens"]
    assert not link.specs  # no node was asked
    missing = await request("POST", "/v1/messages/count_tokens", key=bearer, body={"model": "nope", "messages": [
        {"role": "user", "content": "Hi"}]})
    assert missing.status == 404 and missing.json()["error"]["type"] == "not_found_error"


# --- model aliases ------------------------------------------------------------------------------------------------


async def test_an_alias_names_a_served_model_in_every_api_and_an_unknown_name_stays_a_404(bearer, staff_bearer):
    link = add_fake_node()
    alias = {"name": "claude-haiku-4-5", "target": "smollm2"}
    assert (await request("POST", "/api/model-aliases/", key=bearer, body=alias)).status == 403  # staff only
    made = await request("POST", "/api/model-aliases/", key=staff_bearer, body=alias)
    assert made.status == 201 and made.json()["target"] == "smollm2"
    same = await request("POST", "/api/model-aliases/", key=staff_bearer, body={"name": "x", "target": "x"})
    assert same.status == 400

    listed = (await request("GET", "/v1/models", key=bearer)).json()["data"]
    assert [(m["id"], m.get("alias_of")) for m in listed] == [("claude-haiku-4-5", "smollm2"), ("smollm2", None)]
    assert (await request("GET", "/v1/models/claude-haiku-4-5", key=bearer)).json()["alias_of"] == "smollm2"
    chat = {"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "Hi"}]}
    assert (await request("POST", "/v1/chat/completions", key=bearer, body=chat)).status == 200
    assert (await request("POST", "/v1/responses", key=bearer, body={"model": "claude-haiku-4-5",
                                                                     "input": "Hi"})).status == 200
    assert (await request("POST", "/v1/messages", key=bearer, body=msg(model="claude-haiku-4-5"))).status == 200
    assert [spec["model"] for spec in link.specs] == ["smollm2"] * 3
    embedded = await request("POST", "/v1/embeddings", key=bearer, body={"model": "claude-haiku-4-5", "input": "Hi"})
    assert embedded.status == 200 and len(embedded.json()["data"]) == 1

    await request("DELETE", f"/api/model-aliases/{made.json()['id']}/", key=staff_bearer)
    gone = await request("POST", "/v1/chat/completions", key=bearer, body=chat)
    assert gone.status == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert "smollm2" in gone.json()["error"]["message"]


# --- one path underneath ------------------------------------------------------------------------------------------


async def test_both_apis_are_counted_by_api_and_a_client_that_leaves_cancels_the_lane(bearer, fresh_store):  # noqa: F811
    from fleet import metrics
    from tests.api_support import start
    from tests.test_metrics_events import counted

    link = add_fake_node(FakeLink(script=Script(hang=True)))
    for path, body in (("/v1/responses", {"model": "smollm2", "input": "Hi", "stream": True}),
                       ("/v1/messages", msg(stream=True))):
        ex = await start("POST", path, key=bearer, body=body)
        await ex.wait(lambda e: b"delta" in e.body)
        await ex.close()
    assert len(link.cancelled) == 2  # each stream's lane was cancelled when its client hung up
    link.script = Script()
    await request("POST", "/v1/messages", key=bearer, body=msg())
    assert counted(metrics.API_GENERATIONS, "responses", "cancelled") == 1
    assert counted(metrics.API_GENERATIONS, "messages", "cancelled") == 1
    assert counted(metrics.API_GENERATIONS, "messages", "done") == 1


def test_stored_responses_expire_with_the_sessions_retention(settings, api_key_pair):
    from datetime import timedelta

    from django.utils import timezone

    from sessions.services import stored_response_create
    from sessions.tasks import session_expire_task

    settings.FLEET_SESSION_TTL_DAYS = 30
    for name, age in (("resp_old", 31), ("resp_new", 1)):
        stored_response_create(response_id=name, model="smollm2", api_key=api_key_pair[0], messages=[],
                               input_items=[], body={})
        StoredResponse.objects.filter(pk=name).update(created_at=timezone.now() - timedelta(days=age))
    assert session_expire_task() == 1
    assert list(StoredResponse.objects.values_list("id", flat=True)) == ["resp_new"]


async def test_images_in_both_apis_reach_the_node_by_hash(bearer, settings, tmp_path):
    import base64
    import hashlib

    from tests.vision_projector import png

    settings.FLEET_HOME = tmp_path
    link = add_fake_node(capabilities=["chat", "completion", "vision"])
    image = png()
    encoded = base64.b64encode(image).decode()
    responses = {"model": "smollm2", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{encoded}"}]}]}
    messages = msg(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}}]}])
    assert (await request("POST", "/v1/responses", key=bearer, body=responses)).status == 200
    assert (await request("POST", "/v1/messages", key=bearer, body=messages)).status == 200
    for spec in link.specs:
        text, part = spec["messages"][-1]["content"]
        assert text == {"type": "text", "text": "What is it?"}
        assert part["type"] == "image" and part["image"]["sha256"] == hashlib.sha256(image).hexdigest()
    bad = msg(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "file", "id": "x"}}]}])
    refused = await request("POST", "/v1/messages", key=bearer, body=bad)
    assert refused.status == 400 and "source" in refused.json()["error"]["message"]


THOUGHT = ["<thi", "nk>\nThe user greets me", "; I greet back.\n</th", "ink>\n\nHel", "lo!"]


async def test_a_thinking_models_thinking_is_a_thinking_block_whole_and_streamed(bearer):
    """A model whose chat template thinks (Qwen3's <think>) answered with its thinking inside the text: it is a
    `thinking` block before the answer's, in the whole message and as `thinking_delta` events, tags cut across
    token batches included; a tool call after the thinking is still a call."""
    add_fake_node(FakeLink(script=lambda spec: Script(tokens=THOUGHT, per_batch=1)))
    body = (await request("POST", "/v1/messages", key=bearer, body=msg(thinking={"type": "adaptive"}))).json()
    assert [block["type"] for block in body["content"]] == ["thinking", "text"]
    assert body["content"][0]["thinking"] == "The user greets me; I greet back."
    assert body["content"][1]["text"] == "Hello!" and body["stop_reason"] == "end_turn"
    events = sse(await request("POST", "/v1/messages", key=bearer, body=msg(thinking={"type": "adaptive"},
                                                                           stream=True)))
    starts = [(d["index"], d["content_block"]["type"]) for k, d in events if k == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    thought = "".join(d["delta"]["thinking"] for k, d in events if k == "content_block_delta" and d["index"] == 0)
    assert thought == "The user greets me; I greet back."
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta" and d["index"] == 1) == \
        "Hello!"
    assert [d["index"] for k, d in events if k == "content_block_stop"] == [0, 1]
    assert not any("<think>" in json.dumps(d) for _, d in events)


async def test_a_thinking_models_tool_call_after_its_thinking_is_a_tool_use(bearer):
    add_fake_node(FakeLink(script=lambda spec: Script(tokens=["<think>I need the weather.</think>\n", *CALL])))
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["parameters"]}]
    body = (await request("POST", "/v1/messages", key=bearer, body=msg(tools=tools))).json()
    assert [block["type"] for block in body["content"]] == ["thinking", "tool_use"] and body["stop_reason"] == \
        "tool_use"
    events = sse(await request("POST", "/v1/messages", key=bearer, body=msg(tools=tools, stream=True)))
    starts = [(d["index"], d["content_block"]["type"]) for k, d in events if k == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "tool_use")]
    assert next(d for k, d in events if k == "message_delta")["delta"]["stop_reason"] == "tool_use"


OTHER_NODE = "22222222-2222-2222-2222-222222222222"


async def test_a_prompt_cache_key_lands_where_its_generations_ran_for_its_own_api_key_only(bearer, other_bearer):
    """Generations that carry the same prompt_cache_key (Codex sends its conversation's id) land on the node where
    that key's generations ran, though their prompts share no prefix and the other node is as idle (without the key
    they take turns); the same name from another API key steers nothing of the first's."""
    add_fake_node(FakeLink(identity="a"))
    add_fake_node(FakeLink(node_id=OTHER_NODE, identity="b"))

    async def node_of(key, path, text, cache_key=None):
        body = {"model": "smollm2", "store": False, **({"prompt_cache_key": cache_key} if cache_key else {})}
        body.update({"input": text} if path == "/v1/responses" else {"messages": [{"role": "user", "content": text}]})
        ex = await request("POST", path, key=key, body=body)
        assert ex.status == 200, ex.body
        return ex.headers["x-fleet-node"]

    unkeyed = [await node_of(bearer, "/v1/responses", f"Question {i}?") for i in range(4)]
    assert sorted(unkeyed) == ["a", "a", "b", "b"]  # by cost alone, idle nodes share the work
    keyed = [await node_of(bearer, path, f"Task {i}: something new.", "c0dex-1")
             for i, path in enumerate(["/v1/responses", "/v1/responses", "/v1/chat/completions", "/v1/responses"])]
    assert len(set(keyed)) == 1, keyed
    others = [await node_of(other_bearer, "/v1/responses", f"Another {i}.", "c0dex-1") for i in range(2)]
    assert others[0] != keyed[0] and len(set(others)) == 1  # the least routed node, then its own key's node
    bad = await request("POST", "/v1/responses", key=bearer, body={"model": "smollm2", "input": "Hi",
                                                                    "prompt_cache_key": 7})
    assert bad.status == 400 and bad.json()["error"]["param"] == "prompt_cache_key"


def sdk_events(events: list[tuple[str, dict]]) -> list:
    """The events as the official openai client reads and accumulates them (client.responses.stream does this)."""
    from openai import omit
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    state = ResponseStreamState(input_tools=omit, text_format=omit)
    return [out for _, data in events for out in state.handle_event(construct_type(type_=ResponseStreamEvent,
                                                                                   value=data))]


async def test_a_thinking_models_thinking_is_a_reasoning_item_whole_and_streamed(bearer):
    """A thinking model's <think>...</think> is a reasoning item before the message (OpenAI's shape: reasoning_text
    content, no summary), streamed as its own item with reasoning_text deltas, tags cut across token batches
    included; usage counts the thinking's tokens (the four that came from <think> through </think>)."""
    add_fake_node(FakeLink(script=lambda spec: Script(tokens=THOUGHT, per_batch=1)))
    ask = {"model": "smollm2", "input": "Hi", "reasoning": {"summary": "auto"}}
    body = (await request("POST", "/v1/responses", key=bearer, body=ask)).json()
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user greets me; I greet back."}]
    assert message["type"] == "message" and message["content"][0]["text"] == "Hello!"
    assert body["usage"]["output_tokens"] == 5 and body["usage"]["output_tokens_details"]["reasoning_tokens"] == 4

    events = sse(await request("POST", "/v1/responses", key=bearer, body={**ask, "stream": True}))
    items = [(k.rsplit(".", 1)[1], d["output_index"], d["item"]["type"]) for k, d in events
             if k.startswith("response.output_item.")]
    assert items == [("added", 0, "reasoning"), ("done", 0, "reasoning"), ("added", 1, "message"),
                     ("done", 1, "message")]
    kinds = [k for k, _ in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "".join(d["delta"] for k, d in events if k == "response.reasoning_text.delta")
    assert thought == "The user greets me; I greet back." == next(
        d["text"] for k, d in events if k == "response.reasoning_text.done")
    assert {d["output_index"] for k, d in events if k == "response.output_text.delta"} == {1}
    assert "".join(d["delta"] for k, d in events if k == "response.output_text.delta") == "Hello!"
    assert not any("<think>" in json.dumps(d) or "</think>" in json.dumps(d) for _, d in events)
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
    completed = sdk_events(events)[-1].response
    assert completed.output[0].content[0].text == thought and completed.output_text == "Hello!"


async def test_a_thinking_models_call_after_its_thinking_follows_its_reasoning_item(bearer):
    add_fake_node(FakeLink(script=lambda spec: Script(tokens=["<think>I need the weather.</think>\n", *CALL])))
    ask = {"model": "smollm2", "input": "Weather in Paris?", "tools": [WEATHER]}
    body = (await request("POST", "/v1/responses", key=bearer, body=ask)).json()
    assert [(i["type"], i.get("name")) for i in body["output"]] == [("reasoning", None),
                                                                     ("function_call", "get_weather")]
    assert body["output"][0]["content"][0]["text"] == "I need the weather."
    events = sse(await request("POST", "/v1/responses", key=bearer, body={**ask, "stream": True}))
    added = [(d["output_index"], d["item"]["type"]) for k, d in events if k == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "function_call")]
    assert sdk_events(events)[-1].response.output[1].arguments == '{"city": "Paris"}'


async def test_a_model_that_does_not_think_streams_no_reasoning_item(bearer):
    add_fake_node(FakeLink(script=lambda spec: Script(tokens=["I think", " <think> is a tag."])))
    events = sse(await request("POST", "/v1/responses", key=bearer, body={
        "model": "smollm2", "input": "Hi", "reasoning": {"effort": "high"}, "stream": True}))
    assert not any(k.startswith("response.reasoning") for k, _ in events)
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == "I think <think> is a tag."
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


async def test_a_thinking_budget_is_sent_to_the_node_which_holds_a_thinking_model_to_it(bearer):
    """Messages' thinking.budget_tokens is the generation's thinking_budget (the node closes a thinking that reaches
    it: test_engine_mock, test_engine_llama); adaptive thinking has none; a budget that is not a count is a 400."""
    link = add_fake_node()
    ex = await request("POST", "/v1/messages", key=bearer, body=msg(thinking={"type": "enabled",
                                                                          "budget_tokens": 1024}))
    assert ex.status == 200 and link.specs[-1]["thinking_budget"] == 1024
    assert "budget" not in ex.headers["x-fleet-left-out"]
    await request("POST", "/v1/messages", key=bearer, body=msg(thinking={"type": "adaptive"}))
    assert link.specs[-1]["thinking_budget"] == 0
    for budget in (0, "many", True):
        refused = await request("POST", "/v1/messages", key=bearer, body=msg(thinking={"type": "enabled",
                                                                                   "budget_tokens": budget}))
        assert refused.status == 400 and "budget_tokens" in refused.json()["error"]["message"]
