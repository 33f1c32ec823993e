"""The placement state in Redis, so several head processes place consistently (used when REDIS_URL is set).

The same interface and the same rule (each node's learned load included) as nodes.link.placement.PlacementState.
`choose` runs as one Lua script, so two heads cannot both take a node's last free lane.

Each operation is written once, as a generator of Redis calls (`_op_*`), and run by one of two drivers: the state's
own methods, synchronous (admin pages, metrics, management commands, tests), and `state.aio`, the same methods as
coroutines on `redis.asyncio` for the event loop (dispatch, the link consumer), which must never wait on a socket.
A lane freed or a node (re)joined is also published on `<prefix>pl:lanes`, so waiters in every head process wake.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Generator
from typing import Any

import redis
import redis.asyncio

from fleet.placement_lua import KEY_TTL_S, SCRIPTS
from nodes.link.placement import Choice, NodeSlot, ranking_row
from nodes.link.prefix import PrefixKey

ASYNC_CONNECTIONS = 64  # per head process and event loop; callers beyond it wait for one
SNAPSHOT_S = 1.0  # how long a head process's snapshot of the nodes' slots serves without news
# ... and while it listens to the lanes channel, which tells it every change but another process's choice (which
# can only make a lane look free that a choice then finds taken, and that choice's reply refreshes the snapshot):
# read at most this often, so a generation at a low rate does not pay a read of the fleet besides its choice.
SNAPSHOT_HEARD_S = 5.0

Step = Callable[[Any, dict[str, Any]], Any]  # (client, its scripts) -> a result, or an awaitable of one
Op = Generator[Step, Any, Any]


def _call(name: str, *args: Any, **kwargs: Any) -> Step:
    return lambda r, scripts: getattr(r, name)(*args, **kwargs)


def _script(name: str, args: list[Any]) -> Step:
    return lambda r, scripts: scripts[name](args=args)


def _pipe(build: Callable[[Any], None]) -> Step:
    """Commands sent in one round trip (a pipeline queues them the same way on either client)."""
    def step(r, scripts):
        pipe = r.pipeline()
        build(pipe)
        return pipe.execute()

    return step


def _slot(node_id: str, h: dict[str, str]) -> NodeSlot:
    return NodeSlot(node_id, h["identity"], json.loads(h["models"]), int(h["lanes"]), int(h.get("ctx", 0)),
                    int(h["running"]), int(h["routed"]), h["schedulable"] == "1",
                    json.loads(h.get("caps", "[]")), float(h.get("ptps", 0)), float(h.get("dslow", 0)),
                    float(h.get("ans", 0)), json.loads(h.get("tok", "{}")))


def _slots(rows: list) -> list[NodeSlot]:
    """Slots from the scripts' [node id, flat hash] rows."""
    slots = []
    for node_id, flat in sorted(rows, key=lambda row: row[0]) if rows else ():  # cjson makes an empty list {}
        h = dict(zip(flat[::2], flat[1::2], strict=True))
        if "identity" in h:
            slots.append(_slot(node_id, h))
    return slots


def _choice(got: dict) -> Choice:
    total = int(got["total"])
    ranking = [ranking_row(identity, node_id, total=total, matched=int(matched), running=int(running),
                           load_tokens=int(load)) for identity, node_id, matched, running, load in got["ranking"]]
    return Choice(got["node_id"], got["identity"], int(got["cost"]), int(got["matched"]), total,
                  got.get("runner_up"), int(got["candidates"]), ranking)


