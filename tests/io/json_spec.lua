-- lua/fsdp/json.lua, the one JSON codec of the Lua side: values against hand-written JSON,
-- serde_json's escapes (the bytes Python's safetensors writes), round trips, and errors that
-- name the caller's `what` and the byte.
local json = require "fsdp.json"
local H = require "helpers"

describe("fsdp.json", function()
  it("encodes values with sorted keys and serde_json's escapes", function()
    assert.equal('{"a":[1,2.5,true],"b":{"x":"y"}}', json.encode({ b = { x = "y" }, a = { 1, 2.5, true } }, "t"))
    assert.equal("null", json.encode(nil, "t"))
    assert.equal('"q\\"b\\\\s\\n\\u0001\127é"', json.encode('q"b\\s\n\1\127é', "t"))
    assert.equal("[]", json.encode({}, "t"))
    assert.equal("9007199254740991", json.encode(2 ^ 53 - 1, "t"))
    assert.equal("0.10000000000000001", json.encode(0.1, "t"))
  end)

  it("decodes what it encodes, and \\u escapes including surrogate pairs", function()
    local v = { name = "é\n\"x\"", list = { 1, -2.5e3, false }, nested = { deep = { "a" } } }
    assert.same(v, json.decode(json.encode(v, "t"), "t"))
    assert.equal("é😀/", json.decode('"\\u00e9\\ud83d\\ude00\\/"', "t"))
  end)

  it("names the caller and the byte on malformed text", function()
    H.assert_error(function() json.decode('{"a":1,}', "checkpoint layout") end, "checkpoint layout: malformed JSON (expected a key at byte 8)")
    H.assert_error(function() json.decode('[1] x', "meta") end, "trailing characters")
    H.assert_error(function() json.encode({ [1] = 1, x = 2 }, "extra") end, "extra: table keys must be strings")
    H.assert_error(function() json.encode(0 / 0, "extra") end, "non-finite")
  end)
end)
