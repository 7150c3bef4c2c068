#pragma once
// The Muon variants' phase of a step (core/muon/muon_variant.h), run after
// dp_share, before the commit vote, on L_i (the unscaled update every rank
// holds for its local shard), and their commit.
//
// AdaMuon is elementwise: each rank renormalises its own shard with its own
// shard of the state (staged out of place, swapped in at the commit, as
// momentum), so every layout computes the same bits.
//
// NorMuon needs, per param, every row's sum of squares over the full row and
// two sums over the whole matrix. The group is one row set on the backend
// (Backend::NorMuonRowStats / NorMuonNormalize: a few launches for the whole
// group on CUDA, and no host step). Each rank writes the row sums of its
// local rows with the state of those rows into the statistics, 2 x full-rows
// floats per param, only the rows it speaks for (zeros elsewhere); the domain
// all_gathers them over the gtp group, then over the tp group, and adds the
// contributions in rank order (Backend::SumSlices). A row has one speaker,
// except under tp_dim 1, where each TP rank adds its columns' partial sum (in
// t order) and t = 0 speaks for the state; a TP- or GTP-replicated copy is
// silent. Every rank then has the full row sums and state and computes the
// factors from them in the backend's fixed order: the same bits on every
// rank, and (for whole rows: no TP column split) those of the single-process
// path (MuonVariantFullMatrix, the same calls on one block). Under tp_dim 1 a
// row sum is the sum of T rounded partial sums: within fp32 rounding of the
// single-process one. Each rank stages its rows' new state until the commit
// and keeps their factors, which the update applies to L_i as it writes the
// param (NorMuonRowFactorsOf; one pass over L_i less than scaling it here).
//
// A skipped param is left alone (its state is kept; L_i stays zero).
#include <set>
#include <string>

#include "absl/status/status.h"
#include "core/muon/muon_update.h"
#include "core/step/group_state.h"

namespace muond {

// The variant state of a Muon group's params, zeroed (nothing for kMuon).
// Adds its bytes to the group's state_bytes / staging_bytes.
absl::Status AllocateVariantState(GroupState& group);

// Renormalises every L_i of the group by its variant (nothing for kMuon) and
// stages the new state. Collective for NorMuon (every rank of the domain).
absl::Status VariantPhase(GroupState& group, const MuonOptions& options,
                          const std::set<std::string>& skip);

// NorMuon: param i's row factors of this step (local rows x 1, fp32), valid
// after VariantPhase until the next step.
MatrixView NorMuonRowFactorsOf(const GroupState& group, size_t i);

// After the commit vote: the staged variant state becomes the state (not for
// a skipped param). Local only.
absl::Status CommitVariantState(GroupState& group, const MuonOptions& options,
                                const std::set<std::string>& skip);

}  // namespace muond
