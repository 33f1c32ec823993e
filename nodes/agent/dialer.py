"""The node's end of the link: dial every head process, hand generations to the engine, stream its frames back.

One link to each live head process (the head reached first names them all); each redials with backoff from 2 s to
30 s, the seed address resolved again each time (by mDNS when it has no address: every head announced is tried in
turn until one proves the token). A refusal (token, identity, revoked key, a head whose key differs from the pinned
one) ends the agent at once with a line saying what to do.

Trust: the head's key is pinned only once the head proved it holds the token's secret (its first sealed message
opened); a responder that proves nothing leaves no pin. See docs/protocol.md, "When the head key is pinned".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from nodes.agent import keys, tracing
from nodes.agent.engine.base import ENDS, Event
from nodes.agent.gguf_info import file_fingerprint
from nodes.agent.media import MediaCache, media_ready
from nodes.agent.pull import http_base
from nodes.agent.vocab import vocab_gguf
from nodes.link import trace
from nodes.link.channel import MAX_FRAME, SecureChannel
from nodes.link.codes import ErrorCode, refusal
from nodes.link.handshake import HeadKeyChanged, Initiator, fingerprint, parse_token
from nodes.link.messages import (
    Bye,
    Cancel,
    Check,
    Cut,
    Deploy,
    Done,
    Error,
    Feature,
    Generate,
    Heads,
    Heartbeat,
    LinkError,
    Preparing,
    Pull,
    PullGrant,
    Refusal,
    Register,
    Registered,
    StateOp,
    StateResult,
    TokenizerFile,
    encode,
)
from nodes.link.noise import TAGLEN
from nodes.link.spec import GenerateSpec, SpecError

log = logging.getLogger("nodes.agent")

BACKOFF_START_S = 2.0
BACKOFF_MAX_S = 30.0
MAX_CUTS_HELD = 1000  # cut generations kept for a head that takes them, while no link to one is up
READY_POLL_S = 0.1  # how often the engine's liveness is looked at between heartbeats
TOKENIZER_PART = 960 * 1024  # a tokenizer part a frame: under the link cap, and daphne's default 1 MiB too


class Refused(Exception):
    """The head refused this node for good (token, identity, revoked key, changed head key); redialing won't help.

    `proven`: the refusal came from a head that proved it holds the token (a sealed message, or a close after one).
    An unproven one (a close code before any sealed frame, a key other than the pinned one) may come from anything
    that answers in the head's place: with several heads announced, the node tries the others first.
    """

    def __init__(self, line: str, *, proven: bool = True) -> None:
        super().__init__(line)
        self.proven = proven


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


class HeadLink:
    """One link to one head process: its outbox, the generations it sent, what it said at register."""

    def __init__(self, dial: str) -> None:
        self.dial = dial  # the address dialled (the seed given to node_join, or a head's link URL)
        self.head = ""  # the link URL the head announced for itself (Registered.head)
        self.head_url = ""  # that head's HTTP address, where media blobs are fetched from
        self.outbox: asyncio.Queue | None = None
        self.running: set[str] = set()
        self.takes_cuts = False  # its head writes the records of generations cut from another (Feature.CUT)
        self.joined = False  # the current session registered
        self.since = 0.0
        self.heartbeat_s = 5.0


class NodeAgent:
    """Keeps one link to each live head process alive for an engine (an EngineWorker or a ReplicaSet).

    The node dials the address it was given (the seed); the head it reaches names every live head process
    (Registered.heads, then Heads when that changes), and the node dials each of them too, one link per head, each
    redialling on its own with the backoff. A generation's frames go back on the link it came on.
    """

    def __init__(self, config: AgentConfig, engine, *,
                 resolve_head: Callable[[], str | list[str] | None] | None = None):
        self.config = config
        self.engine = engine
        self.resolve_head = resolve_head or (lambda: config.head)
        self.token_id, self.psk = parse_token(config.token)
        self.node_key = keys.node_key(config.home)
        self.cache_cleared = True
        self.media = MediaCache(config.home)
        self.deployer = None  # applies the head's `deploy` (nodes.agent.deploy.Deployer); None: deploys are ignored
        self.links: dict[str | None, HeadLink] = {}  # by head link URL; None: the seed's
        self.owner: dict[str, HeadLink] = {}  # gen_id -> the link it came on
        self.records: dict[str, dict[str, Any]] = {}  # gen_id -> what its head put in its spec for its record
        self.cuts: deque[Cut] = deque(maxlen=MAX_CUTS_HELD)  # ended after their link closed, for the next link
        self.heads: set[str] = set()  # the live heads' link URLs, as a head last said
        self.discovering = False  # the heads last tried were found by mDNS (not the address given)
        self._loops: dict[str | None, asyncio.Task] = {}
        self._refused: asyncio.Future | None = None

    def up(self) -> list[HeadLink]:
        """The links registered now."""
        return [link for link in self.links.values() if link.joined and link.outbox is not None]

    def send(self, msg) -> None:
        """Put a message on every link that is up; dropped otherwise (what it said is said again at the next join:
        the node registers with its models and the head sends its deployments)."""
        for link in self.up():
            link.outbox.put_nowait(msg)

    def on_engine_event(self, event: Event) -> None:
        """Engine callback (on the loop): the event goes back on the link its generation came on, while it is up."""
        link = self.owner.pop(event.gen_id, None) if isinstance(event, ENDS) else self.owner.get(event.gen_id)
        if trace.ENABLED:
            tracing.event(event)
        if isinstance(event, ENDS):
            _log_end(event)
            record = self.records.pop(event.gen_id, None)
            if record is not None and (link is None or link.outbox is None):
                self._cut(event, record)  # its link closed first: its head may be dead, and its record with it
        if link is None:
            return
        if isinstance(event, ENDS):
            link.running.discard(event.gen_id)
        if link.outbox is not None:
            link.outbox.put_nowait(event)

    def _cut(self, event: Done | Error, record: dict[str, Any]) -> None:
        """Tell a head that takes them (now, or on the next link that joins) how a generation ended whose link
        closed first, with the record its own head could not write if it died (sessions.cuts)."""
        if isinstance(event, Done):
            cut = Cut(gen_id=event.gen_id, record=record, finish_reason=event.finish_reason, usage=event.usage,
                      timings=event.timings)
        else:
            cut = Cut(gen_id=event.gen_id, record=record, code=event.code, message=event.message)
        takers = [link for link in self.up() if link.takes_cuts]
        if takers:
            takers[0].outbox.put_nowait(cut)
        else:
            self.cuts.append(cut)

    async def run(self) -> None:
        """Dial the seed and every head it names, redial each; returns only by raising Refused (or on
        cancellation)."""
        self._refused = asyncio.get_running_loop().create_future()
        self._spawn(None)
        try:
            await self._refused
        finally:
            for task in self._loops.values():
                task.cancel()
            self._loops.clear()

    def _spawn(self, url: str | None, *, pause: float = 0.0) -> None:
        def ended(task: asyncio.Task) -> None:
            if self._loops.get(url) is task:
                del self._loops[url]
            if self._refused is None or self._refused.done():
                return
            if task.cancelled():  # not by run(): whatever cancelled a dial loop stops the agent
                self._refused.cancel()
            elif task.exception() is not None:  # Refused, or a bug: the agent stops with it, never silently
                self._refused.set_exception(task.exception())

        task = asyncio.ensure_future(self._dial_loop(url, pause))
        task.add_done_callback(ended)
        self._loops[url] = task

    def _learn(self, heads: list[str]) -> None:
        """The live heads, as a head names them: dial each one no link holds or dials yet."""
        self.heads = set(heads)
        held = {link.head for link in self.links.values() if link.joined}
        for url in heads:
            if url not in self._loops and url not in held:
                log.info("fleet node: dialing head %s too", url)
                self._spawn(url)

    async def _dial_loop(self, url: str | None, pause: float = 0.0) -> None:
        """Dial `url` (None: the seed address, resolved again each time), serve, redial with backoff. The seed's
        loop gives way to a loop of the head it reached once another link is up; a head's loop ends when the heads
        no longer name it and another link is up."""
        delay = self.config.backoff_start
        link = self.links[url] = HeadLink(url or "")
        if pause:
            await asyncio.sleep(pause)
        while True:
            heads = [url] if url else await self._heads()
            if not heads:
                log.warning("fleet node: no head found on the local network; retrying in %.0f s", delay)
            refusals: list[Refused] = []
            for head in heads:
                link.dial, link.joined = head, False
                failure: Exception | None = None
                try:
                    await self._session(link)
                except Refused as exc:
                    if exc.proven:
                        raise
                    refusals.append(exc)
                    failure = exc
                except (OSError, ConnectionClosed, InvalidHandshake, InvalidURI, LinkError, TimeoutError) as exc:
                    failure = exc
                served = link.joined
                if served:  # a session that ran, however it ended: the backoff starts over
                    delay = self.config.backoff_start
                link.joined = False
                if failure is not None:
                    log.warning("fleet node: link to %s failed: %s; redialing in %.0f s", head, _describe(failure),
                                delay)
                if served:
                    break  # this head proved itself and its link ended: find the heads again before redialing
            if self._gives_way(url, link):
                return
            self._all_refused(heads, refusals, delay, discovered=not url and self.discovering)
            await asyncio.sleep(delay * (0.9 + 0.2 * random.random()))
            delay = min(delay * 2, self.config.backoff_max)

    def _gives_way(self, url: str | None, link: HeadLink) -> bool:
        if not self.up():
            return False  # the last link standing keeps dialing, whatever the heads said
        if url is None:  # the seed's head gets a loop of its own (redialling its link URL) once the seed has served
            if link.head and link.head not in self._loops:
                self._spawn(link.head, pause=self.config.backoff_start)
            self.links.pop(None, None)
            return True
        if url not in self.heads:
            log.info("fleet node: head %s left the fleet; no longer dialing it", url)
            self.links.pop(url, None)
            return True
        return False

    async def _heads(self) -> list[str]:
        """The heads to try, in order: the given address, or every head announced by mDNS (none of them trusted
        before it proves the token)."""
        # in a thread: finding the head by mDNS blocks, and zeroconf started on a running loop would wait on it
        found = await asyncio.to_thread(self.resolve_head)
        self.discovering = not isinstance(found, str)  # found by mDNS, not the address given
        return [found] if isinstance(found, str) else list(found or [])

    async def check_join(self) -> None:
        """Handshake and ask whether this key may join under its identity before the model loads, so a refusal
        stops the node in seconds, not after a long load. A head that does not answer yet is no error: the agent
        keeps dialing it later."""
        await self._ask(Check(identity=self.config.identity))

    async def request_pull(self, model: str) -> tuple[str, PullGrant] | None:
        """(the head's address, its grant to pull `model`), asked as check_join asks; None when no head answers."""
        return await self._ask(Pull(identity=self.config.identity, model=model))

    async def report_preparing(self, model: str, state: str, progress: float) -> None:
        """Tell the heads where this node stands while it pulls or loads its own model before it joins (the live
        fleet page), asked as check_join asks. Best effort: a head that refuses, does not answer or does not know
        the message changes nothing here (the join that follows says what is wrong)."""
        with contextlib.suppress(Refused):
            await self._ask(Preparing(identity=self.config.identity, model=model, state=state, progress=progress))

    async def _ask(self, question: Check | Pull | Preparing) -> tuple[str, PullGrant] | None:
        heads = await self._heads()
        refusals: list[Refused] = []
        for head in heads:
            try:
                return await self._ask_one(head, question)
            except Refused as exc:
                if exc.proven:
                    raise
                refusals.append(exc)
            except (OSError, ConnectionClosed, InvalidHandshake, InvalidURI, LinkError, TimeoutError):
                continue
        self._all_refused(heads, refusals, self.config.backoff_start, discovered=self.discovering)
        return None

    def _all_refused(self, heads: list[str], refusals: list[Refused], delay: float, *, discovered: bool) -> None:
        """Every head tried refused, none proving it holds the token. At the address this node was given that is
        this node's to fix: the agent stops with the first refusal. Heads found on the local network (`discovered`)
        may be announcers that are no head (a rogue one refused a good token once, and the node exited for good):
        it says what it saw and looks again, with the backoff."""
        if not heads or len(refusals) != len(heads):
            return
        if not discovered:
            raise refusals[0]
        log.warning("fleet node: every head found on the local network refused this node without proving it holds "
                    "the token (%s: %s); looking again in %.0f s", heads[0], refusals[0], delay)

    async def _ask_one(self, head: str, question: Check | Pull | Preparing) -> tuple[str, PullGrant] | None:
        async with websockets.connect(_uri(head), open_timeout=10, close_timeout=2) as ws, _refusals() as link:
            channel = link.channel = await self._handshake(ws)
            await ws.send(channel.seal(question))
            answer = self._head_proved(channel, await asyncio.wait_for(ws.recv(), 10))  # a Check: the close answers
            if isinstance(answer, Refusal):
                raise refused(answer)
            if not isinstance(answer, PullGrant):
                raise LinkError(f"expected pull_grant, got {type(answer).__name__}")
            return head, answer

    async def _session(self, link: HeadLink) -> bool:
        uri = _uri(link.dial)
        async with websockets.connect(uri, max_size=MAX_FRAME + 1024, open_timeout=10, ping_interval=20,
                                      ping_timeout=20, close_timeout=2) as ws, _refusals() as proof:
            channel = proof.channel = await self._handshake(ws)
            registered = await self._register(ws, channel)
            link.head_url = http_base(link.dial)
            link.head = registered.head or _uri(link.dial)
            link.joined, link.since = True, time.time()  # this session ran: whatever ends it, the backoff starts over
            link.heartbeat_s = registered.heartbeat_s or link.heartbeat_s
            link.takes_cuts = Feature.CUT in registered.features
            log.info("fleet node %r joined %s as %s (%s); %s", self.config.identity, link.head,
                     ", ".join(registered.model_names), registered.node_id, self._links_line(extra=1))
            for warning in registered.warnings:
                log.warning("fleet node: %s", warning)
            if registered.heads:
                self._learn(registered.heads)
            try:
                await self._serve(ws, channel, link, bundle=Feature.BUNDLE in registered.features)
            finally:
                log.warning("fleet node %r: link to %s closed; %s", self.config.identity, link.head,
                            self._links_line())
            return True

    def _links_line(self, extra: int = 0) -> str:
        count = len(self.up()) + extra
        return f"linked to {count} of {max(len(self.heads), count)} head process(es)"

    async def _handshake(self, ws) -> SecureChannel:
        """The three handshake frames; the channel's peer has proved nothing yet (see `_head_proved`)."""
        pinned = keys.pinned_head(self.config.home)
        initiator = Initiator(self.token_id, self.psk, self.node_key, pinned_head=pinned)
        await ws.send(initiator.first_frame())
        try:
            initiator.read_reply(await asyncio.wait_for(ws.recv(), 10))
        except HeadKeyChanged as exc:
            # Frame 2 proves nothing, so this is neither the head with a new key nor surely an impostor: the node
            # stops before proving itself, pins nothing, and says both.
            raise Refused(f"{exc}; it has not proved it holds the token. If this node's head changed its key on "
                          "purpose, run node_join again with --accept-new-head (the new key is pinned only once "
                          "the head proves the token); otherwise something is answering in the head's place",
                          proven=False) from None
        final, channel = initiator.finish()
        await ws.send(final)
        return channel

    def _head_proved(self, channel: SecureChannel, frame: bytes):
        """The head's first sealed message, opened: only a holder of the token's secret can seal it, so its key is
        pinned now if this node has no pin yet (a frame that does not open leaves none: FrameError)."""
        msg = channel.open(frame)
        if keys.pin_head(self.config.home, channel.peer_static):
            log.info("fleet node: pinned the head's link key %s (first contact; the head proved the token)",
                     fingerprint(channel.peer_static))
        return msg

    async def _register(self, ws, channel: SecureChannel) -> Registered:
        info = self.engine.info()
        await ws.send(channel.seal(Register(
            identity=self.config.identity,
            models=await asyncio.to_thread(_served_models, info),
            lanes=info["lanes"], context_window=info["context_window"], capabilities=info["capabilities"],
            engine=info["engine"], engine_version=info["engine_version"], version=self.config.version,
            labels=self.config.labels, replicas=info.get("replicas", []), cache_cleared=self.cache_cleared,
            warm=list(info.get("warm_generations", [])) if self.cache_cleared else [],
            tokenizers={info["model_name"]: info["tokenizer"]} if info.get("tokenizer") else {},
            device=dict(info.get("device") or {}),
            features=[Feature.HEADS.value, Feature.THINKING_BUDGET.value],
        )))
        reply = self._head_proved(channel, await asyncio.wait_for(ws.recv(), 15))
        if isinstance(reply, Refusal):
            raise refused(reply)
        if not isinstance(reply, Registered):
            raise LinkError(f"expected registered, got {type(reply).__name__}")
        self.cache_cleared = False
        if info.get("tokenizer") in reply.tokenizers_wanted:
            for part in await asyncio.to_thread(tokenizer_parts, info["model_path"], info["tokenizer"]):
                await ws.send(channel.seal(part))
        return reply

    async def _serve(self, ws, channel: SecureChannel, link: HeadLink, *, bundle: bool = False) -> None:
        link.outbox = asyncio.Queue()
        while link.takes_cuts and self.cuts:
            link.outbox.put_nowait(self.cuts.popleft())
        tasks = [asyncio.ensure_future(c) for c in (self._receive(ws, channel, link),
                                                     self._send(ws, channel, link, bundle), self._heartbeat(link))]
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
            link.outbox = None
            # Nobody is listening for these any more: that head places them again elsewhere, or it died, and the
            # node's end of each goes to another head in a `cut` (on_engine_event) for its record.
            for gen_id in list(link.running):
                self.owner.pop(gen_id, None)
                await self.engine.cancel(gen_id)
            link.running.clear()

    async def _receive(self, ws, channel: SecureChannel, link: HeadLink) -> None:
        async for frame in ws:
            if isinstance(frame, str):
                raise LinkError("text frame on the node link")
            msg = channel.open(frame)
            if isinstance(msg, Generate):
                await self._on_generate(msg, link)
            elif isinstance(msg, Cancel):
                if self.owner.get(msg.gen_id) is link:
                    await self.engine.cancel(msg.gen_id)
            elif isinstance(msg, StateOp):
                asyncio.ensure_future(self._on_state_op(msg, link))
            elif isinstance(msg, Deploy) and self.deployer is not None:
                self.deployer.apply(msg)
            elif isinstance(msg, Heads):
                self._learn(msg.heads)
            elif isinstance(msg, Bye):
                return
            elif isinstance(msg, Refusal):  # the head closes the link next (a revoked key or token)
                raise refused(msg)

    async def _on_generate(self, msg: Generate, link: HeadLink) -> None:
        try:
            spec = GenerateSpec.from_dict({**msg.spec, "gen_id": msg.gen_id})
        except (SpecError, TypeError, ValueError) as exc:
            log.warning("fleet node: generation %s refused: %s", msg.gen_id, exc, extra={"gen_id": msg.gen_id})
            link.outbox.put_nowait(Error(gen_id=msg.gen_id, code=ErrorCode.INVALID_REQUEST, message=str(exc)))
            return
        link.running.add(msg.gen_id)
        self.owner[msg.gen_id] = link
        if spec.record:
            self.records[msg.gen_id] = spec.record
        if trace.ENABLED:
            tracing.received(spec, self.config.identity)
        has_media = spec.audio is not None or bool(spec.images())
        if has_media and (problem := await media_ready(self.media, link.head_url, spec)):
            link.running.discard(msg.gen_id)
            self.owner.pop(msg.gen_id, None)
            self.records.pop(msg.gen_id, None)
            error = Error(gen_id=msg.gen_id, code=ErrorCode.MEDIA_UNAVAILABLE, message=problem)
            if trace.ENABLED:
                tracing.event(error)
            if link.outbox is not None:
                link.outbox.put_nowait(error)
            return
        # A worker that is restarting answers engine_unavailable at once, and the head places the generation on
        # another node (it stopped sending here when the heartbeat said the engine was not ready).
        await self.engine.submit(spec)

    async def _on_state_op(self, msg: StateOp, link: HeadLink) -> None:
        try:
            result = await self.engine.state_op(msg.op, msg.args)
            reply = StateResult(op_id=msg.op_id, ok=True, result=result)
        except Exception as exc:  # reported to the head, which answers its client with it
            reply = StateResult(op_id=msg.op_id, ok=False, error=str(exc), code=type(exc).__name__)
        if reply.ok and len(encode(reply)) + TAGLEN > MAX_FRAME:  # sealing it would fail the send loop: the link
            reply = StateResult(op_id=msg.op_id, ok=False, code="FrameError",
                                error=f"the answer to {msg.op} is larger than a link frame ({MAX_FRAME} bytes)")
        if link.outbox is not None:
            link.outbox.put_nowait(reply)

    async def _send(self, ws, channel: SecureChannel, link: HeadLink, bundle: bool) -> None:
        """Every outbox message onto the link, in order. To a head that takes bundles, what the outbox holds at
        once goes in as few frames as fit (an engine step's token batches for all its lanes arrive together): no
        waiting for more, so a lone message leaves as soon as before."""
        outbox = link.outbox
        while True:
            msgs = [await outbox.get()]
            if not bundle:
                await ws.send(channel.seal(msgs[0]))
                continue
            while not outbox.empty():
                msgs.append(outbox.get_nowait())
            for frame in channel.seal_all(msgs):
                await ws.send(frame)

    async def _heartbeat(self, link: HeadLink) -> None:
        """A heartbeat every `heartbeat_s`, and one at once when the engine worker dies or comes back."""
        while True:
            ready = self.engine.alive
            stats = self.engine.stats()
            if self.deployer is not None:  # room for on-demand models (nodes.agent.deploy)
                stats["memory_free"], stats["on_demand"] = await self.deployer.memory_free(), self.deployer.on_demand
            link.outbox.put_nowait(heartbeat_of(stats, engine_ready=ready))
            due = time.monotonic() + link.heartbeat_s
            held = self._held()
            # at once too when a model was loaded or unloaded: the head places on-demand models by its memory_free
            while time.monotonic() < due and self.engine.alive == ready and self._held() == held:
                await asyncio.sleep(READY_POLL_S)

    def _held(self) -> int:
        return sum(self.deployer.held.values()) if self.deployer is not None else 0


async def _goodbye(ws, channel: SecureChannel) -> None:
    """A bye and a normal close, within a second each; a link already gone is left as it is."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.send(channel.seal(Bye(reason="the node is stopping"))), 1.0)
        await asyncio.wait_for(ws.close(1000, "bye"), 1.0)


def refused(msg: Refusal) -> Refused:
    """What the node exits with when the head refuses it: the close code's line, with the head's reason (a sealed
    message: proven)."""
    return Refused(refusal(msg.code, msg.reason) or f"the head refused this node: {msg.reason}")


def tokenizer_parts(model_path: str, fingerprint: str) -> list[TokenizerFile]:
    """The model's tokenizer as the head asks for it: its metadata-only GGUF, compressed, in parts that fit frames."""
    data = zlib.compress(vocab_gguf(model_path), 6)
    chunks = [data[i:i + TOKENIZER_PART] for i in range(0, len(data), TOKENIZER_PART)] or [b""]
    return [TokenizerFile(fingerprint=fingerprint, part=i, parts=len(chunks), data=chunk)
            for i, chunk in enumerate(chunks)]


def _served_models(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The models to register: the engine's, and its speech model (`--transcribe`) under its own name. The engine's
    own model carries its file's fingerprint (`file`), which is what lets the head serve it under another name."""
    models = info.get("models") or [{"name": info["model_name"], "context_window": info["context_window"]}]
    speech = info.get("speech_model")
    if speech and all(m["name"] != speech for m in models):
        models = [*models, {"name": speech, "context_window": info["context_window"]}]
    path = info.get("model_path")
    if path and os.path.isfile(path):
        file = file_fingerprint(path)
        models = [{**m, "file": file} if m["name"] == info["model_name"] else m for m in models]
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
        memory_free=int(stats.get("memory_free", 0)), on_demand=bool(stats.get("on_demand", False)),
        device=dict(stats.get("device") or {}),
    )


@dataclass
class _Link:
    channel: SecureChannel | None = None  # once the handshake's frames were exchanged


@contextlib.asynccontextmanager
async def _refusals():
    """A link the head closed with a refusal code ends the agent (Refused: proven when a sealed frame from the head
    opened first); any other close is for redialing."""
    link = _Link()
    try:
        yield link
    except ConnectionClosed as exc:
        line = refusal(exc.rcvd.code, exc.rcvd.reason) if exc.rcvd else None
        if line is not None:
            raise Refused(line, proven=link.channel is not None and link.channel.peer_proved) from None
        raise


def _uri(head: str) -> str:
    return head if head.startswith(("ws://", "wss://")) else f"ws://{head}/ws/node/"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConnectionClosed):
        rcvd = exc.rcvd
        return f"closed by the head ({rcvd.code} {rcvd.reason})" if rcvd else "connection closed"
    return str(exc) or type(exc).__name__

