"""The node's end of the link: dial the head, hand generations to the engine, stream its frames back.

Redials with backoff from 2 s to 30 s, resolving the head again each time (by mDNS when it has no address).
A refusal (token, identity, revoked key, a head whose key differs from the pinned one) ends the agent at once with a
line saying what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from nodes.agent import keys
from nodes.agent.engine.base import ENDS, Event
from nodes.agent.media import MediaCache, media_ready
from nodes.agent.pull import http_base
from nodes.agent.vocab import vocab_gguf
from nodes.link.channel import MAX_FRAME, SecureChannel
from nodes.link.codes import ErrorCode, refusal
from nodes.link.handshake import HeadKeyChanged, Initiator, fingerprint, parse_token
from nodes.link.messages import (
    Bye,
    Cancel,
    Check,
    Deploy,
    Done,
    Error,
    Feature,
    Generate,
    Heartbeat,
    LinkError,
    Pull,
    PullGrant,
    Refusal,
    Register,
    Registered,
    StateOp,
    StateResult,
    TokenizerFile,
)
from nodes.link.spec import GenerateSpec, SpecError

log = logging.getLogger("nodes.agent")

BACKOFF_START_S = 2.0
BACKOFF_MAX_S = 30.0
READY_POLL_S = 0.1  # how often the engine's liveness is looked at between heartbeats
TOKENIZER_PART = 1024 * 1024  # a tokenizer file's part a frame: well under the link's frame cap (MAX_FRAME)


class Refused(Exception):
    """The head refused this node for good (token, identity, revoked key, changed head key); redialing won't help."""


@dataclass
class AgentConfig:
    head: str | None
    token: str
    home: Path
    identity: str = field(default_factory=socket.gethostname)
    labels: dict[str, str] = field(default_factory=dict)
    version: str = "fleet-node/0.1"
    backoff_start: float = BACKOFF_START_S
    backoff_max: float = BACKOFF_MAX_S

    @staticmethod
    def identity_default() -> str:
        return socket.gethostname()


def _log_end(event: Done | Error) -> None:
    """One line when a generation ends on this node (not per token)."""
    gen_id = event.gen_id
    if isinstance(event, Error):
        log.warning("fleet node: generation %s failed: %s: %s", gen_id, event.code, event.message,
                    extra={"gen_id": gen_id, "code": event.code})
        return
    usage = event.usage or {}
    log.info("fleet node: generation %s done (%s): %d prompt tokens (%d cached), %d completion tokens", gen_id,
             event.finish_reason, usage.get("prompt_tokens", 0), usage.get("cached_tokens", 0),
             usage.get("completion_tokens", 0), extra={"gen_id": gen_id})


