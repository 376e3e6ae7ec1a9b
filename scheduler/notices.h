// The scheduler's notices: messages it keeps sending to a node until the node
// acknowledges them (a response with the same command and request id). Node
// tables, changes of one node, hand-back orders and the job's end go so.
//
// A notice is resent after PS_RESEND_TIMEOUT, then at twice the last wait,
// up to 8 times the time-out, until it is acknowledged, replaced or dropped.
// A node table replaces a pending table to the same node when it carries
// every node that one does (a change of one node does not replace a pending
// change of another). Single-threaded: the scheduler's loop owns it.
#ifndef TESSERA_SCHEDULER_NOTICES_H_
#define TESSERA_SCHEDULER_NOTICES_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/message.h"
#include "common/metrics.h"

namespace tessera {

class Notices {
 public:
  struct Settings {
    bool resend = true;                                // PS_RESEND
    absl::Duration resend_timeout = absl::Seconds(1);  // PS_RESEND_TIMEOUT
    int sender = 0;  // the scheduler's id, set in every notice
    // Ids from here up are provisional (nodes without a table yet): such a
    // node acknowledges under any sender id.
    int provisional_base = 0;
  };
  using SendFn = std::function<absl::Status(int peer, const Message& msg)>;
  // "worker 3 (id 11 at ...)", for logs.
  using DescribeFn = std::function<std::string(int peer)>;

  // `resends` counts every resend (may be null).
  Notices(Settings settings, SendFn send, DescribeFn describe,
          Counter* resends);

  // Sends `msg` to `peer` as a notice: its request id, sender, recipient and
  // plane are set here. A failed send is logged and resent as any other.
  void Send(int peer, Message msg, absl::Time now = absl::Now());
  // The notice `h` acknowledges, now forgotten; nullopt when `h` acknowledges
  // none (unknown request id, another command, or another node's).
  std::optional<Message> Acknowledge(const wire::Header& h);
  // Forgets every notice to `peer` (it died or left: they go nowhere now).
  void DropTo(int peer);
  // Forgets every notice of `command`.
  void DropCommand(wire::Command command);
  // Forgets them all.
  void Clear();
  // Sends again every notice whose wait is over.
  void ResendDue(absl::Time now);

  bool empty() const { return notices_.empty(); }
  size_t size() const { return notices_.size(); }
  // The peers of the pending notices, oldest notice first (a peer once per
  // notice), at most `limit` of them.
  std::vector<int> Peers(size_t limit) const;
  // When the next resend is due (InfiniteFuture when none is).
  absl::Time next_resend() const { return next_resend_; }

 private:
  struct Notice {
    int peer = 0;
    Message msg;
    absl::Time next_send;
    absl::Duration wait;
  };
  void Drop(std::map<uint64_t, Notice>::iterator it);

  const Settings settings_;
  const SendFn send_;
  const DescribeFn describe_;
  Counter* const resends_;
  std::map<uint64_t, Notice> notices_;  // by request id
  // The request ids of each peer's notices: replacing a peer's pending table
  // looks at that peer's notices only (not all N of them at formation).
  std::map<int, std::set<uint64_t>> by_peer_;
  // No notice is due for a resend before this (ResendDue skips its pass over
  // every notice until then).
  absl::Time next_resend_ = absl::InfiniteFuture();
  uint64_t next_id_ = 1;
};

}  // namespace tessera

#endif  // TESSERA_SCHEDULER_NOTICES_H_