class RedisPlacementState:
    """Placement state shared by every head process through Redis. `aio`: the same operations, awaitable."""

    def __init__(self, url: str, *, prefix: str = "fleet:", load_tokens: int | None = None, max_keys: int = 200_000,
                 node_ttl_s: int = 60):
        self.url = url
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.p = f"{prefix}pl:"
        self.lanes_channel = f"{self.p}lanes"
        self.load_tokens, self.max_keys, self.node_ttl_s = load_tokens, max_keys, node_ttl_s
        self._scripts = {name: self.r.register_script(source) for name, source in SCRIPTS.items()}
        self._async: tuple[asyncio.AbstractEventLoop, Any, dict[str, Any]] | None = None
        self.aio = AsyncRedisPlacement(self)

    def _run(self, op: Op) -> Any:
        result = None
        try:
            while True:
                result = op.send(result)(self.r, self._scripts)
        except StopIteration as stop:
            return stop.value

    async def _arun(self, op: Op) -> Any:
        r, scripts = self._async_client()
        result = None
        try:
            while True:
                result = await op.send(result)(r, scripts)
        except StopIteration as stop:
            return stop.value

    def _async_client(self) -> tuple[Any, dict[str, Any]]:
        """One redis.asyncio client per event loop (its connections belong to the loop that opened them)."""
        loop = asyncio.get_running_loop()
        if self._async is None or self._async[0] is not loop:
            # A blocking pool: hundreds of streams may place at once, and redis.asyncio's default pool refuses
            # the 101st connection (MaxConnectionsError, bench/scale.py found it) where waiting is right.
            pool = redis.asyncio.BlockingConnectionPool.from_url(self.url, decode_responses=True,
                                                                 max_connections=ASYNC_CONNECTIONS)
            r = redis.asyncio.Redis(connection_pool=pool)
            self._async = (loop, r, {name: r.register_script(source) for name, source in SCRIPTS.items()})
        return self._async[1], self._async[2]

    # --- nodes ---
    def node_up(self, slot: NodeSlot, *, cache_cleared: bool = True, head: str = "",
                warm: list[str] | tuple[str, ...] = ()) -> None:
        self._run(self._op_node_up(slot, cache_cleared=cache_cleared, head=head, warm=warm))

    def _op_node_up(self, slot: NodeSlot, *, cache_cleared: bool = True, head: str = "", warm=()) -> Op:
        """A link from head process `head` registered the node. Its lanes are counted once, whatever its links: they
        start again from none only when the node's engine started afresh or no other link holds it."""
        key, links = f"{self.p}node:{slot.node_id}", f"{self.p}links:{slot.node_id}"
        routed, linked = yield _pipe(lambda pipe: (pipe.hget(key, "routed"), pipe.hlen(links)))
        if routed is not None and not cache_cleared:
            slot.routed = int(routed)
        fresh = cache_cleared or not linked

        def build(pipe) -> None:
            mapping = {
                "identity": slot.identity, "models": json.dumps(slot.models), "lanes": slot.lanes,
                "routed": slot.routed, "schedulable": int(slot.schedulable),
                "ctx": slot.context_window, "tok": json.dumps(slot.tokenizers),
                "caps": json.dumps(slot.capabilities), "ptps": slot.prefill_tps, "dslow": slot.decode_slowdown_ms,
                "ans": slot.answer_tokens,
            }
            if fresh:
                mapping["running"] = slot.running
                pipe.delete(f"{self.p}run:{slot.node_id}")
            else:
                pipe.hsetnx(key, "running", 0)
            pipe.hset(key, mapping=mapping)
            pipe.hset(links, head, f"{time.time():.3f}")
            pipe.expire(key, self.node_ttl_s)
            pipe.expire(links, self.node_ttl_s)
            pipe.sadd(f"{self.p}nodes", slot.node_id)
            pipe.publish(self.lanes_channel, "joined")

        yield _pipe(build)
        if cache_cleared:
            yield from self._op_forget_node(slot.node_id, keep=warm)

    def node_models(self, node_id: str, models: list[str], lanes: int, capabilities: list[str] | None = None) -> None:
        """A node loaded or unloaded a model (or an adapter: then its capabilities changed too): it serves these from
        now on, with this many lanes (running ones stay)."""
        self._run(self._op_node_models(node_id, models, lanes, capabilities))

    def _op_node_models(self, node_id: str, models: list[str], lanes: int, capabilities: list[str] | None = None) -> Op:
        key = f"{self.p}node:{node_id}"
        if (yield _call("exists", key)):
            changed: dict[str, Any] = {"models": json.dumps(list(models)), "lanes": lanes}
            if capabilities is not None:
                changed["caps"] = json.dumps(list(capabilities))
            yield _call("hset", key, mapping=changed)
            yield _call("publish", self.lanes_channel, "models")

    def node_tokenizers(self, node_id: str, tokenizers: dict[str, str]) -> None:
        """The tokenizer of each model the node serves (its fingerprint), as it reported them."""
        self._run(self._op_node_tokenizers(node_id, tokenizers))

    def _op_node_tokenizers(self, node_id: str, tokenizers: dict[str, str]) -> Op:
        key = f"{self.p}node:{node_id}"
        if (yield _call("exists", key)):
            yield _call("hset", key, "tok", json.dumps(tokenizers))

    def node_alive(self, node_id: str) -> None:
        """Heartbeat: a node whose head process died drops out of placement after node_ttl_s."""
        self._run(self._op_node_alive(node_id))

    def _op_node_alive(self, node_id: str) -> Op:
        yield _pipe(lambda pipe: (pipe.expire(f"{self.p}node:{node_id}", self.node_ttl_s),
                                  pipe.expire(f"{self.p}links:{node_id}", self.node_ttl_s)))

    def node_beat(self, node_id: str, *, prefill_tps: float, decode_slowdown_ms: float, schedulable: bool) -> None:
        """A link's heartbeat: alive, what its engine measured, whether it takes work; one round trip."""
        self._run(self._op_node_beat(node_id, prefill_tps=prefill_tps, decode_slowdown_ms=decode_slowdown_ms,
                                     schedulable=schedulable))

    def _op_node_beat(self, node_id: str, *, prefill_tps: float, decode_slowdown_ms: float, schedulable: bool) -> Op:
        yield _script("node_beat", [self.p, node_id, self.node_ttl_s, float(prefill_tps), float(decode_slowdown_ms),
                                    int(schedulable)])

    def node_down(self, node_id: str, head: str = "") -> int:
        """Head process `head`'s link to the node is gone; the links left. At none, as in process: the slot goes,
        what the node held stays until it registers with its cache cleared."""
        return self._run(self._op_node_down(node_id, head))

    def _op_node_down(self, node_id: str, head: str = "") -> Op:
        return int((yield _script("node_down", [self.p, node_id, head])))

    def links_of(self, node_id: str) -> dict[str, float]:
        """The head processes holding a link to the node: their link URLs, and since when (epoch seconds)."""
        links = self.r.hgetall(f"{self.p}links:{node_id}")
        urls = self.r.hmget(f"{self.p}head_urls", list(links)) if links else []
        return {url or head: float(since) for (head, since), url in zip(links.items(), urls, strict=True)}

    def head_beat(self, head: str, url: str, ttl_s: float) -> list[str]:
        """Head process `head` (reached at `url`) is alive for `ttl_s` more; reaps the dead ones (the lanes they
        held, their links). Returns the live head processes' link URLs."""
        return sorted(set(self._scripts["head_beat"](args=[self.p, head, url, f"{time.time():.3f}", ttl_s])))

    def head_expiry(self, head: str) -> float | None:
        """When head process `head` is dead unless it beats again (epoch seconds); None: it is not alive (reaped,
        or never beat)."""
        score = self.r.zscore(f"{self.p}heads", head)
        return float(score) if score is not None else None

    def set_schedulable(self, node_id: str, schedulable: bool) -> None:
        self._run(self._op_set_schedulable(node_id, schedulable))

    def _op_set_schedulable(self, node_id: str, schedulable: bool) -> Op:
        key = f"{self.p}node:{node_id}"
        now = yield _call("hget", key, "schedulable")
        if now is not None and now != str(int(schedulable)):  # each link's heartbeat sets it: told only on a change
            yield _pipe(lambda pipe: (pipe.hset(key, "schedulable", int(schedulable)),
                                      pipe.publish(self.lanes_channel, "schedulable")))

    def nodes(self) -> list[NodeSlot]:
        return self._run(self._op_nodes())

    def _op_nodes(self) -> Op:
        return _slots(json.loads((yield _script("nodes", [self.p]))))

    def measured(self, node_id: str, *, prefill_tps: float, decode_slowdown_ms: float) -> None:
        self._run(self._op_measured(node_id, prefill_tps=prefill_tps, decode_slowdown_ms=decode_slowdown_ms))

    def _op_measured(self, node_id: str, *, prefill_tps: float, decode_slowdown_ms: float) -> Op:
        key = f"{self.p}node:{node_id}"
        if (yield _call("exists", key)):
            yield _call("hset", key, mapping={"ptps": prefill_tps, "dslow": decode_slowdown_ms})

    def load_of(self, slot: NodeSlot) -> int:
        return slot.learned_load_tokens if self.load_tokens is None else self.load_tokens

    def models(self) -> list[str]:
        return self._run(self._op_models())

    def _op_models(self) -> Op:
        return sorted({m for s in (yield from self._op_nodes()) for m in s.models})

    def free_lanes(self, model: str) -> int:
        return self._run(self._op_free_lanes(model))

    def _op_free_lanes(self, model: str) -> Op:
        return sum(s.free for s in (yield from self._op_nodes()) if model in s.models and s.schedulable)

    # --- placing ---
    def choose(self, model: str, keys: list[PrefixKey], *, exclude: set[str] = frozenset(), gen_id: str = "",
               only: set[str] | None = None, head: str = "") -> Choice | None:
        """`only`: the nodes head process `head` holds links to (None: every node)."""
        return self._run(self._op_choose(model, keys, exclude=exclude, gen_id=gen_id, only=only, head=head))[0]

    def _op_choose(self, model: str, keys: list[PrefixKey], *, exclude: set[str] = frozenset(), gen_id: str = "",
                   only: set[str] | None = None, head: str = "") -> Op:
        """(the choice or None, every node's slot as the choice left it): one round trip."""
        fixed = "" if self.load_tokens is None else self.load_tokens
        if only is None:
            only = set((yield _call("smembers", f"{self.p}nodes")))
        args = [self.p, model, fixed, gen_id, head, len(keys), *[k.key for k in keys], *[k.tokens for k in keys],
                len(only), *only, *exclude]
        got = json.loads((yield _script("choose", args)))
        return (_choice(got["choice"]) if got.get("choice") else None), _slots(got["nodes"])

    def release(self, node_id: str, gen_id: str = "") -> None:
        """Free the lane `gen_id` held; once only, so the link and the dispatcher may both report its end."""
        self._run(self._op_release(node_id, gen_id))

    def _op_release(self, node_id: str, gen_id: str = "") -> Op:
        yield _script("release", [self.p, node_id, gen_id])

    def finish(self, node_id: str, gen_id: str, keys: list[PrefixKey], *, completion_tokens: int = 0,
               evicted: list[str] | tuple[str, ...] = ()) -> None:
        """A generation done: record, evict and release in one round trip."""
        self._run(self._op_finish(node_id, gen_id, keys, completion_tokens=completion_tokens, evicted=evicted))

    def _op_finish(self, node_id: str, gen_id: str, keys: list[PrefixKey], *, completion_tokens: int = 0,
                   evicted: list[str] | tuple[str, ...] = ()) -> Op:
        yield _script("finish", [self.p, node_id, gen_id, max(int(completion_tokens), 0), self.max_keys, KEY_TTL_S,
                                 len(keys), *[k.key for k in keys], *evicted])

    # --- the prefix index ---
    def record(self, node_id: str, gen_id: str, keys: list[PrefixKey], *, completion_tokens: int = 0) -> None:
        self._run(self._op_record(node_id, gen_id, keys, completion_tokens=completion_tokens))

    def _op_record(self, node_id: str, gen_id: str, keys: list[PrefixKey], *, completion_tokens: int = 0) -> Op:
        yield _script("record", [self.p, node_id, gen_id, max(int(completion_tokens), 0), self.max_keys, KEY_TTL_S,
                                 *[k.key for k in keys]])

    def evict(self, node_id: str, gen_ids: list[str]) -> None:
        self._run(self._op_evict(node_id, gen_ids))

    def _op_evict(self, node_id: str, gen_ids: list[str]) -> Op:
        if gen_ids:
            yield _script("evict", [self.p, node_id, *gen_ids])

    def forget_node(self, node_id: str, keep: list[str] | tuple[str, ...] = ()) -> None:
        """Forget what the node holds, except what the generations in `keep` put there."""
        self._run(self._op_forget_node(node_id, keep))

    def _op_forget_node(self, node_id: str, keep: list[str] | tuple[str, ...] = ()) -> Op:
        kept = yield _pipe(lambda pipe: [pipe.lrange(f"{self.p}gen:{node_id}:{g}", 0, -1) for g in keep])
        counts: dict[str, int] = {}
        for keys in kept:
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
        held = yield _call("smembers", f"{self.p}nk:{node_id}")
        yield _pipe(lambda pipe: self._forget_keys(pipe, node_id, held, counts))
        stale = [k for k in (yield from self._op_scan(f"{self.p}gen:{node_id}:*")) if k.rsplit(":", 1)[1] not in keep]
        if stale:
            yield _call("delete", *stale)

    def _forget_keys(self, pipe, node_id: str, held: set[str], counts: dict[str, int]) -> None:
        for key in held:
            if key in counts:
                pipe.hset(f"{self.p}k:{key}", node_id, counts[key])
            else:
                pipe.hdel(f"{self.p}k:{key}", node_id)
        pipe.delete(f"{self.p}nk:{node_id}")
        if counts:
            pipe.sadd(f"{self.p}nk:{node_id}", *counts)

    def _op_scan(self, pattern: str) -> Op:
        found, cursor = [], 0
        while True:
            cursor, batch = yield _call("scan", cursor, match=pattern, count=1000)
            found.extend(batch)
            if not cursor:
                return found

    def holders(self, key: str) -> set[str]:
        return set(self.r.hkeys(f"{self.p}k:{key}"))

    def index_size(self) -> int:
        return int(self.r.zcard(f"{self.p}lru"))

    def clear(self) -> None:
        """Tests and `manage.py` maintenance: drop every placement key."""
        for key in self.r.scan_iter(f"{self.p}*"):
            self.r.delete(key)


