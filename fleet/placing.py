"""Placing one generation: wait in the waiting room's order for a lane of its model, and reserve it.

A `Placer` belongs to one `fleet.dispatch.GenerationStream` (its `gen`) and runs each of its placements (the first,
after a failover, after a preemption). It keys the prompt (prefix keys, with the tokenizer of the nodes that serve the
model, and the key of the name its client gave the prefix, OpenAI's `prompt_cache_key`, whose holder is tried
first), keeps to the key's bound on waiting generations and the batch lines' share of lanes, preempts a lower one
where the rules say (fleet.running), has an on-demand model loaded, and writes the placement's evidence (queued,
waited, loaded, failed over) into the generation's outcome.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from django.conf import settings

from fleet import heads, loading, metrics, tracing
from fleet.errors import GenerationError
from fleet.links import registry
from fleet.live import fleet_changed
from fleet.waiting import BATCH, RANKS, Share, Waiter
from nodes.agent.vocab import BUILTINS, BYTES
from nodes.link.lifecycle import aplacement_keys, named_placement_key
from nodes.link.prefix import PrefixKey
from nodes.link.spec import GenerateSpec
from nodes.tokenizers import fingerprint_served, tokenizer_get, tokenizer_known

# A generation waiting for a lane is woken by events (a lane freed, a node joined, here or in another head process);
# it also looks again this often, in case a wake was lost with a Redis connection.
WAKE_CHECK_S = 5.0
LOADING_CHECK_S = 1.0
# What a user can do when no node has a capability a request needs.
CAPABILITY_HINTS = {
    "batch_invariant": "start a node with `manage.py node_join --batch-invariant` (greedy output then never depends "
                       "on the batch, at some speed), or leave batch_invariant out",
    "transcribe": "start a node with `manage.py node_join --transcribe whisper-tiny.en` and name that model",
    "lora": "load the adapter on a node serving the model (`manage.py node_join --lora NAME=PATH`)",
    "vision": "start a node with the model's multimodal projector (`manage.py node_join --mmproj PATH`), or send no "
              "image",
}


class Placed(Protocol):
    """What a placer reads of its generation (fleet.dispatch.GenerationStream)."""

    spec: GenerateSpec
    deadline: float
    batch: bool
    cache_key: str  # the prefix's name its client gave (prompt_cache_key), scoped to its API key; "" without one
    share: Share
    outcome: Any  # fleet.dispatch.Outcome: `placement` and the node it ran on are written here
    trace: Any
    failure: dict[str, Any] | None  # why its last attempt ended, for the next placement's evidence
    stopped: GenerationError | None  # ended by the head: raised at its next step


class Placer:
    def __init__(self, gen: Placed) -> None:
        self.gen = gen
        self.keys: list[PrefixKey] | None = None  # the prompt's, once its model's tokenizer is known (_key)
        self.named: PrefixKey | None = None  # its cache key's (gen.cache_key), keyed with them
        self.tokenizer: Any = None
        self._tokenizer_due = ""  # the fingerprint whose file the keys wait for (they are bytes' until it is in)
        self.counted = False  # counted in registry().running (from its first placement to its end)
        self._queued: dict[str, Any] | None = None  # its place when it first queued (the record's evidence)
        self._loading: dict[str, Any] | None = None  # it waited for an on-demand load: since when, on which node
        self.waiting: Waiter | None = None  # its place in the waiting room while it waits for a lane

    def waiter(self) -> Waiter:
        gen, share = self.gen, self.gen.share
        rank = RANKS[BATCH] if gen.batch else RANKS.get(share.priority, RANKS["normal"])
        return Waiter(gen.spec.gen_id, rank, gen.deadline, share.key, max(share.weight, 1), share.label)

    def uncount(self) -> None:
        if self.counted:
            self._count(-1)
            registry().lanes.notify()  # a batch line waiting on the share may go now

    async def place(self, excluded: set[str]):
        """Reserve a lane, waiting in the waiting room's order (fleet.waiting); past the deadline, fail without
        ever starting; over its key's bound on waiting generations, a 429 at once."""
        reg, gen = registry(), self.gen
        model = gen.spec.model
        key = self.waiter()
        entry = reg.waiting.join(model, key)
        reg.lanes.join(model, key)
        if self._queued is None:
            self._queued = {"priority": key.priority, "position": reg.lanes.ahead(model, key), "at": time.time()}
        tracing.queue_begin(gen.trace)
        fleet_changed()
        placed, first = False, True
        self.waiting = key
        try:
            while True:
                if gen.stopped is not None:
                    raise gen.stopped
                choice = await self._try_place(reg, excluded)
                if choice is not None:
                    placed = True
                    return choice
                if first and not gen.outcome.placement:  # never once it ran (a failover, a preempted one)
                    self._refuse_over_bound(reg, key)
                    first = False
                left = gen.deadline - time.time()
                if left <= 0 and self._loading is not None and not gen.outcome.placement:
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
            self.waiting = None
            reg.waiting.leave(entry, placed=placed)
            reg.lanes.leave(model, key, placed=placed)
            reg.lanes.notify()
            fleet_changed()  # placed (a lane taken), or gone from the queue

    def placed(self, choice) -> dict[str, Any]:
        """The placement's evidence, written into the outcome: the first with its queue wait, a later one as a
        failover after what ended the attempt before it."""
        gen = self.gen
        outcome = gen.outcome
        outcome.node_id, outcome.node = choice.node_id, choice.identity
        outcome.nodes_used.append(choice.identity)
        # The timestamps make the generation page's timeline (queued, placed, failed over); kept in this JSON,
        # written once at the end with the rest.
        evidence = {**choice.evidence(), "placed_at": time.time()}
        metrics.placement_made(model=gen.spec.model, evidence=evidence)
        loading.placed(choice.node_id, gen.spec.model.partition(":")[0])
        tracing.placed(gen.trace, evidence)
        if outcome.placement:
            outcome.placement.setdefault("failover", []).append({**evidence, "after": gen.failure})
            return evidence
        queued = self._queued or {}
        evidence["queue"] = {**queued, "waited_ms": round((evidence["placed_at"] - queued.get("at",
                                                            evidence["placed_at"])) * 1000)}
        if self._loading is not None:  # the wait was for a node to load its model on demand
            evidence["queue"]["loading"] = {"node": self._loading["node"] or choice.identity,
                                            "since": self._loading["at"],
                                            "ms": round((evidence["placed_at"] - self._loading["at"]) * 1000)}
        if not gen.batch:
            loading.waited(gen.spec.model, evidence["queue"]["waited_ms"] / 1000)
        metrics.admitted(priority=queued.get("priority", ""))
        outcome.placement = evidence
        return evidence

    def _refuse_over_bound(self, reg, key: Waiter) -> None:
        """A 429 when this generation, which found no lane, would put its key over its bound on waiting ones (batch
        lines are bounded by their batch's concurrency instead)."""
        gen = self.gen
        bound = gen.share.max_waiting
        if gen.batch or not bound or reg.waiting.of_key(key.key) <= bound:
            return
        wait = reg.waiting.retry_after_s(gen.spec.model, reg.lanes.ahead(gen.spec.model, key))
        raise GenerationError("too_many_waiting", f"This API key already has {bound} generations waiting for a lane "
                              f"of {gen.spec.model!r} (its bound); retry in {wait} s, when the lanes will have "
                              "served those ahead of it at their current rate.", status=429, retry_after=wait,
                              kind="rate_limit_error")

    async def _try_place(self, reg, excluded: set[str]):
        """A lane now if this generation's turn has come and one is free (None: wait for the next wake)."""
        gen = self.gen
        model = gen.spec.model
        nodes = await reg.aplacement.nodes()  # a snapshot (over Redis: refreshed by each choice, no round trip)
        if not any(model in s.models for s in nodes):
            nodes = await reg.aplacement.nodes(fresh=True)  # a node that just joined: not refused for a stale view
        serving = [s for s in nodes if model in s.models]
        if not serving and await self._load_on_demand():
            return None  # waits in its model's queue (keep-alives flow; its deadline holds) until a node serves it
        if not serving:
            if gen.failure and gen.failure["code"] != "preempted":  # its node went mid-generation: say so
                raise GenerationError(gen.failure["code"], f"{gen.failure['message']}, and no other node serves "
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
        ahead = reg.lanes.ahead(model, self.waiter())
        # placed only on nodes this process holds a link to (a node behind NAT may reach only some head processes)
        linked = set(reg.links)
        free = sum(s.free for s in nodes if model in s.models and s.schedulable and s.node_id in linked)
        if not gen.batch and ahead >= free and await self._preempt_a_lower_one(exclude=excluded | unable):
            free += 1  # the lane it freed: over Redis this process's snapshot has not heard of it yet
        if ahead >= free or not self._within_share(nodes):
            await self._still_waiting(model)
            return None
        counting = not self.counted
        if counting:  # counted before choosing, which may await Redis: two batch lines must not both pass the share
            self._count(1)
        place = {"only": linked, "head": heads.PROCESS_ID}
        choice = await _choose_named(reg, self, nodes, excluded | unable, linked)
        if choice is None:
            choice = await reg.lifecycle.achoose(gen.spec, self.keys, exclude=excluded | unable, **place)
        if choice is None and excluded:
            choice = await reg.lifecycle.achoose(gen.spec, self.keys, exclude=unable, **place)
        if choice is None and counting:
            self._count(-1)
        if choice is None:  # the lanes were taken as it chose (Redis' view)
            await self._still_waiting(model)
        return choice

    def held(self) -> list[PrefixKey]:
        """What the node it ran on holds once it is done, besides its answer: the prompt's keys and its name's."""
        return [*(self.keys or []), *([self.named] if self.named else [])]

    async def _still_waiting(self, model: str) -> None:
        """No lane for it this time: an on-demand model whose queue waits too long gets one more replica."""
        if self._queued and not self.gen.batch:
            await loading.ascale(model, time.time() - self._queued["at"])

    async def _load_on_demand(self) -> bool:
        """No node serves the model: when it is an on-demand registry model, have a node load it (or find its load
        under way) and say so in the record and the trace; False when it is not one. A 503 with the figures when it
        fits on no node."""
        model = self.gen.spec.model
        try:
            decision = await loading.aload(model)
        except loading.NoRoom as exc:
            raise GenerationError("model_cannot_fit", str(exc), status=503, retry_after=30,
                                  kind="server_error") from None
        if decision is None:
            return False
        if self._loading is None:
            self._loading = {"at": time.time(), "node": decision.node or ""}
            tracing.loading(self.gen.trace, model, decision.node or "")
        elif decision.node:
            self._loading["node"] = decision.node
        return True

    async def _key(self, nodes) -> None:
        """The prompt's prefix keys, with the tokenizer of the nodes serving its model: once per generation, off the
        event loop (nodes.link.lifecycle.aplacement_keys)."""
        spec = self.gen.spec
        fingerprint = fingerprint_served(spec.model, [s.tokenizers for s in nodes]) or BYTES
        self.tokenizer = BUILTINS.get(fingerprint) or await asyncio.to_thread(tokenizer_get, fingerprint)
        self.keys = await aplacement_keys(spec, self.tokenizer)
        self.named = named_placement_key(spec, self.tokenizer, self.gen.cache_key) if self.gen.cache_key else None
        # Keyed by bytes while the file of its nodes' tokenizer is on its way (a node that just joined is not
        # placed until the file is in): keyed again once it is, so the node records the keys the next turn looks up.
        self._tokenizer_due = fingerprint if self.tokenizer is BUILTINS[BYTES] and fingerprint != BYTES else ""

    def _count(self, delta: int) -> None:
        """In registry().running from its first placement to its end."""
        self.counted = delta > 0
        registry().running.count(self.gen.spec.model, self.gen.batch, delta)

    async def _preempt_a_lower_one(self, *, exclude: set[str]) -> bool:
        """No lane for this interactive generation (nor for those ahead of it): take one from a generation of its
        model that the rules of fleet.running give it, on a node it may use. The cancel goes first, so the node
        reads it before this generation and starts this one at its next step, as in a free lane. True when it took
        one."""
        me = self.waiter()
        chosen = registry().running.victim(
            self.gen.spec.model, me, exclude=exclude,
            over_interactive=self.gen.share.priority in settings.FLEET_PREEMPTING_CLASSES,
            share_preempting=me.priority in settings.FLEET_SHARE_PREEMPTING_CLASSES)
        if chosen is None:
            return False
        holder, by = chosen
        await holder.stream.preempt(by=by)
        return True

    def _within_share(self, nodes) -> bool:
        """A batch line may take any free lane while no interactive generation of its model waits here, else only
        while batch lines hold fewer than FLEET_BATCH_SHARE of the model's lanes (one at least)."""
        model = self.gen.spec.model
        if not self.gen.batch or not registry().lanes.above(model, RANKS[BATCH]):
            return True
        lanes = sum(s.lanes for s in nodes if model in s.models)
        return registry().running.counted(model, True) < max(1, int(lanes * settings.FLEET_BATCH_SHARE))

    def _unable(self, nodes) -> set[str]:
        """The nodes serving the model that lack a capability this request needs (never placed there); a 400
        naming the capability and those nodes when every node lacks it."""
        spec = self.gen.spec
        needs = spec.needs()
        if not needs:
            return set()
        serving = [s for s in nodes if spec.model in s.models]
        missing = {s.node_id: [n for n in needs if n not in s.capabilities] for s in serving}
        unable = {node_id for node_id, lacks in missing.items() if lacks}
        if serving and len(unable) == len(serving):
            lacking = sorted({n for lacks in missing.values() for n in lacks},
                             key=lambda n: sum(n in lacks for lacks in missing.values()), reverse=True)[0]
            names = ", ".join(sorted(s.identity for s in serving if lacking in missing[s.node_id]))
            hint = CAPABILITY_HINTS.get(lacking.partition(":")[0], "use a node whose engine supports it")
            raise GenerationError("capability_unavailable", f"This request needs {lacking}, and no node serving "
                                  f"{spec.model!r} has it (lacking it: {names}); {hint}.",
                                  status=400, param=lacking)
        return unable


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


async def _choose_named(reg, placer: Placer, nodes, exclude: set[str], linked: set[str]):
    """A generation whose client named its prefix (prompt_cache_key) goes where that name's generations ran (the
    index holds the name's key there, as it holds a conversation's prompt), when one of those nodes has a free lane;
    None: it is placed by cost alone."""
    if placer.named is None:
        return None
    spec = placer.gen.spec
    held = await reg.aplacement.holders(placer.named.key)
    where = {s.node_id for s in nodes if s.node_id in held and s.node_id in linked and s.node_id not in exclude
             and s.free > 0 and s.schedulable and spec.model in s.models}
    if not where:
        return None
    return await reg.lifecycle.achoose(spec, placer.keys, exclude=exclude, only=where, head=heads.PROCESS_ID)
