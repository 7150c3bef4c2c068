// muonctl: the operator's CLI. `muonctl SUBCOMMAND ARGS...`.
// To add a subcommand, write `int RunX(args, out, err)` in its own file and
// add one line to Commands() below.
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "tools/muonctl/command.h"
#include "tools/muonctl/coordinator_commands.h"
#include "tools/muonctl/plan_command.h"

namespace muond::muonctl {
namespace {

const std::map<std::string, Command>& Commands() {
  static const auto* commands = new std::map<std::string, Command>{
      {"plan", {RunPlan, "plan NS homes offline from a manifest (JSON out)"}},
      {"status", {RunStatus, "a running job: current plan and daemons"}},
      {"daemons", {RunDaemons, "a running job's daemons, one per line"}},
      {"rebalance", {RunRebalance, "push a new plan (cost model/table)"}},
      {"save", {RunSave, "every daemon saves its state to --dir"}},
      {"load", {RunLoad, "every daemon loads its state from --dir"}},
      {"unregister",
       {RunUnregister, "clear a dead trainer's registration (operator)"}},
  };
  return *commands;
}

void PrintHelp(std::ostream& os) {
  os << "usage: muonctl SUBCOMMAND [ARGS...]\nsubcommands:\n";
  for (const auto& [name, command] : Commands()) {
    os << "  " << name << "  " << command.summary << "\n";
  }
  os << "`muonctl SUBCOMMAND --help` prints that subcommand's flags.\n";
}

}  // namespace
}  // namespace muond::muonctl

int main(int argc, char** argv) {
  using muond::muonctl::Commands;
  if (argc < 2 || std::string(argv[1]) == "help" ||
      std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    muond::muonctl::PrintHelp(argc < 2 ? std::cerr : std::cout);
    return argc < 2 ? 2 : 0;
  }
  auto it = Commands().find(argv[1]);
  if (it == Commands().end()) {
    std::cerr << "muonctl: unknown subcommand '" << argv[1] << "'\n";
    muond::muonctl::PrintHelp(std::cerr);
    return 2;
  }
  return it->second.run(std::vector<std::string>(argv + 2, argv + argc),
                        std::cout, std::cerr);
}
