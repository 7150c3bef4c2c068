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

MatrixView RowsView(const OwnedBuffer& b, int64_t offset, int64_t rows) {
  return ContiguousView(Floats(b) + offset, kF32, rows, 1);
}

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

// `stats` <- the sum, in rank order, of every rank's `stats` over the gtp
// group, then over the tp group.
absl::Status GatherRowStats(GroupState& group, std::vector<float>& stats) {
  Backend& backend = *group.backend;
  const NorMuonRows& rows = group.normuon;
  const DomainBinding& d = group.config.domain;
  for (Communicator* comm : {d.gtp, d.tp}) {
    if (comm == nullptr || comm->size() <= 1 || rows.slots == 0) continue;
    float* send = Floats(rows.gather_buf);
    float* recv = send + rows.slots;
    RETURN_IF_ERROR(backend.CopyFromHost(send, stats.data(),
                                         rows.slots * int64_t(sizeof(float))));
    RETURN_IF_ERROR(comm->AllGather(send, rows.slots, recv, kF32));
    RETURN_IF_ERROR(comm->Wait());
    std::vector<float> all(rows.slots * comm->size());
    RETURN_IF_ERROR(
        backend.CopyToHost(all.data(), recv, all.size() * sizeof(float)));
    for (int64_t k = 0; k < rows.slots; ++k) {
      float sum = 0.0f;
      for (int r = 0; r < comm->size(); ++r) sum += all[r * rows.slots + k];
      stats[k] = sum;
    }
  }
  return absl::OkStatus();
}

// This rank's contributions: per param [row sums | state] of the full rows.
std::vector<float> LocalRowStats(const GroupState& group,
                                 const std::vector<float>& sums,
                                 const std::vector<float>& state) {
  std::vector<float> stats(group.normuon.slots, 0.0f);
  int64_t at = 0;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const ParamState& p = group.params[i];
    const RowMap m = RowMapOf(p.spec, group.config.domain);
    const int64_t off = group.normuon.offset[i], full = FullRows(p);
    for (int64_t r = 0; r < m.valid; ++r) {
      if (m.sums) stats[at + m.global0 + r] = sums[off + r];
      if (m.state) stats[at + full + m.global0 + r] = state[off + r];
    }
    at += 2 * full;
  }
  return stats;
}

// From the gathered statistics: each local row's factor and new state.
absl::Status RowFactors(GroupState& group, const MuonOptions& options,
                        const std::set<std::string>& skip,
                        const std::vector<float>& stats,
                        std::vector<float>& factors) {
  int64_t at = 0;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const ParamState& p = group.params[i];
    const int64_t full = FullRows(p);
    const int64_t base = at;
    at += 2 * full;
    if (skip.contains(group.config.params[i].name)) continue;
    std::vector<float> v_new(full), f(full);
    const float* s = stats.data() + base;
    RETURN_IF_ERROR(NorMuonRowFactors(
        absl::MakeConstSpan(s, full), absl::MakeConstSpan(s + full, full),
        p.spec.full_shape[1], options.beta2, options.moment2_eps,
        absl::MakeSpan(v_new), absl::MakeSpan(f)));
    const RowMap m = RowMapOf(p.spec, group.config.domain);
    const int64_t off = group.normuon.offset[i];
    for (int64_t r = 0; r < m.valid; ++r) {
      factors[off + r] = f[m.global0 + r];
      group.normuon.staged[off + r] = v_new[m.global0 + r];
    }
  }
  return absl::OkStatus();
}

absl::Status NorMuonPhase(GroupState& group, const MuonOptions& options,
                          const std::set<std::string>& skip) {
  Backend& backend = *group.backend;
  NorMuonRows& rows = group.normuon;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const MatrixView& l = group.local[i];
    if (l.rows == 0) continue;
    RETURN_IF_ERROR(backend.RowSumSquares(
        l, RowsView(rows.sums_buf, rows.offset[i], l.rows)));
  }
  const int64_t bytes = rows.total_rows * int64_t(sizeof(float));
  std::vector<float> sums(rows.total_rows), state(rows.total_rows);
  RETURN_IF_ERROR(backend.CopyToHost(sums.data(), rows.sums_buf.data(), bytes));
  RETURN_IF_ERROR(
      backend.CopyToHost(state.data(), rows.state_buf.data(), bytes));
  std::vector<float> stats = LocalRowStats(group, sums, state);
  RETURN_IF_ERROR(GatherRowStats(group, stats));
  // Rows not renormalised (padding, skipped params) keep factor 1 and their
  // state.
  std::vector<float> factors(rows.total_rows, 1.0f);
  rows.staged = std::move(state);
  RETURN_IF_ERROR(RowFactors(group, options, skip, stats, factors));
  RETURN_IF_ERROR(
      backend.CopyFromHost(rows.factors_buf.data(), factors.data(), bytes));
  for (size_t i = 0; i < group.params.size(); ++i) {
    const MatrixView& l = group.local[i];
    if (l.rows == 0 || skip.contains(group.config.params[i].name)) continue;
    RETURN_IF_ERROR(backend.ScaleRows(
        l, RowsView(rows.factors_buf, rows.offset[i], l.rows)));
  }
  // `factors` is read by the upload until the backend synchronises.
  return backend.Synchronize();
}

absl::Status AdaMuonPhase(GroupState& group, const MuonOptions& options,
                          const std::set<std::string>& skip) {
  for (size_t i = 0; i < group.params.size(); ++i) {
    ParamState& p = group.params[i];
    if (skip.contains(group.config.params[i].name)) continue;
    RETURN_IF_ERROR(group.backend->AdaMuonNormalize(
        group.local[i], p.moment2, p.staged_moment2, options.beta2,
        static_cast<float>(options.moment2_eps)));
  }
  return absl::OkStatus();
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
  ASSIGN_OR_RETURN(rows.sums_buf, AllocateZeroed(b, kF32, rows.total_rows, 1));
  ASSIGN_OR_RETURN(rows.factors_buf,
                   AllocateZeroed(b, kF32, rows.total_rows, 1));
  ASSIGN_OR_RETURN(rows.gather_buf,
                   AllocateZeroed(b, kF32, rows.slots * (1 + widest), 1));
  for (size_t i = 0; i < group.params.size(); ++i) {
    group.params[i].moment2 = RowsView(rows.state_buf, rows.offset[i],
                                       group.params[i].spec.local_shape[0]);
  }
  group.state_bytes += rows.total_rows * 4;
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
    group.staging_bytes += rows * cols * 4;
  }
  return absl::OkStatus();
}

}  // namespace

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
    NorMuonRows& rows = group.normuon;
    // `staged` holds the kept state of skipped params and padding rows.
    RETURN_IF_ERROR(
        group.backend->CopyFromHost(rows.state_buf.data(), rows.staged.data(),
                                    rows.total_rows * int64_t(sizeof(float))));
    return group.backend->Synchronize();
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
