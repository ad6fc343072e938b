-- fsdp, the development version (scm): `luarocks make` in a checkout builds and installs it.
-- It runs on LuaJIT only (the FFI is the whole binding). The C build needs gcc, make, pkg-config,
-- OpenBLAS (libopenblas-dev) and oneDNN (libdnnl-dev); with mpicc (libopenmpi-dev) it also builds
-- the MPI backend, and with nvcc (the CUDA toolkit) the CUDA backend libfsdp_cuda.so.
rockspec_format = "3.0"
package = "fsdp"
version = "scm-1"
source = {
  url = "git+https://github.com/fsdp-lua/fsdp.git",
}
description = {
  summary = "Fully Sharded Data Parallel training from LuaJIT",
  detailed = [[
    A C core (tensors, autograd, ops, parameter sharding, collectives over MPI) behind a LuaJIT
    FFI layer with PyTorch-shaped modules and optimizers. Every combination of wrapping and
    freezing trains exactly like one process.
  ]],
  homepage = "https://github.com/fsdp-lua/fsdp",
  license = "MIT",
  labels = { "machine-learning", "deep-learning", "luajit", "ffi", "mpi" },
}
dependencies = {
  "lua == 5.1",
  "luajit >= 2.0",  -- its ffi module is the binding (LuaRocks provides "luajit" when it runs on it)
}
external_dependencies = {
  OPENBLAS = { library = "openblas" },
  DNNL = { header = "oneapi/dnnl/dnnl.h", library = "dnnl" },
}
build = {
  type = "make",
  -- the Makefile picks its own optimisation (OPT); luarocks's CFLAGS go first, so ours win
  build_variables = {
    LUAROCKS_CFLAGS = "$(CFLAGS)",
  },
  install_variables = {
    PREFIX = "$(PREFIX)",
    LUADIR = "$(LUADIR)",
    LIBDIR = "$(LIBDIR)",
    BINDIR = "$(BINDIR)",
    EXAMPLESDIR = "$(PREFIX)/examples",  -- fsdp-examples-dir prints it
    LUAROCKS = "1",
  },
}
