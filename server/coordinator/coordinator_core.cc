#include "server/coordinator/coordinator_core.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/plan/sharding.h"
#include "glog/logging.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"
#include "server/common/checked_math.h"
#include "server/common/job_id.h"
#include "server/common/ns_load.h"
#include "server/common/proto_convert.h"

namespace muond {
namespace {

// Bytes of a daemon's own refusal reason the coordinator repeats to every
// rank (a raw client could send megabytes).
constexpr size_t kMaxRefusalReasonBytes = 2048;

std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

std::string TagsString(const v1::ShardTags& t) {
  return absl::StrCat("{tensor_model_parallel=", t.tensor_model_parallel(),
                      ", partition_dim=", t.partition_dim(),
                      ", is_gtp_weight_remat=", t.is_gtp_weight_remat(),
                      ", pad_length=", t.pad_length(), ", gtp_rows=[",
                      absl::StrJoin(t.gtp_rows(), ", "), "]}");
}

bool SameShape(const google::protobuf::RepeatedField<int64_t>& a,
               const google::protobuf::RepeatedField<int64_t>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

bool SameTags(const v1::ShardTags& a, const v1::ShardTags& b) {
  return a.tensor_model_parallel() == b.tensor_model_parallel() &&
         a.partition_dim() == b.partition_dim() &&
         a.is_gtp_weight_remat() == b.is_gtp_weight_remat() &&
         a.pad_length() == b.pad_length() &&
         SameShape(a.gtp_rows(), b.gtp_rows());
}

// Empty when `a` (rank ra) and `b` (rank rb) describe the same params;
// otherwise the first difference, naming the param, both ranks and, for
// replicas of one (g, t), their replicas d.
std::string FirstParamDifference(const v1::GroupManifest& a, int ra,
                                 const v1::GroupManifest& b, int rb) {
  const bool replicas =
      a.domain().g() == b.domain().g() && a.domain().t() == b.domain().t();
  const std::string where = absl::StrCat(
      "group '", a.group(), "': rank ", ra, " and rank ", rb,
      replicas && a.domain().d() != b.domain().d()
          ? absl::StrCat(" (replicas d=", a.domain().d(),
                         " and d=", b.domain().d(), " of (g=", a.domain().g(),
                         ", t=", a.domain().t(), "))")
          : "");
  const int n = std::min(a.params_size(), b.params_size());
  for (int i = 0; i < n; ++i) {
    const v1::ParamSpec& pa = a.params(i);
    const v1::ParamSpec& pb = b.params(i);
    const std::string at =
        absl::StrCat(where, " differ at param #", i, " '", pa.name(), "'");
    if (pa.name() != pb.name()) {
      return absl::StrCat(at, ": name '", pa.name(), "' vs '", pb.name(), "'");
    }
    if (!SameShape(pa.full_shape(), pb.full_shape())) {
      return absl::StrCat(at, ": full_shape ", ShapeString(pa.full_shape()),
                          " vs ", ShapeString(pb.full_shape()));
    }
    // Uneven gtp_rows blocks differ by g: full_shape, tags and g imply the
    // local shape (each daemon checks it), so only replicas compare it.
    if (a.domain().g() == b.domain().g() &&
        !SameShape(pa.local_shape(), pb.local_shape())) {
      return absl::StrCat(at, ": local_shape ", ShapeString(pa.local_shape()),
                          " vs ", ShapeString(pb.local_shape()));
    }
    if (!SameTags(pa.tags(), pb.tags())) {
      return absl::StrCat(at, ": tags ", TagsString(pa.tags()), " vs ",
                          TagsString(pb.tags()));
    }
  }
  if (a.params_size() != b.params_size()) {
    const bool a_longer = a.params_size() > b.params_size();
    const v1::ParamSpec& extra = a_longer ? a.params(n) : b.params(n);
    return absl::StrCat(where, " differ at param #", n, " '", extra.name(),
                        "': only rank ", a_longer ? ra : rb, " has it (",
                        a.params_size(), " vs ", b.params_size(), " params)");
  }
  if (a.algorithm() != b.algorithm()) {
    return absl::StrCat(
        where, " differ in algorithm: ", v1::Algorithm_Name(a.algorithm()),
        " vs ", v1::Algorithm_Name(b.algorithm()));
  }
  return "";
}

std::string FieldText(const google::protobuf::Message& m,
                      const google::protobuf::FieldDescriptor* field);

// A message on one line: "{name: value, ...}" over its set fields, "{}" for
// none (TextFormat's own printing ends fields with newlines, which broke the
// disagreement message across lines).
std::string MessageText(const google::protobuf::Message& m) {
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  m.GetReflection()->ListFields(m, &fields);
  std::vector<std::string> parts;
  for (const google::protobuf::FieldDescriptor* f : fields) {
    parts.push_back(absl::StrCat(f->name(), ": ", FieldText(m, f)));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

// One field's value as text: "unset" for an unset field with presence, the
// elements in brackets for a repeated field, a message as MessageText.
std::string FieldText(const google::protobuf::Message& m,
                      const google::protobuf::FieldDescriptor* field) {
  const google::protobuf::Reflection* r = m.GetReflection();
  const bool is_message =
      field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE;
  std::string out, value;
  if (field->is_repeated()) {
    std::vector<std::string> items;
    for (int i = 0; i < r->FieldSize(m, field); ++i) {
      if (is_message) {
        items.push_back(MessageText(r->GetRepeatedMessage(m, field, i)));
        continue;
      }
      google::protobuf::TextFormat::PrintFieldValueToString(m, field, i,
                                                            &value);
      items.push_back(value);
    }
    return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
  }
  if (field->has_presence() && !r->HasField(m, field)) return "unset";
  if (is_message) return MessageText(r->GetMessage(m, field));
  google::protobuf::TextFormat::PrintFieldValueToString(m, field, -1, &out);
  return out;
}

// Empty when the hyperparameters `a` (rank ra) and `b` (rank rb) of `group`
// agree field by field, as on the wire; otherwise the first field that
// differs with both ranks' values. Generic over the message so a field added
// to MuonHyperparams/AdamWHyperparams is compared without a change here.
std::string FirstHyperparamDifference(const std::string& group,
                                      const google::protobuf::Message& a,
                                      int ra,
                                      const google::protobuf::Message& b,
                                      int rb) {
  const google::protobuf::Descriptor* d = a.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = d->field(i);
    const std::string va = FieldText(a, field), vb = FieldText(b, field);
    if (va == vb) continue;
    return absl::StrCat("group '", group, "': hyperparameter ", d->name(), ".",
                        field->name(), " differs between ranks: rank ", ra,
                        " has ", va, ", rank ", rb, " has ", vb,
                        "; every rank must register the group with the same "
                        "hyperparameters");
  }
  return "";
}

std::string GroupHyperparamDifference(const v1::GroupManifest& a, int ra,
                                      const v1::GroupManifest& b, int rb) {
  std::string diff =
      FirstHyperparamDifference(a.group(), a.muon(), ra, b.muon(), rb);
  if (diff.empty()) {
    diff = FirstHyperparamDifference(a.group(), a.adamw(), ra, b.adamw(), rb);
  }
  return diff;
}

// A shape from the wire: 1 or 2 dims (what the servers register), each
// >= 1, whose element count fits int64.
absl::Status CheckWireShape(const std::string& where, const char* field,
                            const google::protobuf::RepeatedField<int64_t>& s,
                            bool zero_rows_ok = false) {
  if (s.size() < 1 || s.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ", field, " ", ShapeString(s), " must have 1 or 2 dims"));
  }
  std::optional<int64_t> elements = 1;
  for (int i = 0; i < s.size(); ++i) {
    const int64_t dim = s[i];
    if (dim == 0 && i == 0 && zero_rows_ok && s.size() == 2) continue;
    if (dim < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", field, " ", ShapeString(s), " has a dim < 1"));
    }
    if (elements) elements = CheckedMul(*elements, dim);
  }
  if (!elements) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", field, " ", ShapeString(s),
                     " has more elements than int64 holds"));
  }
  return absl::OkStatus();
}

// A Join's host, device or address: kept per rank, logged and listed by
// ListDaemons, so bounded and printable (a host name is at most 253
// characters; a unix socket path at most 107 bytes).
absl::Status CheckJoinText(absl::string_view field, absl::string_view value) {
  constexpr size_t kMaxJoinTextBytes = 255;
  const bool printable = std::all_of(value.begin(), value.end(), [](char c) {
    return absl::ascii_isprint(static_cast<unsigned char>(c));
  });
  if (value.size() <= kMaxJoinTextBytes && printable) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": ", value.size(), " bytes \"",
      absl::CHexEscape(value.substr(0, 64)), value.size() > 64 ? "..." : "",
      "\" must be at most ", kMaxJoinTextBytes,
      " printable ASCII characters"));
}

