#include "server/common/logging.h"

#include "glog/logging.h"

namespace muond {

void InitServerLogging(const char* argv0) {
  FLAGS_logtostderr = true;
  FLAGS_v = VerbosityFlag();
  google::InitGoogleLogging(argv0);
}

}  // namespace muond
