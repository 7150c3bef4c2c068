#include "tools/muonctl/coordinator_commands.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/common/error_reason.h"
#include "core/plan/planner.h"
#include "muond/v1/muond.grpc.pb.h"
#include "proto/status_details.h"
#include "server/common/auth.h"
#include "server/common/flag_spelling.h"
#include "server/common/job_id.h"
#include "server/common/operator_id.h"
#include "server/common/proto_convert.h"

namespace muond::muonctl {
namespace {

struct Args {
  std::string coordinator;
  std::string job;
  int timeout_s = 10;
  v1::CostModel cost_model = v1::COST_MODEL_UNSPECIFIED;
  std::vector<std::string> costs;
  std::optional<int64_t> after;  // unset: the coordinator's default
  std::string token;  // --token / --token_file: x-muond-token to every server
  std::string token_file;
  std::string
      tls_ca;       // --tls_ca: PEM root certificate (TLS to the coordinator)
  std::string dir;  // save/load: the state directory
};

constexpr char kCommonFlags[] =
    "  --coordinator HOST:PORT  the job's muond-coordinator (required)\n"
    "  --job_id JOB             the job id (required; --job is the same)\n"
    "  --token_file FILE        shared token, read from a 0600 file "
    "(preferred:\n"
    "                           argv is visible to every user in ps)\n"
    "  --token T                shared token (x-muond-token metadata)\n"
    "  --tls_ca PEM             root certificate: TLS to TCP servers\n"
    "  --timeout_s N            per-RPC deadline, seconds (default 10)\n"
    "  --help                   this text\n"
    "Flags are snake_case; the dashed spelling (--token-file) works too.\n";

enum class Kind { kPlain, kRebalance, kState };

std::string Usage(const std::string& sub, Kind kind) {
  std::string text = absl::StrCat("usage: muonctl ", sub,
                                  " --coordinator HOST:PORT --job_id JOB");
  if (kind == Kind::kRebalance) {
    absl::StrAppend(&text,
                    " [--cost_model ns_cost|flops|measured]\n"
                    "                 [--cost ROWSxCOLS=US]... [--after N]");
  } else if (kind == Kind::kState) {
    absl::StrAppend(&text, " --dir /ABS/DIR");
  }
  absl::StrAppend(&text,
                  " [--token_file FILE] [--tls_ca PEM] [--timeout_s N]\n");
  if (sub == "status") {
    absl::StrAppend(&text,
                    "Prints the job's current plan (version, activation "
                    "step, cost model, per group max/mean) and its daemons.\n");
  } else if (sub == "daemons") {
    absl::StrAppend(&text,
                    "Prints one line per daemon: rank, host, device, "
                    "address, last step, total us, live.\n");
  } else if (sub == "rebalance") {
    absl::StrAppend(
        &text,
        "Asks the coordinator for a new plan and prints it.\n"
        "  --cost_model M     ns_cost, flops or measured (coordinator's "
        "default when omitted)\n"
        "  --cost RxC=US      explicit NS cost of a shape (repeatable; "
        "overrides the model)\n"
        "  --after N          activate N >= 1 steps after the latest "
        "reported step (coordinator's default 2 when omitted)\n");
  } else if (sub == "unregister") {
    absl::StrAppend(
        &text,
        "Every daemon of the job (all must be live) drops its registered "
        "params, whoever registered them (as the operator): for a trainer "
        "that ended without unregistering. Stop the trainer first.\n");
  } else if (sub == "save") {
    absl::StrAppend(
        &text,
        "Every daemon of the job (all must be live) saves its optimizer state "
        "to DIR/rank<R>.safetensors (run between steps).\n"
        "  --dir /ABS/DIR     absolute directory the daemons "
        "write\n");
  } else if (sub == "load") {
    absl::StrAppend(
        &text,
        "Every daemon of the job (all must be live) loads its optimizer state "
        "from DIR/rank<R>.safetensors.\n"
        "  --dir /ABS/DIR     absolute directory the daemons "
        "read\n");
  }
  return absl::StrCat(text, kCommonFlags);
}

// Parses "--name value" / "--name=value" pairs for subcommand `sub`; a
// dashed name is read as its snake_case spelling (--token-file is
// --token_file).
// Returns -1 to go on, else the exit code (0 after --help, 2 after a usage
// error, which is printed with the usage).
int Parse(const std::string& sub, Kind kind,
          const std::vector<std::string>& args, Args* out,
          std::ostream& std_out, std::ostream& err) {
  const bool extra = kind == Kind::kRebalance;
  const bool state = kind == Kind::kState;
  const auto usage_error = [&](const std::string& problem) {
    err << "muonctl " << sub << ": " << problem << "\n" << Usage(sub, kind);
    return 2;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], value;
    if (name == "--help" || name == "-h" || name == "help") {
      std_out << Usage(sub, kind);
      return 0;
    }
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const std::string typed = name;  // errors quote what the user typed
    name = SnakeCaseFlag(name);
    const bool known =
        name == "--coordinator" || name == "--job" || name == "--job_id" ||
        name == "--token" || name == "--token_file" || name == "--tls_ca" ||
        name == "--timeout_s" || (state && name == "--dir") ||
        (extra &&
         (name == "--cost_model" || name == "--cost" || name == "--after"));
    if (!known) {
      return usage_error(absl::StrCat(absl::StartsWith(typed, "-")
                                          ? "unknown flag '"
                                          : "unexpected argument '",
                                      typed, "'"));
    }
    if (eq == std::string::npos) {
      if (i + 1 >= args.size()) {
        return usage_error(absl::StrCat(name, " needs a value"));
      }
      value = args[++i];
    }
    if (name == "--coordinator") {
      out->coordinator = value;
    } else if (name == "--job" || name == "--job_id") {
      out->job = value;
    } else if (name == "--token") {
      out->token = value;
    } else if (name == "--token_file") {
      out->token_file = value;
    } else if (name == "--tls_ca") {
      out->tls_ca = value;
    } else if (name == "--dir") {
      out->dir = value;
    } else if (name == "--timeout_s") {
      if (!absl::SimpleAtoi(value, &out->timeout_s) || out->timeout_s < 1) {
        return usage_error(absl::StrCat(
            "--timeout_s needs a positive integer, got '", value, "'"));
      }
    } else if (name == "--cost_model") {
      absl::StatusOr<CostModel> model = ParseCostModel(value, "--cost_model");
      if (!model.ok())
        return usage_error(std::string(model.status().message()));
      out->cost_model = ToProto(*model);
    } else if (name == "--cost") {
      out->costs.push_back(value);
    } else if (name == "--after") {
      int64_t after = 0;
      if (!absl::SimpleAtoi(value, &after) || after < 1) {
        return usage_error(absl::StrCat(
            "--after needs a positive integer, got '", value, "'"));
      }
      out->after = after;
    }
  }
  if (out->coordinator.empty()) {
    return usage_error("--coordinator HOST:PORT is required");
  }
  if (out->job.empty()) return usage_error("--job_id JOB is required");
  if (absl::Status id = CheckJobId("--job_id", out->job); !id.ok()) {
    return usage_error(std::string(id.message()));
  }
  // Read once, here: every RPC of the command sends the same token.
  absl::StatusOr<std::string> token =
      TokenFromFlags(out->token, out->token_file);
  if (!token.ok()) return usage_error(std::string(token.status().message()));
  out->token = *std::move(token);
  if (state && (out->dir.empty() || out->dir[0] != '/')) {
    return usage_error(
        "--dir must be an absolute directory (the daemons open the files)");
  }
  return -1;
}

std::shared_ptr<grpc::ChannelCredentials> Credentials(const Args& a) {
  if (a.tls_ca.empty()) return grpc::InsecureChannelCredentials();
  std::ifstream in(a.tls_ca);
  grpc::SslCredentialsOptions options;
  options.pem_root_certs.assign(std::istreambuf_iterator<char>(in), {});
  return grpc::SslCredentials(options);
}

std::unique_ptr<v1::Coordinator::Stub> Connect(const Args& a) {
  return v1::Coordinator::NewStub(
      grpc::CreateChannel(a.coordinator, Credentials(a)));
}

void Deadline(grpc::ClientContext* ctx, const Args& a) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(a.timeout_s));
  if (!a.token.empty()) ctx->AddMetadata("x-muond-token", a.token);
}

