# fsdp -- build libfsdp.so, run tests, benchmarks and the demo.
#   make            build libfsdp.so, libfsdp_mpi.so (where mpicc exists), libfsdp_cuda.so (where nvcc
#                   is), libfsdp_nccl.so (where nccl.h is) and lua/fsdp/cdef.lua
#   make test       C unit tests + busted specs (what .ci/run calls); installs missing packages first
#   make demo       the main job: FSDP training on Fashion-MNIST (examples/train.lua)
#   make demo-gpt   the second job: a character-level GPT on the fortunes text (examples/gpt.lua)
#   make bench      benchmarks against PyTorch (python3-torch, and PyPI's torch after make bench-deps)
#   make layers     the layers of src/: no include or call crosses them the wrong way
#   make lint       cppcheck (warning, performance, portability) and the realloc check
#   make format     clang-format the C sources; make format-check: fail on any difference
#   make memcheck   C tests under valgrind; make asan-check: a training run under ASan + UBSan;
#                   make tsan-check: two threads training at once under ThreadSanitizer
#   make cudaemu    the CUDA executor (tests/cudaemu: the CUDA kernels on the CPU; make test builds it);
#                   make cuda-emu-check: the kernels under ASan + UBSan and ThreadSanitizer there
#   make install PREFIX=/usr/local   (luarocks make passes LUADIR/LIBDIR/BINDIR/EXAMPLESDIR)
#
#   make isa-check  the built library needs nothing above x86-64-v2 outside its AVX2 and AVX-512 copies
#   make isa-emu-check  the AVX-512 copy run on an emulated AVX-512 CPU (Bochs), its results against
#                   the sse2 and avx2 copies' (tools/isa_emu.sh; installs Bochs and a kernel first)
#
# Flags: OPT (default -O3 $(ARCH) -g) is the optimisation, CFLAGS/LDFLAGS are yours and come
# last (so CFLAGS=-O0 wins; luarocks's CFLAGS arrive as LUAROCKS_CFLAGS and come first, so its -O2
# yields to OPT), WERROR=1 (default under CI=true) makes warnings errors. The packages
# are checked before anything compiles (tools/deps.sh); DEPS=skip skips that where they come from
# elsewhere than Debian's packages.

CC      ?= cc
COMMA   := ,
# ARCH: the ISA every file is compiled for, x86-64-v2 (any x86-64 CPU since about 2009); the kernel
# files are compiled twice more, with ISA_FLAGS_avx2 and ISA_FLAGS_avx512 added, and the copy that
# runs is picked by cpuid when the library loads (src/backend/cpu/cpu.h). make ARCH=-march=native
# builds for the building CPU alone (docs/environment.md, FSDP_CPU_ISA).
ARCH    ?= -march=x86-64-v2
ISA_FLAGS_avx2   := -mavx2 -mfma -mbmi -mbmi2 -mf16c -mlzcnt -mmovbe
ISA_FLAGS_avx512 := $(ISA_FLAGS_avx2) -mavx512f -mavx512bw -mavx512cd -mavx512dq -mavx512vl
OPT     ?= -O3 $(ARCH) -g
WARN    := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wpointer-arith -Wcast-qual -Wmissing-prototypes
ifeq ($(CI),true)
WERROR  ?= 1
endif
ifeq ($(WERROR),1)
WARN    += -Werror
endif
BLAS_CFLAGS := $(shell pkg-config --cflags openblas 2>/dev/null)
BLAS_LIBS   := $(shell pkg-config --libs openblas 2>/dev/null || echo -lopenblas)
BASE_CFLAGS  = -std=gnu11 -fPIC -fopenmp -Isrc $(WARN)
ALL_CFLAGS   = $(LUAROCKS_CFLAGS) $(OPT) $(BASE_CFLAGS) $(BLAS_CFLAGS) $(CFLAGS)
LDLIBS       = $(BLAS_LIBS) -ldnnl -lm -fopenmp

PREFIX  ?= /usr/local
LUADIR  ?= $(PREFIX)/share/lua/5.1
LIBDIR  ?= $(PREFIX)/lib/lua/5.1
BINDIR  ?= $(PREFIX)/bin
EXAMPLESDIR ?= $(PREFIX)/share/fsdp/examples

