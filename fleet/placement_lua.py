"""The Lua scripts of the Redis placement state (fleet/placement_redis.py): the steps that must be atomic across
head processes (taking a node's last free lane, freeing a lane once, forgetting evicted generations' keys)."""

KEY_TTL_S = 24 * 3600

# KEYS: none (names are built from the prefix). ARGV: prefix, model, load_tokens ('' for each node's learned load),
# gen_id, n_keys, key..., the prompt tokens covered up to each key..., then excluded node ids. Returns a JSON object
# with the choice and the runner-up, or nil. A choice also marks the keys most recently used (the LRU's clock).
CHOOSE = """
local p, model, fixed_load, gen = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local n = tonumber(ARGV[5])
local keys, tokens, excluded = {}, {}, {}
for i = 1, n do keys[i] = ARGV[5 + i]; tokens[i] = tonumber(ARGV[5 + n + i]) end
for i = 6 + 2 * n, #ARGV do excluded[ARGV[i]] = true end
local candidates = {}
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
    end
  end
end
if #candidates == 0 then return nil end
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

# A generation done on a node: the node's mean answer length learns its answer (as nodes.link.placement.
# learn_answer_tokens), and the node holds these keys (a count per key and node, the generation's list for its
# eviction, the node's set, the LRU order), once per generation; then the index is trimmed to its size.
# ARGV: prefix, node id, gen_id, completion tokens, the index's most keys, the keys' TTL in s, key... Returns 0 when
# the node is not in placement.
RECORD = """
local p, node, gen = ARGV[1], ARGV[2], ARGV[3]
local completion, max_keys, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local node_key = p .. 'node:' .. node
if redis.call('EXISTS', node_key) == 0 then return 0 end
if completion > 0 then
  local old = tonumber(redis.call('HGET', node_key, 'ans') or '0') or 0
  local ans = completion
  if old > 0 then ans = 0.8 * old + 0.2 * completion end
  redis.call('HSET', node_key, 'ans', string.format('%.17g', ans))
end
local n = #ARGV - 6
if n == 0 then return 1 end
local gen_key = p .. 'gen:' .. node .. ':' .. gen
if redis.call('EXISTS', gen_key) == 1 then return 1 end  -- recorded already: twice would outlive its eviction
local last = redis.call('INCRBY', p .. 'lru:clock', n)
for i = 1, n do
  local key = ARGV[6 + i]
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
"""

# ARGV: the node's key, its set of placed generations, the generation ('' for none), the lanes channel: a lane is
# freed once, and every head process's waiters hear of it.
RELEASE = """
local key, gen = ARGV[1], ARGV[3]
if gen ~= '' and redis.call('SREM', ARGV[2], gen) == 0 then return 0 end
if redis.call('EXISTS', key) == 1 and tonumber(redis.call('HGET', key, 'running')) > 0 then
  redis.call('HINCRBY', key, 'running', -1)
end
redis.call('PUBLISH', ARGV[4], 'freed')
return 1
"""

SCRIPTS = {"choose": CHOOSE, "release": RELEASE, "evict": EVICT, "record": RECORD}