class AsyncRedisPlacement:
    """The state's operations as coroutines on redis.asyncio (for the event loop), and the lanes channel."""

    OPS = ("node_up", "node_models", "node_tokenizers", "node_alive", "node_beat", "node_down", "set_schedulable",
           "measured", "release", "record", "evict", "finish", "forget_node")

    def __init__(self, state: RedisPlacementState) -> None:
        self.state = state
        # This process's snapshot of every node's slot: refreshed by each choice (the same round trip), patched by
        # each lane freed anywhere (the lanes channel says how many run there now), read again past SNAPSHOT_S (or
        # SNAPSHOT_HEARD_S while the lanes channel is heard) or
        # when a node joined, left or changed. What waiting, the model list and the context windows read, so a
        # generation costs no Redis round trip beyond its choice and its end.
        self._snapshot: list[NodeSlot] | None = None
        self._snapshot_at = 0.0
        self._listening = False

    async def nodes(self, fresh: bool = False) -> list[NodeSlot]:
        """Every node's slot (read-only: shared by this process's callers)."""
        age = SNAPSHOT_HEARD_S if self._listening else SNAPSHOT_S
        if fresh or self._snapshot is None or time.monotonic() - self._snapshot_at > age:
            self._keep(await self.state._arun(self.state._op_nodes()))
        return self._snapshot

    def _keep(self, slots: list[NodeSlot]) -> None:
        self._snapshot, self._snapshot_at = slots, time.monotonic()

    async def models(self) -> list[str]:
        return sorted({m for s in await self.nodes() for m in s.models})

    async def free_lanes(self, model: str) -> int:
        return sum(s.free for s in await self.nodes() if model in s.models and s.schedulable)

    async def holders(self, key: str) -> set[str]:
        r, _ = self.state._async_client()
        return set(await r.hkeys(f"{self.state.p}k:{key}"))

    async def choose(self, model: str, keys: list[PrefixKey], **kwargs: Any) -> Choice | None:
        choice, slots = await self.state._arun(self.state._op_choose(model, keys, **kwargs))
        self._keep(slots)
        return choice

    def _heard(self, data: str) -> None:
        """A lanes-channel message: a lane freed patches the snapshot; anything else (a node joined, left, changed)
        has it read again at its next use."""
        kind, _, rest = str(data).partition(" ")
        node_id, _, running = rest.partition(" ")
        if kind == "freed" and running.lstrip("-").isdigit() and self._snapshot is not None:
            for slot in self._snapshot:
                if slot.node_id == node_id:
                    slot.running = int(running)
            return
        self._snapshot = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in self.OPS:
            raise AttributeError(name)
        op = getattr(self.state, f"_op_{name}")

        async def run(*args: Any, **kwargs: Any) -> Any:
            return await self.state._arun(op(*args, **kwargs))

        return run

    def load_of(self, slot: NodeSlot) -> int:
        return self.state.load_of(slot)

    async def listen(self, wake: Callable[[], None]) -> None:
        """Call `wake` whenever any head process frees a lane or a node joins (runs until cancelled)."""
        r, _ = self.state._async_client()
        pubsub = r.pubsub()
        await pubsub.subscribe(self.state.lanes_channel)
        self._snapshot = None  # what it missed before listening
        self._listening = True
        try:
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    self._heard(message.get("data", ""))
                    wake()
        finally:
            self._listening = False
            self._snapshot = None  # what it misses until it listens again
            await pubsub.aclose()
