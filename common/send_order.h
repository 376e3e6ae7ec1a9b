// SendOrder: where a message goes in a queue that honours priorities
// (docs/priority.md). A sealed link's sending queue and a server shard's
// queue use it; both hold whole messages, the first of which may have started.
//
//   OrderTag tag = OrderTagOf(msg.header);
//   size_t at = OrderedPosition(queue.begin(), queue.end(), tag,
//       [](const Entry& e) {
//         return e.started ? std::nullopt : std::optional(e.tag);
//       });
//   queue.insert(queue.begin() + at, std::move(entry));
//
// The rule: a message with a priority passes, from the back, the queued
// messages that have a lower priority and another key; it stops behind the
// first one that has started, has no priority (control messages, tasks: they
// keep their place), is at least as urgent (FIFO among equals), or is about
// the same key (a key's messages stay in the order they were issued: a pull
// never passes its own key's push). A message without a priority goes last.
#ifndef TESSERA_COMMON_SEND_ORDER_H_
#define TESSERA_COMMON_SEND_ORDER_H_

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "proto/tessera.pb.h"

namespace tessera {
// Priorities a request may carry: a bad one is InvalidArgument, named.
constexpr int64_t kMaxPriority = 1000000000;
constexpr int64_t kMinPriority = -kMaxPriority;
// OK, or InvalidArgument naming `what` (e.g. "priority of key 7") and the
// range.
inline absl::Status CheckPriority(int64_t priority, const char* what) {
  if (priority >= kMinPriority && priority <= kMaxPriority)
    return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, " is ", priority, ": expected an integer from ", kMinPriority,
      " to ", kMaxPriority, " (higher is more urgent)"));
}

struct OrderTag {
  bool ordered = false;  // carries a priority
  int32_t priority = 0;
  bool has_key = false;
  uint64_t key = 0;
};

// The message's priority and key (its slice's), from its header.
inline OrderTag OrderTagOf(const wire::Header& h) {
  OrderTag t;
  t.ordered = h.has_priority();
  t.priority = h.priority();
  t.has_key = h.has_slice();
  t.key = h.slice().key();
  return t;
}

// The position (from `begin`) at which a message tagged `tag` goes in the
// queue [begin, end). `tag_of(entry)`: the entry's tag, or std::nullopt when
// it has started (it is never passed).
template <typename It, typename TagOf>
size_t OrderedPosition(It begin, It end, const OrderTag& tag, TagOf tag_of) {
  size_t at = static_cast<size_t>(end - begin);
  if (!tag.ordered) return at;
  for (; at > 0; --at) {
    const std::optional<OrderTag> e = tag_of(*(begin + (at - 1)));
    if (!e.has_value() || !e->ordered || e->priority >= tag.priority ||
        (tag.has_key && e->has_key && e->key == tag.key)) {
      return at;
    }
  }
  return 0;
}

}  // namespace tessera

#endif  // TESSERA_COMMON_SEND_ORDER_H_
