#include "core/step/lane_threads.h"

#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muond {

absl::StatusOr<std::unique_ptr<LaneThreads>> LaneThreads::Create(
    int lanes, const ThreadStarter& start_thread) {
  std::unique_ptr<LaneThreads> threads(new LaneThreads());
  for (int l = 0; l < lanes; ++l) {
    std::function<void()> loop = [t = threads.get(), l] { t->Loop(l); };
    try {
      threads->threads_.push_back(start_thread ? start_thread(std::move(loop))
                                               : std::thread(std::move(loop)));
    } catch (const std::system_error& e) {
      // std::thread reports a refused thread by throwing; an exception
      // escaping the engine build would abort the daemon.
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot start the thread of lane ", l + 1, " of ", lanes,
          " (one per group that shares no communicator or device backend "
          "with another): ",
          e.what(), "; register fewer param groups or raise the limit"));
    }
  }
  return threads;
}

LaneThreads::~LaneThreads() { Stop(); }

void LaneThreads::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
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
