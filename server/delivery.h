// Delivery bookkeeping of one key on a server: which pushes of each worker it
// has taken (exactly once), which of them its last checkpoint holds, and the
// messages that must wait for something (a worker's push of the next round, a
// pull behind a push of the open round, a push that overtook an earlier one
// of the same worker).
//
//   PushLedger ledger(/*num_workers=*/4);
//   switch (ledger.Classify(rank, header.push_seq())) {
//     case PushLedger::kDuplicate: ...   // answered, never applied twice
//     case PushLedger::kAhead: ...       // wait for the missing one
//     case PushLedger::kNext: ledger.Take(rank); ...
//   }
//   WaitingMessages waiting(limits);
//   absl::Status held = waiting.Hold(std::move(msg));   // ResourceExhausted
//                                                        // past the limits
//
// Thread-safety: none; a key's bookkeeping is owned by one thread at a time
// (see KVServer).
#ifndef TESSERA_SERVER_DELIVERY_H_
#define TESSERA_SERVER_DELIVERY_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/message.h"

namespace tessera {

// Per worker rank: the pushes to a key the server has taken (the next
// expected push_seq) and how many of them its last written checkpoint holds.
class PushLedger {
 public:
  explicit PushLedger(int num_workers)
      : received_(num_workers, 0), durable_(num_workers, 0) {}

  enum Verdict {
    kDuplicate,  // numbered below the count: taken before; answer, do not apply
    kNext,       // the push the server expects next from this worker
    kAhead,      // an earlier push of this worker is missing: it must wait
  };
  Verdict Classify(int rank, uint64_t push_seq) const {
    if (push_seq < received_[rank]) return kDuplicate;
    return push_seq == received_[rank] ? kNext : kAhead;
  }
  // The push numbered received(rank) is taken (even a rejected one uses up
  // its number, so the worker's next push is not held waiting for it).
  void Take(int rank) { ++received_[rank]; }

  uint64_t received(int rank) const { return received_[rank]; }
  uint64_t durable(int rank) const { return durable_[rank]; }
  void set_durable(int rank, uint64_t count) { durable_[rank] = count; }
  // A backup taking its primary's update: the pushes the weights include.
  void SetReceived(int rank, uint64_t count) { received_[rank] = count; }
  // After a restore from a checkpoint: both counts are what it holds.
  void Restore(int rank, uint64_t count) {
    received_[rank] = durable_[rank] = count;
  }
  int num_workers() const { return static_cast<int>(received_.size()); }

 private:
  std::vector<uint64_t> received_;
  std::vector<uint64_t> durable_;
};

// How much may wait per key. Past either limit a message is refused with
// ResourceExhausted naming the key, so a worker (or a peer posing as one) that
// runs far ahead cannot make the server hold memory without bound.
struct WaitingLimits {
  size_t max_messages_per_sender = 64;
  uint64_t max_bytes = uint64_t{256} << 20;
};

// Messages of one key that must wait, in arrival order. A worker's messages
// stay in its order: once one waits, its later ones wait behind it.
class WaitingMessages {
 public:
  explicit WaitingMessages(WaitingLimits limits) : limits_(limits) {}

  bool empty() const { return messages_.empty(); }
  size_t size() const { return messages_.size(); }
  uint64_t bytes() const { return bytes_; }

  // True when a message of `sender` waits (its next ones must queue behind).
  bool HasWaiting(int sender) const;
  // True when this very request (a resent copy) already waits.
  bool Holds(int sender, uint64_t request_id, uint64_t generation) const;

  // Queues `msg`. ResourceExhausted (naming `key`, the sender and the limit)
  // when it would exceed the limits; `msg` is then left untouched for the
  // caller to answer.
  absl::Status Hold(uint64_t key, Message& msg);

  // Drops what `sender`'s lives before `generation` left waiting (a worker
  // restarted into the job: nobody waits for their replies). Returns how
  // many.
  size_t DropEarlierLives(int sender, uint64_t generation);

  // Offers every waiting message to `try_process`, in order, once; a message
  // it declines (returns false) waits on, and so do its sender's later ones,
  // except the sender's pushes numbered below the declined message's
  // push_seq: they were sent before it, and it may wait for them (a pull for
  // the pushes it follows; a push for the ones it overtook).
  void Replay(const std::function<bool(Message&)>& try_process);

 private:
  static uint64_t SizeOf(const Message& msg);

  WaitingLimits limits_;
  std::deque<Message> messages_;
  uint64_t bytes_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_DELIVERY_H_
