#include "server/daemon/region_table.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/echo.h"
#include "core/common/status_macros.h"
#include "server/common/checked_math.h"
#include "server/common/proto_convert.h"

namespace muond {
namespace {

std::string Shape(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

std::string KindName(v1::MemoryKind kind) {
  return v1::MemoryKind_IsValid(kind) ? v1::MemoryKind_Name(kind)
                                      : absl::StrCat(static_cast<int>(kind));
}

absl::Status ValidateDeclaration(const v1::MemoryRegion& region,
                                 const std::string& where) {
  if (region.kind() != v1::MEMORY_KIND_HOST_SHM &&
      region.kind() != v1::MEMORY_KIND_CUDA_IPC) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": kind ", KindName(region.kind()),
                     " is not MEMORY_KIND_HOST_SHM or MEMORY_KIND_CUDA_IPC"));
  }
  if (region.byte_size() == 0 || region.byte_size() > kMaxRegionBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": byte_size ", region.byte_size(),
                     " must be in [1, ", kMaxRegionBytes, "]"));
  }
  if (region.kind() == v1::MEMORY_KIND_HOST_SHM && region.shm_name().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": kind MEMORY_KIND_HOST_SHM needs shm_name"));
  }
  return absl::OkStatus();
}

// The memory a declaration names, as a key and in words: two regions of one
// registration must not alias it (the same CUDA IPC handle cannot be opened
// twice in one process, and one name per memory keeps errors unambiguous).
std::string MemoryKey(const v1::MemoryRegion& region) {
  return region.kind() == v1::MEMORY_KIND_HOST_SHM
             ? "shm:" + region.shm_name()
             : "ipc:" + region.cuda_ipc_handle();
}
std::string MemoryInWords(const v1::MemoryRegion& region) {
  return region.kind() == v1::MEMORY_KIND_HOST_SHM
             ? absl::StrCat("shm object '", Echo(region.shm_name()), "'")
             : std::string("its CUDA IPC handle");
}

absl::StatusOr<std::unique_ptr<MappedRegion>> Open(
    const v1::MemoryRegion& region, const std::string& where,
    HandleOpener& opener) {
  if (region.kind() == v1::MEMORY_KIND_HOST_SHM) {
    return opener.OpenShm(region.shm_name(), region.byte_size(), where);
  }
  return opener.OpenCudaIpc(region.cuda_ipc_handle(), region.byte_size(),
                            region.device(), where);
}

// Bytes from a view's first element to one past its last, from its offset:
// nullopt when that overflows int64. Shape dims are >= 0 and strides >= 0
// (the caller checked). An empty view (a 0-row shard of uneven GTP blocks)
// covers no byte: it ends where it starts, so any offset <= byte_size fits.
std::optional<int64_t> ViewEnd(uint64_t byte_offset,
                               const std::vector<int64_t>& shape,
                               const std::vector<int64_t>& strides,
                               int64_t element_size) {
  if (byte_offset > uint64_t(INT64_MAX)) return std::nullopt;
  for (int64_t dim : shape) {
    if (dim == 0) return int64_t(byte_offset);
  }
  std::optional<int64_t> last = 0;
  for (size_t d = 0; d < shape.size() && last; ++d) {
    std::optional<int64_t> step = CheckedMul(shape[d] - 1, strides[d]);
    last = step ? CheckedAdd(*last, *step) : std::nullopt;
  }
  std::optional<int64_t> span = last ? CheckedAdd(*last, 1) : std::nullopt;
  if (span) span = CheckedMul(*span, element_size);
  if (!span || byte_offset > uint64_t(INT64_MAX)) return std::nullopt;
  return CheckedAdd(int64_t(byte_offset), *span);
}

absl::Status ValidateLayout(const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& strides,
                            const std::vector<int64_t>& expected_shape,
                            const std::string& field) {
  if (shape != expected_shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape ", Shape(shape), " should be ",
                     Shape(expected_shape), " (the local shard)"));
  }
  if (strides.size() != shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": strides ", Shape(strides),
                     " must have one entry per dim of shape ", Shape(shape)));
  }
  if (strides.back() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": innermost stride is ", strides.back(), "; it must be 1"));
  }
  if (shape.size() == 2 && strides[0] < shape[1]) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": row stride ", strides[0], " is smaller than the row length ",
        shape[1], " (rows would overlap)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckNameLength(const std::string& name,
                             const std::string& field) {
  if (name.size() <= kMaxNameBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " '", Echo(name), "' is ", name.size(),
                   " bytes; names are at most ", kMaxNameBytes, " bytes"));
}

