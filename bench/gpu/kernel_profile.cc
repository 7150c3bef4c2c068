// A per-kernel GPU time profile for any CUDA process, for hosts without nsys.
//
// Loaded by the CUDA driver as an injection library:
//
//   export MUOND_KERNEL_PROFILE=profile.md
//   export CUDA_INJECTION64_PATH=$bundle/lib/libkernel_profile.so
//   $bundle/bin/step_bench --engine ...
//
// It records every kernel, memcpy and memset through CUPTI's activity API
// (graph replays included: CUPTI reports each node's kernel) and, at exit,
// writes a markdown table to $MUOND_KERNEL_PROFILE (stderr if unset; "%p" in
// it becomes the process id, for commands that start several CUDA processes,
// which all inherit the injection): per kernel name, its launches, total and
// mean GPU time and share, plus the window's wall time, how much of it the
// GPU was busy and how many records CUPTI dropped, then the GPU's idle gaps
// by the records around them (IdleGaps). Where the process calls
// cudaProfilerStart/Stop (step_bench does, around its timed steps), only
// activity that starts inside those ranges counts; otherwise all of it. A
// forked child that exits writes nothing (its parent's records are not its).
// The table is written at exit: a daemon profiled so (no profiler range:
// everything from its start counts) must be stopped with SIGTERM, not
// killed. Needs libcupti.so.13 at run time (the CUDA toolkit's lib64, or
// torch's wheel folder site-packages/nvidia/cu13/lib on LD_LIBRARY_PATH).
#include <cupti.h>
#include <cxxabi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "bench/gpu/kernel_name.h"

namespace {

struct Interval {
  uint64_t start, end;
  const std::string* name;  // State::names' entry
};

struct State {
  std::mutex mu;
  std::vector<Interval> activity;
  // Short names by CUPTI's name pointer (stable for a function: a kernel is
  // demangled once, not per launch) and by the copies' own labels; a map's
  // entries never move, so intervals point into it.
  std::map<const void*, std::string> names;
  size_t dropped = 0;  // records CUPTI had no buffer for
  pid_t pid = 0;       // the process that loaded the library
  // cudaProfilerStart/Stop ranges: [begin, end); end == 0 while open.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
};

State& Global() {
  static State* state = new State;  // never destroyed: used from atexit
  return *state;
}

constexpr size_t kBufferBytes = 8 << 20;

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size,
                              size_t* max_records) {
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

// Demangled, then shortened by ShortKernelName (kernel_name.h).
std::string ShortName(const char* mangled) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : mangled;
  std::free(demangled);
  return muond::bench::ShortKernelName(name);
}

const char* MemcpyName(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "[memcpy HtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "[memcpy DtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "[memcpy DtoD]";
    default:
      return "[memcpy other]";
  }
}

// The interned short name of a kernel (its mangled name) or of a copy (its
// label, taken as it is). Called with State::mu held.
const std::string* NameOf(State& s, const char* name, bool kernel) {
  auto [it, fresh] = s.names.try_emplace(name);
  if (fresh) it->second = kernel ? ShortName(name) : std::string(name);
  return &it->second;
}

void CUPTIAPI BufferCompleted(CUcontext context, uint32_t stream_id,
                              uint8_t* buffer, size_t, size_t valid) {
  State& s = Global();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    CUpti_Activity* record = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) ==
           CUPTI_SUCCESS) {
      switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(record);
          s.activity.push_back({k->start, k->end, NameOf(s, k->name, true)});
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(record);
          s.activity.push_back(
              {m->start, m->end, NameOf(s, MemcpyName(m->copyKind), false)});
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
          auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(record);
          s.activity.push_back(
              {m->start, m->end, NameOf(s, "[memset]", false)});
          break;
        }
        default:
          break;
      }
    }
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(context, stream_id, &dropped);
    s.dropped += dropped;
  }
  std::free(buffer);
}

void CUPTIAPI OnDriverApi(void*, CUpti_CallbackDomain, CUpti_CallbackId id,
                          const void* data) {
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  uint64_t now = 0;
  cuptiGetTimestamp(&now);
  State& s = Global();
  std::lock_guard<std::mutex> lock(s.mu);
  if (id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStart &&
      info->callbackSite == CUPTI_API_EXIT) {
    s.ranges.push_back({now, 0});
  } else if (id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStop &&
             info->callbackSite == CUPTI_API_ENTER && !s.ranges.empty() &&
             s.ranges.back().second == 0) {
    s.ranges.back().second = now;
  }
}

// The profiler range holding t (0 without ranges; -1 outside them).
int RangeOf(const State& s, uint64_t t) {
  if (s.ranges.empty()) return 0;
  for (size_t k = 0; k < s.ranges.size(); ++k) {
    const auto& [begin, end] = s.ranges[k];
    if (t >= begin && (end == 0 || t < end)) return int(k);
  }
  return -1;
}

bool InRanges(const State& s, uint64_t t) { return RangeOf(s, t) >= 0; }

// Busy time: the union of the intervals (streams may overlap).
uint64_t BusyNs(std::vector<Interval> v) {
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) {
    return a.start < b.start;
  });
  uint64_t busy = 0, cur_start = 0, cur_end = 0;
  for (const auto& i : v) {
    if (i.start > cur_end) {
      busy += cur_end - cur_start;
      cur_start = i.start;
      cur_end = i.end;
    } else {
      cur_end = std::max(cur_end, i.end);
    }
  }
  return busy + (cur_end - cur_start);
}

