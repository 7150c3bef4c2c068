// bench/gpu/kernel_name.h's ShortKernelName on real kernel names
// (kernel_name_cases.txt, shared with the Python twin's test), and the 160
// character cap.
#include "bench/gpu/kernel_name.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

namespace muond::bench {
namespace {

std::vector<std::pair<std::string, std::string>> Cases() {
  std::ifstream in("tests/bench/kernel_name_cases.txt");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') lines.push_back(line);
  std::vector<std::pair<std::string, std::string>> cases;
  for (size_t i = 0; i + 1 < lines.size(); i += 2)
    cases.emplace_back(lines[i], lines[i + 1]);
  return cases;
}

TEST(ShortKernelNameTest, RealNamesAsTheCasesFileSays) {
  const auto cases = Cases();
  ASSERT_EQ(cases.size(), 7u) << "kernel_name_cases.txt not read whole";
  for (const auto& [name, want] : cases) EXPECT_EQ(ShortKernelName(name), want);
}

TEST(ShortKernelNameTest, CapsAt160Characters) {
  const std::string long_name(300, 'k');
  EXPECT_EQ(ShortKernelName(long_name), std::string(160, 'k'));
}

}  // namespace
}  // namespace muond::bench
