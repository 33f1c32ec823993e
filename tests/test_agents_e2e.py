"""The agents' APIs as agent tools use them: the official `openai` (Responses API) and `anthropic` (Messages API)
clients, unchanged, against a real head (daphne) and a real SmolLM2 node. Answers are kept short: the machine has
two cores. (Validation, shapes and event order in process: test_api_agents.)"""

import json

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def oai(live_head, live_node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_head.url}/v1", api_key=live_head.api_key, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def claude(live_head, live_node) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_head.url, api_key=live_head.api_key, max_retries=0, timeout=180)


def test_responses_text_stream_stored_turns_tools_and_json_schema(oai):
    first = oai.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=6,
                                 temperature=0)
    assert first.id.startswith("resp_") and first.output_text and first.status in ("completed", "incomplete")
    # The next turn continues the stored conversation: its prefix is on the node that answered it, and is reused.
    second = oai.responses.create(model=MODEL, input="Again.", instructions="Be brief.",
                                  previous_response_id=first.id, max_output_tokens=2, temperature=0)
    assert second.previous_response_id == first.id and second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.input_tokens > first.usage.input_tokens
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    assert [item.content[0].text for item in oai.responses.input_items.list(first.id).data] == ["Say hello."]
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)

    with oai.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # A cut at max_output_tokens ends in response.incomplete, as OpenAI's does (the client's get_final_response
    # waits for response.completed only).
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert deltas and events[-1].response.output_text == "".join(deltas)

    call = oai.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=40, temperature=0).output[0]
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    answer = oai.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}])
    assert answer.output_text

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    shaped = oai.responses.create(model=MODEL, input="Give a number as JSON.", max_output_tokens=20, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "n", "schema": schema,
                                                   "strict": True}})
    jsonschema.validate(json.loads(shaped.output_text), schema)


# This client has no sampling parameters (the newest models take none); the API still honours them, from the body.
GREEDY = {"extra_body": {"temperature": 0}}


def test_messages_text_stream_tools_stop_sequences_count_and_errors(claude, live_head):
    hi = [{"role": "user", "content": "Say hello."}]
    first = claude.messages.create(model=MODEL, max_tokens=6, messages=hi, **GREEDY)
    assert first.id.startswith("msg_") and first.content[0].text and first.stop_reason in ("end_turn", "max_tokens")
    again = claude.messages.create(model=MODEL, max_tokens=2, messages=hi, **GREEDY)
    assert again.usage.cache_read_input_tokens > 0  # the same prompt: its prefix was kept on the node

    stops = [" ", ".", "\n", ","]
    stopped = claude.messages.create(model=MODEL, max_tokens=16, messages=hi, stop_sequences=stops, **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence in stops

    with claude.messages.stream(model=MODEL, max_tokens=6, messages=hi, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens > 0

    tools = [{"name": "get_weather", "description": "The current weather in a city",
              "input_schema": WEATHER["parameters"]}]
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    use = claude.messages.create(model=MODEL, max_tokens=40, messages=asked, tools=tools, tool_choice={"type": "any"},
                                 **GREEDY)
    assert use.stop_reason == "tool_use" and use.content[0].type == "tool_use" and "city" in use.content[0].input
    turn = [*asked, {"role": "assistant", "content": use.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.content[0].id,
                                          "content": "18 C and sunny"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=8, messages=turn, tools=tools, **GREEDY)
    assert answer.content[0].type == "text" and answer.content[0].text

    assert claude.messages.count_tokens(model=MODEL, messages=asked).input_tokens > 0

    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live_head.url, api_key="fk-0.wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=hi)
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=hi)
    assert "smollm2" in str(missing.value)
    with pytest.raises(anthropic.BadRequestError) as long:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "word " * 12_000}])
    assert "window" in str(long.value)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=hi,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