int RpcFailed(const char* rpc, const grpc::Status& st, std::ostream& err) {
  // gRPC's and absl's codes are the same numbers; print the name.
  err << "muonctl: " << rpc << " failed: "
      << absl::StatusCodeToString(
             static_cast<absl::StatusCode>(st.error_code()))
      << ": " << st.error_message() << "\n";
  return 1;
}

// The operator's name of a plan's cost model ("measured"), as --cost_model
// takes it.
std::string CostModelNameOf(v1::CostModel model) {
  absl::StatusOr<CostModel> core = FromProto(model, "cost_model");
  return core.ok() ? std::string(CostModelName(*core))
                   : v1::CostModel_Name(model);
}

// Each domain rank's share of the group's NS load (flat rank (d * G + g) * T
// + t): with a DP axis of D replicas about 1/D each.
void PrintLoadShares(const v1::GroupPlan& g, std::ostream& out) {
  double total = 0;
  for (double l : g.rank_load()) total += l;
  if (!(total > 0)) return;
  out << "    NS load share per domain rank:";
  for (int r = 0; r < g.rank_load_size(); ++r) {
    out << " " << r << ":"
        << absl::StrFormat("%.1f%%", 100 * g.rank_load(r) / total);
  }
  out << "\n";
}

// How many params each replica is home to, when a DP axis spreads them.
void PrintReplicaHomes(const v1::GroupPlan& g, std::ostream& out) {
  std::map<int, int> per_replica;
  for (const v1::NsHome& h : g.homes()) ++per_replica[h.d()];
  if (per_replica.size() < 2 && per_replica.count(0)) return;
  out << "    homes per replica:";
  for (const auto& [d, n] : per_replica) out << " d" << d << ":" << n;
  out << "\n";
}

}  // namespace

