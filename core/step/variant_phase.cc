#include "core/step/variant_phase.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "core/muon/muon_variant.h"
#include "core/plan/sharding.h"

namespace muond {
namespace {

constexpr DType kF32 = DType::kFloat32;

float* Floats(const OwnedBuffer& b) { return static_cast<float*>(b.data()); }

// Where a param's local rows sit in its full matrix, and what this rank
// contributes to the domain's row statistics (variant_phase.h).
struct RowMap {
  int64_t global0 = 0;  // full-matrix row of local row 0
  int64_t valid = 0;    // local rows that are real (the rest is GTP padding)
  bool sums = false;    // adds its row sums (partial under tp_dim 1)
  bool state = false;   // speaks for the rows' state
};

RowMap RowMapOf(const ParamShardSpec& spec, const DomainBinding& d) {
  const DomainSize size = d.size;
  const int64_t tp_rows = TpLocalShape(spec, size)[0];
  RowMap m;
  m.global0 = (spec.tp_dim == 0 ? d.t * tp_rows : 0) +
              GtpRowBlockOf(spec, size, d.g).start;
  m.valid = ValidLocalRows(spec, size, d.g);
  const bool gtp_copy = size.gtp > 1 && !spec.gtp_sharded && d.g != 0;
  const bool tp_copy = size.tp > 1 && spec.tp_dim == -1 && d.t != 0;
  m.sums = !gtp_copy && !tp_copy;
  m.state = m.sums && !(spec.tp_dim == 1 && d.t != 0);
  return m;
}

int64_t FullRows(const ParamState& p) { return p.spec.full_shape[0]; }

MatrixView Rows(const OwnedBuffer& b, int64_t offset, int64_t rows) {
  return ContiguousView(Floats(b) + offset, kF32, rows, 1);
}

// The group's params as one NorMuon row set (Backend::NorMuonRowStats).
std::vector<NorMuonRowBlock> RowBlocks(const GroupState& group,
                                       const MuonOptions& options,
                                       const std::set<std::string>& skip) {
  std::vector<NorMuonRowBlock> blocks;
  blocks.reserve(group.params.size());
  int64_t stats_at = 0;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const ParamState& p = group.params[i];
    const RowMap m = RowMapOf(p.spec, group.config.domain);
    blocks.push_back({.update = UpdateOf(group, options, i),
                      .row_offset = group.normuon.offset[i],
                      .stats_offset = stats_at,
                      .full_rows = FullRows(p),
                      .full_cols = p.spec.full_shape[1],
                      .global0 = m.global0,
                      .valid = m.valid,
                      .adds_sums = m.sums,
                      .speaks_state = m.state,
                      .skip = skip.contains(group.config.params[i].name)});
    stats_at += 2 * FullRows(p);
  }
  return blocks;
}

// The statistics <- the sum, in rank order, of every rank's statistics over
// the gtp group, then over the tp group (on the backend's memory: no host
// step).
// A local failure (`local`, and one in a sum here) does not skip a gather:
// the peers wait for it (the step is refused after); a communicator's does.
absl::Status GatherRowStats(GroupState& group, absl::Status local) {
  const NorMuonRows& rows = group.normuon;
  const DomainBinding& d = group.config.domain;
  for (Communicator* comm : {d.gtp, d.tp}) {
    if (comm == nullptr || comm->size() <= 1 || rows.slots == 0) continue;
    float* stats = Floats(rows.stats_buf);
    float* recv = stats + rows.slots;
    RETURN_IF_ERROR(comm->AllGather(stats, rows.slots, recv, kF32));
    RETURN_IF_ERROR(comm->Wait());
    if (!local.ok()) continue;
    local = group.backend->SumSlices(
        ContiguousView(recv, kF32, comm->size(), rows.slots),
        Rows(rows.stats_buf, 0, rows.slots));
  }
  return local;
}

absl::Status NorMuonPhase(GroupState& group, const MuonOptions& options,
                          const std::set<std::string>& skip) {
  Backend& backend = *group.backend;
  const NorMuonRows& rows = group.normuon;
  const std::vector<NorMuonRowBlock> blocks = RowBlocks(group, options, skip);
  const MatrixView state = Rows(rows.state_buf, 0, rows.total_rows);
  const MatrixView stats = Rows(rows.stats_buf, 0, rows.slots);
  RETURN_IF_ERROR(
      GatherRowStats(group, backend.NorMuonRowStats(blocks, state, stats)));
  return backend.NorMuonFactors(blocks, stats, state,
                                Rows(rows.staged_buf, 0, rows.total_rows),
                                Rows(rows.factors_buf, 0, rows.total_rows),
                                options.beta2, options.moment2_eps);
}

absl::Status AdaMuonPhase(GroupState& group, const MuonOptions& options,
                          const std::set<std::string>& skip) {
  std::vector<MatrixView> updates, v_in, v_out;
  for (size_t i = 0; i < group.params.size(); ++i) {
    if (skip.contains(group.config.params[i].name)) continue;
    const ParamState& p = group.params[i];
    updates.push_back(UpdateOf(group, options, i));
    v_in.push_back(p.moment2);
    v_out.push_back(p.staged_moment2);
  }
  return group.backend->AdaMuonNormalizeBatch(
      updates, v_in, v_out, options.beta2,
      static_cast<float>(options.moment2_eps));
}

// Points every param's moment2 at its rows of the state buffer.
void ViewNorMuonState(GroupState& group) {
  for (size_t i = 0; i < group.params.size(); ++i) {
    group.params[i].moment2 =
        Rows(group.normuon.state_buf, group.normuon.offset[i],
             group.params[i].spec.local_shape[0]);
  }
}

absl::Status AllocateNorMuonRows(GroupState& group) {
  NorMuonRows& rows = group.normuon;
  rows.offset.clear();
  rows.total_rows = rows.slots = 0;
  for (const ParamState& p : group.params) {
    rows.offset.push_back(rows.total_rows);
    rows.total_rows += p.spec.local_shape[0];
    rows.slots += 2 * FullRows(p);
  }
  const DomainBinding& d = group.config.domain;
  const int64_t widest = std::max<int64_t>(d.size.gtp, d.size.tp);
  Backend* b = group.backend;
  ASSIGN_OR_RETURN(rows.state_buf, AllocateZeroed(b, kF32, rows.total_rows, 1));
  ASSIGN_OR_RETURN(rows.staged_buf,
                   AllocateZeroed(b, kF32, rows.total_rows, 1));
  ASSIGN_OR_RETURN(rows.factors_buf,
                   AllocateZeroed(b, kF32, rows.total_rows, 1));
  ASSIGN_OR_RETURN(rows.stats_buf,
                   AllocateZeroed(b, kF32, rows.slots * (1 + widest), 1));
  ViewNorMuonState(group);
  group.state_bytes += rows.total_rows * 4;
  group.variant_state_bytes += rows.total_rows * 4;
  group.staging_bytes += rows.total_rows * 4;
  return absl::OkStatus();
}

absl::Status AllocateAdaMuonState(GroupState& group) {
  for (ParamState& p : group.params) {
    const int64_t rows = p.spec.local_shape[0], cols = p.spec.local_shape[1];
    ASSIGN_OR_RETURN(p.moment2_buf,
                     AllocateZeroed(group.backend, kF32, rows, cols));
    ASSIGN_OR_RETURN(p.staged_moment2_buf,
                     AllocateZeroed(group.backend, kF32, rows, cols));
    p.moment2 = ContiguousView(p.moment2_buf.data(), kF32, rows, cols);
    p.staged_moment2 =
        ContiguousView(p.staged_moment2_buf.data(), kF32, rows, cols);
    group.state_bytes += rows * cols * 4;
    group.variant_state_bytes += rows * cols * 4;
    group.staging_bytes += rows * cols * 4;
  }
  return absl::OkStatus();
}

}  // namespace

