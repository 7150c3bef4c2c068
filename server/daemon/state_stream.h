#pragma once
// A rank's optimizer state in ExportState / ImportState's wire form
// (proto StateChunk): entry names, chunking, and the rules an imported stream
// must keep (DaemonCore::ExportState / ImportState are the RPCs; the value
// rules are server/daemon/state_file.h's CheckStateValues).
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "muond/v1/muond.pb.h"
#include "server/daemon/registration.h"
#include "server/daemon/state_file.h"

namespace muond {

// Engine state name <-> wire entry name. The engine's
// "<group>/<param>.<suffix>" travels as "<param>.<suffix>" (param names are
// unique across a registration, so the trainer needs no group names); any
// other engine name (e.g. a group-wide "<group>/.step") travels as it is.
// Generic over the suffixes, so new state entries need no change here.
class StateEntryNames {
 public:
  explicit StateEntryNames(const Registration& reg);
  std::string ToWire(const std::string& engine_name) const;

 private:
  // "<group>/<param>" -> the length of "<group>/".
  std::unordered_map<std::string, size_t> grouped_;
};

// Sends every entry of `state` (engine names) as chunks of at most
// `chunk_values` values (an empty entry as one chunk without data) through
// `write`; false as soon as `write` returns false.
bool WriteStateChunks(const StateTensors& state, const StateEntryNames& names,
                      int64_t chunk_values,
                      const std::function<bool(const v1::StateChunk&)>& write);

// Assembles an imported stream into `state`, the copy of the current state
// whose names and sizes are the rules: each chunk names a known entry, its
// numel is the registered shard's, its data is whole fp32 values, it starts
// where the entry's previous chunk ended (so no overlap, gap or duplicate)
// and ends inside the entry; no header after the first message. Finish then
// requires every entry complete and valid values. Errors are InvalidArgument
// "ImportState: entry '<name>': <rule>". Writes only into `state`, whose
// size it never changes, so memory stays that of the registered state.
class StateAssembler {
 public:
  StateAssembler(StateTensors* state, const StateEntryNames& names);
  absl::Status Add(const v1::StateChunk& chunk);
  absl::Status Finish() const;
  size_t num_entries() const { return slots_.size(); }

 private:
  struct Slot {
    std::string engine_name;
    std::vector<float>* values = nullptr;
    int64_t filled = 0;
    bool seen = false;
  };
  std::unordered_map<std::string, Slot> slots_;  // by wire name
  std::vector<std::string> order_;               // wire names, engine order
};

}  // namespace muond
