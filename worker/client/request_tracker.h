// RequestTracker: the requests a worker has sent to servers, and the
// operations (a push, a pull, an init...) they belong to. It numbers requests,
// matches replies to them, keeps pulled frames until the waiting caller copies
// them, sends again what got no answer in time, and fails what exhausted its
// retries or its deadline.
//
//   RequestTracker tracker(options, send, describe);
//   uint64_t op = tracker.NewOp();
//   tracker.Send(RequestTracker::Request{.op = op, .server = 8, .out = out,
//                                        .length = n}, std::move(msg));
//   node callback: tracker.HandleReply(std::move(reply));
//   absl::Status done = tracker.Wait(op, "pull of key 3");
//
// Delivery (PS_RESEND=1, the default): every request is kept until its reply
// arrives and sent again when none came within PS_RESEND_TIMEOUT, the wait
// doubling up to 8x; TESSERA_RESEND_RETRIES unanswered sends in a row fail it
// with an error naming the server. A server that holds a request (a push
// waiting for its round) answers a resent copy with an acknowledgement, which
// restarts the count. With PS_RESEND=0 a request goes once.
//
// Probes (issue #46): once its server acknowledged a push (it holds it, and
// the answer comes when its round completes), the push's resends carry its
// header only, marked `probe`: the server answers a probe as it would the
// whole push when it holds it or has taken it, and with `send_whole` when it
// does neither (it lost it: a restart the worker has not heard of yet); the
// push then goes again at once, whole, and its resends stay whole until the
// next acknowledgement. A server restarting or a slice moving
// (ResendNowTo) makes the push whole again too.
//
// Borrowed memory: a frame that borrows the caller's buffer (Buffer::Wrap with
// the owner from Pin(op)) pins its operation until every copy of the frame is
// gone (ZeroMQ's, the kept request's); Wait returns only then, so the caller's
// buffer is free again when Wait returns.
//
// Receiving in Wait: given a ReceiveFn (Node::ReceiveOnCaller), one waiting
// thread at a time takes messages off the transport itself while its
// operation awaits replies, and dispatches them (HandleReply, for every
// operation): its own reply then wakes it directly instead of waking the
// node's receiver thread, which would have to wake it in turn. The other
// waiters wait for their replies as before and one of them takes over when it
// leaves. When the node's receiver thread is receiving (ReceiveFn answers
// kBusy), the waiter waits; the thread dispatches the reply or steps aside
// (ReceiverFree) after its current receive.
//
// Metrics (MetricsRegistry::Global(), docs/metrics.md): push, pull and
// pushpull latency (an operation from NewOp to its last reply), time callers
// spend in Wait, requests and operations in flight, resends (those of pushes
// split into header-only probes and whole resends), duplicate replies and
// requests that failed after their last resend.
//
// Thread-safety: all methods are thread-safe. The OnAnswered callback runs on
// the thread that called HandleReply, without the tracker's lock, before the
// answered request (and any borrowed frame it holds) is released.
//
// Its methods live in request_tracker.cc (operations, sends, windows,
// replies, waits) and request_tracker_resend.cc (the resend thread); the
// requests' trace spans in request_trace.h.
#ifndef TESSERA_WORKER_CLIENT_REQUEST_TRACKER_H_
#define TESSERA_WORKER_CLIENT_REQUEST_TRACKER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/debug_pending.h"
#include "common/message.h"
#include "common/metrics.h"
#include "common/node.h"

