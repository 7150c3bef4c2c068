#pragma once
// A small metrics registry and its Prometheus text exposition (format 0.0.4),
// shared by muond and muond-coordinator (server/README.md "Metrics" lists
// every metric). No gRPC and no HTTP here: metrics_http.h serves Render().
//
// Updates are cheap and never wait on a scrape: counters and gauges are
// atomics, a histogram takes its own short mutex (so a scrape sees its
// buckets, sum and count from the same observations). A family's series are
// created once per label set and never move, so the hot path holds a pointer
// (Family::With) and updates it without a lookup.
//
// Thread-safety: everything is thread-safe.
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace muond {

class Counter {
 public:
  // `v` must be >= 0 (a counter only goes up; negative values are ignored).
  void Increment(double v = 1);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Upper bounds (Prometheus `le`, inclusive) of a histogram's buckets,
// ascending; +Inf is implicit.
using Buckets = std::vector<double>;

// 100 us .. 60 s: the phases of a step, from a small CPU model's momentum to
// a large model's exchange over a slow network.
const Buckets& StepPhaseBuckets();

class Histogram {
 public:
  explicit Histogram(Buckets bounds);
  void Observe(double v);

  struct Snapshot {
    Buckets bounds;
    std::vector<uint64_t> counts;  // per bucket (not cumulative), +Inf last
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  const Buckets bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

enum class MetricType { kCounter, kGauge, kHistogram };

// A metric name with its label names; one series per label-value tuple.
template <typename T>
class Family {
 public:
  // The series of `values` (one per label name, in order), created at
  // zero on first use. The reference stays valid for the family's life
  // (unless Clear()ed).
  T& With(const std::vector<std::string>& values = {});
  // Drops every series (a gauge family that mirrors state which can go away,
  // e.g. the coordinator's jobs: refilled before each render).
  void Clear();

 private:
  friend class MetricsRegistry;
  Family(std::string name, std::string help, MetricType type,
         std::vector<std::string> label_names, Buckets bounds)
      : name_(std::move(name)),
        help_(std::move(help)),
        type_(type),
        label_names_(std::move(label_names)),
        bounds_(std::move(bounds)) {}
  void Render(std::string& out) const;

  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
  const Buckets bounds_;  // histograms only
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> series_
      ABSL_GUARDED_BY(mu_);
};

class MetricsRegistry {
 public:
  // Families render in the order they were added. Names and label names are
  // the caller's constants (checked in debug builds only:
  // [a-zA-Z_:][a-zA-Z0-9_:]*).
  Family<Counter>& AddCounter(std::string name, std::string help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>& AddGauge(std::string name, std::string help,
                          std::vector<std::string> label_names = {});
  Family<Histogram>& AddHistogram(std::string name, std::string help,
                                  Buckets bounds,
                                  std::vector<std::string> label_names = {});
  // Runs before every Render (in the order added): fills gauges that mirror
  // state kept elsewhere, instead of a hook at every change of that state.
  void AddCollector(std::function<void()> collect);

  // The text exposition: per family "# HELP", "# TYPE" and its series
  // (label values escaped; histograms as cumulative _bucket{le=...} with
  // +Inf, _sum and _count).
  std::string Render();

 private:
  absl::Mutex mu_;
  struct Entry {
    MetricType type;
    std::unique_ptr<Family<Counter>> counter;
    std::unique_ptr<Family<Gauge>> gauge;
    std::unique_ptr<Family<Histogram>> histogram;
  };
  std::vector<Entry> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
};

// The exposition's number format: integers as such ("3"), others in the
// shortest form that reads back exactly ("0.25", "1e-05"), "+Inf", "-Inf",
// "NaN".
std::string FormatMetricValue(double v);
// A label value with `\`, `"` and newline escaped (`\\`, `\"`, `\n`).
std::string EscapeLabelValue(absl::string_view v);

// Prometheus text format's Content-Type.
inline constexpr char kMetricsContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";

}  // namespace muond
