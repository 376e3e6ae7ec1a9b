#include "worker/client/request_tracker.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/trace.h"
#include "common/wire_status.h"
#include "worker/client/request_trace.h"

namespace tessera {

namespace {

// The longest a waiter stays in one receive: what completes an operation
// without a message (the job's failure noticed by the heart-beat thread, a
// request failed after its last resend) is seen within it.
constexpr absl::Duration kReceiveSlice = absl::Milliseconds(20);

// Adds what one rejoin reply (KV_INIT with rejoin) said to its operation's.
void AddRejoinReply(const wire::Header& h, RequestTracker::RejoinReplies* r) {
  r->resume_min = std::min(r->resume_min, h.push_seq());
  r->resume_max = std::max(r->resume_max, h.push_seq());
  r->open_round_max = std::max(r->open_round_max, h.open_round());
  r->joining = r->joining || h.joining();
  if (h.enter() && h.open_round() > h.enter_round()) r->entry_refused = true;
}

}  // namespace

RequestTracker::Metrics::Metrics() {
  MetricsRegistry& r = MetricsRegistry::Global();
  push = r.GetHistogram(
      "tessera_worker_push_duration_seconds",
      "Push latency: from the push being issued (its 2-bit compression "
      "included) to the last server's reply.",
      LatencyBuckets());
  pull = r.GetHistogram(
      "tessera_worker_pull_duration_seconds",
      "Pull latency: from the pull being issued to the last server's reply.",
      LatencyBuckets());
  pushpull = r.GetHistogram(
      "tessera_worker_pushpull_duration_seconds",
      "Pushpull latency: from the operation being issued to the last "
      "server's reply (in dist_sync, the round's end).",
      LatencyBuckets());
  wait = r.GetHistogram(
      "tessera_worker_wait_duration_seconds",
      "Time callers spent blocked waiting for an operation (Wait).",
      LatencyBuckets());
  duplicate_replies = r.GetCounter(
      "tessera_worker_duplicate_replies_total",
      "Replies dropped because their request was already answered (a "
      "resent request answered twice).");
  wrong_server_replies = r.GetCounter(
      "tessera_worker_wrong_server_replies_total",
      "Replies dropped because they came from a node that may not answer "
      "their request (not a node it was sent to).");
  failed_requests = r.GetCounter(
      "tessera_worker_failed_requests_total",
      "Requests that failed after TESSERA_RESEND_RETRIES unanswered sends.");
}

RequestTracker::RequestTracker(Options options, SendFn send,
                               DescribeFn describe, OnAnswered on_answered,
                               ReceiveFn receive, RouteFn route)
    : options_(options),
      send_(std::move(send)),
      describe_(std::move(describe)),
      on_answered_(std::move(on_answered)),
      receive_(std::move(receive)),
      route_(std::move(route)),
      next_request_(options.first_request_id) {
  if (options_.resend) {
    resender_ = std::thread([this] {
      trace::SetThreadName("resender");
      ResendLoop();
    });
  }
  pending_section_ = DebugPendingRegistry::Global().Add(
      [this](wire::DebugPending* out) { FillPending(out); });
  MetricsRegistry& r = MetricsRegistry::Global();
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_requests_in_flight",
      "Requests sent to servers (or held back by a push's window) and not "
      "yet answered.",
      MetricType::kGauge, [this](MetricSamples* out) {
        absl::MutexLock lock(&mu_);
        out->push_back({{}, static_cast<double>(requests_.size())});
      }));
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_operations_in_flight",
      "Operations (push, pull, init, ...) issued and not yet waited for.",
      MetricType::kGauge, [this](MetricSamples* out) {
        absl::MutexLock lock(&mu_);
        out->push_back({{}, static_cast<double>(ops_.size())});
      }));
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_resends_total",
      "Requests sent again after no answer in time (PS_RESEND_TIMEOUT).",
      MetricType::kCounter, [this](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(resends_.load())});
      }));
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_push_probes_total",
      "Resends of an acknowledged push as a probe: its header only, no data "
      "frames (the server answers, or asks for the push whole).",
      MetricType::kCounter, [this](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(probes_.load())});
      }));
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_push_whole_resends_total",
      "Resends of a push carrying its data: not yet acknowledged, or asked "
      "for by the answer to a probe (the server lacked it).",
      MetricType::kCounter, [this](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(whole_resends_.load())});
      }));
}