absl::StatusOr<RegionTable> RegionTable::Map(const Declarations& declarations,
                                             HandleOpener& opener) {
  RegionTable table;
  std::map<std::string, std::string> region_of_memory;  // MemoryKey -> name
  for (int i = 0; i < declarations.size(); ++i) {
    const v1::MemoryRegion& declaration = declarations[i];
    if (declaration.name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("regions[", i, "]: name is empty"));
    }
    RETURN_IF_ERROR(CheckNameLength(declaration.name(),
                                    absl::StrCat("regions[", i, "].name")));
    const std::string where =
        absl::StrCat("region '", Echo(declaration.name()), "'");
    if (table.regions_.contains(declaration.name())) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": declared twice (names are unique within a registration)"));
    }
    RETURN_IF_ERROR(ValidateDeclaration(declaration, where));
    auto [owner, fresh] =
        region_of_memory.emplace(MemoryKey(declaration), declaration.name());
    if (!fresh) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", MemoryInWords(declaration),
                       " is already region '", Echo(owner->second), "'"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<MappedRegion> mapping,
                     Open(declaration, where, opener));
    // The same object under another name (a hard link in /dev/shm) would
    // be mapped twice at two addresses, hiding aliasing from
    // view_overlap's address comparison.
    if (const std::string id = mapping->identity(); !id.empty()) {
      auto [same, fresh_id] = region_of_memory.emplace(id, declaration.name());
      if (!fresh_id) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", MemoryInWords(declaration),
            " is the same object as region '", Echo(same->second), "'"));
      }
    }
    table.regions_.emplace(declaration.name(),
                           Region{declaration, std::move(mapping)});
  }
  return table;
}

absl::StatusOr<MatrixView> RegionTable::View(
    const v1::TensorRef& ref, const std::vector<int64_t>& expected_shape,
    const std::string& field) const {
  ASSIGN_OR_RETURN(DType dtype, DTypeFromProto(ref.dtype(), field));
  const std::vector<int64_t> shape(ref.shape().begin(), ref.shape().end());
  const std::vector<int64_t> strides(ref.strides().begin(),
                                     ref.strides().end());
  RETURN_IF_ERROR(ValidateLayout(shape, strides, expected_shape, field));
  const int64_t element_size = DTypeSize(dtype);
  const std::optional<int64_t> end =
      ViewEnd(ref.byte_offset(), shape, strides, element_size);
  if (!end) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": byte_offset ", ref.byte_offset(), " + the extent of shape ",
        Shape(shape), " strides ", Shape(strides), " overflows int64"));
  }
  auto it = regions_.find(ref.region());
  if (it == regions_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": region '", Echo(ref.region()),
                     "' is not declared in the request's regions"));
  }
  const MappedRegion& region = *it->second.mapping;
  if (uint64_t(*end) > region.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": view [", ref.byte_offset(), ", ", *end,
                     ") bytes runs past region '", Echo(ref.region()), "' of ",
                     region.size(), " bytes"));
  }
  if (ref.byte_offset() % element_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": byte_offset ", ref.byte_offset(),
                     " is not a multiple of the element size ", element_size));
  }
  MatrixView view;
  view.data = static_cast<char*>(region.base()) + ref.byte_offset();
  view.dtype = dtype;
  view.rows = shape.size() == 2 ? shape[0] : 1;
  view.cols = shape.back();
  view.row_stride = shape.size() == 2 ? strides[0] : shape[0];
  return view;
}

absl::Status RegionTable::Recheck() const {
  for (const auto& [name, region] : regions_) {
    RETURN_IF_ERROR(region.mapping->CheckStillBacked(
        absl::StrCat("region '", Echo(name), "'")));
  }
  return absl::OkStatus();
}

}  // namespace muond
