/*
 * comm_bench.c -- the timing loop behind bench/comm.lua: fsdp's collectives and the raw MPI
 * calls they compete with, interleaved in one MPI job so machine noise hits both alike.
 *
 * MPI is initialized here (MPI_THREAD_SERIALIZED); libfsdp's mpi backend then joins it and its
 * communication thread makes the fsdp calls, while raw calls are made from this thread only
 * while fsdp is idle (every fsdp call is waited before the next raw one), as SERIALIZED allows.
 *
 * For each full-buffer size (argv) and each of `rounds` rounds, every case is timed over a
 * batch of back-to-back blocking calls; rank 0 prints "<case> <bytes> <seconds per call>" with
 * the slowest rank's time, median over rounds:
 *   ours_ag       fsdp_all_gather (queue, thread hand-off, collective check, MPI_Allgather)
 *   raw_ag        MPI_Allgather
 *   ours_ring     fsdp_reduce_scatter, algorithm 0 (ring of MPI_Sendrecv + vectorized sum)
 *   ours_block    fsdp_reduce_scatter, algorithm 1 (MPI_Reduce_scatter_block)
 *   raw_block     MPI_Reduce_scatter_block
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp.h"

enum { OURS_AG, RAW_AG, OURS_RING, OURS_BLOCK, RAW_BLOCK, NCASE };
static const char* names[NCASE] = {"ours_ag", "raw_ag", "ours_ring", "ours_block", "raw_block"};

static fsdp_tensor *full_t, *part_t;

static void run(int c) {
  fsdp_work* w = NULL;
  switch (c) {
    case OURS_AG: w = fsdp_all_gather(full_t, part_t, "bench"); break;
    case OURS_RING:
      fsdp_comm_set_reduce_scatter_algo(0);
      w = fsdp_reduce_scatter(part_t, full_t, FSDP_REDUCE_SUM, "bench");
      break;
    case OURS_BLOCK:
      fsdp_comm_set_reduce_scatter_algo(1);
      w = fsdp_reduce_scatter(part_t, full_t, FSDP_REDUCE_SUM, "bench");
      break;
    case RAW_AG: {
      int n = (int)fsdp_tensor_numel(part_t) * 4;
      MPI_Allgather(fsdp_tensor_data(part_t), n, MPI_BYTE, fsdp_tensor_data(full_t), n, MPI_BYTE, MPI_COMM_WORLD);
      return;
    }
    case RAW_BLOCK:
      MPI_Reduce_scatter_block(fsdp_tensor_data(full_t), fsdp_tensor_data(part_t), (int)fsdp_tensor_numel(part_t),
                               MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      return;
  }
  if (!w || fsdp_work_wait(w) != 0) {
    fprintf(stderr, "comm_bench: %s failed: %s\n", names[c], fsdp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  fsdp_work_free(w);
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  int provided = 0, rank, size, rounds = 5;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (provided < MPI_THREAD_SERIALIZED || fsdp_comm_init("mpi") != 0) {
    fprintf(stderr, "comm_bench: thread level %d; %s\n", provided, fsdp_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  for (int a = 1; a < argc; a++) {
    int64_t per = (int64_t)(strtoull(argv[a], NULL, 10) / size / 4);  // floats per rank
    int64_t sfull[1] = {per * size}, spart[1] = {per};
    full_t = fsdp_randn(1, sfull, 0, 1);
    part_t = fsdp_randn(1, spart, 0, 1);
    long bytes = (long)(per * size * 4);
    int iters = (int)(64l * 1024 * 1024 / bytes);
    iters = iters < 3 ? 3 : iters > 100 ? 100 : iters;
    double t[NCASE][16];
    for (int c = 0; c < NCASE; c++) run(c), run(c);  // warm up every path
    for (int round = 0; round < rounds; round++) {
      for (int c = 0; c < NCASE; c++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) run(c);
        double dt = (MPI_Wtime() - t0) / iters;
        MPI_Allreduce(&dt, &t[c][round], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      }
    }
    for (int c = 0; c < NCASE && rank == 0; c++) {
      qsort(t[c], rounds, sizeof(double), cmp);
      printf("%s %ld %.9f\n", names[c], bytes, t[c][rounds / 2]);
    }
    fflush(stdout);
    fsdp_tensor_release(full_t);
    fsdp_tensor_release(part_t);
  }
  fsdp_comm_finalize();
  MPI_Finalize();
  return 0;
}
