// muonctl rebalance: asks the coordinator for a new plan (cost model or
// explicit --cost table) and prints it.
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tools/muonctl/coordinator_client.h"
#include "tools/muonctl/coordinator_commands.h"

namespace muond::muonctl {

int RunRebalance(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err) {
  Args a;
  if (int rc = Parse("rebalance", Kind::kRebalance, args, &a, out, err);
      rc >= 0) {
    return rc;
  }
  v1::RebalanceRequest req;
  req.set_job_id(a.CoordinatorJob());
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
