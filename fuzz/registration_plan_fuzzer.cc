// libFuzzer target: request validation and plan building.
//
// The input is a serialized v1::RegisterParamsRequest. It goes through the
// daemon's validation (BuildRegistration, every region over a fake mapping of
// its declared size, at most 1 MiB: larger ones are refused), and
// when accepted its manifest goes through the coordinator (Join of every rank
// of the first group's domain, PublishManifest with each rank's coordinates,
// plan computation) and the planner directly with each cost model. Nothing
// may crash, leak or trip a sanitizer; errors are fine.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "muond/v1/muond.pb.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"
#include "server/daemon/registration.h"

namespace muond {
namespace {

constexpr uint64_t kMaxMappingBytes = 1 << 20;

class FakeRegion : public MappedRegion {
 public:
  explicit FakeRegion(uint64_t bytes) : data_(bytes) {}
  void* base() const override { return const_cast<char*>(data_.data()); }
  uint64_t size() const override { return data_.size(); }

 private:
  std::vector<char> data_;
};

// Shm objects of up to 1 MiB exist under every well-formed name; CUDA IPC is
// refused as on a host-mode daemon (the base class).
class FakeOpener : public HandleOpener {
 public:
  absl::StatusOr<std::unique_ptr<MappedRegion>> OpenShm(
      const std::string& name, uint64_t byte_size,
      const std::string& field) override {
    if (name.empty() || name[0] != '/')
      return absl::NotFoundError(field + ": no such shm object");
    if (byte_size > kMaxMappingBytes)
      return absl::InvalidArgumentError(field + ": shm object too small");
    return std::unique_ptr<MappedRegion>(new FakeRegion(byte_size));
  }
};

void PlanAndPublish(const Registration& reg, const std::string& job) {
  v1::PublishManifestRequest manifest = reg.Manifest(job, 0);
  for (const v1::GroupManifest& g : manifest.groups()) {
    for (v1::CostModel model : {v1::COST_MODEL_NS_COST, v1::COST_MODEL_FLOPS}) {
      (void)PlanGroup(g, model, {});
    }
  }
  if (manifest.groups().empty()) return;
  const v1::Domain& d = manifest.groups(0).domain();
  const int64_t world = int64_t(d.gtp_size()) * d.tp_size();
  if (world < 1 || world > 16) return;
  CoordinatorOptions options;
  options.max_wait = absl::ZeroDuration();
  options.planner = [](const v1::GroupManifest& m, v1::CostModel model,
                       const CostTable& costs) {
    return PlanGroup(m, model, costs);
  };
  CoordinatorCore core(options);
  for (int r = 0; r < world; ++r) {
    v1::JoinRequest join;
    join.set_job_id(job);
    join.set_rank(r);
    join.set_world_size(int(world));
    if (!core.Join(join).ok()) return;
  }
  for (int r = 0; r < world; ++r) {
    v1::PublishManifestRequest m = manifest;
    m.set_rank(r);
    for (v1::GroupManifest& g : *m.mutable_groups()) {
      if (int64_t(g.domain().gtp_size()) * g.domain().tp_size() != world)
        continue;
      g.mutable_domain()->set_g(r / g.domain().tp_size());
      g.mutable_domain()->set_t(r % g.domain().tp_size());
    }
    (void)core.PublishManifest(m);
  }
  (void)core.GetPlan(job);
  v1::RebalanceRequest rebalance;
  rebalance.set_job_id(job);
  rebalance.set_cost_model(v1::COST_MODEL_FLOPS);
  (void)core.Rebalance(rebalance);
}

}  // namespace
}  // namespace muond

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  muond::v1::RegisterParamsRequest request;
  if (!request.ParseFromArray(data, int(size))) return 0;
  muond::FakeOpener opener;
  const std::string job = request.job_id().empty() ? "job" : request.job_id();
  auto reg = muond::BuildRegistration(request, {job, 16}, opener);
  if (reg.ok()) muond::PlanAndPublish(**reg, job);
  return 0;
}
