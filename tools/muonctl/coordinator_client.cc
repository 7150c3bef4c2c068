#include "tools/muonctl/coordinator_client.h"

#include <chrono>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/plan/planner.h"
#include "server/common/auth.h"
#include "server/common/flag_spelling.h"
#include "server/common/job_id.h"
#include "server/common/proto_convert.h"

namespace muond::muonctl {
namespace {

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

}  // namespace

std::string Args::CoordinatorJob() const {
  return InstanceJobId(job, optimizer);
}

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
                  " [--optimizer NAME]\n"
                  "    [--token_file FILE] [--tls_ca PEM] [--timeout_s N]\n"
                  "  --optimizer NAME   an optimizer instance of the job (a "
                  "process's later muond.torch.Muon: opt-<n>, or its name=); "
                  "default: the first\n");
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
        name == "--timeout_s" || name == "--optimizer" ||
        (state && name == "--dir") ||
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
    } else if (name == "--optimizer") {
      out->optimizer = value;
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
  if (!out->optimizer.empty()) {
    if (absl::Status name = CheckOptimizerName("--optimizer", out->optimizer);
        !name.ok()) {
      return usage_error(std::string(name.message()));
    }
  }
  // Read once, here: every RPC of the command sends the same token.
  absl::StatusOr<std::string> token =
      TokenFromFlags(out->token, out->token_file);
  if (!token.ok()) return usage_error(std::string(token.status().message()));
  out->token = *std::move(token);
  // Read once, here: a missing or garbage file is a usage error naming the
  // flag, not a connection that fails later for no stated reason.
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentials(out->tls_ca, "--tls_ca");
  if (!credentials.ok()) {
    return usage_error(std::string(credentials.status().message()));
  }
  out->credentials = *std::move(credentials);
  if (state && (out->dir.empty() || out->dir[0] != '/')) {
    return usage_error(
        "--dir must be an absolute directory (the daemons open the files)");
  }
  return -1;
}

std::unique_ptr<v1::Coordinator::Stub> Connect(const Args& a) {
  return v1::Coordinator::NewStub(
      grpc::CreateChannel(a.coordinator, a.credentials));
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
  req.set_job_id(a.CoordinatorJob());
  grpc::ClientContext ctx;
  Deadline(&ctx, a);
  grpc::Status st = Connect(a)->ListDaemons(&ctx, req, list);
  if (!st.ok()) {
    RpcFailed("ListDaemons", st, err);
    return false;
  }
  if (list->daemons().empty()) {
    err << "muonctl: job " << a.CoordinatorJob() << " has no daemons\n";
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

std::unique_ptr<v1::Optimizer::Stub> ConnectDaemon(const v1::DaemonInfo& d,
                                                   const Args& a) {
  return v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), absl::StartsWith(d.address(), "unix:")
                                           ? grpc::InsecureChannelCredentials()
                                           : a.credentials));
}

int DaemonRpcFailed(const v1::DaemonInfo& d, const std::string& rpc,
                    const grpc::Status& st, std::ostream& err) {
  err << "muonctl: rank " << d.rank() << ": " << rpc << " failed: "
      << absl::StatusCodeToString(
             static_cast<absl::StatusCode>(st.error_code()))
      << ": " << st.error_message() << "\n";
  return 1;
}

}  // namespace muond::muonctl
