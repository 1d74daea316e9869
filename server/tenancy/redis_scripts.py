"""The Lua scripts that keep tenants' quotas in Redis: one atomic call per admission, release or
lease renewal, so replicas never interleave a check with another replica's take.

Per tenant, two keys sharing the hash tag `{tenant}` (one Redis Cluster slot):
- `<prefix>{tenant}`, a hash: `rpm` / `rpm_at` and `tpm` / `tpm_at`, each bucket's level and the
  time it was last written (absent: full), and `held`, the sequences of live leases;
- `<prefix>{tenant}:leases`, a sorted set of leases, `<replica>:<serial>:<n>` scored by the time
  they lapse. A replica renews the leases it holds; one that dies stops renewing, and its
  leases lapse and are reaped at the tenant's next admission, so its sequences stop counting.

The buckets are the in-process ones (`quotas.TokenBucket`) written in Lua: a minute's allowance
refilling continuously, taken at admission (n sequences; prompt + n x max_tokens tokens), the
unused tokens given back at release, debt repaid by the refill. Time is Redis' own clock (TIME),
so replicas whose clocks disagree still share one. Each key expires once it carries nothing: the
hash when its buckets are full again and no lease is held, the lease set with its last lease.
Levels are written with 17 significant digits, which round-trip a double exactly.
"""

from __future__ import annotations

# Helpers every script starts with. `level` refills a bucket to now (capacity if absent).
_PRELUDE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state, leases = KEYS[1], KEYS[2]

local function level(name, per_minute)
  local v = redis.call('HMGET', state, name, name .. '_at')
  if not v[1] then return per_minute end
  local refilled = tonumber(v[1]) + (now - tonumber(v[2])) * per_minute / 60
  if refilled > per_minute then return per_minute end
  return refilled
end

local function set_level(name, value)
  redis.call('HSET', state, name, string.format('%.17g', value), name .. '_at',
             string.format('%.17g', now))
end

local function sequences_of(member)
  return tonumber(string.match(member, '(%d+)$'))
end

-- Drop the leases that lapsed (their replica stopped renewing them): their sequences no
-- longer count. Returns the sequences held by the live ones.
local function reap()
  local held = tonumber(redis.call('HGET', state, 'held') or '0')
  local lapsed = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  if #lapsed > 0 then
    for _, member in ipairs(lapsed) do held = held - sequences_of(member) end
    redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
    if held < 0 then held = 0 end
    redis.call('HSET', state, 'held', held)
  end
  return held
end

-- Seconds until the limited buckets are full again.
local function refill_s(rpm, tpm)
  local s = 0
  if rpm > 0 then s = math.max(s, (rpm - level('rpm', rpm)) * 60 / rpm) end
  if tpm > 0 then s = math.max(s, (tpm - level('tpm', tpm)) * 60 / tpm) end
  return s
end

-- Write `held` and the keys' lifetimes: the hash lives while a bucket refills or a lease may
-- still be renewed, the lease set as long as its newest lease.
local function keep(held, rpm, tpm, ttl)
  redis.call('HSET', state, 'held', held)
  local ms = math.ceil(refill_s(rpm, tpm) * 1000) + 1000
  if held > 0 then ms = math.max(ms, ttl * 1000 + 1000) end
  redis.call('PEXPIRE', state, ms)
  if redis.call('ZCARD', leases) > 0 then redis.call('PEXPIRE', leases, ttl * 1000 + 1000) end
end
"""

ACQUIRE = (
    _PRELUDE
    + """
-- ARGV: max_concurrent, requests_per_minute, tokens_per_minute (0: unlimited), n, tokens,
-- lease member, lease ttl (s). Returns {0, '0', held} when admitted (the lease taken), else
-- {reason, wait seconds, held}: 1 max_concurrent, 2 tokens_per_minute, 3 requests_per_minute,
-- checked in that order, as the in-process gate does. The wait is a string: Redis truncates
-- Lua numbers to integers.
local max_concurrent, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n, tokens, member, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])

local held = reap()
-- Taken already: this is a retry of a call whose answer was lost. Take nothing twice.
if redis.call('ZSCORE', leases, member) then return {0, '0', held} end
if max_concurrent > 0 and held + n > max_concurrent then return {1, '1', held} end
local tokens_left, requests_left
if tpm > 0 then
  tokens_left = level('tpm', tpm)
  if tokens_left < tokens then return {2, tostring((tokens - tokens_left) * 60 / tpm), held} end
end
if rpm > 0 then
  requests_left = level('rpm', rpm)
  if requests_left < n then return {3, tostring((n - requests_left) * 60 / rpm), held} end
end

-- A bucket whose limit was lifted is dropped (full, should the limit come back).
if tpm > 0 then set_level('tpm', tokens_left - tokens)
else redis.call('HDEL', state, 'tpm', 'tpm_at') end
if rpm > 0 then set_level('rpm', requests_left - n)
else redis.call('HDEL', state, 'rpm', 'rpm_at') end
held = held + n
redis.call('ZADD', leases, now + ttl, member)
keep(held, rpm, tpm, ttl)
return {0, '0', held}
"""
)

RELEASE = (
    _PRELUDE
    + """
-- ARGV: lease member, requests_per_minute, requests given back, tokens_per_minute, tokens given
-- back (negative: charged), lease ttl (s). Acts only if the lease is still held, so a release
-- sent twice, or for a lease whose acquire never ran, changes nothing. Returns 1 if it acted.
local member, rpm, requests_back = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local tpm, tokens_back, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])

if redis.call('ZREM', leases, member) == 0 then return 0 end
local held = tonumber(redis.call('HGET', state, 'held') or '0') - sequences_of(member)
if held < 0 then held = 0 end
if tpm > 0 and tokens_back ~= 0 then
  set_level('tpm', math.min(tpm, level('tpm', tpm) + tokens_back))
end
if rpm > 0 and requests_back ~= 0 then
  set_level('rpm', math.min(rpm, level('rpm', rpm) + requests_back))
end
keep(held, rpm, tpm, ttl)
return 1
"""
)

RENEW = (
    _PRELUDE
    + """
-- ARGV: lease ttl (s), then the members this replica holds for the tenant. Each lapses ttl from
-- now. A lease that is gone (lapsed while this replica could not reach Redis, or Redis restarted
-- empty) is taken again, so the sequences still running count again. Returns the held count.
local ttl = tonumber(ARGV[1])
local held = reap()
for i = 2, #ARGV do
  if not redis.call('ZSCORE', leases, ARGV[i]) then held = held + sequences_of(ARGV[i]) end
  redis.call('ZADD', leases, now + ttl, ARGV[i])
end
redis.call('HSET', state, 'held', held)
redis.call('PEXPIRE', state, math.max(redis.call('PTTL', state), ttl * 1000 + 1000))
redis.call('PEXPIRE', leases, ttl * 1000 + 1000)
return held
"""
)
