// Node's receiving (part of Node; see common/node.h): which thread takes
// messages off the transport (the receiver thread, or a caller in
// ReceiveOnCaller), and the dispatch of what arrives: control messages to
// HandleControl, data-plane messages to the owner (held until
// StartDelivery).
#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/logging.h"
#include "common/node.h"

namespace tessera {

void Node::StartDelivery() {
  absl::MutexLock lock(&mu_);
  deliver_ = true;
}

void Node::ReceiveLoop() {
  while (AwaitReceiverTurn()) {
    ReceiveResult r;
    do {
      r = ReceiveAndDispatch(kReceiverPoll);
      if (r == ReceiveResult::kClosed && stop_.load()) break;
    } while (!caller_waiting_.load(std::memory_order_acquire) && !stop_.load());
    EndReceiverTurn();
  }
}

bool Node::AwaitReceiverTurn() {
  absl::MutexLock lock(&receive_mu_);
  // A condition variable, not Mutex::Await: a parked thread would make every
  // caller's unlock of receive_mu_ evaluate its condition.
  while (true) {
    if (receive_stopped_) return false;
    const absl::Time now = absl::Now();
    const absl::Time turn = caller_received_ + kCallerGrace;
    if (receiving_ == Receiver::kNone && (receiver_wanted_ || now >= turn)) {
      receiving_ = Receiver::kThread;
      receiver_wanted_ = false;
      caller_waiting_.store(false, std::memory_order_relaxed);
      return true;
    }
    if (receiving_ == Receiver::kNone) {
      // A caller received a moment ago and will likely again: leave it the
      // transport for the rest of the grace.
      receiver_cv_.WaitWithDeadline(&receive_mu_, turn);
    } else if (receiver_wanted_) {
      // A caller receives (its receive has a time-out); it signals when it
      // hands the transport back.
      receiver_cv_.Wait(&receive_mu_);
    } else {
      // A caller receives: look again after the grace, not at every hand-back
      // (that would wake this thread once per round trip).
      receiver_cv_.WaitWithDeadline(&receive_mu_, now + kCallerGrace);
    }
  }
}

void Node::EndReceiverTurn() {
  bool wanted;
  {
    absl::MutexLock lock(&receive_mu_);
    receiving_ = Receiver::kNone;
    wanted = caller_waiting_.exchange(false, std::memory_order_relaxed);
    // The caller that asked receives next; this thread waits out the grace.
    if (wanted) caller_received_ = absl::Now();
  }
  if (wanted && callbacks_.on_receiver_free) callbacks_.on_receiver_free();
}

void Node::WakeReceiver() {
  absl::MutexLock lock(&receive_mu_);
  if (receiving_ == Receiver::kThread) return;
  receiver_wanted_ = true;
  receiver_cv_.Signal();
}

Node::ReceiveResult Node::ReceiveOnCaller(absl::Duration timeout) {
  {
    absl::MutexLock lock(&receive_mu_);
    if (receive_stopped_) return ReceiveResult::kClosed;
    if (receiving_ != Receiver::kNone) {
      if (receiving_ == Receiver::kThread)
        caller_waiting_.store(true, std::memory_order_release);
      return ReceiveResult::kBusy;
    }
    receiving_ = Receiver::kCaller;
  }
  const ReceiveResult r = ReceiveAndDispatch(timeout);
  {
    absl::MutexLock lock(&receive_mu_);
    receiving_ = Receiver::kNone;
    caller_received_ = absl::Now();
    if (receiver_wanted_) receiver_cv_.Signal();
  }
  return r;
}

Node::ReceiveResult Node::ReceiveAndDispatch(absl::Duration timeout) {
  // Messages held before StartDelivery go first, to keep order.
  std::vector<Message> early;
  {
    absl::MutexLock lock(&mu_);
    if (deliver_ && !held_.empty()) early.swap(held_);
  }
  for (Message& m : early) {
    if (callbacks_.on_data) callbacks_.on_data(std::move(m));
  }
  absl::StatusOr<Message> msg = transport_->Receive(timeout);
  if (!msg.ok()) {
    if (absl::IsDeadlineExceeded(msg.status())) return ReceiveResult::kTimedOut;
    // Cancelled after Close; any other error is the transport's failure.
    return ReceiveResult::kClosed;
  }
  if (msg->header.sender() == kSchedulerId) {
    absl::MutexLock lock(&mu_);
    last_scheduler_contact_ = absl::Now();
  }
  if (msg->header.plane() != wire::DATA) {
    HandleControl(*std::move(msg));
    return ReceiveResult::kReceived;
  }
  if (options_.drop_percent > 0) {
    // PS_DROP_MSG: lose some data-plane messages on purpose (tests of
    // the resend path). xorshift32, seeded per process.
    if (drop_state_ == 0) drop_state_ = static_cast<uint32_t>(getpid()) | 1;
    drop_state_ ^= drop_state_ << 13;
    drop_state_ ^= drop_state_ >> 17;
    drop_state_ ^= drop_state_ << 5;
    if (static_cast<int>(drop_state_ % 100) < options_.drop_percent) {
      TESSERA_VLOG(2) << "PS_DROP_MSG dropped " << DebugString(*msg);
      return ReceiveResult::kReceived;
    }
  }
  bool direct = false;
  std::vector<Message> ready;
  {
    absl::MutexLock lock(&mu_);
    // Once delivery started and what was held went, messages go straight to
    // the owner (only the receiving thread adds to held_).
    direct = deliver_ && held_.empty();
    if (!direct) {
      held_.push_back(*std::move(msg));
      if (deliver_) ready.swap(held_);
    }
  }
  if (!callbacks_.on_data) return ReceiveResult::kReceived;
  if (direct) callbacks_.on_data(*std::move(msg));
  for (Message& m : ready) callbacks_.on_data(std::move(m));
  return ReceiveResult::kReceived;
}

}  // namespace tessera
