// The servers' --v flag (absl). Kept apart from glog headers: glog declares
// its own FLAGS_v (gflags), which would clash with absl's FLAGS_v in one
// translation unit.
#include "absl/flags/flag.h"

ABSL_FLAG(int, v, 0, "Verbose logging level (glog VLOG)");

namespace muond {
int VerbosityFlag() { return absl::GetFlag(FLAGS_v); }
}  // namespace muond
