"""Server-sent events for /v1 streams: OpenAI's chunks, keep-alives, an error event on failure, `[DONE]`.

The view waits briefly for the first event before it sends headers, so errors that come before any token
(unknown model, prompt too long, no lane by the deadline) still get a clean HTTP status. After that, the body
streams (api.streaming_app writes it); a client that goes away cancels the loop, which cancels the node's lane.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any, Protocol

from django.http import StreamingHttpResponse

from api.errors import OpenAIError
from api.generation import PENDING, Run
from api.json_out import json_bytes
from api.responses import shape_for
from fleet.dispatch import Finished, Tokens

HEADER_WAIT_S = 1.5
KEEPALIVE_S = 5.0
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def sse_event(body: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(body) + b"\n\n"


async def first_event(run: Run) -> Any:
    """The first event within HEADER_WAIT_S (PENDING if none yet); raises OpenAIError for an early failure."""
    return await run.next_event(timeout=HEADER_WAIT_S)


_runs: ContextVar[list[Run] | None] = ContextVar("fleet_streamed_runs", default=None)


def unfinished_streams_abandoned(app):
    """ASGI wrapper for Django's HTTP app (which still serves the transcription and session-message streams): after
    each request, abandon the runs whose streams it never finished. A client that hangs up between the view's return
    and the first chunk makes Django drop the response on its way out (in the middleware, or while sending the
    headers): the loop then never starts, so its own cleanup never runs, and the node would decode for nobody.

    The list lives in a context variable set here, in the request's own task; Django runs the view in a child task,
    which shares the list object, so what the view registers is seen here whatever Django did.
    """

    async def guarded(scope, receive, send):
        token = _runs.set([])
        try:
            await app(scope, receive, send)
        finally:
            runs = _runs.get() or []
            _runs.reset(token)
            for run in runs:
                if not run.over:
                    await run.abandon("client went away before the stream started")

    return guarded


def sse_response(run: Run, first: Any, sink: Sink | None = None) -> StreamingHttpResponse:
    """The stream of `run` from event `first` on, as `sink` writes it (OpenAI's chunks of the run's chat or
    completion unless given: the Responses and Messages APIs and transcriptions have sinks of their own)."""
    events = drive(run, first, sink or OpenAIChunks(shape_for(run)))
    response = StreamingHttpResponse(events, content_type="text/event-stream; charset=utf-8")
    response.events, response.run = events, run  # what api.streaming_app writes, and abandons if never started
    if (runs := _runs.get()) is not None:
        runs.append(run)
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    response["X-Fleet-Generation"] = run.request.gen_id
    if run.node:  # known when the generation started before the headers went out
        response["X-Fleet-Node"] = run.node
    return response


class Sink(Protocol):
    """What one API's stream makes of a run's events: the bytes of its SSE events (the client websocket's sink makes
    frames). `drive` calls `opening` once,
    `tokens` for each token batch, `keepalive` while the run waits (a lane, a slow node, a failover), `closing`
    when the node finished, then `ending`; or `failed` once, instead of whatever was left, when the run fails."""

    keepalive: Any  # None: no keep-alives (the client websocket's frames)

    def opening(self) -> list[Any]: ...

    def tokens(self, event: Tokens) -> list[Any]: ...

    async def closing(self) -> list[Any]: ...

    def ending(self) -> list[Any]: ...

    def failed(self, exc: OpenAIError) -> list[Any]: ...


NEXT = object()  # drive's `first` when no event was read before: the loop reads the first itself


async def drive(run: Run, first: Any, sink: Sink):
    """The one stream loop: `run`'s events from `first` on, through `sink`, with a keep-alive every KEEPALIVE_S
    while the run waits (none where the sink's keepalive is None: then no step needs a timer); a client that goes
    away (the loop cancelled or closed) abandons the run, which cancels the node's lane."""
    timeout = None if sink.keepalive is None else KEEPALIVE_S
    try:
        event = await run.next_event(timeout=timeout) if first is NEXT else first
        for chunk in sink.opening():
            yield chunk
        while event is not None:
            if event is PENDING:
                yield sink.keepalive
            elif isinstance(event, Tokens):
                for chunk in sink.tokens(event):
                    yield chunk
            elif isinstance(event, Finished):
                for chunk in await sink.closing():
                    yield chunk
            event = await run.next_event(timeout=timeout)
        last = sink.ending()
    except OpenAIError as exc:
        last = sink.failed(exc)
    except (asyncio.CancelledError, GeneratorExit):
        await run.abandon()
        raise
    for chunk in last:
        yield chunk


class OpenAIChunks:
    """OpenAI's streamed chunks (a chat's, a completion's, a transcription's: `shape` makes them), its usage chunk
    when asked for, an error chunk on failure, and `[DONE]` at the end either way."""

    keepalive = KEEPALIVE

    def __init__(self, shape: Any):
        self.shape = shape

    def opening(self) -> list[bytes]:
        return [sse_event(chunk) for chunk in self.shape.opening_chunks()]

    def tokens(self, event: Tokens) -> list[bytes]:
        return [sse_event(chunk) for chunk in self.shape.token_chunks(event)]

    async def closing(self) -> list[bytes]:
        return [sse_event(chunk) for chunk in self.shape.closing_chunks()]

    def ending(self) -> list[bytes]:
        usage = [sse_event(self.shape.usage_chunk())] if self.shape.run.request.include_usage else []
        return [*usage, DONE]

    def failed(self, exc: OpenAIError) -> list[bytes]:
        return [sse_event(exc.body()), DONE]
