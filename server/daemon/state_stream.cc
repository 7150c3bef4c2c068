#include "server/daemon/state_stream.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

// StateChunk.data is little-endian fp32, copied as the host's bytes.
static_assert(std::endian::native == std::endian::little,
              "StateChunk data is little-endian fp32");

absl::Status BadEntry(const std::string& entry, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("ImportState: entry '", entry.substr(0, 256), "': ", why));
}

}  // namespace

StateEntryNames::StateEntryNames(const Registration& reg) {
  for (const BoundGroup& g : reg.groups) {
    for (const BoundParam& p : g.params) {
      grouped_[absl::StrCat(g.proto.name(), "/", p.name)] =
          g.proto.name().size() + 1;
    }
  }
}

std::string StateEntryNames::ToWire(const std::string& engine_name) const {
  // Suffixes have no '.', param names may.
  const size_t dot = engine_name.rfind('.');
  if (dot == std::string::npos) return engine_name;
  auto it = grouped_.find(engine_name.substr(0, dot));
  if (it == grouped_.end()) return engine_name;
  return engine_name.substr(it->second);
}

bool WriteStateChunks(const StateTensors& state, const StateEntryNames& names,
                      int64_t chunk_values,
                      const std::function<bool(const v1::StateChunk&)>& write) {
  v1::StateChunk chunk;
  for (const auto& [engine_name, values] : state) {
    chunk.set_entry(names.ToWire(engine_name));
    const int64_t numel = int64_t(values.size());
    chunk.set_numel(numel);
    int64_t offset = 0;
    do {
      const int64_t n = std::min(chunk_values, numel - offset);
      chunk.set_offset(offset);
      chunk.set_data(reinterpret_cast<const char*>(values.data() + offset),
                     size_t(n) * sizeof(float));
      if (!write(chunk)) return false;
      offset += n;
    } while (offset < numel);
  }
  return true;
}

StateAssembler::StateAssembler(StateTensors* state,
                               const StateEntryNames& names) {
  for (auto& [engine_name, values] : *state) {
    std::string wire = names.ToWire(engine_name);
    order_.push_back(wire);
    slots_[std::move(wire)] = Slot{engine_name, &values};
  }
}

absl::Status StateAssembler::Add(const v1::StateChunk& chunk) {
  if (chunk.has_header()) {
    return absl::InvalidArgumentError(
        "ImportState: a second header (only the stream's first message "
        "carries one)");
  }
  if (chunk.entry().empty()) {
    return absl::InvalidArgumentError(
        "ImportState: a chunk without an entry name");
  }
  auto it = slots_.find(chunk.entry());
  if (it == slots_.end()) {
    return BadEntry(chunk.entry(), "no registered param of this rank has it");
  }
  Slot& slot = it->second;
  const int64_t numel = int64_t(slot.values->size());
  if (chunk.numel() != numel) {
    return BadEntry(chunk.entry(),
                    absl::StrCat("numel ", chunk.numel(),
                                 ", but the registered shard has ", numel));
  }
  if (chunk.data().size() % sizeof(float) != 0) {
    return BadEntry(chunk.entry(),
                    absl::StrCat("data of ", chunk.data().size(),
                                 " bytes is not whole fp32 values"));
  }
  if (slot.seen && slot.filled == numel) {
    return BadEntry(chunk.entry(), "sent twice (it is already complete)");
  }
  const int64_t n = int64_t(chunk.data().size() / sizeof(float));
  if (chunk.offset() != slot.filled) {
    return BadEntry(chunk.entry(),
                    absl::StrCat("chunk at offset ", chunk.offset(),
                                 ", expected ", slot.filled,
                                 " (an entry's chunks come in order, "
                                 "without gaps or overlaps)"));
  }
  if (n > numel - slot.filled) {
    return BadEntry(chunk.entry(),
                    absl::StrCat("chunk of ", n, " values at offset ",
                                 chunk.offset(), " runs past numel ", numel));
  }
  std::memcpy(slot.values->data() + slot.filled, chunk.data().data(),
              chunk.data().size());
  slot.filled += n;
  slot.seen = true;
  return absl::OkStatus();
}

absl::Status StateAssembler::Finish() const {
  for (const std::string& wire : order_) {
    const Slot& slot = slots_.at(wire);
    if (!slot.seen) {
      return BadEntry(wire,
                      "missing (every entry of the registered params must "
                      "arrive)");
    }
    if (slot.filled != int64_t(slot.values->size())) {
      return BadEntry(wire,
                      absl::StrCat("incomplete: ", slot.filled, " of ",
                                   slot.values->size(), " values arrived"));
    }
    RETURN_IF_ERROR(
        CheckStateValues("ImportState", slot.engine_name, wire, *slot.values));
  }
  return absl::OkStatus();
}

}  // namespace muond
