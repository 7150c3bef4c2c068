#pragma once
// Requests and options the CoordinatorCore tests share: a core with the real
// core planner (PlanGroup), Join requests, the manifests of a 2x2 GTP x TP
// domain and of a DP x TP domain, a manual clock.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"

namespace muond {

inline CoordinatorOptions Options(std::string token = "") {
  CoordinatorOptions o;
  o.token = std::move(token);
  o.planner = [](const v1::GroupManifest& m, v1::CostModel model,
                 const CostTable& costs) { return PlanGroup(m, model, costs); };
  return o;
}

inline v1::JoinRequest JoinReq(const std::string& job, int rank, int world,
                               const std::string& token = "") {
  v1::JoinRequest r;
  r.set_job_id(job);
  r.set_rank(rank);
  r.set_world_size(world);
  r.set_host("localhost");
  r.set_device("cpu");
  r.set_address("unix:///tmp/x" + std::to_string(rank));
  r.set_token(token);
  return r;
}

// A 2x2 domain (G=2, T=2) with GTP+TP column-parallel weights of the given
// full shapes; rank r = g * 2 + t.
inline v1::PublishManifestRequest Manifest(
    const std::string& job, int rank,
    const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  v1::PublishManifestRequest r;
  r.set_job_id(job);
  r.set_rank(rank);
  v1::GroupManifest* g = r.add_groups();
  g->set_group("muon");
  g->set_algorithm(v1::ALGORITHM_MUON);
  g->mutable_domain()->set_name("dense");
  g->mutable_domain()->set_gtp_size(2);
  g->mutable_domain()->set_tp_size(2);
  g->mutable_domain()->set_g(rank / 2);
  g->mutable_domain()->set_t(rank % 2);
  for (size_t i = 0; i < shapes.size(); ++i) {
    v1::ParamSpec* p = g->add_params();
    p->set_name("w" + std::to_string(i));
    p->add_full_shape(shapes[i].first);
    p->add_full_shape(shapes[i].second);
    // Column-parallel: rows split over T, then over G.
    p->add_local_shape(shapes[i].first / 4);
    p->add_local_shape(shapes[i].second);
    p->mutable_tags()->set_tensor_model_parallel(true);
    p->mutable_tags()->set_partition_dim(0);
    p->mutable_tags()->set_is_gtp_weight_remat(true);
  }
  return r;
}

inline const std::vector<std::pair<int64_t, int64_t>> kShapes = {
    {64, 32}, {32, 32}, {64, 64}, {16, 32}, {32, 16}, {128, 32}};

inline void JoinAll(CoordinatorCore& core, const std::string& job, int world) {
  for (int r = 0; r < world; ++r)
    ASSERT_TRUE(core.Join(JoinReq(job, r, world)).ok());
}

// A manual clock for expiry and join grace.
struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1'000'000);
  std::function<absl::Time()> Fn() {
    return [this] { return now; };
  }
};

inline void PublishAll4(
    CoordinatorCore& core, const std::string& job,
    const std::function<void(v1::PublishManifestRequest&)>& edit_rank1 = {}) {
  for (int r = 0; r < 4; ++r) {
    v1::PublishManifestRequest m = Manifest(job, r, kShapes);
    if (r == 1 && edit_rank1) edit_rank1(m);
    ASSERT_TRUE(core.PublishManifest(m).ok()) << r;
  }
}

inline v1::PublishManifestRequest WithNsSteps(v1::PublishManifestRequest m,
                                              int steps) {
  m.mutable_groups(0)->mutable_muon()->set_num_ns_steps(steps);
  return m;
}

// A DP x TP domain (D replicas of a 1 x T grid; rank r = d * T + t) with
// TP column-parallel weights, or with T = 1 a DDP job of plain matrices.
inline v1::PublishManifestRequest DpManifest(
    const std::string& job, int rank, int dp, int tp,
    const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  v1::PublishManifestRequest r;
  r.set_job_id(job);
  r.set_rank(rank);
  v1::GroupManifest* g = r.add_groups();
  g->set_group("muon");
  g->set_algorithm(v1::ALGORITHM_MUON);
  v1::Domain* d = g->mutable_domain();
  d->set_name("dense");
  d->set_gtp_size(1);
  d->set_tp_size(tp);
  d->set_dp_size(dp);
  d->set_d(rank / tp);
  d->set_t(rank % tp);
  for (size_t i = 0; i < shapes.size(); ++i) {
    v1::ParamSpec* p = g->add_params();
    p->set_name("w" + std::to_string(i));
    p->add_full_shape(shapes[i].first);
    p->add_full_shape(shapes[i].second);
    p->add_local_shape(shapes[i].first / tp);
    p->add_local_shape(shapes[i].second);
    p->mutable_tags()->set_tensor_model_parallel(tp > 1);
    p->mutable_tags()->set_partition_dim(0);
  }
  return r;
}

}  // namespace muond