absl::Status ValidateManifestShape(const v1::PublishManifestRequest& request) {
  std::set<std::string> groups;
  for (const v1::GroupManifest& g : request.groups()) {
    if (g.group().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", request.rank(), ": a group has an empty name"));
    }
    if (!groups.insert(g.group()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", request.rank(), ": group '", g.group(), "' appears twice"));
    }
    if (!v1::Algorithm_IsValid(g.algorithm())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", g.group(), "': algorithm: value ", g.algorithm(),
          " is not one of ALGORITHM_MUON, ALGORITHM_ADAMW (or unset)"));
    }
    const v1::Domain& d = g.domain();
    if (d.dp_size() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", g.group(), "': domain '", d.name(),
                       "': dp_size ", d.dp_size(), " must be >= 0 (0 = 1)"));
    }
    RETURN_IF_ERROR(CheckDomainCoordinates(
        DomainSizeOf(d), d.d(), d.g(), d.t(),
        absl::StrCat("group '", g.group(), "': domain '", d.name(), "'")));
    std::set<std::string> names;
    for (const v1::ParamSpec& p : g.params()) {
      if (p.name().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("group '", g.group(), "': a param has an empty name"));
      }
      if (!names.insert(p.name()).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "group '", g.group(), "': duplicate param name '", p.name(), "'"));
      }
      const std::string where = absl::StrCat("param '", p.name(), "'");
      RETURN_IF_ERROR(CheckWireShape(where, "full_shape", p.full_shape()));
      // 0 rows: an empty shard of uneven gtp_rows blocks.
      RETURN_IF_ERROR(
          CheckWireShape(where, "local_shape", p.local_shape(), true));
      if (p.local_shape_size() != p.full_shape_size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": local_shape ", ShapeString(p.local_shape()),
                         " and full_shape ", ShapeString(p.full_shape()),
                         " must have the same number of dims"));
      }
    }
  }
  return absl::OkStatus();
}

// "GxT", or "DxGxT" with a DP axis: how messages name a domain's sizes.
std::string DomainText(const v1::Domain& d) {
  return absl::StrCat(DpSizeOf(d) > 1 ? absl::StrCat(DpSizeOf(d), "x") : "",
                      d.gtp_size(), "x", d.tp_size());
}

// "(g=0, t=1)", or "(d=1, g=0, t=1)" with a DP axis.
std::string CoordText(const v1::Domain& d) {
  return absl::StrCat("(",
                      DpSizeOf(d) > 1 ? absl::StrCat("d=", d.d(), ", ") : "",
                      "g=", d.g(), ", t=", d.t(), ")");
}

std::string Fingerprint(const std::map<int, std::string>& manifests) {
  std::string out;
  for (const auto& [rank, bytes] : manifests) {
    absl::StrAppend(&out, rank, ":", bytes.size(), ":", bytes, ";");
  }
  return out;
}

}  // namespace

absl::Status CoordinatorOptions::Validate() const {
  RETURN_IF_ERROR(ValidatePlansKept("plans_kept", plans_kept));
  if (!std::isfinite(rebalance_threshold) || rebalance_threshold < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rebalance_threshold: ", rebalance_threshold,
                     " must be finite and >= 0 (0 = off)"));
  }
  for (const auto& [field, value] :
       {std::pair<const char*, int64_t>{"rebalance_interval_steps",
                                        rebalance_interval_steps},
        {"rebalance_activate_margin", rebalance_activate_margin}}) {
    if (value < 1 || value > kMaxRebalanceSteps) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", value, " must be in [1, ", kMaxRebalanceSteps, "]"));
    }
  }
  for (const auto& [field, value] :
       {std::pair<const char*, absl::Duration>{"max_wait", max_wait},
        {"job_idle_expiry_s", job_idle_expiry},
        {"join_grace_s", join_grace}}) {
    if (value <= absl::ZeroDuration() || value == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", absl::FormatDuration(value), " must be > 0 and finite"));
    }
  }
  for (const auto& [field, value] :
       {std::pair<const char*, int64_t>{"max_jobs", max_jobs},
        {"kv_max_key_bytes", kv.max_key_bytes},
        {"kv_max_value_bytes", kv.max_value_bytes},
        {"kv_max_keys_per_job", kv.max_keys_per_job},
        {"kv_max_total_bytes", kv.max_total_bytes}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", value, " must be >= 1"));
    }
  }
  return absl::OkStatus();
}

