// BoundedQueue: a blocking FIFO with a capacity, for hand-offs between threads.
// Push blocks while the queue is full (back-pressure); Pop blocks while it is
// empty; Close wakes everyone and makes Pop return std::nullopt once drained.
//
//   BoundedQueue<Message> q(1024);
//   q.Push(std::move(m));                        // producer
//   while (std::optional<Message> m = q.Pop()) { ... }   // consumer
#ifndef TESSERA_COMMON_BOUNDED_QUEUE_H_
#define TESSERA_COMMON_BOUNDED_QUEUE_H_

#include <deque>
#include <optional>

#include "absl/synchronization/mutex.h"

namespace tessera {

template <typename T>
class BoundedQueue {
 public:
  explicit BoundedQueue(size_t capacity) : capacity_(capacity) {}

  // Returns false (dropping nothing: `item` is not taken) when the queue is
  // closed.
  bool Push(T&& item) {
    absl::MutexLock lock(&mu_);
    auto room = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return closed_ || items_.size() < capacity_;
    };
    mu_.Await(absl::Condition(&room));
    if (closed_) return false;
    items_.push_back(std::move(item));
    return true;
  }

  std::optional<T> Pop() {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return closed_ || !items_.empty();
    };
    mu_.Await(absl::Condition(&ready));
    if (items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

  size_t size() const {
    absl::MutexLock lock(&mu_);
    return items_.size();
  }

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<T> items_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_BOUNDED_QUEUE_H_
