"""Dispatch: place a generation, send it to its node, relay the node's frames, fail over when a node is lost.

`generation_stream(spec)` is the one entry point for every interface (/v1 REST and SSE, the client websocket,
batch jobs). It yields `Started`, `Tokens` and finally `Finished`, or raises `GenerationError`. The caller
writes the durable record once, at the end, from `stream.outcome`. Each placement is its `Placer`'s (fleet.placing);
the generations running here, and which one a waiting one may preempt, are `registry().running` (fleet.running).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from fleet import metrics, tracing
from fleet.errors import GenerationError
from fleet.links import NodeLost, Relay, registry
from fleet.placing import Placer
from fleet.reported import count_checked, prompt_tokens_bound
from fleet.running import Holder
from fleet.waiting import Share
from nodes.link.codes import ErrorCode, FinishReason, retried_elsewhere
from nodes.link.messages import Accepted, Done, Error, LinkError, TokenBatch
from nodes.link.spec import GenerateSpec

__all__ = ["Finished", "GenerationError", "GenerationStream", "Outcome", "Started", "Tokens", "generation_stream"]

log = logging.getLogger("fleet")

MAX_ATTEMPTS = 3
STUCK_AFTER_S = 300.0  # no frame at all from a node for this long, on a generation without a deadline
# While a node is silent, this often the head checks that the link it sent the generation over is still the node's
# (a link torn down and rebuilt, in this process or another, never delivers that generation's frames).
LINK_CHECK_S = 5.0
# Which node errors are placed again elsewhere: nodes.link.codes.retried_elsewhere (the request's faults never; the
# node's before the first token; after it only a lost node). At most MAX_ATTEMPTS placements, so a request that
# crashes every engine it reaches (llama.cpp aborts on some inputs) still ends with a clear error.


@dataclass
class Started:
    node: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Tokens:
    seq: int
    text: str
    pieces: list[str]
    ids: list[int]
    logprobs: list[dict] | None = None
    segments: list[dict] | None = None  # a transcription's segments (start, end, text, words)


@dataclass
class Finished:
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    node: str


@dataclass
class Outcome:
    """Everything the durable Generation record needs, filled in as the stream runs."""

    node_id: str | None = None
    node: str = ""
    nodes_used: list[str] = field(default_factory=list)
    placement: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    ids: list[int] = field(default_factory=list)  # the token ids streamed so far: a resume continues from them
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    error: GenerationError | None = None
    trace_id: str = ""  # its OpenTelemetry trace (fleet.tracing), when tracing is on

    def usage(self, prompt_tokens: int | None = None) -> dict[str, int]:
        """What a `Finished` says it used; `prompt_tokens` where the node's accepted counted none."""
        prompt = prompt_tokens if prompt_tokens is not None else self.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "total_tokens": prompt + self.completion_tokens}