void PrintPlan(const v1::Plan& plan, std::ostream& out) {
  out << "plan version " << plan.version() << ", activates at step "
      << plan.activate_at_step() << ", cost model '"
      << CostModelNameOf(plan.cost_model()) << "'\n";
  for (const v1::GroupPlan& g : plan.groups()) {
    if (g.homes_size() == 0) {
      // AdamW's per-rank groups route nothing: their load, shares and
      // replica homes are all empty, so one short line says so.
      out << "  group " << g.group() << ": no routed homes\n";
      continue;
    }
    out << "  group " << g.group() << ": " << g.homes_size()
        << " routed homes, max/mean " << g.max_over_mean()
        << ", max/lower_bound " << g.lower_bound_ratio() << "\n";
    if (g.rank_load_size() > 0) {
      out << "    rank load:";
      for (double l : g.rank_load()) out << " " << l;
      out << "\n";
      PrintLoadShares(g, out);
    }
    PrintReplicaHomes(g, out);
  }
}

namespace {

void PrintDaemons(const v1::ListDaemonsResponse& list, std::ostream& out) {
  out << "rank  host  device  address  last_step  total_us  live\n";
  for (const v1::DaemonInfo& d : list.daemons()) {
    out << d.rank() << "  " << d.host() << "  " << d.device() << "  "
        << d.address() << "  " << d.last_step_id() << "  "
        << d.last_timings().total_us() << "  " << (d.live() ? "yes" : "no")
        << "\n";
  }
}

// Every daemon of the job, all live; prints why not otherwise.
bool ListLiveDaemons(const Args& a, v1::ListDaemonsResponse* list,
                     std::ostream& err) {
  v1::ListDaemonsRequest req;
  req.set_job_id(a.job);
  grpc::ClientContext ctx;
  Deadline(&ctx, a);
  grpc::Status st = Connect(a)->ListDaemons(&ctx, req, list);
  if (!st.ok()) {
    RpcFailed("ListDaemons", st, err);
    return false;
  }
  if (list->daemons().empty()) {
    err << "muonctl: job " << a.job << " has no daemons\n";
    return false;
  }
  for (const v1::DaemonInfo& d : list->daemons()) {
    if (!d.live()) {
      err << "muonctl: rank " << d.rank() << " (" << d.address()
          << ") is not live; refusing a partial save/load/unregister\n";
      return false;
    }
  }
  return true;
}

std::string StatePath(const Args& a, int rank) {
  return absl::StrCat(a.dir, "/rank", rank, ".safetensors");
}

// Daemons on Unix sockets must be on this host (muonctl opens the socket).
std::unique_ptr<v1::Optimizer::Stub> ConnectDaemon(const v1::DaemonInfo& d,
                                                   const Args& a) {
  return v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), absl::StartsWith(d.address(), "unix:")
                                           ? grpc::InsecureChannelCredentials()
                                           : Credentials(a)));
}

int DaemonRpcFailed(const v1::DaemonInfo& d, const std::string& rpc,
                    const grpc::Status& st, std::ostream& err) {
  err << "muonctl: rank " << d.rank() << ": " << rpc << " failed: "
      << absl::StatusCodeToString(
             static_cast<absl::StatusCode>(st.error_code()))
      << ": " << st.error_message() << "\n";
  return 1;
}

