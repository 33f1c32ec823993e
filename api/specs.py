"""Validate an OpenAI-style request body into one GenerateSpec, or an OpenAIError that says what to fix.

One function per interface shape (`chat_request`, `completion_request`); both end in a `GenerationRequest` that
the SSE, JSON and websocket paths serve alike. Loading a session or a handle touches the database, so the event
loop calls these through `aparse`, which runs them in a thread unless the body reads nothing stored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from asgiref.sync import sync_to_async
from django.conf import settings

from api.constraints import apply_constraints
from api.errors import OpenAIError, invalid
from api.images import IMAGE_PART_TYPES, image_part
from api.tools import ToolPlan, tool_plan
from fleet.links import registry
from fleet.selectors import acontext_windows, model_context_window
from fleet.waiting import DEFAULT_PRIORITY, PRIORITIES, RANKS
from nodes.link.spec import GenerateSpec
from nodes.registry import media_ref
from sessions import selectors
from sessions.services import logit_bias_clean, nul_problem

DEFAULT_MAX_TOKENS = 512
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_DEADLINE_MS = 3_600_000
LINK_FRAME_SLACK = 64 * 1024
ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class GenerationRequest:
    """A validated generation: the node's spec plus what the interface needs to answer and record it."""

    kind: str  # "chat" | "completion"
    spec: GenerateSpec
    deadline: float
    stream: bool = False
    include_usage: bool = False
    tools: ToolPlan | None = None
    session_id: str | None = None
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    api_key: Any = None
    batch: bool = False  # a batch line: placed below interactive generations (fleet.dispatch)
    priority: str = DEFAULT_PRIORITY  # its class in the waiting room (fleet.waiting): its key's, or lower if asked
    api: str = ""  # the interface that asked, where it is not `kind`'s own ("responses", "messages")
    left_out: list[str] = field(default_factory=list)  # what the request sent that the fleet accepted but cannot do
    cache_key: str = ""  # prompt_cache_key: the client's name for its prompt's prefix (placement, api.generation)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def gen_id(self) -> str:
        return self.spec.gen_id

    def parameters(self) -> dict[str, Any]:
        """What the Generation record keeps of the request (no prompt text: that lives in the session)."""
        s = self.spec
        params = {k: getattr(s, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                             "presence_penalty", "frequency_penalty", "repeat_penalty", "ignore_eos",
                                             "logprobs", "top_logprobs", "batch_invariant", "lora")}
        params.update(stream=self.stream, grammar=bool(s.grammar), json_schema=bool(s.json_schema),
                      logit_bias=len(s.logit_bias), deadline=s.deadline)
        if self.tools:
            params["tools"] = {"mode": self.tools.mode, "names": list(self.tools.functions)}
        return params


def chat_request(body: Any, *, api_key=None, user=None, windows: dict[str, int] | None = None) -> GenerationRequest:
    """A /v1/chat/completions body (or a websocket generate with `messages`) as a GenerationRequest. `windows`: each
    model's context window, when the caller read them (else they are read here, from the placement)."""
    body = _object(body)
    spec = _base_spec(body, windows)
    new_messages = _messages(body.get("messages"))
    plan = tool_plan(body)
    history: list[dict[str, Any]] = []
    session_id = None
    if body.get("session") is not None:
        session = selectors.session_get(user=user, session_id=body["session"])
        if session is None:
            raise invalid(f"There is no session {body['session']!r} for this API key; create one with "
                          "POST /api/sessions/.", param="session", code="session_not_found")
        if problem := nul_problem(new_messages, "messages"):  # kept with the session: PostgreSQL cannot store it
            raise invalid(f"{problem} in a session.", param="messages")
        session_id, history = str(session.id), selectors.session_history(session=session)
    spec.messages = _for_node(history + new_messages, plan)
    _apply_logprobs_chat(spec, body)
    apply_constraints(spec, body, plan, user)
    return _request("chat", spec, body, api_key, plan=plan, session_id=session_id, new_messages=new_messages)


