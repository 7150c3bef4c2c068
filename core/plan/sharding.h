#pragma once
// The sharding model of a 2-D Muon weight in a GTP_remat x TP domain
// (docs/ARCHITECTURE.md "Sharding"; Megatron-LM's layer-sharded Muon,
// `ParamShardSpec.from_param`).
//
// Domain = G x T ranks; rank (g, t) has flat index g * T + t (TP innermost).
// A weight of full shape (P, Q):
//   * TP splits it along tp_dim (0: column-parallel, rows split; 1:
//   row-parallel,
//     cols split) into T equal pieces when it is TP-sharded; otherwise every TP
//     rank holds the whole TP-local matrix (TP-replicated).
//   * GTP_remat pads dim 0 of the TP-local matrix with pad_length trailing zero
//     rows and splits it into G row blocks: equal blocks, or the gtp_rows
//     blocks given (uneven, FSDP2's torch.chunk sizes; a block may be empty).
//   * An axis of size 1 is absent and its tag is ignored.
// So local_shape = ((R + pad) / G, C) (or (gtp_rows[g], C) on GTP rank g)
// where (R, C) is the TP-local shape, and full_shape = (R, C) with the tp_dim
// extent multiplied by T.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/domain.h"

namespace muond {

enum class ParamSharding {
  kReplicated,     // no exchange: every rank runs the same local NS
  kGtpRemat,       // stage 1 only: every TP rank of the home row runs NS
  kTp,             // stage 2 only (only possible when G == 1)
  kGtpRematAndTp,  // both stages: one rank (g_home, t_home) runs NS
};

const char* ParamShardingName(ParamSharding sharding);

// The model's tags on a parameter (Megatron names).
struct ShardTags {
  bool tensor_model_parallel = false;
  // Counts only when tensor_model_parallel is set (Transformer Engine stamps
  // partition_dim = 0 on duplicated weights). -1 with the flag set means
  // TP-replicated, as in Megatron's tp_partition_dim().
  int partition_dim = -1;
  bool is_gtp_weight_remat = false;
  // Trailing zero rows appended to dim 0 of the TP-local matrix before the
  // GTP split (GTP alignment padding). Must be 0 unless GTP-sharded.
  int64_t pad_length = 0;
  // Uneven GTP row blocks: the rows of the padded TP-local matrix (R +
  // pad_length) held by each GTP rank, in g order. Empty: G equal blocks.
  // Otherwise only on a GTP-sharded param, exactly G entries >= 0 summing to
  // R + pad_length, and rank g holds gtp_rows[g] rows (0 allowed: an empty
  // local shard, which only gtp_rows can describe).
  std::vector<int64_t> gtp_rows = {};
};

struct ParamShardSpec {
  std::string name;
  std::vector<int64_t> local_shape;  // the shard this rank holds (2-D)
  std::vector<int64_t> full_shape;   // the matrix NS runs on (2-D, unpadded)
  int tp_dim =
      -1;  // -1 none (TP axis absent or replicated), 0 column-, 1 row-parallel
  bool gtp_sharded = false;  // GTP axis present and the param is GTP-tagged
  int64_t pad_length =
      0;  // zero rows on the gathered dim (only if gtp_sharded)
  // Rows of each GTP rank's block of the padded TP-local matrix (only if
  // gtp_sharded; ShardTags::gtp_rows). Empty: G blocks of local_shape[0].
  std::vector<int64_t> gtp_rows;
  ParamSharding sharding = ParamSharding::kReplicated;

