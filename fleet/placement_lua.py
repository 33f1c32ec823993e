"""The Lua scripts of the Redis placement state (fleet/placement_redis.py): the steps that must be atomic across
head processes (taking a node's last free lane, freeing a lane once, forgetting evicted generations' keys)."""

KEY_TTL_S = 24 * 3600

# A node's placed generations are a hash `run:<node>`: gen_id -> the head process that placed it, so the lanes a
# head process held are freed when it dies (HEAD_BEAT). Its links are a hash `links:<node>`: head process id -> since.

# KEYS: none (names are built from the prefix). ARGV: prefix, model, load_tokens ('' for each node's learned load),
# gen_id, head process id, n_keys, key..., the prompt tokens covered up to each key..., n_only, the node ids this
# process links (placed only there)..., then excluded node ids. Returns a JSON object: `nodes`, every node's slot
# (what the head's snapshot of the fleet is refreshed from: the same round trip), and `choice` with the runner-up,
# or no choice. A choice also marks the keys most recently used (the LRU's clock).
CHOOSE = """
local p, model, fixed_load, gen, head = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local n = tonumber(ARGV[6])
local keys, tokens, only, excluded = {}, {}, {}, {}
for i = 1, n do keys[i] = ARGV[6 + i]; tokens[i] = tonumber(ARGV[6 + n + i]) end
local n_only = tonumber(ARGV[7 + 2 * n])
for i = 8 + 2 * n, 7 + 2 * n + n_only do only[ARGV[i]] = true end
for i = 8 + 2 * n + n_only, #ARGV do excluded[ARGV[i]] = true end
local candidates, nodes = {}, {}
for _, id in ipairs(redis.call('SMEMBERS', p .. 'nodes')) do
  local h = redis.call('HGETALL', p .. 'node:' .. id)
  if #h == 0 then
    redis.call('SREM', p .. 'nodes', id)
  else
    table.insert(nodes, {id, h})
    local s = {}
    for i = 1, #h, 2 do s[h[i]] = h[i + 1] end
    local serves = false
    for _, m in ipairs(cjson.decode(s.models)) do if m == model then serves = true end end
    if serves and s.schedulable == '1' and tonumber(s.running) < tonumber(s.lanes) and not excluded[id]
       and only[id] then
      s.id = id
      table.insert(candidates, s)
    end
  end
end
if #candidates == 0 then return cjson.encode({nodes = nodes}) end
local total = n > 0 and tokens[n] or 0
local scored = {}
for _, s in ipairs(candidates) do
  local matched = 0
  for i = 1, n do
    if redis.call('HEXISTS', p .. 'k:' .. keys[i], s.id) == 0 then break end
    matched = tokens[i]
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
if n > 0 then  -- the prompt's keys were just used: most recent in the index's LRU order (those it still holds)
  local last = redis.call('INCRBY', p .. 'lru:clock', n)
  for i = 1, n do redis.call('ZADD', p .. 'lru', 'XX', last - n + i, keys[i]) end
end
if gen == '' or redis.call('HSETNX', p .. 'run:' .. best[5], gen, head) == 1 then
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
for _, pair in ipairs(nodes) do  -- the snapshot shows the lane just taken
  if pair[1] == best[5] then
    for i = 1, #pair[2], 2 do
      if pair[2][i] == 'running' then pair[2][i + 1] = redis.call('HGET', p .. 'node:' .. best[5], 'running') end
    end
  end
end
return cjson.encode({choice = out, nodes = nodes})
"""

# Every node's slot in one round trip: a JSON list of [node id, its hash as a flat list].
NODES = """
local p, nodes = ARGV[1], {}
for _, id in ipairs(redis.call('SMEMBERS', p .. 'nodes')) do
  local h = redis.call('HGETALL', p .. 'node:' .. id)
  if #h > 0 then table.insert(nodes, {id, h}) end
end
return cjson.encode(nodes)
"""