namespace tessera {

// The payload on a push's error that its server refused before taking the
// push's number (wire::Header::push_untaken: the server's count of this
// worker's pushes to the key stays behind). The first such refusal of an
// operation is the error Wait returns, marked with it.
inline constexpr char kPushUntakenPayload[] = "type.tessera/push_untaken";
inline bool PushUntaken(const absl::Status& status) {
  return status.GetPayload(kPushUntakenPayload).has_value();
}

class RequestTracker {
 public:
  struct Options {
    bool resend = true;
    absl::Duration resend_timeout = absl::Seconds(1);
    int resend_retries = 8;
    absl::Duration request_timeout = absl::Seconds(600);  // Wait's deadline
    uint64_t first_request_id = 1;
  };
  // Identifies the key part a request is about (for the replay log).
  struct PartRef {
    uint64_t key = 0;
    size_t index = 0;
    bool valid = false;
  };
  // What the tracker knows of one request besides its message.
  struct Request {
    uint64_t op = 0;       // 0: a replayed request nobody waits for
    int server = 0;        // node id
    float* out = nullptr;  // where pulled values go
    uint64_t length = 0;   // values expected in a pull's reply
    PartRef part;
    bool replayed = false;
    bool rejoin = false;  // a restarted worker's KV_INIT: its reply says where
                          // pushes resume
    // > 0: held back while this many requests of the same operation to the
    // same server are out and not yet answered (an acknowledgement does not
    // count): the slices of one big push. Every request of an operation to a
    // server names the same window.
    int window = 0;
    // Takes a successful reply in place of `out` (a compressed pull): called
    // on the thread of HandleReply, before the operation completes; its error
    // is the request's.
    std::function<absl::Status(const Message& reply)> on_reply;
  };
  struct Answered {
    Request request;
    Message msg;  // the request as sent (holds borrowed frames)
  };
  // Sends `msg` to the node `to` (where RouteFn aimed it).
  using SendFn = std::function<absl::Status(int to, Message msg)>;
  // The node a request for `server`'s slices goes to now (a chain's acting
  // primary after a fail-over or a hand-back; ServerRoutes), marking in
  // `msg` what that node needs to know (an init's chain place). Called with
  // the tracker's lock held, at every send and resend: it may take no lock
  // but a leaf lock of its own. Null: a request goes to its server.
  using RouteFn = std::function<int(int server, Message* msg)>;
  using DescribeFn = std::function<std::string(int node)>;
  using OnAnswered =
      std::function<void(const Answered& answered, const wire::Header& reply)>;
  // Receives at most one message within the time-out and dispatches it on the
  // calling thread (replies come back through HandleReply).
  using ReceiveFn = std::function<Node::ReceiveResult(absl::Duration timeout)>;

  // `receive` null: replies come only from another thread's HandleReply.
  //
  // Who may answer a request: a node it was sent (or resent) to, as `route`
  // aimed it: its server, or after a fail-over or a hand-back the server
  // that answers for the slice now. A reply or an acknowledgement from any
  // other node (another server of the slice's chain included) is dropped,
  // counted and logged naming the sender: it cannot be the answer.
  RequestTracker(Options options, SendFn send, DescribeFn describe,
                 OnAnswered on_answered = nullptr, ReceiveFn receive = nullptr,
                 RouteFn route = nullptr);
  // Stops the resend thread.
  ~RequestTracker();

  uint64_t NewOp();
  // The owner for frames that borrow the caller's memory for `op`.
  std::shared_ptr<const void> Pin(uint64_t op);
  // Fails `op` before (or instead of) sending its remaining requests.
  void FailOp(uint64_t op, const absl::Status& status);

  // Numbers `msg`, keeps it and sends it to request.server. A failed send
  // fails the operation, unless the request is kept for resending.
  void Send(Request request, Message msg);

  // A reply from a server (on the thread that received it). REQUIRES: not
  // called with the tracker's lock held (it never is: callbacks run unlocked).
  void HandleReply(Message&& msg);

  // The node's receiver thread stepped aside for a waiter that found it
  // receiving (Node's on_receiver_free): such a waiter may receive now.
  void ReceiverFree();

  // What the replies to a rejoin (KV_INIT with rejoin) said, over the slices.
  struct RejoinReplies {
    uint64_t resume_min = UINT64_MAX;  // smallest push count replied
    uint64_t resume_max = 0;           // largest push count replied
    uint64_t open_round_max = 0;       // the furthest open round
    bool joining = false;        // the sender joins a slice's rounds (elastic)
    bool entry_refused = false;  // an entry's round was past a slice's
  };
  // Waits (at most Options::request_timeout) for `op`, then copies its pulled
  // frames to the callers' buffers. `rejoin`, when given, receives what the
  // rejoin replies said. Errors: the first error of its requests;
  // DeadlineExceeded naming the silent servers and `what`; the job's failure
  // after FailAll.
  absl::Status Wait(uint64_t op, const std::string& what,
                    RejoinReplies* rejoin = nullptr);

  // The job failed: every operation fails with `status`, now and later.
  void FailAll(const absl::Status& status);
  // A server restarted: what waits for it, first sent before `sent_before`,
  // goes again at once (what was sent since, e.g. the replay, is not doubled).
  void ResendNowTo(int server, absl::Time sent_before);

