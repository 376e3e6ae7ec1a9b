#include "common/seal_pool.h"

#include <pthread.h>

#include <utility>

namespace tessera::zmq_internal {

void SealPool::Schedule(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  queue_.push_back(std::move(work));
  if (workers_.size() < static_cast<size_t>(threads_) && idle_ == 0) {
    workers_.emplace_back([this] { Run(); });
  }
  work_came_.Signal();
}

void SealPool::ScheduleAfter(absl::Duration delay, std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  timed_.emplace(absl::Now() + delay, std::move(work));
  // Some thread must be there to wait for it.
  if (workers_.empty()) workers_.emplace_back([this] { Run(); });
  // Every idle thread waits for the earliest due work: one that waits for
  // a later one must look again.
  work_came_.SignalAll();
}

void SealPool::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    queue_.clear();
    timed_.clear();
    work_came_.SignalAll();
  }
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void SealPool::Run() {
  // A thread started from ZeroMQ's I/O thread would keep its name.
  pthread_setname_np(pthread_self(), "tessera-seal");
  while (true) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      ++idle_;
      while (!stopped_ && work == nullptr) {
        if (!queue_.empty()) {
          work = std::move(queue_.front());
          queue_.pop_front();
        } else if (!timed_.empty() && timed_.begin()->first <= absl::Now()) {
          work = std::move(timed_.begin()->second);
          timed_.erase(timed_.begin());
        } else {
          work_came_.WaitWithDeadline(&mu_, timed_.empty()
                                                ? absl::InfiniteFuture()
                                                : timed_.begin()->first);
        }
      }
      --idle_;
      if (stopped_) return;
    }
    work();
  }
}

}  // namespace tessera::zmq_internal
