// muonctl argument handling: --help per subcommand, --job/--job_id, errors
// that blame the flag, plan's required --gtp/--tp, and the flag spelling:
// help and errors in snake_case, the dashed spelling accepted too.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "nlohmann/json.hpp"
#include "server/common/proto_convert.h"
#include "tools/muonctl/coordinator_commands.h"
#include "tools/muonctl/plan_command.h"

namespace muond::muonctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using RunFn = int (*)(const std::vector<std::string>&, std::ostream&,
                      std::ostream&);

struct Sub {
  const char* name;
  RunFn run;
};
const Sub kSubs[] = {{"plan", RunPlan},       {"status", RunStatus},
                     {"daemons", RunDaemons}, {"rebalance", RunRebalance},
                     {"save", RunSave},       {"load", RunLoad}};

TEST(Muonctl, EverySubcommandHasHelp) {
  for (const Sub& sub : kSubs) {
    std::ostringstream out, err;
    EXPECT_EQ(sub.run({"--help"}, out, err), 0) << sub.name;
    EXPECT_THAT(out.str(), HasSubstr(std::string("usage: muonctl ") + sub.name))
        << sub.name;
    EXPECT_EQ(err.str(), "") << sub.name;
  }
}

TEST(Muonctl, MissingValueBlamesTheFlag) {
  std::ostringstream out, err;
  EXPECT_EQ(RunDaemons({"--coordinator", "127.0.0.1:1", "--job_id"}, out, err),
            2);
  EXPECT_THAT(err.str(), HasSubstr("--job_id needs a value"));
  err.str("");
  EXPECT_EQ(
      RunDaemons({"--coordinator", "127.0.0.1:1", "--jobid", "x"}, out, err),
      2);
  EXPECT_THAT(err.str(), HasSubstr("unknown flag '--jobid'"));
  EXPECT_THAT(err.str(), Not(HasSubstr("'x'")));
  err.str("");
  EXPECT_EQ(RunStatus({"--coordinator", "h:1", "--job_id", "j", "--timeout-s",
                       "soon"},
                      out, err),
            2);
  EXPECT_THAT(err.str(), HasSubstr("--timeout_s needs a positive integer"));
  err.str("");
  EXPECT_EQ(RunStatus({"--coordinator", "h:1"}, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("--job_id JOB is required"));
}

// Both spellings parse; the call then fails at the RPC (exit 1), not at
// the arguments (exit 2).
// --tls_ca and --token are checked when parsed (exit 2 naming the flag and
// the cause), before any connection: a missing or garbage CA file, a token
// with a space.
TEST(Muonctl, TlsCaAndTokenAreCheckedBeforeConnecting) {
  const std::string garbage =
      std::string(std::getenv("TEST_TMPDIR")) + "/garbage.pem";
  std::ofstream(garbage) << "not a certificate\n";
  const std::string missing =
      std::string(std::getenv("TEST_TMPDIR")) + "/absent.pem";
  for (const auto& [flag, value, phrase] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--tls_ca", garbage, "--tls_ca='" + garbage + "': holds no PEM"},
           {"--tls_ca", missing, "--tls_ca='" + missing + "': cannot read"},
           {"--token", "a b", "--token: the token must be printable ASCII"}}) {
    std::ostringstream out, err;
    EXPECT_EQ(RunDaemons({"--coordinator", "127.0.0.1:1", "--job_id", "j", flag,
                          value},
                         out, err),
              2)
        << flag;
    EXPECT_THAT(err.str(), HasSubstr(phrase));
  }
}

TEST(Muonctl, OptimizerNameIsCheckedAndEverySubcommandOffersIt) {
  std::ostringstream out, err;
  EXPECT_EQ(
      RunStatus({"--coordinator", "h:1", "--job_id", "j", "--optimizer", "a/b"},
                out, err),
      2);
  EXPECT_THAT(err.str(), HasSubstr("--optimizer"));
  EXPECT_THAT(err.str(), HasSubstr("a/b"));
  for (const Sub& sub : kSubs) {
    if (std::string(sub.name) == "plan") continue;  // offline: no daemons
    std::ostringstream help, none;
    ASSERT_EQ(sub.run({"--help"}, help, none), 0) << sub.name;
    EXPECT_THAT(help.str(), HasSubstr("[--optimizer NAME]")) << sub.name;
  }
}