// A job-wide save or load in two phases (proto StatePhase): PREPARE on every
// daemon, then COMMIT on every daemon only when all prepared and agree (the
// same step id), else ABORT on every daemon, so the operation completes on
// every rank or changes nothing.
struct TwoPhase {
  TwoPhase(const Args& args, std::ostream& std_out, std::ostream& std_err)
      : a(args), out(std_out), err(std_err) {}

  const Args& a;
  std::ostream& out;
  std::ostream& err;
  v1::ListDaemonsResponse list;
  std::vector<std::unique_ptr<v1::Optimizer::Stub>> stubs;
  std::string transaction_id;
  // Per daemon: its PREPARE succeeded (ABORT goes to these only).
  std::vector<bool> prepared;
  // The ranks whose COMMIT failed.
  std::vector<int> commit_failed;

  // Fills list/stubs; false (reason printed) unless every daemon is live.
  bool Connect() {
    if (!ListLiveDaemons(a, &list, err)) return false;
    for (const v1::DaemonInfo& d : list.daemons()) {
      stubs.push_back(ConnectDaemon(d, a));
    }
    prepared.assign(list.daemons_size(), false);
    transaction_id = NewTransactionId();
    return true;
  }

  template <typename Request>
  Request Make(const v1::DaemonInfo& d, v1::StatePhase phase) const {
    Request req;
    req.set_path(StatePath(a, d.rank()));
    req.set_job_id(a.job);
    req.set_client_id(kOperatorClientId);
    req.set_phase(phase);
    req.set_transaction_id(transaction_id);
    return req;
  }

  // Sends `phase` to every daemon (ABORT: to those this transaction
  // prepared; the daemons ignore an ABORT of another transaction anyway).
  // `rpc(stub, ctx, req, resp)` calls one; `on_reply(rank, resp)` sees each
  // success. Returns false (the failing ranks printed) when any failed; with
  // `stop_at_first`, the rest are not asked.
  template <typename Request, typename Response, typename Rpc, typename Reply>
  bool Send(const char* name, v1::StatePhase phase, Rpc rpc, Reply on_reply,
            bool stop_at_first) {
    bool ok = true;
    for (int i = 0; i < list.daemons_size(); ++i) {
      const v1::DaemonInfo& d = list.daemons(i);
      if (phase == v1::STATE_PHASE_ABORT && !prepared[i]) continue;
      const Request req = Make<Request>(d, phase);
      Response resp;
      grpc::ClientContext ctx;
      Deadline(&ctx, a);
      grpc::Status st = rpc(*stubs[i], &ctx, req, &resp);
      if (!st.ok()) {
        // "LoadState (prepare)": the phase as the operator reads it.
        std::string phase_name(
            absl::StripPrefix(v1::StatePhase_Name(phase), "STATE_PHASE_"));
        absl::AsciiStrToLower(&phase_name);
        DaemonRpcFailed(d, absl::StrCat(name, " (", phase_name, ")"), st, err);
        if (phase == v1::STATE_PHASE_COMMIT) commit_failed.push_back(d.rank());
        ok = false;
        if (stop_at_first) return false;
        continue;
      }
      if (phase == v1::STATE_PHASE_PREPARE) prepared[i] = true;
      on_reply(d, resp);
    }
    return ok;
  }

  // After a COMMIT that failed somewhere (every rank was still asked): the
  // job is split, say so and how to repair it.
  void ReportSplitCommit(const char* what) const {
    err << "muonctl: COMMIT failed on rank(s)";
    for (int rank : commit_failed) err << " " << rank;
    err << " of " << list.daemons_size() << " (those kept their old " << what
        << "; the others committed, as printed above); run `muonctl " << what
        << "` again\n";
  }

  static std::string NewTransactionId() {
    std::random_device rd;
    return absl::StrCat(
        absl::Hex(uint64_t(rd()) << 32 | rd(), absl::kZeroPad16), "-",
        getpid());
  }
};

}  // namespace