# The steps a generation's end takes, as Lua functions, so one script runs them all in one round trip (FINISH).
# A key's hash holds, per node, how many generations there hold it; eviction counts down and drops at zero.
EVICT_FN = """
local function evict(p, node, gens)
  for _, g in ipairs(gens) do
    local gen_key = p .. 'gen:' .. node .. ':' .. g
    for _, key in ipairs(redis.call('LRANGE', gen_key, 0, -1)) do
      local left = redis.call('HINCRBY', p .. 'k:' .. key, node, -1)
      if left <= 0 then redis.call('HDEL', p .. 'k:' .. key, node) end
    end
    redis.call('DEL', gen_key)
  end
end
"""

# A generation done on a node: the node's mean answer length learns its answer (as nodes.link.placement.
# learn_answer_tokens), and the node holds these keys (a count per key and node, the generation's list for its
# eviction, the node's set, the LRU order), once per generation; then the index is trimmed to its size.
RECORD_FN = """
local function record(p, node, gen, completion, max_keys, ttl, keys)
  local node_key = p .. 'node:' .. node
  if redis.call('EXISTS', node_key) == 0 then return 0 end
  if completion > 0 then
    local old = tonumber(redis.call('HGET', node_key, 'ans') or '0') or 0
    local ans = completion
    if old > 0 then ans = 0.8 * old + 0.2 * completion end
    redis.call('HSET', node_key, 'ans', string.format('%.17g', ans))
  end
  local n = #keys
  if n == 0 then return 1 end
  local gen_key = p .. 'gen:' .. node .. ':' .. gen
  if redis.call('EXISTS', gen_key) == 1 then return 1 end  -- recorded already: twice would outlive its eviction
  local last = redis.call('INCRBY', p .. 'lru:clock', n)
  for i = 1, n do
    local key = keys[i]
    redis.call('HINCRBY', p .. 'k:' .. key, node, 1)
    redis.call('EXPIRE', p .. 'k:' .. key, ttl)
    redis.call('ZADD', p .. 'lru', last - n + i, key)
    redis.call('SADD', p .. 'nk:' .. node, key)
    redis.call('RPUSH', gen_key, key)
  end
  redis.call('EXPIRE', gen_key, ttl)
  local excess = redis.call('ZCARD', p .. 'lru') - max_keys
  if excess > 0 then
    local popped = redis.call('ZPOPMIN', p .. 'lru', excess)
    for i = 1, #popped, 2 do redis.call('DEL', p .. 'k:' .. popped[i]) end
  end
  return 1
end
"""

# A lane is freed once (gen '' frees one unconditionally), and every head process's waiters hear of it:
# "freed <node> <running>", so each process's snapshot of the fleet follows without reading it again.
RELEASE_FN = """
local function release(p, node, gen)
  local key = p .. 'node:' .. node
  if gen ~= '' and redis.call('HDEL', p .. 'run:' .. node, gen) == 0 then return 0 end
  local running = tonumber(redis.call('HGET', key, 'running') or '0') or 0
  if redis.call('EXISTS', key) == 1 and running > 0 then
    running = redis.call('HINCRBY', key, 'running', -1)
  end
  redis.call('PUBLISH', p .. 'lanes', 'freed ' .. node .. ' ' .. running)
  return 1
end
"""

# ARGV: prefix, node id, evicted gen_id...
EVICT = EVICT_FN + """
local gens = {}
for i = 3, #ARGV do gens[#gens + 1] = ARGV[i] end
evict(ARGV[1], ARGV[2], gens)
return 1
"""

# ARGV: prefix, node id, gen_id, completion tokens, the index's most keys, the keys' TTL in s, key... Returns 0 when
# the node is not in placement.
RECORD = RECORD_FN + """
local keys = {}
for i = 7, #ARGV do keys[#keys + 1] = ARGV[i] end
return record(ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), keys)
"""

# ARGV: prefix, node id, gen_id ('' for none).
RELEASE = RELEASE_FN + """
return release(ARGV[1], ARGV[2], ARGV[3])
"""

# A generation's end in one round trip: record what the node now holds, forget what it evicted, free the lane.
# ARGV: prefix, node id, gen_id, completion tokens, the index's most keys, the keys' TTL in s, n_keys, key...,
# then evicted gen_id...
FINISH = EVICT_FN + RECORD_FN + RELEASE_FN + """
local p, node, gen = ARGV[1], ARGV[2], ARGV[3]
local n = tonumber(ARGV[7])
local keys, gens = {}, {}
for i = 8, 7 + n do keys[#keys + 1] = ARGV[i] end
for i = 8 + n, #ARGV do gens[#gens + 1] = ARGV[i] end
record(p, node, gen, tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), keys)
evict(p, node, gens)
return release(p, node, gen)
"""

