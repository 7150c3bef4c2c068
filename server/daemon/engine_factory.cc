#include "server/daemon/engine_factory.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/groups.h"
#include "core/comm/nccl_communicator.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/muon/bounds.h"
#include "core/muon/coefficients.h"
#include "glog/logging.h"
#include "server/common/proto_convert.h"
#include "server/common/proto_convert_options.h"
#include "server/daemon/exchange_counting.h"

namespace muond {
namespace {

absl::Status InGroup(const v1::ParamGroup& group, absl::Status st) {
  if (st.ok()) return st;
  return WithContext(st, absl::StrCat("group '", group.name(), "': "));
}

template <typename T>
absl::StatusOr<T> InGroup(const v1::ParamGroup& group,
                          absl::StatusOr<T> value) {
  if (value.ok()) return value;
  return InGroup(group, value.status());
}

// Coefficient `index` of custom_coefficients finite as a float32, checked
// before the fp32 cast (as eps) so that 1e300 is named as out of the fp32
// range, with the value as sent, not as the cast's "non-finite" inf.
absl::Status CheckCoefficientFloat32(double value, int index) {
  if (std::isfinite(value) && std::isfinite(static_cast<float>(value))) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("custom_coefficients: tuple ", index / 3, " value ",
                   index % 3, " must be finite as a float32 (|value| <= ",
                   std::numeric_limits<float>::max(), "), got ", value));
}

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

absl::StatusOr<MuonOptions> MuonOptionsFromProto(const v1::ParamGroup& group) {
  const v1::MuonHyperparams& h = group.muon();
  MuonOptions o;
  o.lr = h.lr();
  o.momentum = h.momentum();
  o.nesterov = h.nesterov();
  o.weight_decay = h.weight_decay();
  // UNSPECIFIED enums and unset optional fields keep MuonOptions' defaults.
  if (h.weight_decay_method() != v1::WEIGHT_DECAY_METHOD_UNSPECIFIED) {
    ASSIGN_OR_RETURN(o.weight_decay_method,
                     InGroup(group, FromProto(h.weight_decay_method(),
                                              "weight_decay_method")));
  }
  if (h.coefficient_type() != v1::COEFFICIENT_TYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(
        o.ns.coefficient_type,
        InGroup(group, FromProto(h.coefficient_type(), "coefficient_type")));
  }
  if (h.custom_coefficients_size() % 3 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", group.name(), "': custom_coefficients has ",
        h.custom_coefficients_size(), " values, not a multiple of 3"));
  }
  for (int i = 0; i < h.custom_coefficients_size(); ++i) {
    RETURN_IF_ERROR(
        InGroup(group, CheckCoefficientFloat32(h.custom_coefficients(i), i)));
  }
  for (int i = 0; i + 2 < h.custom_coefficients_size(); i += 3) {
    o.ns.custom.push_back({float(h.custom_coefficients(i)),
                           float(h.custom_coefficients(i + 1)),
                           float(h.custom_coefficients(i + 2))});
  }
  if (h.has_num_ns_steps()) o.ns.num_steps = h.num_ns_steps();
  if (h.has_eps()) {
    // Checked before the fp32 cast so the message shows the value sent.
    RETURN_IF_ERROR(InGroup(group, CheckPositiveFloat32(h.eps(), "muon eps")));
    o.ns.eps = float(h.eps());
  }
  if (h.scale_mode() != v1::SCALE_MODE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(o.scale_mode,
                     InGroup(group, FromProto(h.scale_mode(), "scale_mode")));
  }
  if (h.has_extra_scale_factor()) {
    o.extra_scale_factor = h.extra_scale_factor();
  }
  if (h.has_ns_batch_size()) o.ns_batch_size = h.ns_batch_size();
  if (h.fp32_matmul_prec() != v1::MATMUL_PRECISION_UNSPECIFIED) {
    ASSIGN_OR_RETURN(
        o.ns.precision,
        InGroup(group, FromProto(h.fp32_matmul_prec(), "fp32_matmul_prec")));
  }
  o.ns.use_syrk = h.use_syrk();
  if (h.ns_algorithm() != v1::NS_ALGORITHM_UNSPECIFIED) {
    ASSIGN_OR_RETURN(o.ns.algorithm, InGroup(group, FromProto(h.ns_algorithm(),
                                                              "ns_algorithm")));
  }
  if (h.has_gram_restarts()) {
    o.ns.gram_restarts.emplace(h.gram_restarts().iterations().begin(),
                               h.gram_restarts().iterations().end());
  }
  if (h.gram_dtype() != v1::NS_ITER_DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(o.ns.gram_dtype,
                     InGroup(group, FromProto(h.gram_dtype(), "gram_dtype")));
  }
  if (h.has_gram_min_aspect_ratio()) {
    o.ns.gram_min_aspect_ratio = h.gram_min_aspect_ratio();
  }
  // Validate (ValidateGramOptions) names gram_restarts / gram_dtype /
  // gram_min_aspect_ratio and the rule.
  RETURN_IF_ERROR(InGroup(group, o.Validate()));
  return o;
}

absl::StatusOr<AdamWOptions> AdamWOptionsFromProto(
    const v1::ParamGroup& group) {
  const v1::AdamWHyperparams& h = group.adamw();
  AdamWOptions o;
  o.lr = h.lr();
  if (h.has_beta1()) o.beta1 = h.beta1();
  if (h.has_beta2()) o.beta2 = h.beta2();
  if (h.has_eps()) o.eps = h.eps();
  o.weight_decay = h.weight_decay();
  RETURN_IF_ERROR(InGroup(group, o.Validate()));
  return o;
}

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
        const std::string prefix =
            absl::StrCat("comm/", d.name(), "/v", plan.version());
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
      if (config.algorithm == Algorithm::kMuon) {
        ASSIGN_OR_RETURN(config.muon, MuonOptionsFromProto(group.proto));
      } else {
        ASSIGN_OR_RETURN(config.adamw, AdamWOptionsFromProto(group.proto));
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
                                 absl::StrCat("jobcomm/v", plan.version()),
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