CoordinatorCore::CoordinatorCore(CoordinatorOptions options)
    : options_(std::move(options)),
      own_metrics_(options_.metrics == nullptr
                       ? std::make_unique<CoordinatorMetrics>()
                       : nullptr),
      metrics_(options_.metrics != nullptr ? options_.metrics
                                           : own_metrics_.get()) {}

bool CoordinatorCore::Live(const Daemon& daemon, absl::Time now) const {
  return daemon.streams > 0 ||
         (daemon.join_pending && now - daemon.joined_at < options_.join_grace);
}

bool CoordinatorCore::AnyLive(const Job& job, absl::Time now) const {
  for (const auto& [rank, d] : job.daemons) {
    if (Live(d, now)) return true;
  }
  return false;
}

void CoordinatorCore::ClearKv(Job& job) {
  total_kv_bytes_ -= job.kv_bytes;
  job.kv_bytes = 0;
  job.kv.clear();
}

void CoordinatorCore::ExpireIdleJobs(absl::Time now) {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& job = *it->second;
    if (job.waiters > 0 || AnyLive(job, now) ||
        now - job.last_activity < options_.job_idle_expiry) {
      ++it;
      continue;
    }
    LOG(INFO) << "job " << job.id << ": no live daemon and no call for "
              << absl::FormatDuration(now - job.last_activity)
              << "; forgetting it (world size, token, store, plans)";
    ClearKv(job);
    it = jobs_.erase(it);
  }
}

std::unique_ptr<CoordinatorCore::Job> CoordinatorCore::NewJob(
    const v1::JoinRequest& request) const {
  auto job = std::make_unique<Job>();
  job->plans = PlanHistory<v1::Plan>(options_.plans_kept);
  job->id = request.job_id();
  job->world_size = request.world_size();
  job->token = request.token();
  job->last_activity = options_.clock();
  return job;
}

absl::StatusOr<CoordinatorCore::Job*> CoordinatorCore::FindJob(
    const std::string& job_id) {
  RETURN_IF_ERROR(CheckJobId("job_id", job_id));
  const absl::Time now = options_.clock();
  ExpireIdleJobs(now);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job_id '", job_id,
                     "' is unknown to this coordinator (no daemon "
                     "joined it, or it expired after its daemons left)"));
  }
  it->second->last_activity = now;
  return it->second.get();
}

absl::StatusOr<v1::JoinResponse> CoordinatorCore::Join(
    const v1::JoinRequest& request) {
  RETURN_IF_ERROR(CheckJobId("job_id", request.job_id()));
  if (request.world_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: ", request.world_size(), " must be >= 1"));
  }
  if (request.rank() < 0 || request.rank() >= request.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(),
                                                   " is outside [0, ",
                                                   request.world_size(), ")"));
  }
  RETURN_IF_ERROR(CheckJoinText("host", request.host()));
  RETURN_IF_ERROR(CheckJoinText("device", request.device()));
  RETURN_IF_ERROR(CheckJoinText("address", request.address()));
  if (!options_.token.empty() && request.token() != options_.token) {
    return absl::PermissionDeniedError(
        absl::StrCat("job '", request.job_id(), "' rank ", request.rank(),
                     ": token does not match the coordinator's"));
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock();
  ExpireIdleJobs(now);
  auto found = jobs_.find(request.job_id());
  if (found == jobs_.end() && int(jobs_.size()) >= options_.max_jobs) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", request.job_id(), "': this coordinator holds max_jobs=",
        options_.max_jobs, " jobs already (idle jobs expire after ",
        absl::FormatDuration(options_.job_idle_expiry), ")"));
  }
  std::unique_ptr<Job>& slot = jobs_[request.job_id()];
  if (slot == nullptr) {
    slot = NewJob(request);
    metrics_->JobCreated(slot->id);
  } else if (slot->waiters == 0 && !AnyLive(*slot, now) &&
             (slot->world_size != request.world_size() ||
              slot->token != request.token())) {
    // Every daemon of the old incarnation is gone: its world size and token
    // bind nobody any more.
    LOG(INFO) << "job " << slot->id << ": no daemon is live; a Join with "
              << "another world size or token starts the job afresh";
    ClearKv(*slot);
    slot = NewJob(request);
  }
  Job& job = *slot;
  job.last_activity = now;
  if (request.world_size() != job.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "world_size: ", request.world_size(), " differs from job '", job.id,
        "' world size ", job.world_size));
  }
  if (request.token() != job.token) {
    return absl::PermissionDeniedError(
        absl::StrCat("job '", job.id, "' rank ", request.rank(),
                     ": token differs from the job's first daemon"));
  }
  auto it = job.daemons.find(request.rank());
  if (it != job.daemons.end() && Live(it->second, now)) {
    const Daemon& d = it->second;
    return absl::AlreadyExistsError(absl::StrCat(
        "job '", job.id, "' rank ", request.rank(),
        " is already joined and live (from ", d.join.host(), " at ",
        d.join.address(), "; ",
        d.streams > 0
            ? "its plan stream is open"
            : absl::StrCat("joined ", absl::FormatDuration(now - d.joined_at),
                           " ago; a join with no plan stream is replaced "
                           "after ",
                           absl::FormatDuration(options_.join_grace)),
        ")"));
  }
  if (!AnyLive(job, now) && !job.kv.empty()) {
    // Every daemon of the job went away and one is back (the job restarts):
    // rendezvous keys of the dead incarnation would point peers at dead
    // addresses, so the new one starts from an empty store.
    LOG(INFO) << "job " << job.id << ": every daemon had left; clearing "
              << job.kv.size() << " rendezvous keys";
    ClearKv(job);
  }
  Daemon& daemon = job.daemons[request.rank()];
  daemon.join = request;
  daemon.join.clear_token();
  daemon.streams = 0;
  daemon.join_pending = true;
  daemon.joined_at = now;
  daemon.refusals_at_join = job.refusals;
  v1::JoinResponse response;
  response.set_store_prefix(absl::StrCat("job/", job.id));
  return response;
}

