"""The shared store's server-side functions (Valkey / Redis 7+ function libraries, loaded by ValkeyStore at every
(re)connection): each admission, settlement, booking and budget swap runs as one atomic call on the store."""

LIBRARY = r"""#!lua name=tandem

local function admit(keys, args)
  -- keys: spend of the period, holds, requests of the minute, tokens of the minute
  local id, now = args[1], tonumber(args[2])
  local reserve, cap = tonumber(args[4]), tonumber(args[5])
  local rpm, tpm, streams_max = tonumber(args[6]), tonumber(args[7]), tonumber(args[8])
  local spent = tonumber(redis.call('GET', keys[1]) or '0')
  local reserved, streams = 0, 0
  local holds = redis.call('HGETALL', keys[2])
  for i = 1, #holds, 2 do
    local micro, expiry = string.match(holds[i + 1], '^(%d+):([%d.]+)$')
    if tonumber(expiry) < now then
      redis.call('HDEL', keys[2], holds[i])
    else
      reserved = reserved + tonumber(micro)
      streams = streams + 1
    end
  end
  local requests = tonumber(redis.call('GET', keys[3]) or '0')
  local tokens = tonumber(redis.call('GET', keys[4]) or '0')
  local status = 'ok'
  if rpm >= 0 and requests >= rpm then status = 'rpm'
  elseif tpm >= 0 and tokens >= tpm then status = 'tpm'
  elseif streams_max >= 0 and streams >= streams_max then status = 'streams'
  elseif cap >= 0 and spent + reserved + reserve > cap then
    if args[9] == '1' then status = 'device' else status = 'cap' end
  end
  if status == 'ok' or status == 'device' then
    if status == 'device' then reserve = 0 end
    redis.call('HSET', keys[2], id, reserve .. ':' .. args[3])
    redis.call('EXPIRE', keys[2], args[10])
    requests = redis.call('INCR', keys[3])
    redis.call('EXPIRE', keys[3], 120)
    reserved = reserved + reserve
    streams = streams + 1
  end
  return {status, spent, reserved, requests, tokens, streams}
end

local function settle(keys, args)
  -- keys: spend of the period, holds, tokens of the minute; args: id, micro-dollars, tokens, the spend's TTL
  redis.call('HDEL', keys[2], args[1])
  local spent = redis.call('INCRBY', keys[1], args[2])
  redis.call('EXPIRE', keys[1], args[4])
  redis.call('INCRBY', keys[3], args[3])
  redis.call('EXPIRE', keys[3], 120)
  return spent
end

local function book(keys, args)
  -- keys: spend hash, window entries, window order, window sums
  -- args: request, endpoint, new request, new for endpoint, prefill, decode, micro-dollars, input, constrained, N
  local e = args[2] .. '.'
  if args[3] == '1' then redis.call('HINCRBY', keys[1], 'requests', 1) end
  if args[4] == '1' then redis.call('HINCRBY', keys[1], e .. 'requests', 1) end
  redis.call('HINCRBY', keys[1], e .. 'prefill_tokens', args[5])
  redis.call('HINCRBY', keys[1], e .. 'decode_tokens', args[6])
  redis.call('HINCRBY', keys[1], e .. 'cost_micro', args[7])
  redis.call('HINCRBY', keys[1], 'cost_micro', args[7])
  local id, input, constrained = args[1], tonumber(args[8]), tonumber(args[9])
  local old = redis.call('HGET', keys[2], id)
  local d_input, d_constrained = input, constrained
  if old then
    local oi, oc = string.match(old, '^(%d+):(%d+)$')
    d_input, d_constrained = input - tonumber(oi), constrained - tonumber(oc)
  else
    redis.call('RPUSH', keys[3], id)
    while redis.call('LLEN', keys[3]) > tonumber(args[10]) do
      local gone = redis.call('LPOP', keys[3])
      local entry = redis.call('HGET', keys[2], gone)
      if entry then
        local gi, gc = string.match(entry, '^(%d+):(%d+)$')
        d_input, d_constrained = d_input - tonumber(gi), d_constrained - tonumber(gc)
        redis.call('HDEL', keys[2], gone)
      end
    end
  end
  redis.call('HSET', keys[2], id, input .. ':' .. constrained)
  redis.call('HINCRBY', keys[4], 'input', d_input)
  redis.call('HINCRBY', keys[4], 'constrained', d_constrained)
  return 1
end

local function budget_swap(keys, args)
  -- keys: the budget hash; args: the version expected, the settings (JSON), the channel to tell
  local current = tonumber(redis.call('HGET', keys[1], 'version') or '0')
  if current ~= tonumber(args[1]) then return -current end
  local version = current + 1
  redis.call('HSET', keys[1], 'version', version, 'settings', args[2])
  redis.call('PUBLISH', args[3], version)
  return version
end

redis.register_function('tandem_admit', admit)
redis.register_function('tandem_settle', settle)
redis.register_function('tandem_book', book)
redis.register_function('tandem_budget_swap', budget_swap)
"""

# A library of its own: a replica of an older release loads `tandem` again at every (re)connection, which during a
# rolling upgrade would take away a function the newer replicas call if it lived there.
LEASES = r"""#!lua name=tandem_leases

local function progress(keys, args)
  -- a running request's partial settlement, its hold's lease renewed unless it lapsed already
  -- keys: spend of the period, holds, tokens of the minute
  -- args: id, micro-dollars, tokens, the spend's TTL, now, the lease's new end, the holds' TTL
  if args[2] ~= '0' then
    redis.call('INCRBY', keys[1], args[2])
    redis.call('EXPIRE', keys[1], args[4])
  end
  if args[3] ~= '0' then
    redis.call('INCRBY', keys[3], args[3])
    redis.call('EXPIRE', keys[3], 120)
  end
  local hold = redis.call('HGET', keys[2], args[1])
  if not hold then return 0 end
  local micro, expiry = string.match(hold, '^(%d+):([%d.]+)$')
  if tonumber(expiry) < tonumber(args[5]) then return 0 end
  redis.call('HSET', keys[2], args[1], micro .. ':' .. args[6])
  redis.call('EXPIRE', keys[2], args[7])
  return 1
end

redis.register_function('tandem_progress', progress)
"""
