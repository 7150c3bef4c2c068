// muonctl daemons: one line per daemon of the job.
#include <ostream>
#include <string>
#include <vector>

#include "tools/muonctl/coordinator_client.h"
#include "tools/muonctl/coordinator_commands.h"

namespace muond::muonctl {

int RunDaemons(const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err) {
  Args a;
  if (int rc = Parse("daemons", Kind::kPlain, args, &a, out, err); rc >= 0) {
    return rc;
  }
  auto stub = Connect(a);
  v1::ListDaemonsRequest req;
  req.set_job_id(a.CoordinatorJob());
  v1::ListDaemonsResponse list;
  grpc::ClientContext ctx;
  Deadline(&ctx, a);
  grpc::Status st = stub->ListDaemons(&ctx, req, &list);
  if (!st.ok()) return RpcFailed("ListDaemons", st, err);
  PrintDaemons(list, out);
  return 0;
}

}  // namespace muond::muonctl
