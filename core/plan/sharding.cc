#include "core/plan/sharding.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

absl::Status Invalid(const std::string& name, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat("param '", name, "': ", rule));
}

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status CheckDomain(const std::string& name, DomainSize domain) {
  if (domain.gtp < 1 || domain.tp < 1) {
    return Invalid(name, absl::StrCat("domain sizes must be >= 1, got G=",
                                      domain.gtp, " T=", domain.tp));
  }
  return absl::OkStatus();
}

constexpr int64_t kMaxMatrixDim = int64_t{1} << 31;

// zero_rows_ok: a local shard on a rank whose gtp_rows block is empty.
absl::Status CheckMatrixShape(const std::string& name, const char* what,
                              const std::vector<int64_t>& shape,
                              bool zero_rows_ok = false) {
  if (shape.size() != 2) {
    return Invalid(name, absl::StrCat(what, " shape ", ShapeStr(shape),
                                      " is not 2-D (Muon orthogonalizes "
                                      "matrices; send it to the AdamW path)"));
  }
  if (shape[0] < (zero_rows_ok ? 0 : 1) || shape[1] <= 0) {
    return Invalid(
        name,
        absl::StrCat(what, " shape ", ShapeStr(shape), " has a dimension <= 0",
                     zero_rows_ok ? ""
                                  : " (0 rows only on a rank whose gtp_rows "
                                    "entry is 0)"));
  }
  // Bounded so that dims times a domain size (an int) or plus a bounded
  // pad_length never overflow int64 (found by UBSan on malformed requests).
  if (shape[0] > kMaxMatrixDim || shape[1] > kMaxMatrixDim) {
    return Invalid(name, absl::StrCat(what, " shape ", ShapeStr(shape),
                                      " has a dimension > ", kMaxMatrixDim));
  }
  return absl::OkStatus();
}

int64_t Sum(const std::vector<int64_t>& v) {
  int64_t sum = 0;
  for (int64_t x : v) sum += x;
  return sum;
}

// Rank g (a GTP coordinate of the domain) holds gtp_rows[g] rows; g < 0:
// some rank, so local_rows must be one of the entries.
absl::Status CheckLocalRowsOfRank(const std::string& name, int64_t local_rows,
                                  const std::vector<int64_t>& gtp_rows,
                                  DomainSize domain, int g) {
  if (g >= domain.gtp) {
    return Invalid(
        name, absl::StrCat("GTP rank g=", g, " is outside G=", domain.gtp));
  }
  if (g >= 0 && local_rows != gtp_rows[g]) {
    return Invalid(name, absl::StrCat("local rows ", local_rows,
                                      " != gtp_rows[", g, "] = ", gtp_rows[g],
                                      " (GTP rank g holds gtp_rows[g] rows of "
                                      "gtp_rows ",
                                      ShapeStr(gtp_rows), ")"));
  }
  if (g < 0 && std::find(gtp_rows.begin(), gtp_rows.end(), local_rows) ==
                   gtp_rows.end()) {
    return Invalid(name, absl::StrCat("local rows ", local_rows,
                                      " are no rank's block of gtp_rows ",
                                      ShapeStr(gtp_rows)));
  }
  return absl::OkStatus();
}

ParamSharding Classify(bool tp_sharded, bool gtp_sharded) {
  if (tp_sharded && gtp_sharded) return ParamSharding::kGtpRematAndTp;
  if (tp_sharded) return ParamSharding::kTp;
  if (gtp_sharded) return ParamSharding::kGtpRemat;
  return ParamSharding::kReplicated;
}

