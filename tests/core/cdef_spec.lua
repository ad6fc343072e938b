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

-- the names of the functions the FFI section declares (not the function-pointer typedefs)
local function ffi_functions()
  local body = header_ffi_section():gsub("%(%*[%w_]+%)", "")
  local names, seen = {}, {}
  for name in body:gmatch("([%w_]+)%s*%(") do
    if name:match("^fsdp_") and not seen[name] then seen[name] = true; names[#names + 1] = name end
  end
  return names
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
    local names = ffi_functions()
    assert.is_true(#names > 100)
    local missing = {}
    for _, name in ipairs(names) do
      local ok = pcall(function() return fsdp.C[name] end)
      if not ok then missing[#missing + 1] = name end
    end
    assert.same({}, missing)
  end)

  -- internal functions and data tables stay inside the library (the version script made from the
  -- FFI section): what `nm -D` lists as defined is exactly the FFI section's functions
  it("libfsdp.so exports exactly the functions of the FFI section", function()
    local lib = assert(package.searchpath("libfsdp", package.cpath), "libfsdp.so not in package.cpath")
    local p = io.popen("nm -D --defined-only " .. lib .. " 2>&1")
    local exported, extra = {}, {}
    for line in p:lines() do
      local kind, name = line:match("^%x*%s+(%a)%s+([%w_@.]+)$")
      assert(kind, "unexpected nm output: " .. line)
      exported[name] = true
    end
    p:close()
    local declared = {}
    for _, name in ipairs(ffi_functions()) do declared[name] = true end
    local not_exported = {}
    for name in pairs(declared) do if not exported[name] then not_exported[#not_exported + 1] = name end end
    for name in pairs(exported) do if not declared[name] then extra[#extra + 1] = name end end
    table.sort(not_exported); table.sort(extra)
    assert.same({}, not_exported)
    assert.same({}, extra)
  end)

  it("agrees with C on enum values", function()
    assert.equal(0, ffi.C.FSDP_F32 or fsdp.C.FSDP_F32)
    assert.equal(6, fsdp.C.FSDP_MEM_NCAT)
    assert.equal(4, tonumber(fsdp.C.fsdp_dtype_size(fsdp.C.FSDP_F32)))
    assert.equal("bfloat16", ffi.string(fsdp.C.fsdp_dtype_name(fsdp.C.FSDP_BF16)))
  end)
end)
