#include "core/step/group_step.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/step/variant_phase.h"

namespace muond {
namespace {

// The views of `views` at `indices`, in that order.
std::vector<MatrixView> Pick(const std::vector<MatrixView>& views,
                             const std::vector<int>& indices) {
  std::vector<MatrixView> picked;
  picked.reserve(indices.size());
  for (int i : indices) picked.push_back(views[i]);
  return picked;
}

// The momentum kernel's operands for the params not in `skip`: grads,
// momenta, and the block scales of fp8 state (in and out: in place).
struct MomentumOperands {
  std::vector<size_t> params;
  std::vector<MatrixView> grads, momenta;
  std::vector<BlockScales> scales;
};
MomentumOperands MomentumOperandsOf(const GroupState& group,
                                    const std::set<std::string>& skip) {
  MomentumOperands m;
  for (size_t i = 0; i < group.params.size(); ++i) {
    if (skip.contains(group.config.params[i].name)) continue;
    const ParamState& p = group.params[i];
    m.params.push_back(i);
    m.grads.push_back(group.config.params[i].grad);
    m.momenta.push_back(p.momentum);
    if (p.momentum_scales != nullptr) {
      m.scales.push_back({p.momentum_scales, p.momentum_scales});
    }
  }
  return m;
}

// Whether the momentum phase itself stores the new momentum to the staged
// buffer (MuonOptions::double_buffer_momentum); streamed host state stages
// through its stream instead.
bool DoubleBuffersMomentum(const GroupState& group) {
  return StagesMomentum(group.config.muon, *group.backend) &&
         group.host_streams == nullptr;
}

// grad_i, momentum_i -> L_i in one batched call (CUDA: a launch per ~40 small
// params, not per param); the new momentum to staged_momentum_i where the
// group DoubleBuffersMomentum, else not stored. momentum_i is only read, so
// an abandoned step leaves the state as it was (CommitMuonGroups stores the
// new momentum or swaps it in). A skipped param's L_i is zeroed.
// With `check`, the momentum kernels also check the grads they read
// (Backend::CheckedMuonMomentumBatch).
absl::Status MomentumPhase(
    GroupState& group, const MuonOptions& options,
    const std::set<std::string>& skip,
    std::optional<MomentumGradCheck> check = std::nullopt) {
  for (size_t i = 0; i < group.params.size(); ++i) {
    if (skip.contains(group.config.params[i].name)) {
      RETURN_IF_ERROR(group.backend->Memset0(group.local[i]));
    }
  }
  MomentumOperands m = MomentumOperandsOf(group, skip);
  if (m.params.empty()) return absl::OkStatus();
  const bool staged = DoubleBuffersMomentum(group);
  std::vector<MatrixView> outs, inputs;
  for (size_t k = 0; k < m.params.size(); ++k) {
    const ParamState& p = group.params[m.params[k]];
    outs.push_back(staged ? p.staged_momentum : Absent(m.momenta[k]));
    inputs.push_back(group.local[m.params[k]]);
    if (!m.scales.empty()) {
      m.scales[k].out = staged ? p.staged_momentum_scales : nullptr;
    }
  }
  return MuonMomentumPhaseBatch(*group.backend, options, m.grads, m.momenta,
                                outs, inputs, m.scales, check);
}

// After the commit vote, device state: the new momentum of the params not in
// `skip`, by the momentum kernel in place with no NS input (the grads are the
// trainer's, unchanged since MomentumPhase): bitwise what MomentumPhase
// computed. Costs a read of grad and momentum per element where a staged
// copy would have cost a second momentum's memory. `groups` share a backend
// and step options (one batched call for them all).
absl::Status StoreMomentum(absl::Span<GroupState* const> groups,
                           const MuonOptions& options,
                           const std::set<std::string>& skip) {
  MomentumOperands all;
  std::vector<MatrixView> absent;
  for (GroupState* group : groups) {
    MomentumOperands m = MomentumOperandsOf(*group, skip);
    for (size_t k = 0; k < m.params.size(); ++k) {
      absent.push_back(Absent(group->local[m.params[k]]));
    }
    all.grads.insert(all.grads.end(), m.grads.begin(), m.grads.end());
    all.momenta.insert(all.momenta.end(), m.momenta.begin(), m.momenta.end());
    all.scales.insert(all.scales.end(), m.scales.begin(), m.scales.end());
  }
  if (all.grads.empty()) return absl::OkStatus();
  return MuonMomentumPhaseBatch(*groups.front()->backend, options, all.grads,
                                all.momenta, all.momenta, absent, all.scales);
}

// Params in NS order cut into pieces of about GroupState::host_piece_bytes
// of momentum.
std::vector<std::vector<size_t>> StreamPieces(
    const GroupState& group, const std::vector<std::vector<size_t>>& chunks) {
  std::vector<std::vector<size_t>> pieces;
  int64_t in_piece = group.host_piece_bytes;
  for (const std::vector<size_t>& chunk : chunks) {
    for (size_t i : chunk) {
      if (in_piece >= group.host_piece_bytes) {
        pieces.emplace_back();
        in_piece = 0;
      }
      pieces.back().push_back(i);
      in_piece += SlotOf(group.params[i]).bytes;
    }
  }
  return pieces;
}

// `bytes` bytes from src to dst on `backend`'s queue (device or mapped host
// memory), without waiting (Copy2D of one contiguous run).
absl::Status CopyBytes(Backend& backend, void* dst, const void* src,
                       int64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  constexpr DType kByte = DType::kFloat8E4M3;  // a 1-byte element
  return backend.Copy2D(
      ContiguousView(dst, kByte, 1, bytes),
      ContiguousView(const_cast<void*>(src), kByte, 1, bytes));
}

// Host momentum (GroupState::host_streams) piece by piece through two device
// slots (HostStateStreams), and where `with_ns` (StreamsNsWithMomentum) NS as
// soon as a chunk's momentum is done:
//   load  (piece p+1)  host momentum -> slot             | while NS runs
//   main  (piece p)    momentum kernel in place in its slot, L_i; then NS of
//                      every chunk whose params are all done
//   store (piece p)    slot -> host staged momentum      | while NS runs
// Load p+1 overwrites the slot of piece p-1: it waits for the kernel of p
// (after that of p-1) and for store p-1, so a piece's copies in and out
// overlap the NS of the pieces before (without
// NS: the kernels of the pieces before, and the stores the exchanges and NS
// that follow). Bitwise device state: the same kernels on the same values and
// the same NS chunks (NsRunner::ChunksOf).
absl::Status StreamMomentum(GroupState& group, const MuonOptions& options,
                            const std::set<std::string>& skip, bool with_ns) {
  Backend& main = *group.backend;
  HostStateStreams& hs = *group.host_streams;
  // With NS: params in NS order, a chunk's NS once its momentum is done;
  // without: in registration order, each alone.
  std::vector<std::vector<size_t>> chunks;
  if (with_ns) {
    ASSIGN_OR_RETURN(chunks, group.ns->ChunksOf(options, group.local));
  } else {
    for (size_t i = 0; i < group.params.size(); ++i) chunks.push_back({i});
  }
  const std::vector<std::vector<size_t>> pieces = StreamPieces(group, chunks);
  auto stepped = [&](size_t i) {
    return !skip.contains(group.config.params[i].name);
  };
  auto load = [&](size_t p) -> absl::Status {
    char* in = static_cast<char*>(hs.slot[p % 2].data());
    for (size_t i : pieces[p]) {
      const ParamState& st = group.params[i];
      const MomentumSlot at = SlotOf(st);
      if (stepped(i)) {
        RETURN_IF_ERROR(
            CopyBytes(*hs.load, in, st.momentum.data, at.value_bytes));
        RETURN_IF_ERROR(CopyBytes(*hs.load, in + at.scales_offset,
                                  st.momentum_scales, at.scale_bytes));
      }
      in += at.bytes;
    }
    return absl::OkStatus();
  };
  // The momentum of piece p from its slot, and its new momentum out.
  auto momentum_and_store = [&](size_t p) -> absl::Status {
    char* at_slot = static_cast<char*>(hs.slot[p % 2].data());
    std::vector<MatrixView> grads, momenta, inputs;
    std::vector<BlockScales> scales;
    std::vector<std::pair<size_t, char*>>
        stored;  // param, its place in the slot
    for (size_t i : pieces[p]) {
      const ParamState& st = group.params[i];
      const MomentumSlot at = SlotOf(st);
      if (!stepped(i)) {
        RETURN_IF_ERROR(main.Memset0(group.local[i]));
      } else {
        const MatrixView& m = st.momentum;
        grads.push_back(group.config.params[i].grad);
        momenta.push_back(ContiguousView(at_slot, m.dtype, m.rows, m.cols));
        inputs.push_back(group.local[i]);
        if (at.scale_bytes > 0) {
          float* s = reinterpret_cast<float*>(at_slot + at.scales_offset);
          scales.push_back({s, s});
        }
        stored.emplace_back(i, at_slot);
      }
      at_slot += at.bytes;
    }
    // In place in the slot (bitwise the out-of-place kernel).
    if (!grads.empty()) {
      RETURN_IF_ERROR(MuonMomentumPhaseBatch(main, options, grads, momenta,
                                             momenta, inputs, scales));
    }
    RETURN_IF_ERROR(main.OrderBefore(*hs.store));
    RETURN_IF_ERROR(main.OrderBefore(*hs.load));  // the slot updated
    for (const auto& [i, from] : stored) {
      const ParamState& st = group.params[i];
      const MomentumSlot at = SlotOf(st);
      RETURN_IF_ERROR(
          CopyBytes(*hs.store, st.staged_momentum.data, from, at.value_bytes));
      RETURN_IF_ERROR(CopyBytes(*hs.store, st.staged_momentum_scales,
                                from + at.scales_offset, at.scale_bytes));
    }
    return absl::OkStatus();
  };
  // NS of every chunk whose params' momentum is done, in chunk order.
  std::vector<size_t> piece_of(group.params.size());
  for (size_t p = 0; p < pieces.size(); ++p) {
    for (size_t i : pieces[p]) piece_of[i] = p;
  }
  size_t next_chunk = 0;
  auto ns_ready = [&](size_t p) -> absl::Status {
    for (; with_ns && next_chunk < chunks.size(); ++next_chunk) {
      const std::vector<size_t>& chunk = chunks[next_chunk];
      if (piece_of[chunk.back()] > p) break;
      std::vector<MatrixView> members;
      for (size_t i : chunk) members.push_back(group.local[i]);
      RETURN_IF_ERROR(group.ns->Run(options, members, nullptr));
    }
    return absl::OkStatus();
  };
  absl::Status status = main.OrderBefore(*hs.load);
  if (status.ok() && !pieces.empty()) status = load(0);
  for (size_t p = 0; status.ok() && p < pieces.size(); ++p) {
    status = hs.load->OrderBefore(main);
    // Store p-1 before load p+1 (the slot they share); load p+1 before the
    // NS of p, so the copy runs under it.
    if (status.ok() && p >= 1) status = hs.store->OrderBefore(*hs.load);
    if (status.ok()) status = momentum_and_store(p);
    if (status.ok() && p + 1 < pieces.size()) status = load(p + 1);
    if (status.ok()) status = ns_ready(p);
  }
  // Later work on the group's backend comes after the stores; the caller
  // waits for them (DrainMomentumStores) before the commit.
  if (status.ok()) status = hs.store->OrderBefore(main);
  return status;
}

}  // namespace

absl::Status DrainMomentumStores(GroupState& group) {
  if (group.host_streams == nullptr) return absl::OkStatus();
  const absl::Status loaded = group.host_streams->load->Synchronize();
  const absl::Status stored = group.host_streams->store->Synchronize();
  return loaded.ok() ? stored : loaded;
}

namespace {

// NS in place where each param is whole on this rank: unmeasured, one graph
// replay on CUDA (NsRunner::RunLists).
absl::Status NsPhase(GroupState& group, const MuonOptions& options,
                     ShapeTimes* shape_times) {
  const NsLists ns = NsListsOf(group);
  const absl::Span<const MatrixView> spans[] = {ns.lists[0], ns.lists[1],
                                                ns.lists[2]};
  return group.ns->RunLists(options, spans, shape_times);
}

// L_i -> param_i, for `groups` that share a backend and step options (one
// batched call for them all).
absl::Status UpdatePhase(absl::Span<GroupState* const> groups,
                         const MuonOptions& options,
                         const std::set<std::string>& skip) {
  // Each param's lr times its Muon scale (of the full matrix).
  // NorMuon's row factors (variant_phase.h) are applied with the update.
  const bool row_scaled = options.variant == MuonVariant::kNorMuon;
  std::vector<MatrixView> params, updates, row_factors;
  std::vector<float> adjusted_lrs;
  for (GroupState* group : groups) {
    for (size_t i = 0; i < group->params.size(); ++i) {
      const ParamBinding& b = group->config.params[i];
      if (skip.contains(b.name)) continue;
      const std::vector<int64_t>& full = group->params[i].spec.full_shape;
      ASSIGN_OR_RETURN(float lr, MuonAdjustedLr(options, full[0], full[1]));
      params.push_back(b.param);
      updates.push_back(UpdateOf(*group, options, i));
      adjusted_lrs.push_back(lr);
      if (row_scaled) row_factors.push_back(NorMuonRowFactorsOf(*group, i));
    }
  }
  if (params.empty()) return absl::OkStatus();
  return MuonUpdatePhaseBatch(*groups.front()->backend, options, params,
                              updates, adjusted_lrs, row_factors);
}

}  // namespace

bool ChecksGradsInMomentum(const GroupState& group) {
  // A host backend gains nothing (its check is a read of its own either
  // way) and keeps its momentum phases in its concurrent lanes.
  return group.config.algorithm == Algorithm::kMuon &&
         group.host_streams == nullptr && group.backend->is_device();
}

absl::Status MomentumWithGradCheck(GroupState& group,
                                   const MuonOptions& options,
                                   const std::set<std::string>& skip,
                                   MomentumGradCheck check) {
  Backend& backend = *group.backend;
  backend.PushRange("lsmuon/momentum");
  const absl::Status ran = MomentumPhase(group, options, skip, check);
  backend.PopRange();
  return ran;
}

namespace {

// Whether the plan moves shards between the ranks of the group's domain
// around NS (a2a_fwd and a2a_bwd); without, every param is whole here.
bool HasExchangeStages(const GroupExchangePlan& plan) {
  return plan.has_stage1 || !plan.stage2.empty();
}

}  // namespace

bool StreamsNsWithMomentum(const GroupState& group,
                           const ShapeTimes* shape_times) {
  const GroupExchangePlan& plan = group.plan->plan;
  return group.host_streams != nullptr && shape_times == nullptr &&
         !HasExchangeStages(plan) && plan.ns_tp_complete.empty() &&
         plan.ns_after_stage2.empty() &&
         plan.replicated.size() == group.params.size() &&
         group.config.domain.size.dp <= 1;
}

NsLists NsListsOf(const GroupState& group) {
  const PlanBuffers& pb = *group.plan;
  const GroupExchangePlan& plan = pb.plan;
  return {{Pick(group.local, plan.replicated),
           Pick(pb.stage1, plan.ns_tp_complete),
           Pick(pb.stage2, plan.ns_after_stage2)}};
}

bool RunsLaneNs(const GroupState& group) {
  // momentum_ready is set only where the group ChecksGradsInMomentum.
  return group.momentum_ready && !group.ns_done && group.plan.has_value() &&
         !HasExchangeStages(group.plan->plan);
}

PrepareWork TakePrepareWork(GroupState& group, const ShapeTimes* shape_times) {
  // Cleared whichever way the step goes: they speak for this step only.
  const bool momentum_ready = std::exchange(group.momentum_ready, false);
  const bool ns_done = std::exchange(group.ns_done, false);
  if (StreamsNsWithMomentum(group, shape_times)) {
    return {.momentum = true, .ns = true, .streamed = true};
  }
  return {.momentum = !momentum_ready, .ns = !ns_done, .streamed = false};
}

absl::Status RunMomentumPhase(GroupState& group, const MuonOptions& options,
                              const std::set<std::string>& skip,
                              const PrepareWork& work, PhaseClock& clock) {
  Backend& backend = *group.backend;
  if (work.streamed) {
    // Momentum and NS overlap: their wall time counts as NS's.
    return clock.Time(backend, "lsmuon/streamed_ns", &PhaseTimings::ns_us, [&] {
      return StreamMomentum(group, options, skip, /*with_ns=*/true);
    });
  }
  if (!work.momentum) return absl::OkStatus();
  return clock.Time(backend, "lsmuon/momentum", &PhaseTimings::momentum_us,
                    [&] {
                      return group.host_streams != nullptr
                                 ? StreamMomentum(group, options, skip,
                                                  /*with_ns=*/false)
                                 : MomentumPhase(group, options, skip);
                    });
}

absl::Status RunNsPhase(GroupState& group, const MuonOptions& options,
                        const PrepareWork& work, ShapeTimes* shape_times,
                        PhaseClock& clock) {
  if (work.streamed || !work.ns) return absl::OkStatus();
  return clock.Time(*group.backend, "lsmuon/ns", &PhaseTimings::ns_us,
                    [&] { return NsPhase(group, options, shape_times); });
}

absl::Status RunVariantPhase(GroupState& group, const MuonOptions& options,
                             const std::set<std::string>& skip,
                             PhaseClock& clock) {
  // NorMuon/AdaMuon renormalise the update where it is whole again; their
  // time counts as NS's.
  if (options.variant == MuonVariant::kMuon) return absl::OkStatus();
  return clock.Time(*group.backend, "lsmuon/variant", &PhaseTimings::ns_us,
                    [&] { return VariantPhase(group, options, skip); });
}

absl::Status CheckNsOutputsFinite(GroupState& group, const MuonOptions& options,
                                  const std::set<std::string>& skip) {
  if (options.ns.coefficient_type != CoefficientType::kCustom) {
    return absl::OkStatus();
  }
  std::vector<size_t> checked;
  std::vector<MatrixView> views;
  for (size_t i = 0; i < group.params.size(); ++i) {
    if (skip.contains(group.config.params[i].name)) continue;
    checked.push_back(i);
    views.push_back(UpdateOf(group, options, i));
  }
  // One read and one host sync for the whole group; the per-param pass that
  // names the culprits runs only when something is not finite.
  ASSIGN_OR_RETURN(bool all_finite, group.backend->AllFinite(views));
  if (all_finite) return absl::OkStatus();
  std::vector<std::string> bad;
  for (size_t i : checked) {
    ASSIGN_OR_RETURN(bool finite,
                     group.backend->AllFinite({UpdateOf(group, options, i)}));
    if (!finite) bad.push_back(group.config.params[i].name);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "group ", group.config.name,
      ": the Newton-Schulz output is not finite (NaN or Inf; custom "
      "coefficients grew past the iteration dtype's range) for: ",
      absl::StrJoin(bad, ", "),
      "; the step was not applied (params and momentum unchanged)"));
}