int RunSave(const std::vector<std::string>& args, std::ostream& out,
            std::ostream& err) {
  Args a;
  if (int rc = Parse("save", Kind::kState, args, &a, out, err); rc >= 0) {
    return rc;
  }
  TwoPhase job(a, out, err);
  if (!job.Connect()) return 1;
  const auto rpc = [](v1::Optimizer::Stub& s, grpc::ClientContext* c,
                      const v1::SaveStateRequest& r,
                      v1::SaveStateResponse* resp) {
    return s.SaveState(c, r, resp);
  };
  std::map<int, int64_t> steps;  // rank -> step id of its prepared file
  std::map<int, int64_t> bytes;
  const bool prepared = job.Send<v1::SaveStateRequest, v1::SaveStateResponse>(
      "SaveState", v1::STATE_PHASE_PREPARE, rpc,
      [&](const v1::DaemonInfo& d, const v1::SaveStateResponse& r) {
        steps[d.rank()] = r.step_id();
        bytes[d.rank()] = r.bytes();
      },
      /*stop_at_first=*/true);
  std::set<int64_t> distinct;
  for (const auto& [rank, step] : steps) distinct.insert(step);
  if (!prepared || distinct.size() > 1) {
    if (prepared) {
      err << "muonctl: the daemons' states are of different step ids (a step "
             "ran during the save):";
      for (const auto& [rank, step] : steps) {
        err << " rank " << rank << " step " << step << ";";
      }
      err << " pause the trainers and save again\n";
    }
    job.Send<v1::SaveStateRequest, v1::SaveStateResponse>(
        "SaveState", v1::STATE_PHASE_ABORT, rpc,
        [](const v1::DaemonInfo&, const v1::SaveStateResponse&) {}, false);
    err << "muonctl: save aborted; no rank's file was replaced\n";
    return 1;
  }
  const bool committed = job.Send<v1::SaveStateRequest, v1::SaveStateResponse>(
      "SaveState", v1::STATE_PHASE_COMMIT, rpc,
      [&](const v1::DaemonInfo& d, const v1::SaveStateResponse& r) {
        out << "rank " << d.rank() << ": " << r.path() << " ("
            << bytes[d.rank()] << " bytes)\n";
      },
      /*stop_at_first=*/false);
  if (!committed) {
    job.ReportSplitCommit("save");
    return 1;
  }
  out << "saved " << steps.size() << " ranks at step " << *distinct.begin()
      << "\n";
  return 0;
}

int RunLoad(const std::vector<std::string>& args, std::ostream& out,
            std::ostream& err) {
  Args a;
  if (int rc = Parse("load", Kind::kState, args, &a, out, err); rc >= 0) {
    return rc;
  }
  TwoPhase job(a, out, err);
  if (!job.Connect()) return 1;
  const auto rpc = [](v1::Optimizer::Stub& s, grpc::ClientContext* c,
                      const v1::LoadStateRequest& r,
                      v1::LoadStateResponse* resp) {
    return s.LoadState(c, r, resp);
  };
  std::map<int, std::pair<int64_t, std::string>> files;  // rank -> step, job
  // Every rank is asked, so one run names every bad file.
  const bool prepared = job.Send<v1::LoadStateRequest, v1::LoadStateResponse>(
      "LoadState", v1::STATE_PHASE_PREPARE, rpc,
      [&](const v1::DaemonInfo& d, const v1::LoadStateResponse& r) {
        files[d.rank()] = {r.step_id(), r.job_id()};
      },
      /*stop_at_first=*/false);
  std::set<std::pair<int64_t, std::string>> distinct;
  for (const auto& [rank, f] : files) distinct.insert(f);
  if (!prepared || distinct.size() > 1) {
    if (prepared) {
      err << "muonctl: the state files are of different steps or jobs:";
      for (const auto& [rank, f] : files) {
        err << " rank " << rank << " step " << f.first << " job '" << f.second
            << "';";
      }
      err << "\n";
    }
    job.Send<v1::LoadStateRequest, v1::LoadStateResponse>(
        "LoadState", v1::STATE_PHASE_ABORT, rpc,
        [](const v1::DaemonInfo&, const v1::LoadStateResponse&) {}, false);
    err << "muonctl: load aborted; no rank's state changed\n";
    return 1;
  }
  const bool committed = job.Send<v1::LoadStateRequest, v1::LoadStateResponse>(
      "LoadState", v1::STATE_PHASE_COMMIT, rpc,
      [&](const v1::DaemonInfo& d, const v1::LoadStateResponse& r) {
        out << "rank " << d.rank() << ": loaded " << StatePath(a, d.rank())
            << " (step " << r.step_id() << ")\n";
      },
      /*stop_at_first=*/false);
  if (!committed) {
    job.ReportSplitCommit("load");
    return 1;
  }
  const int64_t step = distinct.begin()->first;
  out << "loaded " << files.size() << " ranks at step " << step
      << "; the next step id is " << step + 1 << "\n";
  return 0;
}

