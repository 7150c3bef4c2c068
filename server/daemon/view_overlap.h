#pragma once
// The aliasing rule of a registration (docs/ARCHITECTURE.md "Memory
// registration"): a param's memory must not overlap another param's memory
// or any grad (its own included). Two overlapping params would be updated
// twice per step; a grad overlapping a param would be overwritten while it is
// read. Grads may overlap each other: they are only read (torch never does
// it, but nothing breaks).
//
// Views are compared by their addresses in the daemon: every region is
// mapped once (region_table refuses one shm object or CUDA IPC handle under
// two names, so one memory has one address range), so equal memory means
// equal addresses. Strided views (TP column blocks) are compared row by row,
// so column blocks interleaved in one buffer (a fused QKV weight split in
// three params) are accepted.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/common/matrix_view.h"

namespace muond {

struct TensorSpan {
  const MatrixView* view;
  const std::string* param;  // the param's name
  bool grad;                 // the param's grad, else the param itself
};

// Rows of strided views compared exactly in one cluster of overlapping
// bounding ranges, at most (bounds time and memory against a client that
// interleaves millions of one-element rows).
inline constexpr int64_t kMaxInterleavedRows = int64_t{1} << 22;

// OK when the rule above holds. InvalidArgument naming both tensors
// ("param 'a' param and param 'b' grad") and the rule otherwise, or when a
// cluster of interleaved strided views has more than kMaxInterleavedRows
// rows. O(n log n) in the number of views (plus the rows of interleaved
// strided views).
absl::Status CheckNoAliasing(const std::vector<TensorSpan>& spans);

}  // namespace muond
