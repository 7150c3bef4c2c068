#include "server/daemon/engine_factory.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/groups.h"
#include "core/comm/nccl_communicator.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/common/proto_convert.h"
#include "server/common/proto_convert_options.h"
#include "server/daemon/exchange_counting.h"

namespace muond {
namespace {

// The communicators of one domain on this rank (null: an axis of size 1).
struct DomainComms {
  Communicator* gtp = nullptr;
  Communicator* tp = nullptr;
  Communicator* dp = nullptr;
};

// D x G x T of `domain`; dp_size 0 (unset) is no DP axis, D = 1.
DomainSize WithDpAxis(const v1::Domain& domain) {
  DomainSize size = DomainSizeOf(domain);
  size.dp = std::max(1, domain.dp_size());
  return size;
}

}  // namespace

EngineFactory MakeEngineFactory(EngineOptions options,
                                std::shared_ptr<KeyValueStore> store) {
  return [options, store](const Registration& reg, const v1::Plan& plan,
                          const std::function<bool()>& abandoned)
             -> absl::StatusOr<std::unique_ptr<StepEngine>> {
    auto engine = std::make_unique<StepEngine>();
    std::shared_ptr<Backend> backend;
    if (options.device < 0) {
      backend = MakeCpuBackend();
    } else {
      ASSIGN_OR_RETURN(std::unique_ptr<Backend> cuda,
                       MakeCudaBackend(options.device, options.cuda));
      backend = std::move(cuda);
    }
    // On a GPU every domain gets a backend (a CUDA stream) of its own, so
    // groups of disjoint domains run concurrently (LayerShardedMuon lanes);
    // on the host one CPU backend serves all.
    engine->backends.push_back(backend);
    std::map<std::string, Backend*> domain_backend;
    // One set of communicators per domain name, shared by its groups.
    std::map<std::string, DomainComms> comms;
    std::vector<GroupConfig> configs;
    for (const BoundGroup& group : reg.groups) {
      const v1::Domain& d = group.proto.domain();
      const DomainSize size = WithDpAxis(d);
      if (!comms.count(d.name())) {
        const std::string prefix = absl::StrCat(
            "comm/", d.name(), "/v", plan.version(), "/e", plan.comm_epoch());
        ASSIGN_OR_RETURN(DomainGroups groups,
                         SplitDomain(size, d.d(), d.g(), d.t(), prefix));
        Backend* dom_backend = backend.get();
        if (options.device >= 0 && !domain_backend.empty()) {
          ASSIGN_OR_RETURN(std::unique_ptr<Backend> own,
                           MakeCudaBackend(options.device, options.cuda));
          dom_backend = own.get();
          engine->backends.push_back(std::move(own));
        }
        domain_backend[d.name()] = dom_backend;
        auto make =
            [&](const std::string& p, int rank,
                int size) -> absl::StatusOr<std::unique_ptr<Communicator>> {
          if (options.device < 0) {
            GlooOptions gloo;
            gloo.hostname = options.gloo_hostname;
            gloo.timeout = options.comm_timeout;
            gloo.cancelled = abandoned;
            return CreateGlooCommunicator(store.get(), p, rank, size, gloo);
          }
          NcclOptions nccl;
          nccl.device = options.device;
          nccl.cancelled = abandoned;
          return CreateNcclCommunicator(store.get(), p, rank, size,
                                        dom_backend->stream(), nccl);
        };
        // The gtp_remat and tp groups of this rank's replica, then its DP
        // group (the ranks holding the same shards): an axis of size 1 has
        // none.
        auto axis = [&](const std::string& p, int rank, int size,
                        Communicator*& out) -> absl::Status {
          if (size <= 1) return absl::OkStatus();
          ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c,
                           make(p, rank, size));
          if (options.metrics != nullptr) {
            c = CountingExchangeBytes(std::move(c),
                                      &options.metrics->exchange_sent(),
                                      &options.metrics->exchange_received());
          }
          out = c.get();
          engine->communicators.push_back(std::move(c));
          return absl::OkStatus();
        };
        DomainComms& dc = comms[d.name()];
        RETURN_IF_ERROR(axis(groups.gtp_remat_prefix, d.g(), size.gtp, dc.gtp));
        RETURN_IF_ERROR(axis(groups.tp_prefix, d.t(), size.tp, dc.tp));
        RETURN_IF_ERROR(axis(groups.dp_prefix, d.d(), size.dp, dc.dp));
      }
      GroupConfig config;
      config.name = group.proto.name();
      config.algorithm = group.proto.algorithm() == v1::ALGORITHM_ADAMW
                             ? Algorithm::kAdamW
                             : Algorithm::kMuon;
      // The registered proto's params are cleared: an auto state_dtype
      // follows the bound params' dtypes.
      std::vector<DType> param_dtypes;
      for (const BoundParam& p : group.params) {
        param_dtypes.push_back(p.param.dtype);
      }
      if (config.algorithm == Algorithm::kMuon) {
        ASSIGN_OR_RETURN(config.muon,
                         MuonOptionsFromProto(group.proto, param_dtypes));
      } else {
        ASSIGN_OR_RETURN(config.adamw,
                         AdamWOptionsFromProto(group.proto, param_dtypes));
      }
      config.backend = domain_backend[d.name()];
      config.domain.size = size;
      config.domain.g = d.g();
      config.domain.t = d.t();
      config.domain.d = d.d();
      config.domain.gtp = comms[d.name()].gtp;
      config.domain.tp = comms[d.name()].tp;
      config.domain.dp = comms[d.name()].dp;
      for (const BoundParam& p : group.params) {
        ParamBinding b;
        b.name = p.name;
        b.full_shape = p.full_shape;
        b.tags = p.tags;
        b.param = p.param;
        b.grad = p.grad;
        config.params.push_back(std::move(b));
      }
      configs.push_back(std::move(config));
    }
    StepOptions step_options;
    step_options.skip_nonfinite = options.skip_nonfinite;
    step_options.testonly_commit_delay_ms = options.testonly_commit_delay_ms;
    step_options.max_ns_workspace_bytes = options.max_ns_workspace_bytes;
    if (options.world_size > 1) {
      // The job's vote is a few bytes of host memory per rank: Gloo over
      // every daemon of the job, in GPU mode too (no NCCL communicator or
      // device sync for it), bounded by the same timeout.
      GlooOptions gloo;
      gloo.hostname = options.gloo_hostname;
      gloo.timeout = options.comm_timeout;
      gloo.cancelled = abandoned;
      ASSIGN_OR_RETURN(
          std::unique_ptr<Communicator> job,
          CreateGlooCommunicator(store.get(),
                                 absl::StrCat("jobcomm/v", plan.version(), "/e",
                                              plan.comm_epoch()),
                                 options.rank, options.world_size, gloo));
      step_options.job = job.get();
      engine->communicators.push_back(std::move(job));
    }
    ASSIGN_OR_RETURN(engine->muon,
                     LayerShardedMuon::Create(backend.get(), std::move(configs),
                                              step_options));
    return engine;
  };
}

absl::Status ValidateGroupForDevice(const v1::ParamGroup& group, int device) {
  if (group.algorithm() == v1::ALGORITHM_ADAMW) {
    return AdamWOptionsFromProto(group).status();
  }
  ASSIGN_OR_RETURN(MuonOptions muon, MuonOptionsFromProto(group));
  if (device >= 0) return absl::OkStatus();  // CUDA has every precision
  static Backend* const cpu = MakeCpuBackend().release();
  const absl::Status st = ValidateNsOptions(muon.ns, *cpu);
  if (st.ok()) return st;
  return absl::InvalidArgumentError(
      absl::StrCat("group '", group.name(), "': ", st.message(),
                   "; this daemon runs in host mode (--host, no GPU)"));
}

}  // namespace muond
