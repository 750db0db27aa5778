-- Each request: buyer i (round robin over the tokens file), its own Idempotency-Key.
local tokens = {}
for line in io.lines(os.getenv("TOKENS")) do tokens[#tokens + 1] = line end
local sale = os.getenv("SALE")
local keyed = os.getenv("KEYED") == "1"
local n = 0
local offset = tonumber(os.getenv("OFFSET") or "0")
request = function()
  n = n + 1
  local i = ((n * 7919 + offset) % #tokens) + 1
  local headers = { ["Authorization"] = "Bearer " .. tokens[i], ["Content-Type"] = "application/json" }
  if keyed then headers["Idempotency-Key"] = "press-" .. i end
  return wrk.format("POST", "/api/sales/" .. sale .. "/purchase", headers, '{"quantity":1}')
end
local codes = {}
response = function(status, headers, body)
  local code = string.match(body, '"code":"([a-z_]+)"') or tostring(status)
  codes[code] = (codes[code] or 0) + 1
end
done = function(summary, latency, requests)
  io.write(string.format("requests %d, errors: connect %d read %d timeout %d status %d\n", summary.requests, summary.errors.connect, summary.errors.read, summary.errors.timeout, summary.errors.status))
end
