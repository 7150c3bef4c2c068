#pragma once
// The memory regions of one registration (docs/ARCHITECTURE.md "Memory
// registration"), modelled on Triton Inference Server's shared-memory
// regions: the trainer declares each region once in RegisterParamsRequest
// (kind, shm name or CUDA IPC handle, byte size, device), the daemon maps
// each once, and every TensorRef names a region plus a byte offset, dtype,
// shape and strides that View checks against that region before any byte is
// touched. The table owns the mappings; views into it stay valid while it
// lives.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/matrix_view.h"
#include "muond/v1/muond.pb.h"
#include "server/daemon/memory_mapper.h"

namespace muond {

// The longest name (region, group, param, domain, client) a registration
// accepts; longer ones are refused naming the field, so no error message
// has to carry a 60 MB name.
inline constexpr size_t kMaxNameBytes = 1024;
// The largest region byte_size (2^48: 256 TiB, above any real allocation);
// keeps byte arithmetic on regions far from overflow.
inline constexpr uint64_t kMaxRegionBytes = uint64_t{1} << 48;

// InvalidArgument "<field> is N bytes; at most kMaxNameBytes" when too long.
absl::Status CheckNameLength(const std::string& name, const std::string& field);

class RegionTable {
 public:
  using Declarations = google::protobuf::RepeatedPtrField<v1::MemoryRegion>;

  // Validates and maps every declared region, all or nothing (on an error
  // nothing stays mapped). Errors name the region ("region 'r0'", or
  // "regions[i]" while it has no name) and the rule: InvalidArgument for an
  // empty, repeated or too long (> kMaxNameBytes) name, a kind other than
  // MEMORY_KIND_HOST_SHM / MEMORY_KIND_CUDA_IPC, byte_size 0 or above
  // kMaxRegionBytes, MEMORY_KIND_HOST_SHM without shm_name, the same shm
  // object (by name, or by inode: a hard link) or CUDA IPC handle as an
  // earlier region; else the HandleOpener's error (NotFound for a missing shm
  // object, PermissionDenied for another user's, FailedPrecondition for
  // MEMORY_KIND_CUDA_IPC on a host-mode daemon, ...).
  static absl::StatusOr<RegionTable> Map(const Declarations& declarations,
                                         HandleOpener& opener);

  RegionTable() = default;
  RegionTable(RegionTable&&) = default;
  RegionTable& operator=(RegionTable&&) = default;

  // The view `ref` describes, in elements of its dtype (rows = 1 for 1-D).
  // InvalidArgument naming `field` (e.g. "param 'w' grad") and the rule for:
  // an unknown dtype; shape different from `expected_shape`; strides not one
  // per dim, innermost stride != 1, rows overlapping (row stride < row
  // length); offset + extent overflowing int64; a region not declared; a view
  // running past its region's byte_size; an offset not a multiple of the
  // element size.
  absl::StatusOr<MatrixView> View(const v1::TensorRef& ref,
                                  const std::vector<int64_t>& expected_shape,
                                  const std::string& field) const;

  size_t size() const { return regions_.size(); }

  // OK while every region's memory still covers its byte_size (one fstat per
  // shm region: MappedRegion::CheckStillBacked). FailedPrecondition naming
  // the region, the object and both sizes otherwise.
  absl::Status Recheck() const;

 private:
  struct Region {
    v1::MemoryRegion declaration;
    std::unique_ptr<MappedRegion> mapping;
  };

  std::map<std::string, Region> regions_;  // by MemoryRegion.name
};

}  // namespace muond
