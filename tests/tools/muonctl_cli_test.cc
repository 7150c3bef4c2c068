// muonctl argument handling: --help per subcommand, --job/--job_id, errors
// that blame the flag, plan's required --gtp/--tp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>

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
  EXPECT_THAT(err.str(), HasSubstr("--timeout-s needs a positive integer"));
  err.str("");
  EXPECT_EQ(RunStatus({"--coordinator", "h:1"}, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("--job_id JOB is required"));
}

// Both spellings parse; the call then fails at the RPC (exit 1), not at
// the arguments (exit 2).
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

}  // namespace
}  // namespace muond::muonctl
