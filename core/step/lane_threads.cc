#include "core/step/lane_threads.h"

namespace muond {

LaneThreads::LaneThreads(int lanes) {
  for (int l = 0; l < lanes; ++l) threads_.emplace_back([this, l] { Loop(l); });
}

LaneThreads::~LaneThreads() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

void LaneThreads::Run(const std::function<void(int)>& work) {
  absl::MutexLock lock(&mu_);
  work_ = &work;
  running_ = int(threads_.size());
  ++generation_;
  changed_.SignalAll();
  while (running_ > 0) changed_.Wait(&mu_);
  work_ = nullptr;
}

void LaneThreads::Loop(int lane) {
  int64_t done = 0;  // the generation this thread ran last
  while (true) {
    const std::function<void(int)>* work;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && generation_ == done) changed_.Wait(&mu_);
      if (stop_) return;
      done = generation_;
      work = work_;
    }
    (*work)(lane);
    absl::MutexLock lock(&mu_);
    if (--running_ == 0) changed_.SignalAll();
  }
}

}  // namespace muond
