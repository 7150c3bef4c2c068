// muonctl unregister: every daemon of the job drops its registered params as
// the operator.
#include <ostream>
#include <string>
#include <vector>

#include "server/common/operator_id.h"
#include "tools/muonctl/coordinator_client.h"
#include "tools/muonctl/coordinator_commands.h"

namespace muond::muonctl {

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
    req.set_optimizer(a.optimizer);
    req.set_client_id(OperatorClientId(a.token));
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

}  // namespace muond::muonctl