def completion_request(body: Any, *, api_key=None, user=None,
                       windows: dict[str, int] | None = None) -> GenerationRequest:
    """A /v1/completions body (or a websocket generate with `prompt`) as a GenerationRequest (`windows` as for
    chat_request)."""
    body = _object(body)
    spec = _base_spec(body, windows)
    spec.prompt = _prompt(body.get("prompt"))
    if body.get("echo"):
        raise invalid("echo is not supported.", param="echo")
    if body.get("suffix"):
        raise invalid("suffix (fill-in-the-middle) is not supported.", param="suffix")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of must be 1.", param="best_of")
    if body.get("session") is not None:
        raise invalid("session continues chats; use /v1/chat/completions.", param="session")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        spec.logprobs, spec.top_logprobs = True, _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    apply_constraints(spec, body, None, user)
    return _request("completion", spec, body, api_key)


def _request(kind, spec, body, api_key, *, plan=None, session_id=None, new_messages=None) -> GenerationRequest:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object like {\"include_usage\": true}.", param="stream_options")
    deadline_ms = _int(body, "deadline_ms", 1, MAX_DEADLINE_MS, settings.FLEET_DEFAULT_DEADLINE_MS)
    deadline = time.time() + deadline_ms / 1000
    # A deadline the client gave bounds the whole generation; the default only bounds the wait for a lane,
    # so a client that asked for none gets its whole answer however long the node takes.
    spec.deadline = deadline if body.get("deadline_ms") is not None else None
    _fits_a_link_frame(spec)
    return GenerationRequest(kind, spec, deadline, stream=stream, include_usage=stream and bool(
        options.get("include_usage")), tools=plan, session_id=session_id, new_messages=new_messages or [],
        api_key=api_key, priority=_priority(body, api_key), cache_key=_cache_key(body))


def _cache_key(body: dict[str, Any]) -> str:
    """`prompt_cache_key` (OpenAI's): generations that carry the same one, from the same API key, are placed where
    that name's generations ran."""
    value = body.get("prompt_cache_key")
    if value is not None and not isinstance(value, str):
        raise invalid("prompt_cache_key must be a string.", param="prompt_cache_key")
    return value or ""


def _priority(body: dict[str, Any], api_key) -> str:
    """The request's class in the waiting room: `priority` if given, no higher than its key's (the key's if not
    given). Without a key (the admin playground's staff session) any class."""
    if api_key is None:
        allowed, default = PRIORITIES[0], DEFAULT_PRIORITY
    else:
        allowed = default = getattr(api_key, "priority", None) or DEFAULT_PRIORITY
    asked = body.get("priority")
    if asked is None:
        return default
    if asked not in PRIORITIES:
        raise invalid(f"priority must be one of {', '.join(PRIORITIES)} (got {asked!r}).", param="priority")
    if RANKS[asked] < RANKS[allowed]:
        raise invalid(f"priority {asked!r} is above this API key's ({allowed!r}); ask for {allowed!r} or lower, or "
                      "have staff raise the key's priority in the admin.", param="priority",
                      code="priority_not_allowed")
    return asked


def _fits_a_link_frame(spec: GenerateSpec) -> None:
    """A 413 for a spec the node link cannot carry (one frame, FLEET_LINK_MAX_FRAME_BYTES): sent, it was refused by
    the link as the node was reached, a 502 `node_lost`. LINK_FRAME_SLACK leaves room for the text a resumed
    generation carries and the message's own fields."""
    limit = settings.FLEET_LINK_MAX_FRAME_BYTES - LINK_FRAME_SLACK
    size = len(msgpack.packb(spec.to_dict(), use_bin_type=True))
    if size > limit:
        raise OpenAIError(413, f"This request makes a {size}-byte message for the node; a node link carries at most "
                          f"{limit} (FLEET_LINK_MAX_FRAME_BYTES less room for its replies). Send a shorter prompt, "
                          "fewer messages, or a smaller logit_bias, grammar or tool list.", code="request_too_large")


# --- the common parameters ------------------------------------------------------------------------------------


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    return body


