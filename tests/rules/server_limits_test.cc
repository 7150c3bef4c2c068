// The constants the Python client repeats whose homes print_rules_py cannot
// print (server/common/auth.h, server/daemon/daemon_core.h, the CUDA
// runtime's cudaIpcMemHandle_t) against the shared table server_limits.json,
// which test_server_limits.py checks the client's copies against.
#include <driver_types.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "server/common/auth.h"
#include "server/daemon/daemon_core.h"
#include "tests/rules/case_table.h"

namespace muond::rules {
namespace {

class ServerLimitsTest : public ::testing::Test {
 protected:
  const nlohmann::json table_ = LoadCaseTable("server_limits.json");
};

TEST_F(ServerLimitsTest, TokenRules) {
  EXPECT_EQ(std::string(kTokenMetadataKey),
            table_["token_metadata_key"].get<std::string>());
  EXPECT_EQ(int64_t(kMaxTokenBytes), table_["max_token_bytes"].get<int64_t>());
}

TEST_F(ServerLimitsTest, StateChunkBounds) {
  EXPECT_EQ(kDefaultStateChunkBytes,
            table_["default_state_chunk_bytes"].get<int64_t>());
  EXPECT_EQ(kMaxStateChunkBytes,
            table_["max_state_chunk_bytes"].get<int64_t>());
  EXPECT_EQ(kStateChunkOverheadBytes,
            table_["state_chunk_overhead_bytes"].get<int64_t>());
}

// The daemon's opener (server/daemon/cuda_ipc_opener.cc) takes handles of
// sizeof(cudaIpcMemHandle_t) bytes.
TEST_F(ServerLimitsTest, CudaIpcHandleBytes) {
  EXPECT_EQ(int64_t(sizeof(cudaIpcMemHandle_t)),
            table_["cuda_ipc_handle_bytes"].get<int64_t>());
}

}  // namespace
}  // namespace muond::rules
