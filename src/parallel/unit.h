/*
 * parallel/unit.h -- the FSDP unit, shared by shard.c (layout, buffers, collectives) and sched.c
 * (lifecycle, engine events). Not part of the public API.
 *
 * Layout of one unit on rank r of W (W = 1 for NO_SHARD):
 *   parameter p, numel n_p, is cut into W chunks of c_p = ceil(n_p / W) flat elements;
 *   rank r owns elements [r*c_p, min(n_p, (r+1)*c_p)) -- its "piece", maybe shorter or empty.
 *   group g (0 = trainable, 1 = frozen) has
 *     shard: the chunks of its parameters, back to back (S_g = sum c_p elements, padded per chunk)
 *     full:  the gathered parameters, back to back in their own order (F_g = sum n_p elements)
 *   all-gather:     shard (S_g) of every rank -> staging (W * S_g, rank-major) -> copy-out to full
 *   reduce-scatter: full grads -> copy-in to staging (W * S_g, rank-major) -> this rank's S_g sums
 * Shards (the master copy) and gradient pieces are float32. The full buffers hold the dtype they
 * were gathered in: the unit's param dtype for forward and backward (bfloat16 under mixed
 * precision: parameters are then bfloat16 tensors, and the unit computes in bfloat16), float32 for
 * summon_full_params and for parameters leaving the unit (their exact values).
 * A parameter tensor switches between two forms in place (same C struct, so Lua, optimizers and
 * autograd edges keep seeing one object): the piece view of shard, and the full view of full.
 */
#ifndef FSDP_UNIT_H
#define FSDP_UNIT_H

#include "core/core.h"

typedef struct unit_param {
  fsdp_tensor* t;  // the user's parameter (owning ref)
  char* name;
  int ndim;
  int64_t shape[FSDP_MAX_DIMS];  // full shape
  int64_t numel, chunk;          // chunk = ceil(numel / W)
  int64_t start, len;            // this rank's piece
  int group;                     // 0 trainable, 1 frozen
  int64_t shard_off;             // offset of the chunk in the group's shard buffer (elements)
  int64_t full_off;              // offset of the parameter in the group's full buffer
  int rg_at_forward;             // requires_grad when the last forward ran (checked in backward)
  fsdp_tensor* stash;            // inside a backward: the reduced .grad piece from before it, set aside
  int grad_is_local;             // .grad is a local gradient (below), while .grad_sets == local_stamp
  unsigned local_stamp;          // the parameter's grad_sets when its .grad became local
  int got_grad;                  // got a gradient in this backward
} unit_param;

// Gradient accumulation. Between backwards a trainable parameter's .grad alone holds everything
// accumulated since it was last cleared, in one of two forms:
//   reduced  this rank's piece of the gradient averaged over ranks (after a synced backward)
//   local    this rank's full unreduced gradient, float32 (after a no_sync backward): the
//            average over ranks of its pieces is the parameter's gradient piece
// A synced backward turns local into reduced (reduce-scatter); a no_sync one leaves it local.
// Inside a backward a reduced piece waits aside (stash) while the engine writes the new full
// gradient into .grad; it rejoins when the backward's gradient is known: added to the reduced
// result (synced), or folded into the local gradient as W times itself at its own elements
// (no_sync: the next reduction averages over the W ranks that hold those elements; with
// replicas, over each replica's copy of the same piece, so W is the factor there too). Any
// assignment to .grad (zero_grad, p.grad = g) ends the local form: an assigned gradient has the
// piece's shape, so it is a reduced one.
static inline int grad_is_local(const unit_param* p) {
  return p->grad_is_local && p->t->grad && p->t->grad_sets == p->local_stamp;
}

typedef struct unit_group {
  int64_t shard_numel, full_numel;
  fsdp_storage* shard;  // PARAMS, always allocated
  fsdp_storage* full;   // PARAMS; == shard when the unit needs no separate full buffer
  fsdp_work* gather;    // all-gather in flight into gather_recv
  fsdp_tensor *gather_send, *gather_recv;
} unit_group;

struct fsdp_unit {
  char* path;
  fsdp_unit_options opts;
  int W, rank;        // layout world (1 for NO_SHARD) and this rank
  int device;         // where its parameters live (all on one), and so its buffers (0, cpu, until set)
  int separate_full;  // gathered buffers are separate from the shards (W > 1 or low precision)
  int n;
  unit_param* p;
  unit_group g[2];
  int state;        // fsdp_unit_phase
  int gathered;     // full buffers hold the current values
  int full_dtype;   // ... in this dtype (the param dtype, or float32 for full precision)
  int is_root;      // root of the current forward pass
  int sync_grads;   // 0 inside no_sync
  int order_index;  // position in the last forward order, -1 if not reached
  int has_bw_node;  // mark_output gave an output of this forward pass a pre-backward node
  double trace_t0;  // when its forward began (fsdp_trace_now), for the trace's slice
  int trace_bw;     // its backward slice is open on the trace
  // backward bookkeeping
  int64_t pass;         // backward pass the counters below belong to
  int expected, ready;  // trainable params that will get / got their gradient this pass
  fsdp_work* reduce;    // reduce-scatter (or all-reduce) in flight
  fsdp_tensor *reduce_send, *reduce_recv;
  int reduced_pending;  // reduce issued; grads are assigned when it completes
};

// shard.c
int fsdp_shard_layout(fsdp_unit* u);  // (re)builds buffers from the params' groups
// gathers in `dtype`: the param dtype (compute) or FSDP_F32 (full precision)
int fsdp_shard_gather_start(fsdp_unit* u, int dtype);   // issues the all-gathers (no-op if gathered)
int fsdp_shard_gather_finish(fsdp_unit* u, int dtype);  // waits, copies out, params take full form
int fsdp_shard_reshard(fsdp_unit* u, int writeback);    // frees full buffers, params take piece form
int fsdp_shard_reduce_start(fsdp_unit* u);              // copy-in grads, issue reduce-scatter
int fsdp_shard_reduce_finish(fsdp_unit* u);             // waits, assigns piece grads (+ stash)
void fsdp_shard_set_form(fsdp_unit* u, int full);       // points every param at full or piece view
int fsdp_shard_requires_relayout(const fsdp_unit* u);   // a param's requires_grad moved it between groups
int fsdp_shard_release_param(fsdp_unit* u, int i);      // param i becomes a standalone full tensor

// sched.c
extern fsdp_unit** fsdp_units;  // every unit, in creation order (the order collectives are issued in)
extern int fsdp_n_units;

#endif