class GenerationStream:
    """One generation's life on the head: placement, relay, failover. Iterate it once."""

    def __init__(self, spec: GenerateSpec, *, deadline: float, batch: bool = False, share: Share | None = None,
                 cache_key: str = ""):
        self.spec = spec
        self.deadline = deadline
        self.batch = batch
        self.cache_key = cache_key  # its prompt_cache_key, scoped to its API key: placed where that name ran
        self.share = share or Share()
        self.outcome = Outcome()
        self._seq = 0
        self._streamed_before = 0  # completion tokens streamed before the current attempt (a failover resumes)
        self._cancelled = False
        self._current: tuple[str, Any] | None = None  # (node_id, link)
        self._relay: Any = None  # the current attempt's frames from its node (fleet.links.Relay)
        self._expected_seq = 1  # the token batch the current attempt's node sends next
        self.failure: dict[str, Any] | None = None  # why the last attempt's node failed, for the next's evidence
        self._holder: Holder | None = None  # while it runs on a node: its lane, as preemption sees it
        self._evicted: list[str] = []  # what the node's lane choice evicted (its accepted), forgotten at the end
        self.trace: tracing.GenTrace | None = None  # its spans (set by api.generation.Run while tracing is on)
        self.stopped: GenerationError | None = None  # ended by the head (its drain): raised at its next step
        self.placer = Placer(self)  # its placements: the waiting, the keys, the evidence

    def ready(self) -> bool:
        """Whether the next step only hands on a token batch that is here already: the node's next frame is the
        batch this attempt expects. Any other frame (an end, a duplicate, a lost batch's successor) may take the
        step into a wait: for the placement, or for another node after a failure."""
        relay = self._relay
        frame = relay.head() if relay is not None else None
        return isinstance(frame, TokenBatch) and frame.seq == self._expected_seq

    async def __aiter__(self):
        try:
            async for event in self._attempts():
                yield event
        finally:
            self.placer.uncount()

    async def _attempts(self):
        reg = registry()
        excluded: set[str] = set()
        attempt = 0
        while attempt < MAX_ATTEMPTS:
            attempt += 1
            choice = await self.placer.place(excluded)
            link = reg.links.get(choice.node_id)  # this process's own link: no token crosses between processes
            if link is None:  # the node left between choosing and sending
                await reg.lifecycle.aended(choice.node_id, self.spec.gen_id)
                continue
            self.placer.placed(choice)
            try:
                async for event in self._run_on(link):
                    yield event
                return
            except _Preempted as taken:
                # its lane went to a generation of a higher class (a batch line's to an interactive one), or of a
                # key under its share: placed again, in its own class, to continue from the tokens it has; not a
                # failed attempt
                self.failure = {"code": "preempted", "message": f"{taken.by} took its lane", "at": taken.at}
                attempt -= 1
            except _NodeFailed as failed:
                await reg.lifecycle.alost(choice.node_id, self.spec.gen_id)
                excluded.add(choice.node_id)
                if failed.suspect:  # no more goes there until its next heartbeat says it is alive
                    await reg.aplacement.set_schedulable(choice.node_id, False)
                self.failure = {"code": failed.code, "message": failed.message, "at": time.time()}
                tracing.failover(self.trace, choice.identity, failed.code, failed.message)
                if self.outcome.completion_tokens >= self.spec.max_tokens:
                    # every token the client asked for had arrived when the node was lost: nothing to resume
                    yield self._finished_by_length(choice.identity)
                    return
                if attempt == MAX_ATTEMPTS:
                    raise GenerationError(failed.code, failed.message, status=502) from None
                log.warning("fleet generation %s: %s on node %r; placing it again (attempt %d)",
                            self.spec.gen_id, failed.code, choice.identity, attempt + 1)
                metrics.failover(model=self.spec.model, node=choice.identity, code=failed.code)
        raise GenerationError("node_unavailable", "no node could serve this generation", status=503)

    async def _run_on(self, link):
        reg = registry()
        relay_gen = self.spec.gen_id
        relay = reg.relays[relay_gen] = Relay(relay_gen, node_id=link.node_id)
        self._current = (link.node_id, link)
        self._relay = relay
        spec = GenerateSpec(**{**self.spec.__dict__, "resume_text": self.spec.resume_text + self.outcome.text,
                               "resume_ids": self.spec.resume_ids + self.outcome.ids})
        spec.max_tokens = max(self.spec.max_tokens - self.outcome.completion_tokens, 1)
        self._streamed_before = self.outcome.completion_tokens
        tracing.attempt_begin(self.trace, spec, link.identity)  # its trace context goes to the node in the spec
        self._expected_seq = 1
        self._evicted = []
        finished = accepted = False
        try:
            try:
                await link.send_generate(relay_gen, spec.to_dict())
            except LinkError as exc:  # the link broke as it was sent
                raise _NodeFailed(ErrorCode.NODE_LOST, f"node {link.identity!r} could not be reached: {exc}") from None
            # by a better class (batch lines; interactive ones by FLEET_PREEMPTING_CLASSES), or within its class by a
            # key under its share (FLEET_SHARE_PREEMPTING_CLASSES): each rule picks its victims
            self._holder = Holder(self.placer.waiter(), self.batch, link.node_id,
                                  self.outcome.placement.get("placed_at", 0.0), stream=self)
            reg.running.hold(self.spec.model, self._holder)
            while True:
                if relay.overflowed:
                    raise GenerationError("client_too_slow", "the client read tokens too slowly", status=500)
                event = await _next_frame(self, relay, link, accepted=accepted)
                accepted = True  # whatever the node's first frame: it answers
                if isinstance(event, Error | NodeLost):
                    finished = True
                if isinstance(event, Accepted):
                    started = await self._on_accepted(event, link)
                    if started is not None:
                        yield started
                elif isinstance(event, TokenBatch):
                    if event.seq < self._expected_seq:
                        continue  # a duplicate batch
                    if event.seq > self._expected_seq:  # a batch lost on its way (a gap: never skipped over)
                        raise _NodeFailed(ErrorCode.NODE_LOST, f"token batch {self._expected_seq} from node "
                                                               f"{link.identity!r} was lost in transit")
                    self._expected_seq = event.seq + 1
                    yield self._on_tokens(event)
                elif isinstance(event, Done):
                    if event.seq > self._expected_seq:
                        raise _NodeFailed(ErrorCode.NODE_LOST, f"token batch {self._expected_seq} from node "
                                                               f"{link.identity!r} was lost in transit")
                    finished = True
                    holder = self._holder
                    if holder is not None and holder.preempting and event.finish_reason == FinishReason.CANCELLED:
                        raise _Preempted(holder.preempted_by, holder.preempted_at)
                    yield await self._on_done(event, link)
                    return
                elif isinstance(event, Error):
                    await reg.lifecycle.aended(link.node_id, self.spec.gen_id)
                    if event.code == ErrorCode.ENGINE_UNAVAILABLE:
                        # its heartbeat puts it back once the engine is up; until then nothing more goes there
                        await reg.aplacement.set_schedulable(link.node_id, False)
                    if retried_elsewhere(event.code, streamed=bool(self.outcome.completion_tokens)):
                        raise _NodeFailed(event.code, event.message)
                    raise GenerationError(event.code, event.message, status=_status_for(event.code),
                                          param="messages" if event.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED else None)
                elif isinstance(event, NodeLost):
                    raise _NodeFailed(ErrorCode.NODE_LOST, f"node {link.identity!r} was lost: {event.reason}")
        finally:
            if self._holder is not None:
                reg.running.release(self.spec.model, self._holder)
                self._holder = None
            reg.relays.pop(relay_gen, None)
            if self._evicted:  # accepted, and ended without a done that forgot them
                asyncio.ensure_future(reg.lifecycle.aaccepted(link.node_id, self._evicted))
                self._evicted = []
            self._current = self._relay = None
            if not finished:
                # The client went away or failed mid-stream: free the node's lane now. Not awaited, because a
                # generator closed by the garbage collector may not await in its finally.
                asyncio.ensure_future(_cancel_quietly(link, relay_gen))

    async def _on_accepted(self, event: Accepted, link) -> Started | None:
        # What its lane choice evicted is forgotten with the generation's end (one round trip for both), or at once
        # when it ends without a done (_run_on's finally).
        self._evicted = list(event.evicted or ())
        resumed = bool(self.outcome.completion_tokens)
        if not resumed:
            prompt = count_checked(event.prompt_tokens, prompt_tokens_bound(self.spec), what="prompt_tokens",
                                   node=link.identity, gen_id=self.spec.gen_id)
            cached = count_checked(event.cached_tokens, prompt, what="cached_tokens", node=link.identity,
                                   gen_id=self.spec.gen_id)
            self.outcome.prompt_tokens, self.outcome.cached_tokens = prompt, cached
            return Started(link.identity, prompt, cached)
        return None

    def _on_tokens(self, event: TokenBatch) -> Tokens:
        if self.outcome.first_token_at is None:
            self.outcome.first_token_at = time.time()
            tracing.first_token(self.trace)
        self._seq += 1
        text = "".join(event.text)
        self.outcome.text += text
        self.outcome.ids.extend(event.ids)
        self.outcome.completion_tokens += len(event.ids)
        return Tokens(self._seq, text, list(event.text), list(event.ids), event.logprobs, event.segments)

    async def _on_done(self, event: Done, link) -> Finished:
        evicted, self._evicted = [*self._evicted, *(event.evicted or ())], []
        # what this node streamed on this attempt: the most completion tokens it may say it made
        streamed = self.outcome.completion_tokens - self._streamed_before
        reported = {"completion_tokens": count_checked(event.usage.get("completion_tokens"), streamed,
                                                       what="completion_tokens", node=link.identity,
                                                       gen_id=self.spec.gen_id)}
        await registry().lifecycle.adone(link.node_id, self.spec, self.placer.held(), answer=self.outcome.text,
                                         usage=reported, tokenizer=self.placer.tokenizer, evicted=evicted)
        self.outcome.finish_reason = event.finish_reason
        self.outcome.timings = dict(event.timings)
        usage = self.outcome.usage(self.outcome.prompt_tokens or count_checked(
            event.usage.get("prompt_tokens"), prompt_tokens_bound(self.spec), what="prompt_tokens",
            node=link.identity, gen_id=self.spec.gen_id))
        if isinstance(event.usage.get("stop_index"), int):  # which stop string ended it (the Messages API says)
            usage["stop_index"] = event.usage["stop_index"]
        return Finished(event.finish_reason, usage, self.outcome.timings, link.identity)

    def _finished_by_length(self, node: str) -> Finished:
        self.outcome.finish_reason = "length"
        return Finished("length", self.outcome.usage(), self.outcome.timings, node)

    async def stop(self, error: GenerationError) -> None:
        """The head ends this generation (its drain): the node's lane is cancelled, and its next step, waiting
        for a lane or for the node's next frame, raises `error` at once."""
        self.stopped = error
        if self.placer.waiting is not None:
            registry().lanes.wake(self.placer.waiting)
        if self._relay is not None:
            self._relay.push(_STOP)
        await self.cancel(error.message)

    async def preempt(self, by: str) -> None:
        """Give this generation's lane to one that outranks it (`by` says how, fleet.running): freed now, the node
        told to stop it."""
        node_id, link = self._current
        self._holder.preempting, self._holder.preempted_at, self._holder.preempted_by = True, time.time(), by
        await registry().lifecycle.apreempted(node_id, self.spec.gen_id)
        metrics.preempted(model=self.spec.model, node=link.identity)
        await _cancel_quietly(link, self.spec.gen_id, f"preempted by {by}")

    async def cancel(self, reason: str = "cancelled") -> None:
        """The client went away (or asked): stop the node's lane now."""
        self._cancelled = True
        current = self._current
        if current is not None:
            node_id, link = current
            try:
                await link.send_cancel(self.spec.gen_id, reason)
            except Exception:  # the link may be closing; its own teardown releases the lane
                log.debug("cancel of %s on %s failed", self.spec.gen_id, node_id, exc_info=True)


