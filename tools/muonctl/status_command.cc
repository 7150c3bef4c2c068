// muonctl status: the job's current plan (or that none exists yet), its
// daemons and each live daemon's optimizer state bytes by location and dtype
// (GetStatus).
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/common/error_reason.h"
#include "proto/status_details.h"
#include "tools/muonctl/coordinator_client.h"
#include "tools/muonctl/coordinator_commands.h"

namespace muond::muonctl {

namespace {

// "rank R state: device fp32 4096, host bf16 2048 (total 6144 bytes)", or
// why the daemon did not say. A daemon that does not answer is reported on
// its line, not as the command's failure: the plan and the daemon list above
// stand.
void PrintStateBytes(const Args& a, const v1::ListDaemonsResponse& list,
                     std::ostream& out) {
  for (const v1::DaemonInfo& d : list.daemons()) {
    if (!d.live()) continue;
    out << "rank " << d.rank() << " state: ";
    v1::GetStatusRequest req;
    req.set_optimizer(a.optimizer);
    v1::GetStatusResponse status;
    grpc::ClientContext ctx;
    Deadline(&ctx, a);
    const grpc::Status st = ConnectDaemon(d, a)->GetStatus(&ctx, req, &status);
    if (!st.ok()) {
      out << "unknown (GetStatus failed: "
          << absl::StatusCodeToString(
                 static_cast<absl::StatusCode>(st.error_code()))
          << ": " << st.error_message() << ")\n";
      continue;
    }
    if (status.state_bytes_by().empty()) out << "none";
    for (int i = 0; i < status.state_bytes_by_size(); ++i) {
      const v1::StateBytes& b = status.state_bytes_by(i);
      out << (i > 0 ? ", " : "") << b.location() << " " << b.dtype() << " "
          << b.bytes();
    }
    out << " (total " << status.state_bytes() << " bytes)\n";
  }
}

}  // namespace

int RunStatus(const std::vector<std::string>& args, std::ostream& out,
              std::ostream& err) {
  Args a;
  if (int rc = Parse("status", Kind::kPlain, args, &a, out, err); rc >= 0) {
    return rc;
  }
  auto stub = Connect(a);
  out << "job " << a.CoordinatorJob() << " at " << a.coordinator << "\n";
  v1::GetPlanRequest plan_req;
  plan_req.set_job_id(a.CoordinatorJob());
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
  req.set_job_id(a.CoordinatorJob());
  v1::ListDaemonsResponse list;
  grpc::ClientContext ctx;
  Deadline(&ctx, a);
  st = stub->ListDaemons(&ctx, req, &list);
  if (!st.ok()) return RpcFailed("ListDaemons", st, err);
  PrintDaemons(list, out);
  PrintStateBytes(a, list, out);
  return 0;
}

}  // namespace muond::muonctl
