// muonctl save / load: a job-wide two-phase state transaction (proto
// StatePhase) over every daemon of the job.
#include <unistd.h>

#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/common/operator_id.h"
#include "tools/muonctl/coordinator_client.h"
#include "tools/muonctl/coordinator_commands.h"

namespace muond::muonctl {
namespace {

std::string StatePath(const Args& a, int rank) {
  return absl::StrCat(a.dir, "/rank", rank, ".safetensors");
}

// A job-wide save or load in two phases (proto StatePhase): PREPARE on every
// daemon, then COMMIT on every daemon only when all prepared and agree (the
// same step id), else ABORT on every daemon, so the operation completes on
// every rank or changes nothing.
struct TwoPhase {
  TwoPhase(const Args& args, std::ostream& std_out, std::ostream& std_err)
      : a(args), out(std_out), err(std_err) {}

  const Args& a;
  std::ostream& out;
  std::ostream& err;
  v1::ListDaemonsResponse list;
  std::vector<std::unique_ptr<v1::Optimizer::Stub>> stubs;
  std::string transaction_id;
  // Per daemon: its PREPARE succeeded (ABORT goes to these only).
  std::vector<bool> prepared;
  // The ranks whose COMMIT failed.
  std::vector<int> commit_failed;

  // Fills list/stubs; false (reason printed) unless every daemon is live.
  bool Connect() {
    if (!ListLiveDaemons(a, &list, err)) return false;
    for (const v1::DaemonInfo& d : list.daemons()) {
      stubs.push_back(ConnectDaemon(d, a));
    }
    prepared.assign(list.daemons_size(), false);
    transaction_id = NewTransactionId();
    return true;
  }

  template <typename Request>
  Request Make(const v1::DaemonInfo& d, v1::StatePhase phase) const {
    Request req;
    req.set_path(StatePath(a, d.rank()));
    req.set_job_id(a.job);
    req.set_optimizer(a.optimizer);
    req.set_client_id(OperatorClientId(a.token));
    req.set_phase(phase);
    req.set_transaction_id(transaction_id);
    return req;
  }

  // Sends `phase` to every daemon (ABORT: to those this transaction
  // prepared; the daemons ignore an ABORT of another transaction anyway).
  // `rpc(stub, ctx, req, resp)` calls one; `on_reply(rank, resp)` sees each
  // success. Returns false (the failing ranks printed) when any failed; with
  // `stop_at_first`, the rest are not asked.
  template <typename Request, typename Response, typename Rpc, typename Reply>
  bool Send(const char* name, v1::StatePhase phase, Rpc rpc, Reply on_reply,
            bool stop_at_first) {
    bool ok = true;
    for (int i = 0; i < list.daemons_size(); ++i) {
      const v1::DaemonInfo& d = list.daemons(i);
      if (phase == v1::STATE_PHASE_ABORT && !prepared[i]) continue;
      const Request req = Make<Request>(d, phase);
      Response resp;
      grpc::ClientContext ctx;
      Deadline(&ctx, a);
      grpc::Status st = rpc(*stubs[i], &ctx, req, &resp);
      if (!st.ok()) {
        // "LoadState (prepare)": the phase as the operator reads it.
        std::string phase_name(
            absl::StripPrefix(v1::StatePhase_Name(phase), "STATE_PHASE_"));
        absl::AsciiStrToLower(&phase_name);
        DaemonRpcFailed(d, absl::StrCat(name, " (", phase_name, ")"), st, err);
        if (phase == v1::STATE_PHASE_COMMIT) commit_failed.push_back(d.rank());
        ok = false;
        if (stop_at_first) return false;
        continue;
      }
      if (phase == v1::STATE_PHASE_PREPARE) prepared[i] = true;
      on_reply(d, resp);
    }
    return ok;
  }

  // After a COMMIT that failed somewhere (every rank was still asked): the
  // job is split, say so and how to repair it.
  void ReportSplitCommit(const char* what) const {
    err << "muonctl: COMMIT failed on rank(s)";
    for (int rank : commit_failed) err << " " << rank;
    err << " of " << list.daemons_size() << " (those kept their old " << what
        << "; the others committed, as printed above); run `muonctl " << what
        << "` again\n";
  }

