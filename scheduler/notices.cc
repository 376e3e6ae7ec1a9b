#include "scheduler/notices.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"

namespace tessera {

Notices::Notices(Settings settings, SendFn send, DescribeFn describe,
                 Counter* resends)
    : settings_(settings),
      send_(std::move(send)),
      describe_(std::move(describe)),
      resends_(resends) {}

void Notices::Send(int peer, Message msg, absl::Time now) {
  if (msg.header.command() == wire::NODE_TABLE) {
    auto mine = by_peer_.find(peer);
    std::vector<uint64_t> replaced;
    if (mine != by_peer_.end()) {
      std::set<int> ids;
      for (const wire::NodeInfo& n : msg.header.node_table().nodes())
        ids.insert(n.id());
      for (uint64_t old_id : mine->second) {
        const Message& old = notices_.at(old_id).msg;
        if (old.header.command() != wire::NODE_TABLE) continue;
        bool covered = true;
        for (const wire::NodeInfo& n : old.header.node_table().nodes()) {
          if (ids.count(n.id()) == 0) {
            covered = false;
            break;
          }
        }
        if (covered) replaced.push_back(old_id);
      }
    }
    for (uint64_t old_id : replaced) Drop(notices_.find(old_id));
  }
  const uint64_t id = next_id_++;
  msg.header.set_request_id(id);
  msg.header.set_sender(settings_.sender);
  msg.header.set_recipient(peer);
  msg.header.set_plane(wire::CONTROL);
  absl::Status sent = send_(peer, msg);
  if (!sent.ok()) {
    TESSERA_LOG(WARNING) << "send to " << describe_(peer) << ": "
                         << sent.message();
  }
  Notice& notice = notices_[id];
  notice.peer = peer;
  notice.msg = std::move(msg);
  notice.wait = settings_.resend_timeout;
  notice.next_send = now + notice.wait;
  by_peer_[peer].insert(id);
  next_resend_ = std::min(next_resend_, notice.next_send);
}

std::optional<Message> Notices::Acknowledge(const wire::Header& h) {
  auto it = notices_.find(h.request_id());
  if (it == notices_.end() || it->second.msg.header.command() != h.command()) {
    return std::nullopt;
  }
  // A node that has no node table yet (a start-up abort) acknowledges
  // without an id.
  if (it->second.peer != h.sender() &&
      it->second.peer < settings_.provisional_base) {
    return std::nullopt;
  }
  Message acknowledged = std::move(it->second.msg);
  Drop(it);
  return acknowledged;
}

void Notices::Drop(std::map<uint64_t, Notice>::iterator it) {
  auto mine = by_peer_.find(it->second.peer);
  if (mine != by_peer_.end()) {
    mine->second.erase(it->first);
    if (mine->second.empty()) by_peer_.erase(mine);
  }
  notices_.erase(it);
}

void Notices::DropTo(int peer) {
  auto mine = by_peer_.find(peer);
  if (mine == by_peer_.end()) return;
  const std::set<uint64_t> pending = mine->second;  // Drop edits it
  for (uint64_t n : pending) Drop(notices_.find(n));
}

void Notices::DropCommand(wire::Command command) {
  std::vector<uint64_t> stale;
  for (const auto& [n, notice] : notices_)
    if (notice.msg.header.command() == command) stale.push_back(n);
  for (uint64_t n : stale) Drop(notices_.find(n));
}

void Notices::Clear() {
  notices_.clear();
  by_peer_.clear();
  next_resend_ = absl::InfiniteFuture();
}

void Notices::ResendDue(absl::Time now) {
  // PS_RESEND=0: every message goes once, as the nodes' requests do.
  if (!settings_.resend || now < next_resend_) return;
  next_resend_ = absl::InfiniteFuture();
  for (auto& [id, notice] : notices_) {
    if (now < notice.next_send) {
      next_resend_ = std::min(next_resend_, notice.next_send);
      continue;
    }
    notice.wait = std::min(notice.wait * 2, settings_.resend_timeout * 8);
    notice.next_send = now + notice.wait;
    next_resend_ = std::min(next_resend_, notice.next_send);
    TESSERA_VLOG(1) << "no acknowledgement from " << describe_(notice.peer)
                    << " yet; sending again " << DebugString(notice.msg);
    if (resends_ != nullptr) resends_->Increment();
    (void)send_(notice.peer, notice.msg);
  }
}

std::vector<int> Notices::Peers(size_t limit) const {
  std::vector<int> peers;
  for (const auto& [id, notice] : notices_) {
    if (peers.size() == limit) break;
    peers.push_back(notice.peer);
  }
  return peers;
}

}  // namespace tessera
