"""The OpenAI-compatible /v1 API as plain Django async views (streaming and disconnects need async, not DRF).

Each view: authenticate the key and count it against its quota, parse the body, validate it into a
GenerationRequest, run it, shape the answer. Every failure a client can cause is an OpenAI error object with a 4xx
status; every answer after authentication carries the key's x-ratelimit headers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from api.auth import v1_authenticate_async, v1_staff_session
from api.batches import BATCH_HEADER, batch_key_for
from api.errors import OpenAIError, body_too_large, invalid, openai_error_response
from api.generation import Run
from api.quotas import Ticket, quota_admit
from api.responses import shape_for
from api.specs import GenerationRequest, aparse, chat_request, completion_request
from api.sse import first_event, sse_response
from api.transcriptions import serve_transcription
from fleet.links import registry
from fleet.remote import aremote_link
from nodes import selectors as node_selectors
from nodes.link.messages import LinkError

log = logging.getLogger("api")

MAX_EMBED_INPUTS = 256
EMBED_TIMEOUT_S = 60.0


def openai_view(*methods: str, tokens: bool = False, stream: bool = False, session: bool = False):
    """Wrap an async view: method check, API-key auth, the key's quota (`tokens`: the view spends tokens, `stream`:
    it runs a generation, which holds a stream slot), OpenAIError (or a bug) as an error object, and the
    x-ratelimit headers on whatever the view answers. `session`: a request with no key may come from the admin
    playground instead (a staff session with its CSRF token; no key, so no quota, as on the playground's socket)."""

    def wrap(view: Callable[..., Awaitable[HttpResponse]]):
        @csrf_exempt
        @wraps(view)
        async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            request.quota = None
            try:
                response = await _serve_admitted(view, request, methods, (tokens, stream, session), *args, **kwargs)
            finally:
                if request.quota is not None and not request.quota.owned:  # no Run took it: free its slot now
                    await request.quota.settle()
            if request.quota is not None:
                for name, value in request.quota.headers().items():
                    response[name] = value
            return response

        wrapper.methods = methods  # what /v1/openapi.json must document (tests compare them)
        return wrapper

    return wrap


async def _serve_admitted(view, request: HttpRequest, methods, wants: tuple[bool, bool, bool], *args, **kwargs):
    tokens, stream, session = wants
    try:
        if request.method not in methods:
            raise OpenAIError(405, f"{request.method} is not allowed here; use {' or '.join(methods)}.",
                              code="method_not_allowed", headers={"Allow": ", ".join(methods)})
        request.api_key, request.batch_line = await _authenticate(request, session)
        if request.api_key is not None:
            request.quota = await quota_admit(request.api_key, tokens=tokens, stream=stream)
        return await view(request, *args, **kwargs)
    except OpenAIError as exc:
        return openai_error_response(exc)
    except Exception:
        log.exception("api: %s %s failed", request.method, request.path)
        return openai_error_response(OpenAIError(500, "The head failed to serve this request; it has been "
                                                 "logged.", code="internal_error"))


async def _authenticate(request: HttpRequest, session: bool = False):
    """The request's key, and whether it is a batch line: a worker's signed X-Fleet-Batch credential runs as the
    key that created the batch, at batch priority; anything else authenticates with its bearer key (or, where the
    view takes one, no key and the playground's staff session: None)."""
    credential = request.headers.get(BATCH_HEADER)
    if session and not credential and "Authorization" not in request.headers:
        await v1_staff_session(request)
        return None, False
    if not credential:
        return await v1_authenticate_async(request.headers.get("Authorization")), False
    key = await sync_to_async(batch_key_for)(credential)
    if key is None:
        raise OpenAIError(401, f"The {BATCH_HEADER} credential is wrong, or its batch is over or its key revoked; "
                          "only a Fleet worker sends it.", code="invalid_batch_credential")
    return key, True


def json_body(request: HttpRequest) -> dict[str, Any]:
    content_type = request.content_type or ""
    if content_type != "application/json":
        raise OpenAIError(415, f"Send the body as JSON with `Content-Type: application/json` (got "
                          f"{content_type or 'none'!r}).", code="unsupported_media_type")
    try:
        body = json.loads(request.body or b"")
    except RequestDataTooBig:
        raise body_too_large(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"The body is not valid JSON: {exc}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    return body


# --- models ---------------------------------------------------------------------------------------------------


async def served_models() -> list[str]:
    """Models a node can take a generation of now: those of schedulable linked nodes (not drained, cordoned or
    restarting) and of online nodes anywhere in the fleet."""
    live = {m for s in await registry().aplacement.nodes() if s.schedulable for m in s.models}
    recorded = await sync_to_async(node_selectors.node_models_served)()
    return sorted(live | set(recorded))


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "fleet"}


@openai_view("GET")
async def models(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"object": "list", "data": [_model_object(m) for m in await served_models()]})