RequestTracker::~RequestTracker() {
  metric_handles_.clear();
  {
    absl::MutexLock lock(&mu_);
    stop_.store(true);
    resender_cv_.Signal();
  }
  if (resender_.joinable()) resender_.join();
  // Kept messages may borrow frames whose owners unpin ops: release them
  // before the maps go.
  std::map<uint64_t, Tracked> requests;
  {
    absl::MutexLock lock(&mu_);
    requests.swap(requests_);
  }
  // Their spans end here, unanswered (a trace has no open span).
  for (const auto& [id, t] : requests) TraceRequestEnd(t.msg, 0, false);
}

uint64_t RequestTracker::NewOp() {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  const uint64_t op = next_op_++;
  Op& o = ops_[op];
  o.started = now;
  return op;
}

std::shared_ptr<const void> RequestTracker::Pin(uint64_t op) {
  {
    absl::MutexLock lock(&mu_);
    ++ops_[op].pinned;
  }
  return std::shared_ptr<const void>(nullptr,
                                     [this, op](const void*) { Unpin(op); });
}

void RequestTracker::Unpin(uint64_t op) {
  absl::MutexLock lock(&mu_);
  auto it = ops_.find(op);
  if (it != ops_.end()) --it->second.pinned;
}

void RequestTracker::FailOp(uint64_t op, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  Op& o = ops_[op];
  if (o.status.ok()) o.status = status;
}

void RequestTracker::Send(Request request, Message msg) {
  const uint64_t id = next_request_.fetch_add(1);
  msg.header.set_request_id(id);
  const int server = request.server;
  const uint64_t op = request.op;
  if (trace::Enabled()) TraceRequestBegin(msg, server);
  int to = server;
  {
    absl::MutexLock lock(&mu_);
    if (requests_.empty()) resender_cv_.Signal();
    Tracked& t = requests_[id];
    t.request = request;
    t.msg = msg;  // the header and references to the same frames
    t.first_sent = absl::Now();
    t.last_sent = t.first_sent;
    t.unacknowledged = 1;
    t.wait = options_.resend_timeout;
    t.next_send =
        options_.resend ? t.first_sent + t.wait : absl::InfiniteFuture();
    t.unanswered = 1;
    if (op != 0) {
      Op& o = ops_[op];
      ++o.pending;
      if (o.command == 0) o.command = msg.header.command();
    }
    if (request.window > 0) {
      Window& w = windows_[{op, server}];
      if (w.out >= request.window) {
        t.sent = false;  // goes when an earlier one is taken
        t.next_send = absl::InfiniteFuture();
        w.held.push_back(id);
        return;
      }
      ++w.out;
    }
    to = AimLocked(t, &msg);
  }
  SendOnce(to, std::move(msg));
}

int RequestTracker::AimLocked(Tracked& t, Message* msg) {
  const int to = route_ ? route_(t.request.server, msg) : t.request.server;
  if (std::find(t.sent_to.begin(), t.sent_to.end(), to) == t.sent_to.end())
    t.sent_to.push_back(to);
  return to;
}

