// The GPU's SM clock and board power, read through NVML while a timed loop
// runs, so that a kernel bench can say what each column drew. Why: a GEMM
// that keeps the tensor cores busy for longer than a few milliseconds runs at
// the board's power limit (700 W on an H100 SXM), below its boost clock, so a
// kernel's sustained time is its energy per product over that limit; two
// kernels can trade places between a short run (boost clock) and a long one.
//
// NVML is loaded at run time from the driver (libnvidia-ml.so.1), so the
// binaries need neither its header nor its library to build; where it is
// missing, Available() is false and nothing is sampled.
#ifndef MUOND_BENCH_GPU_POWER_SAMPLER_H_
#define MUOND_BENCH_GPU_POWER_SAMPLER_H_

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace muond {
namespace bench {

// The medians of the samples taken; `samples` 0 when none were.
struct PowerReading {
  int samples = 0;
  double sm_mhz = 0;
  double watts = 0;
  // The energy counter's difference over the timed launches, divided by
  // their count; -1 where the counter is missing.
  double mj_per_launch = -1;
};

class PowerSampler {
 public:
  // `pci_bus_id`: the CUDA device's (cudaDeviceGetPCIBusId), since NVML's
  // device order need not be CUDA's.
  explicit PowerSampler(const char* pci_bus_id) {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;
    auto init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    auto by_pci = reinterpret_cast<int (*)(const char*, void**)>(
        dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    clock_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(
        dlsym(lib, "nvmlDeviceGetClockInfo"));
    power_ = reinterpret_cast<int (*)(void*, unsigned*)>(
        dlsym(lib, "nvmlDeviceGetPowerUsage"));
    // Optional: the board's energy counter (Volta and later). It refreshes
    // every ~10 ms or so, where the power reading is a ~1 s average, so over
    // a window of seconds it gives the energy to within a fraction of 1%.
    energy_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(
        dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    if (init == nullptr || by_pci == nullptr || clock_ == nullptr ||
        power_ == nullptr || init() != 0 || by_pci(pci_bus_id, &device_) != 0) {
      device_ = nullptr;
    }
  }

  bool Available() const { return device_ != nullptr; }

  // One sample into the current window (no-op without NVML).
  void Sample() {
    unsigned mhz = 0, milliwatts = 0;
    if (!Available() || clock_(device_, kNvmlClockSm, &mhz) != 0 ||
        power_(device_, &milliwatts) != 0) {
      return;
    }
    mhz_.push_back(mhz);
    watts_.push_back(milliwatts / 1000.0);
  }

  // The board's energy counter in millijoules since the driver loaded, or -1
  // where NVML or the counter is missing. The difference of two readings is
  // the energy drawn between them.
  double EnergyMillijoules() const {
    unsigned long long mj = 0;
    if (!Available() || energy_ == nullptr || energy_(device_, &mj) != 0) {
      return -1;
    }
    return double(mj);
  }

  // The energy a launch over `launches` launches, from the counter's readings
  // before and after them (EnergyMillijoules); -1 where either is missing or
  // the counter did not tick between them (a run too short to say).
  static double PerLaunch(double mj_before, double mj_after, int64_t launches) {
    if (mj_before < 0 || mj_after <= mj_before || launches < 1) return -1;
    return (mj_after - mj_before) / double(launches);
  }

  // The window's medians; starts the next window.
  PowerReading Take() {
    PowerReading r;
    r.samples = int(mhz_.size());
    if (r.samples > 0) {
      r.sm_mhz = Median(&mhz_);
      r.watts = Median(&watts_);
    }
    mhz_.clear();
    watts_.clear();
    return r;
  }

 private:
  static constexpr int kNvmlClockSm = 1;  // NVML_CLOCK_SM

  static double Median(std::vector<double>* v) {
    std::nth_element(v->begin(), v->begin() + v->size() / 2, v->end());
    return (*v)[v->size() / 2];
  }

  void* device_ = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
  int (*power_)(void*, unsigned*) = nullptr;
  int (*energy_)(void*, unsigned long long*) = nullptr;
  std::vector<double> mhz_, watts_;
};

}  // namespace bench
}  // namespace muond

#endif  // MUOND_BENCH_GPU_POWER_SAMPLER_H_
