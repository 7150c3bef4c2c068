// server/common/operator_id: the operator's client_id is derived from the
// token. Known answers from the openssl CLI:
//   printf 'muond operator client_id v1' | openssl dgst -sha256 -hmac TOKEN
// (tests/client/python/test_operator_id.py holds the Python client to the
// same values).
#include "server/common/operator_id.h"

#include <gtest/gtest.h>

namespace muond {
namespace {

TEST(OperatorIdTest, IsTheTokensHmac) {
  EXPECT_EQ(OperatorClientId("job-token"),
            "operator:"
            "266ea89347a1bf78b4466711158ca5ac141c014f36d62096a59ee086ceb3ffe2");
  EXPECT_EQ(OperatorClientId(""),
            "operator:"
            "8e51399fc895d458cdb43e8d95ec80b63c0825f522a12f5ff32f92b7c1e7747f");
  EXPECT_NE(OperatorClientId("job-token"), OperatorClientId("job-token2"));
}

}  // namespace
}  // namespace muond
