#pragma once
// What the daemon may ask, while it runs a step, of the trainer that sent it
// (through a step channel or the Step RPC).
#include <functional>

#include "absl/status/status.h"

namespace muond {

struct StepTrainer {
  // For a step sent before its trainer's checks
  // (StepRequest.await_trainer_verdict; step channels only): waits for the
  // trainer's verdict, OK for go, else why the step is withdrawn. Empty over
  // the Step RPC.
  std::function<absl::Status()> verdict;
  // True once the trainer is known to be gone (its step channel's lock
  // released, its RPC cancelled). Empty: never known.
  std::function<bool()> gone;
};

}  // namespace muond