# BUILD: where objects and C tests go (make memcheck builds its own copy in build-memcheck)
BUILD ?= build
# src/ is layered (docs/layout.md; make layers checks it): core, backend/cpu, ops, parallel, io
SRCS := $(filter-out src/parallel/comm_mpi.c src/parallel/comm_nccl.c,$(wildcard src/*/*.c src/*/*/*.c))
# the kernel files, one copy per ISA level: $(BUILD)/x.o the base's (FSDP_ISA_BUILD=0), x.avx2.o and
# x.avx512.o the others' (src/backend/cpu/cpu.h)
ISA_SRCS := $(addprefix src/backend/cpu/,elem.c isa.c linalg.c nn.c norm.c optim.c)
ISA_BASE_OBJS := $(ISA_SRCS:src/%.c=$(BUILD)/%.o)
ISA_OBJS := $(ISA_SRCS:src/%.c=$(BUILD)/%.avx2.o) $(ISA_SRCS:src/%.c=$(BUILD)/%.avx512.o)
OBJS := $(SRCS:src/%.c=$(BUILD)/%.o) $(ISA_OBJS)
HDRS := $(wildcard src/*.h src/*/*.h src/*/*/*.h)
LUAJIT ?= luajit
BUSTED ?= $(shell command -v busted)

all: libfsdp.so lua/fsdp/cdef.lua

# the packages, before the first compiler call (an order-only prerequisite: never forces a rebuild)
deps-build:
	@bash tools/deps.sh --check build

$(BUILD)/%.o: src/%.c $(HDRS) | $(BUILD) deps-build
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -c $< -o $@
$(ISA_BASE_OBJS): ALL_CFLAGS += -DFSDP_ISA_BUILD=0
$(BUILD)/%.avx2.o: src/%.c $(HDRS) | $(BUILD) deps-build
	$(CC) $(ALL_CFLAGS) $(ISA_FLAGS_avx2) -DFSDP_ISA_BUILD=1 -c $< -o $@
$(BUILD)/%.avx512.o: src/%.c $(HDRS) | $(BUILD) deps-build
	$(CC) $(ALL_CFLAGS) $(ISA_FLAGS_avx512) -DFSDP_ISA_BUILD=2 -c $< -o $@
# optimizer kernels: sqrtf without its errno branch (so the Adam loop vectorizes), and no FMA
# contraction, so an element's update never depends on where it falls in the vector loop
$(addprefix $(BUILD)/backend/cpu/,optim.o optim.avx2.o optim.avx512.o): ALL_CFLAGS += -fno-math-errno -ffp-contract=off

$(BUILD):
	mkdir -p $(BUILD)

# the FFI section of the public header: the single source of truth for ffi.cdef and the exports
FFI_SECTION = sed -n '/^\/\/ FFI-BEGIN/,/^\/\/ FFI-END/p' src/fsdp.h

# only the public API (the functions of the FFI section) is exported: a version script made from
# that section hides every other symbol (tests/core/cdef_spec.lua compares nm -D with it)
$(BUILD)/libfsdp.map: src/fsdp.h | $(BUILD)
	{ echo '{ global:'; $(FFI_SECTION) | sed -E 's/\(\*[A-Za-z0-9_]+\)//g' | grep -oE '\bfsdp_[A-Za-z0-9_]+ *\(' | \
	  sed -E 's/ *\($$/;/' | sort -u; echo 'local: *; };'; } > $@

# (the link map, $(BUILD)/libfsdp.link.map, says which object each piece of code came from: make isa-check)
libfsdp.so: $(OBJS) $(BUILD)/libfsdp.map
	$(CC) -shared -o $@ $(OBJS) -Wl,--version-script=$(BUILD)/libfsdp.map -Wl,-Map=$(BUILD)/libfsdp.link.map \
	  $(LDFLAGS) $(LDLIBS)
# the same library in $(BUILD), for the sanitizer builds (make asan-check, tsan-check)
$(BUILD)/libfsdp.so: $(OBJS) $(BUILD)/libfsdp.map
	$(CC) $(OPT) -shared -o $@ $(OBJS) -Wl,--version-script=$(BUILD)/libfsdp.map $(LDFLAGS) $(LDLIBS)

# Portability: outside the objects of the AVX2 and AVX-512 copies (the link map says where each
# object's code went), no instruction of libfsdp.so needs more than x86-64-v2, and the AVX2 copy
# needs no AVX-512 (tools/isa_check.lua; tests/backends/isa_check_spec.lua runs it, and shows it
# fails on a planted AVX2 function). A build with ARCH=-march=native is not portable: skipped.
isa-check: libfsdp.so
	$(if $(findstring native,$(ARCH)),@echo "isa-check: ARCH=$(ARCH) builds for this CPU alone: skipped",\
	  $(LUAJIT) tools/isa_check.lua libfsdp.so $(BUILD)/libfsdp.link.map)

# The AVX-512 copy on a CPU without AVX-512: Bochs emulates one, a Debian kernel boots in it from an
# initramfs holding the library, and the guest compares the avx512f copy's runs of the op-case table
# and the wide cases with the sse2 and avx2 copies' runs made here (tools/isa_emu.sh; its packages,
# kernel and guest in build/isa-emu). Correctness only: the emulated CPU says nothing about speed.
isa-emu-check: libfsdp.so
	bash tools/isa_emu.sh

# the MPI backend: its own library, so libfsdp.so never depends on MPI (comm.c dlopen()s it);
# built only where mpicc exists
MPICC ?= $(shell command -v mpicc 2>/dev/null)
ifneq ($(MPICC),)
all: libfsdp_mpi.so
endif
libfsdp_mpi.so: src/parallel/comm_mpi.c src/parallel/comm.h | deps-build
	$(MPICC) $(OPT) $(BASE_CFLAGS) $(CFLAGS) -shared -o $@ src/parallel/comm_mpi.c $(LDFLAGS)

# the CUDA backend: its own library, so libfsdp.so never depends on CUDA (backend/cuda/load.c
# dlopen()s it once it found a driver and a device); built only where nvcc exists, for sm_80
# (A100) and sm_90 (H100/H200), plus PTX for later GPUs. optim.cu without FMA contraction, as
# the CPU's optimizer loop (each element's update rounds the same way on both devices).
NVCC ?= $(shell command -v nvcc 2>/dev/null)
CUDA_SRCS := $(wildcard src/backend/cuda/*.cu)
CUDA_OBJS := $(CUDA_SRCS:src/%.cu=$(BUILD)/%.o)
CUDA_HDRS := src/core/backend.h $(wildcard src/core/kernels_*.h src/backend/cuda/*.h)
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90
NVCC_FLAGS = -std=c++17 -O3 -g -Isrc $(CUDA_ARCH) -Xcompiler -fPIC,-fvisibility=hidden,-Wall \
             $(if $(filter 1,$(WERROR)),-Werror all-warnings -Xcompiler -Werror)
CUDA_LIBS ?= -cudart static -lcublasLt -lcudnn
ifneq ($(NVCC),)
all: libfsdp_cuda.so
endif
$(BUILD)/backend/cuda/%.o: src/backend/cuda/%.cu $(CUDA_HDRS) | $(BUILD)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@
$(BUILD)/backend/cuda/optim.o: NVCC_FLAGS += -fmad=false
libfsdp_cuda.so: $(CUDA_OBJS)
	$(NVCC) -shared -o $@ $(CUDA_OBJS) $(CUDA_LIBS)

# The CUDA executor (tests/cudaemu; test infrastructure, never installed): the same .cu files,
# rewritten (kernel<<<...>>> launches, __shared__ declarations: tests/cudaemu/rewrite.lua, line for
# line) and compiled as host C++ against its own CUDA headers into libfsdp_cudaemu.so, which
# FSDP_CUDA_EMU=1 loads as the "cuda" device (backend/cuda/load.c). EMU_SAN: sanitizer flags (make
# cuda-emu-check builds it again with AddressSanitizer and with ThreadSanitizer).
EMU_DIR   := tests/cudaemu
EMU_BUILD ?= $(BUILD)/cudaemu
EMU_LIB   ?= libfsdp_cudaemu.so
EMU_SAN   ?=
EMU_HDRS  := $(wildcard $(EMU_DIR)/*.h $(EMU_DIR)/include/*.h)
EMU_OBJS   = $(CUDA_SRCS:src/backend/cuda/%.cu=$(EMU_BUILD)/%.o) $(EMU_BUILD)/runtime.o $(EMU_BUILD)/blaslt.o \
             $(EMU_BUILD)/dnn.o
# (-Wno-sign-compare: CUDA's unsigned threadIdx against int, which nvcc does not warn about)
EMU_FLAGS  = -std=gnu++17 -O2 -g -fPIC -fvisibility=hidden -I$(EMU_DIR)/include -I$(EMU_DIR) -Isrc -Wall -Wextra \
             -Wno-sign-compare $(if $(filter 1,$(WERROR)),-Werror) $(EMU_SAN)
cudaemu: $(EMU_LIB)
$(EMU_BUILD)/%.cc: src/backend/cuda/%.cu $(EMU_DIR)/rewrite.lua
	@mkdir -p $(@D)
	$(LUAJIT) $(EMU_DIR)/rewrite.lua $< $@
$(EMU_BUILD)/%.o: $(EMU_BUILD)/%.cc $(CUDA_HDRS) $(EMU_HDRS)
	$(CXX) $(EMU_FLAGS) -c $< -o $@
$(EMU_BUILD)/%.o: $(EMU_DIR)/%.cc $(EMU_HDRS)
	@mkdir -p $(@D)
	$(CXX) $(EMU_FLAGS) -c $< -o $@
# (as nvcc -fmad=false for optim.cu: no contraction, each element rounds as on the CPU)
$(EMU_BUILD)/optim.o: EMU_FLAGS += -ffp-contract=off
# the scheduler stays out of ThreadSanitizer's view, and tells it of fibers and synchronisation
$(EMU_BUILD)/runtime.o: $(EMU_DIR)/runtime.cc $(EMU_HDRS)
	@mkdir -p $(@D)
	$(CXX) $(filter-out -fsanitize=thread,$(EMU_FLAGS)) $(if $(findstring thread,$(EMU_SAN)),-DFSDP_EMU_TSAN) -c $< -o $@
$(EMU_LIB): $(EMU_OBJS)
	$(CXX) $(EMU_SAN) -shared -o $@ $(EMU_OBJS) -lpthread
# the executor's own checks: tests/cudaemu/selftest.cu, rewritten as the backend's .cu files are
$(EMU_BUILD)/%.cc: $(EMU_DIR)/%.cu $(EMU_DIR)/rewrite.lua
	@mkdir -p $(@D)
	$(LUAJIT) $(EMU_DIR)/rewrite.lua $< $@
.PRECIOUS: $(EMU_BUILD)/%.cc
$(EMU_BUILD)/selftest: $(EMU_BUILD)/selftest.o $(EMU_BUILD)/runtime.o
	$(CXX) $(EMU_SAN) -o $@ $^ -lpthread
$(EMU_BUILD)/libs_test: $(EMU_BUILD)/libs_test.o $(EMU_BUILD)/runtime.o $(EMU_BUILD)/blaslt.o $(EMU_BUILD)/dnn.o
	$(CXX) $(EMU_SAN) -o $@ $^ -lpthread
cudaemu: $(EMU_BUILD)/selftest $(EMU_BUILD)/libs_test

# the NCCL device data plane: its own library, loaded by comm.c for GPU tensors; built where
# nccl.h is (the CUDA toolkit's or a system one). It links libnccl.so.2 only (the driver is
# opened at run time), so it loads -- and bootstraps -- on a machine without a GPU.
NCCL_H ?= $(firstword $(wildcard /usr/include/nccl.h $(dir $(NVCC))../include/nccl.h /usr/local/cuda/include/nccl.h))
ifneq ($(NCCL_H),)
NCCL_INC := $(abspath $(dir $(NCCL_H)))/
NCCL_LIBDIR := $(firstword $(wildcard $(NCCL_INC)../lib64/libnccl.so $(NCCL_INC)../lib/libnccl.so /usr/lib/x86_64-linux-gnu/libnccl.so))
all: libfsdp_nccl.so
endif
libfsdp_nccl.so: src/parallel/comm_nccl.c src/parallel/comm.h | $(BUILD)
	$(CC) $(OPT) $(BASE_CFLAGS) $(CFLAGS) -isystem $(NCCL_INC) -shared -o $@ src/parallel/comm_nccl.c \
	  $(if $(NCCL_LIBDIR),-L$(dir $(NCCL_LIBDIR)) -Wl$(COMMA)-rpath$(COMMA)$(dir $(NCCL_LIBDIR))) -lnccl -ldl

# the FFI section as a Lua string, for ffi.cdef
lua/fsdp/cdef.lua: src/fsdp.h
	{ echo '-- generated from src/fsdp.h by make; do not edit'; echo 'return [==['; \
	  $(FFI_SECTION) | grep -v '^// FFI-'; echo ']==]'; } > $@

# ---- tests -----------------------------------------------------------------------------------
# (the ThreadSanitizer probe of make tsan-check, linked with the objects of BUILD=build-tsan)
$(BUILD)/tsan_probe: tests/c/tsan_probe.c $(OBJS)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(OBJS) $(LDFLAGS) $(LDLIBS)

# The C tests link the objects themselves: they also reach internal functions libfsdp.so hides.
CTEST_NAMES := $(patsubst tests/c/%.c,%,$(wildcard tests/c/test_*.c))
CTESTS := $(CTEST_NAMES:%=$(BUILD)/tests/%)
$(BUILD)/tests/%: tests/c/%.c tests/c/ctest.h $(OBJS)
	@mkdir -p $(BUILD)/tests
	$(CC) $(ALL_CFLAGS) $< -o $@ $(OBJS) $(LDFLAGS) $(LDLIBS) -ldl

# `make test` installs what is missing first (tools/deps.sh), then builds (one compiler a core) and
# runs everything in a second make, which sees the installed tools (mpicc, busted) from its start
test:
	@bash tools/deps.sh test
	@$(MAKE) --no-print-directory -j$$(env -u OMP_NUM_THREADS nproc) test-run

test-run: all cudaemu $(CTESTS)
	@for t in $(CTESTS); do echo "== $$t"; $$t || exit 1; done
	LUAJIT=$(LUAJIT) BUSTED=$(BUSTED) bash tools/run_specs.sh

# the API reference (LDoc, config.ld): HTML into doc/ from the doc comments; a warning is an error
doc:
	@bash tools/deps.sh doc
	ldoc --fatalwarnings .

# ---- guardrails (.ci/run runs them after make test) ---------------------------------------------
# the layers of src/ (core <- backend/cpu, ops <- parallel; io): includes and calls that cross them
# the wrong way are errors; prints the folder graph (tools/layers.lua; --dot for graphviz)
layers: $(OBJS)
	$(LUAJIT) tools/layers.lua $(BUILD)

# (mpi.h stays unread: through it cppcheck would parse OpenMPI's C++ bindings as C)
lint:
	cppcheck -q --error-exitcode=1 --enable=warning,performance,portability --std=c11 --language=c --inline-suppr \
	  --suppress=missingIncludeSystem -Isrc $(filter -I%,$(BLAS_CFLAGS)) src tests/c bench/comm_bench.c
	bash tools/check_realloc.sh src tests/c bench

FORMAT_FILES = $(SRCS) src/parallel/comm_mpi.c src/parallel/comm_nccl.c $(CUDA_SRCS) $(HDRS) $(wildcard tests/c/*.c tests/c/*.h bench/*.c) \
               $(wildcard tests/cudaemu/*.cc tests/cudaemu/*.cu tests/cudaemu/*.h tests/cudaemu/include/*.h)
format:
	clang-format -i $(FORMAT_FILES)
format-check:
	clang-format --dry-run --Werror $(FORMAT_FILES)

# The C tests under valgrind (leaks and invalid accesses are errors). valgrind 3.19 cannot run
# AVX-512 code, so they are built again for x86-64-v3 (AVX2 + FMA, what valgrind emulates) in
# build-memcheck/ by a second make (valgrind's cpuid shows no AVX-512, so the AVX2 copy of the
# kernels runs; and oneDNN, which generates its kernels at run time, is held to AVX2: its bf16 GEMM
# is then absent, so the bf16 GEMM test runs the float32 path). The float32 GEMMs run on OpenBLAS here: oneDNN's JIT sgemm
# kernels load whole vectors past the ends of their own buffers, which valgrind reports.
memcheck:
	@$(MAKE) --no-print-directory BUILD=build-memcheck ARCH=-march=x86-64-v3 memcheck-run
memcheck-run: $(CTESTS)
	@for t in $(CTESTS); do echo "== valgrind $$t"; \
	  OMP_NUM_THREADS=1 ONEDNN_MAX_CPU_ISA=AVX2 FSDP_GEMM=openblas valgrind -q --leak-check=full --errors-for-leak-kinds=definite \
	  --error-exitcode=1 $$t || exit 1; done

# libfsdp built with AddressSanitizer and UndefinedBehaviorSanitizer (build-asan/), with the normal
# build's ARCH, so the same vector kernels run under them, then one short training run through
# LuaJIT with ASan preloaded: invalid accesses, undefined behaviour and leaks at exit are errors
ASAN_LIB := $(shell $(CC) -print-file-name=libasan.so)
asan-check: lua/fsdp/cdef.lua | deps-build
	$(MAKE) --no-print-directory BUILD=build-asan OPT="-O1 $(ARCH) -g -fsanitize=address,undefined -fno-omit-frame-pointer" \
	  build-asan/libfsdp.so
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 LD_PRELOAD=$(ASAN_LIB) \
	  LUA_CPATH='build-asan/?.so' OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(LUAJIT) tests/scripts/train_short.lua

# The core from two threads at once under ThreadSanitizer (build-tsan/): tests/c/tsan_probe.c trains
# two independent models in two threads and must match a single-thread run; any race is an error
# (one thread per OpenMP and OpenBLAS pool: neither library is built for TSan)
# Then the threads of a device data plane: every collective on tensors of the GPU double through the
# stand-in communicator (the communication thread, two stream threads and the caller), one rank.
TSAN_LIB := $(shell $(CC) -print-file-name=libtsan.so)
tsan-check: lua/fsdp/cdef.lua | deps-build
	$(MAKE) --no-print-directory BUILD=build-tsan OPT="-O1 $(ARCH) -g -fsanitize=thread" LDLIBS="$(LDLIBS) -lpthread -ldl" \
	  build-tsan/libfsdp.so build-tsan/tsan_probe
	TSAN_OPTIONS=halt_on_error=1:exitcode=66 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 build-tsan/tsan_probe
	TSAN_OPTIONS=halt_on_error=1:exitcode=66 LD_PRELOAD=$(TSAN_LIB) LUA_PATH='lua/?.lua;lua/?/init.lua;;' \
	  LUA_CPATH='build-tsan/?.so' OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 FSDP_VALUES_DEVICE=cuda \
	  FSDP_DEVICE_COMM=standin $(LUAJIT) tests/scripts/comm_values.lua self

# The CUDA kernels' memcheck and racecheck (.ci/run): the CUDA executor built again with
# AddressSanitizer + UndefinedBehaviorSanitizer (cuda-emu-asan, build-asan/) and with ThreadSanitizer
# (cuda-emu-tsan, build-tsan/; the three parts are independent: make -j2 runs them side by side),
# each running its self-test, the cuBLASLt/cuDNN stand-ins' test, the op-case table's
# device cases and tests/backends/cuda_spec.lua (the optimizer kernels): every kernel. An access past a
# global or shared buffer, undefined behaviour, or two threads of a block (or two blocks) touching
# one address with a write and no barrier between are errors naming the kernel. The planted races
# of the self-test must be reported (exit 66). And the FSDP matrix at world size 4 on the executor
# (cuda-emu-matrix: host plane and the stand-in communicator), which make test leaves out for time.
EMU_ASAN_ENV = ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
EMU_TSAN_ENV = TSAN_OPTIONS=halt_on_error=1:exitcode=66
# the op table's block that runs on the device (every case, both dtypes): the rest of ops_spec is
# CPU-only (references, finite differences), which the sanitized executor does not touch
EMU_CASES = --filter=every.backend.against.the.CPU
# (busted's children -- the shells of popen -- must not get libtsan preloaded: dash dies of it)
EMU_UNPRELOAD = local ffi = require 'ffi'; ffi.cdef 'int unsetenv(const char*);'; ffi.C.unsetenv('LD_PRELOAD')
EMU_RUN      = FSDP_CUDA_EMU=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 LUA_PATH='lua/?.lua;lua/?/init.lua;tests/?.lua;;'
cuda-emu-check: cuda-emu-asan cuda-emu-tsan cuda-emu-matrix
cuda-emu-asan: all
	$(MAKE) --no-print-directory EMU_BUILD=build-asan/cudaemu EMU_LIB=build-asan/libfsdp_cudaemu.so \
	  EMU_SAN="-fsanitize=address,undefined -fno-omit-frame-pointer" build-asan/libfsdp_cudaemu.so cudaemu
	$(EMU_ASAN_ENV) build-asan/cudaemu/selftest
	$(EMU_ASAN_ENV) build-asan/cudaemu/libs_test
	for spec in "$(EMU_CASES) tests/ops/ops_spec.lua" tests/backends/cuda_spec.lua; do \
	  $(EMU_ASAN_ENV) LD_PRELOAD=$(ASAN_LIB) FSDP_CUDA_EMU_LIB=build-asan/libfsdp_cudaemu.so $(EMU_RUN) \
	  $(LUAJIT) $(BUSTED) $$spec || exit 1; done
cuda-emu-tsan: all
	$(MAKE) --no-print-directory EMU_BUILD=build-tsan/cudaemu EMU_LIB=build-tsan/libfsdp_cudaemu.so \
	  EMU_SAN="-fsanitize=thread" build-tsan/libfsdp_cudaemu.so cudaemu
	$(EMU_TSAN_ENV) build-tsan/cudaemu/selftest
	$(EMU_TSAN_ENV) build-tsan/cudaemu/libs_test
	for race in race_shared race_blocks; do $(EMU_TSAN_ENV) build-tsan/cudaemu/selftest $$race >/dev/null 2>&1; \
	  rc=$$?; [ $$rc = 66 ] || { echo "the planted $$race was not reported (exit $$rc)"; exit 1; }; done
	for spec in "$(EMU_CASES) tests/ops/ops_spec.lua" tests/backends/cuda_spec.lua; do \
	  $(EMU_TSAN_ENV) LD_PRELOAD=$(TSAN_LIB) FSDP_CUDA_EMU_LIB=build-tsan/libfsdp_cudaemu.so $(EMU_RUN) \
	  $(LUAJIT) -e "$(EMU_UNPRELOAD)" $(BUSTED) --ignore-lua $$spec || exit 1; done
cuda-emu-matrix: all cudaemu
	for plane in host standin; do FSDP_DEVICE_COMM=$$plane FSDP_MATRIX_DEVICE=cuda FSDP_CUDA_EMU=1 \
	  bin/fsdprun -n 4 tests/scripts/fsdp_matrix.lua | grep "SUMMARY" | grep -q "failed=0" || exit 1; done

# ---- benchmarks and the demo --------------------------------------------------------------------
# ours against two PyTorch builds: Debian's (/usr/bin/python3, or PYTHON=) and a current one from
# PyPI (tmp/torch-venv when make bench-deps made it, or PYTHON2=; PYTHON2=none leaves it out).
# BENCH_ROUNDS=R: R rounds instead of each bench's default (.ci/run's 1 checks that they run).
BENCH_ARGS = $(if $(PYTHON),--python $(PYTHON)) $(if $(PYTHON2),--python2 $(PYTHON2)) $(if $(BENCH_ROUNDS),--rounds $(BENCH_ROUNDS))
bench: all
	OPENBLAS_NUM_THREADS=$${THREADS:-2} OMP_NUM_THREADS=$${THREADS:-2} $(LUAJIT) bench/run.lua $(BENCH_ARGS)
	OPENBLAS_NUM_THREADS=$${THREADS:-2} OMP_NUM_THREADS=$${THREADS:-2} $(LUAJIT) bench/conv_shapes.lua $(BENCH_ARGS)
	$(LUAJIT) bench/jit_loop.lua

# optional, never needed by make test: a current PyTorch from PyPI in an ignored venv (tmp/torch-venv,
# several GB with the CUDA wheels pip brings along) for make bench to compare with
TORCH_VENV ?= tmp/torch-venv
bench-deps:
	@if [ -x $(TORCH_VENV)/bin/python ] && $(TORCH_VENV)/bin/python -c 'import torch, numpy' 2>/dev/null; then \
	  echo "$(TORCH_VENV): torch $$($(TORCH_VENV)/bin/python -c 'import torch; print(torch.__version__)') is there"; \
	else \
	  python3 -m venv $(TORCH_VENV) && \
	  $(TORCH_VENV)/bin/pip install torch numpy tqdm; \
	fi

# DataLoader workers: an epoch with num_workers = 0 against 2 on a CPU-heavy transform (bench/README.md)
bench-loader: all
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 $(LUAJIT) bench/loader.lua $(if $(BENCH_ROUNDS),--rounds $(BENCH_ROUNDS))

# FSDP benchmarks through bin/fsdprun: memory at N = 1, 2, 4; step time at N = 2 (full vs no
# shard, and against PyTorch DDP over gloo). See bench/README.md, "make bench-fsdp".
bench-fsdp: all
	$(LUAJIT) bench/fsdp_memory.lua && $(LUAJIT) bench/fsdp_memory.lua --device cuda --gc 1 && \
	  $(LUAJIT) bench/fsdp_speed.lua $(if $(BENCH_ROUNDS),--rounds $(BENCH_ROUNDS))

# A GPT of a billion parameters at 4 ranks, each capped below its float32 parameters (issue 36's
# proof; bench/big_model.lua says what each phase shows): about 12 GB of memory, 8 GB of disk in
# BIG_DIR (default tmp/big), about 6 minutes on 2 cores. BIG_ARGS passes model flags to every
# phase. (One glibc malloc arena: the cap counts address space, and every thread's arena reserves
# 64 MiB of it.)
BIG_DIR ?= tmp/big
bench-big: export MALLOC_ARENA_MAX = 1
bench-big: all
	rm -rf $(BIG_DIR) && mkdir -p $(BIG_DIR)
	bin/fsdprun -n 4 bench/big_model.lua --save $(BIG_DIR)/sharded $(BIG_ARGS)
	bin/fsdprun -n 4 bench/big_model.lua --eager $(BIG_ARGS)
	bin/fsdp-consolidate $(BIG_DIR)/sharded $(BIG_DIR)/full.safetensors
	bin/fsdprun -n 4 bench/big_model.lua --load $(BIG_DIR)/full.safetensors $(BIG_ARGS)
	bin/fsdprun -n 4 bench/big_model.lua --load-sharded $(BIG_DIR)/sharded $(BIG_ARGS)
	bin/fsdprun -n 2 bench/big_model.lua --load-sharded $(BIG_DIR)/sharded $(BIG_ARGS)
	rm -rf $(BIG_DIR)

# no prerequisites: demo.sh installs the packages first, then builds
demo:
	bash examples/demo.sh

# (GPT_STOP_AT=S: the first S steps only, as .ci/run does)
demo-gpt:
	DEMO_SCRIPT=gpt.lua bash examples/demo.sh $(if $(GPT_STOP_AT),--stop-at $(GPT_STOP_AT))

# ---- install ------------------------------------------------------------------------------------
# Lua modules, the libraries, the launchers and the examples; fsdp-examples-dir learns where the
# examples went. Prints the LUA_PATH/LUA_CPATH lines when LUADIR/LIBDIR are not on LuaJIT's path.
install: all
	mkdir -p $(DESTDIR)$(LUADIR)/fsdp $(DESTDIR)$(LIBDIR) $(DESTDIR)$(BINDIR) $(DESTDIR)$(EXAMPLESDIR)
	cp -r lua/fsdp/* $(DESTDIR)$(LUADIR)/fsdp/
	cp libfsdp.so $(DESTDIR)$(LIBDIR)/
	if [ -f libfsdp_mpi.so ]; then cp libfsdp_mpi.so $(DESTDIR)$(LIBDIR)/; fi
	if [ -f libfsdp_cuda.so ]; then cp libfsdp_cuda.so $(DESTDIR)$(LIBDIR)/; fi
	if [ -f libfsdp_nccl.so ]; then cp libfsdp_nccl.so $(DESTDIR)$(LIBDIR)/; fi
	cp bin/fsdprun bin/fsdp-consolidate $(DESTDIR)$(BINDIR)/
	sed 's|^installed=.*|installed="$(EXAMPLESDIR)"|' bin/fsdp-examples-dir > $(DESTDIR)$(BINDIR)/fsdp-examples-dir
	chmod 755 $(DESTDIR)$(BINDIR)/fsdp-examples-dir
	cp examples/*.lua examples/*.gp examples/*.py $(DESTDIR)$(EXAMPLESDIR)/
	@$(if $(LUAROCKS)$(DESTDIR),,LUADIR='$(LUADIR)' LIBDIR='$(LIBDIR)' BINDIR='$(BINDIR)' LUAJIT='$(LUAJIT)' bash tools/install_paths.sh)

clean:
	rm -rf build build-memcheck build-asan build-tsan doc libfsdp.so libfsdp_mpi.so libfsdp_cuda.so libfsdp_nccl.so libfsdp_cudaemu.so lua/fsdp/cdef.lua

.PHONY: all deps-build test test-run doc cudaemu cuda-emu-check cuda-emu-asan cuda-emu-tsan cuda-emu-matrix layers lint format format-check isa-check isa-emu-check memcheck memcheck-run asan-check tsan-check bench bench-loader bench-deps bench-fsdp bench-big demo demo-gpt install clean
