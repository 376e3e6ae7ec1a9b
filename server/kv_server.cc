#include "server/kv_server.h"

#include <cmath>
#include <cstring>
#include <new>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/bounded_queue.h"
#include "common/logging.h"
#include "common/send_order.h"
#include "common/trace.h"
#include "common/wire_status.h"
#include "server/key_store.h"
#include "server/kv_server_shard.h"
#include "server/pull_shadow.h"

namespace tessera {
namespace {

// Messages up to this many data bytes are processed on Handle's thread when
// their shard is idle.
constexpr size_t kInlineBytes = 64 << 10;

// Updates from a slice's primary up to this many data bytes are applied on
// Handle's thread when their shard is idle.
constexpr size_t kInlineReplicaBytes = 4 << 20;

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

uint64_t DataBytes(const Message& msg) {
  uint64_t bytes = 0;
  for (const Buffer& b : msg.data) bytes += b.size();
  return bytes;
}

}  // namespace

KVServer::KVServer(int num_workers, int num_threads, SendFn send,
                   WaitingLimits limits, SyncRound::Mode sum_mode,
                   RoundWatch::Options watch)
    : num_workers_(num_workers),
      send_(std::move(send)),
      limits_(limits),
      chain_rng_(std::random_device()() ^
                 static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()))),
      round_duration_(MetricsRegistry::Global().GetHistogram(
          "tessera_server_round_duration_seconds",
          "dist_sync: from a round's first push to its completion (every "
          "worker's push summed and the update applied), per key.",
          DurationBuckets())),
      update_duration_(MetricsRegistry::Global().GetHistogram(
          "tessera_server_update_duration_seconds",
          "Time to apply one update to a key slice (the optimizer, or the "
          "round's sum becoming the value).",
          LatencyBuckets())),
      watch_(num_workers, watch),
      ssp_stats_(num_workers) {
  StartUpdateThreads(num_threads, sum_mode);
  RegisterCounters();
  RegisterGauges();
  pending_section_ = DebugPendingRegistry::Global().Add(
      [this](wire::DebugPending* out) { FillPending(out); });
}

void KVServer::StartUpdateThreads(int num_threads, SyncRound::Mode sum_mode) {
  if (num_threads < 1) num_threads = 1;
  for (int i = 0; i < num_threads; ++i)
    shards_.push_back(std::make_unique<Shard>(num_workers_, limits_, sum_mode));
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this, i, shard = shards_[i].get()] {
      trace::SetThreadName(absl::StrCat("update ", i));
      Run(shard);
    });
  }
}

KVServer::~KVServer() { Stop(); }

void KVServer::Stop() {
  if (stopped_.exchange(true)) return;
  catch_up_.Stop();
  for (auto& shard : shards_) shard->queue.Close();
  for (std::thread& t : threads_) t.join();
}

KVServer::Settings KVServer::settings() const {
  absl::MutexLock lock(&settings_mu_);
  return settings_;
}

KVServer::Shard* KVServer::ShardOf(uint64_t key) const {
  return shards_[Mix(key) % shards_.size()].get();
}

void KVServer::Acknowledge(const Message& request) {
  Message ack;
  ack.header.set_command(request.header.command());
  ack.header.set_request_id(request.header.request_id());
  ack.header.set_is_response(true);
  ack.header.set_ack_only(true);
  SendReply(request, std::move(ack));
}

bool KVServer::IsProbe(const Message& msg) {
  const wire::Command cmd = msg.header.command();
  return msg.header.probe() &&
         (cmd == wire::KV_PUSH || cmd == wire::KV_PUSHPULL);
}

void KVServer::AskForWhole(const Message& probe) {
  ++probes_sent_whole_;
  TESSERA_VLOG(1) << "probe for push " << probe.header.push_seq() << " of node "
                  << probe.header.sender() << " to key "
                  << probe.header.slice().key() << " offset "
                  << probe.header.slice().offset()
                  << ": not held here; asked for it whole";
  Message reply;
  reply.header.set_command(probe.header.command());
  reply.header.set_request_id(probe.header.request_id());
  reply.header.set_is_response(true);
  reply.header.set_send_whole(true);
  SendReply(probe, std::move(reply));
}

