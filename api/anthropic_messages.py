"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on the chat path underneath.

A Messages body is translated into a chat body and validated by `api.specs.chat_request`: the same GenerateSpec,
placement, quotas, deadlines, cancel on disconnect, failover and generation record (kind "messages") as chat
completions; tools through the same tool prompt and grammar. Errors on these paths are Anthropic's error object
with the status Anthropic gives each type.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from api.errors import OpenAIError, anthropic_body, anthropic_status, invalid
from api.generation import Run
from api.json_out import json_bytes
from api.specs import GenerationRequest, chat_request, unknown_fields
from api.thinking import Splitter, split_thinking
from api.v1 import json_body, openai_view, respond
from fleet.dispatch import Tokens
from fleet.links import registry
from fleet.selectors import model_context_window
from nodes.agent.vocab import BUILTINS, BYTES
from nodes.tokenizers import fingerprint_served, tokenizer_get

REFUSED = {"container": "containers are not supported.", "mcp_servers": "MCP servers are not supported."}
# Every top-level field the Messages API knows (docs/api.md): others are accepted, ignored and named as left out.
KNOWN = frozenset({
    "model", "max_tokens", "system", "messages", "stop_sequences", "temperature", "top_p", "top_k", "tools",
    "tool_choice", "output_config", "stream", "metadata", "service_tier", "thinking", "context_management",
    "deadline_ms", "priority", *REFUSED})


def anthropic_error_response(exc: OpenAIError) -> HttpResponse:
    """An OpenAIError as Anthropic reports it: every lane busy until the deadline is its 529 "overloaded"."""
    status = anthropic_status(exc.status)
    response = JsonResponse(anthropic_body(status, exc.message), status=status)
    for name, value in exc.headers.items():
        response[name] = value
    return response


def anthropic_view(*methods: str, **wants: bool):
    return openai_view(*methods, errors=anthropic_error_response, **wants)


# --- the request ------------------------------------------------------------------------------------------------


def messages_request(body: Any, *, api_key=None, user=None, counting: bool = False) -> GenerationRequest:
    """Validate a /v1/messages body (sync: images are stored). `counting`: for count_tokens (no max_tokens)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    for name, why in REFUSED.items():
        if body.get(name):
            raise invalid(f"{name}: {why}", param=name)
    budget, thinking = _thinking(body.get("thinking"))
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or
                                 not isinstance(metadata.get("user_id"), str | None)):
        raise invalid("metadata: must be an object like {\"user_id\": \"...\"}.", param="metadata")
    max_tokens = body.get("max_tokens")
    if not counting and max_tokens is None:
        raise invalid("max_tokens: Field required.", param="max_tokens")
    max_tokens, capped = _within_window(max_tokens, body.get("model"))
    messages = _system_first(_system(body.get("system")) + _messages(body.get("messages")))
    fmt = _output_format(body.get("output_config"))
    chat = {"response_format": fmt, "model": body.get("model"), "messages": messages, "stream": body.get("stream"),
            "max_tokens": None if counting else max_tokens, "stop": body.get("stop_sequences") or None,
            "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(body.get("tool_choice")),
            **{name: body.get(name) for name in ("temperature", "top_p", "top_k", "deadline_ms", "priority")}}
    try:
        gen = chat_request({k: v for k, v in chat.items() if v is not None}, api_key=api_key, user=user)
    except OpenAIError as exc:
        if exc.param in ("stop", "response_format"):
            name = {"stop": "stop_sequences", "response_format": "output_config.format"}[exc.param]
            exc.param, exc.message = name, exc.message.replace(exc.param, name, 1)
        raise
    gen.api = "messages"
    gen.spec.thinking_budget = budget
    gen.left_out += thinking + capped + unknown_fields(body, KNOWN)
    return gen


THINKING = ("enabled", "adaptive", "disabled")


def _within_window(max_tokens: Any, model: Any) -> tuple[Any, list[str]]:
    """Anthropic's clients ask for more tokens than a small model's window (Claude Code: 32,000): capped to the
    window, and said, rather than refused; the node stops at its window anyway."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not isinstance(model, str):
        return max_tokens, []
    window = model_context_window(model)
    if window is None or max_tokens <= window:
        return max_tokens, []
    return window, [f"max_tokens {max_tokens}: capped to {window}, the context window of {model!r}"]


