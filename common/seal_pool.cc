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
}

void SealPool::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    queue_.clear();
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
      mu_.Await(absl::Condition(
          +[](SealPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stopped_ || !p->queue_.empty();
          },
          this));
      --idle_;
      if (stopped_) return;
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

}  // namespace tessera::zmq_internal
