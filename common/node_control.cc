// Node's control plane (part of Node; see common/node.h): the scheduler's
// control messages (node tables, answers to requests, deaths, aborts,
// hand-backs, the job's end) and the heartbeats this node sends it.
#include <algorithm>
#include <string>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/node.h"
#include "common/silence.h"
#include "common/wire_status.h"

namespace tessera {

void Node::HandleControl(Message&& msg) {
  const wire::Header& h = msg.header;
  if (h.sender() != kSchedulerId) {
    // Only the scheduler sends a node control messages: one from a server
    // (a hand-back notice nobody started, issue #46) is a wrong sender,
    // though its seal is its own.
    foreign_control_metric_->Increment();
    const uint64_t n = ++foreign_control_;
    if (LogOccurrence(n)) {
      TESSERA_LOG(WARNING) << "ignored control message #" << n << " from "
                           << Describe(h.sender())
                           << ": only the scheduler sends control messages "
                              "to nodes: "
                           << DebugString(msg);
    }
    return;
  }
  TESSERA_VLOG(1) << "control: " << DebugString(msg);
  switch (h.command()) {
    case wire::NODE_TABLE:
      HandleNodeTable(h);
      return;
    case wire::BARRIER:
    case wire::WORKER_DONE:
    case wire::WORKER_LEAVE:
    case wire::SERVER_LEAVE:
    case wire::HEARTBEAT:
      AnswerWaiter(h);
      return;
    case wire::NODE_DEAD:
      HandleNodeDead(h);
      return;
    case wire::ABORT:
      HandleAbort(h);
      return;
    case wire::HANDBACK:
      Acknowledge(h);
      if (callbacks_.on_handback)
        callbacks_.on_handback(h.handback_rank(), h.handback_epoch(),
                               h.handback_leave());
      return;
    case wire::TERMINATE: {
      // Acknowledge first: the thread waiting for the end may close the
      // transport as soon as it sees terminated_, and the acknowledgement
      // would then never leave (the scheduler waits out its deadline).
      Acknowledge(h);
      {
        absl::MutexLock lock(&mu_);
        terminated_ = true;
      }
      return;
    }
    default:
      TESSERA_LOG(WARNING) << "ignored unexpected control message "
                           << DebugString(msg);
  }
}

void Node::Acknowledge(const wire::Header& h) {
  // What ends the job, and node tables, are kept by the scheduler until
  // acknowledged; every copy is acknowledged (an acknowledgement can be lost
  // too).
  Message ack;
  ack.header.set_command(h.command());
  ack.header.set_request_id(h.request_id());
  ack.header.set_is_response(true);
  (void)SendControl(std::move(ack));
}

void Node::HandleNodeTable(const wire::Header& h) {
  // A table after the first says which peers restarted.
  bool update = false;
  {
    absl::MutexLock lock(&mu_);
    update = have_table_;
  }
  if (update) {
    UpdateTable(h.node_table());
    Acknowledge(h);
    return;
  }
  if (!AdoptFirstTable(h.node_table())) return;
  // Confirms that the scheduler's messages reach the address this node
  // advertises.
  Acknowledge(h);
}

void Node::AnswerWaiter(const wire::Header& h) {
  if (!h.is_response()) return;
  absl::MutexLock lock(&mu_);
  auto it = waiters_.find(h.request_id());
  if (it != waiters_.end()) {
    it->second.done = true;
    it->second.status = FromWire(h.status());
  }
}

void Node::HandleNodeDead(const wire::Header& h) {
  // As for TERMINATE: acknowledged before the failure is seen.
  Acknowledge(h);
  const wire::NodeInfo& dead = h.node_dead().node();
  Fail(absl::UnavailableError(
      absl::StrCat(dead.role() == wire::SERVER ? "server " : "worker ",
                   dead.rank(), " (id ", dead.id(), " at ", dead.host(), ":",
                   dead.port(), ") died: ", h.node_dead().reason())));
}

void Node::HandleAbort(const wire::Header& h) {
  // Only an abort for this node: sent to its id, or answering its
  // registration (it may have an id by the time that answer comes). The
  // scheduler aborts registrations at the address they name, which may
  // be another node's (issue #46).
  const bool mine = (id_ != 0 && h.recipient() == id_) ||
                    absl::c_linear_search(h.abort().registrations(), nonce_);
  if (!mine) {
    const uint64_t n = ++foreign_aborts_;
    if (n <= 10 || n % 1000 == 0) {
      TESSERA_LOG(WARNING) << "ignored abort #" << n << " for "
                           << (id_ != 0
                                   ? absl::StrCat("node id ", h.recipient())
                                   : std::string("another registration"))
                           << " (this node: "
                           << (id_ != 0 ? absl::StrCat("id ", id_)
                                        : std::string("no id yet"))
                           << "): " << h.abort().reason();
    }
    return;
  }
  Acknowledge(h);
  Fail(absl::AbortedError(
      absl::StrCat("the scheduler ended the job: ", h.abort().reason())));
}

void Node::HeartbeatLoop() {
  const absl::Duration interval = options_.heartbeat_interval;
  const absl::Duration timeout = options_.heartbeat_timeout;
  absl::Time next = absl::Now();
  while (!stop_.load()) {
    absl::Status failed;
    bool beat = false;
    {
      absl::MutexLock lock(&mu_);
      if (terminated_ || !failure_.ok() || stopping_) return;
      const absl::Time now = absl::Now();
      // Judged up to when this node last took everything waiting for it
      // (common/silence.h): its own receiving may be held up.
      const absl::Time heard_until = transport_->caught_up_at();
      const Silence silent =
          MeasureSilence(last_scheduler_contact_, heard_until, now);
      if (silent.TooLong(timeout) && part_done_) {
        // This node's work is complete (a worker the scheduler counted as
        // done, a server every worker said goodbye to): a scheduler lost
        // after that does not make a finished job a failure.
        TESSERA_LOG(WARNING)
            << "the scheduler (id 1 at " << scheduler_address_
            << ") went silent for " << silent.Describe(now, heard_until)
            << " after this node finished its part; leaving without failure";
        terminated_ = true;
        return;
      }
      if (silent.TooLong(timeout)) {
        failed = absl::UnavailableError(
            absl::StrCat("the scheduler (id 1 at ", scheduler_address_,
                         ") stopped answering heartbeats for ",
                         silent.Describe(now, heard_until)));
      } else if (now >= next) {
        next = now + interval;
        beat = true;
      } else {
        // Sleep until the next heartbeat is due or the silence could pass
        // the time-out, whichever is first (Stop wakes it): one wake-up per
        // interval, not 20 a second, which adds up with hundreds of
        // processes on one machine. Silence heard counts up to heard_until
        // only, so at that deadline it may not have passed: then look again
        // every 100 ms while the receiving catches up.
        absl::Time wake =
            last_scheduler_contact_ + timeout + absl::Milliseconds(1);
        if (wake <= now) wake = now + absl::Milliseconds(100);
        heartbeat_cv_.WaitWithDeadline(&mu_, std::min(next, wake));
        continue;
      }
    }
    if (!failed.ok()) {
      Fail(failed);
      return;
    }
    if (beat) SendHeartbeat();
  }
}

void Node::SendHeartbeat() {
  Message hb;
  hb.header.set_command(wire::HEARTBEAT);
  hb.header.set_request_id(next_request_.fetch_add(1));
  if (SendControl(std::move(hb)).ok()) heartbeats_sent_->Increment();
  bool report = false;
  uint64_t handback = 0;
  {
    absl::MutexLock lock(&mu_);
    report = report_caught_up_;
    handback = report_handback_;
  }
  if (handback != 0) {
    Message done;
    done.header.set_command(wire::HANDBACK);
    done.header.set_request_id(next_request_.fetch_add(1));
    done.header.set_handback_epoch(handback);
    (void)SendControl(std::move(done));
  }
  if (report) {
    // Until the table says so: the first report may have been lost.
    Message caught_up;
    caught_up.header.set_command(wire::CAUGHT_UP);
    caught_up.header.set_request_id(next_request_.fetch_add(1));
    (void)SendControl(std::move(caught_up));
  }
}

}  // namespace tessera
