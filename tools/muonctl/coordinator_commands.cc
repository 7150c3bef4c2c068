#include "tools/muonctl/coordinator_commands.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "muond/v1/muond.grpc.pb.h"

namespace muond::muonctl {
namespace {

struct Args {
  std::string coordinator;
  std::string job;
  int timeout_s = 10;
  std::string cost_model;
  std::vector<std::string> costs;
  int64_t after = 0;
};

// Parses "--name value" / "--name=value" pairs; `extra` allows the
// rebalance-only flags. Returns false (after printing) on a usage error.
bool Parse(const std::vector<std::string>& args, bool extra, Args* out,
           std::ostream& err) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      err << "muonctl: " << name << " needs a value\n";
      return false;
    }
    if (name == "--coordinator") {
      out->coordinator = value;
    } else if (name == "--job") {
      out->job = value;
    } else if (name == "--timeout-s" &&
               absl::SimpleAtoi(value, &out->timeout_s)) {
    } else if (extra && name == "--cost-model") {
      out->cost_model = value;
    } else if (extra && name == "--cost") {
      out->costs.push_back(value);
    } else if (extra && name == "--after" &&
               absl::SimpleAtoi(value, &out->after)) {
    } else {
      err << "muonctl: unknown or malformed argument '" << args[i] << "'\n";
      return false;
    }
  }
  if (out->coordinator.empty() || out->job.empty()) {
    err << "muonctl: --coordinator HOST:PORT and --job JOB are required\n";
    return false;
  }
  return true;
}

std::unique_ptr<v1::Coordinator::Stub> Connect(const Args& a) {
  return v1::Coordinator::NewStub(
      grpc::CreateChannel(a.coordinator, grpc::InsecureChannelCredentials()));
}

void Deadline(grpc::ClientContext* ctx, const Args& a) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(a.timeout_s));
}

int RpcFailed(const char* rpc, const grpc::Status& st, std::ostream& err) {
  err << "muonctl: " << rpc << " failed: code " << int(st.error_code()) << ": "
      << st.error_message() << "\n";
  return 1;
}

void PrintPlan(const v1::Plan& plan, std::ostream& out) {
  out << "plan version " << plan.version() << ", activates at step "
      << plan.activate_at_step() << ", cost model '" << plan.cost_model()
      << "'\n";
  for (const v1::GroupPlan& g : plan.groups()) {
    out << "  group " << g.group() << ": " << g.homes_size()
        << " routed homes, max/mean " << g.max_over_mean()
        << ", max/lower_bound " << g.lower_bound_ratio() << "\n";
    if (g.rank_load_size() > 0) {
      out << "    rank load:";
      for (double l : g.rank_load()) out << " " << l;
      out << "\n";
    }
  }
}

void PrintDaemons(const v1::ListDaemonsResponse& list, std::ostream& out) {
  out << "rank  host  device  address  last_step  total_us\n";
  for (const v1::DaemonInfo& d : list.daemons()) {
    out << d.rank() << "  " << d.host() << "  " << d.device() << "  "
        << d.address() << "  " << d.last_step_id() << "  "
        << d.last_timings().total_us() << "\n";
  }
}

}  // namespace

int RunDaemons(const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err) {
  Args a;
  if (!Parse(args, false, &a, err)) return 2;
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
  if (!Parse(args, false, &a, err)) return 2;
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
  } else if (st.error_code() == grpc::StatusCode::NOT_FOUND &&
             st.error_message().find("no plan yet") != std::string::npos) {
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
  if (!Parse(args, true, &a, err)) return 2;
  v1::RebalanceRequest req;
  req.set_job_id(a.job);
  req.set_cost_model(a.cost_model);
  req.set_activate_after_steps(a.after);
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