  uint64_t resends() const { return resends_.load(); }
  // Of a push's resends: header-only probes, and those carrying its data.
  uint64_t probes() const { return probes_.load(); }
  uint64_t whole_resends() const { return whole_resends_.load(); }
  // Pulled bytes on the wire, and what they stand for as float32.
  uint64_t bytes_pulled() const { return bytes_pulled_.load(); }
  uint64_t bytes_pulled_float32() const { return bytes_pulled_float32_.load(); }

 private:
  struct PulledFrame {
    float* out = nullptr;
    Buffer values;
  };
  struct Op {
    int pending = 0;     // requests without a reply
    int pinned = 0;      // borrowed frames still held
    int command = 0;     // of its first request (which latency it is)
    absl::Time started;  // NewOp
    absl::Time done;     // the last reply (pending reached 0)
    absl::Status status;
    std::vector<PulledFrame> pulled;  // replies not yet copied to the caller
    RejoinReplies rejoin;             // rejoin: what the replies said
  };
  struct Tracked {
    Request request;
    Message msg;  // the header and references to the same frames
    absl::Time first_sent;
    absl::Time last_sent;  // its latest send
    absl::Time next_send;
    absl::Duration wait;
    int unanswered = 0;      // sends in a row without any answer, while its
                             // server sent nothing else either
    int unacknowledged = 0;  // sends since its last acknowledgement
    int resends = 0;         // sends after the first
    bool sent = true;        // false: held back by its window
    bool taken = false;  // windowed: answered, its place in the window freed
    // A push its server acknowledged since its last whole send: resent as
    // a probe (its header only) until the server says it lacks it.
    bool acknowledged = false;
    // The nodes it was sent to (RouteFn's answers), in order: only they
    // answer it.
    std::vector<int> sent_to;
  };
  // One operation's windowed requests to one server.
  struct Window {
    int out = 0;                // sent and not yet answered
    std::deque<uint64_t> held;  // request ids, in order
  };