def _thinking(thinking: Any) -> tuple[int, list[str]]:
    """`thinking` of any of Anthropic's types is accepted: its budget (0: none), which the node holds a thinking
    model to, and what it asked for that the answer may not have."""
    if thinking is None:
        return 0, []
    if not isinstance(thinking, dict) or thinking.get("type") not in THINKING:
        raise invalid('thinking: must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                      '{"type": "disabled"}.', param="thinking")
    budget = thinking.get("budget_tokens") if thinking["type"] == "enabled" else None
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise invalid("thinking.budget_tokens: must be a whole number of at least 1.", param="thinking.budget_tokens")
    if thinking["type"] == "disabled":
        return 0, []
    return budget or 0, [f"thinking ({thinking['type']}): thinking blocks come only from a model that thinks "
                         "(<think>)"]


def _system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A system-role message inside `messages` (Claude Code sends one) joins the system prompt, which chat templates
    take only first."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    if len(system) < 2 and (not system or messages[0]["role"] == "system"):
        return messages
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


def _output_format(config: Any) -> dict[str, Any] | None:
    """output_config.format (structured outputs) as the chat response_format; its `effort` is a hint, ignored."""
    if config is None:
        return None
    if not isinstance(config, dict) or config.get("effort") not in (None, "low", "medium", "high", "xhigh", "max"):
        raise invalid("output_config: must be an object with format and effort.", param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid('output_config.format: must be {"type": "json_schema", "schema": {...}}.',
                      param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                        isinstance(b.get("text"), str) for b in system):
        system = "\n\n".join(b["text"] for b in system)
    if not isinstance(system, str):
        raise invalid("system: must be a string or a list of text blocks.", param="system")
    return [{"role": "system", "content": system}] if system else []


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: must be a non-empty list of {role, content} objects.", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        param = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise invalid(f"{param}.role: must be \"user\", \"assistant\" or \"system\".", param=param)
        content = message.get("content")
        if message["role"] == "system":
            out += _system(content)
        elif isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out += _blocks(message["role"], content, param)
        else:
            raise invalid(f"{param}.content: must be a string or a list of content blocks.", param=param)
    return out


def _blocks(role: str, blocks: list[Any], param: str) -> list[dict[str, Any]]:
    """One Anthropic message's blocks as chat messages: tool results become tool messages, tool uses an assistant's
    calls, text and images the message's parts."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), where)}})
        elif kind == "tool_use" and role == "assistant" and _strings(block, "id", "name") and isinstance(
                block.get("input"), dict):
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user" and _strings(block, "tool_use_id") and isinstance(
                block.get("is_error", False), bool):
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _result_text(block.get("content"), where)})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a reasoning model's notes: nothing a fleet model reads
        else:
            raise invalid(f"{where}: a {role} message's blocks are text, "
                          f"{'image and tool_result' if role == 'user' else 'tool_use'} (got {kind!r}).", param=where)
    if parts or not (calls or out):
        text_only = all(p["type"] == "text" for p in parts)
        content: Any = "".join(p["text"] for p in parts) if text_only else parts
        out.append({"role": role, "content": content})
    if calls:
        if out and out[-1]["role"] == "assistant":
            out[-1]["tool_calls"] = calls
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": calls})
    return out


def _strings(block: dict[str, Any], *names: str) -> bool:
    return all(isinstance(block.get(name), str) for name in names)


def _image_url(source: Any, where: str) -> str:
    if isinstance(source, dict) and source.get("type") == "base64" and _strings(source, "data") and isinstance(
            source.get("media_type", ""), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise invalid(f"{where}.source: an image's source is {{type: base64, media_type, data}} or {{type: url, url}}.",
                  param=where)


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                         isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise invalid(f"{where}.content: a tool result's content is a string or text blocks.", param=where)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools: must be a list of {name, description, input_schema}.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(f"tools.{i}: only client tools ({{name, description, input_schema}}) run on a fleet; "
                          f"server tools such as {kind!r} do not.", param=f"tools.{i}")
        if not isinstance(tool.get("input_schema"), dict) or not isinstance(tool.get("description", ""), str):
            raise invalid(f"tools.{i}: a tool needs an input_schema object (and its description is text).",
                          param=f"tools.{i}")
        out.append({"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description"),
                                                     "parameters": tool["input_schema"]}})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid('tool_choice: must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}.',
                  param="tool_choice")


# --- the answer -------------------------------------------------------------------------------------------------


def _stop(run: Run) -> tuple[str, str | None]:
    if run.tool_calls():
        return "tool_use", None
    reason = run.finish_reason()
    if reason == "length":
        return "max_tokens", None
    index = run.finished.usage.get("stop_index") if run.finished else None
    stops = run.request.spec.stop
    if isinstance(index, int) and 0 <= index < len(stops):
        return "stop_sequence", stops[index]
    return "end_turn", None


def _usage(run: Run) -> dict[str, Any]:
    usage = run.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # Anthropic counts the prompt's tokens read from the cache apart from input_tokens.
    return {"input_tokens": max(usage["prompt_tokens"] - cached, 0), "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_blocks(run: Run) -> list[dict[str, Any]]:
    return [{"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}", "name": call["function"]["name"],
             "input": json.loads(call["function"]["arguments"])} for call in run.tool_calls() or []]


def message_object(run: Run) -> dict[str, Any]:
    stop_reason, stop_sequence = _stop(run)
    thought, answer = split_thinking(run.text)
    content = ([{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []) + (
        _tool_blocks(run) or [{"type": "text", "text": answer}])
    return {"id": f"msg_{run.request.gen_id}", "type": "message", "role": "assistant",
            "model": run.request.spec.model, "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": _usage(run)}


# --- streaming --------------------------------------------------------------------------------------------------


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json_bytes({"type": kind, **fields}) + b"\n\n"


PING = _event("ping")


class MessageEvents:
    """A Run's events as Anthropic streams them: message_start, content blocks, message_delta, message_stop (an
    api.sse.Sink; its keep-alive is Anthropic's `ping`: a node is slow, or a lane is awaited)."""

    keepalive = PING

    def __init__(self, run: Run):
        self.run = run
        plan = run.request.tools
        self.holding = plan is not None  # a reply that may be a tool call is held until it clearly is not
        self.decided = plan is not None and plan.mode != "auto"
        self.held = ""
        self.opened = False
        self.splitter = Splitter()  # a thinking model's <think>...</think>: a block of its own, before the answer
        self.thinking_open = False  # that block (index 0) is open
        self.first = 0  # the index of the answer's first block: 1 after a thinking block

    def opening(self) -> list[bytes]:
        started = self.run.started
        message = {"id": f"msg_{self.run.request.gen_id}", "type": "message", "role": "assistant",
                   "model": self.run.request.spec.model, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": started.prompt_tokens - started.cached_tokens if started else 0,
                             "output_tokens": 0, "cache_read_input_tokens": started.cached_tokens if started else 0,
                             "cache_creation_input_tokens": 0}}
        return [_event("message_start", message=message)]

    def tokens(self, event: Tokens) -> list[bytes]:
        return self._pieces(self.splitter.feed(event.text))

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[bytes]:
        out: list[bytes] = []
        for kind, piece in pieces:
            out += self._thought(piece) if kind == "thinking" else self._answer(piece)
        return out

    def _thought(self, text: str) -> list[bytes]:
        out = []
        if not self.thinking_open:
            self.thinking_open, self.first = True, 1
            out.append(_event("content_block_start", index=0,
                              content_block={"type": "thinking", "thinking": "", "signature": ""}))
        return out + [_event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": text})]

    def _end_thought(self) -> list[bytes]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        return [_event("content_block_stop", index=0)]

    def _answer(self, text: str) -> list[bytes]:
        out = self._end_thought()
        if self.holding:
            self.held += text
            if self.decided or not self.held.strip() or self.held.lstrip().startswith(("{", "[", "`")):
                self.decided = True
                return out
            self.holding, text = False, self.held
        return out + self._text(text)

    def _text(self, text: str) -> list[bytes]:
        out = []
        if not self.opened:
            self.opened = True
            out.append(_event("content_block_start", index=self.first, content_block={"type": "text", "text": ""}))
        if text:
            out.append(_event("content_block_delta", index=self.first, delta={"type": "text_delta", "text": text}))
        return out

    async def closing(self) -> list[bytes]:
        out = self._pieces(self.splitter.flush()) + self._end_thought()
        tools = _tool_blocks(self.run)
        if tools:
            for index, block in enumerate(tools, start=self.first):
                partial = json.dumps(block["input"], ensure_ascii=False)
                out += [_event("content_block_start", index=index, content_block={**block, "input": {}}),
                        _event("content_block_delta", index=index,
                               delta={"type": "input_json_delta", "partial_json": partial}),
                        _event("content_block_stop", index=index)]
        else:
            out += self._text(self.held if self.holding else "") + [_event("content_block_stop", index=self.first)]
        stop_reason, stop_sequence = _stop(self.run)
        out += [_event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       usage=_usage(self.run)), _event("message_stop")]
        return out

    def ending(self) -> list[bytes]:
        return []

    def failed(self, exc: OpenAIError) -> list[bytes]:
        return [b"event: error\ndata: " + anthropic_error_response(exc).content + b"\n\n"]


