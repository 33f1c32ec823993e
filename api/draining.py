"""A head that is draining (fleet/shutdown.py) takes no new work: each new HTTP request is a 503 with Retry-After in
its API's own error shape (so a load balancer or a client goes to another head), `/healthz` included, and a new
websocket (a node link, a client stream) is refused before it is accepted (the node dials the other heads)."""

from __future__ import annotations

import json

from api.errors import OpenAIError, anthropic_body, anthropic_path
from fleet.shutdown import RETRY_AFTER_S

MESSAGE = "This head is shutting down and takes no new requests; retry (another head answers)."


def draining_body(path: str) -> bytes:
    """OpenAI's error object on /v1 (Anthropic's on its Messages API), DRF's `{"detail": ...}` everywhere else."""
    if anthropic_path(path):
        return json.dumps(anthropic_body(503, MESSAGE)).encode()
    if path.startswith("/v1/"):
        return json.dumps(OpenAIError(503, MESSAGE, code="head_shutting_down").body()).encode()
    return json.dumps({"detail": MESSAGE, "ok": False}).encode()


def refuse_while_draining(app, shutdown):
    """ASGI wrapper (HTTP and websockets) in front of `app`: pass through until `shutdown().draining` (`shutdown`:
    the process's fleet.shutdown.Shutdown, read at each request: tests make the process state afresh)."""

    async def guarded(scope, receive, send):
        if not shutdown().draining or scope["type"] not in ("http", "websocket"):
            return await app(scope, receive, send)
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1013})  # "try again later", before the handshake ends
            return
        body = draining_body(scope.get("path", ""))
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode()),
            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return guarded
