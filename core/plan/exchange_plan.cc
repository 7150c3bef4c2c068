#include "core/plan/exchange_plan.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "core/plan/all_to_allv_builder.h"

namespace muond {
namespace {

StageExchange BuildStage1(const GroupExchangePlan& plan) {
  const DomainSize d = plan.domain;
  const int G = d.gtp;
  StageExchange ex;
  for (int g = 0; g < G; ++g)
    ex.group_ranks.push_back(d.FlatRank(g, plan.my_t));
  ex.my_peer = plan.my_g;
  AllToAllvBuilder fwd(G), rev(G);
  for (int i : plan.routed) {
    const ParamShardSpec& spec = plan.specs[i];
    if (!spec.gtp_sharded) continue;
    ex.active = true;  // every rank holds a shard of every GTP param
    const int home = plan.homes[i].g;
    // Block g holds padded rows [start_g, start_g + rows_g) (prefix sums of
    // gtp_rows, or equal blocks); only its real rows travel, and an empty
    // piece (a 0-row shard, or pad only) is never sent (the builder drops it).
    const int64_t r = spec.local_shape[0], c = spec.local_shape[1];
    const int64_t mine = ValidLocalRows(spec, d, plan.my_g);
    fwd.Send(home, i, Block{0, 0, mine, c});
    rev.Recv(home, i, Block{0, 0, mine, c});
    if (mine < r) {
      ex.reverse_zero_fill.push_back(ZeroFill{i, Block{mine, 0, r - mine, c}});
    }
    if (plan.my_g != home) continue;
    const std::vector<int64_t> a1 = TpLocalShape(spec, d);
    ex.assembled.push_back(AssembledParam{i, a1[0], a1[1]});
    for (int g = 0; g < G; ++g) {
      const Block rows_of_g{GtpRowBlockOf(spec, d, g).start, 0,
                            ValidLocalRows(spec, d, g), c};
      fwd.Recv(g, i, rows_of_g);
      rev.Send(g, i, rows_of_g);
    }
  }
  ex.forward = std::move(fwd).Finish();
  ex.reverse = std::move(rev).Finish();
  return ex;
}

StageExchange BuildStage2(const GroupExchangePlan& plan, int tp_dim) {
  const DomainSize d = plan.domain;
  const int T = d.tp;
  StageExchange ex;
  ex.tp_dim = tp_dim;
  for (int t = 0; t < T; ++t)
    ex.group_ranks.push_back(d.FlatRank(plan.my_g, t));
  ex.my_peer = plan.my_t;
  AllToAllvBuilder fwd(T), rev(T);
  for (int i : plan.routed) {
    const ParamShardSpec& spec = plan.specs[i];
    if (spec.tp_dim != tp_dim || plan.homes[i].g != plan.my_g) continue;
    ex.active = true;  // the same for every member of this row
    const int home = plan.homes[i].t;
    const std::vector<int64_t> a1 = TpLocalShape(spec, d);
    const int64_t R = a1[0], C = a1[1];
    fwd.Send(home, i, Block{0, 0, R, C});
    rev.Recv(home, i, Block{0, 0, R, C});
    if (plan.my_t != home) continue;
    ex.assembled.push_back(
        AssembledParam{i, spec.full_shape[0], spec.full_shape[1]});
    for (int t = 0; t < T; ++t) {
      const Block block_of_t =
          tp_dim == 0 ? Block{t * R, 0, R, C} : Block{0, t * C, R, C};
      fwd.Recv(t, i, block_of_t);
      rev.Send(t, i, block_of_t);
    }
  }
  ex.forward = std::move(fwd).Finish();
  ex.reverse = std::move(rev).Finish();
  return ex;
}

void TrackBufferSizes(const StageExchange& ex, GroupExchangePlan& plan) {
  plan.max_send_elems = std::max(
      {plan.max_send_elems, ex.forward.total_send, ex.reverse.total_send});
  plan.max_recv_elems = std::max(
      {plan.max_recv_elems, ex.forward.total_recv, ex.reverse.total_recv});
}

}  // namespace

absl::Status CheckNsHomeReplicas(const std::vector<ParamShardSpec>& specs,
                                 const std::vector<NsHome>& homes, int dp) {
  if (homes.size() != specs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(homes.size(), " NS homes for ", specs.size(), " params"));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (homes[i].d < 0 || homes[i].d >= dp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param '", specs[i].name, "': NS home replica d=", homes[i].d,
          " is outside dp_size ", dp));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GroupExchangePlan> BuildGroupExchangePlan(
    std::vector<ParamShardSpec> specs, std::vector<NsHome> homes,
    DomainSize domain, int my_g, int my_t, int my_d) {
  RETURN_IF_ERROR(
      CheckDomainCoordinates(domain, my_d, my_g, my_t, "this rank"));
  RETURN_IF_ERROR(CheckNsHomeReplicas(specs, homes, domain.dp));
  GroupExchangePlan plan;
  plan.domain = domain;
  plan.my_g = my_g;
  plan.my_t = my_t;
  bool tp_dim_present[2] = {false, false};
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamShardSpec& spec = specs[i];
    RETURN_IF_ERROR(ValidateShardSpec(spec, domain, my_g));
    NsHome& home = homes[i];
    if (home.d != my_d) continue;  // another replica's NS
    if (!spec.routed()) {
      home = NsHome{.d = home.d};
      plan.replicated.push_back(int(i));
      continue;
    }
    if (spec.sharding == ParamSharding::kGtpRemat) home.t = 0;
    if (!domain.Contains(home.g, home.t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param '", spec.name, "': NS home (", home.g, ", ", home.t,
          ") is outside the ", domain.gtp, "x", domain.tp, " domain"));
    }
    plan.routed.push_back(int(i));
    if (spec.tp_sharded()) tp_dim_present[spec.tp_dim] = true;
    plan.has_stage1 = plan.has_stage1 || spec.gtp_sharded;
  }
  plan.specs = std::move(specs);
  plan.homes = std::move(homes);

  for (int i : plan.routed) {
    const ParamShardSpec& spec = plan.specs[i];
    const NsHome& home = plan.homes[i];
    if (spec.sharding == ParamSharding::kGtpRemat) {
      if (home.g == my_g) plan.ns_tp_complete.push_back(i);
    } else if (home.g == my_g && home.t == my_t) {
      plan.ns_after_stage2.push_back(i);
    }
  }
  if (plan.has_stage1) {
    plan.stage1 = BuildStage1(plan);
    TrackBufferSizes(plan.stage1, plan);
  }
  for (int tp_dim = 0; tp_dim < 2; ++tp_dim) {
    if (!tp_dim_present[tp_dim]) continue;
    plan.stage2.push_back(BuildStage2(plan, tp_dim));
    TrackBufferSizes(plan.stage2.back(), plan);
  }
  return plan;
}

}  // namespace muond