# --- the views --------------------------------------------------------------------------------------------------


@anthropic_view("POST", tokens=True, stream=True)
async def messages(request: HttpRequest) -> HttpResponse:
    body = json_body(request)
    key = request.api_key
    gen = await sync_to_async(messages_request)(body, api_key=key, user=key.owner)
    gen.batch = request.batch_line
    return await respond(gen, request.quota, body=_message_body, sink=MessageEvents)


async def _message_body(run: Run) -> dict[str, Any]:
    return message_object(run)


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


@anthropic_view("POST")
async def count_tokens(request: HttpRequest) -> HttpResponse:
    """The prompt's tokens in the tokenizer of the model's nodes (their text; the chat template's markers are not
    counted), read on the head: no node is asked."""
    gen = await sync_to_async(messages_request)(json_body(request), api_key=request.api_key,
                                                user=request.api_key.owner, counting=True)
    model = gen.spec.model
    nodes = [s for s in await registry().aplacement.nodes() if model in s.models]
    if not nodes:
        raise OpenAIError(404, f"model: {model!r} is not served by any node.", param="model")
    fingerprint = fingerprint_served(model, [s.tokenizers for s in nodes]) or BYTES
    tokenizer = BUILTINS.get(fingerprint) or await asyncio.to_thread(tokenizer_get, fingerprint)
    texts = [f"{m['role']}\n{_content_text(m.get('content'))}" for m in gen.spec.messages]
    count = sum(len(tokenizer.tokenize(t)) for t in texts) if tokenizer in BUILTINS.values() else \
        await asyncio.to_thread(lambda: sum(len(tokenizer.tokenize(t)) for t in texts))
    return JsonResponse({"input_tokens": count})
