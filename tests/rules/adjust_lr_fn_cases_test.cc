// The scale modes torch.optim.Muon names (adjust_lr_fn) against the muond
// modes the Python client maps them to, on the shared table
// adjust_lr_fn_cases.json (test_adjust_lr_fn_cases.py checks the mapping):
// both give the same factor on every shape (core/muon/muon_update.h).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/muon/muon_update.h"
#include "tests/rules/case_table.h"

namespace muond::rules {
namespace {

TEST(AdjustLrFnCasesTest, MappedModeScalesAsTorchsMode) {
  const nlohmann::json table = LoadCaseTable("adjust_lr_fn_cases.json");
  ASSERT_FALSE(table["cases"].empty());
  for (const nlohmann::json& c : table["cases"]) {
    if (c.contains("error")) continue;  // refused by the client, no mode
    const std::string why = c["why"].get<std::string>();
    absl::StatusOr<ScaleMode> torch_mode =
        ParseScaleMode(c["torch_mode"].get<std::string>());
    absl::StatusOr<ScaleMode> mapped =
        ParseScaleMode(c["scale_mode"].get<std::string>());
    ASSERT_TRUE(torch_mode.ok()) << why << ": " << torch_mode.status();
    ASSERT_TRUE(mapped.ok()) << why << ": " << mapped.status();
    const double extra = c["extra_scale_factor"].get<double>();
    for (const nlohmann::json& shape : table["shapes"]) {
      const int64_t rows = shape[0].get<int64_t>();
      const int64_t cols = shape[1].get<int64_t>();
      EXPECT_DOUBLE_EQ(MuonScaleFactor(*mapped, rows, cols, extra),
                       MuonScaleFactor(*torch_mode, rows, cols))
          << why << " at " << rows << "x" << cols;
    }
  }
}

}  // namespace
}  // namespace muond::rules
