#include "tests/support/server_harness.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"

namespace tessera::testing {

ServerHarness::ServerHarness(int num_workers, int threads, WaitingLimits limits,
                             SyncRound::Mode sum_mode)
    : server_(
          num_workers, threads,
          [this](int peer, Message msg) {
            absl::MutexLock lock(&mu_);
            msg.header.set_sender(ServerId(0));
            msg.header.set_recipient(peer);
            replies_.push_back(std::move(msg));
            return absl::OkStatus();
          },
          limits, sum_mode) {}

std::optional<Message> ServerHarness::NextReply(bool skip_acks) {
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (true) {
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !replies_.empty();
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline))
      return std::nullopt;
    Message m = std::move(replies_.front());
    replies_.pop_front();
    if (skip_acks && m.header.ack_only()) continue;
    return m;
  }
}

size_t ServerHarness::Pending(absl::Duration settle) {
  absl::SleepFor(settle);
  absl::MutexLock lock(&mu_);
  return replies_.size();
}

}  // namespace tessera::testing
