"""OpenAI's Responses API (/v1/responses) on the chat path underneath.

A Responses body is translated into a chat body and validated by `api.specs.chat_request`, so it becomes the same
GenerateSpec (tools and `text.format` through the same grammar machinery) and runs through the same Run: placement,
quotas, deadlines, cancel on disconnect, failover and the generation record (kind "responses"). What is Responses'
own is here: the input items, the response object, its event stream, and stored responses, whose conversation is
the next turn's prompt prefix (`previous_response_id`), so placement sends that turn to the node that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from api.errors import OpenAIError, invalid
from api.generation import Run
from api.json_out import json_bytes
from api.responses import chat_logprobs
from api.specs import MAX_TOP_LOGPROBS, GenerationRequest, _for_node, chat_request, shown, unknown_fields
from api.sse import KEEPALIVE
from api.thinking import Splitter, split_thinking
from api.v1 import json_body, openai_view, respond
from fleet.dispatch import Tokens
from fleet.selectors import model_context_window
from sessions import selectors
from sessions.models import StoredResponse
from sessions.services import nul_problem, stored_response_create, stored_response_delete

LOGPROBS_INCLUDE = "message.output_text.logprobs"
IGNORED_INCLUDES = {"reasoning.encrypted_content", "message.input_image.image_url"}  # nothing of theirs to add
ROLES = ("user", "assistant", "system", "developer")
# Fields that ask for what Fleet has no part for: a 400 naming them (when set to anything but "off").
REFUSED = {
    "background": "background responses are not supported; stream instead.",
    "conversation": "conversation objects are not supported; continue with previous_response_id.",
    "prompt": "prompt templates are not supported; send instructions and input.",
    "max_tool_calls": "max_tool_calls is not supported; the model makes at most one turn of calls.",
}
# Every top-level field the Responses API knows (docs/api.md): others are accepted, ignored and named as left out.
KNOWN = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature", "top_p",
    "store", "previous_response_id", "include", "top_logprobs", "stream", "metadata", "parallel_tool_calls", "user",
    "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "stream_options", "truncation",
    "reasoning", "client_metadata", "priority", "top_k", "seed", "stop", "deadline_ms", *REFUSED})
# Where a chat field's error should name the Responses field the client sent.
RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


@dataclass
class ResponsesRequest:
    gen: GenerationRequest
    body: dict[str, Any]
    history: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    previous: StoredResponse | None = None
    store: bool = True
    ids: dict[str, str] = field(default_factory=dict)
    namespaces: dict[str, str] = field(default_factory=dict)  # a namespace's function name -> the namespace's name

    @property
    def id(self) -> str:
        return f"resp_{self.gen.gen_id}"

    def item_id(self, kind: str, index: int = 0) -> str:
        return self.ids.setdefault(f"{kind}{index}", f"{kind}_{self.gen.gen_id}{index:02d}")


# --- the request ------------------------------------------------------------------------------------------------


def responses_request(body: Any, *, api_key=None, user=None) -> ResponsesRequest:
    """Validate a /v1/responses body (sync: a previous response and images are read from the database)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    _refuse(body)
    store = body.get("store", True) is not False
    if store:  # kept for previous_response_id as sent, and PostgreSQL cannot hold a NUL character
        for name, value in body.items():
            if problem := nul_problem(name, "a field's name") or nul_problem(value, name):
                raise invalid(f"{problem}; send it with store: false, or without the NUL.", param=name)
    previous = _previous(body.get("previous_response_id"), user)
    history = list(previous.messages) if previous is not None else []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string.", param="instructions")
    messages = input_messages(body.get("input"))
    tools, left_out = _tools(body.get("tools"))
    chat = {"model": body.get("model"), "messages": messages, "stream": body.get("stream"),
            "tools": tools, "tool_choice": _tool_choice(body.get("tool_choice")),
            "priority": body.get("priority"), "prompt_cache_key": body.get("prompt_cache_key"),
            **_sampling(body), **_logprobs(body), **_text_format(body.get("text"))}
    try:
        gen = chat_request({k: v for k, v in chat.items() if v is not None}, api_key=api_key, user=user)
    except OpenAIError as exc:
        raise _renamed(exc) from None
    gen.api = "responses"
    if body.get("max_output_tokens") is None:  # as OpenAI's: no cap but the window (Codex CLI sends none)
        gen.spec.max_tokens = max(model_context_window(gen.spec.model) or 0, gen.spec.max_tokens)
    gen.left_out += _reasoning_left_out(body.get("reasoning")) + left_out + unknown_fields(body, KNOWN)
    system = [{"role": "system", "content": instructions}] if instructions else []
    gen.spec.messages = _for_node(system + history + gen.new_messages, gen.tools)
    return ResponsesRequest(gen, body, history, _items(body.get("input"), gen.gen_id), previous, store,
                            namespaces=_namespaces(body.get("tools")))


