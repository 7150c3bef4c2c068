#pragma once
// muonctl subcommands against a running muond-coordinator:
//   muonctl status    --coordinator HOST:PORT --job_id JOB [--timeout_s N]
//       the job's current plan (version, activation step, cost model, per
//       group max/mean, each domain rank's NS load and its share of the
//       group's total, homes per DP replica) and every daemon's last step and
//       timings.
//   muonctl daemons   --coordinator HOST:PORT --job_id JOB
//       one line per daemon: rank, host, device, address, last step, total us.
//   muonctl rebalance --coordinator HOST:PORT --job_id JOB
//                     [--cost_model ns_cost|flops|measured]
//                     [--cost ROWSxCOLS=US]... [--after N]
//       asks for a new plan (explicit per-shape costs override the model),
//       activating N steps after the latest reported step; prints it.
//   muonctl save|load --coordinator HOST:PORT --job_id JOB --dir /ABS/DIR
//       every daemon of the job (addresses from ListDaemons; all must be
//       live) saves/loads its optimizer state to/from DIR/rank<R>.safetensors
//       (SaveState/LoadState on each daemon, so muonctl must reach the
//       daemons' addresses: Unix sockets mean the same host). Save between
//       steps (trainers paused). Both are two-phase across the job (proto
//       StatePhase; muonctl acts as the operator, OperatorClientId(token)):
//       every rank prepares (save: the file written under a temporary name;
//       load: read, validated, staged), then all commit, or, when any rank
//       fails or the ranks' step ids differ, all abort: no file replaced, no
//       state changed, the failing ranks named.
//   muonctl unregister --coordinator HOST:PORT --job_id JOB
//       every daemon of the job drops its registered params as the operator
//       (UnregisterParams with OperatorClientId(token)): clears the
//       registration of a trainer that ended without unregistering (killed,
//       crashed).
// --job is accepted as a synonym of --job_id. `muonctl SUB --help` prints
// SUB's usage to stdout and exits 0.
// Every subcommand takes --token_file FILE (or --token T; the file keeps the
// token out of ps; sent as metadata 'x-muond-token' to the coordinator and
// the daemons) and --tls_ca PEM (TLS to TCP servers).
// Exit codes: 0 ok, 1 RPC failure (the gRPC status is printed), 2 usage.
#include <ostream>
#include <string>
#include <vector>

#include "muond/v1/muond.pb.h"

namespace muond::muonctl {

// How status and rebalance print a plan: per group the rank loads (flat
// domain rank (d * G + g) * T + t), each rank's share of the total, and with
// a DP axis how many params each replica is home to.
void PrintPlan(const v1::Plan& plan, std::ostream& out);

int RunStatus(const std::vector<std::string>& args, std::ostream& out,
              std::ostream& err);
int RunDaemons(const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err);
int RunSave(const std::vector<std::string>& args, std::ostream& out,
            std::ostream& err);
int RunLoad(const std::vector<std::string>& args, std::ostream& out,
            std::ostream& err);
int RunUnregister(const std::vector<std::string>& args, std::ostream& out,
                  std::ostream& err);
int RunRebalance(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err);

}  // namespace muond::muonctl
