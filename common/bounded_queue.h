// BoundedQueue: a blocking FIFO with a capacity, for hand-offs between threads
// (an item pushed with a priority may pass less urgent ones: send_order.h).
// The capacity counts items and, optionally, their cost (e.g. bytes): Push
// blocks while either is full (back-pressure; an item costlier than the whole
// budget is let in alone); Pop blocks while the queue is empty; Close wakes
// everyone and makes Pop return std::nullopt once drained.
//
//   BoundedQueue<Message> q(/*capacity=*/1024, /*max_cost=*/64 << 20);
//   q.Push(std::move(m), m_bytes);                       // producer
//   while (std::optional<Message> m = q.Pop()) { ... }   // consumer
//
// The waits have no deadline: the consumer of every queue in Tessera waits on
// nothing but its queue, so a full queue empties as fast as the consumer
// works, and an idle consumer waits for work for its whole life (Close ends
// it).
#ifndef TESSERA_COMMON_BOUNDED_QUEUE_H_
#define TESSERA_COMMON_BOUNDED_QUEUE_H_

#include <cstdint>
#include <deque>
#include <optional>

#include "absl/synchronization/mutex.h"
#include "common/send_order.h"

namespace tessera {

template <typename T>
class BoundedQueue {
 public:
  explicit BoundedQueue(size_t capacity, uint64_t max_cost = UINT64_MAX)
      : capacity_(capacity), max_cost_(max_cost) {}

  // Returns false (dropping nothing: `item` is not taken) when the queue is
  // closed.
  // `order`: where it goes (common/send_order.h); none: at the back.
  bool Push(T&& item, uint64_t cost = 0, OrderTag order = {}) {
    absl::MutexLock lock(&mu_);
    auto room = [this, cost]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return closed_ || items_.empty() ||
             (items_.size() < capacity_ && cost_ + cost <= max_cost_);
    };
    mu_.Await(absl::Condition(&room));
    if (closed_) return false;
    const size_t at = OrderedPosition(
        items_.begin(), items_.end(), order,
        [](const Entry& e) { return std::optional<OrderTag>(e.order); });
    items_.insert(items_.begin() + at, Entry{std::move(item), cost, order});
    cost_ += cost;
    return true;
  }

  std::optional<T> Pop() {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return closed_ || !items_.empty();
    };
    mu_.Await(absl::Condition(&ready));
    if (items_.empty()) return std::nullopt;
    Entry entry = std::move(items_.front());
    items_.pop_front();
    cost_ -= entry.cost;
    return std::move(entry.item);
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
  struct Entry {
    T item;
    uint64_t cost;
    OrderTag order;
  };
  const size_t capacity_;
  const uint64_t max_cost_;
  mutable absl::Mutex mu_;
  std::deque<Entry> items_ ABSL_GUARDED_BY(mu_);
  uint64_t cost_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera

#endif  // TESSERA_COMMON_BOUNDED_QUEUE_H_
