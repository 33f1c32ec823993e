"""The OpenAPI 3 description of the OpenAI-compatible /v1 API, served at /v1/openapi.json (no key needed).

Written by hand, in one place, from what api.v1 and api.specs accept: the views are plain async Django views,
which drf-spectacular cannot see. The limits come from the same constants and settings the validators use, so
the document cannot drift from them; `tests/test_fuzz_api.py` holds every answer of the API to it.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from api import openapi_agents, specs, v1
from fleet.waiting import PRIORITIES

INT64 = 2**63 - 1


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _opt(schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    """An optional parameter: null means "not given", as the validators read it."""
    return {**schema, "nullable": True, **({"description": description} if description else {})}


def _number(lo: float, hi: float, description: str = "") -> dict[str, Any]:
    return _opt({"type": "number", "minimum": lo, "maximum": hi}, description)


def _integer(lo: int, hi: int, description: str = "") -> dict[str, Any]:
    return _opt({"type": "integer", "minimum": lo, "maximum": hi}, description)


TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text", "input_text"]}, "text": {"type": "string"}}}
TEXT_PARTS = {"type": "array", "items": TEXT_PART}
CONTENT = {"oneOf": [{"type": "string"}, TEXT_PARTS]}
IMAGE_PART = {"oneOf": [
    {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"type": "string", "enum": ["image_url"]},
        "image_url": {"type": "object", "required": ["url"], "properties": {
            "url": {"type": "string", "description": "A base64 data URL (PNG, JPEG, GIF, BMP), or an http(s) URL "
                                                     "when FLEET_MEDIA_REMOTE_URLS allows its host."},
            "detail": {"type": "string"}}}}},
    {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"type": "string", "enum": ["input_image"]}, "image_url": {"type": "string"}}},
]}
USER_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [TEXT_PART, IMAGE_PART]}}],
                "description": "Text, or text and image parts (images need a node with capability vision)."}


TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"description": "JSON text, or the arguments object."}}}}}


def _message(roles: list[str], required: list[str], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "required": ["role", *required], "properties": {
        "role": {"type": "string", "enum": roles}, "content": CONTENT, "name": {"type": "string"}, **extra}}


MESSAGE = {"oneOf": [
    _message(["system", "developer"], ["content"]),
    _message(["user"], ["content"], content=USER_CONTENT),
    _message(["assistant"], [], content={**CONTENT, "nullable": True},
             tool_calls={"type": "array", "minItems": 1, "items": TOOL_CALL,
                         "description": "Calls the assistant made; content may then be null."}),
    _message(["tool"], ["content", "tool_call_id"], tool_call_id={"type": "string"}),
]}

TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "A JSON schema of the arguments."}}}}}

TOOL_CHOICE = {"oneOf": [
    {"type": "string", "enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
], "nullable": True, "description": "Needs `tools` unless none or auto."}

RESPONSE_FORMAT = {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"type": "string",
                                                                     "enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"type": "string", "enum": ["json_schema"]},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
], "nullable": True}


def _common() -> dict[str, Any]:
    """The parameters chat and completions share (api.specs._base_spec and _request)."""
    window = ("At most 1,000,000, and at most the context window of the nodes serving the model (a 400 names "
              "it); default 512.")
    return {
        "model": {"type": "string", "minLength": 1, "pattern": r"\S", "description": "A model /v1/models lists."},
        "max_tokens": _integer(1, 1_000_000, window),
        "max_completion_tokens": _integer(1, 1_000_000, window + " Wins over max_tokens."),
        "temperature": _number(0, 2), "top_p": _number(0, 1), "min_p": _number(0, 1),
        "presence_penalty": _number(-2, 2), "frequency_penalty": _number(-2, 2), "repeat_penalty": _number(0, 10),
        "top_k": _integer(0, 1_000_000), "seed": _integer(-INT64 - 1, INT64),
        "ignore_eos": _opt({"type": "boolean"}),
        "batch_invariant": _opt({"type": "boolean"}),
        "lora": _opt({"type": "array", "maxItems": specs.MAX_LORA, "items": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1, "pattern": r"\S"}, "scale": _number(-16, 16)}}}),
        "stop": _opt({"oneOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "maxItems": specs.MAX_STOP,
                                 "items": {"type": "string", "minLength": 1}}]}),
        "logit_bias": _opt({"type": "object", "propertyNames": {"pattern": "^0*[0-9]{1,9}$"},
                            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                           "Token id (of the node's model) to bias."),
        "logit_bias_handle": _opt({"type": "string", "format": "uuid"}, "A handle from POST /api/logit-biases/."),
        "grammar": _opt({"type": "string", "minLength": 1}, "A grammar handle id, or GBNF text with a root rule."),
        "response_format": RESPONSE_FORMAT,
        "n": _opt({"type": "integer", "enum": [1]}),
        "stream": _opt({"type": "boolean"}),
        "stream_options": _opt({"type": "object", "properties": {"include_usage": {}}}),
        "deadline_ms": _integer(1, specs.MAX_DEADLINE_MS, "How long the request may wait for a lane and run."),
        "priority": _opt({"type": "string", "enum": list(PRIORITIES)}, "Its class when every lane is busy, at most "
                         "the key's (default: the key's)."),
        "prompt_cache_key": _opt({"type": "string"}, "Generations of one API key with the same name go where that "
                                 "name's ran, while that node has a free lane."),
        "user": {"description": "Accepted and ignored."},
        "metadata": {"description": "Accepted and ignored."},
    }


def chat_request() -> dict[str, Any]:
    return {"type": "object", "required": ["model", "messages"], "properties": {
        **_common(),
        "messages": {"type": "array", "minItems": 1, "maxItems": settings.FLEET_MAX_MESSAGES, "items": MESSAGE,
                     "description": "At most FLEET_MAX_MESSAGES; a 400 names the limit."},
        "logprobs": _opt({"type": "boolean"}),
        "top_logprobs": _integer(0, specs.MAX_TOP_LOGPROBS, "Needs logprobs: true."),
        "tools": _opt({"type": "array", "items": TOOL}), "tool_choice": TOOL_CHOICE,
        "session": _opt({"type": "string"}, "A session id from POST /api/sessions/."),
    }}


def completion_request() -> dict[str, Any]:
    return {"type": "object", "required": ["model", "prompt"], "properties": {
        **_common(),
        "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": {"type": "string", "minLength": 1}}]},
        "logprobs": _integer(0, specs.MAX_TOP_LOGPROBS, "How many alternatives to report per token."),
        "echo": _opt({"type": "boolean", "enum": [False]}), "suffix": _opt({"type": "string", "maxLength": 0}),
        "best_of": _opt({"type": "integer", "enum": [1]}),
    }}


def embedding_request() -> dict[str, Any]:
    return {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "input": {"oneOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "maxItems": v1.MAX_EMBED_INPUTS,
                             "items": {"type": "string", "minLength": 1}}]},
        "encoding_format": _opt({"type": "string", "enum": ["float", "base64"]}),
        "dimensions": {"nullable": True, "enum": [None], "description": "Not supported: leave it out."},
        "user": {"description": "Accepted and ignored."},
    }}


USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}


def _answer(object_name: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": [object_name]},
        "created": {"type": "integer"}, "model": {"type": "string"}, "system_fingerprint": {"type": "string"},
        "choices": {"type": "array", "items": choice}, "usage": USAGE}}


CHAT_CHOICE = {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
    "index": {"type": "integer"}, "finish_reason": {"type": "string"},
    "logprobs": {"type": "object", "nullable": True},
    "message": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["assistant"]}, "content": {"type": "string", "nullable": True},
        "refusal": {"nullable": True}, "tool_calls": {"type": "array", "items": {"type": "object"}}}}}}

COMPLETION_CHOICE = {"type": "object", "required": ["index", "text", "finish_reason"], "properties": {
    "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": {"type": "string"},
    "logprobs": {"type": "object", "nullable": True}}}

MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}}}

EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"type": "string", "enum": ["list"]}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                        "properties": {"object": {"type": "string", "enum": ["embedding"]},
                                                       "index": {"type": "integer"},
                                                       "embedding": {"oneOf": [{"type": "array",
                                                                                "items": {"type": "number"}},
                                                                               {"type": "string"}]}}}},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}}

SSE_EVENT = {"type": "object", "required": ["data"], "description": "With stream: true, OpenAI's chunks as "
             "server-sent events: each `data` is a chunk as JSON (or an error object), and the last is `[DONE]`.",
             "properties": {"data": {"type": "string", "minLength": 1}, "event": {"type": "string"}}}

ERROR = {"type": "object", "required": ["error"], "additionalProperties": False, "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
    "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                   "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}

ERRORS = {
    "400": "A parameter is missing or wrong (`param` names it), or the body is not a JSON object.",
    "401": "No API key, or a wrong or revoked one.",
    "404": "No node serves the model; the message lists what is served.",
    "405": "Another method than the one documented.",
    "413": "The body is over FLEET_MAX_BODY_BYTES.",
    "415": "The body is not `application/json`.",
    "429": "Over the key's rate, or its bound on generations waiting for a lane; `Retry-After` says when to retry.",
    "502": "The node failed the request.",
    "503": "Every lane serving the model stayed busy until the deadline; `Retry-After`.",
    "504": "The node did not answer in time.",
}


def _operation(summary: str, ok: dict[str, Any], statuses: list[str], body: dict[str, Any] | None = None,
               *, stream: bool = False) -> dict[str, Any]:
    content = {"application/json": {"schema": ok}}
    if stream:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    responses = {"200": {"description": "OK", "content": content}}
    for status in statuses:
        responses[status] = {"description": ERRORS[status],
                             "content": {"application/json": {"schema": _ref("Error")}}}
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return operation


GENERATION_ERRORS = ["400", "401", "404", "405", "413", "415", "429", "502", "503", "504"]
EMBEDDING_ERRORS = ["400", "401", "404", "405", "413", "415", "429", "502", "504"]


def v1_schema() -> dict[str, Any]:
    """The whole document (built per call: the limits follow settings)."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "Fleet OpenAI-compatible API", "version": "1",
                 "description": "OpenAI's /v1 shapes (chat, completions, embeddings, the Responses API), and "
                                "Anthropic's Messages API at /v1/messages, served by a llama.cpp fleet. Errors are "
                                "OpenAI's error object (Anthropic's on /v1/messages). "
                                "Extensions (session, grammar, logit_bias_handle, deadline_ms, priority, top_k, min_p, "
                                "repeat_penalty, ignore_eos, batch_invariant, lora) are described in docs/api.md."},
        "servers": [{"url": "/"}],
        "security": [{"apiKey": []}],
        "paths": {
            "/v1/models": {"get": _operation("Models served by the fleet", {
                "type": "object", "required": ["object", "data"], "properties": {
                    "object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": MODEL}}},
                ["401", "405", "429"])},
            "/v1/models/{model}": {"get": {**_operation("A model served by the fleet", MODEL,
                                                        ["401", "404", "405", "429"]),
                                           "parameters": [{"name": "model", "in": "path", "required": True,
                                                           "schema": {"type": "string"}}]}},
            "/v1/chat/completions": {"post": _operation("Chat completion", _answer("chat.completion", CHAT_CHOICE),
                                                        GENERATION_ERRORS, chat_request(), stream=True)},
            "/v1/completions": {"post": _operation("Text completion", _answer("text_completion", COMPLETION_CHOICE),
                                                   GENERATION_ERRORS, completion_request(), stream=True)},
            "/v1/embeddings": {"post": _operation("Embeddings", EMBEDDINGS, EMBEDDING_ERRORS,
                                                  embedding_request())},
            **openapi_agents.paths(_operation),
        },
        "components": {
            "schemas": {"Error": ERROR, "AnthropicError": openapi_agents.ANTHROPIC_ERROR},
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                           "description": "An API key: `Authorization: Bearer fk-...` (on "
                                                          "/v1/messages also `x-api-key: fk-...`)."}},
        },
    }