  void Unpin(uint64_t op);
  // HandleReply's matching of `msg` to its request, under the lock: false
  // when nothing more is to be done (a duplicate, a reply from a node that
  // may not answer, an acknowledgement); otherwise the request leaves the
  // tracker into `answered`. `next`: a windowed request let out, to send
  // unlocked.
  bool TakeAnswered(const Message& msg, Answered* answered,
                    std::optional<std::pair<int, Message>>* next)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Counts an answered request's reply (its status, after on_reply) toward
  // its operation, keeping a pulled frame or what a rejoin reply said.
  void CompleteRequest(const Request& request, absl::Status status,
                       Message& reply) ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps the single float32 frame of a pull's reply for Wait to copy to
  // request.out; DataLoss when the reply carries anything else.
  absl::Status KeepPulledFrame(const Request& request, Message& reply, Op* op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A windowed request was answered: the next one held back goes out. Returns it
  // (the node it goes to, message) to send unlocked, if any.
  std::optional<std::pair<int, Message>> TakenLocked(Tracked& t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends a tracked request to node `to` (its first send, or a windowed one
  // let out); without resends a failed send fails the request and its
  // operation.
  void SendOnce(int to, Message msg);
  // A windowed request of `op` to `server` failed for good: the requests its
  // window still holds back fail with it (moved to `dead`, to be released
  // unlocked) and the window is forgotten.
  void DropWindowLocked(uint64_t op, int server, std::vector<Message>* dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until `op` has all its replies and no borrowed frame is held, or the
  // job failed (true), or until `deadline` (false); receives on this thread
  // when it can (see the class comment).
  bool AwaitOp(uint64_t op, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wait gave up on `op` at its deadline: its requests are dropped (moved to
  // `dead`, to be released unlocked) with its windows, and the operation is
  // forgotten unless borrowed frames (`pinned`) still pin it. Returns the
  // servers that did not answer, in the order of their requests.
  std::vector<int> AbandonOpLocked(uint64_t op, int pinned,
                                   std::vector<Message>* dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The latency histogram of an operation by its first request's command
  // (null: none is kept).
  Histogram* LatencyOf(int command) const;
  // Wait's DeadlineExceeded for `what`, naming the silent servers.
  // REQUIRES: mu_ not held (describe_ takes the node's lock).
  absl::Status TimeoutError(const std::string& what,
                            const std::vector<int>& silent_servers) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // A request its server keeps silent about while answering others fails
  // after this many times TESSERA_RESEND_RETRIES sends.
  static constexpr int kUnacknowledgedFactor = 4;
  void ResendLoop();
  // One pass of ResendLoop over the requests: those due go to `resend` (a
  // copy of the message, by server), their waits doubled up to `max_wait`;
  // those at their limit to `expiring` (id, server), for FailExpired.
  void CollectDueLocked(absl::Duration max_wait,
                        std::vector<std::pair<int, Message>>* resend,
                        std::vector<std::pair<uint64_t, int>>* expiring)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the requests (id, server) that ResendLoop found at their limit and
  // that no answer reached since. REQUIRES: mu_ not held.
  void FailExpired(const std::vector<std::pair<uint64_t, int>>& expiring)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The error of a request FailExpired gives up on: Unavailable after its
  // unanswered (or unacknowledged) sends, DeadlineExceeded for a replay past
  // request_timeout. `server_name`: its server, described.
  absl::Status ExpiryError(const Tracked& t, const std::string& server_name,
                           absl::Time now) const;
  // The node a send of `t` goes to now (`msg`: the copy that goes, marked
  // by route_), kept in t.sent_to.
  int AimLocked(Tracked& t, Message* msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `sender` may answer `t`: a node it was sent to.
  static bool MayAnswer(const Tracked& t, int sender);
  // Names the nodes a request was sent to, for a log line.
  // REQUIRES: mu_ not held (describe_ takes the node's lock).
  std::string DescribeAll(const std::vector<int>& nodes) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // A request nobody waits for (op 0: a replay) past request_timeout.
  bool Overdue(const Tracked& t, absl::Time now) const;
  // The message a due request is resent as: a probe (its header, marked,
  // without frames) for an acknowledged push with data; otherwise the
  // request itself (references to the same frames). Counts which.
  Message ResendOf(const Tracked& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A probe's answer said its server lacks the push (send_whole): the push,
  // whole, to send unlocked now (the node it goes to, message; none when it
  // is not probing any more).
  std::optional<std::pair<int, Message>> SendWholeLocked(Tracked& t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `msg` is a push carrying data (its resends may be probes).
  static bool IsPushWithData(const Message& msg);
  // Describes a request for errors: "push of key 3".
  static std::string What(const Message& msg);

  const Options options_;
  const SendFn send_;
  const DescribeFn describe_;
  const OnAnswered on_answered_;
  const ReceiveFn receive_;
  const RouteFn route_;
  std::atomic<uint64_t> next_request_;
  std::atomic<uint64_t> resends_{0};
  std::atomic<uint64_t> probes_{0};
  std::atomic<uint64_t> whole_resends_{0};
  std::atomic<uint64_t> bytes_pulled_{0};
  std::atomic<uint64_t> bytes_pulled_float32_{0};
  std::atomic<uint64_t> wrong_server_replies_{0};

  mutable absl::Mutex mu_;
  std::map<uint64_t, Op> ops_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Tracked> requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint64_t, int>, Window> windows_ ABSL_GUARDED_BY(mu_);
  // When each server last sent this worker anything on the data plane (an
  // answer, an acknowledgement, a late answer to a finished request): a
  // server still answering is busy, not gone, and a request to it is not
  // given up for its silence alone (its operation's deadline still holds).
  std::map<int, absl::Time> heard_ ABSL_GUARDED_BY(mu_);
  uint64_t next_op_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool receiving_ ABSL_GUARDED_BY(mu_) = false;       // a waiter is in receive_
  uint64_t receiver_freed_ ABSL_GUARDED_BY(mu_) = 0;  // ReceiverFree calls

  std::atomic<bool> stop_{false};
  // Wakes the resend thread when the first request is tracked (or at stop):
  // with none tracked it sleeps, so an idle worker does not wake 50 times a
  // second (hundreds of worker processes on one machine add up).
  absl::CondVar resender_cv_;
  std::thread resender_;

  struct Metrics {
    Metrics();
    Histogram* push;
    Histogram* pull;
    Histogram* pushpull;
    Histogram* wait;
    Counter* duplicate_replies;
    Counter* wrong_server_replies;
    Counter* failed_requests;
  };
  const Metrics metrics_;
  CollectorHandles metric_handles_;  // removed before the maps go
  // The requests in flight in /debug/pending; removed before the maps go.
  void FillPending(wire::DebugPending* out) const;
  DebugPendingRegistry::Section pending_section_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_REQUEST_TRACKER_H_
