/*
 * cpu_optim.c -- CPU kernels of the optim family (see kernels_optim.h).
 */
#include "internal.h"

const fsdp_optim_kernels fsdp_cpu_optim_kernels = {0};
