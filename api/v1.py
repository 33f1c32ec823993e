"""The OpenAI-compatible /v1 API as plain Django async views (streaming and disconnects need async, not DRF).

Each view: authenticate the key and count it against its quota, parse the body, validate it into a
GenerationRequest, run it, shape the answer. Every failure a client can cause is an OpenAI error object with a 4xx
status; every answer after authentication carries the key's x-ratelimit headers.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from api.auth import v1_authenticate_async, v1_staff_session
from api.batches import BATCH_HEADER, batch_key_for
from api.errors import OpenAIError, body_too_large, invalid, openai_error_response, store_unavailable
from api.generation import Run
from api.json_in import JsonRefused, json_loads
from api.quotas import Ticket, quota_admit
from api.responses import shape_for
from api.specs import GenerationRequest, aparse, chat_request, completion_request, model_name
from api.sse import first_event, sse_response
from api.transcriptions import serve_transcription
from fleet import tracing
from fleet.links import registry
from fleet.reported import count_checked, embedding_tokens_bound
from nodes import selectors as node_selectors
from nodes.link.messages import LinkClosed, LinkError

log = logging.getLogger("api")

MAX_EMBED_INPUTS = 256
EMBED_TIMEOUT_S = 60.0
EMBED_ATTEMPTS = 3  # nodes tried when links close under an embedding (as MAX_ATTEMPTS for a generation)
EMBED_BATCH_INPUTS = 32  # a node link frame (4 MiB) holds 32 vectors of 8,192 dimensions as msgpack doubles
EMBED_BATCH_CHARS = 1024 * 1024


def openai_view(*methods: str, tokens: bool = False, stream: bool = False, session: bool = False,
                errors: Callable[[OpenAIError], HttpResponse] = openai_error_response):
    """Wrap an async view: method check, API-key auth, the key's quota (`tokens`: the view spends tokens, `stream`:
    it runs a generation, which holds a stream slot), OpenAIError (or a bug) as an error object, and the
    x-ratelimit headers on whatever the view answers. `session`: a request with no key may come from the admin
    playground instead (a staff session with its CSRF token; no key, so no quota, as on the playground's socket).
    `errors`: how an OpenAIError is answered (another API's shape: Anthropic's on /v1/messages)."""

    def wrap(view: Callable[..., Awaitable[HttpResponse]]):
        @csrf_exempt
        @wraps(view)
        async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            request.quota = None
            request.trace = tracing.request_begin(request.headers, request.path)  # a Run takes it over
            try:
                response = await _serve_admitted(view, request, methods, (tokens, stream, session), errors, *args,
                                                 **kwargs)
            finally:
                if request.quota is not None and not request.quota.owned:  # no Run took it: free its slot now
                    await request.quota.settle()
            tracing.request_end(request.trace, response.status_code)
            if request.quota is not None:
                for name, value in request.quota.headers().items():
                    response[name] = value
            return response

        wrapper.methods = methods  # what /v1/openapi.json must document (tests compare them)
        return wrapper

    return wrap


async def _serve_admitted(view, request: HttpRequest, methods, wants: tuple[bool, bool, bool], errors, *args,
                          **kwargs):
    tokens, stream, session = wants
    try:
        if request.method not in methods:
            raise OpenAIError(405, f"{request.method} is not allowed here; use {' or '.join(methods)}.",
                              code="method_not_allowed", headers={"Allow": ", ".join(methods)})
        request.api_key, request.batch_line = await _authenticate(request, session)
        tracing.request_key(request.trace, request.api_key, request.batch_line)
        if request.api_key is not None:
            with tracing.admission(request.trace):
                request.quota = await quota_admit(request.api_key, tokens=tokens, stream=stream)
        return await view(request, *args, **kwargs)
    except OpenAIError as exc:
        return errors(exc)
    except MultiPartParserError as exc:  # Django's parser, when the view reads request.POST or FILES
        return errors(invalid(f"The multipart/form-data body could not be read ({exc}); send it with its boundary, "
                              "as an HTTP client's multipart encoder does."))
    except Exception as exc:
        if (unavailable := store_unavailable(exc)) is not None:
            log.warning("api: %s %s: %s (%s)", request.method, request.path, unavailable.message, exc)
            return errors(unavailable)
        log.exception("api: %s %s failed", request.method, request.path)
        return errors(OpenAIError(500, "The head failed to serve this request; it has been logged.",
                                  code="internal_error"))


async def _authenticate(request: HttpRequest, session: bool = False):
    """The request's key, and whether it is a batch line: a worker's signed X-Fleet-Batch credential runs as the
    key that created the batch, at batch priority; anything else authenticates with its bearer key (or, where the
    view takes one, no key and the playground's staff session: None)."""
    credential = request.headers.get(BATCH_HEADER)
    if session and not credential and "Authorization" not in request.headers:
        await v1_staff_session(request)
        return None, False
    if not credential:
        return await v1_authenticate_async(_authorization(request)), False
    key = await sync_to_async(batch_key_for)(credential)
    if key is None:
        raise OpenAIError(401, f"The {BATCH_HEADER} credential is wrong, or its batch is over or its key revoked; "
                          "only a Fleet worker sends it.", code="invalid_batch_credential")
    return key, True


def _authorization(request: HttpRequest) -> str | None:
    """The bearer header; else Anthropic's `x-api-key` as one (its clients send nothing else)."""
    header = request.headers.get("Authorization")
    if header is None and request.headers.get("x-api-key"):
        return f"Bearer {request.headers['x-api-key']}"
    return header


def json_body(request: HttpRequest) -> dict[str, Any]:
    content_type = request.content_type or ""
    if content_type != "application/json":
        raise OpenAIError(415, f"Send the body as JSON with `Content-Type: application/json` (got "
                          f"{content_type or 'none'!r}).", code="unsupported_media_type")
    try:
        body = json_loads(request.body or b"")
    except RequestDataTooBig:
        raise body_too_large(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) from None
    except JsonRefused as exc:
        raise invalid(f"The body is not accepted: {exc}.", code="invalid_json") from None
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


def _model_object(name: str, alias_of: str | None = None) -> dict[str, Any]:
    body = {"id": name, "object": "model", "created": 0, "owned_by": "fleet"}
    return {**body, "alias_of": alias_of} if alias_of else body


async def _listed() -> dict[str, str | None]:
    """Each name a client may ask for -> the served model it is an alias of (None: it is that model). An alias is
    listed while its target is served; an on-demand registry model always (its first request loads it)."""
    served = await served_models()
    names: dict[str, str | None] = dict.fromkeys(sorted({*served, *await sync_to_async(
        node_selectors.models_on_demand)()}))
    for alias, target in (await registry().aliases.atable()).items():
        if target in names and alias not in names:
            names[alias] = target
    return names


@openai_view("GET")
async def models(request: HttpRequest) -> HttpResponse:
    listed = await _listed()
    return JsonResponse({"object": "list", "data": [_model_object(m, listed[m]) for m in sorted(listed)]})


@openai_view("GET")
async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    listed = await _listed()
    if model not in listed:
        names = ", ".join(sorted(listed)) or "none"
        raise OpenAIError(404, f"The model {model!r} is not served by any node (served: {names}).",
                          code="model_not_found", param="model")
    return JsonResponse(_model_object(model, listed[model]))


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


async def respond(gen: GenerationRequest, ticket: Ticket | None = None, *, body: Any = None,
                  sink: Any = None) -> HttpResponse:
    """Run a validated generation and answer it: SSE when it streams, else one JSON object. The Run settles the
    quota ticket when the generation ends. Every API answers through here: `body(run)` (awaitable) is the JSON
    answer (chat's or completion's shape unless given); `sink(run)` streams another API's events (api.sse.Sink;
    OpenAI's chunks unless given)."""
    run = Run(gen, ticket)
    if gen.left_out:
        log.info("generation %s: left out what the fleet cannot do: %s", gen.gen_id, "; ".join(gen.left_out))
    try:
        if gen.stream:
            first = await first_event(run)
            return left_out(sse_response(run, first, sink(run) if sink else None), gen)
        async for _ in run.events():
            pass
        answer = await body(run) if body else shape_for(run).response()
    except asyncio.CancelledError:
        await run.abandon()
        raise
    response = JsonResponse(answer)
    response["X-Fleet-Node"] = run.node
    response["X-Fleet-Generation"] = gen.gen_id
    return left_out(response, gen)


def left_out(response: HttpResponse, gen: GenerationRequest) -> HttpResponse:
    """`X-Fleet-Left-Out`: what the request asked for that the fleet accepted and did not do (docs/api.md)."""
    if gen.left_out:
        response["X-Fleet-Left-Out"] = "; ".join(gen.left_out)
    return response


@openai_view("POST", tokens=True, stream=True, session=True)
async def audio_transcriptions(request: HttpRequest) -> HttpResponse:
    return await serve_transcription(request)


# --- embeddings -----------------------------------------------------------------------------------------------


@openai_view("POST", tokens=True)
async def embeddings(request: HttpRequest) -> HttpResponse:
    body = json_body(request)
    model, texts, encoding = _embedding_input(body)
    model = (await registry().aliases.atable()).get(model, model)
    node, vectors, prompt_tokens = "", [], 0
    for batch in _embedding_batches(texts):
        node, result = await _embedded(model, batch)
        vectors += result.get("embeddings") or []
        prompt_tokens += count_checked(result.get("prompt_tokens") or sum(max(len(t) // 4, 1) for t in batch),
                                       embedding_tokens_bound(batch), what="prompt_tokens", node=node)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding)} for i, v in enumerate(vectors)]
    await request.quota.settle(prompt_tokens)
    response = JsonResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
    response["X-Fleet-Node"] = node
    return response


async def _embedded(model: str, texts: list[str]) -> tuple[str, dict[str, Any]]:
    """(the node, its answer) for an embedding; a node whose link closes while it embeds hands the request to the
    next one that embeds the model, as a lost node's generation is placed again (EMBED_ATTEMPTS in all)."""
    lost: list[str] = []
    for _ in range(EMBED_ATTEMPTS):
        node, link = await _embedding_node(model, lost_on=lost)
        try:
            return node, await link.state_op("embed", {"texts": texts, "model": model}, EMBED_TIMEOUT_S)
        except TimeoutError:
            raise OpenAIError(504, f"Node {node!r} did not answer the embedding request in {EMBED_TIMEOUT_S:.0f} s.",
                              code="node_timeout") from None
        except LinkClosed:
            log.warning("api: node %r's link closed while it embedded; trying another node", node)
            lost.append(node)
        except LinkError as exc:
            raise OpenAIError(502, f"Node {node!r} could not embed: {exc}", code="embedding_failed") from None
    raise OpenAIError(502, f"The links of nodes {', '.join(lost)} closed while they embedded.", code="node_lost")


def _embedding_batches(texts: list[str]) -> list[list[str]]:
    """The inputs in runs of at most EMBED_BATCH_INPUTS and EMBED_BATCH_CHARS: one link frame each way holds a run
    and its vectors (256 vectors of a 4,096-wide model are about 9 MB of msgpack, over a frame)."""
    batches: list[list[str]] = [[]]
    size = 0
    for text in texts:
        if batches[-1] and (len(batches[-1]) == EMBED_BATCH_INPUTS or size + len(text) > EMBED_BATCH_CHARS):
            batches.append([])
            size = 0
        batches[-1].append(text)
        size += len(text)
    return batches


def _embedding_input(body: dict[str, Any]) -> tuple[str, list[str], str]:
    model = model_name(body.get("model"), "its name")
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise invalid("input must be a non-empty string or a list of them (token arrays are not supported).",
                      param="input")
    if len(texts) > MAX_EMBED_INPUTS:
        raise invalid(f"input may hold at most {MAX_EMBED_INPUTS} strings.", param="input")
    if any(len(t) > EMBED_BATCH_CHARS for t in texts):
        raise invalid(f"each input may hold at most {EMBED_BATCH_CHARS} characters (far past any model's context).",
                      param="input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid('encoding_format must be "float" or "base64".', param="encoding_format")
    if body.get("dimensions") is not None:
        raise invalid("dimensions is not supported: the model's own size is returned.", param="dimensions")
    return model.strip(), texts, encoding


async def _embedding_node(model: str, lost_on: list[str] = ()) -> tuple[str, Any]:
    """A node serving the model and linked to this head process (every node links every head process it can
    reach), the least busy first (an embedding takes no generation lane). `lost_on`: the nodes whose links closed
    under this request, never tried again."""
    reg = registry()
    nodes = await reg.aplacement.nodes()
    await _refuse_speech_model(model, nodes)
    slots = [s for s in nodes if model in s.models and "embeddings" in s.capabilities and s.identity not in lost_on]
    if not slots and lost_on:
        raise OpenAIError(502, f"The link of node {lost_on[-1]!r} closed while it embedded, and no other node embeds "
                               f"{model!r}.", code="node_lost")
    if not slots:
        served = ", ".join(sorted({m for s in nodes for m in s.models})) or "none"
        raise OpenAIError(404, f"The model {model!r} is not served by any node that embeds (served: {served}).",
                          code="model_not_found", param="model")
    for slot in sorted(slots, key=lambda s: (not s.schedulable, s.running - s.lanes, s.identity)):
        link = reg.links.get(slot.node_id)
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

