/*
 * tests/cudaemu/runtime.h -- what the executor's library stand-ins (blaslt.cc for cuBLASLt,
 * dnn.cc for cuDNN) share with its runtime (runtime.cc): queueing work on a stream, and checking
 * that a pointer is device memory of at least n bytes.
 */
#ifndef FSDP_CUDAEMU_RUNTIME_H
#define FSDP_CUDAEMU_RUNTIME_H

#include <cuda_runtime.h>

#include <functional>

namespace fsdp_emu {
// runs fn on stream s in issue order (s == 0: now, on the caller's thread); `what` names it in
// the messages of the stream's errors
void enqueue(cudaStream_t s, const char* what, std::function<void()> fn);
// whether [p, p + n) lies inside one device allocation (n == 0: p inside one)
bool is_device(const void* p, size_t n);
// a kernel-like failure found while running on a stream (a library stand-in's refusal): sticky,
// reported by the next synchronising call with this message; also printed at once
void fail_sticky(cudaError_t e, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// whether a kernel failed: the context runs nothing more (queued library work is skipped too)
bool failed(void);
}  // namespace fsdp_emu

#endif
