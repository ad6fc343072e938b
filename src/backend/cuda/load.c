/*
 * backend/cuda/load.c -- part of libfsdp.so: finds out whether this machine can run the CUDA
 * backend and, the first time someone asks, loads it. Cheap checks come first and touch nothing
 * of CUDA's runtime, so a machine without a GPU never loads libfsdp_cuda.so:
 *   1. the driver: dlopen("libcuda.so.1") and cuInit(0)        -> "no NVIDIA driver ..."
 *   2. a device: cuDeviceGetCount()                             -> "no CUDA device ..."
 *   3. the library: libfsdp_cuda.so (FSDP_CUDA_LIB, next to libfsdp.so, the search path)
 *                                                               -> "libfsdp_cuda.so is missing ..."
 *   4. its init (compute stream, memory pool, cuBLASLt) and the registration of its device table
 *      for FSDP_CUDA, which checks that every entry is there.
 * The outcome is kept: fsdp_cuda_why_not() names the first check that failed.
 *
 * FSDP_CUDA_EMU=1 (tests only): the CUDA executor stands in for the GPU -- libfsdp_cudaemu.so, the
 * same .cu files compiled for the CPU (tests/cudaemu), loads in place of libfsdp_cuda.so
 * (FSDP_CUDA_EMU_LIB, next to libfsdp.so, the search path), with no driver to ask; everything
 * after the load is the same.
 */
#include "core/core.h"
#include "backend/cuda/cuda.h"

#include <dlfcn.h>
#include <pthread.h>

typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_count_fn)(int*);
typedef int (*cu_version_fn)(int*);

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_available, g_count, g_driver_version, g_index;
static char g_why[1024], g_name[256], g_versions[256];
static const fsdp_cuda_library* g_lib;

static void host_error(const char* msg) { fsdp_errorf("%s", msg); }
static const fsdp_cuda_host g_host = {FSDP_CUDA_ABI, host_error, fsdp_check_report};

static int emulated(void) {
  const char* e = getenv("FSDP_CUDA_EMU");
  return e && e[0] == '1';
}

// libfsdp_cuda.so's table (libfsdp_cudaemu.so's under FSDP_CUDA_EMU=1), loaded (not initialized:
// no GPU needed); NULL with the reason in why
static const fsdp_cuda_library* load_library(char* why, size_t why_len) {
  char tried[700];
  int emu = emulated();
  const char* name = emu ? "libfsdp_cudaemu.so" : "libfsdp_cuda.so";
  // RTLD_LOCAL: its CUDA libraries stay out of the global namespace
  void* h = fsdp_dlopen_backend(emu ? "FSDP_CUDA_EMU_LIB" : "FSDP_CUDA_LIB", name, RTLD_NOW | RTLD_LOCAL, tried,
                                sizeof tried);
  if (!h) {
    snprintf(why, why_len, "%s is missing or cannot load (%s); build it with `make%s`%s, or point %s at it", name,
             tried, emu ? " cudaemu" : "", emu ? "" : " on a machine with nvcc",
             emu ? "FSDP_CUDA_EMU_LIB" : "FSDP_CUDA_LIB");
    return NULL;
  }
  fsdp_cuda_library_getter get = (fsdp_cuda_library_getter)dlsym(h, "fsdp_cuda_library_get");
  const fsdp_cuda_library* lib = get ? get() : NULL;
  if (!lib || lib->abi != FSDP_CUDA_ABI) {
    snprintf(why, why_len, "libfsdp_cuda.so was built for another libfsdp (ABI %d, expected %d); rebuild with make",
             lib ? lib->abi : -1, FSDP_CUDA_ABI);
    return NULL;
  }
  return lib;
}

// loads, initializes and registers the library for device g_index
static void attach(void) {
  const fsdp_cuda_library* lib = load_library(g_why, sizeof g_why);
  if (!lib) return;
  if (lib->init(&g_host, g_index, g_why, sizeof g_why)) return;
  if (fsdp_backend_register(FSDP_CUDA, lib->table)) {
    snprintf(g_why, sizeof g_why, "%s", fsdp_last_error());
    return;
  }
  size_t free_b = 0, total_b = 0;
  lib->device_info(g_name, sizeof g_name, &free_b, &total_b);
  lib->versions(g_versions, sizeof g_versions);
  g_lib = lib;
  g_available = 1;
}