absl::Status CoordinatorCore::CheckJobToken(const std::string& job_id,
                                            const std::string& token) {
  // First of every RPC but Join (which checks it itself): an id no daemon
  // could have joined with is refused before it reaches a log or a lookup.
  RETURN_IF_ERROR(CheckJobId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second->token.empty()) return absl::OkStatus();
  const std::string& want = it->second->token;
  unsigned char diff = want.size() == token.size() ? 0 : 1;
  for (size_t i = 0; i < want.size() && i < token.size(); ++i)
    diff |= want[i] ^ token[i];
  if (diff != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("job '", job_id,
                     "' requires its token (metadata 'x-muond-token' or "
                     "'authorization: Bearer <token>')"));
  }
  return absl::OkStatus();
}

bool CoordinatorCore::StartWatching(const std::string& job_id, int rank) {
  absl::MutexLock lock(&mu_);
  auto job = jobs_.find(job_id);
  if (job == jobs_.end()) return false;
  auto it = job->second->daemons.find(rank);
  if (it == job->second->daemons.end()) return false;
  ++it->second.streams;
  it->second.join_pending = false;
  job->second->last_activity = options_.clock();
  return true;
}

void CoordinatorCore::Leave(const std::string& job_id, int rank) {
  absl::MutexLock lock(&mu_);
  auto job = jobs_.find(job_id);
  if (job == jobs_.end()) return;
  job->second->last_activity = options_.clock();
  auto it = job->second->daemons.find(rank);
  if (it == job->second->daemons.end()) return;
  it->second.streams = std::max(0, it->second.streams - 1);
  it->second.join_pending = false;
}

absl::Status CoordinatorCore::KvSet(const v1::KvSetRequest& request) {
  RETURN_IF_ERROR(CheckJobId("job_id", request.job_id()));  // errors quote it
  if (request.key().empty()) {
    return absl::InvalidArgumentError("key: must not be empty");
  }
  const KvLimits& limits = options_.kv;
  auto exhausted = [&](const char* limit, int64_t value, int64_t max) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KvSet of job '", request.job_id(), "': ", limit, "=", max,
                     " exceeded (", value, ")"));
  };
  const int64_t key_bytes = request.key().size();
  const int64_t value_bytes = request.value().size();
  if (key_bytes > limits.max_key_bytes) {
    return exhausted("kv_max_key_bytes", key_bytes, limits.max_key_bytes);
  }
  if (value_bytes > limits.max_value_bytes) {
    return exhausted("kv_max_value_bytes", value_bytes, limits.max_value_bytes);
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  auto it = job->kv.find(request.key());
  const int64_t old_bytes =
      it == job->kv.end() ? 0 : key_bytes + int64_t(it->second.size());
  if (it == job->kv.end() &&
      int64_t(job->kv.size()) >= limits.max_keys_per_job) {
    return exhausted("kv_max_keys_per_job", job->kv.size() + 1,
                     limits.max_keys_per_job);
  }
  const int64_t total = total_kv_bytes_ - old_bytes + key_bytes + value_bytes;
  if (total > limits.max_total_bytes) {
    return exhausted("kv_max_total_bytes", total, limits.max_total_bytes);
  }
  job->kv[request.key()] = request.value();
  job->kv_bytes += key_bytes + value_bytes - old_bytes;
  total_kv_bytes_ = total;
  return absl::OkStatus();
}

absl::StatusOr<std::string> CoordinatorCore::KvGet(
    const v1::KvGetRequest& request, const std::function<bool()>& cancelled) {
  if (request.key().empty()) {
    return absl::InvalidArgumentError("key: must not be empty");
  }
  if (request.timeout_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: ", request.timeout_ms(), " must be >= 0"));
  }
  const absl::Duration timeout =
      std::min(absl::Milliseconds(request.timeout_ms()), options_.max_wait);
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  // A job is never deleted under a waiter, so `job` stays valid while we
  // wait (a fresh job replaces it only when it has no waiter either).
  ++job->waiters;
  auto is_set = [job, &request]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return job->kv.count(request.key()) > 0;
  };
  while (!is_set()) {
    const absl::Time now = absl::Now();
    if (now >= deadline || (cancelled && cancelled())) {
      --job->waiters;
      return absl::DeadlineExceededError(
          absl::StrCat("key '", request.key(), "' of job '", job->id,
                       "' was not set within ", request.timeout_ms(), " ms"));
    }
    mu_.AwaitWithTimeout(absl::Condition(&is_set),
                         std::min(deadline - now, absl::Milliseconds(200)));
  }
  --job->waiters;
  job->last_activity = options_.clock();
  return job->kv.at(request.key());
}

absl::Status CoordinatorCore::CheckAgainstPeers(
    const Job& job, const v1::PublishManifestRequest& request) {
  for (const v1::GroupManifest& mine : request.groups()) {
    for (const auto& [rank, daemon] : job.daemons) {
      if (rank == request.rank() || !daemon.has_manifest) continue;
      for (const v1::GroupManifest& theirs : daemon.manifest.groups()) {
        if (theirs.group() != mine.group()) continue;
        const v1::Domain& a = mine.domain();
        const v1::Domain& b = theirs.domain();
        if (a.name() != b.name() || a.gtp_size() != b.gtp_size() ||
            a.tp_size() != b.tp_size() || DpSizeOf(a) != DpSizeOf(b)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "group '", mine.group(), "': rank ", request.rank(),
              " has domain '", a.name(), "' ", DomainText(a), " but rank ",
              rank, " has '", b.name(), "' ", DomainText(b)));
        }
        if (a.g() == b.g() && a.t() == b.t() && a.d() == b.d()) {
          return absl::InvalidArgumentError(
              absl::StrCat("group '", mine.group(), "': ranks ", rank, " and ",
                           request.rank(), " both claim ", CoordText(a),
                           " of domain '", a.name(), "'"));
        }
        // The earlier rank is the reference, so messages read "rank 0 and
        // rank 1 differ".
        const std::string diff =
            rank < request.rank()
                ? FirstParamDifference(theirs, rank, mine, request.rank())
                : FirstParamDifference(mine, request.rank(), theirs, rank);
        if (!diff.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "manifest mismatch in domain '", a.name(), "': ", diff));
        }
        // The published rank is the reference, the later one is refused.
        const std::string hyper =
            GroupHyperparamDifference(theirs, rank, mine, request.rank());
        if (!hyper.empty()) return absl::InvalidArgumentError(hyper);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CoordinatorCore::CheckNoRoundInProgress(const Job& job) const {
  int published = 0, in_round = 0;
  for (const auto& [rank, daemon] : job.daemons) {
    published += daemon.has_manifest;
    in_round += daemon.has_manifest && daemon.new_round;
  }
  // A rebalance now would plan from a mix of old and new registrations and
  // leave the ranks still to publish waiting for their round's plan.
  if (published < job.world_size || (in_round > 0 && !job.plans.empty())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id, "': registration round in progress: ",
        in_round > 0 ? in_round : published, " of ", job.world_size,
        " ranks published; retry once every rank has registered"));
  }
  return absl::OkStatus();
}