// The rules shared by both factories once tp_dim and gtp_sharded are known
// (axes of size 1 already folded away).
absl::Status CheckAxisRules(const std::string& name, int tp_dim,
                            bool gtp_sharded, int64_t pad_length,
                            DomainSize domain) {
  if (tp_dim >= 0 && !gtp_sharded && domain.gtp > 1) {
    return Invalid(name,
                   absl::StrCat("TP-sharded (tp_dim=", tp_dim,
                                ") but not GTP-sharded in a domain with a GTP "
                                "axis (G=",
                                domain.gtp,
                                "): stage 1 would concatenate its replicated "
                                "copies as shards and corrupt the update"));
  }
  if (pad_length < 0) {
    return Invalid(name, absl::StrCat("pad_length ", pad_length, " < 0"));
  }
  if (pad_length > 0 && !gtp_sharded) {
    return Invalid(name, absl::StrCat("pad_length ", pad_length,
                                      " > 0 but the param is not GTP-sharded "
                                      "(G=",
                                      domain.gtp,
                                      "): padding exists only on the GTP "
                                      "gathered dim"));
  }
  return absl::OkStatus();
}

}  // namespace

const char* ParamShardingName(ParamSharding sharding) {
  switch (sharding) {
    case ParamSharding::kReplicated:
      return "REPLICATED";
    case ParamSharding::kGtpRemat:
      return "GTP_REMAT";
    case ParamSharding::kTp:
      return "TP";
    case ParamSharding::kGtpRematAndTp:
      return "GTP_REMAT_AND_TP";
  }
  return "UNKNOWN";
}

absl::StatusOr<ParamShardSpec> MakeShardSpec(std::string name,
                                             std::vector<int64_t> local_shape,
                                             const ShardTags& tags,
                                             DomainSize domain, int g) {
  if (absl::Status s = CheckDomain(name, domain); !s.ok()) return s;
  const bool uneven = !tags.gtp_rows.empty();
  if (absl::Status s = CheckMatrixShape(name, "local", local_shape, uneven);
      !s.ok()) {
    return s;
  }
  int tp_dim = -1;
  if (domain.tp > 1 && tags.tensor_model_parallel) {
    if (tags.partition_dim < -1 || tags.partition_dim > 1) {
      return Invalid(name, absl::StrCat("partition_dim ", tags.partition_dim,
                                        " is not -1, 0 or 1 for a 2-D "
                                        "tensor_model_parallel weight"));
    }
    tp_dim = tags.partition_dim;
  }
  if (tags.pad_length > kMaxMatrixDim) {
    return Invalid(name, absl::StrCat("pad_length ", tags.pad_length, " > ",
                                      kMaxMatrixDim));
  }
  const bool gtp_sharded = domain.gtp > 1 && tags.is_gtp_weight_remat;
  if (absl::Status s =
          CheckAxisRules(name, tp_dim, gtp_sharded, tags.pad_length, domain);
      !s.ok()) {
    return s;
  }
  RETURN_IF_ERROR(
      CheckGtpRows(name, tags.gtp_rows, gtp_sharded, domain, /*padded=*/-1));
  if (uneven) {
    RETURN_IF_ERROR(
        CheckLocalRowsOfRank(name, local_shape[0], tags.gtp_rows, domain, g));
  }
  const int64_t gathered_rows = uneven        ? Sum(tags.gtp_rows)
                                : gtp_sharded ? local_shape[0] * domain.gtp
                                              : local_shape[0];
  if (tags.pad_length >= gathered_rows) {
    return Invalid(
        name,
        absl::StrCat("pad_length ", tags.pad_length, " >= the gathered dim 0 (",
                     gathered_rows,
                     uneven ? absl::StrCat(" = sum of gtp_rows ",
                                           ShapeStr(tags.gtp_rows))
                            : absl::StrCat(" = local rows ", local_shape[0],
                                           " x G ", domain.gtp),
                     "): no real rows left"));
  }
  ParamShardSpec spec;
  spec.name = std::move(name);
  spec.tp_dim = tp_dim;
  spec.gtp_sharded = gtp_sharded;
  spec.pad_length = tags.pad_length;
  spec.gtp_rows = tags.gtp_rows;
  spec.sharding = Classify(tp_dim >= 0, gtp_sharded);
  spec.full_shape = {gathered_rows - tags.pad_length, local_shape[1]};
  if (tp_dim >= 0) spec.full_shape[tp_dim] *= domain.tp;
  spec.local_shape = std::move(local_shape);
  return spec;
}