  static std::string NewTransactionId() {
    std::random_device rd;
    return absl::StrCat(
        absl::Hex(uint64_t(rd()) << 32 | rd(), absl::kZeroPad16), "-",
        getpid());
  }
};

}  // namespace

int RunSave(const std::vector<std::string>& args, std::ostream& out,
            std::ostream& err) {
  Args a;
  if (int rc = Parse("save", Kind::kState, args, &a, out, err); rc >= 0) {
    return rc;
  }
  TwoPhase job(a, out, err);
  if (!job.Connect()) return 1;
  const auto rpc = [](v1::Optimizer::Stub& s, grpc::ClientContext* c,
                      const v1::SaveStateRequest& r,
                      v1::SaveStateResponse* resp) {
    return s.SaveState(c, r, resp);
  };
  std::map<int, int64_t> steps;  // rank -> step id of its prepared file
  std::map<int, int64_t> bytes;
  const bool prepared = job.Send<v1::SaveStateRequest, v1::SaveStateResponse>(
      "SaveState", v1::STATE_PHASE_PREPARE, rpc,
      [&](const v1::DaemonInfo& d, const v1::SaveStateResponse& r) {
        steps[d.rank()] = r.step_id();
        bytes[d.rank()] = r.bytes();
      },
      /*stop_at_first=*/true);
  std::set<int64_t> distinct;
  for (const auto& [rank, step] : steps) distinct.insert(step);
  if (!prepared || distinct.size() > 1) {
    if (prepared) {
      err << "muonctl: the daemons' states are of different step ids (a step "
             "ran during the save):";
      for (const auto& [rank, step] : steps) {
        err << " rank " << rank << " step " << step << ";";
      }
      err << " pause the trainers and save again\n";
    }
    job.Send<v1::SaveStateRequest, v1::SaveStateResponse>(
        "SaveState", v1::STATE_PHASE_ABORT, rpc,
        [](const v1::DaemonInfo&, const v1::SaveStateResponse&) {}, false);
    err << "muonctl: save aborted; no rank's file was replaced\n";
    return 1;
  }
  const bool committed = job.Send<v1::SaveStateRequest, v1::SaveStateResponse>(
      "SaveState", v1::STATE_PHASE_COMMIT, rpc,
      [&](const v1::DaemonInfo& d, const v1::SaveStateResponse& r) {
        out << "rank " << d.rank() << ": " << r.path() << " ("
            << bytes[d.rank()] << " bytes)\n";
      },
      /*stop_at_first=*/false);
  if (!committed) {
    job.ReportSplitCommit("save");
    return 1;
  }
  out << "saved " << steps.size() << " ranks at step " << *distinct.begin()
      << "\n";
  return 0;
}

int RunLoad(const std::vector<std::string>& args, std::ostream& out,
            std::ostream& err) {
  Args a;
  if (int rc = Parse("load", Kind::kState, args, &a, out, err); rc >= 0) {
    return rc;
  }
  TwoPhase job(a, out, err);
  if (!job.Connect()) return 1;
  const auto rpc = [](v1::Optimizer::Stub& s, grpc::ClientContext* c,
                      const v1::LoadStateRequest& r,
                      v1::LoadStateResponse* resp) {
    return s.LoadState(c, r, resp);
  };
  std::map<int, std::pair<int64_t, std::string>> files;  // rank -> step, job
  // Every rank is asked, so one run names every bad file.
  const bool prepared = job.Send<v1::LoadStateRequest, v1::LoadStateResponse>(
      "LoadState", v1::STATE_PHASE_PREPARE, rpc,
      [&](const v1::DaemonInfo& d, const v1::LoadStateResponse& r) {
        files[d.rank()] = {r.step_id(), r.job_id()};
      },
      /*stop_at_first=*/false);
  std::set<std::pair<int64_t, std::string>> distinct;
  for (const auto& [rank, f] : files) distinct.insert(f);
  if (!prepared || distinct.size() > 1) {
    if (prepared) {
      err << "muonctl: the state files are of different steps or jobs:";
      for (const auto& [rank, f] : files) {
        err << " rank " << rank << " step " << f.first << " job '" << f.second
            << "';";
      }
      err << "\n";
    }
    job.Send<v1::LoadStateRequest, v1::LoadStateResponse>(
        "LoadState", v1::STATE_PHASE_ABORT, rpc,
        [](const v1::DaemonInfo&, const v1::LoadStateResponse&) {}, false);
    err << "muonctl: load aborted; no rank's state changed\n";
    return 1;
  }
  const bool committed = job.Send<v1::LoadStateRequest, v1::LoadStateResponse>(
      "LoadState", v1::STATE_PHASE_COMMIT, rpc,
      [&](const v1::DaemonInfo& d, const v1::LoadStateResponse& r) {
        out << "rank " << d.rank() << ": loaded " << StatePath(a, d.rank())
            << " (step " << r.step_id() << ")\n";
      },
      /*stop_at_first=*/false);
  if (!committed) {
    job.ReportSplitCommit("load");
    return 1;
  }
  const int64_t step = distinct.begin()->first;
  out << "loaded " << files.size() << " ranks at step " << step
      << "; the next step id is " << step + 1 << "\n";
  return 0;
}

}  // namespace muond::muonctl
