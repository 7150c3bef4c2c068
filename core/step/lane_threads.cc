#include "core/step/lane_threads.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muond {

int LaneWorkerCount(int lanes, int requested) {
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  const int wanted =
      requested > 0 ? requested : std::min(cores, kMaxLaneWorkers);
  return std::max(1, std::min(lanes, wanted));
}

absl::StatusOr<std::unique_ptr<LaneThreads>> LaneThreads::Create(
    int lanes, int workers, const ThreadStarter& start_thread) {
  std::unique_ptr<LaneThreads> threads(new LaneThreads(lanes));
  for (int w = 0; w < workers; ++w) {
    std::function<void()> loop = [t = threads.get()] { t->Loop(); };
    try {
      threads->threads_.push_back(start_thread ? start_thread(std::move(loop))
                                               : std::thread(std::move(loop)));
    } catch (const std::system_error& e) {
      // std::thread reports a refused thread by throwing; an exception
      // escaping the engine build would abort the daemon.
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot start worker thread ", w + 1, " of ", workers, " for ", lanes,
          " lanes (groups that share no communicator or device backend run "
          "concurrently): ",
          e.what(),
          "; set fewer lane workers (StepOptions::lane_workers) or raise the "
          "thread limit"));
    }
  }
  return threads;
}

LaneThreads::~LaneThreads() { Stop(); }

void LaneThreads::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  changed_.notify_all();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void LaneThreads::Run(const std::function<void(int)>& work) {
  std::unique_lock<std::mutex> lock(mu_);
  work_ = &work;
  next_lane_ = 0;
  unfinished_ = lanes_;
  changed_.notify_all();
  changed_.wait(lock, [&] { return unfinished_ == 0; });
  work_ = nullptr;
}

void LaneThreads::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    changed_.wait(lock, [&] { return stop_ || next_lane_ < lanes_; });
    if (stop_) return;
    const int lane = next_lane_++;
    const std::function<void(int)>* work = work_;
    lock.unlock();
    (*work)(lane);
    lock.lock();
    if (--unfinished_ == 0) changed_.notify_all();
  }
}

}  // namespace muond