void KVServer::AnswerProbe(StoredKey* key, Message& msg) {
  // Taken before (the ledger counts it): TryProcess answers it as a resent
  // copy (acknowledged in its open round, answered after it), unless this
  // server is a backup not yet answering for the slice: then the whole push
  // is held like any request it gets, and answered once it does.
  const bool taken =
      key->ledger.Classify(RankOfId(msg.header.sender()),
                           msg.header.push_seq()) == PushLedger::kDuplicate;
  if (taken && TryProcess(key, msg)) return;
  AskForWhole(msg);
}

Message KVServer::NewReply(const Message& request, const absl::Status& status,
                           const StoredKey* key) {
  Message reply;
  reply.header.set_command(request.header.command());
  reply.header.set_request_id(request.header.request_id());
  reply.header.set_is_response(true);
  reply.header.set_push_seq(request.header.push_seq());
  if (request.header.has_slice())
    *reply.header.mutable_slice() = request.header.slice();
  if (request.header.rejoin()) {
    // Elastic joins: the entry asked, and where the slice's rounds are.
    reply.header.set_enter(request.header.enter());
    reply.header.set_enter_round(request.header.enter_round());
    reply.header.set_open_round(request.header.open_round());
    reply.header.set_joining(request.header.joining());
  }
  if (key != nullptr && checkpointing_.load()) {
    reply.header.set_checkpointing(true);
    reply.header.set_durable_seq(
        key->ledger.durable(RankOfId(request.header.sender())));
  }
  if (!status.ok()) {
    ToWire(status, reply.header.mutable_status());
    ++errors_;
    if (absl::IsResourceExhausted(status)) ++refused_;
    TESSERA_VLOG(1) << "error reply to node " << request.header.sender() << ": "
                    << status.message();
  }
  if (request.header.command() == wire::KV_STATS)
    *reply.header.mutable_kv_stats() = stats();
  return reply;
}

void KVServer::SendReply(const Message& request, Message reply) {
  // As urgent as its request (docs/priority.md). Only a reply about the
  // key's slice: one without it (an acknowledgement, a request for the whole
  // push) could otherwise pass that key's earlier replies.
  if (request.header.has_priority() && !reply.header.has_priority() &&
      reply.header.has_slice())
    reply.header.set_priority(request.header.priority());
  absl::Status sent = send_(request.header.sender(), std::move(reply));
  if (!sent.ok()) {
    const uint64_t n = ++failed_replies_;
    if (LogOccurrence(n)) {
      TESSERA_LOG(WARNING) << "reply to node " << request.header.sender()
                           << " not sent (#" << n << "): " << sent.message();
    }
  }
}

void KVServer::DropMalformed(const std::string& what, const Message& msg) {
  const uint64_t n = ++malformed_;
  // Throttled on its own count: the drops counted without a warning (a
  // request without a slice, say) must not use up the logged ones.
  if (const uint64_t w = ++malformed_warnings_; LogOccurrence(w)) {
    TESSERA_LOG(WARNING) << "dropped " << what << " (malformed message #" << n
                         << ", warning #" << w
                         << "; logged: the first 20, then at powers of two): "
                         << DebugString(msg);
  }
}

void KVServer::Reply(const Message& request, const absl::Status& status,
                     Buffer values, const StoredKey* key) {
  Message reply = NewReply(request, status, key);
  if (!values.empty()) AddFloatFrame(&reply, std::move(values));
  SendReply(request, std::move(reply));
}

void KVServer::RefuseUntaken(const Message& request, const absl::Status& why) {
  Message reply = NewReply(request, why, nullptr);
  const wire::Command cmd = request.header.command();
  if (cmd == wire::KV_PUSH || cmd == wire::KV_PUSHPULL)
    reply.header.set_push_untaken(true);
  SendReply(request, std::move(reply));
}

uint64_t KVServer::NewChain() {
  absl::MutexLock lock(&chain_mu_);
  uint64_t chain;
  do {
    chain = chain_rng_();
  } while (chain == 0);
  return chain;
}