void RequestTracker::SendOnce(int to, Message msg) {
  const uint64_t id = msg.header.request_id();
  absl::Status sent = send_(to, std::move(msg));
  if (sent.ok() || options_.resend) return;
  std::vector<Message> dropped;  // released unlocked: may unpin an op
  absl::MutexLock lock(&mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  const Request request = it->second.request;
  dropped.push_back(std::move(it->second.msg));
  requests_.erase(it);
  TraceRequestEnd(dropped.back(), 0, false);
  // Not sent and never resent: what its window holds back would wait for an
  // answer that cannot come.
  if (request.window > 0)
    DropWindowLocked(request.op, request.server, &dropped);
  auto o = request.op == 0 ? ops_.end() : ops_.find(request.op);
  if (o == ops_.end()) return;  // none, or its Wait gave up
  --o->second.pending;
  if (o->second.status.ok()) o->second.status = sent;
}

void RequestTracker::DropWindowLocked(uint64_t op, int server,
                                      std::vector<Message>* dead) {
  auto w = windows_.find({op, server});
  if (w == windows_.end()) return;
  for (uint64_t held : w->second.held) {
    auto h = requests_.find(held);
    if (h == requests_.end()) continue;
    if (op != 0) --ops_[op].pending;
    TraceRequestEnd(h->second.msg, 0, false);
    dead->push_back(std::move(h->second.msg));
    requests_.erase(h);
  }
  windows_.erase(w);
}

std::optional<std::pair<int, Message>> RequestTracker::TakenLocked(Tracked& t) {
  if (t.request.window == 0 || t.taken || !t.sent) return std::nullopt;
  t.taken = true;
  const std::pair<uint64_t, int> id{t.request.op, t.request.server};
  auto w = windows_.find(id);
  if (w == windows_.end()) return std::nullopt;
  --w->second.out;
  while (!w->second.held.empty()) {
    auto next = requests_.find(w->second.held.front());
    w->second.held.pop_front();
    if (next == requests_.end()) continue;  // gone (its Wait gave up)
    Tracked& n = next->second;
    n.sent = true;
    n.first_sent = absl::Now();
    n.last_sent = n.first_sent;
    n.next_send =
        options_.resend ? n.first_sent + n.wait : absl::InfiniteFuture();
    ++w->second.out;
    Message copy = n.msg;
    const int to = AimLocked(n, &copy);
    return std::make_pair(to, std::move(copy));
  }
  if (w->second.out == 0) windows_.erase(w);
  return std::nullopt;
}

void RequestTracker::FillPending(wire::DebugPending* out) const {
  // At most this many, oldest first (a big push has one per slice).
  constexpr size_t kMaxListed = 1000;
  const absl::Time now = absl::Now();
  std::vector<wire::PendingRequest> listed;
  {
    absl::MutexLock lock(&mu_);
    out->set_requests_total(out->requests_total() +
                            static_cast<int32_t>(requests_.size()));
    for (const auto& [id, t] : requests_) {
      if (listed.size() == kMaxListed) break;
      wire::PendingRequest r;
      r.set_command(wire::Command_Name(t.msg.header.command()));
      r.set_key(t.msg.header.slice().key());
      r.set_offset(t.msg.header.slice().offset());
      r.set_server(t.request.server);
      r.set_age_s(absl::ToDoubleSeconds(now - t.first_sent));
      r.set_resends(t.resends);
      r.set_request_id(id);
      listed.push_back(std::move(r));
    }
  }
  // Described unlocked: describe_ takes the node's lock.
  for (wire::PendingRequest& r : listed) {
    r.set_server_name(describe_(r.server()));
    *out->add_requests() = std::move(r);
  }
}

std::string RequestTracker::What(const Message& msg) {
  const char* verb = "request";
  switch (msg.header.command()) {
    case wire::KV_INIT:
      verb = "init";
      break;
    case wire::KV_PUSH:
      verb = "push";
      break;
    case wire::KV_PULL:
      verb = "pull";
      break;
    case wire::KV_PUSHPULL:
      verb = "pushpull";
      break;
    case wire::KV_SET_OPTIMIZER:
      return "set_optimizer";
    case wire::KV_SET_COMPRESSION:
      return "set_gradient_compression";
    case wire::KV_FINISH:
      return "goodbye";
    case wire::KV_STATS:
      return "stats";
    default:
      break;
  }
  return absl::StrCat(verb, " of key ", msg.header.slice().key());
}

void RequestTracker::HandleReply(Message&& msg) {
  const wire::Header& h = msg.header;
  if (!h.is_response()) {
    TESSERA_LOG(WARNING) << "dropped unexpected message " << DebugString(msg);
    return;
  }
  Answered answered;
  std::optional<std::pair<int, Message>> next;  // a windowed one let out
  const bool answers = TakeAnswered(msg, &answered, &next);
  if (next.has_value()) SendOnce(next->first, std::move(next->second));
  if (!answers) return;
  if (trace::Enabled())
    TraceRequestEnd(answered.msg, DataBytes(msg), h.status().code() == 0);
  // Keeps a copy for a replay while the request's borrowed frames still pin
  // the operation (its caller cannot have reused the memory yet).
  if (on_answered_) on_answered_(answered, h);
  absl::Status reply_status = FromWire(h.status());
  const wire::Command asked = answered.msg.header.command();
  if (!reply_status.ok() && h.push_untaken() &&
      (asked == wire::KV_PUSH || asked == wire::KV_PUSHPULL))
    reply_status.SetPayload(kPushUntakenPayload, absl::Cord());
  if (reply_status.ok() && answered.request.on_reply) {
    reply_status = answered.request.on_reply(msg);
    if (reply_status.ok()) {
      for (const Buffer& b : msg.data) bytes_pulled_ += b.size();
      bytes_pulled_float32_ += answered.request.length * sizeof(float);
    }
  }
  CompleteRequest(answered.request, reply_status, msg);
  // `answered` goes here, unlocked: it may unpin the operation.
}

bool RequestTracker::TakeAnswered(
    const Message& msg, Answered* answered,
    std::optional<std::pair<int, Message>>* next) {
  const wire::Header& h = msg.header;
  absl::ReleasableMutexLock lock(&mu_);
  heard_[h.sender()] = absl::Now();
  auto it = requests_.find(h.request_id());
  if (it == requests_.end()) {
    // A second answer to a resent request.
    TESSERA_VLOG(1) << "dropped answer to a finished request "
                    << DebugString(msg);
    if (!h.ack_only() && !h.send_whole())
      metrics_.duplicate_replies->Increment();
    return false;
  }
  if (!MayAnswer(it->second, h.sender())) {
    // A compromised or confused node answering for another server (a
    // backup for its primary included): its reply (or acknowledgement)
    // neither completes nor keeps alive a request; the real server's answer
    // still counts.
    metrics_.wrong_server_replies->Increment();
    const uint64_t n = ++wrong_server_replies_;
    const std::vector<int> sent_to = it->second.sent_to;
    lock.Release();  // describe_ takes the node's lock
    if (LogOccurrence(n)) {
      TESSERA_LOG(WARNING) << "dropped reply #" << n << " to request "
                           << h.request_id() << " from "
                           << describe_(h.sender()) << ": it was sent to "
                           << DescribeAll(sent_to)
                           << " only: " << DebugString(msg);
    }
    return false;
  }
  // An answer from where a request was re-aimed (a fail-over, a hand-back,
  // a one-copy slice that moved) is a sign of life of its server's route
  // too.
  heard_[it->second.request.server] = heard_[h.sender()];
  if (h.send_whole()) {
    // A probe's answer: the server lacks the push (no answer either); it
    // goes whole, now.
    *next = SendWholeLocked(it->second);
    return false;
  }
  // The window moves with answers, not acknowledgements: a server answers
  // a dist_sync slice when its round completes, so a worker is never more
  // than its window ahead of the slowest (the slices a server has open).
  if (!h.ack_only()) *next = TakenLocked(it->second);
  if (h.ack_only()) {
    // The server has it and is holding it: keep asking, at the current
    // (doubled) interval, in case the final reply is lost; a push by probes.
    it->second.acknowledged = IsPushWithData(it->second.msg);
    it->second.unanswered = 0;
    it->second.unacknowledged = 0;
    if (options_.resend) it->second.next_send = absl::Now() + it->second.wait;
    return false;
  }
  answered->request = it->second.request;
  answered->msg = std::move(it->second.msg);
  requests_.erase(it);
  return true;
}

void RequestTracker::CompleteRequest(const Request& request,
                                     absl::Status status, Message& reply) {
  absl::MutexLock lock(&mu_);
  auto found = request.op == 0 ? ops_.end() : ops_.find(request.op);
  if (found == ops_.end()) return;  // gone: its Wait gave up at the deadline
  Op& op = found->second;
  if (status.ok() && request.rejoin) AddRejoinReply(reply.header, &op.rejoin);
  if (status.ok() && request.out != nullptr)
    status = KeepPulledFrame(request, reply, &op);
  // The first error, unless a later part's refusal left its push's number
  // untaken: that one stays with the key (KVClient::Wait).
  if (!status.ok() &&
      (op.status.ok() || (PushUntaken(status) && !PushUntaken(op.status))))
    op.status = status;
  if (--op.pending == 0) op.done = absl::Now();
}

absl::Status RequestTracker::KeepPulledFrame(const Request& request,
                                             Message& reply, Op* op) {
  const wire::Header& h = reply.header;
  if (reply.data.size() != 1 ||
      h.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
      h.frames(0).num_values() != request.length) {
    return absl::DataLossError(absl::StrCat("reply from node ", h.sender(),
                                            " does not carry ", request.length,
                                            " float values"));
  }
  bytes_pulled_ += reply.data[0].size();
  bytes_pulled_float32_ += reply.data[0].size();
  op->pulled.push_back(PulledFrame{request.out, std::move(reply.data[0])});
  return absl::OkStatus();
}

bool RequestTracker::MayAnswer(const Tracked& t, int sender) {
  return std::find(t.sent_to.begin(), t.sent_to.end(), sender) !=
         t.sent_to.end();
}

std::string RequestTracker::DescribeAll(const std::vector<int>& nodes) const {
  if (nodes.empty()) return "no node yet";
  std::string out;
  for (int node : nodes)
    absl::StrAppend(&out, out.empty() ? "" : " and ", describe_(node));
  return out;
}

absl::Status RequestTracker::Wait(uint64_t op_id, const std::string& what,
                                  RejoinReplies* rejoin) {
  trace::Span span("kv", "wait");
  span.Arg("op", static_cast<int64_t>(op_id));
  const absl::Time wait_start = absl::Now();
  Histogram* latency = nullptr;
  absl::Duration took;
  std::vector<PulledFrame> pulled;
  std::vector<Message> dead;  // released unlocked: may unpin an op
  absl::Status status;
  bool timed_out = false;
  std::vector<int> silent_servers;  // named unlocked: describe_ locks
  {
    absl::MutexLock lock(&mu_);
    auto it = ops_.find(op_id);
    if (it == ops_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown operation handle ", op_id));
    }
    const bool finished =
        AwaitOp(op_id, absl::Now() + options_.request_timeout);
    Op result = std::move(ops_.at(op_id));
    if (!finished) {
      timed_out = true;
      silent_servers = AbandonOpLocked(op_id, result.pinned, &dead);
    } else {
      ops_.erase(op_id);
      if (!result.status.ok()) {
        status = result.status;
      } else if (result.pending != 0) {
        status = failure_;
      } else {
        pulled = std::move(result.pulled);
        if (rejoin != nullptr) *rejoin = result.rejoin;
        latency = LatencyOf(result.command);
        took = result.done - result.started;
      }
    }
  }
  if (timed_out) status = TimeoutError(what, silent_servers);
  if (latency != nullptr && took >= absl::ZeroDuration())
    latency->ObserveDuration(took);
  metrics_.wait->ObserveDuration(absl::Now() - wait_start);
  for (const PulledFrame& f : pulled)
    std::memcpy(f.out, f.values.data(), f.values.size());
  return status;
}

std::vector<int> RequestTracker::AbandonOpLocked(uint64_t op_id, int pinned,
                                                 std::vector<Message>* dead) {
  std::vector<int> silent_servers;
  for (auto r = requests_.begin(); r != requests_.end();) {
    if (r->second.request.op != op_id) {
      ++r;
      continue;
    }
    if (std::find(silent_servers.begin(), silent_servers.end(),
                  r->second.request.server) == silent_servers.end()) {
      silent_servers.push_back(r->second.request.server);
    }
    TraceRequestEnd(r->second.msg, 0, false);
    dead->push_back(std::move(r->second.msg));
    r = requests_.erase(r);
  }
  std::erase_if(windows_,
                [op_id](const auto& w) { return w.first.first == op_id; });
  if (pinned == 0) {
    ops_.erase(op_id);
  } else {
    ops_.at(op_id).pinned = pinned;
  }
  return silent_servers;
}

Histogram* RequestTracker::LatencyOf(int command) const {
  switch (command) {
    case wire::KV_PUSH:
      return metrics_.push;
    case wire::KV_PULL:
      return metrics_.pull;
    case wire::KV_PUSHPULL:
      return metrics_.pushpull;
    default:
      return nullptr;
  }
}

absl::Status RequestTracker::TimeoutError(
    const std::string& what, const std::vector<int>& silent_servers) const {
  std::string silent;
  for (int server : silent_servers)
    absl::StrAppend(&silent, silent.empty() ? "" : ", ", describe_(server));
  return absl::DeadlineExceededError(absl::StrCat(
      what, ": no reply from ", silent.empty() ? "the servers" : silent,
      " within ", absl::FormatDuration(options_.request_timeout),
      " (TESSERA_TIMEOUT)"));
}

bool RequestTracker::AwaitOp(uint64_t op_id, absl::Time deadline) {
  auto done = [this, op_id]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const Op& o = ops_.at(op_id);
    // After a failure, return at once: the borrowed memory is never read
    // again, because the job is over.
    return (o.pending == 0 && o.pinned == 0) || !failure_.ok();
  };
  bool may_receive = receive_ != nullptr;
  // Whether this waiter should receive: its replies are due and no other
  // waiter is receiving.
  auto my_turn = [this, op_id, &may_receive]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return may_receive && !receiving_ && ops_.at(op_id).pending > 0;
  };
  while (!done()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    if (!my_turn()) {
      // Another waiter receives and dispatches this operation's replies, or
      // they all came and the transport still holds a borrowed frame; take
      // over when that waiter leaves.
      auto woken = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return done() || my_turn();
      };
      mu_.AwaitWithDeadline(absl::Condition(&woken), deadline);
      continue;
    }
    receiving_ = true;
    const uint64_t freed = receiver_freed_;
    mu_.Unlock();
    const Node::ReceiveResult r =
        receive_(std::min(deadline - now, kReceiveSlice));
    mu_.Lock();
    receiving_ = false;
    if (r == Node::ReceiveResult::kClosed) {
      may_receive =
          false;  // the node stopped: wait for FailAll or the deadline
    } else if (r == Node::ReceiveResult::kBusy) {
      // The node's receiver thread is receiving: it dispatches this
      // operation's replies, or steps aside after its current receive.
      auto woken = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return done() || receiver_freed_ != freed;
      };
      mu_.AwaitWithDeadline(absl::Condition(&woken), deadline);
    }
  }
  return true;
}

void RequestTracker::ReceiverFree() {
  absl::MutexLock lock(&mu_);
  ++receiver_freed_;
}

void RequestTracker::FailAll(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  failure_ = status;
  for (auto& [id, op] : ops_) {
    if (op.status.ok()) op.status = status;
  }
}

}  // namespace tessera