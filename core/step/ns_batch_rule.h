// ns_batch_size = 0 (auto): how many same-shape matrices Newton–Schulz runs
// together, from what was measured on one H100/H200 (bench/results/
// gpu_h100_llama_ns_batch.md, gpu_h200.md):
// - short side <= 2048: batching pays on a GPU. The ~1B Llama bench's NS
//   (2048-wide) took 62.8 ms unbatched, 43.1 ms in batches of 8, 41.1 ms in
//   batches of 32 and 40.9 ms at this rule; Qwen3-1.7B's 28 layers ran 1.2%
//   faster in batches of 28 than of 8.
// - short side 4096 and up: it does not (Llama-3-8B: batches of 4 were 0.8%
//   slower than 1), so those run one at a time (the unbatched path).
// - a host backend runs a batch slice by slice: batching there only costs
//   workspace, so auto is 1.
// A batch's matrices take at most kAutoNsBatchBytes in the NS work dtype
// (bf16 under "medium": 2^28 elements); the NS workspace holds a few such
// buffers (the iterate, its Gram and product, a staging copy), and the
// engine's memory budget (NsRunner::FitBatch) may cut the batch further.
#ifndef MUOND_CORE_STEP_NS_BATCH_RULE_H_
#define MUOND_CORE_STEP_NS_BATCH_RULE_H_

#include <algorithm>
#include <cstdint>

namespace muond {

inline constexpr int64_t kAutoNsBatchMaxShortSide = 2048;
inline constexpr int64_t kAutoNsBatchBytes = int64_t{1} << 29;

// The most matrices of rows x cols one NS batch holds: `ns_batch_size` when
// set (>= 1), else (0, auto) the rule above for `work_dtype_bytes` per
// element on a device (`on_device`) or the host.
inline int64_t NsBatchLimit(int64_t ns_batch_size, int64_t rows, int64_t cols,
                            int64_t work_dtype_bytes, bool on_device) {
  if (ns_batch_size >= 1) return ns_batch_size;
  if (!on_device || std::min(rows, cols) > kAutoNsBatchMaxShortSide) return 1;
  // Divided down, not multiplied up: no product of the sides can overflow.
  const int64_t per_row = kAutoNsBatchBytes /
                          std::max<int64_t>(1, work_dtype_bytes) /
                          std::max<int64_t>(1, rows);
  return std::max<int64_t>(1, per_row / std::max<int64_t>(1, cols));
}

}  // namespace muond

#endif  // MUOND_CORE_STEP_NS_BATCH_RULE_H_
