#include "server/delivery.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"

namespace tessera {

uint64_t WaitingMessages::SizeOf(const Message& msg) {
  uint64_t bytes = 0;
  for (const Buffer& b : msg.data) bytes += b.size();
  return bytes;
}

bool WaitingMessages::HasWaiting(int sender) const {
  for (const Message& m : messages_) {
    if (m.header.sender() == sender) return true;
  }
  return false;
}

bool WaitingMessages::Holds(int sender, uint64_t request_id,
                            uint64_t generation) const {
  for (const Message& m : messages_) {
    if (m.header.sender() == sender && m.header.request_id() == request_id &&
        m.header.generation() == generation) {
      return true;
    }
  }
  return false;
}

absl::Status WaitingMessages::Hold(uint64_t key, Message& msg) {
  const int sender = msg.header.sender();
  size_t from_sender = 0;
  for (const Message& m : messages_) from_sender += m.header.sender() == sender;
  const uint64_t size = SizeOf(msg);
  if (from_sender >= limits_.max_messages_per_sender) {
    return absl::ResourceExhaustedError(
        absl::StrCat("key ", key, ": node ", sender, " already has ",
                     from_sender, " requests waiting on this server (at most ",
                     limits_.max_messages_per_sender,
                     "); is it running far ahead of the other workers?"));
  }
  if (bytes_ + size > limits_.max_bytes && !messages_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "key ", key, ": ", bytes_,
        " bytes of requests already wait on this "
        "server; ",
        size, " more would pass the limit of ", limits_.max_bytes));
  }
  bytes_ += size;
  messages_.push_back(std::move(msg));
  return absl::OkStatus();
}

size_t WaitingMessages::DropEarlierLives(int sender, uint64_t generation) {
  const size_t before = messages_.size();
  std::erase_if(messages_, [&](const Message& m) {
    if (m.header.sender() != sender || m.header.generation() >= generation)
      return false;
    bytes_ -= SizeOf(m);
    return true;
  });
  return before - messages_.size();
}

void WaitingMessages::Replay(const std::function<bool(Message&)>& try_process) {
  // Most calls find nothing waiting; an empty std::deque still allocates.
  if (messages_.empty()) return;
  std::deque<Message> offered;
  offered.swap(messages_);
  bytes_ = 0;
  // Behind a sender's first declined message, only its pushes numbered below
  // that message's push_seq are still offered: they were sent before it, and
  // it may wait for them (a pull for the pushes it follows, a push that
  // overtook its predecessors for them: a restarted server holds a push that
  // a worker resent before it learned of the restart ahead of the replayed
  // ones). Everything else of the sender waits behind it, in order.
  std::map<int, uint64_t> below;
  while (!offered.empty()) {
    Message m = std::move(offered.front());
    offered.pop_front();
    const int sender = m.header.sender();
    const wire::Command cmd = m.header.command();
    const bool is_push = cmd == wire::KV_PUSH || cmd == wire::KV_PUSHPULL;
    auto declined = below.find(sender);
    const bool offer = declined == below.end() ||
                       (is_push && m.header.push_seq() < declined->second);
    if (offer && try_process(m)) continue;
    if (offer) {
      // A later declined push only narrows what may pass.
      const uint64_t bound =
          is_push || cmd == wire::KV_PULL ? m.header.push_seq() : 0;
      if (declined == below.end()) {
        below.emplace(sender, bound);
      } else {
        declined->second = std::min(declined->second, bound);
      }
    }
    bytes_ += SizeOf(m);
    messages_.push_back(std::move(m));
  }
}

}  // namespace tessera
