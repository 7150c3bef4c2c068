#include "server/common/metrics.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace muond {

void Counter::Increment(double v) {
  if (!(v >= 0)) return;  // NaN too
  value_.fetch_add(v, std::memory_order_relaxed);
}

void Gauge::Add(double v) { value_.fetch_add(v, std::memory_order_relaxed); }

const Buckets& StepPhaseBuckets() {
  static const Buckets* const buckets = new Buckets{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
  return *buckets;
}

Histogram::Histogram(Buckets bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  // The first bucket whose bound is >= v (`le` is inclusive); NaN lands in
  // +Inf, as in the reference client.
  size_t i = 0;
  while (i < bounds_.size() && !(v <= bounds_[i])) ++i;
  absl::MutexLock lock(&mu_);
  ++counts_[i];
  sum_ += v;
  ++count_;
}

Histogram::Snapshot Histogram::snapshot() const {
  absl::MutexLock lock(&mu_);
  return {bounds_, counts_, sum_, count_};
}

template <typename T>
T& Family<T>::With(const std::vector<std::string>& values) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<T>& slot = series_[values];
  if (slot == nullptr) {
    if constexpr (std::is_same_v<T, Histogram>) {
      slot = std::make_unique<Histogram>(bounds_);
    } else {
      slot = std::make_unique<T>();
    }
  }
  return *slot;
}

template <typename T>
void Family<T>::Clear() {
  absl::MutexLock lock(&mu_);
  series_.clear();
}

namespace {

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// HELP text escapes `\` and newline only (the format's rule).
std::string EscapeHelp(absl::string_view help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"}` of `names` = `values` plus an optional extra pair (a
// histogram's le); empty without labels.
std::string LabelText(const std::vector<std::string>& names,
                      const std::vector<std::string>& values,
                      absl::string_view extra_name = "",
                      absl::string_view extra_value = "") {
  std::string out;
  for (size_t i = 0; i < names.size() && i < values.size(); ++i) {
    absl::StrAppend(&out, out.empty() ? "" : ",", names[i], "=\"",
                    EscapeLabelValue(values[i]), "\"");
  }
  if (!extra_name.empty()) {
    absl::StrAppend(&out, out.empty() ? "" : ",", extra_name, "=\"",
                    extra_value, "\"");
  }
  return out.empty() ? out : absl::StrCat("{", out, "}");
}

void RenderSeries(std::string& out, const std::string& name,
                  const std::vector<std::string>& names,
                  const std::vector<std::string>& values, const Counter& c) {
  absl::StrAppend(&out, name, LabelText(names, values), " ",
                  FormatMetricValue(c.value()), "\n");
}

void RenderSeries(std::string& out, const std::string& name,
                  const std::vector<std::string>& names,
                  const std::vector<std::string>& values, const Gauge& g) {
  absl::StrAppend(&out, name, LabelText(names, values), " ",
                  FormatMetricValue(g.value()), "\n");
}

void RenderSeries(std::string& out, const std::string& name,
                  const std::vector<std::string>& names,
                  const std::vector<std::string>& values, const Histogram& h) {
  const Histogram::Snapshot s = h.snapshot();
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= s.bounds.size(); ++i) {
    cumulative += s.counts[i];
    const std::string le =
        i < s.bounds.size() ? FormatMetricValue(s.bounds[i]) : "+Inf";
    absl::StrAppend(&out, name, "_bucket", LabelText(names, values, "le", le),
                    " ", cumulative, "\n");
  }
  absl::StrAppend(&out, name, "_sum", LabelText(names, values), " ",
                  FormatMetricValue(s.sum), "\n");
  absl::StrAppend(&out, name, "_count", LabelText(names, values), " ", s.count,
                  "\n");
}

}  // namespace

template <typename T>
void Family<T>::Render(std::string& out) const {
  absl::StrAppend(&out, "# HELP ", name_, " ", EscapeHelp(help_), "\n");
  absl::StrAppend(&out, "# TYPE ", name_, " ", TypeName(type_), "\n");
  absl::MutexLock lock(&mu_);
  for (const auto& [values, series] : series_) {
    RenderSeries(out, name_, label_names_, values, *series);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Family<Counter>& MetricsRegistry::AddCounter(
    std::string name, std::string help, std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  Entry e{MetricType::kCounter, {}, {}, {}};
  e.counter.reset(new Family<Counter>(std::move(name), std::move(help),
                                      MetricType::kCounter,
                                      std::move(label_names), {}));
  Family<Counter>& f = *e.counter;
  families_.push_back(std::move(e));
  return f;
}

Family<Gauge>& MetricsRegistry::AddGauge(std::string name, std::string help,
                                         std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  Entry e{MetricType::kGauge, {}, {}, {}};
  e.gauge.reset(new Family<Gauge>(std::move(name), std::move(help),
                                  MetricType::kGauge, std::move(label_names),
                                  {}));
  Family<Gauge>& f = *e.gauge;
  families_.push_back(std::move(e));
  return f;
}

Family<Histogram>& MetricsRegistry::AddHistogram(
    std::string name, std::string help, Buckets bounds,
    std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  Entry e{MetricType::kHistogram, {}, {}, {}};
  e.histogram.reset(new Family<Histogram>(
      std::move(name), std::move(help), MetricType::kHistogram,
      std::move(label_names), std::move(bounds)));
  Family<Histogram>& f = *e.histogram;
  families_.push_back(std::move(e));
  return f;
}

void MetricsRegistry::AddCollector(std::function<void()> collect) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collect));
}

std::string MetricsRegistry::Render() {
  absl::MutexLock lock(&mu_);
  for (const std::function<void()>& collect : collectors_) collect();
  std::string out;
  for (const Entry& e : families_) {
    switch (e.type) {
      case MetricType::kCounter:
        e.counter->Render(out);
        break;
      case MetricType::kGauge:
        e.gauge->Render(out);
        break;
      case MetricType::kHistogram:
        e.histogram->Render(out);
        break;
    }
  }
  return out;
}

std::string FormatMetricValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Integers below 2^53 exactly, without an exponent (byte counters); the
  // rest as %g would write them, with the fewest digits that read back.
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  char buf[64];
  const std::to_chars_result r =
      std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::general);
  return std::string(buf, r.ptr);
}

std::string EscapeLabelValue(absl::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace muond