absl::StatusOr<ParamShardSpec> MakeShardSpecFromFullShape(
    std::string name, std::vector<int64_t> full_shape, int tp_dim,
    bool gtp_sharded, int64_t pad_length, DomainSize domain,
    std::vector<int64_t> gtp_rows, int g) {
  if (absl::Status s = CheckDomain(name, domain); !s.ok()) return s;
  if (absl::Status s = CheckMatrixShape(name, "full", full_shape); !s.ok()) {
    return s;
  }
  if (tp_dim < -1 || tp_dim > 1) {
    return Invalid(name, absl::StrCat("tp_dim ", tp_dim, " is not -1, 0 or 1"));
  }
  const int effective_tp_dim = domain.tp > 1 ? tp_dim : -1;
  const bool effective_gtp = domain.gtp > 1 && gtp_sharded;
  std::vector<int64_t> tp_local = full_shape;
  if (effective_tp_dim >= 0) {
    if (full_shape[effective_tp_dim] % domain.tp != 0) {
      return Invalid(name, absl::StrCat("full dim ", effective_tp_dim, " (",
                                        full_shape[effective_tp_dim],
                                        ") is not divisible by T=", domain.tp));
    }
    tp_local[effective_tp_dim] /= domain.tp;
  }
  if (pad_length > kMaxMatrixDim) {
    return Invalid(
        name, absl::StrCat("pad_length ", pad_length, " > ", kMaxMatrixDim));
  }
  RETURN_IF_ERROR(
      CheckGtpRows(name, gtp_rows, effective_gtp, domain, /*padded=*/-1));
  if (pad_length < 0 && !gtp_rows.empty()) {
    pad_length = Sum(gtp_rows) - tp_local[0];
    if (pad_length < 0) {
      return Invalid(
          name, absl::StrCat("gtp_rows ", ShapeStr(gtp_rows), " sum to ",
                             Sum(gtp_rows), ", fewer than the TP-local rows (",
                             tp_local[0], ")"));
    }
  } else if (pad_length < 0) {
    pad_length = effective_gtp
                     ? (domain.gtp - tp_local[0] % domain.gtp) % domain.gtp
                     : 0;
  }
  if (absl::Status s = CheckAxisRules(name, effective_tp_dim, effective_gtp,
                                      pad_length, domain);
      !s.ok()) {
    return s;
  }
  std::vector<int64_t> local = tp_local;
  if (effective_gtp) {
    ASSIGN_OR_RETURN(local[0], GtpLocalRows(name, tp_local[0], pad_length,
                                            gtp_rows, domain, g));
  }
  ParamShardSpec spec;
  spec.name = std::move(name);
  spec.local_shape = std::move(local);
  spec.full_shape = std::move(full_shape);
  spec.tp_dim = effective_tp_dim;
  spec.gtp_sharded = effective_gtp;
  spec.pad_length = pad_length;
  spec.gtp_rows = std::move(gtp_rows);
  spec.sharding = Classify(effective_tp_dim >= 0, effective_gtp);
  if (absl::Status s = ValidateShardSpec(spec, domain, g); !s.ok()) return s;
  return spec;
}