bool CoordinatorCore::AllPublished(const Job& job) const {
  int published = 0;
  for (const auto& [rank, daemon] : job.daemons)
    published += daemon.has_manifest;
  return published == job.world_size;
}

absl::StatusOr<v1::Plan> CoordinatorCore::ComputePlan(
    const Job& job, const CostTable& costs, v1::CostModel cost_model,
    int64_t activate_at_step) {
  absl::StatusOr<v1::Plan> plan =
      PlanJob(job, costs, cost_model, activate_at_step);
  if (!plan.ok()) metrics_->PlanBuildFailed(plan.status());
  return plan;
}

absl::StatusOr<v1::Plan> CoordinatorCore::PlanJob(const Job& job,
                                                  const CostTable& costs,
                                                  v1::CostModel cost_model,
                                                  int64_t activate_at_step) {
  // Per group: the manifest of the lowest rank and the (g, t) coverage.
  struct GroupInfo {
    const v1::GroupManifest* manifest = nullptr;
    std::set<std::tuple<int, int, int>> coords;  // (d, g, t)
  };
  std::map<std::string, GroupInfo> groups;
  for (const auto& [rank, daemon] : job.daemons) {
    for (const v1::GroupManifest& g : daemon.manifest.groups()) {
      GroupInfo& info = groups[g.group()];
      if (info.manifest == nullptr) info.manifest = &g;
      info.coords.insert({g.domain().d(), g.domain().g(), g.domain().t()});
    }
  }
  v1::Plan plan;
  plan.set_job_id(job.id);
  plan.set_version(job.plans.NextVersion());
  plan.set_activate_at_step(activate_at_step);
  plan.set_cost_model(cost_model);
  for (const auto& [name, info] : groups) {
    const v1::Domain& d = info.manifest->domain();
    const size_t expected =
        size_t(DpSizeOf(d)) * size_t(d.gtp_size()) * size_t(d.tp_size());
    if (info.coords.size() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", name, "': ", info.coords.size(), " of the ", expected,
          " ranks of domain '", d.name(), "' (", DomainText(d),
          ") published it; every rank of the domain must"));
    }
    v1::GroupPlan* group_plan = plan.add_groups();
    if (info.manifest->algorithm() == v1::ALGORITHM_ADAMW) {
      group_plan->set_group(name);
      continue;
    }
    if (!options_.planner) {
      return absl::InternalError("coordinator has no planner configured");
    }
    absl::StatusOr<v1::GroupPlan> computed =
        options_.planner(*info.manifest, cost_model, costs);
    if (!computed.ok()) {
      return WithContext(computed.status(),
                         absl::StrCat("planning group '", name, "': "));
    }
    *group_plan = *std::move(computed);
    group_plan->set_group(name);
    if (group_plan->homes_size() != info.manifest->params_size()) {
      return absl::InternalError(absl::StrCat(
          "planner returned ", group_plan->homes_size(), " homes for the ",
          info.manifest->params_size(), " params of group '", name, "'"));
    }
  }
  return plan;
}

absl::Status CoordinatorCore::PublishManifest(
    const v1::PublishManifestRequest& request) {
  return PublishRegistration(request, "").status();
}

absl::StatusOr<int64_t> CoordinatorCore::PublishRegistration(
    const v1::PublishManifestRequest& published,
    const std::string& registration) {
  const absl::Status valid = ValidatePublishFields(published, options_);
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Job*> job = FindJob(published.job_id());
  if (!job.ok()) return valid.ok() ? job.status() : valid;
  auto it = (*job)->daemons.find(published.rank());
  if (it == (*job)->daemons.end()) {
    if (!valid.ok()) return valid;
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", published.rank(), " has not joined job '",
                     (*job)->id, "'; Join first"));
  }
  Job& the_job = **job;
  metrics_->ManifestReceived(the_job.id);
  if (!published.registration_refused().empty()) {
    return RefuseOwnRegistration(the_job, published, registration);
  }
  RETURN_IF_ERROR(
      StaleForRefusedRound(the_job, it->second, published, registration));
  absl::StatusOr<int64_t> round =
      valid.ok() ? PublishJoined(the_job, it->second, published, registration)
                 : absl::StatusOr<int64_t>(valid);
  if (!round.ok()) {
    RefuseRound(the_job, published.rank(), registration, round.status().code(),
                absl::StrCat("registration round refused at rank ",
                             published.rank(), ": ", round.status().message()));
  }
  return round;
}

absl::Status CoordinatorCore::StaleForRefusedRound(
    const Job& job, const Daemon& daemon,
    const v1::PublishManifestRequest& published,
    const std::string& registration) const {
  if (registration.empty()) return absl::OkStatus();  // no id: judged as usual
  const absl::Status* refusal =
      registration == daemon.dropped_registration ? &daemon.dropped_by
      : registration == daemon.refused_publish    ? &daemon.refused_by
                                                  : nullptr;
  if (refusal == nullptr) return absl::OkStatus();
  // Not pushed to the plan streams: nothing changes for the other ranks, and
  // this rank hears it in the answer to its publish.
  LOG(WARNING) << "job " << job.id << ": rank " << published.rank()
               << " published registration " << registration
               << " of a refused round again; refused";
  return absl::Status(
      refusal->code(),
      absl::StrCat(refusal->message(), " (rank ", published.rank(),
                   " published its registration '", registration,
                   "' of that refused round again; register again)"));
}

absl::StatusOr<int64_t> CoordinatorCore::RefuseOwnRegistration(
    Job& job, const v1::PublishManifestRequest& published,
    const std::string& registration) {
  const int rank = published.rank();
  if (!published.groups().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, ": registration_refused is set but groups has ",
        published.groups_size(), " entries (a refusal carries no manifest)"));
  }
  std::string reason = published.registration_refused();
  if (reason.size() > kMaxRefusalReasonBytes) {
    reason.resize(kMaxRefusalReasonBytes);
    reason += "...";
  }
  RefuseRound(job, rank, registration, absl::StatusCode::kInvalidArgument,
              absl::StrCat("rank ", rank,
                           " refused its trainer's registration: ", reason));
  return job.plans.NextVersion();
}