  bool routed() const { return sharding != ParamSharding::kReplicated; }
  bool tp_sharded() const { return tp_dim >= 0; }
};

// Builds the spec of one param from its tags and the shape of the local shard
// held by GTP rank `g` (counts only with tags.gtp_rows: every rank of an
// equal split holds the same shape).
// Errors (InvalidArgument, message names the param and the rule):
//   * local_shape not 2-D, or a dimension <= 0 (non-2-D tensors go to AdamW),
//     except 0 rows on a rank whose gtp_rows entry is 0;
//   * domain sizes < 1; partition_dim not in {-1, 0, 1} when TP tags count;
//   * TP-sharded but not GTP-tagged while G > 1 (stage 1 would concatenate
//     replicated copies as shards and silently corrupt the update);
//   * pad_length < 0, pad_length > 0 on a param that is not GTP-sharded, or
//     pad_length >= the gathered dim (local rows * G, or sum of gtp_rows);
//   * gtp_rows (CheckGtpRows): on a param that is not GTP-sharded, not G
//     entries, an entry < 0, a sum != TP-local rows + pad_length, or
//     local_shape[0] != gtp_rows[g].
absl::StatusOr<ParamShardSpec> MakeShardSpec(std::string name,
                                             std::vector<int64_t> local_shape,
                                             const ShardTags& tags,
                                             DomainSize domain, int g = 0);

// Builds the spec from the FULL shape (what manifests list). tp_dim in
// {-1, 0, 1} applies when T > 1; gtp_sharded applies when G > 1. pad_length
// < 0 means "choose the smallest padding that makes the TP-local dim 0
// divisible by G" (with gtp_rows: sum(gtp_rows) - TP-local rows). With
// gtp_rows the local shape is rank g's block (gtp_rows[g], C). Errors: as
// MakeShardSpec, plus the full dim not divisible by T on tp_dim, and
// (TP-local rows + pad) not divisible by G without gtp_rows.
absl::StatusOr<ParamShardSpec> MakeShardSpecFromFullShape(
    std::string name, std::vector<int64_t> full_shape, int tp_dim,
    bool gtp_sharded, int64_t pad_length, DomainSize domain,
    std::vector<int64_t> gtp_rows = {}, int g = 0);

// Checks that a spec (e.g. one received from elsewhere) is self-consistent and
// belongs to `domain`: local * sizes - padding == full (sum(gtp_rows) -
// padding with gtp_rows), flags match the axes, sharding matches the flags,
// gtp_rows follows CheckGtpRows. g >= 0: the spec is GTP rank g's
// (local_shape[0] == gtp_rows[g]); g < 0: any rank's (local_shape[0] is one
// of gtp_rows).
absl::Status ValidateShardSpec(const ParamShardSpec& spec, DomainSize domain,
                               int g = -1);

// THE home of the gtp_rows rules (docs/ARCHITECTURE.md "Sharding"): OK for
// empty gtp_rows; otherwise gtp_sharded, exactly domain.gtp entries, each in
// [0, 2^31], summing to padded_rows (TP-local rows + pad_length).
// InvalidArgument "param '<name>': gtp_rows ..." naming the rule.
// padded_rows < 0: the sum is not checked (it defines the padded rows).
absl::Status CheckGtpRows(const std::string& name,
                          const std::vector<int64_t>& gtp_rows,
                          bool gtp_sharded, DomainSize domain,
                          int64_t padded_rows);

// Rows that GTP rank g holds of a GTP-sharded dim 0 of tp_local_rows rows
// (any tensor, 1-D AdamW params too): gtp_rows[g] (CheckGtpRows), or
// (tp_local_rows + pad_length) / G, which must divide. pad_length >= 0.
absl::StatusOr<int64_t> GtpLocalRows(const std::string& name,
                                     int64_t tp_local_rows, int64_t pad_length,
                                     const std::vector<int64_t>& gtp_rows,
                                     DomainSize domain, int g);

// The length rank (g, t) holds of a 1-D tensor (an AdamW param: a bias, a
// norm's weight) of full_length elements: the whole tensor, or a split along
// dim 0 by TP (tensor_model_parallel with partition_dim 0 and T > 1: an equal
// piece, full_length / T, which must divide) and then by GTP
// (is_gtp_weight_remat and G > 1: GtpLocalRows of the TP piece, so
// pad_length and gtp_rows count as for a matrix). A tensor that is not
// GTP-split must not carry gtp_rows (CheckGtpRows). The 2-D rule is
// MakeShardSpec's. InvalidArgument "param '<name>': ..." naming the rule.
absl::StatusOr<int64_t> LocalLengthOf1d(const std::string& name,
                                        int64_t full_length,
                                        const ShardTags& tags,
                                        DomainSize domain, int g);

// The rows [start, start + rows) of the padded TP-local matrix that GTP rank
// g holds: prefix sums of gtp_rows, or g * r and r = local_shape[0] for equal
// blocks. (0, local_shape[0]) for a param that is not GTP-sharded.
struct GtpRowBlock {
  int64_t start = 0;
  int64_t rows = 0;
};
GtpRowBlock GtpRowBlockOf(const ParamShardSpec& spec, DomainSize domain, int g);

// The TP-local matrix without padding: what stage 1 assembles on the home row,
// and the stage-2 input (for a param with no stage 1 it is the local shard).
std::vector<int64_t> TpLocalShape(const ParamShardSpec& spec,
                                  DomainSize domain);

// Rows of the local shard on GTP rank g that are real (not padding): block g
// covers padded rows [start, start + rows) (GtpRowBlockOf); its real rows are
// those < R, the TP-local rows: clamp(R - start, 0, rows).
// (local_shape[0] for a param that is not GTP-sharded.)
int64_t ValidLocalRows(const ParamShardSpec& spec, DomainSize domain, int g);

// Megatron-LM's layer-sharded Muon balances by this proxy: max(P, Q) *
// min(P, Q)^2, the leading term of NsFlops.
double NsCost(int64_t rows, int64_t cols);
// ns_cost of any tensor: NsCost for 2-D, the element count otherwise.
double NsCostOfShape(const std::vector<int64_t>& shape);

// Exact floating-point operation count of `num_steps` Newton–Schulz iterations
// on a rows x cols matrix, m = min, n = max (Dao-AILab, "Gram Newton-Schulz":
// "Runtime of Standard Newton-Schulz"): per step X·Xᵀ 2m²n, A² 2m³,
// B·X 2m²n = 4m²n + 2m³. With symmetric (SYRK) kernels X·Xᵀ and A² compute
// half of their outputs: 3m²n + m³ per step.
double NsFlops(int64_t rows, int64_t cols, int num_steps, bool symmetric);

}  // namespace muond
