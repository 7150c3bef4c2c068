#pragma once
// What every coordinator subcommand of muonctl shares: its flags (parsed
// into Args, with the usage text), the channels to the coordinator and the
// daemons (token metadata, TLS, per-RPC deadline), and how a failed RPC is
// printed.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "muond/v1/muond.grpc.pb.h"

namespace muond::muonctl {

// A coordinator subcommand's flags, as Parse leaves them.
struct Args {
  std::string coordinator;
  std::string job;
  int timeout_s = 10;
  v1::CostModel cost_model = v1::COST_MODEL_UNSPECIFIED;
  std::vector<std::string> costs;
  std::optional<int64_t> after;  // unset: the coordinator's default
  std::string token;  // --token / --token_file: x-muond-token to every server
  std::string token_file;
  std::string tls_ca;  // --tls_ca: PEM root certificate (TLS to TCP servers)
  // From --tls_ca (checked by Parse): TLS, else insecure, to TCP servers.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string dir;  // save/load: the state directory
  // --optimizer: the optimizer instance ("" the daemons' default one).
  std::string optimizer;

  // The instance's job on the coordinator (InstanceJobId): plans and
  // daemon lists of --optimizer; the daemons' own RPCs take `job` and
  // `optimizer`.
  std::string CoordinatorJob() const;
};

// Which flags a subcommand takes beyond the common ones.
enum class Kind { kPlain, kRebalance, kState };

// The usage text of subcommand `sub` (its flags, then the common ones).
std::string Usage(const std::string& sub, Kind kind);

// Parses "--name value" / "--name=value" pairs for subcommand `sub`; a
// dashed name is read as its snake_case spelling (--token-file is
// --token_file).
// Returns -1 to go on, else the exit code (0 after --help, 2 after a usage
// error, which is printed with the usage).
int Parse(const std::string& sub, Kind kind,
          const std::vector<std::string>& args, Args* out,
          std::ostream& std_out, std::ostream& err);

// A stub for the coordinator at --coordinator (TLS with --tls_ca).
std::unique_ptr<v1::Coordinator::Stub> Connect(const Args& a);

// Daemons on Unix sockets must be on this host (muonctl opens the socket).
std::unique_ptr<v1::Optimizer::Stub> ConnectDaemon(const v1::DaemonInfo& d,
                                                   const Args& a);

// Sets --timeout_s as the deadline and the token metadata of one RPC.
void Deadline(grpc::ClientContext* ctx, const Args& a);

// Print "muonctl: RPC failed: CODE: message"; return exit code 1.
int RpcFailed(const char* rpc, const grpc::Status& st, std::ostream& err);
int DaemonRpcFailed(const v1::DaemonInfo& d, const std::string& rpc,
                    const grpc::Status& st, std::ostream& err);

// Every daemon of the job, all live; prints why not otherwise.
bool ListLiveDaemons(const Args& a, v1::ListDaemonsResponse* list,
                     std::ostream& err);

// One line per daemon: rank, host, device, address, last step, total us, live.
void PrintDaemons(const v1::ListDaemonsResponse& list, std::ostream& out);

}  // namespace muond::muonctl
