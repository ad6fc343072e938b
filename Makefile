# fsdp -- build libfsdp.so, run tests, benchmarks and the demo.
#   make            build libfsdp.so and lua/fsdp/cdef.lua
#   make test       C unit tests + busted specs (what .ci/run calls)
#   make bench      benchmarks against PyTorch (needs python3-torch, or PYTHON=a python with torch)
#   make demo       the main job: FSDP training on Fashion-MNIST (examples/train.lua)
#   make install PREFIX=/usr/local   (luarocks make uses LUADIR/LIBDIR/BINDIR instead)

CC      ?= cc
ARCH    ?= -march=native
CFLAGS  ?= -O3 $(ARCH) -g
CFLAGS  += -std=gnu11 -fPIC -Wall -Wextra -Wno-unused-parameter -fopenmp
BLAS_CFLAGS := $(shell pkg-config --cflags openblas 2>/dev/null)
BLAS_LIBS   := $(shell pkg-config --libs openblas 2>/dev/null || echo -lopenblas)
LDLIBS  = $(BLAS_LIBS) -lm -fopenmp

PREFIX  ?= /usr/local
LUADIR  ?= $(PREFIX)/share/lua/5.1
LIBDIR  ?= $(PREFIX)/lib/lua/5.1
BINDIR  ?= $(PREFIX)/bin

SRCS := $(filter-out src/comm_mpi.c,$(wildcard src/*.c))
OBJS := $(SRCS:src/%.c=build/%.o)
HDRS := $(wildcard src/*.h)
LUAJIT ?= luajit
BUSTED ?= $(shell command -v busted)

all: libfsdp.so lua/fsdp/cdef.lua

build/%.o: src/%.c $(HDRS) | build
	$(CC) $(CFLAGS) $(BLAS_CFLAGS) -c $< -o $@
# optimizer kernels: sqrtf without its errno branch (so the Adam loop vectorizes), and no FMA
# contraction, so an element's update never depends on where it falls in the vector loop
build/cpu_optim.o: CFLAGS += -fno-math-errno -ffp-contract=off

build:
	mkdir -p build

libfsdp.so: $(OBJS)
	$(CC) -shared -o $@ $(OBJS) $(LDLIBS)

# the MPI backend: its own library, so libfsdp.so never depends on MPI (comm.c dlopen()s it);
# built only where mpicc exists
MPICC ?= $(shell command -v mpicc 2>/dev/null)
ifneq ($(MPICC),)
all: libfsdp_mpi.so
endif
libfsdp_mpi.so: src/comm_mpi.c src/comm.h
	$(MPICC) $(CFLAGS) -shared -o $@ src/comm_mpi.c

# the FFI part of the public header, as a Lua string (the single source of truth for ffi.cdef)
lua/fsdp/cdef.lua: src/fsdp.h
	{ echo '-- generated from src/fsdp.h by make; do not edit'; echo 'return [==['; \
	  sed -n '\#^// FFI-BEGIN#,\#^// FFI-END#p' $< | grep -v '^// FFI-'; echo ']==]'; } > $@

# ---- tests -----------------------------------------------------------------------------------
CTESTS := $(patsubst tests/c/%.c,build/tests/%,$(wildcard tests/c/test_*.c))
build/tests/%: tests/c/%.c libfsdp.so tests/c/ctest.h
	@mkdir -p build/tests
	$(CC) $(CFLAGS) -Isrc $< -o $@ -L. -lfsdp -Wl,-rpath,'$$ORIGIN/../..' $(LDLIBS)

test: all $(CTESTS)
	@for t in $(CTESTS); do echo "== $$t"; $$t || exit 1; done
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 $(LUAJIT) $(BUSTED) tests

# the C tests under valgrind (leaks and invalid accesses are errors)
memcheck: all $(CTESTS)
	@for t in $(CTESTS); do echo "== valgrind $$t"; \
	  OMP_NUM_THREADS=1 valgrind -q --leak-check=full --errors-for-leak-kinds=definite --error-exitcode=1 $$t || exit 1; done

# libfsdp built with AddressSanitizer (build-asan/), then one short training run through LuaJIT
# with the sanitizer preloaded: invalid accesses and leaks at exit are errors
ASAN_LIB := $(shell $(CC) -print-file-name=libasan.so)
asan-check: lua/fsdp/cdef.lua
	mkdir -p build-asan
	$(CC) -O1 -g -fsanitize=address -fno-omit-frame-pointer -std=gnu11 -fPIC -fopenmp $(BLAS_CFLAGS) -shared \
	  -o build-asan/libfsdp.so $(SRCS) $(LDLIBS)
	ASAN_OPTIONS=detect_leaks=1 LD_PRELOAD=$(ASAN_LIB) \
	  LUA_CPATH='build-asan/?.so' OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(LUAJIT) tests/scripts/train_short.lua

bench: all
	OPENBLAS_NUM_THREADS=$${THREADS:-2} OMP_NUM_THREADS=$${THREADS:-2} $(LUAJIT) bench/run.lua $(if $(PYTHON),--python $(PYTHON))

# FSDP benchmarks through bin/fsdprun: memory at N = 1, 2, 4; step time at N = 2 (full vs no
# shard, and against PyTorch DDP over gloo). See bench/README.md, "FSDP benchmarks".
bench-fsdp: all
	$(LUAJIT) bench/fsdp_memory.lua && $(LUAJIT) bench/fsdp_speed.lua

demo: all
	bash examples/demo.sh

install: all
	mkdir -p $(DESTDIR)$(LUADIR)/fsdp $(DESTDIR)$(LIBDIR) $(DESTDIR)$(BINDIR)
	cp -r lua/fsdp/* $(DESTDIR)$(LUADIR)/fsdp/
	cp libfsdp.so $(DESTDIR)$(LIBDIR)/
	if [ -f libfsdp_mpi.so ]; then cp libfsdp_mpi.so $(DESTDIR)$(LIBDIR)/; fi
	if [ -d bin ]; then cp bin/* $(DESTDIR)$(BINDIR)/; fi

clean:
	rm -rf build libfsdp.so libfsdp_mpi.so lua/fsdp/cdef.lua

.PHONY: all test memcheck asan-check bench bench-fsdp demo install clean
