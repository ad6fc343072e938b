/*
 * backend/testdev/testdev.h -- what the stand-in communicator (standin.c) uses of the test double
 * of a GPU beyond its device table (internal).
 */
#ifndef FSDP_TESTDEV_H
#define FSDP_TESTDEV_H
#include <stddef.h>

int fsdp_testdev_installed(void);
// a host function queued on one of the double's streams (as cudaLaunchHostFunc)
void fsdp_testdev_launch(void* stream, void (*fn)(void*), void* arg);
// bytes moved between device and host memory by a stream's host function, as a DMA engine would:
// no wait on the compute stream, no deferred check reported, no sync counted
void fsdp_testdev_move(void* dst, const void* src, size_t nbytes);
void fsdp_testdev_poison(void* p, size_t nbytes);

#endif