def shown(name: str, limit: int = 48) -> str:
    """A name the client chose, as a header and a log line can carry it: printable ASCII (a JSON string's escapes
    for the rest, lone surrogates and newlines included), cut to `limit` characters."""
    text = json.dumps(name)[1:-1]
    return text if len(text) <= limit else text[:limit] + "..."


def unknown_fields(body: dict[str, Any], known: frozenset[str], most: int = 8) -> list[str]:
    """Top-level fields an API does not know, as left-out entries: accepted and ignored, as OpenAI's and Anthropic's
    servers do for forward compatibility, and named in X-Fleet-Left-Out and the log line (the first `most` of
    them, then a count)."""
    unknown = [name for name in body if name not in known]
    named = [f"{shown(name)}: a field Fleet does not know, ignored" for name in unknown[:most]]
    if len(unknown) > most:
        named.append(f"{len(unknown) - most} more fields Fleet does not know, ignored")
    return named


def model_name(model: Any, kind: str = "a model") -> str:
    """The `model` a request names, trimmed; a 400 when it is missing or could name no model (PostgreSQL cannot
    even look up a name with a NUL character, and the request's record would keep it)."""
    if not isinstance(model, str) or not model.strip():
        raise invalid(f"You must provide a model: {kind} as /v1/models lists it.", param="model")
    if "\x00" in model:
        raise invalid("model must not contain NUL characters: send a name as /v1/models lists it.", param="model")
    return model.strip()


def _base_spec(body: dict[str, Any], windows: dict[str, int] | None) -> GenerateSpec:
    model = model_name(body.get("model"), "its name")
    if body.get("n") not in (None, 1):
        raise invalid("Only n=1 is supported; send several requests for several choices.", param="n")
    spec = GenerateSpec(gen_id=uuid.uuid4().hex, model=registry().aliases.resolve(model))
    spec.max_tokens = _max_tokens(body, spec.model, windows)
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                         ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                         ("repeat_penalty", 0.0, 10.0)):
        if body.get(name) is not None:
            setattr(spec, name, _float(body, name, lo, hi))
    if body.get("top_k") is not None:
        spec.top_k = _int(body, "top_k", 0, 1_000_000)
    if body.get("seed") is not None:
        spec.seed = _int(body, "seed", -(2**63), 2**63 - 1)
    spec.ignore_eos = _bool(body, "ignore_eos", False)
    spec.batch_invariant = _bool(body, "batch_invariant", False)
    spec.stop = _stop(body.get("stop"))
    spec.logit_bias = _logit_bias(body.get("logit_bias"))
    spec.lora = _lora(body.get("lora"))
    return spec


def _max_tokens(body: dict[str, Any], model: str, windows: dict[str, int] | None) -> int:
    """The client's max_tokens, within the model's context window (the largest among the nodes serving it); the
    default is not checked, because the node stops at its window anyway."""
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            value = _int(body, name, 1, 1_000_000, message=f"{name} must be a whole number of at least 1.")
            window = windows.get(model) if windows is not None else model_context_window(model)
            if window is not None and value > window:
                raise invalid(f"{name} is {value}, beyond the context window of {model!r} ({window} tokens, prompt "
                              "included); ask for fewer tokens.", param=name)
            return value
    return DEFAULT_MAX_TOKENS


def _number(body, name, lo, hi, *, integer: bool, message: str | None = None):
    value = body.get(name)
    ok = not isinstance(value, bool) and (isinstance(value, int) or (not integer and isinstance(value, float)))
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if not ok or not lo <= value <= hi:
        kind = "a whole number" if integer else "a number"
        raise invalid(message or f"{name} must be {kind} from {lo} to {hi}; got {value!r}.", param=name)
    return value


def _int(body, name, lo, hi, default=None, *, message: str | None = None) -> int:
    if body.get(name) is None and default is not None:
        return default
    return _number(body, name, lo, hi, integer=True, message=message)


def _float(body, name, lo, hi) -> float:
    return float(_number(body, name, lo, hi, integer=False))


