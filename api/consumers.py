"""The client websocket at /ws/v1/generate: several generations at once on one socket, each by the client's id.

Auth happens in connect(): `Authorization: Bearer <key>` or `?api_key=<key>` (browsers cannot set headers), or,
with no key, a logged-in staff Django session from the same origin (the admin playground); a refused socket is
closed with 4401 and a reason. Frames in: generate, cancel, ping. Frames out: token, done,
error (and pong), each with a `seq` per generation id. Closing the socket cancels all its generations.
Each generate frame is checked against the key (revoked since connect: close 4401) and its quotas (over one: an
error frame with code `rate_limit_exceeded` and `retry_after`); its stream slot frees when the generation ends.
A frame over FLEET_MAX_BODY_BYTES (the HTTP body limit) is refused with a `message_too_large` error frame; the
socket and its other generations go on.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from typing import Any
from urllib.parse import urlsplit

from channels import auth as channels_auth
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from api.auth import bearer_from_scope
from api.errors import OpenAIError
from api.generation import Run
from api.json_in import JsonRefused, json_loads
from api.json_out import json_text
from api.quotas import Ticket, quota_admit
from api.services import api_key_authenticate, api_key_verified
from api.specs import aparse, request_for
from api.sse import NEXT, drive
from fleet import tracing
from fleet.dbsweep import FramesSkipSweep
from fleet.dispatch import Tokens

log = logging.getLogger("api")

CLOSE_UNAUTHORIZED = 4401
MAX_RUNNING = 32


class _Refused(Exception):
    """A generate frame was refused and the client told why."""


class ClientStreamConsumer(FramesSkipSweep, AsyncJsonWebsocketConsumer):
    """One client's socket. Each generation runs as its own task and streams independently."""

    @classmethod
    async def encode_json(cls, content: Any) -> str:
        return json_text(content)  # orjson, where Channels' own uses the standard library (api/json_out.py)

    async def connect(self) -> None:
        self.api_key = self.bearer = None
        self.user = None  # set once the socket is authenticated: the key's owner, or the staff session's user
        self.running: dict[Any, tuple[Run, asyncio.Task]] = {}
        await self.accept()
        key = bearer_from_scope(self.scope)
        if key is None:
            await self._connect_session()
            return
        # A key this process verified lately is not looked up again (as for HTTP requests and generate frames): on
        # the process's one consumer database thread, hundreds of sockets dialing at once would wait in turn.
        row = await api_key_verified(key=key) or await database_sync_to_async(api_key_authenticate)(key=key)
        if row is None or not row.owner.is_active:
            await self._refuse("the API key is wrong or revoked")
            return
        self.api_key, self.user, self.bearer = row, row.owner, key

    async def _connect_session(self) -> None:
        """No key: a logged-in, active staff user's session (the admin playground), only from this site's pages."""
        # Resolved here, not by Channels' AuthMiddleware before connect(): that costs every socket a hop to the
        # process's one thread for consumers' database work before its handshake ends, keyed sockets included.
        user = await channels_auth.get_user(self.scope)
        if user is None or not user.is_authenticated:
            await self._refuse("missing API key: send Authorization: Bearer <key> or ?api_key=<key>")
        elif not (user.is_active and user.is_staff):
            await self._refuse("only staff users may use the websocket with a session; send an API key")
        elif not same_origin(self.scope):
            await self._refuse("a session-authenticated socket must come from this site's own pages (Origin)")
        else:
            self.user = user

    async def _refuse(self, reason: str) -> None:
        # daphne drops close reasons, so the reason also goes out as an error frame first.
        await self.send_json(_error(None, 0, "unauthorized", reason))
        await self.close(code=CLOSE_UNAUTHORIZED, reason=reason)

    async def disconnect(self, code: int) -> None:
        for client_id in list(getattr(self, "running", {})):
            await self._stop(client_id, "client went away")

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.user is None:
            return
        size = len(text_data.encode()) if text_data is not None else len(bytes_data or b"")
        if size > settings.FLEET_MAX_BODY_BYTES:
            await self.send_json(_error(None, 0, "message_too_large", f"This frame holds {size} bytes; a frame may "
                                        f"hold at most {settings.FLEET_MAX_BODY_BYTES} (FLEET_MAX_BODY_BYTES)."))
            return
        try:
            frame = json_loads(text_data if text_data is not None else bytes_data)
        except JsonRefused as exc:
            await self.send_json(_error(None, 0, "invalid_json", f"The frame is not accepted: {exc}."))
            return
        except (ValueError, TypeError):
            await self.send_json(_error(None, 0, "invalid_json", "Each frame is one JSON object."))
            return
        if not isinstance(frame, dict):
            await self.send_json(_error(None, 0, "invalid_json", "Each frame is one JSON object."))
            return
        kind = frame.get("type")
        if kind == "generate":
            await self._generate(frame)
        elif kind == "cancel":
            await self._cancel(frame.get("id"))
        elif kind == "ping":
            await self.send_json({"type": "pong", "id": frame.get("id")})
        else:
            await self.send_json(_error(frame.get("id"), 0, "unknown_frame", f"Unknown frame type {kind!r}; send "
                                        "generate, cancel or ping."))

    async def _generate(self, frame: dict[str, Any]) -> None:
        client_id = frame.get("id")
        if not isinstance(client_id, str | int) or isinstance(client_id, bool) or client_id == "":
            await self.send_json(_error(None, 0, "invalid_request", "A generate frame needs an `id` (a string)."))
            return
        if client_id in self.running:
            await self.send_json(_error(client_id, 0, "duplicate_id", f"Generation {client_id!r} is still running."))
            return
        if len(self.running) >= MAX_RUNNING:
            await self.send_json(_error(client_id, 0, "too_many_generations",
                                        f"At most {MAX_RUNNING} generations run at once on one socket."))
            return
        try:
            ticket = await self._admit(client_id)
        except _Refused:
            return
        body = {k: v for k, v in frame.items() if k not in ("type", "id", "traceparent", "tracestate")}
        try:
            gen = await aparse(request_for, body, api_key=self.api_key, user=self.user,
                               in_thread=database_sync_to_async)
        except OpenAIError as exc:
            if ticket is not None:
                await ticket.settle()
            await self.send_json(_error(client_id, 1, exc.code or "invalid_request", exc.message, exc.param))
            return
        run = Run(gen, ticket, tracing.request_begin(frame, "/ws/v1/generate"))  # the frame's traceparent
        task = asyncio.ensure_future(self._relay(client_id, run))
        self.running[client_id] = (run, task)

    async def _admit(self, client_id: Any) -> Ticket | None:
        """The key's quota ticket for one generation (None for a staff session, which has no key). Raises _Refused,
        having told the client, when the key is over a quota (an error frame) or was revoked since the socket
        opened (the socket closes with 4401)."""
        if self.api_key is None:
            return None
        row = await api_key_verified(key=self.bearer) or await database_sync_to_async(api_key_authenticate)(
            key=self.bearer)
        if row is None or not row.owner.is_active:
            await self._refuse("the API key was revoked, or its owner deactivated")
            raise _Refused
        self.api_key = row  # the row as it is now: its quotas may have changed
        try:
            return await quota_admit(row, tokens=True, stream=True)
        except OpenAIError as exc:
            frame = _error(client_id, 1, exc.code, exc.message)
            await self.send_json({**frame, "retry_after": int(exc.headers["Retry-After"])})
            raise _Refused from None

    async def _relay(self, client_id: Any, run: Run) -> None:
        try:
            async for frame in drive(run, NEXT, SocketFrames(client_id, run)):
                await self.send_json(frame)
        except Exception:  # the socket is closing under us; disconnect() cancels the generation
            log.debug("client stream %r: could not send", client_id, exc_info=True)
        finally:
            if self.running.get(client_id, (None,))[0] is run:
                del self.running[client_id]

    async def _cancel(self, client_id: Any) -> None:
        entry = self.running.get(client_id)
        if entry is None:
            await self.send_json(_error(client_id, 0, "not_running", f"No generation {client_id!r} is running."))
            return
        run, _ = entry
        await self._stop(client_id, "cancelled by the client")
        await self.send_json({"type": "done", "id": client_id, "seq": run.seq + 1, "finish_reason": "cancelled",
                              "usage": run.usage(), "node": run.node})

    async def _stop(self, client_id: Any, reason: str) -> None:
        run, task = self.running.pop(client_id)
        task.cancel()
        with suppress(BaseException):
            await task
        await run.abandon(reason)


