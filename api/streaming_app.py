"""The four generation endpoints (/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages) as a plain ASGI
app, routed in fleet/asgi.py ahead of Django's handler, under daphne.

A generation's request needs none of what Django's handler and middleware do for a page (sessions, CSRF, messages,
static files): its view authenticates its own key, and its answer is one JSON object
or a stream of SSE events. Here the body (already bounded by api.limits) is read whole and handed to the same view
as a Django request object (so the views, the URLconf and Django's test client are unchanged), and the answer is
written straight to the server: each chunk `api.sse.drive` makes is one `send`, with nothing between.

This app owns a stream's lifetime. A client that goes away (`http.disconnect`) cancels the answer at once: the
loop's `except` abandons the run, which cancels the node's lane and writes the record. A stream the client left
before its first chunk (between the view's answer and the headers going out) never entered the loop, so the run
is abandoned here instead; a run is never left decoding for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress
from io import BytesIO
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.db import close_old_connections
from django.http import HttpResponseBase

log = logging.getLogger("api")

# What Django's security middleware adds to every answer that these endpoints' answers can use.
SAFE_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"same-origin")]


def stream_routes() -> dict[str, Callable[..., Any]]:
    """Path -> view for the endpoints served here (their URLconf entries stay, for `reverse` and the test client)."""
    from api import anthropic_messages, responses_api, v1

    return {"/v1/chat/completions": v1.chat_completions, "/v1/completions": v1.completions,
            "/v1/responses": responses_api.responses, "/v1/messages": anthropic_messages.messages}


def generations_first(app, routes: dict[str, Callable[..., Any]] | None = None):
    """ASGI wrapper for the HTTP app: the generation endpoints served here, anything else by `app`."""
    routes = stream_routes() if routes is None else routes

    async def routed(scope, receive, send):
        view = routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if view is None:
            return await app(scope, receive, send)
        await serve(view, scope, receive, send)

    return routed


async def serve(view: Callable[..., Any], scope, receive, send) -> None:
    """One request to `view`, answered until it ends or the client goes away (whichever comes first)."""
    body = await _body(receive)
    if body is None:  # gone while sending it
        return
    # As Django's handler: the request's synchronous work (its database calls) on a thread of its own, so that one
    # slow call never holds up another request's, and stale connections closed there at its end.
    async with ThreadSensitiveContext():
        answering = asyncio.ensure_future(answer(view, ASGIRequest(scope, BytesIO(body)), send))
        leaving = asyncio.ensure_future(_gone(receive))
        try:
            await asyncio.wait((answering, leaving), return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not answering.done():
                answering.cancel()
            with suppress(asyncio.CancelledError):
                await answering
            await sync_to_async(close_old_connections)()


async def answer(view: Callable[..., Any], request: ASGIRequest, send) -> None:
    response: HttpResponseBase = await view(request)
    events = getattr(response, "events", None)  # a stream's chunks straight from `drive` (api.sse.sse_response)
    try:
        await send({"type": "http.response.start", "status": response.status_code, "headers": _headers(response)})
        if events is not None:
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send({"type": "http.response.body", "body": response.content})
    finally:
        if events is not None:
            await events.aclose()  # cancelled between chunks: the loop abandons the run at its `yield`
            run = response.run
            if not run.over:  # the loop never started: nothing of the run's was sent
                await run.abandon("client went away before the stream started")


def _headers(response: HttpResponseBase) -> list[tuple[bytes, bytes]]:
    headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.items()]
    if not response.streaming:
        headers.append((b"content-length", str(len(response.content)).encode()))
    for cookie in response.cookies.values():
        headers.append((b"set-cookie", cookie.output(header="").strip().encode("latin-1")))
    return headers + SAFE_HEADERS


async def _body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _gone(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