TEST(Muonctl, AcceptsJobAndJobId) {
  for (const char* flag : {"--job", "--job_id", "--job=j", "--job_id=j"}) {
    std::vector<std::string> args = {"--coordinator", "127.0.0.1:1", flag,
                                     "--timeout-s", "1"};
    if (std::string(flag).find('=') == std::string::npos) {
      args.insert(args.begin() + 3, "j");
    }
    std::ostringstream out, err;
    EXPECT_EQ(RunDaemons(args, out, err), 1) << flag << ": " << err.str();
    EXPECT_THAT(err.str(), HasSubstr("ListDaemons failed")) << flag;
  }
}

// The flag family's one spelling: every flag in help is snake_case.
TEST(Muonctl, HelpSpellsEveryFlagSnakeCase) {
  for (const Sub& sub : kSubs) {
    std::ostringstream out, err;
    ASSERT_EQ(sub.run({"--help"}, out, err), 0) << sub.name;
    for (const char* dashed :
         {"--tls-ca", "--timeout-s", "--cost-model", "--no-colocate",
          "--round-robin", "--token-file FILE", "[--ns-steps"}) {
      EXPECT_THAT(out.str(), Not(HasSubstr(dashed))) << sub.name;
    }
  }
  std::ostringstream out, err;
  ASSERT_EQ(RunRebalance({"--help"}, out, err), 0);
  EXPECT_THAT(out.str(), HasSubstr("--token_file FILE"));
  EXPECT_THAT(out.str(), HasSubstr("--tls_ca PEM"));
  EXPECT_THAT(out.str(), HasSubstr("--timeout_s N"));
  EXPECT_THAT(out.str(), HasSubstr("--cost_model M"));
}

// Both spellings reach the same flag (its check fails the same way, in
// snake_case), as "--flag value" and as "--flag=value".
TEST(Muonctl, DashedAndSnakeCaseSpellingsAreTheSameFlag) {
  struct Case {
    RunFn run;
    std::vector<std::string> snake, dashed;
    const char* error;
  };
  const std::vector<std::string> job = {"--coordinator", "h:1", "--job_id",
                                        "j"};
  auto with_job = [&](std::vector<std::string> args) {
    args.insert(args.begin(), job.begin(), job.end());
    return args;
  };
  const std::vector<Case> cases = {
      {RunStatus, with_job({"--timeout_s", "0"}),
       with_job({"--timeout-s", "0"}), "--timeout_s needs a positive integer"},
      {RunStatus, with_job({"--timeout_s=0"}), with_job({"--timeout-s=0"}),
       "--timeout_s needs a positive integer"},
      {RunDaemons, with_job({"--token_file", "/nonexistent/token"}),
       with_job({"--token-file", "/nonexistent/token"}), "--token_file"},
      {RunRebalance, with_job({"--cost_model=magic"}),
       with_job({"--cost-model=magic"}), "--cost_model: 'magic' is not one of"},
      {RunPlan,
       {"--manifest", "m.json", "--gtp", "1", "--tp", "1", "--ns_steps", "0"},
       {"--manifest", "m.json", "--gtp", "1", "--tp", "1", "--ns-steps", "0"},
       "--ns_steps must be >= 1"},
      {RunPlan,
       {"--no_colocate=1"},
       {"--no-colocate=1"},
       "--no_colocate takes no value"},
  };
  for (const Case& c : cases) {
    for (const std::vector<std::string>& args : {c.snake, c.dashed}) {
      std::ostringstream out, err;
      EXPECT_EQ(c.run(args, out, err), 2) << args.back() << err.str();
      EXPECT_THAT(err.str(), HasSubstr(c.error)) << args.back();
    }
  }
}