class SocketFrames:
    """A run's events as the client websocket's frames (an api.sse.Sink without keep-alives): `token` frames, then
    `done` with usage and any tool calls, or `error`; each with the generation's own sequence number."""

    keepalive = None

    def __init__(self, client_id: Any, run: Run):
        self.client_id, self.run, self.seq = client_id, run, 0

    def opening(self) -> list[dict[str, Any]]:
        return []

    def tokens(self, event: Tokens) -> list[dict[str, Any]]:
        self.seq += 1
        frame = {"type": "token", "id": self.client_id, "seq": self.seq, "text": event.text}
        if event.logprobs is not None:
            frame["logprobs"] = event.logprobs
        return [frame]

    async def closing(self) -> list[dict[str, Any]]:
        self.seq += 1
        run = self.run
        frame = {"type": "done", "id": self.client_id, "seq": self.seq, "finish_reason": run.finish_reason(),
                 "usage": run.usage(), "node": run.node}
        if calls := run.tool_calls():
            frame["tool_calls"] = calls
        return [frame]

    def ending(self) -> list[dict[str, Any]]:
        return []

    def failed(self, exc: OpenAIError) -> list[dict[str, Any]]:
        frame = _error(self.client_id, self.seq + 1, exc.code or "error", exc.message, exc.param)
        if "Retry-After" in exc.headers:  # too many waiting for the key, every lane busy until the deadline
            frame["retry_after"] = int(exc.headers["Retry-After"])
        return [frame]


def same_origin(scope: dict) -> bool:
    """The handshake's Origin is this host (or a CSRF-trusted origin), so another site cannot ride the cookie."""
    headers = {name.lower(): value.decode("latin1") for name, value in scope.get("headers") or []}
    origin, host = headers.get(b"origin", "").strip(), headers.get(b"host", "").strip().lower()
    if not origin or origin == "null":
        return False
    if origin.rstrip("/") in [o.rstrip("/") for o in settings.CSRF_TRUSTED_ORIGINS]:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host


def _error(client_id: Any, seq: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "id": client_id, "seq": seq, "code": code, "message": message, "param": param}