absl::Status ValidateShardSpec(const ParamShardSpec& spec, DomainSize domain,
                               int g) {
  const std::string& name = spec.name;
  if (absl::Status s = CheckDomain(name, domain); !s.ok()) return s;
  const bool uneven = !spec.gtp_rows.empty();
  if (absl::Status s =
          CheckMatrixShape(name, "local", spec.local_shape, uneven);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckMatrixShape(name, "full", spec.full_shape);
      !s.ok()) {
    return s;
  }
  if (spec.tp_dim < -1 || spec.tp_dim > 1) {
    return Invalid(name,
                   absl::StrCat("tp_dim ", spec.tp_dim, " is not -1, 0 or 1"));
  }
  if (spec.tp_dim >= 0 && domain.tp == 1) {
    return Invalid(name, "tp_dim set but the domain has no TP axis (T=1)");
  }
  if (spec.gtp_sharded && domain.gtp == 1) {
    return Invalid(name,
                   "gtp_sharded set but the domain has no GTP axis (G=1)");
  }
  if (absl::Status s = CheckAxisRules(name, spec.tp_dim, spec.gtp_sharded,
                                      spec.pad_length, domain);
      !s.ok()) {
    return s;
  }
  RETURN_IF_ERROR(
      CheckGtpRows(name, spec.gtp_rows, spec.gtp_sharded, domain, -1));
  if (uneven) {
    RETURN_IF_ERROR(CheckLocalRowsOfRank(name, spec.local_shape[0],
                                         spec.gtp_rows, domain, g));
  }
  if (spec.sharding != Classify(spec.tp_dim >= 0, spec.gtp_sharded)) {
    return Invalid(name,
                   absl::StrCat("sharding ", ParamShardingName(spec.sharding),
                                " does not match tp_dim=", spec.tp_dim,
                                " gtp_sharded=", spec.gtp_sharded));
  }
  std::vector<int64_t> expected = TpLocalShape(spec, domain);
  if (expected[0] <= 0) {
    return Invalid(name, absl::StrCat("pad_length ", spec.pad_length,
                                      " >= the gathered dim 0 (",
                                      expected[0] + spec.pad_length, ")"));
  }
  if (spec.tp_dim >= 0) expected[spec.tp_dim] *= domain.tp;
  if (expected != spec.full_shape) {
    return Invalid(
        name, absl::StrCat("local shape ", ShapeStr(spec.local_shape),
                           " is inconsistent with full shape ",
                           ShapeStr(spec.full_shape), " for G=", domain.gtp,
                           " T=", domain.tp, " tp_dim=", spec.tp_dim,
                           " pad_length=", spec.pad_length,
                           uneven ? " gtp_rows=" + ShapeStr(spec.gtp_rows) : "",
                           " (expected ", ShapeStr(expected), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckGtpRows(const std::string& name,
                          const std::vector<int64_t>& gtp_rows,
                          bool gtp_sharded, DomainSize domain,
                          int64_t padded_rows) {
  if (gtp_rows.empty()) return absl::OkStatus();
  if (!gtp_sharded) {
    return Invalid(name, absl::StrCat("gtp_rows ", ShapeStr(gtp_rows),
                                      " given but the param is not "
                                      "GTP-sharded (G=",
                                      domain.gtp,
                                      "): row blocks exist only on the GTP "
                                      "axis"));
  }
  if (int64_t(gtp_rows.size()) != domain.gtp) {
    return Invalid(
        name, absl::StrCat(
                  "gtp_rows ", ShapeStr(gtp_rows), " has ", gtp_rows.size(),
                  " entries; it needs one per GTP rank (G=", domain.gtp, ")"));
  }
  for (size_t i = 0; i < gtp_rows.size(); ++i) {
    if (gtp_rows[i] < 0 || gtp_rows[i] > kMaxMatrixDim) {
      return Invalid(name, absl::StrCat("gtp_rows[", i, "] = ", gtp_rows[i],
                                        " is not in [0, ", kMaxMatrixDim, "]"));
    }
  }
  if (padded_rows >= 0 && Sum(gtp_rows) != padded_rows) {
    return Invalid(name, absl::StrCat("gtp_rows ", ShapeStr(gtp_rows),
                                      " sum to ", Sum(gtp_rows),
                                      ", not the TP-local rows + pad_length (",
                                      padded_rows, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> GtpLocalRows(const std::string& name,
                                     int64_t tp_local_rows, int64_t pad_length,
                                     const std::vector<int64_t>& gtp_rows,
                                     DomainSize domain, int g) {
  if (pad_length < 0 || pad_length > kMaxMatrixDim ||
      tp_local_rows > kMaxMatrixDim) {
    return Invalid(name, absl::StrCat("pad_length ", pad_length,
                                      " is not in [0, ", kMaxMatrixDim, "]"));
  }
  if (g < 0 || g >= domain.gtp) {
    return Invalid(
        name, absl::StrCat("GTP rank g=", g, " is outside G=", domain.gtp));
  }
  const int64_t padded = tp_local_rows + pad_length;
  if (!gtp_rows.empty()) {
    RETURN_IF_ERROR(CheckGtpRows(name, gtp_rows, true, domain, padded));
    return gtp_rows[g];
  }
  if (padded % domain.gtp != 0) {
    return Invalid(
        name,
        absl::StrCat("TP-local dim 0 (", tp_local_rows, ") + pad_length (",
                     pad_length, ") is not divisible by G=", domain.gtp,
                     " (give gtp_rows for uneven row blocks)"));
  }
  return padded / domain.gtp;
}

absl::StatusOr<int64_t> LocalLengthOf1d(const std::string& name,
                                        int64_t full_length,
                                        const ShardTags& tags,
                                        DomainSize domain, int g) {
  const bool tp =
      tags.tensor_model_parallel && tags.partition_dim == 0 && domain.tp > 1;
  const bool gtp = tags.is_gtp_weight_remat && domain.gtp > 1;
  int64_t n = full_length;
  if (tp) {
    if (n % domain.tp != 0) {
      return Invalid(name,
                     absl::StrCat("full_shape ", ShapeStr({full_length}),
                                  " not divisible by tp_size ", domain.tp));
    }
    n /= domain.tp;
  }
  if (!gtp) {
    RETURN_IF_ERROR(CheckGtpRows(name, tags.gtp_rows, false, domain, -1));
    return n;
  }
  return GtpLocalRows(name, n, tags.pad_length, tags.gtp_rows, domain, g);
}

std::vector<int64_t> TpLocalShape(const ParamShardSpec& spec,
                                  DomainSize domain) {
  std::vector<int64_t> shape = spec.local_shape;
  if (!spec.gtp_sharded) return shape;
  const int64_t padded =
      spec.gtp_rows.empty() ? shape[0] * domain.gtp : Sum(spec.gtp_rows);
  shape[0] = padded - spec.pad_length;
  return shape;
}

// The block depends on the spec alone (its local rows or gtp_rows); the
// domain stays in the signature so callers pass what TpLocalShape takes.
GtpRowBlock GtpRowBlockOf(const ParamShardSpec& spec, DomainSize /*domain*/,
                          int g) {
  const int64_t local_rows = spec.local_shape[0];
  if (!spec.gtp_sharded) return {0, local_rows};
  if (spec.gtp_rows.empty()) return {g * local_rows, local_rows};
  int64_t start = 0;
  for (int k = 0; k < g; ++k) start += spec.gtp_rows[k];
  return {start, spec.gtp_rows[g]};
}

int64_t ValidLocalRows(const ParamShardSpec& spec, DomainSize domain, int g) {
  if (!spec.gtp_sharded) return spec.local_shape[0];
  const GtpRowBlock block = GtpRowBlockOf(spec, domain, g);
  const int64_t real_rows = TpLocalShape(spec, domain)[0];
  return std::clamp<int64_t>(real_rows - block.start, 0, block.rows);
}

double NsCost(int64_t rows, int64_t cols) {
  const double m = double(std::min(rows, cols));
  const double n = double(std::max(rows, cols));
  return n * m * m;
}

double NsCostOfShape(const std::vector<int64_t>& shape) {
  if (shape.size() == 2) return NsCost(shape[0], shape[1]);
  double numel = 1;
  for (int64_t d : shape) numel *= double(d);
  return numel;
}

double NsFlops(int64_t rows, int64_t cols, int num_steps, bool symmetric) {
  const double m = double(std::min(rows, cols));
  const double n = double(std::max(rows, cols));
  const double per_step =
      symmetric ? 3 * m * m * n + m * m * m : 4 * m * m * n + 2 * m * m * m;
  return num_steps * per_step;
}

}  // namespace muond