@openai_view("GET")
async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    served = await served_models()
    if model not in served:
        names = ", ".join(served) or "none"
        raise OpenAIError(404, f"The model {model!r} is not served by any node (served: {names}).",
                          code="model_not_found", param="model")
    return JsonResponse(_model_object(model))


# --- generations ----------------------------------------------------------------------------------------------


@openai_view("POST", tokens=True, stream=True)
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await serve(request, chat_request)


@openai_view("POST", tokens=True, stream=True)
async def completions(request: HttpRequest) -> HttpResponse:
    return await serve(request, completion_request)


async def serve(request: HttpRequest, parse: Callable[..., GenerationRequest]) -> HttpResponse:
    body = json_body(request)
    key = request.api_key
    gen = await aparse(parse, body, api_key=key, user=key.owner)
    gen.batch = request.batch_line
    return await respond(gen, request.quota)


async def respond(gen: GenerationRequest, ticket: Ticket | None = None) -> HttpResponse:
    """Run a validated generation and answer it: SSE when it streams, else one JSON object. The Run settles the
    quota ticket when the generation ends."""
    run = Run(gen, ticket)
    try:
        if gen.stream:
            first = await first_event(run)
            return sse_response(run, first)
        async for _ in run.events():
            pass
    except asyncio.CancelledError:
        await run.abandon()
        raise
    response = JsonResponse(shape_for(run).response())
    response["X-Fleet-Node"] = run.node
    response["X-Fleet-Generation"] = gen.gen_id
    return response


@openai_view("POST", tokens=True, stream=True, session=True)
async def audio_transcriptions(request: HttpRequest) -> HttpResponse:
    return await serve_transcription(request)


# --- embeddings -----------------------------------------------------------------------------------------------


@openai_view("POST", tokens=True)
async def embeddings(request: HttpRequest) -> HttpResponse:
    body = json_body(request)
    model, texts, encoding = _embedding_input(body)
    node, link = await _embedding_node(model)
    try:
        result = await link.state_op("embed", {"texts": texts, "model": model}, EMBED_TIMEOUT_S)
    except TimeoutError:
        raise OpenAIError(504, f"Node {node!r} did not answer the embedding request in {EMBED_TIMEOUT_S:.0f} s.",
                          code="node_timeout") from None
    except LinkError as exc:
        raise OpenAIError(502, f"Node {node!r} could not embed: {exc}", code="embedding_failed") from None
    vectors = result.get("embeddings") or []
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding)} for i, v in enumerate(vectors)]
    prompt_tokens = int(result.get("prompt_tokens") or sum(max(len(t) // 4, 1) for t in texts))
    await request.quota.settle(prompt_tokens)
    response = JsonResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
    response["X-Fleet-Node"] = node
    return response


def _embedding_input(body: dict[str, Any]) -> tuple[str, list[str], str]:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid("You must provide a model: its name as /v1/models lists it.", param="model")
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise invalid("input must be a non-empty string or a list of them (token arrays are not supported).",
                      param="input")
    if len(texts) > MAX_EMBED_INPUTS:
        raise invalid(f"input may hold at most {MAX_EMBED_INPUTS} strings.", param="input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid('encoding_format must be "float" or "base64".', param="encoding_format")
    if body.get("dimensions") is not None:
        raise invalid("dimensions is not supported: the model's own size is returned.", param="dimensions")
    return model.strip(), texts, encoding


async def _embedding_node(model: str) -> tuple[str, Any]:
    """A node serving the model, the least busy first (an embedding takes no generation lane); one linked to
    this head process before one linked to another (which the request then reaches through the channel layer)."""
    reg = registry()
    nodes = await reg.aplacement.nodes()
    await _refuse_speech_model(model, nodes)
    slots = [s for s in nodes if model in s.models and "embeddings" in s.capabilities]
    if not slots:
        served = ", ".join(sorted({m for s in nodes for m in s.models})) or "none"
        raise OpenAIError(404, f"The model {model!r} is not served by any node that embeds (served: {served}).",
                          code="model_not_found", param="model")
    for slot in sorted(slots, key=lambda s: (s.node_id not in reg.links, not s.schedulable, s.running - s.lanes,
                                             s.identity)):
        link = reg.links.get(slot.node_id) or await aremote_link(slot.node_id, slot.identity)
        if link is not None:
            return slot.identity, link
    raise OpenAIError(503, f"No node serving {model!r} can be reached now; retry shortly.", code="node_unavailable")


async def _refuse_speech_model(model: str, nodes) -> None:
    """A 400 for a speech model (`node_join --transcribe`): its node would embed with its text model instead, under
    the speech model's name."""
    speech = await sync_to_async(node_selectors.node_speech_models)()
    if model in speech:
        text = ", ".join(sorted({m for s in nodes for m in s.models if "embeddings" in s.capabilities} - speech))
        raise OpenAIError(400, f"The model {model!r} is a speech model: it transcribes audio "
                          f"(/v1/audio/transcriptions) and makes no embeddings; name a text model (serving now: "
                          f"{text or 'none'}).", code="model_not_supported", param="model")


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return [float(x) for x in vector]
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