MatrixView NorMuonRowFactorsOf(const GroupState& group, size_t i) {
  return Rows(group.normuon.factors_buf, group.normuon.offset[i],
              group.params[i].spec.local_shape[0]);
}

absl::Status AllocateVariantState(GroupState& group) {
  switch (group.config.muon.variant) {
    case MuonVariant::kMuon:
      return absl::OkStatus();
    case MuonVariant::kNorMuon:
      return AllocateNorMuonRows(group);
    case MuonVariant::kAdaMuon:
      return AllocateAdaMuonState(group);
  }
  return absl::OkStatus();
}

absl::Status VariantPhase(GroupState& group, const MuonOptions& options,
                          const std::set<std::string>& skip) {
  switch (options.variant) {
    case MuonVariant::kMuon:
      return absl::OkStatus();
    case MuonVariant::kNorMuon:
      return NorMuonPhase(group, options, skip);
    case MuonVariant::kAdaMuon:
      return AdaMuonPhase(group, options, skip);
  }
  return absl::OkStatus();
}

absl::Status CommitVariantState(GroupState& group, const MuonOptions& options,
                                const std::set<std::string>& skip) {
  if (options.variant == MuonVariant::kNorMuon) {
    // The staged rows hold the kept state of skipped params and padding.
    std::swap(group.normuon.state_buf, group.normuon.staged_buf);
    ViewNorMuonState(group);
    return absl::OkStatus();
  }
  if (options.variant != MuonVariant::kAdaMuon) return absl::OkStatus();
  for (size_t i = 0; i < group.params.size(); ++i) {
    if (skip.contains(group.config.params[i].name)) continue;
    ParamState& p = group.params[i];
    std::swap(p.moment2_buf, p.staged_moment2_buf);
    std::swap(p.moment2, p.staged_moment2);
  }
  return absl::OkStatus();
}

}  // namespace muond