namespace {

// Staged momentum (stored by the stream or the momentum phase) is the state
// from now on; the old buffer stages the next step. A skipped param's
// momentum stays (nothing staged it).
void SwapInStagedMomentum(GroupState& group,
                          const std::set<std::string>& skip) {
  for (size_t i = 0; i < group.params.size(); ++i) {
    if (skip.contains(group.config.params[i].name)) continue;
    ParamState& p = group.params[i];
    std::swap(p.momentum_buf, p.staged_momentum_buf);
    std::swap(p.momentum, p.staged_momentum);
    std::swap(p.momentum_scales_buf, p.staged_momentum_scales_buf);
    std::swap(p.momentum_scales, p.staged_momentum_scales);
  }
}

}  // namespace

bool CommitsTogether(const GroupState& a, const GroupState& b) {
  return a.config.algorithm == Algorithm::kMuon &&
         b.config.algorithm == Algorithm::kMuon && a.backend == b.backend &&
         a.step_muon == b.step_muon &&
         StagesMomentum(a.config.muon, *a.backend) ==
             StagesMomentum(b.config.muon, *b.backend);
}

absl::Status CommitMuonGroups(absl::Span<GroupState* const> groups,
                              const std::set<std::string>& skip,
                              PhaseClock& clock) {
  GroupState& first = *groups.front();
  const MuonOptions& options = first.step_muon;
  const bool staged = StagesMomentum(first.config.muon, *first.backend);
  RETURN_IF_ERROR(clock.Time(
      *first.backend, "lsmuon/update", &PhaseTimings::update_us, [&] {
        RETURN_IF_ERROR(UpdatePhase(groups, options, skip));
        return staged ? absl::OkStatus() : StoreMomentum(groups, options, skip);
      }));
  for (GroupState* group : groups) {
    if (staged) SwapInStagedMomentum(*group, skip);
    RETURN_IF_ERROR(CommitVariantState(*group, options, skip));
  }
  return absl::OkStatus();
}

absl::Status StepAdamWGroup(GroupState& group, const AdamWOptions& options,
                            const std::set<std::string>& skip,
                            PhaseClock& clock) {
  std::vector<ParamState*> stepped;
  RETURN_IF_ERROR(
      clock.Time(*group.backend, "lsmuon/adamw", &PhaseTimings::update_us, [&] {
        for (size_t i = 0; i < group.params.size(); ++i) {
          const ParamBinding& b = group.config.params[i];
          if (skip.contains(b.name)) continue;
          ParamState& p = group.params[i];
          RETURN_IF_ERROR(AdamWStep(*group.backend, options, p.adamw_step + 1,
                                    b.param, b.grad, p.exp_avg, p.exp_avg_sq,
                                    p.moment_scales));
          stepped.push_back(&p);
        }
        return absl::OkStatus();
      }));
  for (ParamState* p : stepped) ++p->adamw_step;
  return absl::OkStatus();
}

}  // namespace muond