void KVServer::Handle(Message&& msg) {
  if (TakeServerMessage(msg)) return;
  const wire::Header& h = msg.header;
  if (h.is_response()) {
    DropMalformed("unexpected reply", msg);
    return;
  }
  if (!IsWorkerId(h.sender()) || RankOfId(h.sender()) >= num_workers_) {
    DropMalformed(absl::StrCat("message from non-worker node ", h.sender()),
                  msg);
    return;
  }
  if (!left_workers_.empty() &&
      left_workers_.count(RankOfId(h.sender())) != 0) {
    RefuseUntaken(msg, NotInJob(RankOfId(h.sender())));
    return;
  }
  switch (h.command()) {
    case wire::KV_SET_OPTIMIZER:
    case wire::KV_SET_COMPRESSION:
    case wire::KV_STATS:
      HandleSettings(std::move(msg));
      return;
    case wire::KV_FINISH:
      WorkerFinished(msg);
      return;
    case wire::KV_INIT:
    case wire::KV_PUSH:
    case wire::KV_PULL:
    case wire::KV_PUSHPULL:
      break;
    default:
      DropMalformed("unexpected message", msg);
      return;
  }
  RouteSliceRequest(std::move(msg));
}

bool KVServer::TakeServerMessage(Message& msg) {
  const wire::Header& h = msg.header;
  if (h.command() == wire::KV_TRANSFER && replicas_ > 1 &&
      IsServerId(h.sender()) && RankOfId(h.sender()) < num_servers_ &&
      RankOfId(h.sender()) != rank_) {
    if (h.has_slice()) {
      Enqueue(ShardOf(h.slice().key()),
              std::move(msg));  // a slice, or its answer
    } else if (h.is_response()) {
      TransferCounted(RankOfId(h.sender()), msg);
    } else {
      TransferRequested(RankOfId(h.sender()), h);
    }
    return true;
  }
  if (h.command() == wire::KV_REPLICATE && replicas_ > 1 &&
      IsServerId(h.sender()) && RankOfId(h.sender()) < num_servers_ &&
      h.has_slice()) {
    // Between the servers of a chain: an update, or a backup's answer. An
    // update is applied on this thread when its shard is idle, up to
    // kInlineReplicaBytes: its primary's answers wait for it, so the hand-off
    // to the update thread would be on every round's path.
    Shard* shard = ShardOf(h.slice().key());
    if (shard->pending.load(std::memory_order_acquire) == 0 &&
        !stopped_.load() && DataBytes(msg) <= kInlineReplicaBytes) {
      ProcessMessage(shard, std::move(msg));
      return true;
    }
    Enqueue(shard, std::move(msg));
    return true;
  }
  return false;
}

void KVServer::WorkerFinished(const Message& msg) {
  const int rank = RankOfId(msg.header.sender());
  const bool first = finished_workers_.insert(rank).second;
  Reply(msg, absl::OkStatus());
  if (first && elastic_) LeaveRounds(rank);
  if (first) CheckWorkersFinished();
}

void KVServer::RouteSliceRequest(Message&& msg) {
  const wire::Header& h = msg.header;
  if (!h.has_slice()) {
    ++malformed_;
    Reply(msg, absl::DataLossError("key-value message without a key slice"));
    return;
  }
  if (h.command() == wire::KV_INIT && !h.rejoin()) num_keys_.fetch_add(1);
  Shard* shard = ShardOf(h.slice().key());
  // An idle shard's cheap message is processed here: the hand-off to the update
  // thread (a wake-up, tens of microseconds on a loaded machine) would cost
  // more than the work. The key's messages stay in arrival order: nothing of
  // this shard is queued or being processed.
  if (shard->pending.load(std::memory_order_acquire) == 0 && !stopped_.load() &&
      ProcessInline(msg)) {
    ProcessMessage(shard, std::move(msg));
    return;
  }
  Enqueue(shard, std::move(msg));
}

void KVServer::Enqueue(Shard* shard, Message&& msg) {
  const uint64_t bytes = DataBytes(msg);
  shard->pending.fetch_add(1, std::memory_order_relaxed);
  const OrderTag order = OrderTagOf(msg.header);
  if (!shard->queue.Push(Shard::Work{std::move(msg), nullptr}, bytes, order))
    shard->pending.fetch_sub(1, std::memory_order_relaxed);
}

void KVServer::Post(Shard* shard, std::function<void(Shard*)> task) {
  shard->pending.fetch_add(1, std::memory_order_relaxed);
  if (!shard->queue.Push(Shard::Work{Message(), std::move(task)}))
    shard->pending.fetch_sub(1, std::memory_order_relaxed);
}

