#pragma once
// Per-rank routing tables of one param group (docs/ARCHITECTURE.md "One step";
// Megatron-LM's layer-sharded Muon, route_to_ns_home / route_from_ns_home).
// Built once per (specs, homes, domain, rank); a step only packs, calls
// all_to_allv and unpacks. Nothing is computed per step.
//
// Matrices a step keeps per param i (all row-major, element type the step's):
//   L_i   local shard, spec.local_shape (momentum / NS input on this rank)
//   A1_i  stage-1 matrix: TpLocalShape(spec) = the TP-local matrix, padding
//         stripped. For a param with no stage 1 (kTp) A1_i IS L_i.
//   A2_i  stage-2 matrix: spec.full_shape (only on the TP home).
//   U*_i  the NS update in the same shapes, flowing back.
// Stage 1 (GTP group = ranks (g', my_t), g' = 0..G-1, peer index g'):
//   forward  packs from L_i,  unpacks into A1_i on every rank of row g_home;
//   reverse  packs from U1_i, unpacks into UL_i (the update of the local
//   shard). Rank g's block starts at row GtpRowBlockOf(spec, g).start of A1_i
//   (prefix sums of gtp_rows for uneven blocks). Padding rows are never sent:
//   a rank sends only its real rows (none from a 0-row shard: no piece) and,
//   on the way back, zero-fills its pad rows (`reverse_zero_fill`).
// Stage 2 (TP group = ranks (my_g, t'), t' = 0..T-1, peer index t'), one
// exchange per tp_dim present among the specs, in tp_dim order:
//   forward  packs from A1_i (L_i for kTp), unpacks into A2_i on (g_home,
//   t_home); reverse  packs from U2_i, unpacks into U1_i.
// Buffers are packed [data for peer 0 | data for peer 1 | ...]; within a peer
// segment pieces are in param (spec) order, each block flattened row-major.
// Counts and offsets are in elements. Zero-size segments are normal (idle
// ranks, uneven homes).
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/planner.h"
#include "core/plan/sharding.h"

namespace muond {

// A rectangle of a row-major matrix: rows [row0, row0 + rows) x cols
// [col0, col0 + cols).
struct Block {
  int64_t row0 = 0;
  int64_t col0 = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t numel() const { return rows * cols; }
  bool operator==(const Block& o) const {
    return row0 == o.row0 && col0 == o.col0 && rows == o.rows && cols == o.cols;
  }
};

// One contiguous run of a packed buffer <-> one block of one param's matrix.
struct Piece {
  int param = -1;      // index into GroupExchangePlan::specs
  Block block;         // of the source matrix (pack) / destination (unpack)
  int64_t offset = 0;  // elements from the start of the whole buffer
};

// The arguments of one all_to_allv call plus how to pack and unpack it.
struct AllToAllvPlan {
  std::vector<std::vector<Piece>> send;  // [peer] pieces to pack, in order
  std::vector<std::vector<Piece>> recv;  // [peer] pieces to unpack, in order
  std::vector<int64_t> send_counts, send_displs;  // [peer], elements
  std::vector<int64_t> recv_counts, recv_displs;  // [peer], elements
  int64_t total_send = 0;
  int64_t total_recv = 0;
};

struct ZeroFill {
  int param = -1;
  Block block;  // rows of the destination matrix to set to 0
};

// A param this rank assembles in a stage, and the assembled matrix's shape.
struct AssembledParam {
  int param = -1;
  int64_t rows = 0;
  int64_t cols = 0;
};

// One exchange over one group (stage 1, or stage 2 for one tp_dim).
struct StageExchange {
  int tp_dim = -1;               // stage 2 only: 0 or 1
  std::vector<int> group_ranks;  // flat domain ranks of the group, peer order
  int my_peer = 0;               // this rank's index in group_ranks
  // True when some member of THIS group moves data. Every member computes the
  // same value, so skipping an inactive exchange cannot deadlock.
  bool active = false;
  AllToAllvPlan forward;
  AllToAllvPlan reverse;
  // Params this rank assembles (forward destination = reverse source), in
  // param order, with the assembled shape (stage 1: TpLocalShape; stage 2:
  // full_shape).
  std::vector<AssembledParam> assembled;
  // Stage 1 reverse only: pad rows of UL_i to zero after unpacking.
  std::vector<ZeroFill> reverse_zero_fill;
};

struct GroupExchangePlan {
  DomainSize domain;
  int my_g = 0;
  int my_t = 0;
  std::vector<ParamShardSpec> specs;
  std::vector<NsHome> homes;    // normalized: replicated {0,0}, GTP_REMAT t=0
  std::vector<int> replicated;  // every rank runs local NS on L_i
  std::vector<int> routed;      // all params that move (param order)
  // Stage 1; absent (has_stage1 false) when no param is GTP-sharded.
  bool has_stage1 = false;
  StageExchange stage1;
  // Stage 2, one per tp_dim present among the TP-sharded specs (ascending).
  std::vector<StageExchange> stage2;
  // NS work of this rank, in param order:
  // home-owned TP-sharded params, NS on A2_i (full matrix after stage 2)
  std::vector<int> ns_after_stage2;
  // GTP_REMAT params of this row: TP-complete after stage 1, NS on A1_i on
  // every TP rank of the row. Run them as their own batches so chunking is
  // identical on every TP column.
  std::vector<int> ns_tp_complete;
  // Largest forward/reverse buffers over all exchanges (preallocate once).
  int64_t max_send_elems = 0;
  int64_t max_recv_elems = 0;
};

// One home per spec, each home replica d in [0, dp) (InvalidArgument naming
// the param otherwise): the rule both exchange plans of a group check.
absl::Status CheckNsHomeReplicas(const std::vector<ParamShardSpec>& specs,
                                 const std::vector<NsHome>& homes, int dp);

// Builds the plan of rank (my_g, my_t) of replica my_d. homes: one per spec
// (PlanNsHomes or RoundRobinHomes output); the t of a GTP_REMAT home and the
// (g, t) of a replicated param's home are ignored. Only the params homed in
// replica my_d (home.d == my_d) take part; the others appear in no list of
// the plan (their update comes from their home replica: replica_exchange.h).
// Errors (InvalidArgument, naming the param): invalid spec for the domain and
// rank (ValidateShardSpec(spec, domain, my_g): local rows = gtp_rows[my_g]),
// homes/specs size mismatch, a home outside the domain (d included),
// (my_d, my_g, my_t) outside the domain.
absl::StatusOr<GroupExchangePlan> BuildGroupExchangePlan(
    std::vector<ParamShardSpec> specs, std::vector<NsHome> homes,
    DomainSize domain, int my_g, int my_t, int my_d = 0);

}  // namespace muond