// An unknown flag is quoted as typed, dashes and all.
TEST(Muonctl, UnknownDashedFlagIsQuotedAsTyped) {
  std::ostringstream out, err;
  EXPECT_EQ(
      RunDaemons({"--coordinator", "h:1", "--job_id", "j", "--no-such", "x"},
                 out, err),
      2);
  EXPECT_THAT(err.str(), HasSubstr("unknown flag '--no-such'"));
  err.str("");
  EXPECT_EQ(RunPlan({"--no-such"}, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("unknown flag --no-such"));
}

TEST(Muonctl, PlanRequiresGtpAndTp) {
  std::ostringstream out, err;
  EXPECT_EQ(RunPlan({"--manifest", "m.json"}, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("--gtp G is required"));
  err.str("");
  EXPECT_EQ(RunPlan({"--manifest", "m.json", "--gtp", "2"}, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("--tp T is required"));
  err.str("");
  EXPECT_EQ(
      RunPlan({"--manifest", "m.json", "--gtp", "0", "--tp", "1"}, out, err),
      2);
  EXPECT_THAT(err.str(), HasSubstr("--gtp=0 must be >= 1"));
  EXPECT_EQ(out.str(), "");
}

// A DDP job of 4 (1 x 1 grid, D = 4) with 8 equal matrices: status shows each
// domain rank's share of the NS load (a quarter each) and the homes per
// replica; the plan comes from the coordinator's planner (PlanGroup).
TEST(Muonctl, StatusShowsNsLoadSharesAndReplicaHomes) {
  v1::GroupManifest manifest;
  manifest.set_group("muon");
  v1::Domain* d = manifest.mutable_domain();
  d->set_gtp_size(1);
  d->set_tp_size(1);
  d->set_dp_size(4);
  for (int i = 0; i < 8; ++i) {
    v1::ParamSpec* p = manifest.add_params();
    p->set_name("w" + std::to_string(i));
    for (int64_t dim : {32, 16}) {
      p->add_full_shape(dim);
      p->add_local_shape(dim);
    }
  }
  absl::StatusOr<v1::GroupPlan> group =
      PlanGroup(manifest, v1::COST_MODEL_NS_COST, {});
  ASSERT_TRUE(group.ok()) << group.status();
  v1::Plan plan;
  plan.set_version(1);
  plan.set_cost_model(v1::COST_MODEL_NS_COST);
  *plan.add_groups() = *group;
  std::ostringstream out;
  PrintPlan(plan, out);
  EXPECT_THAT(out.str(), HasSubstr("    NS load share per domain rank: "
                                   "0:25.0% 1:25.0% 2:25.0% 3:25.0%\n"));
  EXPECT_THAT(out.str(), HasSubstr("    homes per replica: d0:2 d1:2 d2:2 "
                                   "d3:2\n"));
}

// An AdamW group (elementwise, per-rank domain) has no routed homes: status
// prints one short line for it, not empty load and replica lines.
TEST(Muonctl, StatusPrintsGroupWithoutHomesOnOneLine) {
  v1::Plan plan;
  plan.set_version(1);
  v1::GroupPlan* adamw = plan.add_groups();
  adamw->set_group("group1.solo-r0");
  adamw->add_rank_load(0);
  std::ostringstream out;
  PrintPlan(plan, out);
  EXPECT_THAT(out.str(),
              HasSubstr("  group group1.solo-r0: no routed homes\n"));
  EXPECT_THAT(out.str(), Not(HasSubstr("homes per replica")));
  EXPECT_THAT(out.str(), Not(HasSubstr("rank load")));
}

TEST(Muonctl, OfflinePlanOverDpReplicas) {
  const std::string path = ::testing::TempDir() + "/ddp_manifest.json";
  {
    std::ofstream f(path);
    f << R"({"model": "ddp", "params": [)";
    for (int i = 0; i < 8; ++i) {
      f << (i ? "," : "") << R"({"name": "w)" << i
        << R"(", "shape": [64, 32]})";
    }
    f << "]}";
  }
  std::ostringstream out, err;
  ASSERT_EQ(
      RunPlan({"--manifest", path, "--gtp", "1", "--tp", "1", "--dp", "4"}, out,
              err),
      0)
      << err.str();
  const nlohmann::json j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["domain"]["dp"], 4);
  ASSERT_EQ(j["rank_load"].size(), 4u);
  for (const auto& load : j["rank_load"]) EXPECT_EQ(load, j["rank_load"][0]);
  std::vector<int> per_replica(4, 0);
  for (const auto& home : j["homes"]) ++per_replica[home["replica"].get<int>()];
  EXPECT_EQ(per_replica, (std::vector<int>{2, 2, 2, 2}));
  err.str("");
  EXPECT_EQ(
      RunPlan({"--manifest", path, "--gtp", "1", "--tp", "1", "--dp", "0"}, out,
              err),
      2);
  EXPECT_THAT(err.str(), HasSubstr("--dp=0 must be >= 1"));
}

}  // namespace
}  // namespace muond::muonctl
