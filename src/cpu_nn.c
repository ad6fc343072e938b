/*
 * cpu_nn.c -- CPU kernels of the nn family (see kernels_nn.h).
 */
#include "internal.h"

const fsdp_nn_kernels fsdp_cpu_nn_kernels = {0};
