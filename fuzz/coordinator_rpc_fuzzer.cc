// libFuzzer target: the coordinator's RPCs (it trusts no request).
//
// The input is decoded (FuzzedDataProvider) into a short program of calls on
// one in-process CoordinatorCore: Join, Leave, KvSet, KvGet, PublishManifest,
// PublishRegistration, GetPlan, WaitForPlan, ReportTimings, MeasuredCosts,
// Rebalance, ListDaemons, CheckJobToken, with fuzzed fields. Job ids, ranks,
// group and param names come mostly from small pools so calls hit the same
// jobs; "publish all" sends one fuzzed manifest from every rank of its domain
// with the right coordinates, so plans are actually computed.
//
// Invariants: nothing crashes, leaks or trips a sanitizer; every error is a
// proper status (a code other than UNKNOWN and a message); a returned plan
// has a version >= 1 and a home inside its group's domain for every param
// of the published manifest.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "muond/v1/muond.pb.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"

namespace muond {
namespace {

constexpr int kMaxCalls = 64;

[[noreturn]] void Fail(const std::string& what) {
  fprintf(stderr, "invariant violated: %s\n", what.c_str());
  abort();
}

void CheckStatus(const absl::Status& status, const char* call) {
  if (status.ok()) return;
  if (status.code() == absl::StatusCode::kUnknown || status.message().empty())
    Fail(std::string(call) +
         " returned an improper error: " + status.ToString());
}

class Program {
 public:
  explicit Program(FuzzedDataProvider& in) : in_(in) {}

  void Run() {
    CoordinatorOptions options;
    options.max_wait = absl::ZeroDuration();
    options.planner = [](const v1::GroupManifest& m, v1::CostModel model,
                         const CostTable& costs) {
      return PlanGroup(m, model, costs);
    };
    if (in_.ConsumeBool()) options.token = "secret";
    options.rebalance_threshold = in_.ConsumeBool() ? 1.01 : 0;
    options.rebalance_interval_steps = in_.ConsumeIntegralInRange(1, 4);
    options.rebalance_activate_margin = in_.ConsumeIntegralInRange(0, 4);
    options.plans_kept = in_.ConsumeIntegralInRange(1, kPlansKept);
    CoordinatorCore core(options);
    for (int i = 0; i < kMaxCalls && in_.remaining_bytes() > 0; ++i) {
      Call(core);
    }
  }

 private:
  std::string JobId() {
    switch (in_.ConsumeIntegralInRange(0, 3)) {
      case 0:
        return "job";
      case 1:
        return "other";
      case 2:
        return "";
      default:
        return in_.ConsumeRandomLengthString(64);
    }
  }
  // Mostly small (valid) values, sometimes any int32.
  int32_t SmallInt(int32_t hi) {
    if (in_.ConsumeIntegralInRange(0, 7) == 0)
      return in_.ConsumeIntegral<int32_t>();
    return in_.ConsumeIntegralInRange<int32_t>(0, hi);
  }
  int64_t AnyInt64() {
    switch (in_.ConsumeIntegralInRange(0, 3)) {
      case 0:
        return in_.ConsumeIntegralInRange<int64_t>(-2, 100);
      case 1:
        return INT64_MAX - in_.ConsumeIntegralInRange<int64_t>(0, 2);
      case 2:
        return INT64_MIN + in_.ConsumeIntegralInRange<int64_t>(0, 2);
      default:
        return in_.ConsumeIntegral<int64_t>();
    }
  }
  std::string Token() { return in_.ConsumeBool() ? "secret" : "wrong"; }
  std::string Name(const char* prefix) {
    if (in_.ConsumeIntegralInRange(0, 7) == 0)
      return in_.ConsumeRandomLengthString(32);
    return prefix + std::to_string(in_.ConsumeIntegralInRange(0, 3));
  }
  int64_t Dim() {
    if (in_.ConsumeIntegralInRange(0, 7) == 0) return AnyInt64();
    return in_.ConsumeIntegralInRange<int64_t>(1, 64);
  }

