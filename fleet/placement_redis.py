"""The placement state in Redis, so several head processes place consistently (used when REDIS_URL is set).

The same interface and the same rule (each node's learned load included) as nodes.link.placement.PlacementState.
`choose` runs as one Lua script, so two heads cannot both take a node's last free lane. Calls are synchronous: each
is one round trip on loopback (well under a millisecond) and happens a few times per generation, never per token.
"""

from __future__ import annotations

import json

import redis

from nodes.link.placement import Choice, NodeSlot, learn_answer_tokens, ranking_row
from nodes.link.prefix import PrefixKey

KEY_TTL_S = 24 * 3600

# KEYS: none (names are built from the prefix). ARGV: prefix, model, load_tokens ('' for each node's learned load),
# gen_id, n_keys, key..., chars..., then excluded node ids. Returns a JSON object with the choice and the runner-up,
# or nil.
CHOOSE = """
local p, model, fixed_load, gen = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local n = tonumber(ARGV[5])
local keys, chars, excluded = {}, {}, {}
for i = 1, n do keys[i] = ARGV[5 + i]; chars[i] = tonumber(ARGV[5 + n + i]) end
for i = 6 + 2 * n, #ARGV do excluded[ARGV[i]] = true end
local candidates, cpt_sum = {}, 0
for _, id in ipairs(redis.call('SMEMBERS', p .. 'nodes')) do
  local h = redis.call('HGETALL', p .. 'node:' .. id)
  if #h == 0 then
    redis.call('SREM', p .. 'nodes', id)
  else
    local s = {}
    for i = 1, #h, 2 do s[h[i]] = h[i + 1] end
    local serves = false
    for _, m in ipairs(cjson.decode(s.models)) do if m == model then serves = true end end
    if serves and s.schedulable == '1' and tonumber(s.running) < tonumber(s.lanes) and not excluded[id] then
      s.id = id
      table.insert(candidates, s)
      cpt_sum = cpt_sum + tonumber(s.cpt)
    end
  end
end
if #candidates == 0 then return nil end
-- One text-to-token ratio for every candidate (their mean), as the in-process state does.
local cpt = cpt_sum / #candidates
local total = n > 0 and math.floor(chars[n] / cpt) or 0
local scored = {}
for _, s in ipairs(candidates) do
  local matched = 0
  for i = 1, n do
    if redis.call('HEXISTS', p .. 'k:' .. keys[i], s.id) == 0 then break end
    matched = math.floor(chars[i] / cpt)
  end
  local running = tonumber(s.running)
  -- as nodes.link.placement.learned_load_tokens
  local load = fixed_load or math.floor(tonumber(s.ptps or 0) * tonumber(s.dslow or 0) / 1000 * tonumber(s.ans or 0)
                                        / 2 + 0.5)
  local cost = math.max(total - matched, 0) + load * running
  table.insert(scored, {cost, running, tonumber(s.routed), s.identity, s.id, matched, load})
end
table.sort(scored, function(a, b)
  for i = 1, 4 do if a[i] ~= b[i] then return a[i] < b[i] end end
  return false
end)
local best = scored[1]
if gen == '' or redis.call('SADD', p .. 'run:' .. best[5], gen) == 1 then
  redis.call('HINCRBY', p .. 'node:' .. best[5], 'running', 1)
end
redis.call('EXPIRE', p .. 'run:' .. best[5], 86400)
redis.call('HINCRBY', p .. 'node:' .. best[5], 'routed', 1)
local out = {node_id = best[5], identity = best[4], cost = best[1], matched = best[6], total = total,
             candidates = #scored}
if #scored > 1 then
  out.runner_up = {node = scored[2][4], cost = scored[2][1], matched_tokens = scored[2][6]}
end
out.ranking = {}
for i, r in ipairs(scored) do out.ranking[i] = {r[4], r[5], r[6], r[2], r[7]} end
return cjson.encode(out)
"""

# A key's hash holds, per node, how many generations there hold it; eviction counts down and drops at zero.
EVICT = """
local p, node = ARGV[1], ARGV[2]
for i = 3, #ARGV do
  local gen_key = p .. 'gen:' .. node .. ':' .. ARGV[i]
  for _, key in ipairs(redis.call('LRANGE', gen_key, 0, -1)) do
    local left = redis.call('HINCRBY', p .. 'k:' .. key, node, -1)
    if left <= 0 then redis.call('HDEL', p .. 'k:' .. key, node) end
  end
  redis.call('DEL', gen_key)
end
return 1
"""

# ARGV: the node's key, its set of placed generations, the generation ('' for none): a lane is freed once.
RELEASE = """
local key, gen = ARGV[1], ARGV[3]
if gen ~= '' and redis.call('SREM', ARGV[2], gen) == 0 then return 0 end
if redis.call('EXISTS', key) == 1 and tonumber(redis.call('HGET', key, 'running')) > 0 then
  redis.call('HINCRBY', key, 'running', -1)
end
return 1
"""


