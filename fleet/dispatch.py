"""Dispatch: place a generation, send it to its node, relay the node's frames, fail over when a node is lost.

`generation_stream(spec)` is the one entry point for every interface (/v1 REST and SSE, the client websocket,
batch jobs). It yields `Started`, `Tokens` and finally `Finished`, or raises `GenerationError`. The caller
writes the durable record once, at the end, from `stream.outcome`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from fleet import heads, loading, metrics, tracing
from fleet.links import NodeLost, registry
from fleet.live import fleet_changed
from fleet.reported import count_checked, prompt_tokens_bound
from fleet.waiting import BATCH, RANKS, Share, Waiter
from nodes.agent.vocab import BUILTINS, BYTES
from nodes.link.codes import ErrorCode, FinishReason, retried_elsewhere
from nodes.link.lifecycle import aplacement_keys
from nodes.link.messages import Accepted, Done, Error, LinkError, TokenBatch
from nodes.link.prefix import PrefixKey
from nodes.link.spec import GenerateSpec
from nodes.tokenizers import fingerprint_served, tokenizer_get, tokenizer_known

log = logging.getLogger("fleet")

MAX_ATTEMPTS = 3
STUCK_AFTER_S = 300.0  # no frame at all from a node for this long, on a generation without a deadline
# While a node is silent, this often the head checks that the link it sent the generation over is still the node's
# (a link torn down and rebuilt, in this process or another, never delivers that generation's frames).
LINK_CHECK_S = 5.0
# A generation waiting for a lane is woken by events (a lane freed, a node joined, here or in another head process);
# it also looks again this often, in case a wake was lost with a Redis connection.
WAKE_CHECK_S = 5.0
LOADING_CHECK_S = 1.0
# Which node errors are placed again elsewhere: nodes.link.codes.retried_elsewhere (the request's faults never; the
# node's before the first token; after it only a lost node). At most MAX_ATTEMPTS placements, so a request that
# crashes every engine it reaches (llama.cpp aborts on some inputs) still ends with a clear error.
# What a user can do when no node has a capability a request needs.
CAPABILITY_HINTS = {
    "batch_invariant": "start a node with `manage.py node_join --batch-invariant` (greedy output then never depends "
                       "on the batch, at some speed), or leave batch_invariant out",
    "transcribe": "start a node with `manage.py node_join --transcribe whisper-tiny.en` and name that model",
    "lora": "load the adapter on a node serving the model (`manage.py node_join --lora NAME=PATH`)",
    "vision": "start a node with the model's multimodal projector (`manage.py node_join --mmproj PATH`), or send no "
              "image",
}


async def _refuse_if_held(model: str, serving) -> None:
    """A 503 at once when every node serving `model` was drained or cordoned by the operator: waiting for a lane
    would last the whole deadline. (A node whose engine restarts is also unschedulable, for seconds: waited for.)"""
    from asgiref.sync import sync_to_async

    from nodes.models import Node

    ids = [s.node_id for s in serving]
    states = dict(await sync_to_async(lambda: list(Node.objects.filter(pk__in=ids).values_list("identity", "state")))())
    if len(states) < len(ids) or any(state == Node.State.ONLINE for state in states.values()):
        return
    held = ", ".join(f"{identity!r} ({state})" for identity, state in sorted(states.items()))
    raise GenerationError("model_unavailable", f"Every node serving {model!r} takes no new generations: {held}. "
                          "Uncordon one (admin, Nodes) or start another node serving it.", status=503, retry_after=5,
                          kind="server_error")


class GenerationError(Exception):
    """A generation that cannot be served, with an OpenAI-style code and the HTTP status it maps to."""

    def __init__(self, code: str, message: str, *, status: int = 500, param: str | None = None,
                 retry_after: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.code, self.message, self.status, self.param, self.retry_after = code, message, status, param, retry_after
        self.kind = kind or ("invalid_request_error" if 400 <= status < 500 else "server_error")


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


# Generations of this process placed and not yet over, per (model, batch): batch lines keep to their share of a
# model's lanes while interactive ones run or wait.
_running: dict[tuple[str, bool], int] = {}
# Generations of this process running on a node, per model: what a generation that finds no free lane may preempt,
# by the rules of _preempt_a_lower_one (batch lines, by any interactive class; where FLEET_PREEMPTING_CLASSES names a
# class, interactive ones of a lower class; where FLEET_SHARE_PREEMPTING_CLASSES names one, its keys over their share),
# and what the share rule counts. A preempted one continues later from the tokens it has, token for token as if never
# stopped.
_preemptible: dict[str, set[GenerationStream]] = {}


class GenerationStream:
    """One generation's life on the head: placement, relay, failover. Iterate it once."""

    def __init__(self, spec: GenerateSpec, *, deadline: float, batch: bool = False, share: Share | None = None):
        self.spec = spec
        self.deadline = deadline
        self.batch = batch
        self.share = share or Share()
        self._queued: dict[str, Any] | None = None  # its place when it first queued (the record's evidence)
        self._counted = False  # counted in _running (from its first placement to its end)
        self.keys: list[PrefixKey] | None = None  # the prompt's, once its model's tokenizer is known (_key)
        self.tokenizer: Any = None
        self._tokenizer_due = ""  # the fingerprint whose file the keys wait for (they are bytes' until it is in)
        self.outcome = Outcome()
        self._seq = 0
        self._streamed_before = 0  # completion tokens streamed before the current attempt (a failover resumes)
        self._cancelled = False
        self._current: tuple[str, Any] | None = None  # (node_id, link)
        self._relay: Any = None  # the current attempt's frames from its node (fleet.links.Relay)
        self._expected_seq = 1  # the token batch the current attempt's node sends next
        self._failure: dict[str, Any] | None = None  # why the last attempt's node failed, for the next's evidence
        self._preempting = False  # its lane was handed to an interactive generation; its cancel is on the way
        self._preempted_at = 0.0
        self._preempted_by = ""  # who took its lane, in the record's words
        self._evicted: list[str] = []  # what the node's lane choice evicted (its accepted), forgotten at the end
        self.trace: tracing.GenTrace | None = None  # its spans (set by api.generation.Run while tracing is on)
        self._loading: dict[str, Any] | None = None  # it waited for an on-demand load: since when, on which node
        self._stopped: GenerationError | None = None  # ended by the head (its drain): raised at its next step
        self._waiting: Waiter | None = None  # its place in the waiting room while it waits for a lane

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
            if self._counted:
                _running[(self.spec.model, self.batch)] -= 1
                registry().lanes.notify()  # a batch line waiting on the share may go now

    async def _attempts(self):
        reg = registry()
        excluded: set[str] = set()
        attempt = 0
        while attempt < MAX_ATTEMPTS:
            attempt += 1
            choice = await self._place(excluded)
            link = reg.links.get(choice.node_id)  # this process's own link: no token crosses between processes
            if link is None:  # the node left between choosing and sending
                await reg.lifecycle.aended(choice.node_id, self.spec.gen_id)
                continue
            self._record_choice(choice)
            try:
                async for event in self._run_on(link):
                    yield event
                return
            except _Preempted:
                # its lane went to a generation of a higher class (a batch line's to an interactive one), or of a
                # key under its share: placed again, in its own class, to continue from the tokens it has; not a
                # failed attempt
                self._preempting = False
                self._failure = {"code": "preempted", "message": f"{self._preempted_by} took its lane",
                                 "at": self._preempted_at}
                attempt -= 1
            except _NodeFailed as failed:
                await reg.lifecycle.alost(choice.node_id, self.spec.gen_id)
                excluded.add(choice.node_id)
                if failed.suspect:  # no more goes there until its next heartbeat says it is alive
                    await reg.aplacement.set_schedulable(choice.node_id, False)
                self._failure = {"code": failed.code, "message": failed.message, "at": time.time()}
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

    def _record_choice(self, choice) -> None:
        self.outcome.node_id, self.outcome.node = choice.node_id, choice.identity
        self.outcome.nodes_used.append(choice.identity)
        # The timestamps make the generation page's timeline (queued, placed, failed over); kept in this JSON,
        # written once at the end with the rest.
        evidence = {**choice.evidence(), "placed_at": time.time()}
        metrics.placement_made(model=self.spec.model, evidence=evidence)
        loading.placed(choice.node_id, self.spec.model.partition(":")[0])
        tracing.placed(self.trace, evidence)
        if not self.outcome.placement:
            queued = self._queued or {}
            evidence["queue"] = {**queued, "waited_ms": round((evidence["placed_at"] - queued.get("at",
                                                                evidence["placed_at"])) * 1000)}
            if self._loading is not None:  # the wait was for a node to load its model on demand
                evidence["queue"]["loading"] = {"node": self._loading["node"] or choice.identity,
                                                "since": self._loading["at"],
                                                "ms": round((evidence["placed_at"] - self._loading["at"]) * 1000)}
            if not self.batch:
                loading.waited(self.spec.model, evidence["queue"]["waited_ms"] / 1000)
            metrics.admitted(priority=queued.get("priority", ""))
            self.outcome.placement = evidence
        else:
            self.outcome.placement.setdefault("failover", []).append({**evidence, "after": self._failure})

    def _waiter(self) -> Waiter:
        share = self.share
        rank = RANKS[BATCH] if self.batch else RANKS.get(share.priority, RANKS["normal"])
        return Waiter(self.spec.gen_id, rank, self.deadline, share.key, max(share.weight, 1), share.label)

    async def _place(self, excluded: set[str]):
        """Reserve a lane, waiting in the waiting room's order (fleet.waiting); past the deadline, fail without
        ever starting; over its key's bound on waiting generations, a 429 at once."""
        reg = registry()
        model = self.spec.model
        key = self._waiter()
        entry = reg.waiting.join(model, key)
        reg.lanes.join(model, key)
        if self._queued is None:
            self._queued = {"priority": key.priority, "position": reg.lanes.ahead(model, key), "at": time.time()}
        tracing.queue_begin(self.trace)
        fleet_changed()
        placed, first = False, True
        self._waiting = key
        try:
            while True:
                if self._stopped is not None:
                    raise self._stopped
                choice = await self._try_place(reg, excluded)
                if choice is not None:
                    placed = True
                    return choice
                if first and not self.outcome.placement:  # never once it ran (a failover, a preempted one)
                    self._refuse_over_bound(reg, key)
                    first = False
                left = self.deadline - time.time()
                if left <= 0 and self._loading is not None and not self.outcome.placement:
                    on = f" on {self._loading['node']!r}" if self._loading["node"] else ""
                    raise GenerationError("deadline_exceeded", f"The model {model!r} was still loading on demand{on} "
                                          "at the request's deadline; retry shortly (it is being loaded) or raise "
                                          "deadline_ms.", status=503, retry_after=5, kind="server_error")
                if left <= 0:
                    raise GenerationError("deadline_exceeded", "Every lane serving this model stayed busy until the "
                                          "request's deadline; retry later or raise deadline_ms.", status=503,
                                          retry_after=1, kind="server_error")
                # waiting for an on-demand load, it also looks again each second: the room it waits for is told by
                # heartbeats (a drained model's memory), which wake no lane
                await reg.lanes.wait(key, min(left, LOADING_CHECK_S if self._loading else WAKE_CHECK_S))
        finally:
            self._waiting = None
            reg.waiting.leave(entry, placed=placed)
            reg.lanes.leave(model, key, placed=placed)
            reg.lanes.notify()
            fleet_changed()  # placed (a lane taken), or gone from the queue

    def _refuse_over_bound(self, reg, key: Waiter) -> None:
        """A 429 when this generation, which found no lane, would put its key over its bound on waiting ones (batch
        lines are bounded by their batch's concurrency instead)."""
        bound = self.share.max_waiting
        if self.batch or not bound or reg.waiting.of_key(key.key) <= bound:
            return
        wait = reg.waiting.retry_after_s(self.spec.model, reg.lanes.ahead(self.spec.model, key))
        raise GenerationError("too_many_waiting", f"This API key already has {bound} generations waiting for a lane "
                              f"of {self.spec.model!r} (its bound); retry in {wait} s, when the lanes will have "
                              "served those ahead of it at their current rate.", status=429, retry_after=wait,
                              kind="rate_limit_error")

    async def _try_place(self, reg, excluded: set[str]):
        """A lane now if this generation's turn has come and one is free (None: wait for the next wake)."""
        model = self.spec.model
        nodes = await reg.aplacement.nodes()  # a snapshot (over Redis: refreshed by each choice, no round trip)
        if not any(model in s.models for s in nodes):
            nodes = await reg.aplacement.nodes(fresh=True)  # a node that just joined: not refused for a stale view
        serving = [s for s in nodes if model in s.models]
        if not serving and await self._load_on_demand():
            return None  # waits in its model's queue (keep-alives flow; its deadline holds) until a node serves it
        if not serving:
            if self._failure and self._failure["code"] != "preempted":  # its node went mid-generation: say so
                raise GenerationError(self._failure["code"], f"{self._failure['message']}, and no other node serves "
                                      f"{model!r} now.", status=502)
            served = ", ".join(sorted({m for s in nodes for m in s.models})) or "none"
            raise GenerationError("model_not_found", f"The model {model!r} is not served by any node "
                                  f"(served: {served}).", status=404, param="model")
        if not any(s.schedulable for s in serving):
            await _refuse_if_held(model, serving)
        if self.keys is None or (self._tokenizer_due and tokenizer_known(self._tokenizer_due)):
            await self._key(nodes)
        try:
            unable = self._unable(nodes)
        except GenerationError:  # refused by the snapshot: look again (an adapter may have just loaded)
            nodes = await reg.aplacement.nodes(fresh=True)
            unable = self._unable(nodes)
        ahead = reg.lanes.ahead(model, self._waiter())
        # placed only on nodes this process holds a link to (a node behind NAT may reach only some head processes)
        linked = set(reg.links)
        free = sum(s.free for s in nodes if model in s.models and s.schedulable and s.node_id in linked)
        if not self.batch and ahead >= free and await self._preempt_a_lower_one(exclude=excluded | unable):
            free += 1  # the lane it freed: over Redis this process's snapshot has not heard of it yet
        if ahead >= free or not self._within_share(nodes):
            await self._still_waiting(model)
            return None
        counting = not self._counted
        if counting:  # counted before choosing, which may await Redis: two batch lines must not both pass the share
            self._count(1)
        place = {"only": linked, "head": heads.PROCESS_ID}
        choice = await reg.lifecycle.achoose(self.spec, self.keys, exclude=excluded | unable, **place)
        if choice is None and excluded:
            choice = await reg.lifecycle.achoose(self.spec, self.keys, exclude=unable, **place)
        if choice is None and counting:
            self._count(-1)
        if choice is None:  # the lanes were taken as it chose (Redis' view)
            await self._still_waiting(model)
        return choice

    async def _still_waiting(self, model: str) -> None:
        """No lane for it this time: an on-demand model whose queue waits too long gets one more replica."""
        if self._queued and not self.batch:
            await loading.ascale(model, time.time() - self._queued["at"])

    async def _load_on_demand(self) -> bool:
        """No node serves the model: when it is an on-demand registry model, have a node load it (or find its load
        under way) and say so in the record and the trace; False when it is not one. A 503 with the figures when it
        fits on no node."""
        try:
            decision = await loading.aload(self.spec.model)
        except loading.NoRoom as exc:
            raise GenerationError("model_cannot_fit", str(exc), status=503, retry_after=30,
                                  kind="server_error") from None
        if decision is None:
            return False
        if self._loading is None:
            self._loading = {"at": time.time(), "node": decision.node or ""}
            tracing.loading(self.trace, self.spec.model, decision.node or "")
        elif decision.node:
            self._loading["node"] = decision.node
        return True

    async def _key(self, nodes) -> None:
        """The prompt's prefix keys, with the tokenizer of the nodes serving its model: once per generation, off the
        event loop (nodes.link.lifecycle.aplacement_keys)."""
        fingerprint = fingerprint_served(self.spec.model, [s.tokenizers for s in nodes]) or BYTES
        self.tokenizer = BUILTINS.get(fingerprint) or await asyncio.to_thread(tokenizer_get, fingerprint)
        self.keys = await aplacement_keys(self.spec, self.tokenizer)
        # Keyed by bytes while the file of its nodes' tokenizer is on its way (a node that just joined is not
        # placed until the file is in): keyed again once it is, so the node records the keys the next turn looks up.
        self._tokenizer_due = fingerprint if self.tokenizer is BUILTINS[BYTES] and fingerprint != BYTES else ""

    def _count(self, delta: int) -> None:
        """In _running from its first placement to its end."""
        self._counted = delta > 0
        _running[(self.spec.model, self.batch)] = _running.get((self.spec.model, self.batch), 0) + delta

    async def _preempt_a_lower_one(self, *, exclude: set[str]) -> bool:
        """No lane for this interactive generation (nor for those ahead of it): take one from a generation of its
        model of a lower class (a batch line; an interactive one of a lower class too where FLEET_PREEMPTING_CLASSES
        names this one's) on a node it may use: the lowest class first, then the one that started last here. Else,
        where FLEET_SHARE_PREEMPTING_CLASSES names its class, from a key of its class over its share (_over_share).
        The cancel goes first, so the node reads it before this generation and starts this one at its next step, as
        in a free lane. True when it took one."""
        rank = self._waiter().rank
        over_interactive = self.share.priority in settings.FLEET_PREEMPTING_CLASSES
        running = [s for s in _preemptible.get(self.spec.model, ()) if not s._preempting and s._current is not None]
        victims = [s for s in running if s._current[0] not in exclude
                   and (s.batch or (over_interactive and s._waiter().rank > rank))]
        if victims:
            await max(victims, key=lambda s: (s._waiter().rank, s.outcome.placement.get("placed_at", 0.0))).preempt()
            return True
        if self._waiter().priority in settings.FLEET_SHARE_PREEMPTING_CLASSES:
            victim = self._over_share(running, exclude)
            if victim is not None:
                await victim.preempt(by="a generation of a key under its share")
                return True
        return False

    def _over_share(self, running: list[GenerationStream], exclude: set[str]) -> GenerationStream | None:
        """The generation of this one's class to take a lane from: of a key whose lanes here, one fewer, would still
        be at least this key's, one more, per unit of weight (so a key gives up a lane only to one it then holds no
        fewer than, and never takes it back); the key most over its share first, then the one that started last."""
        me = self._waiter()
        mine = [s for s in running if not s.batch and s._waiter().rank == me.rank]
        held = Counter(s._waiter().key for s in mine)
        after = (held[me.key] + 1) / me.weight
        victims = [s for s in mine if s._current[0] not in exclude and s._waiter().key != me.key
                   and (held[s._waiter().key] - 1) / s._waiter().weight >= after]
        return max(victims, default=None, key=lambda s: (held[s._waiter().key] / s._waiter().weight,
                                                          s.outcome.placement.get("placed_at", 0.0)))

    async def preempt(self, by: str = "a generation of a higher class") -> None:
        """Give this generation's lane to one that outranks it (`by` says how): freed now, the node told to stop it."""
        node_id, link = self._current
        self._preempting, self._preempted_at, self._preempted_by = True, time.time(), by
        await registry().lifecycle.apreempted(node_id, self.spec.gen_id)
        metrics.preempted(model=self.spec.model, node=link.identity)
        await _cancel_quietly(link, self.spec.gen_id, f"preempted by {by}")

    def _within_share(self, nodes) -> bool:
        """A batch line may take any free lane while no interactive generation of its model waits here, else only
        while batch lines hold fewer than FLEET_BATCH_SHARE of the model's lanes (one at least)."""
        model = self.spec.model
        if not self.batch or not registry().lanes.above(model, RANKS[BATCH]):
            return True
        lanes = sum(s.lanes for s in nodes if model in s.models)
        return _running.get((model, True), 0) < max(1, int(lanes * settings.FLEET_BATCH_SHARE))

    def _unable(self, nodes) -> set[str]:
        """The nodes serving the model that lack a capability this request needs (never placed there); a 400
        naming the capability and those nodes when every node lacks it."""
        needs = self.spec.needs()
        if not needs:
            return set()
        serving = [s for s in nodes if self.spec.model in s.models]
        missing = {s.node_id: [n for n in needs if n not in s.capabilities] for s in serving}
        unable = {node_id for node_id, lacks in missing.items() if lacks}
        if serving and len(unable) == len(serving):
            lacking = sorted({n for lacks in missing.values() for n in lacks},
                             key=lambda n: sum(n in lacks for lacks in missing.values()), reverse=True)[0]
            names = ", ".join(sorted(s.identity for s in serving if lacking in missing[s.node_id]))
            hint = CAPABILITY_HINTS.get(lacking.partition(":")[0], "use a node whose engine supports it")
            raise GenerationError("capability_unavailable", f"This request needs {lacking}, and no node serving "
                                  f"{self.spec.model!r} has it (lacking it: {names}); {hint}.",
                                  status=400, param=lacking)
        return unable

    async def _run_on(self, link):
        reg = registry()
        relay_gen = self.spec.gen_id
        from fleet.links import Relay

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
            _preemptible.setdefault(self.spec.model, set()).add(self)
            while True:
                if relay.overflowed:
                    raise GenerationError("client_too_slow", "the client read tokens too slowly", status=500)
                event = await self._next_frame(relay, link, accepted=accepted)
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
                    if self._preempting and event.finish_reason == FinishReason.CANCELLED:
                        raise _Preempted
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
            _preemptible.get(self.spec.model, set()).discard(self)
            reg.relays.pop(relay_gen, None)
            if self._evicted:  # accepted, and ended without a done that forgot them
                asyncio.ensure_future(reg.lifecycle.aaccepted(link.node_id, self._evicted))
                self._evicted = []
            self._current = self._relay = None
            if not finished:
                # The client went away or failed mid-stream: free the node's lane now. Not awaited, because a
                # generator closed by the garbage collector may not await in its finally.
                asyncio.ensure_future(_cancel_quietly(link, relay_gen))

    async def _next_frame(self, relay, link, *, accepted: bool = True):
        """The node's next frame. While it is silent, the link it was sent over is checked every LINK_CHECK_S:
        a replaced link never delivers this generation's frames (lost node, placed again). Past the frame timeout,
        a clear error; before the node's first frame (`accepted` False), past FLEET_ACCEPT_TIMEOUT_S, it is placed
        elsewhere (a node that never answers held such a generation for the whole frame timeout)."""
        timeout = self._frame_timeout()
        if not accepted:
            timeout = min(timeout, settings.FLEET_ACCEPT_TIMEOUT_S * (4 if self.spec.needs_media() else 1))
        silent_until = time.monotonic() + timeout
        while True:
            try:
                frame = await relay.get(timeout=max(min(silent_until - time.monotonic(), LINK_CHECK_S), 0.0))
                if self._stopped is not None:
                    raise self._stopped
                return frame
            except TimeoutError:
                if time.monotonic() < silent_until:
                    if await _link_gone(link):
                        raise _NodeFailed(ErrorCode.NODE_LOST, f"node {link.identity!r}'s link was replaced "
                                                               "while it ran this generation") from None
                    continue
            if not accepted and timeout < self._frame_timeout():
                raise _NodeFailed(ErrorCode.NODE_SILENT, f"node {link.identity!r} did not accept the generation "
                                                         f"within {timeout:.0f} s", suspect=True)
            if self.spec.deadline is None:
                raise GenerationError("node_stuck", f"node {link.identity!r} sent nothing for {STUCK_AFTER_S:.0f} s; "
                                      "the generation was stopped", status=504, kind="server_error")
            raise GenerationError("deadline_exceeded", "the generation passed its deadline", status=504,
                                  kind="server_error")

    def _frame_timeout(self) -> float:
        """How long to wait for the node's next frame: until the client's deadline (the node ends the generation
        itself then), or, without one, a generous silence after which the node is taken for stuck."""
        if self.spec.deadline is not None:
            return max(self.spec.deadline - time.time(), 0) + 5
        return STUCK_AFTER_S

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
        await registry().lifecycle.adone(link.node_id, self.spec, self.keys, answer=self.outcome.text,
                                         usage=reported, tokenizer=self.tokenizer, evicted=evicted)
        self.outcome.finish_reason = event.finish_reason
        self.outcome.timings = dict(event.timings)
        usage = {
            "prompt_tokens": self.outcome.prompt_tokens or count_checked(
                event.usage.get("prompt_tokens"), prompt_tokens_bound(self.spec), what="prompt_tokens",
                node=link.identity, gen_id=self.spec.gen_id),
            "completion_tokens": self.outcome.completion_tokens,
            "cached_tokens": self.outcome.cached_tokens,
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if isinstance(event.usage.get("stop_index"), int):  # which stop string ended it (the Messages API says)
            usage["stop_index"] = event.usage["stop_index"]
        return Finished(event.finish_reason, usage, self.outcome.timings, link.identity)

    def _finished_by_length(self, node: str) -> Finished:
        self.outcome.finish_reason = "length"
        usage = {"prompt_tokens": self.outcome.prompt_tokens, "completion_tokens": self.outcome.completion_tokens,
                 "cached_tokens": self.outcome.cached_tokens}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return Finished("length", usage, self.outcome.timings, node)

    async def stop(self, error: GenerationError) -> None:
        """The head ends this generation (its drain): the node's lane is cancelled, and its next step, waiting
        for a lane or for the node's next frame, raises `error` at once."""
        self._stopped = error
        if self._waiting is not None:
            registry().lanes.wake(self._waiting)
        if self._relay is not None:
            self._relay.push(_STOP)
        await self.cancel(error.message)

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
                      share: Share | None = None) -> GenerationStream:
    """`batch`: a batch job's line, placed after every interactive generation and within its share of lanes.
    `share`: its key, class and weight in the waiting room (fleet.waiting); none: the default class, no key."""
    return GenerationStream(spec, deadline=deadline, batch=batch, share=share)
