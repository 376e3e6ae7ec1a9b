// RequestTracker's resend thread (see worker/client/request_tracker.h): sends
// again what got no answer within PS_RESEND_TIMEOUT, the wait doubling up to
// 8x (an acknowledged push as a header-only probe), and fails what exhausted
// TESSERA_RESEND_RETRIES (or, nobody waiting for it, TESSERA_TIMEOUT). The
// rest of the tracker (operations, sends, replies, waits) is in
// request_tracker.cc.
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "worker/client/request_trace.h"
#include "worker/client/request_tracker.h"

namespace tessera {

void RequestTracker::ResendLoop() {
  const absl::Duration tick =
      std::min(absl::Milliseconds(20), options_.resend_timeout / 4);
  const absl::Duration max_wait = options_.resend_timeout * 8;
  while (!stop_.load()) {
    {
      absl::MutexLock lock(&mu_);
      // Nothing to resend: sleep until a request is tracked (the cap only
      // bounds the harm of a missed signal).
      if (requests_.empty() && !stop_.load())
        resender_cv_.WaitWithTimeout(&mu_, absl::Seconds(1));
    }
    absl::SleepFor(tick);
    std::vector<std::pair<int, Message>> resend;
    // Requests at their limit: (request id, server). Failed in a second
    // pass, once their servers are described: describe_ takes the node's
    // lock, which is never taken under this one.
    std::vector<std::pair<uint64_t, int>> expiring;
    {
      absl::MutexLock lock(&mu_);
      if (!failure_.ok()) continue;
      CollectDueLocked(max_wait, &resend, &expiring);
    }
    if (!expiring.empty()) FailExpired(expiring);
    for (auto& [to, msg] : resend) {
      TESSERA_VLOG(1) << (msg.header.probe() ? "probing for " : "resending ")
                      << What(msg) << " (request " << msg.header.request_id()
                      << ") to " << describe_(to);
      (void)send_(to, std::move(msg));
    }
  }
}

void RequestTracker::CollectDueLocked(
    absl::Duration max_wait, std::vector<std::pair<int, Message>>* resend,
    std::vector<std::pair<uint64_t, int>>* expiring) {
  const absl::Time now = absl::Now();
  for (auto& [id, t] : requests_) {
    if (now < t.next_send && !Overdue(t, now)) continue;
    // The server sent something since this request's last send: it is
    // alive and working through what it has, so that send is not one
    // more unanswered (the server may be slow with resent copies; giving
    // up on it would fail a job that is moving).
    auto heard = heard_.find(t.request.server);
    if (heard != heard_.end() && heard->second >= t.last_sent) t.unanswered = 0;
    // Bounded all the same: a server that answers everything else but
    // neither answers nor acknowledges this request (which a held push's
    // resends get) has lost it, or will not take it.
    // And a request nobody waits for (a replay, op 0: no Wait's
    // deadline ends it) at the operations' time-out, however often its
    // server acknowledges it.
    if (t.unanswered >= options_.resend_retries ||
        t.unacknowledged >= kUnacknowledgedFactor * options_.resend_retries ||
        Overdue(t, now)) {
      t.next_send = absl::InfiniteFuture();  // the second pass decides
      expiring->emplace_back(id, t.request.server);
      continue;
    }
    ++t.unanswered;
    ++t.unacknowledged;
    ++t.resends;
    t.wait = std::min(t.wait * 2, max_wait);
    t.last_sent = now;
    t.next_send = now + t.wait;
    ++resends_;
    Message copy = ResendOf(t);
    const int to = AimLocked(t, &copy);
    resend->emplace_back(to, std::move(copy));
  }
}

bool RequestTracker::IsPushWithData(const Message& msg) {
  const wire::Command cmd = msg.header.command();
  return (cmd == wire::KV_PUSH || cmd == wire::KV_PUSHPULL) &&
         !msg.data.empty();
}

Message RequestTracker::ResendOf(const Tracked& t) {
  if (!IsPushWithData(t.msg)) return t.msg;
  if (!t.acknowledged) {
    ++whole_resends_;
    return t.msg;
  }
  // The server holds it (or did): ask, without the payload, whether it
  // still does. Its answer to a probe is the push's answer, or send_whole.
  ++probes_;
  Message probe;
  probe.header = t.msg.header;
  probe.header.clear_frames();
  probe.header.set_probe(true);
  return probe;
}

std::optional<std::pair<int, Message>> RequestTracker::SendWholeLocked(
    Tracked& t) {
  // Only once per probing: a second send_whole (two probes answered) finds
  // the whole copy on its way.
  if (!t.acknowledged || !t.sent) return std::nullopt;
  t.acknowledged = false;
  const absl::Time now = absl::Now();
  t.unanswered = 1;  // the server is there; this send is not yet answered
  // The probe's send already counted toward the unacknowledged budget: this
  // exchange counts once. And the whole copy is new to the server: if it is
  // lost, it goes again after the first resend time, not after the probes'
  // doubled one.
  ++t.resends;
  t.wait = options_.resend_timeout;
  t.last_sent = now;
  if (options_.resend) t.next_send = now + t.wait;
  ++resends_;
  ++whole_resends_;
  Message copy = t.msg;
  const int to = AimLocked(t, &copy);
  return std::make_pair(to, std::move(copy));
}

bool RequestTracker::Overdue(const Tracked& t, absl::Time now) const {
  return t.request.op == 0 && t.sent &&
         now - t.first_sent >= options_.request_timeout;
}

void RequestTracker::FailExpired(
    const std::vector<std::pair<uint64_t, int>>& expiring) {
  std::map<int, std::string> names;
  for (const auto& [id, server] : expiring) {
    if (!names.contains(server)) names[server] = describe_(server);
  }
  std::vector<Message> dead;  // released unlocked: may unpin an op
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (const auto& [id, server] : expiring) {
    auto it = requests_.find(id);
    // Answered (or acknowledged, which makes it wait again, unless overdue)
    // in between.
    if (it == requests_.end() ||
        (it->second.next_send != absl::InfiniteFuture() &&
         !Overdue(it->second, now))) {
      continue;
    }
    Tracked& t = it->second;
    const absl::Status failed = ExpiryError(t, names[server], now);
    TESSERA_LOG(ERROR) << failed.message();
    metrics_.failed_requests->Increment();
    if (t.request.op != 0) {
      Op& o = ops_[t.request.op];
      --o.pending;
      if (o.status.ok()) o.status = failed;
    }
    if (t.request.window > 0)
      DropWindowLocked(t.request.op, t.request.server, &dead);
    TraceRequestEnd(t.msg, 0, false);
    dead.push_back(std::move(t.msg));
    requests_.erase(it);
  }
}

absl::Status RequestTracker::ExpiryError(const Tracked& t,
                                         const std::string& server_name,
                                         absl::Time now) const {
  const bool silent = t.unanswered >= options_.resend_retries;
  const bool busy = !silent && t.unacknowledged >= kUnacknowledgedFactor *
                                                       options_.resend_retries;
  const absl::Duration since =
      absl::Trunc(now - t.first_sent, absl::Milliseconds(1));
  return silent || busy
             ? absl::UnavailableError(absl::StrCat(
                   What(t.msg), ": no answer from ", server_name, " after ",
                   busy ? t.unacknowledged : t.unanswered,
                   busy ? " sends, neither answered nor acknowledged while it "
                          "answered other requests, over "
                        : " sends over ",
                   absl::FormatDuration(since), " (PS_RESEND_TIMEOUT=",
                   absl::ToInt64Milliseconds(options_.resend_timeout),
                   "ms, TESSERA_RESEND_RETRIES=", options_.resend_retries, ")"))
             : absl::DeadlineExceededError(absl::StrCat(
                   What(t.msg), " (a replay): not answered by ", server_name,
                   " within ", absl::FormatDuration(since),
                   ", acknowledged but never answered (TESSERA_TIMEOUT=",
                   absl::FormatDuration(options_.request_timeout), ")"));
}

void RequestTracker::ResendNowTo(int server, absl::Time sent_before) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (auto& [id, t] : requests_) {
    if (t.request.server != server || !t.sent) continue;
    if (t.first_sent >= sent_before) continue;
    t.next_send = now;
    t.acknowledged = false;  // a restarted or new server has not got it
    t.unanswered = 0;
    t.unacknowledged = 0;
    t.wait = options_.resend_timeout / 2;
  }
}

}  // namespace tessera