bool KVServer::ProcessInline(const Message& msg) const {
  // Cheap: a pull (its reply shares the weights), a small message, or a float32
  // push that needs no arithmetic (one worker, no optimizer: the pushed frame
  // becomes the weights). Anything else runs on the update threads, in
  // parallel.
  const wire::Command cmd = msg.header.command();
  if (cmd == wire::KV_PULL) return true;
  if (DataBytes(msg) <= kInlineBytes) return true;
  if (cmd != wire::KV_PUSH && cmd != wire::KV_PUSHPULL) return false;
  if (num_workers_ != 1 || msg.header.frames_size() != 1 ||
      msg.header.frames(0).encoding() != wire::DataFrame::FLOAT32) {
    return false;
  }
  absl::MutexLock lock(&settings_mu_);
  return settings_.optimizer == nullptr;
}

void KVServer::HandleSettings(Message&& msg) {
  const wire::Header& h = msg.header;
  if (h.command() == wire::KV_STATS) {
    Reply(msg, absl::OkStatus());
    return;
  }
  absl::Status status;
  {
    absl::MutexLock lock(&settings_mu_);
    const bool keys_exist = num_keys_.load() > 0;
    if (h.command() == wire::KV_SET_OPTIMIZER) {
      absl::StatusOr<std::unique_ptr<Optimizer>> opt =
          Optimizer::Create(h.kv_options().optimizer_spec());
      if (!opt.ok()) {
        status = opt.status();
      } else {
        const std::string spec = *opt ? (*opt)->spec() : "none";
        if (spec != settings_.optimizer_spec) {
          if (keys_exist) {
            status = absl::FailedPreconditionError(absl::StrCat(
                "the optimizer must be set before keys are initialised (server "
                "has '",
                settings_.optimizer_spec, "', asked for '", spec, "')"));
          } else {
            settings_.optimizer =
                std::shared_ptr<const Optimizer>(std::move(*opt));
            settings_.optimizer_spec = spec;
            TESSERA_VLOG(1) << "optimizer: " << spec;
          }
        }
      }
    } else {
      const std::string& type = h.kv_options().compression_type();
      const float t = h.kv_options().compression_threshold();
      if (type != "2bit" && type != "none") {
        status = absl::InvalidArgumentError(
            absl::StrCat("unknown gradient compression '", type,
                         "': expected 2bit or none"));
      } else if (type == "2bit" && !(t > 0 && std::isfinite(t))) {
        status = absl::InvalidArgumentError(absl::StrCat(
            "2-bit compression threshold ", t, ": expected a number > 0"));
      } else if (type != settings_.compression ||
                 (type == "2bit" && t != settings_.threshold)) {
        if (keys_exist) {
          status = absl::FailedPreconditionError(
              "gradient compression must be set before keys are initialised");
        } else {
          settings_.compression = type;
          settings_.threshold = type == "2bit" ? t : 0;
          TESSERA_VLOG(1) << "gradient compression: " << type << " threshold "
                          << t;
        }
      }
    }
  }
  Reply(msg, status);
}

void KVServer::Run(Shard* shard) {
  while (std::optional<Shard::Work> work = shard->queue.Pop()) {
    shard->phase_since_ns.store(absl::GetCurrentTimeNanos(),
                                std::memory_order_relaxed);
    if (work->task) {
      shard->phase.store(-1, std::memory_order_relaxed);
      work->task(shard);
    } else {
      shard->phase_key.store(work->msg.header.slice().key(),
                             std::memory_order_relaxed);
      shard->phase.store(work->msg.header.command(), std::memory_order_relaxed);
      ProcessMessage(shard, std::move(work->msg));
    }
    shard->phase.store(0, std::memory_order_relaxed);
    shard->phase_since_ns.store(absl::GetCurrentTimeNanos(),
                                std::memory_order_relaxed);
    shard->pending.fetch_sub(1, std::memory_order_release);
  }
}

void KVServer::ReportWaiting(StoredKey* key) {
  const size_t n = key->waiting.size();
  if (n == key->reported_waiting) return;
  key->reported_waiting = n;
  watch_.Waiting(key->key, key->offset, n);
}