def _bool(body, name, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false.", param=name)
    return value


MAX_LORA = 8
LORA_SHAPE = 'lora must be a list of {"name": adapter, "scale": number} objects (scale defaults to 1).'


def _lora(lora: Any) -> list[list[Any]]:
    """The `lora` extension field: adapters by name with scales, as [name, scale] pairs sorted by name."""
    if lora is None:
        return []
    if not isinstance(lora, list) or len(lora) > MAX_LORA or not all(isinstance(item, dict) for item in lora):
        raise invalid(f"{LORA_SHAPE} At most {MAX_LORA}.", param="lora")
    pairs: dict[str, float] = {}
    for item in lora:
        name = item.get("name")
        if not isinstance(name, str) or not name.strip() or name in pairs:
            raise invalid(f"{LORA_SHAPE} Each names a different adapter.", param="lora")
        scale = item.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not -16 <= scale <= 16:
            raise invalid(f"the scale of LoRA adapter {name!r} must be a number from -16 to 16.", param="lora")
        pairs[name] = float(scale)
    return [[name, scale] for name, scale in sorted(pairs.items())]


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise invalid(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them.", param="stop")
    return stops


def _logit_bias(bias: Any) -> dict[int, float]:
    if bias is None:
        return {}
    try:
        return {int(k): v for k, v in logit_bias_clean(bias).items()}
    except ValueError as exc:
        raise invalid(str(exc), param="logit_bias") from None


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt must be a string (token arrays and several prompts in one request are not "
                      "supported).", param="prompt")
    if not prompt:
        raise invalid("prompt must not be empty.", param="prompt")
    return prompt


# --- chat messages --------------------------------------------------------------------------------------------


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content} objects.", param="messages")
    if len(messages) > settings.FLEET_MAX_MESSAGES:
        raise invalid(f"messages holds {len(messages)} messages; one request may send at most "
                      f"{settings.FLEET_MAX_MESSAGES} (FLEET_MAX_MESSAGES). Keep a long conversation in a session.",
                      param="messages", code="too_many_messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(index: int, message: Any) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{param} must be an object with a role and content.", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"{param}.role must be one of {', '.join(sorted(ROLES))}; got {role!r}.", param=f"{param}.role")
    clean: dict[str, Any] = {"role": "system" if role == "developer" else role,
                             "content": _content(message.get("content"), f"{param}.content", role)}
    tool_calls = message.get("tool_calls")
    if tool_calls:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise invalid(f"{param}.tool_calls belongs on assistant messages, as a list.", param=f"{param}.tool_calls")
        for i, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise invalid(f"{param}.tool_calls[{i}] must be {{id, type: function, function: {{name, arguments}}}}.",
                              param=f"{param}.tool_calls[{i}]")
        clean["tool_calls"] = tool_calls
    elif clean["content"] is None:
        raise invalid(f"{param}.content is missing.", param=f"{param}.content")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise invalid(f"{param} is a tool result: it needs the tool_call_id it answers.",
                          param=f"{param}.tool_call_id")
        clean["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str) and message["name"]:
        clean["name"] = message["name"]
    return clean


def _content(content: Any, param: str, role: str) -> str | list[dict[str, Any]] | None:
    """A message's content: its text, or (with an image) a list of text and image parts."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param} must be a string or a list of content parts.", param=param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            if role != "user":
                raise invalid(f"{param}[{i}]: images go in user messages.", param=f"{param}[{i}]")
            parts.append(image_part(part, f"{param}[{i}]"))
        else:
            raise invalid(f"{param}[{i}]: content parts are text ({{\"type\": \"text\", \"text\"}}) or images "
                          "({\"type\": \"image_url\", \"image_url\": {\"url\"}}).", param=f"{param}[{i}]")
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _for_node(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """What the node's chat template reads: text content everywhere (a template cannot render None), the calls an
    assistant made written out the way the tool prompt asks for them, and the tool prompt in the system message."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):  # a session's stored calls too: only their clean shape travels to the node
            m["tool_calls"] = [_call_clean(c) for c in m["tool_calls"] if isinstance(c, dict)]
        if isinstance(m.get("content"), list):  # a fresh grant each time: a session's images come back later
            m["content"] = [_part_for_node(part) for part in m["content"]]
        if m.get("content") is None:
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c)} for c in m.get("tool_calls") or []]
            m["content"] = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
        out.append(m)
    if plan is not None:
        prompt = plan.system_prompt()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _part_for_node(part: dict[str, Any]) -> dict[str, Any]:
    """A content part as the node reads it: an image named by hash, with where and the grant to fetch it once."""
    if part.get("type") != "image":
        return part
    image = part["image"]
    return {"type": "image", "image": {**media_ref(sha256=image["sha256"], size=image["size"]),
                                       "format": image.get("format", "")}}