void CoordinatorCore::RefuseRound(Job& job, int refused_rank,
                                  const std::string& registration,
                                  absl::StatusCode code,
                                  const std::string& reason) {
  // The coordinator cannot tell which side of a disagreement is wrong, nor
  // whether the daemons that published before still hold their registration
  // (muond.torch.Muon unregisters everywhere on a refusal). Keeping their
  // manifests let a retry be compared against a value of the refused attempt,
  // or complete the round with a registration nobody holds any more (a plan
  // some ranks build and others never see): the whole round goes, every rank
  // registers again.
  int dropped = 0;
  const absl::Status refusal(code, reason);
  for (auto& [rank, d] : job.daemons) {
    d.refused_registration = rank == refused_rank ? registration : "";
    if (rank == refused_rank && !registration.empty()) {
      d.refused_publish = registration;
      d.refused_by = refusal;
    }
    // Only this round's: a manifest of a completed round (a plan was made
    // from it) stays, so a raw bad PublishManifest cannot erase a running
    // job's registration (nor leave the next bad one nothing to compare with).
    if (!d.has_manifest || !d.new_round) continue;
    if (rank != refused_rank) d.refused_registration = d.registration;
    if (!d.registration.empty()) {
      d.dropped_registration = d.registration;
      d.dropped_by = refusal;
    }
    d.has_manifest = false;
    d.new_round = false;
    d.registration.clear();
    ++dropped;
  }
  ++job.refusals;
  job.refusal_reason = reason;
  job.refusal_code = code;
  LOG(WARNING) << "job " << job.id << ": " << reason << "; dropped " << dropped
               << " manifests of the round, every rank must register again";
}

absl::Status CoordinatorCore::ValidatePublishFields(
    const v1::PublishManifestRequest& published,
    const CoordinatorOptions& options) {
  RETURN_IF_ERROR(ValidateManifestShape(published));
  for (const auto& [field, value] :
       {std::pair<const char*, int64_t>{"known_plan_version",
                                        published.known_plan_version()},
        {"last_step_id", published.last_step_id()}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest of rank ", published.rank(), ": ", field,
                       " must be >= 0, got ", value));
    }
  }
  if (published.known_plan_version() > kMaxPlanVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest of rank ", published.rank(),
                     ": known_plan_version ", published.known_plan_version(),
                     " exceeds kMaxPlanVersion ", kMaxPlanVersion));
  }
  // A restarted coordinator activates its first plan this far after it.
  if (!CheckedAdd(published.last_step_id(),
                  options.rebalance_activate_margin)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "manifest of rank ", published.rank(), ": last_step_id ",
        published.last_step_id(), " plus rebalance_activate_margin ",
        options.rebalance_activate_margin, " overflows int64"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CoordinatorCore::PublishJoined(
    Job& job_ref, Daemon& daemon, const v1::PublishManifestRequest& published,
    const std::string& registration) {
  Job* job = &job_ref;
  // The daemon's resume fields are not part of its manifest: a reconnect
  // re-publishes the same manifest with newer values.
  v1::PublishManifestRequest request = published;
  request.clear_known_plan_version();
  request.clear_last_step_id();
  for (const v1::GroupManifest& g : request.groups()) {
    const int64_t ranks = int64_t(DpSizeOf(g.domain())) *
                          int64_t(g.domain().gtp_size()) *
                          int64_t(g.domain().tp_size());
    if (ranks > job->world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", g.group(), "': domain '", g.domain().name(), "' ",
          DomainText(g.domain()), " has ", ranks, " ranks, more than job '",
          job->id, "' world size ", job->world_size));
    }
  }
  job->plans.RaiseFloor(published.known_plan_version(),
                        published.last_step_id());
  // Any plan computed from now on is at least this version.
  const int64_t round_version = job->plans.NextVersion();
  const std::string bytes = request.SerializeAsString();
  const bool same_manifest =
      daemon.has_manifest && daemon.manifest.SerializeAsString() == bytes;
  if (same_manifest && registration == daemon.registration) {
    return round_version;  // a daemon re-publishing after a reconnect
  }
  if (daemon.has_manifest && !same_manifest) {
    // A re-registration: start a new round, the peers publish again. A
    // peer that already published in this round (since the latest plan)
    // keeps its manifest: its registration is as new as this one, and it
    // will not publish again (e.g. a trainer's add_param_group that changed
    // only this rank's groups; the unchanged rank may publish first).
    LOG(INFO) << "job " << job->id << ": rank " << request.rank()
              << " published a new manifest; waiting for every rank again";
    for (auto& [rank, d] : job->daemons) {
      if (!d.new_round) d.has_manifest = false;
    }
  }
  RETURN_IF_ERROR(CheckAgainstPeers(*job, request));
  daemon.manifest = request;
  daemon.has_manifest = true;
  daemon.registration = registration;
  daemon.new_round = true;
  if (!AllPublished(*job)) return round_version;

  std::map<int, std::string> manifests;
  bool round_complete = true;
  for (const auto& [rank, d] : job->daemons) {
    manifests[rank] = d.manifest.SerializeAsString();
    round_complete &= d.new_round;
  }
  const std::string fingerprint = Fingerprint(manifests);
  if (fingerprint == job->planned_fingerprint && !round_complete) {
    return round_version;
  }
  // A plan for a new round serves params that have no plan yet: at once.
  // Unless this coordinator restarted under daemons that are stepping with
  // plans of its predecessor: they keep those until every rank can switch
  // together, as after a rebalance.
  const int64_t activate =
      job->plans.RoundActivationStep(options_.rebalance_activate_margin);
  absl::StatusOr<v1::Plan> plan =
      ComputePlan(*job, CostTable{}, v1::COST_MODEL_NS_COST, activate);
  if (!plan.ok()) return plan.status();  // the caller refuses the round
  RETURN_IF_ERROR(job->plans.Append(*std::move(plan)));
  metrics_->PlanBuilt(job->id, /*rebalance=*/false);
  job->planned_fingerprint = fingerprint;
  for (auto& [rank, d] : job->daemons) d.new_round = false;
  LOG(INFO) << "job " << job->id << ": plan version "
            << job->plans.newest()->version() << " computed for "
            << job->plans.newest()->groups_size() << " groups";
  return round_version;
}

absl::StatusOr<v1::Plan> CoordinatorCore::GetPlan(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(job_id));
  if (job->plans.empty()) {
    return WithErrorReason(
        absl::NotFoundError(absl::StrCat(
            "job '", job_id, "' has no plan yet (waiting for manifests)")),
        ErrorReason::kNoPlanYet);
  }
  return *job->plans.newest();
}