def _refuse(body: dict[str, Any]) -> None:
    for name, why in REFUSED.items():
        if body.get(name) is not None and body[name] is not False:
            raise invalid(why, param=name, code="unsupported_parameter")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise invalid("reasoning must be an object.", param="reasoning")
    if reasoning and reasoning.get("effort") not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
        raise invalid("reasoning.effort must be none, minimal, low, medium, high or xhigh.", param="reasoning.effort")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid('truncation must be "disabled": the head does not drop items from a conversation.',
                      param="truncation")
    for name in ("parallel_tool_calls", "store"):
        if not isinstance(body.get(name), bool | None):
            raise invalid(f"{name} must be true or false.", param=name)
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values())):
        raise invalid("metadata must be an object of strings.", param="metadata")
    if not isinstance(body.get("previous_response_id"), str | None):
        raise invalid("previous_response_id must be a response's id.", param="previous_response_id")


def _previous(response_id: Any, user) -> StoredResponse | None:
    if response_id is None:
        return None
    stored = selectors.stored_response_get(user=user, response_id=response_id)
    if stored is None:
        raise OpenAIError(404, f"Previous response with id {response_id!r} not found (it was never stored, was "
                          "deleted or expired, or belongs to another key's owner).", code="previous_response_not_found",
                          param="previous_response_id")
    return stored


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` (a string, or a list of items) as chat messages; chat_request validates what they hold."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty list of items (messages, function_call, "
                      "function_call_output).", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        message = _item_message(item, f"input[{i}]")
        if message is None:
            continue
        if message.get("tool_calls") and out and out[-1].get("tool_calls") and out[-1]["content"] is None:
            out[-1]["tool_calls"].extend(message["tool_calls"])  # parallel calls: one assistant turn
        else:
            out.append(message)
    return out


def _item_message(item: Any, param: str) -> dict[str, Any] | None:
    if not isinstance(item, dict):
        raise invalid(f"{param} must be an item object.", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ROLES:
            raise invalid(f"{param}.role must be one of {', '.join(ROLES)}.", param=f"{param}.role")
        return {"role": item["role"], "content": _content(item.get("content"), f"{param}.content")}
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise invalid(f"{param}.{name} must be a string.", param=f"{param}.{name}")
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}}]}
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str):
            raise invalid(f"{param} needs the call_id it answers and its output.", param=param)
        if isinstance(output, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in output):
            output = "".join(p["text"] for p in output)  # content parts: their text
        if not isinstance(output, str):
            raise invalid(f"{param}.output must be a string or a list of text parts.", param=f"{param}.output")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
    if kind == "reasoning":
        return None  # a reasoning model's own notes: nothing a fleet model reads
    raise invalid(f"{param}.type {kind!r} is not supported; items are message, function_call and "
                  "function_call_output.", param=f"{param}.type")


def _content(content: Any, param: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param} must be a string or a list of content parts.", param=param)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            parts.append({"type": "input_image", "image_url": part.get("image_url")})
        else:
            raise invalid(f"{param}[{i}]: parts are input_text, output_text or input_image (with an image_url); "
                          "files are not supported.", param=f"{param}[{i}]")
    return parts


def _reasoning_left_out(reasoning: dict[str, Any] | None) -> list[str]:
    if reasoning and reasoning.get("effort") not in (None, "none", "minimal"):
        return [f"reasoning.effort {reasoning['effort']}: not held to (a model that thinks, thinks as its chat "
                "template has it; one that does not gives no reasoning)"]
    return []


def _tools(tools: Any, inner: bool = False) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """The function tools the model sees (a namespace's own function tools under their own names), and the hosted
    tools left out (web search, file search and the like run on OpenAI's side, which a fleet has not)."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise invalid("tools must be a list of function tools.", param="tools")
    out: list[dict[str, Any]] = []
    left_out: list[str] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("tools"), list) and not inner:
            functions, skipped = _tools(tool["tools"], inner=True)
            out += functions or []
            left_out += [f"tools[{i}].{what}" for what in skipped]
        elif not isinstance(kind, str) or kind == "namespace":
            raise invalid(f"tools[{i}] must be a tool object with a type (a namespace holds function and hosted "
                          "tools).",
                          param=f"tools[{i}]")
        elif kind != "function":
            left_out.append(f"tools[{i}] ({shown(kind)}): a hosted tool the fleet cannot run")
        else:
            out.append(_function_tool(tool, i))
    return out, left_out


def _namespaces(tools: list[Any] | None) -> dict[str, str]:
    """Each namespaced function's namespace, for the calls' `namespace` field (tools as _tools has checked them)."""
    return {inner["name"]: tool["name"] for tool in tools or [] if tool.get("type") == "namespace"
            and isinstance(tool.get("name"), str) for inner in tool["tools"]
            if isinstance(inner, dict) and inner.get("type") == "function" and isinstance(inner.get("name"), str)}


def _function_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if not isinstance(tool.get("strict"), bool | None) or not isinstance(tool.get("description"), str | None) or \
            not isinstance(tool.get("parameters"), dict | None):
        raise invalid(f"tools[{i}]: parameters is a JSON schema object, strict true or false, description text.",
                      param=f"tools[{i}]")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                             if tool.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}.',
                  param="tool_choice")


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    out = {name: body.get(name) for name in ("temperature", "top_p", "top_k", "seed", "deadline_ms", "stop")}
    out["max_tokens"] = body.get("max_output_tokens")
    return out


def _logprobs(body: dict[str, Any]) -> dict[str, Any]:
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise invalid("include must be a list of strings.", param="include")
    unknown = [x for x in include if x != LOGPROBS_INCLUDE and x not in IGNORED_INCLUDES]
    if unknown:
        raise invalid(f"include {unknown[0]!r} is not supported; {LOGPROBS_INCLUDE!r} is.", param="include")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid(f"top_logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}.", param="top_logprobs")
    if LOGPROBS_INCLUDE not in include:
        if top:
            raise invalid(f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}].", param="top_logprobs")
        return {}
    return {"logprobs": True, "top_logprobs": top}


def _text_format(text: Any) -> dict[str, Any]:
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        if not isinstance(text, dict):
            raise invalid("text must be an object like {\"format\": {\"type\": \"text\"}}.", param="text")
        return {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name", ""), str) or not isinstance(fmt.get("strict"), bool | None):
            raise invalid("text.format: a json_schema format's name is text and strict true or false.",
                          param="text.format")
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}}
    return {"response_format": fmt}


def _renamed(exc: OpenAIError) -> OpenAIError:
    """A chat validator's error, naming the Responses field the client sent."""
    param = exc.param or ""
    for chat, ours in RENAMED.items():
        if param == chat or param.startswith(chat + "["):
            exc.param = ours + param[len(chat):]
            exc.message = exc.message.replace(chat, ours, 1)
            break
    return exc


def _items(value: Any, gen_id: str) -> list[dict[str, Any]]:
    """The request's input as Responses items with ids (what GET .../input_items lists)."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for i, item in enumerate(items):
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text", "text": item["content"]}]
        out.append({"id": item.get("id") or f"msg_{gen_id}i{i:02d}", **item})
    return out


# --- the answer -------------------------------------------------------------------------------------------------


def _usage(run: Run) -> dict[str, Any]:
    usage = run.usage()
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": run.thinking.count},
            "total_tokens": usage["total_tokens"]}


def response_object(req: ResponsesRequest, *, status: str, output: list[dict[str, Any]], usage: Any = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    body, spec = req.body, req.gen.spec
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {
        "id": req.id, "object": "response", "created_at": req.gen.created, "status": status, "error": error,
        "incomplete_details": incomplete, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": spec.model, "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": req.previous.id if req.previous else None,
        "reasoning": {"effort": None, "summary": None}, "store": req.store,
        "temperature": spec.temperature, "top_p": spec.top_p, "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [], "text": {"format": text.get("format") or {"type": "text"}},
        "top_logprobs": body.get("top_logprobs"), "truncation": "disabled", "usage": usage,
        "user": body.get("user"), "metadata": body.get("metadata") or {},
        "prompt_cache_key": body.get("prompt_cache_key"),
    }


def _status(run: Run) -> str:
    return "incomplete" if run.finish_reason() == "length" and not run.tool_calls() else "completed"


def _message_item(req: ResponsesRequest, text: str, logprobs: list | None, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": req.item_id("msg"), "status": status, "role": "assistant",
            "content": [part] if status != "in_progress" else []}


def _reasoning_item(req: ResponsesRequest, text: str, status: str = "completed") -> dict[str, Any]:
    """A thinking model's thinking (its <think>...</think>) as OpenAI's reasoning item: the text is its content,
    there is no summary."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": req.item_id("rs"), "summary": [], "content": content, "status": status}


def _call_item(req: ResponsesRequest, index: int, call: dict[str, Any], arguments: str | None = None,
               status: str = "completed") -> dict[str, Any]:
    function = call["function"]
    item = {"type": "function_call", "id": req.item_id("fc", index), "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"] if arguments is None else arguments, "status": status}
    if namespace := req.namespaces.get(function["name"]):
        item["namespace"] = namespace  # a namespace's tool is called under its namespace, as OpenAI's API has it
    return item


def output_items(req: ResponsesRequest, run: Run) -> list[dict[str, Any]]:
    """The answer's items: a thinking model's reasoning first, then its calls or its message."""
    thought, answer = split_thinking(run.text)
    items = [_reasoning_item(req, thought)] if thought else []
    calls = run.tool_calls()
    if calls:
        return items + [_call_item(req, i, call) for i, call in enumerate(calls)]
    # the thinking's tokens are the reasoning's: the message's logprobs are the answer's own
    logprobs = chat_logprobs(None, run.logprobs[run.thinking.count if thought else 0:]) \
        if req.gen.spec.logprobs else None
    return items + [_message_item(req, answer, logprobs, _status(run))]


def finished_object(req: ResponsesRequest, run: Run) -> dict[str, Any]:
    return response_object(req, status=_status(run), output=output_items(req, run), usage=_usage(run))


def _store(req: ResponsesRequest, run: Run, body: dict[str, Any]) -> None:
    """Keep the answer for previous_response_id: the conversation through it, without the instructions (a turn's
    instructions are its own, as OpenAI's are)."""
    messages = req.history + req.gen.new_messages + [run.answer_message()]
    stored_response_create(response_id=req.id, model=req.gen.spec.model, api_key=req.gen.api_key,
                           previous=req.previous, messages=messages, input_items=req.input_items, body=body)


async def store_answer(req: ResponsesRequest, run: Run, body: dict[str, Any]) -> None:
    if req.store and run.error is None:
        await sync_to_async(_store)(req, run, body)


# --- streaming --------------------------------------------------------------------------------------------------


class ResponsesEvents:
    """A Run's events as the Responses API streams them, each with its sequence_number (an api.sse.Sink). A thinking
    model's thinking is a reasoning item at output index 0, streamed before the answer's items, which follow it."""

    keepalive = KEEPALIVE

    def __init__(self, run: Run, req: ResponsesRequest):
        self.run, self.req = run, req
        self.seq = 0
        plan = req.gen.tools
        self.holding = plan is not None  # a reply that may be a tool call is held until it clearly is not
        self.decided = plan is not None and plan.mode != "auto"
        self.held = ""
        self.opened = False
        self.text = ""
        self.splitter = Splitter()  # a thinking model's <think>...</think>: the reasoning item's, not the answer's
        self.thought = ""
        self.reasoning = "none"  # none | open | done
        self.first = 0  # the output index of the answer's first item: 1 after a reasoning item

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(body) + b"\n\n"

    def opening(self) -> list[bytes]:
        shell = response_object(self.req, status="in_progress", output=[])
        return [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def tokens(self, event: Tokens) -> list[bytes]:
        pieces = self.splitter.feed(event.text)
        # a batch that held thinking too: its logprobs are not the answer's alone, and are left to the final item
        whole = event if all(kind == "text" for kind, _ in pieces) else None
        return self._pieces(pieces, whole)

    def _pieces(self, pieces: list[tuple[str, str]], event: Tokens | None) -> list[bytes]:
        out: list[bytes] = []
        for kind, piece in pieces:
            out += self._thought(piece) if kind == "thinking" else self._answer(piece, event)
        return out

    def _thought(self, text: str) -> list[bytes]:
        out = []
        if self.reasoning == "none" and not text.strip():
            return []  # the newlines of a thinking cut short: no item of their own (split_thinking gives none)
        if self.reasoning == "none":
            self.reasoning, self.first = "open", 1
            out.append(self.event("response.output_item.added", output_index=0,
                                  item=_reasoning_item(self.req, "", "in_progress")))
        self.thought += text
        return out + [self.event("response.reasoning_text.delta", item_id=self.req.item_id("rs"), output_index=0,
                                 content_index=0, delta=text)]

    def _end_thought(self, item: dict[str, Any] | None = None) -> list[bytes]:
        """The reasoning item's end: at the answer's first text, or at the stream's end with the final `item`."""
        if self.reasoning != "open":
            return []
        self.reasoning = "done"
        item = item or _reasoning_item(self.req, self.thought)
        self.thought = item["content"][0]["text"]
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=0, content_index=0,
                           text=self.thought),
                self.event("response.output_item.done", output_index=0, item=item)]

    def _answer(self, text: str, event: Tokens | None) -> list[bytes]:
        out = self._end_thought()
        if self.holding:
            self.held += text
            if self.decided or not self.held.strip() or self.held.lstrip().startswith(("{", "[", "`")):
                self.decided = True
                return out
            self.holding, text = False, self.held
        return out + self._delta(text, event)

    def _delta(self, text: str, event: Tokens | None) -> list[bytes]:
        out = self._open()
        if text:
            self.text += text
            logprobs = chat_logprobs(event.pieces, event.logprobs) if event and self.req.gen.spec.logprobs else []
            out.append(self.event("response.output_text.delta", item_id=self.req.item_id("msg"),
                                  output_index=self.first, content_index=0, delta=text, logprobs=logprobs))
        return out

    def _open(self) -> list[bytes]:
        if self.opened:
            return []
        self.opened = True
        item = _message_item(self.req, "", None, "in_progress")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=self.first, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=self.first,
                           content_index=0, part=part)]

    async def closing(self) -> list[bytes]:
        final = finished_object(self.req, self.run)
        await store_answer(self.req, self.run, final)  # before the client hears it is done: its next turn may name it
        output = final["output"]
        reasoning = output[0] if output and output[0]["type"] == "reasoning" else None
        out = self._pieces(self.splitter.flush(), None)
        if reasoning is not None and self.reasoning == "none":  # a thinking the splitter still held whole
            out += self._thought(reasoning["content"][0]["text"])
        out += self._end_thought(reasoning)
        items = output[self.first:]
        out += self._calls(items) if self.run.tool_calls() else self._close_message(items[0])
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [*out, self.event(kind, response=final)]

    def _close_message(self, item: dict[str, Any]) -> list[bytes]:
        out = self._delta(self.held, None) if self.holding else self._open()
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": self.first, "content_index": 0}
        return [*out, self.event("response.output_text.done", **ids, text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", **ids, part=part),
                self.event("response.output_item.done", output_index=self.first, item=item)]

    def _calls(self, items: list[dict[str, Any]]) -> list[bytes]:
        out = []
        for index, item in enumerate(items, start=self.first):
            ids = {"item_id": item["id"], "output_index": index}
            out += [self.event("response.output_item.added", output_index=index,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return out

    def ending(self) -> list[bytes]:
        return []

    def failed(self, exc: OpenAIError) -> list[bytes]:
        error = {"code": exc.code or exc.type, "message": exc.message}
        return [self.event("error", code=exc.code, message=exc.message, param=exc.param),
                self.event("response.failed", response=response_object(self.req, status="failed", output=[],
                                                                       error=error))]


# --- the views --------------------------------------------------------------------------------------------------


@openai_view("POST", tokens=True, stream=True)
async def responses(request: HttpRequest) -> HttpResponse:
    body = json_body(request)
    key = request.api_key
    req = await sync_to_async(responses_request)(body, api_key=key, user=key.owner)
    req.gen.batch = request.batch_line
    return await respond(req.gen, request.quota, body=lambda run: _finished(req, run),
                         sink=lambda run: ResponsesEvents(run, req))


async def _finished(req: ResponsesRequest, run: Run) -> dict[str, Any]:
    final = finished_object(req, run)
    await store_answer(req, run, final)  # before the client hears it is done: its next turn may name it
    return final


def _stored(request: HttpRequest, response_id: str) -> StoredResponse:
    stored = selectors.stored_response_get(user=request.api_key.owner, response_id=response_id)
    if stored is None:
        raise OpenAIError(404, f"No response with id {response_id!r} found (never stored, deleted, expired, or "
                          "another owner's).", code="not_found", param="response_id")
    return stored


@openai_view("GET", "DELETE")
async def response_detail(request: HttpRequest, response_id: str) -> HttpResponse:
    stored = await sync_to_async(_stored)(request, response_id)
    if request.method == "DELETE":
        await sync_to_async(stored_response_delete)(stored=stored)
        return JsonResponse({"id": response_id, "object": "response", "deleted": True})
    return JsonResponse(stored.body)


@openai_view("GET")
async def response_input_items(request: HttpRequest, response_id: str) -> HttpResponse:
    stored = await sync_to_async(_stored)(request, response_id)
    order, limit, after = _list_params(request)
    items = stored.input_items if order == "asc" else list(reversed(stored.input_items))
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise invalid(f"after {after!r} is not an item of this response.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JsonResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


def _list_params(request: HttpRequest) -> tuple[str, int, str | None]:
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid('order must be "asc" or "desc".', param="order")
    raw = request.GET.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise invalid("limit must be a whole number from 1 to 100.", param="limit")
    return order, int(raw), request.GET.get("after")


__all__ = ["response_detail", "response_input_items", "responses", "responses_request"]
