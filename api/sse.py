"""Server-sent events for /v1 streams: OpenAI's chunks, keep-alives, an error event on failure, `[DONE]`.

The view waits briefly for the first event before it sends headers, so errors that come before any token
(unknown model, prompt too long, no lane by the deadline) still get a clean HTTP status. After that, the body
streams; a client that goes away cancels the node's lane (Django cancels the body's iterator on disconnect).
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any

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


_bodies: ContextVar[list[SSEBody] | None] = ContextVar("fleet_sse_bodies", default=None)


class SSEBody:
    """A stream's body that `sse_guard` can free if Django never starts sending it.

    A client that hangs up between the view's return and the first chunk makes Django cancel the response on
    its way out (in the middleware, or while sending the headers): the body generator then never starts, so
    its own cleanup never runs, and the node would keep decoding for nobody.
    """

    def __init__(self, run: Run, first: Any, shape: Any = None, events: Any = None):
        self.run = run
        self.started = False
        self.body = self._body(first, shape, events or sse_body)
        pending = _bodies.get()
        if pending is not None:
            pending.append(self)

    async def _body(self, first: Any, shape: Any, events: Any):
        self.started = True
        async for chunk in events(self.run, first, shape):
            yield chunk

    def __aiter__(self):
        return self.body


def sse_guard(app):
    """ASGI wrapper for Django's HTTP app: after each request, abandon the streams Django never started.

    The list lives in a context variable set here, in the request's own task; Django runs the view in a child
    task, which shares the list object, so what the view registers is seen here whatever Django did.
    """

    async def guarded(scope, receive, send):
        token = _bodies.set([])
        try:
            await app(scope, receive, send)
        finally:
            pending = _bodies.get() or []
            _bodies.reset(token)
            for body in pending:
                if not body.started and not body.run.over:
                    await body.run.abandon("client went away before the stream started")

    return guarded


def sse_response(run: Run, first: Any, shape: Any = None, events: Any = None) -> StreamingHttpResponse:
    """The stream of `run` from event `first` on; `shape` turns events into chunks (the run's completion or chat shape
    unless given: a transcription has its own). `events(run, first, shape)`: the body's bytes, where an API streams
    other events than OpenAI's chunks (the Responses and Messages APIs); sse_body unless given."""
    body = SSEBody(run, first, shape, events)
    response = StreamingHttpResponse(body, content_type="text/event-stream; charset=utf-8")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    response["X-Fleet-Generation"] = run.request.gen_id
    if run.node:  # known when the generation started before the headers went out
        response["X-Fleet-Node"] = run.node
    return response


async def sse_body(run: Run, first: Any, shape: Any = None):
    shape = shape or shape_for(run)
    event = first
    try:
        for chunk in shape.opening_chunks():
            yield sse_event(chunk)
        while True:
            if event is PENDING:
                yield KEEPALIVE
            elif event is None:
                break
            elif isinstance(event, Tokens):
                for chunk in shape.token_chunks(event):
                    yield sse_event(chunk)
            elif isinstance(event, Finished):
                for chunk in shape.closing_chunks():
                    yield sse_event(chunk)
            event = await run.next_event(timeout=KEEPALIVE_S)
        if run.request.include_usage:
            yield sse_event(shape.usage_chunk())
    except OpenAIError as exc:
        yield sse_event(exc.body())
    except (asyncio.CancelledError, GeneratorExit):
        await run.abandon()
        raise
    yield DONE
