"""Placement: which node a generation goes to (the replica rule).

cost(node) = prompt tokens the node would have to read again + load_tokens(node) x generations running there.
A tie goes to the least loaded node, then the least routed one, so idle nodes share the work.

load_tokens(node) is learned per node, with nothing to tune: the prompt tokens that node could read in the time an
extra running generation costs, prefill_tps x decode_slowdown_s x answer_tokens / 2 (what the node's engine measures
and reports in its heartbeat: its prefill rate and how much each running generation slows a decode step; and the
mean answer length of the generations done there, of which a running one has half left on average). A node that
has not measured them yet costs no load (ties still go to the least loaded). A fixed `load_tokens` given to the state
(FLEET_LOAD_TOKENS) overrides the learned one.

The index maps each prefix key to the nodes that hold it (and the generation that put it there), LRU-capped.
Nodes report what they evict (the generations whose lane another one took) and when their cache was
cleared (an engine restart), so the index follows the real caches rather than the routing history.
Shared by the head (placing on nodes) and a node with replicas (placing on its engine workers): Django-free.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nodes.link.prefix import PrefixKey


@dataclass
class NodeSlot:
    """What placement knows of one connected node (or one replica group behind it)."""

    node_id: str
    identity: str
    models: list[str]
    lanes: int
    context_window: int = 0
    running: int = 0
    routed: int = 0
    schedulable: bool = True
    capabilities: list[str] = field(default_factory=list)  # the capabilities the node reports as true
    prefill_tps: float = 0.0  # prompt tokens a second its engine reads (0: not measured yet)
    decode_slowdown_ms: float = 0.0  # what each running generation adds to one of its decode steps
    answer_tokens: float = 0.0  # mean completion tokens of the generations done there (learned at done)
    tokenizers: dict[str, str] = field(default_factory=dict)  # model -> its tokenizer's fingerprint (nodes.agent.vocab)

    @property
    def free(self) -> int:
        return max(self.lanes - self.running, 0)

    @property
    def learned_load_tokens(self) -> int:
        return learned_load_tokens(self.prefill_tps, self.decode_slowdown_ms, self.answer_tokens)


def learned_load_tokens(prefill_tps: float, decode_slowdown_ms: float, answer_tokens: float) -> int:
    """The prompt tokens a node reads in the time one more running generation costs a generation placed there:
    each of its decode steps is slower by decode_slowdown_ms for as long as that one still runs, on average half an
    answer (it is halfway through). (The Redis state's Lua script computes the same.)"""
    return int(prefill_tps * decode_slowdown_ms / 1000 * answer_tokens / 2 + 0.5)


def learn_answer_tokens(old: float, completion_tokens: int) -> float:
    """A moving mean of answer lengths: the first answer sets it."""
    return float(completion_tokens) if old <= 0 else 0.8 * old + 0.2 * completion_tokens


@dataclass
class Choice:
    node_id: str
    identity: str
    cost: int
    matched_tokens: int
    prompt_tokens_estimate: int
    runner_up: dict | None = None
    candidates: int = 0
    # Every candidate, cheapest first (the chosen one leads): its cost split into the prompt tokens it would read
    # again and the load penalty for the generations already running there.
    ranking: list[dict] = field(default_factory=list)

    def evidence(self) -> dict:
        return {
            "node": self.identity,
            "node_id": self.node_id,
            "cost": self.cost,
            "matched_tokens": self.matched_tokens,
            "prompt_tokens_estimate": self.prompt_tokens_estimate,
            "runner_up": self.runner_up,
            "candidates": self.candidates,
            "ranking": self.ranking,
        }


def ranking_row(identity: str, node_id: str, *, total: int, matched: int, running: int, load_tokens: int) -> dict:
    """One candidate's line of placement evidence; its `cost` is `reread_tokens + load_tokens` (`load_tokens` is
    the node's load per running generation times `running`)."""
    reread = max(total - matched, 0)
    return {"node": identity, "node_id": node_id, "cost": reread + load_tokens * running, "reread_tokens": reread,
            "load_tokens": load_tokens * running, "load_per_generation": load_tokens, "matched_tokens": matched,
            "running": running}


@dataclass
class _Holders:
    # node_id -> the generations whose lanes hold the key there. A set, not the last one: two lanes of a node
    # can hold the same prefix (a shared system prompt), and evicting one lane must not forget the other.
    by_node: dict[str, set[str]] = field(default_factory=dict)


class AsyncView:
    """A placement state's operations as coroutines, for code on an event loop that may also run over Redis (whose
    state gives its own, on redis.asyncio). The in-process state's calls take one short lock, never wait on I/O."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.state, name)

        async def run(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        return run


class PlacementState:
    """In-process placement state: nodes, their load, and the prefix index. Thread-safe (one lock). `aio`: the same
    operations as coroutines (the interface the Redis state shares)."""

    def __init__(self, *, load_tokens: int | None = None, max_keys: int = 200_000):
        self.load_tokens = load_tokens  # None: each node's learned load
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeSlot] = {}
        self._placed: dict[str, set[str]] = {}  # node_id -> the generations holding a lane there
        self._index: OrderedDict[str, _Holders] = OrderedDict()
        self._by_gen: dict[tuple[str, str], list[str]] = {}
        self._links: dict[str, dict[str, float]] = {}  # node_id -> {head process: since}
        self.aio = AsyncView(self)

    # --- nodes ---
    def node_up(self, slot: NodeSlot, *, cache_cleared: bool = True, head: str = "",
                warm: list[str] | tuple[str, ...] = ()) -> None:
        """A node (re)joined. With `cache_cleared` its engine started afresh: the index forgets what it held,
        except what the generations in `warm` put there (lanes a `--park` node restored from disk)."""
        with self._lock:
            old = self._nodes.get(slot.node_id)
            if old is not None and not cache_cleared:
                slot.routed = old.routed
            self._nodes[slot.node_id] = slot
            self._placed[slot.node_id] = set()
            self._links[slot.node_id] = {head: time.time()}  # one process: its one link
            if cache_cleared:
                self._forget_node_locked(slot.node_id, set(warm))

    def node_models(self, node_id: str, models: list[str], lanes: int, capabilities: list[str] | None = None) -> None:
        """A node loaded or unloaded a model (or an adapter: then its capabilities changed too): it serves these from
        now on, with this many lanes (running ones stay)."""
        with self._lock:
            slot = self._nodes.get(node_id)
            if slot is not None:
                slot.models, slot.lanes = list(models), lanes
                if capabilities is not None:
                    slot.capabilities = list(capabilities)

    def node_tokenizers(self, node_id: str, tokenizers: dict[str, str]) -> None:
        """The tokenizer of each model the node serves (its fingerprint), as it reported them."""
        with self._lock:
            slot = self._nodes.get(node_id)
            if slot is not None:
                slot.tokenizers = dict(tokenizers)

    def node_alive(self, node_id: str) -> None:
        """Liveness is the link itself in one process; the Redis state expires silent nodes instead."""

    def node_beat(self, node_id: str, *, prefill_tps: float, decode_slowdown_ms: float, schedulable: bool) -> None:
        """A link's heartbeat: what its engine measured, and whether it takes work."""
        self.measured(node_id, prefill_tps=prefill_tps, decode_slowdown_ms=decode_slowdown_ms)
        self.set_schedulable(node_id, schedulable)

    def node_down(self, node_id: str, head: str = "") -> int:
        """The link is gone (the links left: none, in one process). What the node held stays in the index: a node
        that comes back with its cache (a link blip, a parked restart) is placed by it at once, and one that cleared
        it says so at register."""
        with self._lock:
            self._nodes.pop(node_id, None)
            self._links.pop(node_id, None)
        return 0

    def links_of(self, node_id: str) -> dict[str, float]:
        """The head processes holding a link to the node (by id here: one process) and since when."""
        with self._lock:
            return dict(self._links.get(node_id, {}))

    def set_schedulable(self, node_id: str, schedulable: bool) -> None:
        with self._lock:
            if node_id in self._nodes:
                self._nodes[node_id].schedulable = schedulable

    def nodes(self, fresh: bool = False) -> list[NodeSlot]:
        with self._lock:
            return [NodeSlot(**{**vars(s), "capabilities": list(s.capabilities), "tokenizers": dict(s.tokenizers)})
                    for s in self._nodes.values()]

    def measured(self, node_id: str, *, prefill_tps: float, decode_slowdown_ms: float) -> None:
        """What the node's engine measured (its heartbeat): the figures its load per running generation comes from."""
        with self._lock:
            slot = self._nodes.get(node_id)
            if slot is not None:
                slot.prefill_tps, slot.decode_slowdown_ms = prefill_tps, decode_slowdown_ms

    def load_of(self, slot: NodeSlot) -> int:
        return slot.learned_load_tokens if self.load_tokens is None else self.load_tokens

    def models(self) -> list[str]:
        with self._lock:
            return sorted({m for s in self._nodes.values() for m in s.models})

    # --- placing ---
    def choose(self, model: str, keys: list[PrefixKey], *, exclude: set[str] = frozenset(), gen_id: str = "",
               only: set[str] | None = None, head: str = "") -> Choice | None:
        """Pick and reserve a lane on the cheapest node serving `model` for `gen_id` (among `only`, when given);
        None when no lane is free."""
        with self._lock:
            candidates = [
                s for s in self._nodes.values()
                if model in s.models and s.schedulable and s.free > 0 and s.node_id not in exclude
                and (only is None or s.node_id in only)
            ]
            if not candidates:
                return None
            scored = sorted(
                (self._cost_locked(s, keys) + (s.running, s.routed, s.identity, s) for s in candidates),
                key=lambda row: row[:5],
            )
            cost, matched, total, _, _, _, best = scored[0]
            placed = self._placed.setdefault(best.node_id, set())
            if not gen_id or gen_id not in placed:
                best.running += 1
            placed.add(gen_id)
            best.routed += 1
            runner_up = None
            if len(scored) > 1:
                r = scored[1]
                runner_up = {"node": r[6].identity, "cost": r[0], "matched_tokens": r[1]}
            ranking = [ranking_row(s.identity, s.node_id, total=t, matched=m, running=run, load_tokens=self.load_of(s))
                       for _, m, t, run, _, _, s in scored]
            for k in keys:
                if k.key in self._index:
                    self._index.move_to_end(k.key)
            return Choice(best.node_id, best.identity, cost, matched, total, runner_up, len(candidates), ranking)

    def _cost_locked(self, slot: NodeSlot, keys: list[PrefixKey]) -> tuple[int, int, int]:
        total = keys[-1].tokens if keys else 0
        matched = 0
        for k in keys:
            holders = self._index.get(k.key)
            if holders is None or slot.node_id not in holders.by_node:
                break
            matched = k.tokens
        return (max(total - matched, 0) + self.load_of(slot) * slot.running, matched, total)

    def release(self, node_id: str, gen_id: str = "") -> None:
        """Free the lane `gen_id` held; once only, so the link and the dispatcher may both report its end."""
        with self._lock:
            slot = self._nodes.get(node_id)
            placed = self._placed.get(node_id, set())
            if gen_id and gen_id not in placed:
                return
            placed.discard(gen_id)
            if slot is not None and slot.running > 0:
                slot.running -= 1

    def free_lanes(self, model: str) -> int:
        with self._lock:
            return sum(s.free for s in self._nodes.values() if model in s.models and s.schedulable)

    # --- the prefix index ---
    def record(self, node_id: str, gen_id: str, keys: list[PrefixKey], *, completion_tokens: int = 0) -> None:
        """A generation finished on a node: the node now holds these keys (its prompt and answer)."""
        with self._lock:
            slot = self._nodes.get(node_id)
            if slot is None:
                return
            if completion_tokens > 0:
                slot.answer_tokens = learn_answer_tokens(slot.answer_tokens, completion_tokens)
            for k in keys:
                holders = self._index.get(k.key)
                if holders is None:
                    holders = self._index[k.key] = _Holders()
                holders.by_node.setdefault(node_id, set()).add(gen_id)
                self._index.move_to_end(k.key)
            self._by_gen[(node_id, gen_id)] = [k.key for k in keys]
            while len(self._index) > self.max_keys:
                self._index.popitem(last=False)

    def finish(self, node_id: str, gen_id: str, keys: list[PrefixKey], *, completion_tokens: int = 0,
               evicted: list[str] | tuple[str, ...] = ()) -> None:
        """A generation done: record, evict, release (one round trip over Redis)."""
        self.record(node_id, gen_id, keys, completion_tokens=completion_tokens)
        self.evict(node_id, list(evicted))
        self.release(node_id, gen_id)

    def evict(self, node_id: str, gen_ids: list[str]) -> None:
        """The node reports these generations' lanes were taken: it no longer holds what only they put there."""
        with self._lock:
            for gen_id in gen_ids:
                for key in self._by_gen.pop((node_id, gen_id), []):
                    holders = self._index.get(key)
                    gens = holders.by_node.get(node_id) if holders is not None else None
                    if gens is not None:
                        gens.discard(gen_id)
                        if not gens:
                            del holders.by_node[node_id]

    def forget_node(self, node_id: str) -> None:
        with self._lock:
            self._forget_node_locked(node_id)

    def _forget_node_locked(self, node_id: str, keep: set[str] = frozenset()) -> None:
        for holders in self._index.values():
            gens = holders.by_node.get(node_id)
            if gens is not None:
                gens &= keep
                if not gens:
                    del holders.by_node[node_id]
        for pair in [p for p in self._by_gen if p[0] == node_id and p[1] not in keep]:
            del self._by_gen[pair]

    def holders(self, key: str) -> set[str]:
        with self._lock:
            holders = self._index.get(key)
            return set(holders.by_node) if holders else set()

    def index_size(self) -> int:
        with self._lock:
            return len(self._index)
