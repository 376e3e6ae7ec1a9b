// Node's requests to the scheduler (part of Node; see common/node.h):
// barriers, finishing and leaving the job, each a control request that is
// asked again while its answer does not come.
#include <algorithm>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/node.h"
#include "common/status_macros.h"

namespace tessera {

absl::Status Node::CallScheduler(wire::Command command, wire::Header extra,
                                 absl::Duration timeout,
                                 const std::string& what) {
  const uint64_t request = next_request_.fetch_add(1);
  Message msg;
  msg.header = std::move(extra);
  msg.header.set_command(command);
  msg.header.set_request_id(request);
  {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) return failure_;
    waiters_[request] = Waiter();
  }
  absl::Status sent = SendControl(msg);
  // No caller will receive the answer for this thread.
  WakeReceiver();
  absl::MutexLock lock(&mu_);
  if (!sent.ok()) {
    waiters_.erase(request);
    return sent;
  }
  auto ready = [this, request]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return waiters_[request].done || !failure_.ok() || stopping_ || terminated_;
  };
  // The reply can be lost with a connection that broke (`ss -K`, a peer's
  // restart): the same request goes again, and the scheduler answers a repeat
  // without counting it twice.
  AwaitAskingAgain(absl::Condition(&ready), absl::Now() + timeout, [&] {
    TESSERA_VLOG(1) << what
                    << ": no answer from the scheduler yet; asking again";
    (void)SendControl(msg);
  });
  Waiter waiter = waiters_[request];
  waiters_.erase(request);
  if (waiter.done) return waiter.status;
  if (!failure_.ok()) return failure_;
  if (terminated_) {
    // The job ended: every worker finished, this one included (the answer to
    // its WORKER_DONE was lost, or the scheduler left before sending it).
    if (command == wire::WORKER_DONE) return absl::OkStatus();
    return absl::CancelledError(absl::StrCat(what, ": the job has ended"));
  }
  if (stopping_)
    return absl::CancelledError(absl::StrCat(what, ": node stopped"));
  return absl::DeadlineExceededError(absl::StrCat(
      what, ": no answer from the scheduler at ", scheduler_address_,
      " within ", absl::FormatDuration(timeout)));
}

void Node::AwaitAskingAgain(const absl::Condition& ready, absl::Time deadline,
                            const std::function<void()>& ask_again) {
  absl::Duration wait =
      options_.resend ? options_.resend_timeout : absl::InfiniteDuration();
  while (
      !mu_.AwaitWithDeadline(ready, std::min(deadline, absl::Now() + wait))) {
    if (absl::Now() >= deadline) return;
    mu_.Unlock();
    control_resends_->Increment();
    ask_again();
    mu_.Lock();
    wait = std::min(wait * 2, options_.resend_timeout * 8);
  }
}

absl::Status Node::Barrier(int group, const std::string& tag) {
  wire::Header extra;
  extra.mutable_barrier()->set_group(group);
  extra.mutable_barrier()->set_tag(tag);
  return CallScheduler(
      wire::BARRIER, std::move(extra), options_.request_timeout,
      absl::StrCat("barrier of group ", group, tag.empty() ? "" : " (", tag,
                   tag.empty() ? "" : ")"));
}

absl::Status Node::JoinBarrierIfOpen(int group, const std::string& tag) {
  wire::Header extra;
  extra.mutable_barrier()->set_group(group);
  extra.mutable_barrier()->set_tag(tag);
  extra.mutable_barrier()->set_join_if_open(true);
  return CallScheduler(
      wire::BARRIER, std::move(extra), options_.request_timeout,
      absl::StrCat("rejoining barrier ", tag, " of group ", group));
}

absl::Status Node::Finish() {
  TESSERA_RETURN_IF_ERROR(CallScheduler(wire::WORKER_DONE, wire::Header(),
                                        options_.request_timeout,
                                        "leaving the job"));
  MarkPartDone();
  // Stay until the end is announced, so the scheduler hears this worker
  // acknowledge it and need not wait out its deadline.
  WakeReceiver();
  absl::MutexLock lock(&mu_);
  auto ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return terminated_ || !failure_.ok() || stopping_;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ended),
                            options_.request_timeout)) {
    TESSERA_LOG(WARNING) << "this worker finished but the job's end was not "
                            "announced within "
                         << absl::FormatDuration(options_.request_timeout)
                         << " (TESSERA_TIMEOUT); leaving";
    return absl::OkStatus();
  }
  if (!failure_.ok()) return failure_;
  return absl::OkStatus();
}

absl::Status Node::Leave() {
  if (options_.role == Role::kServer) {
    TESSERA_RETURN_IF_ERROR(CallScheduler(wire::SERVER_LEAVE, wire::Header(),
                                          options_.request_timeout,
                                          "leaving the job"));
    absl::MutexLock lock(&mu_);
    part_done_ = true;
    left_ = true;  // WaitForTerminate returns
    return absl::OkStatus();
  }
  TESSERA_RETURN_IF_ERROR(CallScheduler(wire::WORKER_LEAVE, wire::Header(),
                                        options_.request_timeout,
                                        "leaving the elastic job"));
  MarkPartDone();
  return absl::OkStatus();
}

}  // namespace tessera