async def _next_frame(gen: GenerationStream, relay, link, *, accepted: bool = True):
    """The node's next frame. While it is silent, the link it was sent over is checked every LINK_CHECK_S:
    a replaced link never delivers this generation's frames (lost node, placed again). Past the frame timeout,
    a clear error; before the node's first frame (`accepted` False), past FLEET_ACCEPT_TIMEOUT_S, it is placed
    elsewhere (a node that never answers held such a generation for the whole frame timeout)."""
    timeout = _frame_timeout(gen.spec)
    if not accepted:
        timeout = min(timeout, settings.FLEET_ACCEPT_TIMEOUT_S * (4 if gen.spec.needs_media() else 1))
    silent_until = time.monotonic() + timeout
    while True:
        try:
            frame = await relay.get(timeout=max(min(silent_until - time.monotonic(), LINK_CHECK_S), 0.0))
            if gen.stopped is not None:
                raise gen.stopped
            return frame
        except TimeoutError:
            if time.monotonic() < silent_until:
                if await _link_gone(link):
                    raise _NodeFailed(ErrorCode.NODE_LOST, f"node {link.identity!r}'s link was replaced "
                                                           "while it ran this generation") from None
                continue
        if not accepted and timeout < _frame_timeout(gen.spec):
            raise _NodeFailed(ErrorCode.NODE_SILENT, f"node {link.identity!r} did not accept the generation "
                                                     f"within {timeout:.0f} s", suspect=True)
        if gen.spec.deadline is None:
            raise GenerationError("node_stuck", f"node {link.identity!r} sent nothing for {STUCK_AFTER_S:.0f} s; "
                                  "the generation was stopped", status=504, kind="server_error")
        raise GenerationError("deadline_exceeded", "the generation passed its deadline", status=504,
                              kind="server_error")


