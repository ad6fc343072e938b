package = "fsdp"
version = "scm-1"
source = {
  url = "git+file:///work/main",
}
description = {
  summary = "Fully Sharded Data Parallel training from LuaJIT",
  detailed = [[
    A C core (tensors, autograd, ops, parameter sharding, collectives) behind a LuaJIT FFI
    layer with PyTorch-shaped modules and optimizers.
  ]],
  license = "MIT",
}
dependencies = {
  "lua >= 5.1",
}
build = {
  type = "make",
  -- the Makefile picks its own optimisation flags; luarocks only tells it where to install
  build_variables = {},
  install_variables = {
    PREFIX = "$(PREFIX)",
    LUADIR = "$(LUADIR)",
    LIBDIR = "$(LIBDIR)",
    BINDIR = "$(BINDIR)",
  },
}
