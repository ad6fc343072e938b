-- The FFI declarations Lua uses are the public header itself, and every declared function exists.
local ffi = require "ffi"
local fsdp = require "fsdp"

local function header_ffi_section()
  local f = assert(io.open("src/fsdp.h", "rb"))
  local text = f:read("*a")
  f:close()
  local body = text:match("\n// FFI%-BEGIN\n(.-)// FFI%-END\n")
  assert(body, "src/fsdp.h has no FFI-BEGIN/FFI-END section")
  return body
end

describe("cdef", function()
  it("is exactly the FFI section of src/fsdp.h", function()
    local generated = require "fsdp.cdef"
    assert.equal(header_ffi_section(), generated)
  end)

  it("has no preprocessor lines or block comments in the FFI section", function()
    local body = header_ffi_section()
    assert.is_nil(body:find("\n#"))
    assert.is_nil(body:find("/%*"))
  end)

  it("declares only functions that libfsdp.so exports", function()
    local names = {}
    for name in header_ffi_section():gmatch("([%w_]+)%s*%(") do
      if name:match("^fsdp_") and not name:match("_fn$") then names[#names + 1] = name end
    end
    assert.is_true(#names > 100)
    local missing = {}
    for _, name in ipairs(names) do
      local ok = pcall(function() return fsdp.C[name] end)
      if not ok then missing[#missing + 1] = name end
    end
    assert.same({}, missing)
  end)

  it("agrees with C on enum values", function()
    assert.equal(0, ffi.C.FSDP_F32 or fsdp.C.FSDP_F32)
    assert.equal(6, fsdp.C.FSDP_MEM_NCAT)
    assert.equal(4, tonumber(fsdp.C.fsdp_dtype_size(fsdp.C.FSDP_F32)))
    assert.equal("bfloat16", ffi.string(fsdp.C.fsdp_dtype_name(fsdp.C.FSDP_BF16)))
  end)
end)
