-- fsdp.json: the one JSON codec of the Lua side (safetensors metadata in io.lua, the structured
-- values of sharded checkpoints in checkpoint.lua). C parses untrusted safetensors headers with
-- its own strict reader (src/io/safetensors.c); this reads and writes what we produce.
--
--   json.encode(v, what[, root]) -> text  nil, booleans, finite numbers, strings, lists (an empty
--                                    table is "[]"), string-keyed tables (keys sorted: equal values
--                                    give equal bytes); errors name `what` and where in v (a cycle,
--                                    a function, NaN, a number key beside string keys), v called root
--   json.decode(s, what) -> value   any JSON value; errors name `what` and the byte
-- Strings are escaped exactly as serde_json (which Python's safetensors uses) escapes them: raw
-- UTF-8, the short escapes, \u00xx (lowercase) for other control characters.
local json = {}

local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f", ["\n"] = "\\n",
                  ["\r"] = "\\r", ["\t"] = "\\t" }
local function encode_string(s)
  local body = s:gsub('[%c"\\]', function(c)
    if c == "\127" then return c end  -- DEL is not a JSON control character
    return escapes[c] or ("\\u%04x"):format(c:byte())
  end)
  return '"' .. body .. '"'
end

-- where a value sits, for messages: extra.a.b, extra.list[2], extra["odd key"]
local function child_path(path, k)
  if type(k) == "number" then return ("%s[%d]"):format(path, k) end
  if k:match("^[%a_][%w_]*$") then return path .. "." .. k end
  return ("%s[%q]"):format(path, k)
end

-- v at `path` (open: the tables being encoded around it, to find a cycle)
local function encode(v, what, path, open)
  local tv = type(v)
  if tv == "nil" then return "null" end
  if tv == "boolean" then return tostring(v) end
  if tv == "number" then
    if v ~= v or v == math.huge or v == -math.huge then
      error(("%s: cannot store the non-finite number %s at %s"):format(what, tostring(v), path), 0)
    end
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%.0f"):format(v) end
    return ("%.17g"):format(v)
  end
  if tv == "string" then return encode_string(v) end
  if tv ~= "table" then
    error(("%s: cannot store a %s at %s (only strings, numbers, booleans and tables of them)"):format(what, tv, path), 0)
  end
  if open[v] then
    error(("%s: %s has a cycle at %s (a table that contains itself)"):format(what, path:match("^[^.[]*"), path), 0)
  end
  open[v] = true
  local n, count = #v, 0
  for _ in pairs(v) do count = count + 1 end
  local parts = {}
  local text
  if count == n then  -- a list (an empty table too: "[]")
    for i = 1, n do parts[i] = encode(v[i], what, child_path(path, i), open) end
    text = "[" .. table.concat(parts, ",") .. "]"
  else
    local keys = {}
    for k in pairs(v) do
      if type(k) ~= "string" then
        error(("%s: table keys must be strings (or a list), got the %s key %s in %s"):format(what, type(k), tostring(k), path), 0)
      end
      keys[#keys + 1] = k
    end
    table.sort(keys)
    for i, k in ipairs(keys) do parts[i] = encode_string(k) .. ":" .. encode(v[k], what, child_path(path, k), open) end
    text = "{" .. table.concat(parts, ",") .. "}"
  end
  open[v] = nil
  return text
end

-- (root names v in messages: "extra" gives "... at extra.a.b")
function json.encode(v, what, root)
  return encode(v, what, root or "value", {})
end

-- code point -> UTF-8 bytes
local function utf8(cp)
  if cp < 0x80 then return string.char(cp) end
  if cp < 0x800 then return string.char(0xc0 + math.floor(cp / 64), 0x80 + cp % 64) end
  if cp < 0x10000 then
    return string.char(0xe0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
  end
  return string.char(0xf0 + math.floor(cp / 262144), 0x80 + math.floor(cp / 4096) % 64,
                     0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

local unescapes = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }

function json.decode(s, what)
  local pos = 1
  local function fail(msg) error(("%s: malformed JSON (%s at byte %d)"):format(what, msg, pos), 0) end
  local function ws() pos = s:find("[^ \t\r\n]", pos) or #s + 1 end
  local function hex4(at) return tonumber(s:sub(at, at + 3):match("^%x%x%x%x$") or "", 16) end
  local function str()
    pos = pos + 1
    local buf = {}
    while true do
      local a = s:find('["\\]', pos)
      if not a then fail("unterminated string") end
      buf[#buf + 1] = s:sub(pos, a - 1)
      if s:sub(a, a) == '"' then
        pos = a + 1
        return table.concat(buf)
      end
      local e = s:sub(a + 1, a + 1)
      if e == "u" then
        local cp = hex4(a + 2) or fail("bad \\u escape")
        pos = a + 6
        if cp >= 0xd800 and cp <= 0xdbff and s:sub(pos, pos + 1) == "\\u" then  -- a surrogate pair
          local lo = hex4(pos + 2) or fail("bad \\u escape")
          cp = 0x10000 + (cp - 0xd800) * 1024 + (lo - 0xdc00)
          pos = pos + 6
        end
        buf[#buf + 1] = utf8(cp)
      else
        buf[#buf + 1] = unescapes[e] or fail("bad escape")
        pos = a + 2
      end
    end
  end
  local value
  function value()
    ws()
    local c = s:sub(pos, pos)
    if c == "{" then
      pos = pos + 1
      local t = {}
      ws()
      if s:sub(pos, pos) == "}" then
        pos = pos + 1
        return t
      end
      while true do
        ws()
        if s:sub(pos, pos) ~= '"' then fail("expected a key") end
        local k = str()
        ws()
        if s:sub(pos, pos) ~= ":" then fail("expected ':'") end
        pos = pos + 1
        t[k] = value()
        ws()
        c = s:sub(pos, pos)
        pos = pos + 1
        if c == "}" then return t end
        if c ~= "," then fail("expected ',' or '}'") end
      end
    elseif c == "[" then
      pos = pos + 1
      local t = {}
      ws()
      if s:sub(pos, pos) == "]" then
        pos = pos + 1
        return t
      end
      while true do
        t[#t + 1] = value()
        ws()
        c = s:sub(pos, pos)
        pos = pos + 1
        if c == "]" then return t end
        if c ~= "," then fail("expected ',' or ']'") end
      end
    elseif c == '"' then
      return str()
    elseif s:sub(pos, pos + 3) == "true" then
      pos = pos + 4
      return true
    elseif s:sub(pos, pos + 4) == "false" then
      pos = pos + 5
      return false
    elseif s:sub(pos, pos + 3) == "null" then
      pos = pos + 4
      return nil
    end
    local num = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
    if not num or not tonumber(num) then fail("unexpected character") end
    pos = pos + #num
    return tonumber(num)
  end
  local v = value()
  ws()
  if pos <= #s then fail("trailing characters") end
  return v
end

return json
