#include "common/link_watch.h"

#include <zmq.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace tessera::zmq_internal {

std::shared_ptr<std::atomic<bool>> LinkWatch::Watch(
    int peer, void* socket, const std::string& endpoint) {
  absl::MutexLock lock(&mu_);
  const std::string address =
      absl::StrCat("inproc://tessera-link-watch-", next_watch_++);
  void* monitor = zmq_socket(context_, ZMQ_PAIR);
  if (monitor == nullptr) {
    TESSERA_LOG(WARNING) << "cannot watch the link to node " << peer << ": "
                         << zmq_strerror(zmq_errno());
    return nullptr;
  }
  const int zero = 0;
  zmq_setsockopt(monitor, ZMQ_LINGER, &zero, sizeof(zero));
  zmq_setsockopt(monitor, ZMQ_RCVHWM, &zero, sizeof(zero));
  if (zmq_connect(monitor, address.c_str()) != 0 ||
      zmq_socket_monitor(socket, address.c_str(),
                         ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED |
                             ZMQ_EVENT_CONNECT_RETRIED |
                             ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0) {
    TESSERA_LOG(WARNING) << "cannot watch the link to node " << peer << ": "
                         << zmq_strerror(zmq_errno());
    zmq_close(monitor);
    return nullptr;
  }
  auto stopped = std::make_shared<std::atomic<bool>>(false);
  Link& link = links_[peer];
  if (link.monitor != nullptr) {
    retired_monitors_.push_back({link.monitor, std::move(link.stopped)});
  }
  link = Link();
  link.monitor = monitor;
  link.stopped = stopped;
  link.endpoint = endpoint;
  return stopped;
}

void LinkWatch::Unwatch(int peer) {
  absl::MutexLock lock(&mu_);
  auto it = links_.find(peer);
  if (it == links_.end()) return;
  // Its socket may still send events until its Sender is gone.
  retired_monitors_.push_back(
      {it->second.monitor, std::move(it->second.stopped)});
  links_.erase(it);
}

std::vector<Transport::LostLink> LinkWatch::TakeLostLinks() {
  std::vector<Transport::LostLink> lost;
  absl::MutexLock lock(&mu_);
  CloseStoppedMonitorsLocked();
  for (auto& [peer, link] : links_) {
    ReadEvents(link);
    // After a close ZeroMQ announces its reconnect (one CONNECT_RETRIED)
    // before trying; each one after that is an attempt that failed at
    // once (refused: a connection that hangs, to a host that dropped off
    // the network, ends no attempt).
    const int refused = link.retried - 1;
    if (link.closed && !link.reported && refused >= kRefusalsForLost) {
      link.reported = true;
      lost.push_back(
          Transport::LostLink{peer, link.endpoint, link.closed_at, refused});
    }
  }
  return lost;
}

void LinkWatch::CloseAll() {
  absl::MutexLock lock(&mu_);
  for (auto& [peer, link] : links_) zmq_close(link.monitor);
  links_.clear();
  for (const RetiredMonitor& m : retired_monitors_) zmq_close(m.monitor);
  retired_monitors_.clear();
}

void LinkWatch::CloseStoppedMonitorsLocked() {
  std::erase_if(retired_monitors_, [](const RetiredMonitor& m) {
    if (!m.stopped->load()) return false;
    zmq_close(m.monitor);
    return true;
  });
}

void LinkWatch::ReadEvents(Link& link) {
  uint16_t event = 0;
  while (NextEvent(link.monitor, &event)) {
    switch (event) {
      case ZMQ_EVENT_DISCONNECTED:
        link.closed = true;
        link.closed_at = absl::Now();
        link.retried = 0;
        link.reported = false;
        break;
      case ZMQ_EVENT_CONNECT_RETRIED:
        if (link.closed) ++link.retried;
        break;
      case ZMQ_EVENT_CONNECTED:
      case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
        link.closed = false;
        link.retried = 0;
        break;
      default:
        break;
    }
  }
}

// An event is two parts (ZeroMQ 4: 16-bit event and 32-bit value, then the
// endpoint), queued whole.
bool LinkWatch::NextEvent(void* monitor, uint16_t* event) {
  zmq_msg_t part;
  zmq_msg_init(&part);
  if (zmq_msg_recv(&part, monitor, ZMQ_DONTWAIT) < 0) {
    zmq_msg_close(&part);
    return false;
  }
  *event = 0;
  if (zmq_msg_size(&part) >= sizeof(*event))
    memcpy(event, zmq_msg_data(&part), sizeof(*event));
  bool more = zmq_msg_more(&part) != 0;
  zmq_msg_close(&part);
  while (more) {
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, monitor, ZMQ_DONTWAIT) < 0)
      more = false;
    else
      more = zmq_msg_more(&part) != 0;
    zmq_msg_close(&part);
  }
  return true;
}

}  // namespace tessera::zmq_internal
