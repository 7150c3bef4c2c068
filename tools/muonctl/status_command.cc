// muonctl status: the job's current plan (or that none exists yet) and its
// daemons.
#include <ostream>
#include <string>
#include <vector>

#include "core/common/error_reason.h"
#include "proto/status_details.h"
#include "tools/muonctl/coordinator_client.h"
#include "tools/muonctl/coordinator_commands.h"

namespace muond::muonctl {

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
  return 0;
}

}  // namespace muond::muonctl
