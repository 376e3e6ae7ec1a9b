#include "worker/client/replay_log.h"

namespace tessera {

void ReplayLog::KeepSetting(const Message& msg) {
  absl::MutexLock lock(&mu_);
  settings_[msg.header.command()] = msg;
}

void ReplayLog::DeclareKey(uint64_t key, const std::vector<KeyPart>& parts) {
  absl::MutexLock lock(&mu_);
  KeyLog& log = keys_[key];
  log.parts = parts;
  log.init.assign(parts.size(), Message());
  log.pushes.assign(parts.size(), std::deque<PushCopy>());
}

void ReplayLog::ForgetKey(uint64_t key) {
  absl::MutexLock lock(&mu_);
  keys_.erase(key);
}

void ReplayLog::Keep(const RequestTracker::PartRef& part,
                     const Message& request, bool replayed,
                     const wire::Header& reply) {
  if (!reply.checkpointing() || !part.valid) return;
  absl::MutexLock lock(&mu_);
  auto k = keys_.find(part.key);
  if (k == keys_.end() || part.index >= k->second.pushes.size()) return;
  KeyLog& log = k->second;
  const wire::Command cmd = request.header.command();
  if (cmd == wire::KV_INIT) {
    if (reply.status().code() == 0 && !request.header.rejoin())
      log.init[part.index] = request;  // owns its bytes
    return;
  }
  if (cmd != wire::KV_PUSH && cmd != wire::KV_PUSHPULL) return;
  std::deque<PushCopy>& pushes = log.pushes[part.index];
  while (!pushes.empty() && pushes.front().seq < reply.durable_seq())
    pushes.pop_front();
  const uint64_t seq = request.header.push_seq();
  if (replayed || seq < reply.durable_seq() ||
      (!pushes.empty() && pushes.back().seq >= seq)) {
    return;
  }
  PushCopy kept;
  kept.seq = seq;
  kept.msg.header = request.header;
  // The frames may borrow the caller's memory, which is theirs again once the
  // operation completes: copy.
  for (const Buffer& b : request.data)
    kept.msg.data.push_back(Buffer::CopyOf(b.data(), b.size()));
  pushes.push_back(std::move(kept));
}

std::vector<ReplayLog::Entry> ReplayLog::For(int server_rank) const {
  std::vector<Entry> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [cmd, msg] : settings_)
    out.push_back(Entry{KeyPart{server_rank, 0, 0}, msg, {}});
  for (const auto& [key, log] : keys_) {
    for (size_t i = 0; i < log.parts.size(); ++i) {
      // An init that was kept (a row-sparse key's zeros and a hashed key's
      // init carry no data frame: data.empty() is no sign of none).
      if (log.parts[i].server_rank != server_rank ||
          log.init[i].header.command() != wire::KV_INIT)
        continue;
      out.push_back(Entry{log.parts[i], log.init[i], {key, i, true}});
    }
  }
  for (const auto& [key, log] : keys_) {
    for (size_t i = 0; i < log.parts.size(); ++i) {
      if (log.parts[i].server_rank != server_rank) continue;
      for (const PushCopy& p : log.pushes[i])
        out.push_back(Entry{log.parts[i], p.msg, {key, i, true}});
    }
  }
  return out;
}

}  // namespace tessera