class NodeAgent:
    """Keeps one link to the head alive for an engine (an EngineWorker or a ReplicaSet)."""

    def __init__(self, config: AgentConfig, engine, *, resolve_head: Callable[[], str | None] | None = None):
        self.config = config
        self.engine = engine
        self.resolve_head = resolve_head or (lambda: config.head)
        self.token_id, self.psk = parse_token(config.token)
        self.node_key = keys.node_key(config.home)
        self.outbox: asyncio.Queue | None = None
        self.running: set[str] = set()
        self.cache_cleared = True
        self.heartbeat_s = 5.0
        self.joined = False  # the current session registered
        self.media = MediaCache(config.home)
        self.head_url = ""  # the head's HTTP address, where media blobs are fetched from
        self.deployer = None  # applies the head's `deploy` (nodes.agent.deploy.Deployer); None: deploys are ignored

    def send(self, msg) -> None:
        """Put a message on the link while one is up; dropped otherwise (what it said is said again at the next
        join: the node registers with its models and the head sends its deployments)."""
        if self.outbox is not None:
            self.outbox.put_nowait(msg)

    def on_engine_event(self, event: Event) -> None:
        """Engine callback (on the loop): the event is the link's message; forward it while a link is up."""
        if isinstance(event, ENDS):
            self.running.discard(event.gen_id)
            _log_end(event)
        if self.outbox is not None:
            self.outbox.put_nowait(event)

    async def run(self) -> None:
        """Dial, serve, redial; returns only by raising Refused (or on cancellation)."""
        delay = self.config.backoff_start
        while True:
            # in a thread: finding the head by mDNS blocks, and zeroconf started on a running loop would wait on it
            head = await asyncio.to_thread(self.resolve_head)
            if head is None:
                log.warning("fleet node: no head found on the local network; retrying in %.0f s", delay)
            else:
                self.joined = False
                failure: Exception | None = None
                try:
                    await self._session(head)
                except Refused:
                    raise
                except (OSError, ConnectionClosed, InvalidHandshake, InvalidURI, LinkError, TimeoutError) as exc:
                    failure = exc
                if self.joined:  # a session that ran, however it ended: the backoff starts over
                    delay = self.config.backoff_start
                if failure is not None:
                    log.warning("fleet node: link to %s failed: %s; redialing in %.0f s", head, _describe(failure),
                                delay)
            await asyncio.sleep(delay * (0.9 + 0.2 * random.random()))
            delay = min(delay * 2, self.config.backoff_max)

    async def check_join(self) -> None:
        """Handshake and ask whether this key may join under its identity before the model loads, so a refusal
        stops the node in seconds, not after a long load. A head that does not answer yet is no error: the agent
        keeps dialing it later."""
        await self._ask(Check(identity=self.config.identity))

    async def request_pull(self, model: str) -> tuple[str, PullGrant] | None:
        """(the head's address, its grant to pull `model`), asked as check_join asks; None when no head answers."""
        return await self._ask(Pull(identity=self.config.identity, model=model))

    async def _ask(self, question: Check | Pull) -> tuple[str, PullGrant] | None:
        head = await asyncio.to_thread(self.resolve_head)
        if head is None:
            return None
        try:
            async with websockets.connect(_uri(head), open_timeout=10, close_timeout=2) as ws, _refusals():
                channel = await self._handshake(ws)
                await ws.send(channel.seal(question))
                answer = channel.open(await asyncio.wait_for(ws.recv(), 10))  # a Check is answered by the close
                if isinstance(answer, Refusal):
                    raise refused(answer)
                if not isinstance(answer, PullGrant):
                    raise LinkError(f"expected pull_grant, got {type(answer).__name__}")
                return head, answer
        except (OSError, ConnectionClosed, InvalidHandshake, InvalidURI, LinkError, TimeoutError):
            return None

    async def _session(self, head: str) -> bool:
        uri = _uri(head)
        async with websockets.connect(uri, max_size=MAX_FRAME + 1024, open_timeout=10, ping_interval=20,
                                      ping_timeout=20, close_timeout=2) as ws, _refusals():
            channel = await self._handshake(ws)
            registered = await self._register(ws, channel)
            self.head_url = http_base(head)
            self.joined = True  # this session ran: whatever ends it, the backoff starts over
            log.info("fleet node %r joined %s as %s (%s)", self.config.identity, head,
                     ", ".join(registered.model_names), registered.node_id)
            for warning in registered.warnings:
                log.warning("fleet node: %s", warning)
            self.heartbeat_s = registered.heartbeat_s or self.heartbeat_s
            await self._serve(ws, channel, bundle=Feature.BUNDLE in registered.features)
            return True

    async def _handshake(self, ws) -> SecureChannel:
        pinned = keys.pinned_head(self.config.home)
        initiator = Initiator(self.token_id, self.psk, self.node_key, pinned_head=pinned)
        await ws.send(initiator.first_frame())
        try:
            head_key = initiator.read_reply(await asyncio.wait_for(ws.recv(), 10))
        except HeadKeyChanged as exc:
            raise Refused(f"{exc}. If this node moved to a new head on purpose, run node_join again with "
                          "--accept-new-head; otherwise something is answering in the head's place") from None
        if pinned is None:
            keys.pin_head(self.config.home, head_key)
            log.info("fleet node: pinned the head's link key %s (first contact)", fingerprint(head_key))
        final, channel = initiator.finish()
        await ws.send(final)
        return channel

    async def _register(self, ws, channel: SecureChannel) -> Registered:
        info = self.engine.info()
        await ws.send(channel.seal(Register(
            identity=self.config.identity,
            models=_served_models(info),
            lanes=info["lanes"], context_window=info["context_window"], capabilities=info["capabilities"],
            engine=info["engine"], engine_version=info["engine_version"], version=self.config.version,
            labels=self.config.labels, replicas=info.get("replicas", []), cache_cleared=self.cache_cleared,
            warm=list(info.get("warm_generations", [])) if self.cache_cleared else [],
            tokenizers={info["model_name"]: info["tokenizer"]} if info.get("tokenizer") else {},
        )))
        reply = channel.open(await asyncio.wait_for(ws.recv(), 15))
        if isinstance(reply, Refusal):
            raise refused(reply)
        if not isinstance(reply, Registered):
            raise LinkError(f"expected registered, got {type(reply).__name__}")
        self.cache_cleared = False
        if info.get("tokenizer") in reply.tokenizers_wanted:
            for part in await asyncio.to_thread(tokenizer_parts, info["model_path"], info["tokenizer"]):
                await ws.send(channel.seal(part))
        return reply

    async def _serve(self, ws, channel: SecureChannel, *, bundle: bool = False) -> None:
        self.outbox = asyncio.Queue()
        tasks = [asyncio.ensure_future(c) for c in (self._receive(ws, channel), self._send(ws, channel, bundle),
                                                     self._heartbeat())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise what ended the link
        except asyncio.CancelledError:  # stopped on purpose (Ctrl-C, SIGTERM): the head logs it as left, not lost
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _goodbye(ws, channel)
            raise
        finally:
            for task in tasks:
                task.cancel()
            self.outbox = None
            # Nobody is listening for these any more; the head places them again elsewhere.
            for gen_id in list(self.running):
                await self.engine.cancel(gen_id)
            self.running.clear()

    async def _receive(self, ws, channel: SecureChannel) -> None:
        async for frame in ws:
            if isinstance(frame, str):
                raise LinkError("text frame on the node link")
            msg = channel.open(frame)
            if isinstance(msg, Generate):
                await self._on_generate(msg)
            elif isinstance(msg, Cancel):
                await self.engine.cancel(msg.gen_id)
            elif isinstance(msg, StateOp):
                asyncio.ensure_future(self._on_state_op(msg))
            elif isinstance(msg, Deploy) and self.deployer is not None:
                self.deployer.apply(msg)
            elif isinstance(msg, Bye):
                return
            elif isinstance(msg, Refusal):  # the head closes the link next (a revoked key or token)
                raise refused(msg)

    async def _on_generate(self, msg: Generate) -> None:
        try:
            spec = GenerateSpec.from_dict({**msg.spec, "gen_id": msg.gen_id})
        except (SpecError, TypeError, ValueError) as exc:
            log.warning("fleet node: generation %s refused: %s", msg.gen_id, exc, extra={"gen_id": msg.gen_id})
            self.outbox.put_nowait(Error(gen_id=msg.gen_id, code=ErrorCode.INVALID_REQUEST, message=str(exc)))
            return
        self.running.add(msg.gen_id)
        has_media = spec.audio is not None or bool(spec.images())
        if has_media and (problem := await media_ready(self.media, self.head_url, spec)):
            self.running.discard(msg.gen_id)
            if self.outbox is not None:
                self.outbox.put_nowait(Error(gen_id=msg.gen_id, code=ErrorCode.MEDIA_UNAVAILABLE, message=problem))
            return
        # A worker that is restarting answers engine_unavailable at once, and the head places the generation on
        # another node (it stopped sending here when the heartbeat said the engine was not ready).
        await self.engine.submit(spec)

    async def _on_state_op(self, msg: StateOp) -> None:
        try:
            result = await self.engine.state_op(msg.op, msg.args)
            reply = StateResult(op_id=msg.op_id, ok=True, result=result)
        except Exception as exc:  # reported to the head, which answers its client with it
            reply = StateResult(op_id=msg.op_id, ok=False, error=str(exc), code=type(exc).__name__)
        if self.outbox is not None:
            self.outbox.put_nowait(reply)

    async def _send(self, ws, channel: SecureChannel, bundle: bool) -> None:
        """Every outbox message onto the link, in order. To a head that takes bundles, what the outbox holds at
        once goes in as few frames as fit (an engine step's token batches for all its lanes arrive together): no
        waiting for more, so a lone message leaves as soon as before."""
        while True:
            msgs = [await self.outbox.get()]
            if not bundle:
                await ws.send(channel.seal(msgs[0]))
                continue
            while not self.outbox.empty():
                msgs.append(self.outbox.get_nowait())
            for frame in channel.seal_all(msgs):
                await ws.send(frame)

    async def _heartbeat(self) -> None:
        """A heartbeat every `heartbeat_s`, and one at once when the engine worker dies or comes back."""
        while True:
            ready = self.engine.alive
            self.outbox.put_nowait(heartbeat_of(self.engine.stats(), engine_ready=ready))
            due = time.monotonic() + self.heartbeat_s
            while time.monotonic() < due and self.engine.alive == ready:
                await asyncio.sleep(READY_POLL_S)


async def _goodbye(ws, channel: SecureChannel) -> None:
    """A bye and a normal close, within a second each; a link already gone is left as it is."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.send(channel.seal(Bye(reason="the node is stopping"))), 1.0)
        await asyncio.wait_for(ws.close(1000, "bye"), 1.0)


def refused(msg: Refusal) -> Refused:
    """What the node exits with when the head refuses it: the close code's line, with the head's reason."""
    return Refused(refusal(msg.code, msg.reason) or f"the head refused this node: {msg.reason}")


def tokenizer_parts(model_path: str, fingerprint: str) -> list[TokenizerFile]:
    """The model's tokenizer as the head asks for it: its metadata-only GGUF, compressed, in parts that fit frames."""
    data = zlib.compress(vocab_gguf(model_path), 6)
    chunks = [data[i:i + TOKENIZER_PART] for i in range(0, len(data), TOKENIZER_PART)] or [b""]
    return [TokenizerFile(fingerprint=fingerprint, part=i, parts=len(chunks), data=chunk)
            for i, chunk in enumerate(chunks)]


def _served_models(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The models to register: the engine's, and its speech model (`--transcribe`) under its own name."""
    models = info.get("models") or [{"name": info["model_name"], "context_window": info["context_window"]}]
    speech = info.get("speech_model")
    if speech and all(m["name"] != speech for m in models):
        models = [*models, {"name": speech, "context_window": info["context_window"]}]
    return models


def heartbeat_of(stats: dict, *, engine_ready: bool) -> Heartbeat:
    """The heartbeat for an engine's (or a replica set's) stats, with what it measured of its own speed."""
    return Heartbeat(
        lanes_busy=int(stats.get("lanes_busy", 0)), lanes=int(stats.get("lanes", 0)),
        kv_used=int(stats.get("kv_used", 0)), kv_total=int(stats.get("kv_total", 0)),
        tokens_per_s=float(stats.get("tokens_per_s", 0.0)), replicas=list(stats.get("replicas", [])),
        cache_cleared=bool(stats.get("cache_cleared", False)), engine_ready=engine_ready,
        prefill_tps=float(stats.get("prefill_tps", 0.0)),
        decode_slowdown_ms=float(stats.get("decode_slowdown_ms", 0.0)), models=dict(stats.get("models") or {}),
    )


@contextlib.asynccontextmanager
async def _refusals():
    """A link the head closed with a refusal code ends the agent (Refused); any other close is for redialing."""
    try:
        yield
    except ConnectionClosed as exc:
        line = refusal(exc.rcvd.code, exc.rcvd.reason) if exc.rcvd else None
        if line is not None:
            raise Refused(line) from None
        raise


def _uri(head: str) -> str:
    return head if head.startswith(("ws://", "wss://")) else f"ws://{head}/ws/node/"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConnectionClosed):
        rcvd = exc.rcvd
        return f"closed by the head ({rcvd.code} {rcvd.reason})" if rcvd else "connection closed"
    return str(exc) or type(exc).__name__