int RunUnregister(const std::vector<std::string>& args, std::ostream& out,
                  std::ostream& err) {
  Args a;
  if (int rc = Parse("unregister", Kind::kPlain, args, &a, out, err); rc >= 0) {
    return rc;
  }
  v1::ListDaemonsResponse list;
  if (!ListLiveDaemons(a, &list, err)) return 1;
  int rc = 0;
  for (const v1::DaemonInfo& d : list.daemons()) {
    v1::UnregisterParamsRequest req;
    req.set_job_id(a.job);
    req.set_client_id(kOperatorClientId);
    v1::UnregisterParamsResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx, a);
    grpc::Status st = ConnectDaemon(d, a)->UnregisterParams(&ctx, req, &resp);
    if (!st.ok()) {
      rc = DaemonRpcFailed(d, "UnregisterParams", st, err);
      continue;  // the others are still cleared
    }
    out << "rank " << d.rank() << ": unregistered\n";
  }
  return rc;
}

int RunDaemons(const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err) {
  Args a;
  if (int rc = Parse("daemons", Kind::kPlain, args, &a, out, err); rc >= 0) {
    return rc;
  }
  auto stub = Connect(a);
  v1::ListDaemonsRequest req;
  req.set_job_id(a.job);
  v1::ListDaemonsResponse list;
  grpc::ClientContext ctx;
  Deadline(&ctx, a);
  grpc::Status st = stub->ListDaemons(&ctx, req, &list);
  if (!st.ok()) return RpcFailed("ListDaemons", st, err);
  PrintDaemons(list, out);
  return 0;
}

int RunStatus(const std::vector<std::string>& args, std::ostream& out,
              std::ostream& err) {
  Args a;
  if (int rc = Parse("status", Kind::kPlain, args, &a, out, err); rc >= 0) {
    return rc;
  }
  auto stub = Connect(a);
  out << "job " << a.job << " at " << a.coordinator << "\n";
  v1::GetPlanRequest plan_req;
  plan_req.set_job_id(a.job);
  v1::Plan plan;
  grpc::ClientContext plan_ctx;
  Deadline(&plan_ctx, a);
  grpc::Status st = stub->GetPlan(&plan_ctx, plan_req, &plan);
  if (st.ok()) {
    PrintPlan(plan, out);
  } else if (HasErrorReason(FromGrpcStatus(st), ErrorReason::kNoPlanYet)) {
    out << "no plan yet (waiting for manifests)\n";
  } else {
    return RpcFailed("GetPlan", st, err);
  }
  v1::ListDaemonsRequest req;
  req.set_job_id(a.job);
  v1::ListDaemonsResponse list;
  grpc::ClientContext ctx;
  Deadline(&ctx, a);
  st = stub->ListDaemons(&ctx, req, &list);
  if (!st.ok()) return RpcFailed("ListDaemons", st, err);
  PrintDaemons(list, out);
  return 0;
}

int RunRebalance(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err) {
  Args a;
  if (int rc = Parse("rebalance", Kind::kRebalance, args, &a, out, err);
      rc >= 0) {
    return rc;
  }
  v1::RebalanceRequest req;
  req.set_job_id(a.job);
  req.set_cost_model(a.cost_model);
  if (a.after) req.set_activate_after_steps(*a.after);
  for (const std::string& c : a.costs) {
    // ROWSxCOLS=US
    std::vector<std::string> kv = absl::StrSplit(c, '=');
    std::vector<std::string> dims = kv.size() == 2 ? absl::StrSplit(kv[0], 'x')
                                                   : std::vector<std::string>{};
    int64_t rows, cols;
    double us;
    if (dims.size() != 2 || !absl::SimpleAtoi(dims[0], &rows) ||
        !absl::SimpleAtoi(dims[1], &cols) || !absl::SimpleAtod(kv[1], &us)) {
      err << "muonctl: --cost '" << c << "' is not ROWSxCOLS=US\n";
      return 2;
    }
    v1::ShapeTiming* t = req.add_cost_table();
    t->add_shape(rows);
    t->add_shape(cols);
    t->set_ns_us(us);
    t->set_count(1);
  }
  auto stub = Connect(a);
  v1::Plan plan;
  grpc::ClientContext ctx;
  Deadline(&ctx, a);
  grpc::Status st = stub->Rebalance(&ctx, req, &plan);
  if (!st.ok()) return RpcFailed("Rebalance", st, err);
  PrintPlan(plan, out);
  return 0;
}

}  // namespace muond::muonctl
