"""Tool calling without a native tool format: the prompt, the constraint and the parse."""

import json

import pytest

from api.errors import OpenAIError
from api.tools import tool_plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


def test_auto_shows_the_tools_and_constrains_nothing():
    plan = tool_plan({"tools": [WEATHER, TIME]})
    assert plan.mode == "auto" and plan.schema() is None
    prompt = plan.system_prompt()
    assert "get_weather" in prompt and "get_time" in prompt and '"arguments"' in prompt
    assert tool_plan({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert tool_plan({}) is None


def test_required_and_named_constrain_the_reply_to_a_call():
    required = tool_plan({"tools": [WEATHER, TIME], "tool_choice": "required"}).schema()
    assert [option["properties"]["name"]["enum"] for option in required["anyOf"]] == [["get_weather"], ["get_time"]]
    named = tool_plan({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_time"}}}).schema()
    assert named["properties"]["name"] == {"type": "string", "enum": ["get_time"]}
    assert named["properties"]["arguments"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("reply, calls", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
    ('```json\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n```', [("get_weather",
                                                                                        {"city": "Rome"})]),
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "parameters": {"city": "Lima"}}]',
     [("get_time", {}), ("get_weather", {"city": "Lima"})]),
    ("It is sunny in Oslo.", None),
    ('{"name": "launch_rockets", "arguments": {}}', None),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"', None),
])
def test_replies_parse_into_tool_calls_only_when_they_call_a_known_tool(reply, calls):
    parsed = tool_plan({"tools": [WEATHER, TIME]}).parse(reply)
    if calls is None:
        assert parsed is None
        return
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed)
    assert len({c["id"] for c in parsed}) == len(parsed)


@pytest.mark.parametrize("body, param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_400s(body, param):
    with pytest.raises(OpenAIError) as caught:
        tool_plan(body)
    assert caught.value.status == 400 and caught.value.param == param