absl::StatusOr<std::optional<v1::Plan>> CoordinatorCore::WaitForPlan(
    const std::string& job_id, int64_t after_version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(job_id));
  auto newer = [job, after_version]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return job->plans.NextForWatcher(after_version) != nullptr;
  };
  ++job->waiters;  // keeps `job` from expiring while we wait
  const bool found = mu_.AwaitWithTimeout(absl::Condition(&newer), timeout);
  --job->waiters;
  if (!found) return std::optional<v1::Plan>();
  return std::optional<v1::Plan>(*job->plans.NextForWatcher(after_version));
}

absl::StatusOr<std::optional<v1::Plan>> CoordinatorCore::WaitForWatcher(
    const std::string& job_id, int rank, int64_t after_version,
    int64_t* refusals_seen, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(job_id));
  if (*refusals_seen < 0) {
    // From the rank's Join on: a refusal between the Join and the stream's
    // first wait is this rank's news too.
    auto it = job->daemons.find(rank);
    *refusals_seen =
        it == job->daemons.end() ? job->refusals : it->second.refusals_at_join;
  }
  auto ready = [job, after_version, refusals_seen]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                     return job->refusals > *refusals_seen ||
                            job->plans.NextForWatcher(after_version) != nullptr;
                   };
  ++job->waiters;  // keeps `job` from expiring while we wait
  const bool found = mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  --job->waiters;
  if (!found) return std::optional<v1::Plan>();
  if (job->refusals > *refusals_seen) {
    *refusals_seen = job->refusals;
    v1::Plan refusal;
    refusal.set_job_id(job->id);
    refusal.set_round_refused(job->refusal_reason);
    auto it = job->daemons.find(rank);
    if (it != job->daemons.end()) {
      refusal.set_refused_registration(it->second.refused_registration);
    }
    return std::optional<v1::Plan>(std::move(refusal));
  }
  return std::optional<v1::Plan>(*job->plans.NextForWatcher(after_version));
}

absl::Status CoordinatorCore::ReportTimings(
    const v1::ReportTimingsRequest& request) {
  for (const v1::ShapeTiming& s : request.shapes()) {
    if (s.shape_size() != 2 || s.shape(0) < 1 || s.shape(1) < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("shapes: entry ", ShapeString(s.shape()),
                       " must be 2-D with positive dims"));
    }
    if (s.count() < 1 || !(s.ns_us() >= 0) || !std::isfinite(s.ns_us())) {
      return absl::InvalidArgumentError(
          absl::StrCat("shapes: entry ", ShapeString(s.shape()),
                       " needs count >= 1 and a finite ns_us >= 0"));
    }
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  auto it = job->daemons.find(request.rank());
  if (it == job->daemons.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", request.rank(), " has not joined job '", job->id, "'"));
  }
  Daemon& daemon = it->second;
  daemon.last_step_id = std::max(daemon.last_step_id, request.step_id());
  daemon.last_timings = request.timings();
  for (const v1::ShapeTiming& s : request.shapes()) {
    daemon.shape_times[{s.shape(0), s.shape(1)}] = {s.ns_us(), s.count()};
  }
  MaybeRebalance(*job);
  return absl::OkStatus();
}

CostTable CoordinatorCore::JobMeasuredCosts(const Job& job) const {
  std::map<std::vector<int64_t>, std::pair<double, int64_t>> sums;
  for (const auto& [rank, d] : job.daemons) {
    for (const auto& [shape, sc] : d.shape_times) {
      sums[shape].first += sc.first;
      sums[shape].second += sc.second;
    }
  }
  CostTable costs;
  for (const auto& [shape, sc] : sums) {
    const double per_matrix = sc.first / double(sc.second);
    // The planner needs positive costs; it estimates shapes left out.
    if (per_matrix > 0) costs[shape] = per_matrix;
  }
  return costs;
}

absl::StatusOr<CostTable> CoordinatorCore::MeasuredCosts(
    const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(job_id));
  return JobMeasuredCosts(*job);
}

