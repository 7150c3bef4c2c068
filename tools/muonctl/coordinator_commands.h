#pragma once
// muonctl subcommands against a running muond-coordinator:
//   muonctl status    --coordinator HOST:PORT --job JOB [--timeout-s N]
//       the job's current plan (version, activation step, cost model, per
//       group max/mean) and every daemon's last step and timings.
//   muonctl daemons   --coordinator HOST:PORT --job JOB
//       one line per daemon: rank, host, device, address, last step, total us.
//   muonctl rebalance --coordinator HOST:PORT --job JOB
//                     [--cost-model ns_cost|flops|measured]
//                     [--cost ROWSxCOLS=US]... [--after N]
//       asks for a new plan (explicit per-shape costs override the model),
//       activating N steps after the latest reported step; prints it.
// Exit codes: 0 ok, 1 RPC failure (the gRPC status is printed), 2 usage.
#include <ostream>
#include <string>
#include <vector>

namespace muond::muonctl {

int RunStatus(const std::vector<std::string>& args, std::ostream& out,
              std::ostream& err);
int RunDaemons(const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err);
int RunRebalance(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err);

}  // namespace muond::muonctl
