// LinkWatch: the ZeroMQ transport's watch of its links (ZmqTransportOptions::
// watch_links, the scheduler's). It reads ZeroMQ's monitor of each link's
// sending socket and reports a link lost once its peer closed it and then
// refused connecting again (Transport::TakeLostLinks): a killed process is
// known within a few hundred ms instead of PS_HEARTBEAT_TIMEOUT.
//
//   LinkWatch watch(context);
//   std::shared_ptr<std::atomic<bool>> stopped =
//       watch.Watch(peer, socket, endpoint);   // after zmq_connect
//   std::vector<Transport::LostLink> lost = watch.TakeLostLinks();
//   // Before the socket closes: zmq_socket_monitor(socket, nullptr, 0);
//   // stopped->store(true);
//   watch.CloseAll();                          // before zmq_ctx_term
//
// ZeroMQ sends monitor events blocking, from its I/O thread, so a full pipe,
// or one whose reader has closed, stops that thread and every link with it
// (a scheduler stalled 20 s after a restart's reconnect, CI under TSan at
// 4a9dde7). The reader is therefore unbounded (RCVHWM 0), connected before
// the monitor starts (an inproc connect may come first), and closed only once
// the sender's socket has stopped its monitor (the flag Watch returns).
//
// Thread-safety: every method from any thread; TakeLostLinks from one.
#ifndef TESSERA_COMMON_LINK_WATCH_H_
#define TESSERA_COMMON_LINK_WATCH_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transport.h"

namespace tessera::zmq_internal {

class LinkWatch {
 public:
  // Watches links of sockets in `context`, which outlives the watch's
  // sockets (CloseAll before zmq_ctx_term).
  explicit LinkWatch(void* context) : context_(context) {}

  // Starts watching the link to `peer` (its sender `socket`, connecting to
  // `endpoint`), in place of an earlier link to `peer`. Returns the flag the
  // socket's owner sets once it has stopped the socket's monitor for good:
  // the reader may close then (TakeLostLinks), never before. A link that
  // cannot be watched is only logged (nullptr): the heartbeats still judge
  // its peer.
  std::shared_ptr<std::atomic<bool>> Watch(int peer, void* socket,
                                           const std::string& endpoint);

  // Stops watching the link to `peer`; its reader stays open until its
  // socket's monitor has stopped.
  void Unwatch(int peer);

  // The links lost since the last call, each once per closing.
  std::vector<Transport::LostLink> TakeLostLinks();

  // Closes every reader: every socket closes before zmq_ctx_term, which waits
  // for them.
  void CloseAll();

 private:
  // What one watched link's monitor said.
  struct Link {
    void* monitor = nullptr;  // PAIR, connected to the sender's monitor
    std::shared_ptr<std::atomic<bool>> stopped;  // the flag Watch returned
    std::string endpoint;
    bool closed = false;  // DISCONNECTED, not connected since
    absl::Time closed_at;
    int retried = 0;  // CONNECT_RETRIED since the close
    bool reported = false;
  };
  // Monitor ends of links replaced or forgotten, open until their sender's
  // monitor has stopped.
  struct RetiredMonitor {
    void* monitor = nullptr;
    std::shared_ptr<std::atomic<bool>> stopped;
  };

  // Refused attempts after a close that make a link lost: two, 100-300 ms
  // apart (ZMQ_RECONNECT_IVL 100 ms, doubling).
  static constexpr int kRefusalsForLost = 2;

  // Closes the readers of monitors that have stopped.
  void CloseStoppedMonitorsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes in the events `link`'s monitor has queued.
  static void ReadEvents(Link& link);
  // Reads the next event of a socket monitor without waiting: false when
  // there is none.
  static bool NextEvent(void* monitor, uint16_t* event);

  void* const context_;
  absl::Mutex mu_;
  std::map<int, Link> links_ ABSL_GUARDED_BY(mu_);
  std::vector<RetiredMonitor> retired_monitors_ ABSL_GUARDED_BY(mu_);
  uint64_t next_watch_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera::zmq_internal

#endif  // TESSERA_COMMON_LINK_WATCH_H_