// Where the GPU idles: every gap of at least kMinGapNs between the end of
// the activity so far and the next record's start within one profiler
// range (what runs between ranges is not profiled, so no gap spans two),
// summed by the pair of records around it ("previous -> next"), largest
// total first. A gap inside a step is host work the GPU waits for (a sync,
// the votes, a launch); the gaps between steps show as the last kernel of a
// step before the first.
constexpr uint64_t kMinGapNs = 5000;
struct Gap {
  uint64_t count = 0, ns = 0;
};
std::vector<std::pair<std::string, Gap>> IdleGaps(const State& s,
                                                  std::vector<Interval> v) {
  // Stable: records that start together keep CUPTI's order.
  std::stable_sort(
      v.begin(), v.end(),
      [](const Interval& a, const Interval& b) { return a.start < b.start; });
  std::map<std::string, Gap> gaps;
  uint64_t cur_end = 0;
  const std::string* before = nullptr;
  int range = -1;
  for (const auto& i : v) {
    if (const int r = RangeOf(s, i.start); r != range) {
      range = r;
      before = nullptr;  // a new range: no gap from the last one's end
      cur_end = 0;
    }
    if (before != nullptr && i.start >= cur_end + kMinGapNs) {
      Gap& g = gaps[*before + " -> " + *i.name];
      ++g.count;
      g.ns += i.start - cur_end;
    }
    if (i.end >= cur_end) {
      cur_end = i.end;
      before = i.name;
    }
  }
  std::vector<std::pair<std::string, Gap>> sorted(gaps.begin(), gaps.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return a.second.ns > b.second.ns;
  });
  return sorted;
}

// $MUOND_KERNEL_PROFILE with "%p" replaced by the process id.
std::string ReportPath() {
  const char* env = std::getenv("MUOND_KERNEL_PROFILE");
  std::string path = env ? env : "";
  for (size_t at; (at = path.find("%p")) != std::string::npos;)
    path.replace(at, 2, std::to_string(getpid()));
  return path;
}

void Report() {
  if (getpid() != Global().pid) return;  // a forked child
  cuptiActivityFlushAll(1);
  State& s = Global();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<Interval> kept;
  for (const auto& i : s.activity)
    if (InRanges(s, i.start)) kept.push_back(i);
  struct Row {
    uint64_t count = 0, ns = 0;
  };
  std::map<std::string, Row> rows;
  uint64_t total = 0, first = UINT64_MAX, last = 0;
  for (const auto& i : kept) {
    Row& r = rows[*i.name];
    ++r.count;
    r.ns += i.end - i.start;
    total += i.end - i.start;
    first = std::min(first, i.start);
    last = std::max(last, i.end);
  }
  std::vector<std::pair<std::string, Row>> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return a.second.ns > b.second.ns;
  });
  const std::string path = ReportPath();
  FILE* f = path.empty() ? stderr : std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "kernel_profile: cannot write %s\n", path.c_str());
    f = stderr;
  }
  const double wall_ms = kept.empty() ? 0 : (last - first) / 1e6;
  const double busy_ms = BusyNs(kept) / 1e6;
  std::fprintf(f,
               "GPU activity: %zu records in %zu profiler range(s); window "
               "%.3f ms, GPU busy %.3f ms (%.1f%%); %zu records dropped in the "
               "whole run\n\n",
               kept.size(), s.ranges.size(), wall_ms, busy_ms,
               wall_ms > 0 ? 100.0 * busy_ms / wall_ms : 0.0, s.dropped);
  std::fprintf(f, "| kernel | launches | total ms | mean us | share |\n");
  std::fprintf(f, "|---|---|---|---|---|\n");
  for (const auto& [name, r] : sorted) {
    std::fprintf(f, "| %s | %llu | %.3f | %.2f | %.1f%% |\n", name.c_str(),
                 static_cast<unsigned long long>(r.count), r.ns / 1e6,
                 r.ns / 1e3 / r.count, total ? 100.0 * r.ns / total : 0.0);
  }
  const auto gaps = IdleGaps(s, kept);
  std::fprintf(f,
               "\nGPU idle gaps of %.0f us or more, by the records around "
               "them (largest total first, at most 20):\n\n| before -> after "
               "| gaps | total ms | mean us |\n|---|---|---|---|\n",
               kMinGapNs / 1e3);
  for (size_t k = 0; k < gaps.size() && k < 20; ++k) {
    const auto& [pair, g] = gaps[k];
    std::fprintf(f, "| %s | %llu | %.3f | %.1f |\n", pair.c_str(),
                 static_cast<unsigned long long>(g.count), g.ns / 1e6,
                 g.ns / 1e3 / g.count);
  }
  if (f != stderr) std::fclose(f);
}

bool Ok(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return true;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_profile: %s failed: %s\n", what,
               msg ? msg : "?");
  return false;
}

}  // namespace

// The CUDA driver calls this once, at cuInit, in a process started with
// CUDA_INJECTION64_PATH naming this library.
extern "C" int InitializeInjection(void) {
  Global().pid = getpid();
  if (!Ok(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted),
          "cuptiActivityRegisterCallbacks"))
    return 0;
  for (CUpti_ActivityKind kind :
       {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
        CUPTI_ACTIVITY_KIND_MEMSET}) {
    if (!Ok(cuptiActivityEnable(kind), "cuptiActivityEnable")) return 0;
  }
  CUpti_SubscriberHandle subscriber;
  if (Ok(cuptiSubscribe(&subscriber,
                        reinterpret_cast<CUpti_CallbackFunc>(OnDriverApi),
                        nullptr),
         "cuptiSubscribe")) {
    Ok(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API,
                           CUPTI_DRIVER_TRACE_CBID_cuProfilerStart),
       "cuptiEnableCallback(cuProfilerStart)");
    Ok(cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API,
                           CUPTI_DRIVER_TRACE_CBID_cuProfilerStop),
       "cuptiEnableCallback(cuProfilerStop)");
  }
  std::atexit(Report);
  return 1;
}
