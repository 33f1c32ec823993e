"""The /v1/openapi.json entries of the agents' APIs: OpenAI's Responses API and Anthropic's Messages API.

Written by hand from what api.responses_api and api.anthropic_messages accept, as api.openapi_v1 is for the rest of
/v1 (which merges these in); tests/test_fuzz_api.py holds the answers to them. A field Fleet accepts and ignores
is described with no type, so that any value is documented as accepted.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from api import specs
from fleet.waiting import PRIORITIES

IGNORED = {"description": "Accepted and ignored."}


def _opt(schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {**schema, "nullable": True, **({"description": description} if description else {})}


def _number(lo: float, hi: float) -> dict[str, Any]:
    return _opt({"type": "number", "minimum": lo, "maximum": hi})


def _integer(lo: int, hi: int, description: str = "") -> dict[str, Any]:
    return _opt({"type": "integer", "minimum": lo, "maximum": hi}, description)


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


def _kind(name: str) -> dict[str, Any]:
    return {"type": "string", "enum": [name]}


STRING = {"type": "string"}
NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
SCHEMA = {"type": "object", "description": "A JSON schema."}
MAX_TOKENS_NOTE = "At most the context window of the nodes serving the model (a 400 names it)."
STOP = _opt({"type": "array", "maxItems": specs.MAX_STOP, "items": {"type": "string", "minLength": 1}})

# --- Responses ----------------------------------------------------------------------------------------------------

INPUT_PART = {"oneOf": [
    _object(["type", "text"], type={"type": "string", "enum": ["input_text", "output_text"]}, text=STRING),
    _object(["type", "image_url"], type=_kind("input_image"), image_url={
        "type": "string", "description": "A base64 data URL, or an http(s) URL FLEET_MEDIA_REMOTE_URLS allows."}),
]}
INPUT_ITEM = {"oneOf": [
    _object(["role", "content"], type=_kind("message"),
            role={"type": "string", "enum": ["user", "assistant", "system", "developer"]},
            content={"oneOf": [STRING, {"type": "array", "items": INPUT_PART}]}),
    _object(["type", "call_id", "name", "arguments"], type=_kind("function_call"), call_id=STRING, name=STRING,
            arguments={"type": "string", "description": "JSON text."}),
    _object(["type", "call_id", "output"], type=_kind("function_call_output"), call_id=STRING,
            output={"oneOf": [STRING, {"type": "array", "items": _object(["text"], text=STRING)}]}),
]}
FUNCTION_TOOL = _object(["type", "name"], type=_kind("function"), name=NAME, description=_opt(STRING),
                        parameters=_opt(SCHEMA), strict=_opt({"type": "boolean"}))
HOSTED_TOOL = _object(["type"], type={"type": "string", "not": {"enum": ["function", "namespace"]}})
ANY_TOOL = {"oneOf": [FUNCTION_TOOL, HOSTED_TOOL]}
NAMESPACE_TOOL = _object(["type", "name", "tools"], type=_kind("namespace"), name=STRING,
                         tools={"type": "array", "items": ANY_TOOL})
TEXT_FORMAT = {"oneOf": [
    _object(["type"], type={"type": "string", "enum": ["text", "json_object"]}),
    _object(["type", "schema"], type=_kind("json_schema"), name={"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            schema=SCHEMA,
            strict=_opt({"type": "boolean"})),
]}


def responses_request() -> dict[str, Any]:
    return _object(["model", "input"], **{
        "model": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "input": {"oneOf": [STRING, {"type": "array", "minItems": 1, "maxItems": settings.FLEET_MAX_MESSAGES,
                                     "items": INPUT_ITEM}]},
        "instructions": _opt(STRING, "A system message before the conversation (not carried to the next turn)."),
        "tools": _opt({"type": "array", "items": {"oneOf": [FUNCTION_TOOL, NAMESPACE_TOOL, HOSTED_TOOL]}},
                      "Function tools, and a namespace's function tools under their own names; hosted tools (web "
                      "search and the like) are left out, named in the X-Fleet-Left-Out header."),
        "tool_choice": _opt({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                       _object(["type", "name"], type=_kind("function"), name=STRING)]}),
        "parallel_tool_calls": _opt({"type": "boolean"}, "Echoed; the model may make several calls either way."),
        "text": _opt({"type": "object", "properties": {"format": TEXT_FORMAT, "verbosity": IGNORED}}),
        "max_output_tokens": _integer(1, 1_000_000, MAX_TOKENS_NOTE),
        "temperature": _number(0, 2), "top_p": _number(0, 1), "top_k": _integer(0, 1_000_000),
        "seed": _integer(-2**63, 2**63 - 1), "stop": STOP,
        "deadline_ms": _integer(1, specs.MAX_DEADLINE_MS, "How long the request may wait for a lane and run."),
        "priority": _opt({"type": "string", "enum": list(PRIORITIES)}, "Its class when every lane is busy, at most "
                         "the key's (default: the key's)."),
        "metadata": _opt({"type": "object", "additionalProperties": STRING}, "Echoed back."),
        "store": _opt({"type": "boolean"}, "Keep the response for previous_response_id, GET and DELETE (default)."),
        "previous_response_id": _opt(STRING, "Continue a stored response's conversation."),
        "include": _opt({"type": "array", "items": {"type": "string", "enum": [
            "message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url"]}}),
        "top_logprobs": _integer(0, specs.MAX_TOP_LOGPROBS, "With include message.output_text.logprobs."),
        "stream": _opt({"type": "boolean"}),
        "truncation": _opt({"type": "string", "enum": ["disabled"]}),
        "reasoning": _opt({"type": "object", "properties": {
            "effort": _opt({"type": "string", "enum": ["none", "minimal", "low", "medium", "high", "xhigh"]},
                           "Accepted; above minimal it is not held to (X-Fleet-Left-Out): a "
                           "model that thinks answers with a reasoning item first."), "summary": IGNORED}}),
        "background": _opt({"type": "boolean", "enum": [False]}, "Not supported."),
        "user": IGNORED, "service_tier": IGNORED, "safety_identifier": IGNORED,
        "prompt_cache_key": _opt(STRING, "Generations of one API key with the same name go where that name's ran, "
                                 "while that node has a free lane."),
        "stream_options": IGNORED,
    })


OUTPUT_ITEM = {"type": "object", "required": ["type", "id"], "properties": {
    "type": {"type": "string", "enum": ["reasoning", "message", "function_call"]}, "id": STRING, "status": STRING,
    "role": STRING, "content": {"type": "array", "items": {"type": "object"}}, "call_id": STRING, "name": STRING,
    "arguments": STRING, "summary": {"type": "array", "items": {"type": "object"}}}}
RESPONSE = _object(["id", "object", "created_at", "status", "model", "output"], **{
    "id": STRING, "object": _kind("response"), "created_at": {"type": "integer"},
    "status": {"type": "string", "enum": ["completed", "incomplete", "failed", "in_progress"]},
    "model": STRING, "output": {"type": "array", "items": OUTPUT_ITEM},
    "usage": {"type": "object", "nullable": True, "properties": {
        "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "input_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": {"type": "integer"}}}}},
})
DELETED = _object(["id", "object", "deleted"], id=STRING, object=_kind("response"), deleted={"type": "boolean"})
ITEMS = _object(["object", "data", "has_more"], object=_kind("list"), has_more={"type": "boolean"},
                data={"type": "array", "items": {"type": "object"}}, first_id=_opt(STRING), last_id=_opt(STRING))

# --- Messages ----------------------------------------------------------------------------------------------------

TEXT_BLOCK = _object(["type", "text"], type=_kind("text"), text=STRING)
BLOCK = {"oneOf": [
    TEXT_BLOCK,
    _object(["type", "source"], type=_kind("image"), source={"oneOf": [
        _object(["type", "data"], type=_kind("base64"), media_type=STRING, data=STRING),
        _object(["type", "url"], type=_kind("url"), url=STRING)]}),
    _object(["type", "id", "name", "input"], type=_kind("tool_use"), id=STRING, name=STRING,
            input={"type": "object"}),
    _object(["type", "tool_use_id"], type=_kind("tool_result"), tool_use_id=STRING, is_error={"type": "boolean"},
            content=_opt({"oneOf": [STRING, {"type": "array", "items": TEXT_BLOCK}]})),
], "description": "User messages: text, image, tool_result; assistant messages: text, tool_use."}
MESSAGE = _object(["role", "content"], role={"type": "string", "enum": ["user", "assistant", "system"]},
                  content={"oneOf": [STRING, {"type": "array", "items": BLOCK}]})
TOOL = _object(["name", "input_schema"], name=NAME, description=STRING, input_schema=SCHEMA)
TOOL_CHOICE = {"oneOf": [_object(["type"], type={"type": "string", "enum": ["auto", "any", "none"]}),
                         _object(["type", "name"], type=_kind("tool"), name=STRING)]}


def _prompt() -> dict[str, Any]:
    return {
        "model": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "messages": {"type": "array", "minItems": 1, "maxItems": settings.FLEET_MAX_MESSAGES, "items": MESSAGE},
        "system": _opt({"oneOf": [STRING, {"type": "array", "items": TEXT_BLOCK}]}),
        "tools": _opt({"type": "array", "items": TOOL}, "Client tools only; server tools are a 400."),
        "tool_choice": _opt(TOOL_CHOICE, "Needs tools unless auto or none."),
        "thinking": _opt(_object(["type"], type={"type": "string", "enum": ["enabled", "adaptive", "disabled"]},
                                 budget_tokens={"type": "integer"}),
                         "Accepted; the answer has no thinking blocks, and X-Fleet-Left-Out says so."),
    }


def messages_request() -> dict[str, Any]:
    return _object(["model", "max_tokens", "messages"], **_prompt(), **{
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000, "description": MAX_TOKENS_NOTE},
        "stop_sequences": STOP, "temperature": _number(0, 2), "top_p": _number(0, 1),
        "top_k": _integer(0, 1_000_000), "stream": _opt({"type": "boolean"}),
        "deadline_ms": _integer(1, specs.MAX_DEADLINE_MS),
        "priority": _opt({"type": "string", "enum": list(PRIORITIES)}, "Its class when every lane is busy, at most "
                         "the key's (default: the key's)."),
        "metadata": _opt({"type": "object", "properties": {"user_id": _opt(STRING)}}, "Accepted and ignored."),
        "output_config": _opt({"type": "object", "properties": {
            "format": _opt(_object(["type", "schema"], type=_kind("json_schema"), schema=SCHEMA)),
            "effort": _opt({"type": "string", "enum": ["low", "medium", "high", "xhigh", "max"]},
                           "Accepted and ignored.")}}),
        "service_tier": IGNORED,
    })


def count_request() -> dict[str, Any]:
    return _object(["model", "messages"], **_prompt())


ANSWER = _object(["id", "type", "role", "model", "content", "stop_reason", "usage"], **{
    "id": STRING, "type": _kind("message"), "role": _kind("assistant"), "model": STRING,
    "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "tool_use"]}}}},
    "stop_reason": {"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
    "stop_sequence": _opt(STRING),
    "usage": _object(["input_tokens", "output_tokens"], input_tokens={"type": "integer"},
                     output_tokens={"type": "integer"}, cache_read_input_tokens={"type": "integer"}),
})
COUNT = _object(["input_tokens"], input_tokens={"type": "integer"})
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "additionalProperties": False, "properties": {
    "type": _kind("error"), "error": {"type": "object", "required": ["type", "message"], "additionalProperties": False,
                                      "properties": {"type": STRING, "message": {"type": "string", "minLength": 1}}}}}
ANTHROPIC_ERRORS = {
    "400": "invalid_request_error: a field is missing or wrong, or the prompt is over the model's window.",
    "401": "authentication_error: no key (`x-api-key` or a bearer), or a wrong or revoked one.",
    "404": "not_found_error: no node serves the model.",
    "405": "invalid_request_error: another method.",
    "413": "request_too_large: the body is over FLEET_MAX_BODY_BYTES.",
    "415": "invalid_request_error: the body is not JSON.",
    "429": "rate_limit_error: over the key's quota; `retry-after`.",
    "502": "api_error: the node failed the request.",
    "504": "api_error: the node did not answer in time.",
    "529": "overloaded_error: every lane serving the model stayed busy until the deadline.",
}
SSE = {"type": "object", "required": ["event", "data"], "description": "Server-sent events, each named (`event:`) "
       "and its `data` a JSON object with the same `type`; keep-alives are comments (Responses) or `ping` events.",
       "properties": {"event": {"type": "string", "minLength": 1}, "data": {"type": "string", "minLength": 1}}}


def _anthropic(summary: str, ok: dict[str, Any], body: dict[str, Any], statuses: list[str],
               stream: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": ok}}
    if stream:
        content["text/event-stream"] = {"schema": SSE}
    responses = {"200": {"description": "OK", "content": content}}
    for status in statuses:
        responses[status] = {"description": ANTHROPIC_ERRORS[status],
                             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/"
                                                                                 "AnthropicError"}}}}
    parameters = [{"name": "beta", "in": "query", "required": False, "schema": {"type": "string"},
                   "description": "Tolerated (Anthropic's clients send beta=true)."}]
    return {"summary": summary, "parameters": parameters, "responses": responses,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


def paths(operation) -> dict[str, Any]:
    """The paths, with `operation` (api.openapi_v1._operation) building the OpenAI-shaped ones."""
    generation = ["400", "401", "404", "405", "413", "415", "429", "502", "503", "504"]
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": STRING}]
    listing = [*response_id,
               {"name": "order", "in": "query", "required": False, "schema": {"type": "string",
                                                                             "enum": ["asc", "desc"]}},
               {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1,
                                                                             "maximum": 100}},
               {"name": "after", "in": "query", "required": False, "schema": STRING}]
    return {
        "/v1/responses": {"post": operation("Create a response (OpenAI's Responses API)", RESPONSE, generation,
                                            responses_request(), stream=True)},
        "/v1/responses/{response_id}": {
            "get": {**operation("A stored response", RESPONSE, ["401", "404", "405", "429"]),
                    "parameters": response_id},
            "delete": {**operation("Delete a stored response", DELETED, ["401", "404", "405", "429"]),
                       "parameters": response_id}},
        "/v1/responses/{response_id}/input_items": {
            "get": {**operation("A stored response's input items", ITEMS, ["400", "401", "404", "405", "429"]),
                    "parameters": listing}},
        "/v1/messages": {"post": _anthropic("Create a message (Anthropic's Messages API)", ANSWER,
                                            messages_request(), [*ANTHROPIC_ERRORS], stream=True)},
        "/v1/messages/count_tokens": {"post": _anthropic(
            "Count a prompt's tokens with the model's tokenizer, on the head", COUNT, count_request(),
            ["400", "401", "404", "405", "413", "415", "429"])},
    }