def _frame_timeout(spec: GenerateSpec) -> float:
    """How long to wait for the node's next frame: until the client's deadline (the node ends the generation
    itself then), or, without one, a generous silence after which the node is taken for stuck."""
    if spec.deadline is not None:
        return max(spec.deadline - time.time(), 0) + 5
    return STUCK_AFTER_S


async def _link_gone(link) -> bool:
    """Whether the link a generation was sent over is no longer its node's (another link object holds the node)."""
    return registry().links.get(link.node_id) is not link


async def _cancel_quietly(link, gen_id: str, reason: str = "client went away") -> None:
    try:
        await link.send_cancel(gen_id, reason)
    except Exception:  # the link may be closing; its own teardown releases the lane
        log.debug("cancel of %s failed", gen_id, exc_info=True)


_STOP = object()  # pushed into a stopped generation's relay: wakes its wait for the node's next frame


class _Preempted(Exception):
    """The node stopped a generation whose lane one that outranks it took (a higher class, or a key under its
    share)."""

    def __init__(self, by: str, at: float):
        super().__init__(by)
        self.by, self.at = by, at


class _NodeFailed(Exception):
    def __init__(self, code: str, message: str, *, suspect: bool = False):
        super().__init__(message)
        self.code, self.message = code, message
        self.suspect = suspect  # the node itself is in doubt (silent): nothing more goes there for now


def _status_for(code: str) -> int:
    return {
        ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
        ErrorCode.INVALID_GRAMMAR: 400,
        ErrorCode.INVALID_REQUEST: 400,
        "deadline_exceeded": 504,
        ErrorCode.ENGINE_CRASHED: 502,
        ErrorCode.MEDIA_UNAVAILABLE: 502,
    }.get(code, 500)


def generation_stream(spec: GenerateSpec, *, deadline: float, batch: bool = False,
                      share: Share | None = None, cache_key: str = "") -> GenerationStream:
    """`batch`: a batch job's line, placed after every interactive generation and within its share of lanes.
    `share`: its key, class and weight in the waiting room (fleet.waiting); none: the default class, no key.
    `cache_key`: the name its client gave its prompt's prefix (prompt_cache_key), scoped to its API key: placed on
    a node where generations with that name ran, when one has a free lane."""
    return GenerationStream(spec, deadline=deadline, batch=batch, share=share, cache_key=cache_key)