void KVServer::Process(Shard* shard, Message&& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  if (msg.header.command() == wire::KV_REPLICATE) {
    if (msg.header.is_response()) {
      ReplicaAnswered(shard, msg);
    } else {
      TakeReplica(shard, std::move(msg));
    }
    return;
  }
  if (msg.header.command() == wire::KV_TRANSFER) {
    if (msg.header.is_response()) {
      TransferAnswered(shard, msg);
    } else {
      TakeTransfer(shard, std::move(msg));
    }
    return;
  }
  if (msg.header.command() == wire::KV_INIT) {
    if (msg.header.rejoin()) {
      Rejoin(shard, std::move(msg));
    } else {
      Init(shard, std::move(msg));
    }
    return;
  }
  StoredKey* key = shard->store.Find(slice);
  if (key == nullptr) {
    AnswerUnknownSlice(shard, std::move(msg));
    return;
  }
  if (absl::Status same = key->CheckSlice(slice); !same.ok()) {
    RefuseUntaken(msg, same);
    return;
  }
  ProcessRequest(shard, key, std::move(msg));
}

void KVServer::AnswerUnknownSlice(Shard* shard, Message&& msg) {
  const wire::KeySlice& slice = msg.header.slice();
  if (shard->moved_away.count({slice.key(), slice.offset()}) != 0) {
    TESSERA_VLOG(1) << "dropped " << wire::Command_Name(msg.header.command())
                    << " of key " << slice.key() << " offset " << slice.offset()
                    << ": the slice moved to another server";
    return;
  }
  if (IsProbe(msg)) {
    // Held as an orphan (a recovering server), or lost.
    if (recovering_.load() &&
        shard->store.HoldsOrphan(slice, msg.header.sender(),
                                 msg.header.request_id(),
                                 msg.header.generation())) {
      Acknowledge(msg);
    } else {
      AskForWhole(msg);
    }
    return;
  }
  if (recovering_.load()) {
    // Restarted: the worker replaying this may be ahead of the init that
    // recreates the key. Hold it (once per request) and say so.
    bool duplicate = false;
    absl::Status held = shard->store.HoldOrphan(slice, msg, &duplicate);
    if (held.ok()) {
      Acknowledge(msg);
    } else {
      RefuseUntaken(msg, held);
    }
    return;
  }
  RefuseUntaken(msg, absl::NotFoundError(absl::StrCat(
                         "key ", slice.key(), " was never initialised")));
}

void KVServer::ProcessRequest(Shard* shard, StoredKey* key, Message&& msg) {
  // Keep each worker's messages in order behind its waiting ones; a resent
  // copy of a waiting message is acknowledged, not queued twice. A push
  // numbered at or below what the server expects from its worker goes first:
  // whatever of that worker waits came after it (a push that overtook it, and
  // what followed that).
  const int sender = msg.header.sender();
  if (key->waiting.Holds(sender, msg.header.request_id(),
                         msg.header.generation())) {
    ++duplicates_;
    Acknowledge(msg);
    if (!key->unacked.empty()) ResendUpdates(shard, key);
    return;
  }
  if (IsProbe(msg)) {
    AnswerProbe(key, msg);
    if (!key->unacked.empty()) ResendUpdates(shard, key);
    return;
  }
  const bool is_push = msg.header.command() == wire::KV_PUSH ||
                       msg.header.command() == wire::KV_PUSHPULL;
  const bool in_order =
      is_push &&
      key->ledger.Classify(RankOfId(sender), msg.header.push_seq()) !=
          PushLedger::kAhead;
  if ((key->waiting.HasWaiting(sender) && !in_order) || !TryProcess(key, msg)) {
    Hold(key, std::move(msg));
  }
  Replay(key);
  // A worker asking again may be waiting for an update a backup has not
  // answered (lost with a connection): send it again, at most once per
  // PS_RESEND_TIMEOUT, doubling.
  if (!key->unacked.empty()) ResendUpdates(shard, key);
}

void KVServer::Hold(StoredKey* key, Message&& msg) {
  absl::Status held = key->waiting.Hold(key->key, msg);
  if (!held.ok()) {
    // A push taken before keeps its number (a dist_ssp pushpull applied,
    // its answer waiting for the bound); any other was never taken.
    const bool taken =
        key->ledger.Classify(RankOfId(msg.header.sender()),
                             msg.header.push_seq()) == PushLedger::kDuplicate;
    if (taken) {
      Reply(msg, held);
    } else {
      RefuseUntaken(msg, held);
    }
  }
  ReportWaiting(key);
}

void KVServer::ProcessMessage(Shard* shard, Message&& msg) {
  Process(shard, std::move(msg));
  if (shard->handback != nullptr) CheckYield(shard);
}

// --- State transfer to a replacement (server/replication.h) ---------------

}  // namespace tessera
