// Logs through every path a server's stderr can see (glog at each severity,
// VLOG, gRPC core's gpr_log, protobuf's log, a message with quotes, control
// characters and invalid UTF-8), then fails a CHECK: log_format_test reads
// its stderr in both --log_format modes.
#include <grpc/grpc.h>
#include <grpc/support/log.h>

#include <string>

#include "absl/flags/parse.h"
#include "glog/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "server/common/logging.h"

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  muond::InitServerLogging(argv[0], "json-log-probe");
  muond::SetLogJob("probe-job", 3);
  grpc_init();  // as in a server: gpr_log's verbosity is set up
  LOG(INFO) << "info \"quoted\"\nsecond line\tand a tab";
  LOG(WARNING) << "warning";
  LOG(ERROR) << "error";
  VLOG(1) << "verbose";
  gpr_log(GPR_ERROR, "gpr error %d", 7);
  GOOGLE_LOG(ERROR) << "protobuf error";
  const std::string invalid_utf8 = "\xff\xfe";
  LOG(INFO) << "invalid utf-8: " << invalid_utf8;
  CHECK_EQ(1 + 1, 3) << "fatal on purpose";
  return 0;
}