def _call_clean(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier tool call in OpenAI's shape, with its arguments as JSON text: whatever else a client put in it
    (numbers msgpack cannot carry, say) stays on the head."""
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": str(function.get("name") or ""), "arguments": arguments}}


def _arguments(call: dict[str, Any]) -> Any:
    raw = call["function"]["arguments"]
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _apply_logprobs_chat(spec: GenerateSpec, body: dict[str, Any]) -> None:
    spec.logprobs = _bool(body, "logprobs", False)
    if body.get("top_logprobs") is not None:
        if not spec.logprobs:
            raise invalid("top_logprobs needs logprobs: true.", param="top_logprobs")
        spec.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)


def request_for(body: Any, *, api_key=None, user=None, windows: dict[str, int] | None = None) -> GenerationRequest:
    """Chat when the body has `messages`, completion when it has `prompt` (the websocket takes both)."""
    if isinstance(body, dict) and "prompt" in body and "messages" not in body:
        return completion_request(body, api_key=api_key, user=user, windows=windows)
    return chat_request(body, api_key=api_key, user=user, windows=windows)


# --- where the parse runs -------------------------------------------------------------------------------------

# The fields whose parse reads the body and nothing else. A body with any other field (a session; a grammar or
# logit-bias handle; a response format or tools, whose schemas are checked; a field this list does not know) or
# with a message whose content is a list of parts (an image or audio part is fetched, hashed and stored) is parsed
# in a thread, where it may read the database and files.
IN_PLACE_FIELDS = frozenset({
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "min_p", "top_k",
    "presence_penalty", "frequency_penalty", "repeat_penalty", "seed", "stop", "n", "logit_bias", "ignore_eos",
    "batch_invariant", "lora", "logprobs", "top_logprobs", "stream", "stream_options", "deadline_ms", "user",
    "echo", "suffix", "best_of", "priority", "prompt_cache_key",
})


def parses_in_place(body: Any) -> bool:
    """Whether parsing `body` reads only the body (and the placement's context windows, which aparse reads first),
    so that it costs less on the event loop than the hop to a thread and back."""
    if not isinstance(body, dict) or not IN_PLACE_FIELDS.issuperset(body):
        return False
    messages = body.get("messages")
    return not isinstance(messages, list) or not any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)


async def aparse(parse: Callable[..., GenerationRequest], body: Any, *, api_key=None, user=None,
                 in_thread: Callable = sync_to_async) -> GenerationRequest:
    """`parse(body)` (chat_request, completion_request or request_for) from the event loop: in place when the body
    reads nothing stored, else in a thread. In place it spares the request a thread hop before its generation is
    placed (Django's ASGI handler still hops once, at the end, for `response.close`).
    `in_thread`: how to reach the thread (a Channels consumer passes `database_sync_to_async`, which closes stale
    connections around the call; an HTTP request's connections are closed when it finishes).
    """
    if not parses_in_place(body):
        return await in_thread(parse)(body, api_key=api_key, user=user)
    await registry().aliases.atable()  # the model's name is resolved in place: the table is read first, off the loop
    asks = "max_tokens" in body or "max_completion_tokens" in body
    windows = await acontext_windows() if asks else {}
    return parse(body, api_key=api_key, user=user, windows=windows)


__all__ = ["GenerationRequest", "OpenAIError", "aparse", "chat_request", "completion_request", "request_for"]
