"""Input limits at the door: an HTTP request body over FLEET_MAX_BODY_BYTES is a 413 before Django reads it.

Django's own DATA_UPLOAD_MAX_MEMORY_SIZE only checks a declared Content-Length, and only where Django parses the
body itself (DRF's JSON parser reads the stream past it); Django's ASGI handler also spools any body to disk
before a view runs. So the limit is kept here, in front of Django: a declared length over it is answered without
reading a byte, and a chunked body is counted as it arrives and refused as soon as it passes the limit.
"""

from __future__ import annotations

import json

from django.conf import settings

from api.errors import anthropic_body, anthropic_path, body_too_large


def too_large_body(path: str, limit: int) -> bytes:
    """OpenAI's error object on /v1 (Anthropic's on its Messages API), DRF's `{"detail": ...}` everywhere else."""
    error = body_too_large(limit)
    if anthropic_path(path):
        return json.dumps(anthropic_body(413, error.message)).encode()
    return json.dumps(error.body() if path.startswith("/v1/") else {"detail": error.message}).encode()


def body_limit(app):
    """ASGI wrapper for the HTTP app: refuse bodies over FLEET_MAX_BODY_BYTES with a 413, else replay the body."""

    async def limited(scope, receive, send):
        limit = _limit(scope.get("path"))
        if _declared_length(scope) > limit:
            await _refuse(scope, send, limit)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await _refuse(scope, send, limit)
                return
            if not message.get("more_body"):
                break
        async def replay():
            # The chunks are let go once handed on: this closure lives as long as Django's request, which is a
            # reference cycle, so a body kept here waited for a full garbage collection (4 MB an upload part).
            nonlocal chunks
            if chunks is None:
                return await receive()  # after the body: the disconnect Django listens for
            body, chunks = b"".join(chunks), None
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return limited


def _limit(path: str | None) -> int:
    """An upload for /v1/batches may be larger than any one request (api.batches checks it against this), and so may
    an audio file (api.transcriptions checks it against FLEET_MAX_AUDIO_BYTES); a form's other fields fit in 1 MiB."""
    if path == "/v1/files":
        return settings.FLEET_BATCH_FILE_MAX_BYTES + 65536
    if path == "/v1/audio/transcriptions":
        return max(settings.FLEET_MAX_AUDIO_BYTES + (1 << 20), settings.FLEET_MAX_BODY_BYTES)
    return settings.FLEET_MAX_BODY_BYTES


def _declared_length(scope) -> int:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


async def _refuse(scope, send, limit: int) -> None:
    body = too_large_body(scope.get("path", ""), limit)
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