# --- transcriptions, files and batches (kept apart from the generation paths above) -------------------------------

TRANSCRIPTION = {"type": "object", "required": ["text"], "properties": {
    "text": {"type": "string"}, "language": {"type": "string"}, "duration": {"type": "number"},
    "segments": {"type": "array", "items": {"type": "object"}}, "words": {"type": "array", "items": {"type": "object"}},
    "usage": {"type": "object"}}}

FILE = {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["file"]}, "bytes": {"type": "integer"},
    "created_at": {"type": "integer"}, "filename": {"type": "string"}, "purpose": {"type": "string"},
    "status": {"type": "string"}, "expires_at": {"type": "integer", "nullable": True},
    "status_details": {"nullable": True}}}

BATCH = {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status",
                                        "request_counts"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["batch"]}, "endpoint": {"type": "string"},
    "input_file_id": {"type": "string"}, "completion_window": {"type": "string"}, "status": {"type": "string"},
    "output_file_id": {"type": "string", "nullable": True}, "error_file_id": {"type": "string", "nullable": True},
    "errors": {"nullable": True}, "metadata": {"type": "object", "nullable": True},
    "request_counts": {"type": "object", "properties": {"total": {"type": "integer"},
                                                         "completed": {"type": "integer"},
                                                         "failed": {"type": "integer"}}}}}