class RedisPlacementState:
    """Placement state shared by every head process through Redis."""

    def __init__(self, url: str, *, prefix: str = "fleet:", load_tokens: int | None = None, max_keys: int = 200_000,
                 node_ttl_s: int = 60):
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.p = f"{prefix}pl:"
        self.load_tokens, self.max_keys, self.node_ttl_s = load_tokens, max_keys, node_ttl_s
        self._choose = self.r.register_script(CHOOSE)
        self._release = self.r.register_script(RELEASE)
        self._evict = self.r.register_script(EVICT)

    # --- nodes ---
    def node_up(self, slot: NodeSlot, *, cache_cleared: bool = True, channel: str = "",
                warm: list[str] | tuple[str, ...] = ()) -> None:
        key = f"{self.p}node:{slot.node_id}"
        routed = self.r.hget(key, "routed")
        if routed is not None and not cache_cleared:
            slot.routed = int(routed)
        pipe = self.r.pipeline()
        pipe.hset(key, mapping={
            "identity": slot.identity, "models": json.dumps(slot.models), "lanes": slot.lanes, "running": slot.running,
            "routed": slot.routed, "schedulable": int(slot.schedulable), "cpt": slot.chars_per_token,
            "ctx": slot.context_window, "channel": channel, "caps": json.dumps(slot.capabilities),
            "ptps": slot.prefill_tps, "dslow": slot.decode_slowdown_ms, "ans": slot.answer_tokens,
        })
        pipe.delete(f"{self.p}run:{slot.node_id}")
        pipe.expire(key, self.node_ttl_s)
        pipe.sadd(f"{self.p}nodes", slot.node_id)
        pipe.execute()
        if cache_cleared:
            self.forget_node(slot.node_id, keep=warm)

    def node_models(self, node_id: str, models: list[str], lanes: int) -> None:
        """A node loaded or unloaded a model: it serves these from now on, with this many lanes (running ones stay)."""
        key = f"{self.p}node:{node_id}"
        if self.r.exists(key):
            self.r.hset(key, mapping={"models": json.dumps(list(models)), "lanes": lanes})

    def node_alive(self, node_id: str) -> None:
        """Heartbeat: a node whose head process died drops out of placement after node_ttl_s."""
        self.r.expire(f"{self.p}node:{node_id}", self.node_ttl_s)

    def node_down(self, node_id: str) -> None:
        """As in process: the slot goes, what the node held stays until it registers with its cache cleared."""
        self.r.srem(f"{self.p}nodes", node_id)
        self.r.delete(f"{self.p}node:{node_id}")

    def set_schedulable(self, node_id: str, schedulable: bool) -> None:
        key = f"{self.p}node:{node_id}"
        if self.r.exists(key):
            self.r.hset(key, "schedulable", int(schedulable))

    def nodes(self) -> list[NodeSlot]:
        ids = sorted(self.r.smembers(f"{self.p}nodes"))
        pipe = self.r.pipeline()
        for node_id in ids:
            pipe.hgetall(f"{self.p}node:{node_id}")
        slots = []
        for node_id, h in zip(ids, pipe.execute(), strict=True):
            if h:
                slots.append(NodeSlot(node_id, h["identity"], json.loads(h["models"]), int(h["lanes"]),
                                      int(h.get("ctx", 0)), int(h["running"]), int(h["routed"]),
                                      h["schedulable"] == "1", float(h["cpt"]), json.loads(h.get("caps", "[]")),
                                      float(h.get("ptps", 0)), float(h.get("dslow", 0)), float(h.get("ans", 0))))
        return slots

    def measured(self, node_id: str, *, prefill_tps: float, decode_slowdown_ms: float) -> None:
        key = f"{self.p}node:{node_id}"
        if self.r.exists(key):
            self.r.hset(key, mapping={"ptps": prefill_tps, "dslow": decode_slowdown_ms})

    def load_of(self, slot: NodeSlot) -> int:
        return slot.learned_load_tokens if self.load_tokens is None else self.load_tokens

    def channel_of(self, node_id: str) -> str:
        return self.r.hget(f"{self.p}node:{node_id}", "channel") or ""

    def models(self) -> list[str]:
        return sorted({m for s in self.nodes() for m in s.models})

    def free_lanes(self, model: str) -> int:
        return sum(s.free for s in self.nodes() if model in s.models and s.schedulable)

    # --- placing ---
    def choose(self, model: str, keys: list[PrefixKey], *, exclude: set[str] = frozenset(),
               gen_id: str = "") -> Choice | None:
        fixed = "" if self.load_tokens is None else self.load_tokens
        args = [self.p, model, fixed, gen_id, len(keys), *[k.key for k in keys], *[k.chars for k in keys], *exclude]
        raw = self._choose(args=args)
        if raw is None:
            return None
        got = json.loads(raw)
        if keys:
            self.r.zadd(f"{self.p}lru", self._ticks(keys), xx=True)
        total = int(got["total"])
        ranking = [ranking_row(identity, node_id, total=total, matched=int(matched), running=int(running),
                               load_tokens=int(load)) for identity, node_id, matched, running, load in got["ranking"]]
        return Choice(got["node_id"], got["identity"], int(got["cost"]), int(got["matched"]), total,
                      got.get("runner_up"), int(got["candidates"]), ranking)

    def release(self, node_id: str, gen_id: str = "") -> None:
        """Free the lane `gen_id` held; once only, so the link and the dispatcher may both report its end."""
        self._release(args=[f"{self.p}node:{node_id}", f"{self.p}run:{node_id}", gen_id])

    # --- the prefix index ---
    def record(self, node_id: str, gen_id: str, keys: list[PrefixKey], *, prompt_tokens: int = 0,
               completion_tokens: int = 0) -> None:
        node_key = f"{self.p}node:{node_id}"
        if not self.r.exists(node_key):
            return
        if completion_tokens > 0:
            learned = learn_answer_tokens(float(self.r.hget(node_key, "ans") or 0), completion_tokens)
            self.r.hset(node_key, "ans", learned)
        if not keys:
            return
        if prompt_tokens > 0:
            cpt = float(self.r.hget(node_key, "cpt") or 4.0)
            self.r.hset(node_key, "cpt", 0.8 * cpt + 0.2 * max(keys[-1].chars / prompt_tokens, 1.0))
        gen_key = f"{self.p}gen:{node_id}:{gen_id}"
        if self.r.exists(gen_key):
            return  # recorded already: counting it twice would outlive its eviction
        ticks = self._ticks(keys)
        pipe = self.r.pipeline()
        for k in keys:
            pipe.hincrby(f"{self.p}k:{k.key}", node_id, 1)
            pipe.expire(f"{self.p}k:{k.key}", KEY_TTL_S)
        pipe.zadd(f"{self.p}lru", ticks)
        pipe.sadd(f"{self.p}nk:{node_id}", *[k.key for k in keys])
        pipe.rpush(gen_key, *[k.key for k in keys])
        pipe.expire(gen_key, KEY_TTL_S)
        pipe.execute()
        self._trim()

    def _ticks(self, keys: list[PrefixKey]) -> dict[str, int]:
        """Recency scores from a shared counter: clock time would tie within a call and break the LRU order."""
        last = self.r.incrby(f"{self.p}lru:clock", len(keys))
        return {k.key: last - len(keys) + i + 1 for i, k in enumerate(keys)}

    def _trim(self) -> None:
        excess = self.r.zcard(f"{self.p}lru") - self.max_keys
        if excess > 0:
            popped = self.r.zpopmin(f"{self.p}lru", excess)
            if popped:
                self.r.delete(*[f"{self.p}k:{key}" for key, _ in popped])

    def evict(self, node_id: str, gen_ids: list[str]) -> None:
        if gen_ids:
            self._evict(args=[self.p, node_id, *gen_ids])

    def forget_node(self, node_id: str, keep: list[str] | tuple[str, ...] = ()) -> None:
        """Forget what the node holds, except what the generations in `keep` put there."""
        kept = {g: self.r.lrange(f"{self.p}gen:{node_id}:{g}", 0, -1) for g in keep}
        counts: dict[str, int] = {}
        for keys in kept.values():
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
        held = self.r.smembers(f"{self.p}nk:{node_id}")
        pipe = self.r.pipeline()
        for key in held:
            if key in counts:
                pipe.hset(f"{self.p}k:{key}", node_id, counts[key])
            else:
                pipe.hdel(f"{self.p}k:{key}", node_id)
        pipe.delete(f"{self.p}nk:{node_id}")
        if counts:
            pipe.sadd(f"{self.p}nk:{node_id}", *counts)
        pipe.execute()
        stale = [k for k in self.r.scan_iter(f"{self.p}gen:{node_id}:*") if k.rsplit(":", 1)[1] not in set(keep)]
        if stale:
            self.r.delete(*stale)

    def holders(self, key: str) -> set[str]:
        return set(self.r.hkeys(f"{self.p}k:{key}"))

    def index_size(self) -> int:
        return int(self.r.zcard(f"{self.p}lru"))

    def clear(self) -> None:
        """Tests and `manage.py` maintenance: drop every placement key."""
        for key in self.r.scan_iter(f"{self.p}*"):
            self.r.delete(key)
