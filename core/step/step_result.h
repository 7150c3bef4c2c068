#pragma once
// What one step of the layer-sharded Muon engine reports (core/step/
// layer_sharded_muon.h): phase times, per-shape NS times, skipped groups and
// the NS homes versions the domains agreed on. A target of its own so that
// code which only converts or reports a step's result (server/common/
// proto_convert) does not depend on the engine.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace muond {

// Microseconds per phase of one step, summed over groups: on a device, the
// GPU time between two events around the phase's work (phase_clock.h); on
// the host, its wall time. total_us: the whole step's wall time.
struct PhaseTimings {
  double momentum_us = 0;
  double a2a_fwd_us = 0;
  double ns_us = 0;
  double a2a_bwd_us = 0;
  // The DP exchange of the updates (0 without a DP axis).
  double dp_share_us = 0;
  double update_us = 0;
  double total_us = 0;
};

// Measured Newton–Schulz time for one full-matrix shape in one step, summed
// over the groups of this rank: wall time (microseconds) of the `count` NS
// runs of that shape this rank did (the scale factor and, when batched, the
// staging copies included). The coordinator rebalances NS homes with
// ns_us / count per shape (docs/ARCHITECTURE.md "Plans and their versions").
struct ShapeTiming {
  int64_t rows = 0;
  int64_t cols = 0;
  double ns_us = 0;
  int64_t count = 0;
};

struct StepResult {
  PhaseTimings timings;
  // Per-shape NS times of this step, by (rows, cols) ascending; empty when
  // the step was not measured (StepOptions::ns_shape_timing_every in
  // layer_sharded_muon.h) or ran no NS.
  std::vector<ShapeTiming> ns_shapes;
  // Non-empty when the step was skipped for non-finite gradients.
  std::vector<std::string> skipped_nonfinite;
  // The NS homes version each Muon group's domain agreed on for this step
  // (LayerShardedMuon::SetHomes; 0 = round-robin fallback).
  std::map<std::string, int64_t> homes_versions;
};

}  // namespace muond