static void probe(void) {
  g_why[0] = 0;
  if (emulated()) {  // one device, the executor's
    g_count = 1;
    g_index = 0;
    attach();
    return;
  }
  void* drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!drv) {
    const char* e = dlerror();
    snprintf(g_why, sizeof g_why, "no NVIDIA driver (%s)", e ? e : "libcuda.so.1 not found");
    return;
  }
  cu_init_fn cu_init = (cu_init_fn)dlsym(drv, "cuInit");
  cu_count_fn cu_count = (cu_count_fn)dlsym(drv, "cuDeviceGetCount");
  cu_version_fn cu_version = (cu_version_fn)dlsym(drv, "cuDriverGetVersion");
  if (!cu_init || !cu_count) {
    snprintf(g_why, sizeof g_why, "no NVIDIA driver (libcuda.so.1 has no cuInit/cuDeviceGetCount)");
    return;
  }
  if (cu_version) cu_version(&g_driver_version);
  int rc = cu_init(0);
  if (rc == 100) {  // CUDA_ERROR_NO_DEVICE
    snprintf(g_why, sizeof g_why, "no CUDA device (the driver sees none)");
    return;
  }
  if (rc != 0) {
    snprintf(g_why, sizeof g_why, "the NVIDIA driver does not start (cuInit error %d)", rc);
    return;
  }
  if (cu_count(&g_count) != 0 || g_count <= 0) {
    g_count = 0;
    snprintf(g_why, sizeof g_why, "no CUDA device (the driver sees none)");
    return;
  }
  // this process's GPU: FSDP_CUDA_DEVICE, else the launcher's local rank (one GPU per rank on a
  // node, as torchrun's LOCAL_RANK), round robin when ranks outnumber GPUs, else the first
  const char* pick = getenv("FSDP_CUDA_DEVICE");
  const char* local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  if (!local) local = getenv("LOCAL_RANK");
  if (pick && *pick) {
    g_index = atoi(pick);
    if (g_index < 0 || g_index >= g_count) {
      snprintf(g_why, sizeof g_why, "FSDP_CUDA_DEVICE=%s is not a device (the driver sees %d)", pick, g_count);
      return;
    }
  } else {
    g_index = local && atoi(local) > 0 ? atoi(local) % g_count : 0;
  }
  attach();
}

int fsdp_cuda_is_available(void) {
  pthread_once(&g_once, probe);
  return g_available;
}
const char* fsdp_cuda_why_not(void) {
  pthread_once(&g_once, probe);
  return g_why;
}
int fsdp_cuda_device_count(void) {
  pthread_once(&g_once, probe);
  return g_count;
}
int fsdp_cuda_current_device(void) {
  pthread_once(&g_once, probe);
  return g_index;
}
const char* fsdp_cuda_device_name(void) {
  pthread_once(&g_once, probe);
  return g_name;
}
const char* fsdp_cuda_versions(void) {
  pthread_once(&g_once, probe);
  if (!g_lib) snprintf(g_versions, sizeof g_versions, "driver %d", g_driver_version);
  return g_versions;
}
int fsdp_cuda_synchronize(void) {  // (the device's backend: the real one, or the tests' double)
  CHECK_INT(fsdp_device_has_backend(FSDP_CUDA) || fsdp_cuda_is_available(),
            "cuda.synchronize: CUDA is not available: %s", fsdp_cuda_why_not());
  return fsdp_backend_for(FSDP_CUDA)->synchronize();
}

int fsdp_cuda_check_library(void) {
  char why[2048];
  const fsdp_cuda_library* lib = load_library(why, sizeof why);
  CHECK_INT(lib, "%s", why);
  return fsdp_backend_check(lib->table);
}
