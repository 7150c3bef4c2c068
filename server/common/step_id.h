#pragma once
// The largest step id a daemon accepts, stepped (StepRequest.step_id) or
// restored (LoadState, ImportState): 2^62 - 1, so id + 1 never overflows an
// int64 and the Python client's check (muond/_rules.py MAX_STEP_ID) matches.
// A daemon at this id, stepped or restored, can only replay it.
#include <cstdint>

namespace muond {

inline constexpr int64_t kMaxStepId = (int64_t{1} << 62) - 1;

}  // namespace muond
