#include "server/delivery.h"

#include <map>
#include <set>

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
  std::set<int> blocked;
  // A sender whose first declined message is a pull: its pushes numbered
  // below the pull's push_seq (those it was sent after, which it may wait
  // for) are still offered; everything else of it waits behind the pull.
  std::map<int, uint64_t> behind_pull;
  while (!offered.empty()) {
    Message m = std::move(offered.front());
    offered.pop_front();
    const int sender = m.header.sender();
    const wire::Command cmd = m.header.command();
    const bool is_push = cmd == wire::KV_PUSH || cmd == wire::KV_PUSHPULL;
    bool offer = blocked.count(sender) == 0;
    auto pull = behind_pull.find(sender);
    if (offer && pull != behind_pull.end())
      offer = is_push && m.header.push_seq() < pull->second;
    if (offer && try_process(m)) continue;
    if (offer) {
      if (cmd == wire::KV_PULL && pull == behind_pull.end()) {
        behind_pull[sender] = m.header.push_seq();
      } else {
        blocked.insert(sender);
      }
    }
    bytes_ += SizeOf(m);
    messages_.push_back(std::move(m));
  }
}

}  // namespace tessera