# A node's link from a head process is gone. ARGV: prefix, node id, head process id. Returns the links left; at none
# the node leaves placement (what it held stays in the index, as in process).
NODE_DOWN = """
local p, node, head = ARGV[1], ARGV[2], ARGV[3]
redis.call('HDEL', p .. 'links:' .. node, head)
local left = redis.call('HLEN', p .. 'links:' .. node)
if left == 0 then
  redis.call('SREM', p .. 'nodes', node)
  redis.call('DEL', p .. 'node:' .. node, p .. 'run:' .. node)
  redis.call('PUBLISH', p .. 'lanes', 'left')
end
return left
"""

# A head process's heartbeat. ARGV: prefix, its id, its link URL, now (s), TTL (s). Renews it, then reaps every head
# process whose heartbeats stopped: the lanes it held are freed and its links dropped (a node left with none leaves
# placement). Returns the live head processes' link URLs.
HEAD_BEAT = """
local p, me, url, now, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('ZADD', p .. 'heads', now + ttl, me)
redis.call('HSET', p .. 'head_urls', me, url)
local dead = redis.call('ZRANGEBYSCORE', p .. 'heads', '-inf', now)
if #dead > 0 then
  local gone = {}
  for _, h in ipairs(dead) do gone[h] = true end
  for _, id in ipairs(redis.call('SMEMBERS', p .. 'nodes')) do
    local run = redis.call('HGETALL', p .. 'run:' .. id)
    for i = 1, #run, 2 do
      if gone[run[i + 1]] then
        redis.call('HDEL', p .. 'run:' .. id, run[i])
        if tonumber(redis.call('HGET', p .. 'node:' .. id, 'running') or '0') > 0 then
          redis.call('HINCRBY', p .. 'node:' .. id, 'running', -1)
        end
      end
    end
    for _, h in ipairs(dead) do redis.call('HDEL', p .. 'links:' .. id, h) end
    if redis.call('HLEN', p .. 'links:' .. id) == 0 then
      redis.call('SREM', p .. 'nodes', id)
      redis.call('DEL', p .. 'node:' .. id, p .. 'run:' .. id)
    end
  end
  for _, h in ipairs(dead) do
    redis.call('ZREM', p .. 'heads', h)
    redis.call('HDEL', p .. 'head_urls', h)
  end
  redis.call('PUBLISH', p .. 'lanes', 'reaped')
end
local urls = {}
for _, h in ipairs(redis.call('ZRANGE', p .. 'heads', 0, -1)) do
  local u = redis.call('HGET', p .. 'head_urls', h)
  if u then urls[#urls + 1] = u end
end
return urls
"""

# A link's heartbeat in one round trip. ARGV: prefix, node id, TTL (s), prefill tokens/s, decode slowdown (ms),
# schedulable ('1' or '0'). Keeps the node (and its links) alive, stores what its engine measured, and tells every
# head process when it became schedulable or not (each link's heartbeat sets it: told only on a change).
NODE_BEAT = """
local p, node, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local key = p .. 'node:' .. node
if redis.call('EXISTS', key) == 0 then return 0 end
redis.call('EXPIRE', key, ttl)
redis.call('EXPIRE', p .. 'links:' .. node, ttl)
redis.call('HSET', key, 'ptps', ARGV[4], 'dslow', ARGV[5])
if redis.call('HGET', key, 'schedulable') ~= ARGV[6] then
  redis.call('HSET', key, 'schedulable', ARGV[6])
  redis.call('PUBLISH', p .. 'lanes', 'schedulable')
end
return 1
"""

SCRIPTS = {"choose": CHOOSE, "node_beat": NODE_BEAT, "nodes": NODES, "release": RELEASE, "evict": EVICT,
           "record": RECORD, "finish": FINISH, "node_down": NODE_DOWN, "head_beat": HEAD_BEAT}