namespace {

bool SameHomes(const v1::Plan& a, const v1::Plan& b) {
  std::map<std::string, const v1::GroupPlan*> by_name;
  for (const v1::GroupPlan& g : b.groups()) by_name[g.group()] = &g;
  if (a.groups_size() != int(by_name.size())) return false;
  for (const v1::GroupPlan& g : a.groups()) {
    auto it = by_name.find(g.group());
    if (it == by_name.end() || it->second->homes_size() != g.homes_size()) {
      return false;
    }
    for (int i = 0; i < g.homes_size(); ++i) {
      if (FromProto(g.homes(i)) != FromProto(it->second->homes(i))) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

void CoordinatorCore::MaybeRebalance(Job& job) {
  if (options_.rebalance_threshold <= 0 || job.plans.empty() ||
      !CheckNoRoundInProgress(job).ok() ||
      int(job.daemons.size()) != job.world_size) {
    return;
  }
  int64_t oldest = std::numeric_limits<int64_t>::max(), latest = -1;
  double max_ns = 0, sum_ns = 0;
  for (const auto& [rank, d] : job.daemons) {
    oldest = std::min(oldest, d.last_step_id);
    latest = std::max(latest, d.last_step_id);
    max_ns = std::max(max_ns, d.last_timings.ns_us());
    sum_ns += d.last_timings.ns_us();
  }
  // Every rank's latest timings must come from the current plan and the
  // previous check must be `interval` steps ago (hysteresis).
  const int64_t interval =
      std::max<int64_t>(1, options_.rebalance_interval_steps);
  const int64_t since = std::max(job.plans.newest()->activate_at_step(),
                                 job.last_rebalance_check_step);
  if (oldest < 0 || oldest - since < interval) return;
  job.last_rebalance_check_step = oldest;
  const double mean_ns = sum_ns / double(job.world_size);
  if (!(mean_ns > 0)) return;
  const double imbalance = max_ns / mean_ns;
  if (imbalance <= options_.rebalance_threshold) {
    VLOG(1) << "job " << job.id << ": NS max/mean " << imbalance << " at step "
            << oldest << " is within the threshold "
            << options_.rebalance_threshold;
    return;
  }
  const CostTable costs = JobMeasuredCosts(job);
  if (costs.empty()) {
    LOG(WARNING) << "job " << job.id << ": NS max/mean " << imbalance
                 << " exceeds " << options_.rebalance_threshold
                 << " but no daemon reported shape timings; not rebalancing";
    return;
  }
  const std::optional<int64_t> activate = CheckedAdd(
      latest, std::max<int64_t>(1, options_.rebalance_activate_margin));
  if (!activate) {
    LOG(WARNING) << "job " << job.id << ": latest reported step " << latest
                 << " plus the activation margin overflows; not rebalancing";
    return;
  }
  absl::StatusOr<v1::Plan> plan =
      ComputePlan(job, costs, v1::COST_MODEL_MEASURED, *activate);
  if (!plan.ok()) {
    LOG(WARNING) << "job " << job.id
                 << ": automatic rebalance failed: " << plan.status();
    return;
  }
  if (SameHomes(*plan, *job.plans.newest())) {
    LOG(INFO) << "job " << job.id << ": NS max/mean " << imbalance
              << " exceeds " << options_.rebalance_threshold
              << " but the measured cost table gives the same homes; "
                 "keeping plan version "
              << job.plans.newest()->version();
    return;
  }
  if (absl::Status st = job.plans.Append(*std::move(plan)); !st.ok()) {
    LOG(WARNING) << "job " << job.id << ": automatic rebalance failed: " << st;
    return;
  }
  metrics_->PlanBuilt(job.id, /*rebalance=*/true);
  LOG(INFO) << "job " << job.id << ": NS max/mean " << imbalance << " exceeds "
            << options_.rebalance_threshold
            << "; automatic rebalance to plan version "
            << job.plans.newest()->version() << " (measured, " << costs.size()
            << " shapes), activating at step "
            << job.plans.newest()->activate_at_step();
}

absl::StatusOr<v1::Plan> CoordinatorCore::Rebalance(
    const v1::RebalanceRequest& request) {
  if (request.has_activate_after_steps() &&
      request.activate_after_steps() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("activate_after_steps: ", request.activate_after_steps(),
                     " must be >= 1 (unset: 2)"));
  }
  const v1::CostModel model = request.cost_model();
  if (!v1::CostModel_IsValid(model)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cost_model: value ", model,
                     " is not one of COST_MODEL_NS_COST, COST_MODEL_FLOPS, "
                     "COST_MODEL_MEASURED (or unset)"));
  }
  CostTable explicit_costs;
  for (const v1::ShapeTiming& s : request.cost_table()) {
    if (s.shape_size() != 2 || s.shape(0) < 1 || s.shape(1) < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("cost_table: shape ", ShapeString(s.shape()),
                       " must be 2-D with positive dims"));
    }
    if (!std::isfinite(s.ns_us()) || s.ns_us() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cost_table: shape ", ShapeString(s.shape()),
                       " has cost ", s.ns_us(), "; needs a finite cost > 0"));
    }
    explicit_costs[{s.shape(0), s.shape(1)}] = s.ns_us();
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  RETURN_IF_ERROR(CheckNoRoundInProgress(*job));
  if (job->plans.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job->id, "' has no complete set of manifests to plan from"));
  }
  // After a coordinator restart no daemon may have reported timings yet; the
  // steps they published with their manifests count too, or the plan would
  // activate at a step already past and each rank would switch whenever the
  // plan reaches it.
  int64_t latest_step = job->plans.resume_step();
  for (const auto& [rank, d] : job->daemons) {
    latest_step = std::max(latest_step, d.last_step_id);
  }
  // Mean measured time per matrix, over every daemon's latest reports.
  const CostTable measured = JobMeasuredCosts(*job);
  CostTable costs;
  const bool unspecified = model == v1::COST_MODEL_UNSPECIFIED;
  v1::CostModel used_model = unspecified ? v1::COST_MODEL_NS_COST : model;
  if (model == v1::COST_MODEL_MEASURED || (unspecified && !measured.empty())) {
    if (measured.empty() && explicit_costs.empty()) {
      return absl::FailedPreconditionError(
          "cost_model COST_MODEL_MEASURED: no daemon has reported shape "
          "timings");
    }
    costs = measured;
    used_model = v1::COST_MODEL_MEASURED;
  }
  for (const auto& [shape, cost] : explicit_costs) costs[shape] = cost;
  // An explicit table is a measured table (shapes it lacks are estimated by
  // the planner from the table's cost/FLOP ratio).
  if (!explicit_costs.empty()) used_model = v1::COST_MODEL_MEASURED;
  const int64_t after =
      request.has_activate_after_steps() ? request.activate_after_steps() : 2;
  const std::optional<int64_t> activate = CheckedAdd(latest_step, after);
  if (!activate) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activate_after_steps: ", after, " after the latest reported step ",
        latest_step, " overflows int64"));
  }
  ASSIGN_OR_RETURN(v1::Plan plan,
                   ComputePlan(*job, costs, used_model, *activate));
  RETURN_IF_ERROR(job->plans.Append(plan));
  metrics_->PlanBuilt(job->id, /*rebalance=*/true);
  LOG(INFO) << "job " << job->id << ": rebalanced to plan version "
            << plan.version() << " (" << used_model << "), activating at step "
            << plan.activate_at_step();
  return plan;
}

absl::StatusOr<v1::ListDaemonsResponse> CoordinatorCore::ListDaemons(
    const v1::ListDaemonsRequest& request) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  v1::ListDaemonsResponse response;
  for (const auto& [rank, d] : job->daemons) {
    v1::DaemonInfo* info = response.add_daemons();
    info->set_rank(rank);
    info->set_host(d.join.host());
    info->set_device(d.join.device());
    info->set_address(d.join.address());
    info->set_last_step_id(d.last_step_id);
    info->set_live(Live(d, options_.clock()));
    *info->mutable_last_timings() = d.last_timings;
  }
  return response;
}

std::vector<JobMetricsSnapshot> CoordinatorCore::MetricsSnapshot() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock();
  std::vector<JobMetricsSnapshot> out;
  for (const auto& [id, job] : jobs_) {
    JobMetricsSnapshot& s = out.emplace_back();
    s.job = id;
    for (const auto& [rank, d] : job->daemons) s.live_daemons += Live(d, now);
    if (job->plans.empty()) continue;
    const v1::Plan& plan = *job->plans.newest();
    s.plan_version = plan.version();
    for (const auto& [rank, d] : job->daemons) {
      HeldGroups held;
      for (const v1::GroupManifest& g : d.manifest.groups()) {
        held.emplace_back(g.group(), g.domain());
      }
      s.ns_load[rank] = NsLoadShare(plan, held);
    }
  }
  return out;
}

std::vector<std::string> CoordinatorCore::JobIds() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  return ids;
}

}  // namespace muond