  v1::GroupManifest Group() {
    v1::GroupManifest g;
    g.set_group(Name("g"));
    g.set_algorithm(v1::Algorithm(in_.ConsumeIntegralInRange(0, 3)));
    v1::Domain* d = g.mutable_domain();
    d->set_name(Name("dom"));
    d->set_gtp_size(SmallInt(2));
    d->set_tp_size(SmallInt(2));
    const int params = in_.ConsumeIntegralInRange(0, 4);
    for (int p = 0; p < params; ++p) {
      v1::ParamSpec* spec = g.add_params();
      spec->set_name(Name("p"));
      const int rank = in_.ConsumeIntegralInRange(0, 3);
      for (int k = 0; k < rank; ++k) spec->add_full_shape(Dim());
      for (int k = 0; k < rank; ++k) spec->add_local_shape(Dim());
      v1::ShardTags* tags = spec->mutable_tags();
      tags->set_tensor_model_parallel(in_.ConsumeBool());
      tags->set_partition_dim(SmallInt(1));
      tags->set_is_gtp_weight_remat(in_.ConsumeBool());
      if (in_.ConsumeIntegralInRange(0, 3) == 0) tags->set_pad_length(Dim());
    }
    return g;
  }

  v1::PublishManifestRequest Manifest(const std::string& job) {
    v1::PublishManifestRequest m;
    m.set_job_id(job);
    const int groups = in_.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < groups; ++i) *m.add_groups() = Group();
    m.set_known_plan_version(in_.ConsumeBool() ? 0 : AnyInt64());
    m.set_last_step_id(in_.ConsumeBool() ? -1 : AnyInt64());
    return m;
  }

  void Join(CoordinatorCore& core, const std::string& job, int rank,
            int world) {
    v1::JoinRequest join;
    join.set_job_id(job);
    join.set_rank(rank);
    join.set_world_size(world);
    join.set_host(in_.ConsumeRandomLengthString(16));
    join.set_address(in_.ConsumeRandomLengthString(16));
    join.set_token(Token());
    CheckStatus(core.Join(join).status(), "Join");
  }

  // One manifest from every rank of a world of gtp*tp (<= 4) ranks, each
  // with its coordinates in every group of that size.
  void PublishAll(CoordinatorCore& core, const std::string& job) {
    v1::PublishManifestRequest m = Manifest(job);
    const int world = in_.ConsumeIntegralInRange(1, 4);
    const bool join_first = in_.ConsumeBool();
    const std::string registration = Name("reg");
    for (int r = 0; r < world; ++r) {
      if (join_first) Join(core, job, r, world);
      v1::PublishManifestRequest mine = m;
      mine.set_rank(r);
      for (v1::GroupManifest& g : *mine.mutable_groups()) {
        const int tp = g.domain().tp_size();
        if (tp < 1 || int64_t(g.domain().gtp_size()) * tp != world) continue;
        g.mutable_domain()->set_g(r / tp);
        g.mutable_domain()->set_t(r % tp);
      }
      CheckStatus(core.PublishRegistration(mine, registration).status(),
                  "PublishRegistration");
    }
    CheckPlan(core.GetPlan(job), m);
  }

  // Every Muon group of a plan has one home per param of the manifest, in
  // its domain.
  void CheckPlan(const absl::StatusOr<v1::Plan>& plan,
                 const v1::PublishManifestRequest& published) {
    CheckStatus(plan.status(), "GetPlan");
    if (!plan.ok()) return;
    if (plan->version() < 1) Fail("plan version < 1");
    for (const v1::GroupPlan& gp : plan->groups()) {
      for (const v1::GroupManifest& g : published.groups()) {
        if (g.group() != gp.group()) continue;
        if (gp.homes_size() != g.params_size()) continue;  // older manifest
        for (const v1::NsHome& h : gp.homes()) {
          if (h.g() < 0 || h.g() >= g.domain().gtp_size() || h.t() < 0 ||
              h.t() >= g.domain().tp_size())
            Fail("plan home outside its domain");
        }
      }
    }
  }