REQUEST_ERRORS = ["400", "401", "404", "405", "413", "415", "429"]
READ_ERRORS = ["401", "404", "405", "429"]


def _list_of(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": item},
        "has_more": {"type": "boolean"}, "first_id": {"type": "string", "nullable": True},
        "last_id": {"type": "string", "nullable": True}}}


def _form(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": required, "properties": properties}}}}


def _in_path(name: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def _in_query(*names: str) -> list[dict[str, Any]]:
    kinds = {"limit": {"type": "integer", "minimum": 1, "maximum": 10000}}
    return [{"name": n, "in": "query", "required": False, "schema": kinds.get(n, {"type": "string"})} for n in names]


def more_paths() -> dict[str, Any]:
    """Transcriptions, the Batch API's files and batches, and this description itself: what /v1 serves besides
    the generation paths (tests/test_api_fuzz_regressions.py compares every /v1 route with the description)."""
    transcribe = _operation("Transcription (multipart form; stream=true: server-sent transcript events)",
                            TRANSCRIPTION, GENERATION_ERRORS, stream=True)
    transcribe["requestBody"] = _form({
        "file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
        "response_format": {"type": "string", "enum": ["json", "text", "srt", "vtt", "verbose_json"]},
        "language": {"type": "string", "maxLength": 8}, "prompt": {"type": "string"},
        "temperature": _number(0, 1), "stream": {"type": "boolean"},
        "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": ["word", "segment"]}}},
        ["file", "model"])
    upload = _operation("Upload a file (purpose batch: a JSONL of requests)", FILE, REQUEST_ERRORS)
    upload["requestBody"] = _form({"file": {"type": "string", "format": "binary"},
                                   "purpose": {"type": "string", "enum": ["batch"]}}, ["file", "purpose"])
    listed = _operation("The key owner's files", _list_of(FILE), ["400", *READ_ERRORS])
    create_batch = _operation("Create a batch", BATCH, REQUEST_ERRORS, {
        "type": "object", "required": ["input_file_id", "endpoint", "completion_window"], "properties": {
            "input_file_id": {"type": "string"}, "endpoint": {"type": "string"},
            "completion_window": {"type": "string"}, "metadata": {"type": "object", "nullable": True}}})
    content = _operation("A file's content", {"type": "string"}, READ_ERRORS)
    content["responses"]["200"]["content"] = {"application/jsonl": {"schema": {"type": "string"}}}
    document = _operation("This description (no key needed)", {"type": "object"}, ["405"])
    document["security"] = []
    return {
        "/v1/audio/transcriptions": {"post": transcribe},
        "/v1/files": {"get": {**listed, "parameters": _in_query("purpose", "limit", "after")}, "post": upload},
        "/v1/files/{file_id}": {"get": {**_operation("A file", FILE, READ_ERRORS), "parameters": _in_path("file_id")},
                                "delete": {**_operation("Delete a file", {"type": "object"}, READ_ERRORS),
                                           "parameters": _in_path("file_id")}},
        "/v1/files/{file_id}/content": {"get": {**content, "parameters": _in_path("file_id")}},
        "/v1/batches": {"get": {**_operation("The key owner's batches", _list_of(BATCH), ["400", *READ_ERRORS]),
                                "parameters": _in_query("limit", "after")}, "post": create_batch},
        "/v1/batches/{batch_id}": {"get": {**_operation("A batch", BATCH, READ_ERRORS),
                                           "parameters": _in_path("batch_id")}},
        "/v1/batches/{batch_id}/cancel": {"post": {**_operation("Cancel a batch", BATCH, READ_ERRORS),
                                                   "parameters": _in_path("batch_id")}},
        "/v1/openapi.json": {"get": document},
    }


def v1_document() -> dict[str, Any]:
    """The description /v1/openapi.json serves: the generation paths (v1_schema) and the others (more_paths)."""
    document = v1_schema()
    document["paths"] = {**document["paths"], **more_paths()}
    return document


@require_GET
def openapi_v1(request: HttpRequest) -> JsonResponse:
    return JsonResponse(v1_document())