  void Timings(CoordinatorCore& core, const std::string& job) {
    v1::ReportTimingsRequest report;
    report.set_job_id(job);
    report.set_rank(SmallInt(3));
    report.set_step_id(AnyInt64());
    report.mutable_timings()->set_ns_us(in_.ConsumeFloatingPoint<double>());
    const int shapes = in_.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < shapes; ++i) {
      v1::ShapeTiming* s = report.add_shapes();
      const int rank = in_.ConsumeIntegralInRange(0, 3);
      for (int k = 0; k < rank; ++k) s->add_shape(Dim());
      s->set_ns_us(in_.ConsumeFloatingPoint<double>());
      s->set_count(SmallInt(4));
    }
    CheckStatus(core.ReportTimings(report), "ReportTimings");
  }

  void Rebalance(CoordinatorCore& core, const std::string& job) {
    v1::RebalanceRequest request;
    request.set_job_id(job);
    request.set_cost_model(v1::CostModel(SmallInt(4)));
    const int entries = in_.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < entries; ++i) {
      v1::ShapeTiming* s = request.add_cost_table();
      const int rank = in_.ConsumeIntegralInRange(0, 3);
      for (int k = 0; k < rank; ++k) s->add_shape(Dim());
      s->set_ns_us(in_.ConsumeFloatingPoint<double>());
      s->set_count(SmallInt(4));
    }
    if (in_.ConsumeBool()) request.set_activate_after_steps(AnyInt64());
    auto plan = core.Rebalance(request);
    CheckStatus(plan.status(), "Rebalance");
    if (plan.ok() && plan->version() < 1) Fail("rebalanced version < 1");
  }

  void Call(CoordinatorCore& core) {
    const std::string job = JobId();
    switch (in_.ConsumeIntegralInRange(0, 13)) {
      case 0:
        Join(core, job, SmallInt(4), SmallInt(4));
        break;
      case 1:
        core.Leave(job, SmallInt(4));
        break;
      case 2: {
        v1::KvSetRequest set;
        set.set_job_id(job);
        set.set_key(Name("k"));
        set.set_value(in_.ConsumeRandomLengthString(256));
        CheckStatus(core.KvSet(set), "KvSet");
        break;
      }
      case 3: {
        v1::KvGetRequest get;
        get.set_job_id(job);
        get.set_key(Name("k"));
        get.set_timeout_ms(in_.ConsumeBool() ? 0 : AnyInt64());
        CheckStatus(core.KvGet(get, [] { return true; }).status(), "KvGet");
        break;
      }
      case 4: {
        v1::PublishManifestRequest m = Manifest(job);
        m.set_rank(SmallInt(4));
        CheckStatus(core.PublishManifest(m), "PublishManifest");
        break;
      }
      case 5:
        PublishAll(core, job);
        break;
      case 6:
        CheckStatus(core.GetPlan(job).status(), "GetPlan");
        break;
      case 7: {
        const int64_t after = AnyInt64();
        auto plan = core.WaitForPlan(job, after, absl::ZeroDuration());
        CheckStatus(plan.status(), "WaitForPlan");
        if (plan.ok() && *plan && after > 0 && (*plan)->version() <= after)
          Fail("WaitForPlan returned a version not after after_version");
        break;
      }
      case 8:
        Timings(core, job);
        break;
      case 9:
        CheckStatus(core.MeasuredCosts(job).status(), "MeasuredCosts");
        break;
      case 10:
        Rebalance(core, job);
        break;
      case 11: {
        v1::ListDaemonsRequest list;
        list.set_job_id(job);
        CheckStatus(core.ListDaemons(list).status(), "ListDaemons");
        break;
      }
      case 12:
        CheckStatus(core.CheckJobToken(job, Token()), "CheckJobToken");
        break;
      default:
        (void)core.JobIds();
        break;
    }
  }

  FuzzedDataProvider& in_;
};

}  // namespace
}  // namespace muond

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  muond::Program(in).Run();
  return 0;
}
