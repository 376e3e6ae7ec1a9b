#include "worker/client/kv_client.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/compression/bf16.h"
#include "common/compression/two_bit.h"
#include "common/hashed_spec.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/trace.h"
#include "worker/client/pulled_value_rep.h"

namespace tessera {
namespace {

// What the workers of a job together keep in flight to one server of one
// big push, in bytes: each worker's share, in slices, is its window (at least
// one). A server therefore holds about this much of a push in flight however
// many workers push at once.
constexpr int64_t kServerInflightBytes = int64_t{64} << 20;

// A row-sparse key's part on a server is cut into slices of about this many
// chunks of rows (64 MiB of rows with the default 1 MiB TESSERA_CHUNK_BYTES):
// each slice is a round of its own, so a server sums and applies one slice of
// a push while the next arrives, and the worker copies one slice of a pull
// while the server gathers the next; a push of a few rows still goes as a few
// messages.
constexpr uint64_t kRowSliceChunks = 64;

int PushWindow(const Options& options) {
  const int64_t share =
      kServerInflightBytes /
      (int64_t{std::max(1, options.num_workers)} * options.chunk_bytes);
  return static_cast<int>(std::clamp<int64_t>(share, 1, 64));
}

// A row push's slices to one server carry only the rows they name, from a
// few bytes to kRowSliceChunks chunks each. Its slices go at most this many
// bytes (over the largest slice, at least two slices) at a time, so that what
// the worker sends next (its pull of the same rows, issued right after the
// push: kv.push(); kv.pull()) is not queued behind the whole push on the
// connection: the server answers the pull of one slice while the next slices
// of the push arrive. (At 16 slices of 6.4 MB sent at once, every pull request
// reached the server after the last push, 30 ms into an 80 ms push + pull.)
constexpr uint64_t kRowPushInflightChunks = 16;

// The tag of the workers' barrier that ends the init of `key`.
std::string InitBarrier(uint64_t key) { return absl::StrCat("init ", key); }

}  // namespace

absl::StatusOr<std::unique_ptr<KVClient>> KVClient::Create(
    const Options& options, bool sync, std::unique_ptr<Transport> transport) {
  if (options.role != Role::kWorker) {
    return absl::InvalidArgumentError(
        absl::StrCat("DMLC_ROLE='", RoleName(options.role),
                     "': a KV store client must be a worker"));
  }
  std::unique_ptr<KVClient> client(new KVClient(options, sync));
  TESSERA_RETURN_IF_ERROR(client->Start(std::move(transport)));
  return client;
}

KVClient::KVClient(const Options& options, bool sync)
    : options_(options),
      sync_(sync),
      partitioner_(options.num_servers, options.bigarray_bound),
      routes_(options.num_servers, options.chain_length(),
              options.single_copy) {}

KVClient::~KVClient() {
  metric_handles_.clear();
  // The node's threads call into the tracker: stop them first. The tracker's
  // resend thread then finds the node stopped (its sends fail).
  if (node_ != nullptr) node_->Stop();
  tracker_.reset();
}

absl::Status KVClient::Start(std::unique_ptr<Transport> transport) {
  RequestTracker::Options tracking;
  tracking.resend = options_.resend;
  tracking.resend_timeout = options_.resend_timeout;
  tracking.resend_retries = options_.resend_retries;
  tracking.request_timeout = options_.request_timeout;
  tracking.first_request_id = FirstRequestId(options_.restart_count);
  tracking.chain_length = options_.chain_length();
  tracking.num_servers = options_.num_servers;
  tracker_ = std::make_unique<RequestTracker>(
      tracking,
      [this](int server, Message msg) {
        const int to = routes_.Route(server, &msg);
        return node_->Send(to, std::move(msg));
      },
      [this](int node) { return node_->Describe(node); },
      [this](const RequestTracker::Answered& answered,
             const wire::Header& reply) {
        replay_log_.Keep(answered.request.part, answered.msg,
                         answered.request.replayed, reply);
      },
      // A thread in Wait takes replies off the transport itself (no hand-off
      // from the node's receiver thread).
      [this](absl::Duration timeout) {
        return node_->ReceiveOnCaller(timeout);
      });
  Node::Callbacks callbacks;
  callbacks.on_data = [this](Message&& msg) {
    tracker_->HandleReply(std::move(msg));
  };
  callbacks.on_failure = [this](const absl::Status& status) {
    tracker_->FailAll(status);
  };
  callbacks.on_peer_restart = [this](int peer) { ReplayTo(peer); };
  callbacks.on_peer_dead = [this](int peer) { FailOver(peer); };
  callbacks.on_server_change = [this](int peer) {
    if (IsServerId(peer)) ServersChanged();
  };
  callbacks.on_receiver_free = [this] { tracker_->ReceiverFree(); };
  TESSERA_ASSIGN_OR_RETURN(
      node_, Node::Start(options_, std::move(callbacks), std::move(transport)));
  live_node_.store(node_.get(), std::memory_order_release);
  // Server states that changed while Start ran (its callbacks saw no node).
  ServersChanged();
  node_->StartDelivery();
  MetricsRegistry& r = MetricsRegistry::Global();
  auto counter = [&](const char* name, const char* help,
                     uint64_t KVWorkerStats::*field) {
    metric_handles_.push_back(r.AddCollector(
        name, help, MetricType::kCounter, [this, field](MetricSamples* out) {
          absl::MutexLock lock(&mu_);
          out->push_back({{}, static_cast<double>(stats_.*field)});
        }));
  };
  counter("tessera_worker_pushes_total",
          "Pushes issued (push, pushpull, push_rows; one per key and call).",
          &KVWorkerStats::pushes);
  counter("tessera_worker_pulls_total",
          "Pulls issued (pull, pull_rows; one per key and call).",
          &KVWorkerStats::pulls);
  counter("tessera_worker_pushed_bytes_total",
          "Payload bytes of pushes (after 2-bit compression).",
          &KVWorkerStats::bytes_pushed);
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_pulled_bytes_total",
      "Payload bytes of pull replies as received (compressed pulls: the "
      "2-bit frames).",
      MetricType::kCounter, [this](MetricSamples* out) {
        out->push_back({{}, static_cast<double>(tracker_->bytes_pulled())});
      }));
  metric_handles_.push_back(r.AddCollector(
      "tessera_worker_pulled_float32_bytes_total",
      "What the pulls stand for as float32 values (pulled bytes without "
      "compression).",
      MetricType::kCounter, [this](MetricSamples* out) {
        out->push_back(
            {{}, static_cast<double>(tracker_->bytes_pulled_float32())});
      }));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<wire::KVStats>> KVClient::ServerStats() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  std::vector<wire::KVStats> stats(options_.num_servers);
  const uint64_t op = tracker_->NewOp();
  const std::vector<bool> dead = node_->dead_servers();
  for (int s = 0; s < options_.num_servers; ++s) {
    if (dead[s]) continue;  // failed over: its stats went with it
    Message msg;
    msg.header.set_command(wire::KV_STATS);
    RequestTracker::Request request;
    request.op = op;
    request.server = ServerId(s);
    wire::KVStats* out = &stats[s];
    request.on_reply = [out](const Message& reply) {
      *out = reply.header.kv_stats();
      return absl::OkStatus();
    };
    tracker_->Send(request, std::move(msg));
  }
  TESSERA_RETURN_IF_ERROR(tracker_->Wait(op, "KV_STATS"));
  return stats;
}

absl::Status KVClient::CheckOpen() const {
  if (closed_) return absl::FailedPreconditionError("the KV store is closed");
  return node_->failure();
}

bool KVClient::HaveKeys() const {
  absl::MutexLock lock(&mu_);
  return !keys_.empty();
}

std::vector<KeyPart> KVClient::Parts(uint64_t key) const {
  absl::MutexLock lock(&mu_);
  return keys_.at(key).parts;
}

absl::Status KVClient::CheckKey(uint64_t key, size_t len,
                                const char* what) const {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    return absl::NotFoundError(
        absl::StrCat(what, " of key ", key,
                     ": the key was never initialised (call init first)"));
  }
  if (it->second.row_length != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " of key ", key,
        ": the key is row-sparse (init_rows): use push_rows / pull_rows"));
  }
  if (it->second.length != len) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of key ", key, " with ", len,
                     " values; the key has ", it->second.length));
  }
  return absl::OkStatus();
}

Message KVClient::SliceMessage(wire::Command cmd, uint64_t key,
                               const KeyPart& part, uint64_t total,
                               uint64_t row_length) {
  Message msg;
  msg.header.set_command(cmd);
  wire::KeySlice* slice = msg.header.mutable_slice();
  slice->set_key(key);
  slice->set_offset(part.offset);
  slice->set_length(part.length);
  slice->set_total_length(total);
  slice->set_row_length(row_length);
  return msg;
}

void KVClient::SendPart(uint64_t op, const KeyPart& part, Message msg,
                        float* out, RequestTracker::PartRef ref, bool replayed,
                        int window) {
  RequestTracker::Request request;
  request.op = op;
  request.server = ServerId(part.server_rank);
  request.out = out;
  request.length = part.length;
  request.part = ref;
  request.replayed = replayed;
  request.rejoin = msg.header.rejoin();
  request.window = window;
  tracker_->Send(request, std::move(msg));
}

absl::Status KVClient::Broadcast(const Message& msg, const std::string& what) {
  const uint64_t op = tracker_->NewOp();
  for (int s = 0; s < options_.num_servers; ++s)
    SendPart(op, KeyPart{s, 0, 0}, msg, nullptr);
  return tracker_->Wait(op, what);
}

absl::Status KVClient::SetOptimizer(const std::string& spec) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (HaveKeys()) {
    return absl::FailedPreconditionError(
        "set_optimizer must be called before the first init");
  }
  Message msg;
  msg.header.set_command(wire::KV_SET_OPTIMIZER);
  msg.header.mutable_kv_options()->set_optimizer_spec(spec);
  TESSERA_RETURN_IF_ERROR(Broadcast(msg, "set_optimizer"));
  replay_log_.KeepSetting(msg);
  return absl::OkStatus();
}

absl::Status KVClient::SetGradientCompression(const std::string& type,
                                              float threshold) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (type != "2bit" && type != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradient compression type '", type, "': expected 2bit or none"));
  }
  if (type == "2bit" && !(threshold > 0 && std::isfinite(threshold))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "2-bit compression threshold ", threshold, ": expected a number > 0"));
  }
  if (HaveKeys()) {
    return absl::FailedPreconditionError(
        "gradient compression must be set before the first init");
  }
  Message msg;
  msg.header.set_command(wire::KV_SET_COMPRESSION);
  msg.header.mutable_kv_options()->set_compression_type(type);
  msg.header.mutable_kv_options()->set_compression_threshold(threshold);
  TESSERA_RETURN_IF_ERROR(Broadcast(msg, "set_gradient_compression"));
  replay_log_.KeepSetting(msg);
  absl::MutexLock lock(&mu_);
  two_bit_ = type == "2bit";
  threshold_ = threshold;
  return absl::OkStatus();
}

absl::Status KVClient::SetPullCompression(const std::string& type) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (type != "2bit" && type != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "pull compression type '", type, "': expected 2bit or none"));
  }
  if (HaveKeys()) {
    return absl::FailedPreconditionError(
        "pull compression must be set before the first init");
  }
  absl::MutexLock lock(&mu_);
  pull_two_bit_ = type == "2bit";
  return absl::OkStatus();
}

absl::Status KVClient::Init(uint64_t key, absl::Span<const float> value) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (value.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("init of key ", key, ": empty value"));
  }
  return InitKey(
      key, value.data(), value.size(), /*row_length=*/0,
      KeyPartitioner::Chunk(
          partitioner_.Partition(key, value.size()),
          std::max<uint64_t>(1, options_.chunk_bytes / sizeof(float))));
}

absl::Status KVClient::InitRows(uint64_t key, const float* value,
                                uint64_t num_rows, uint64_t row_length) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (num_rows == 0 || row_length == 0 ||
      num_rows > (uint64_t{1} << 40) / row_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init of row-sparse key ", key, ": ", num_rows, " rows of ", row_length,
        " values; expected at least one row and one value"));
  }
  // Split by rows, so every server holds whole rows, and each server's part
  // in slices of whole rows (kRowSliceChunks); a push or pull carries only the
  // rows it names, to each slice (a push: to every slice, which counts it
  // toward its round even without rows).
  const uint64_t slice_rows = std::max<uint64_t>(
      1, kRowSliceChunks * static_cast<uint64_t>(options_.chunk_bytes) /
             (row_length * sizeof(float)));
  return InitKey(
      key, value, num_rows * row_length, row_length,
      KeyPartitioner::Chunk(
          partitioner_.PartitionRows(key, num_rows, row_length), slice_rows));
}

absl::Status KVClient::InitHashed(uint64_t key, uint64_t row_length,
                                  const std::string& options) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (row_length == 0 || row_length > (uint64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("init of hashed key ", key, ": rows of ", row_length,
                     " values; expected 1..16777216"));
  }
  absl::StatusOr<HashedSpec> spec = HashedSpec::Parse(options);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init of hashed key ", key, ": ", spec.status().message()));
  }
  // One slice on every server (offset: the server's rank, length and total
  // 0); ids go to HashedServerOf(id).
  std::vector<KeyPart> parts;
  for (int s = 0; s < options_.num_servers; ++s)
    parts.push_back({s, static_cast<uint64_t>(s), 0});
  return InitKey(key, nullptr, 0, row_length, std::move(parts),
                 spec->ToString());
}

absl::Status KVClient::InitKey(uint64_t key, const float* value,
                               uint64_t length, uint64_t row_length,
                               std::vector<KeyPart> parts,
                               const std::string& hashed_spec) {
  std::map<int, int> slices_per_server;
  bool windowed = false;
  for (const KeyPart& part : parts)
    windowed |= ++slices_per_server[part.server_rank] > PushWindow(options_);
  const uint64_t total = row_length == 0 ? length : length / row_length;
  {
    absl::MutexLock lock(&mu_);
    if (keys_.count(key) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("key ", key, " is already initialised"));
    }
    KeyInfo& info = keys_[key];
    info.length = length;
    info.row_length = row_length;
    info.parts = parts;
    info.windowed = windowed;
    info.hashed = !hashed_spec.empty();
    if (two_bit_ && row_length == 0) info.residual.assign(length, 0.0f);
    if (pull_two_bit_ && row_length == 0) {
      for (const KeyPart& part : parts)
        info.pulled.push_back(std::make_shared<PulledCopy>(part.length));
    }
  }
  replay_log_.DeclareKey(key, parts);
  auto forget = [&] {
    replay_log_.ForgetKey(key);
    absl::MutexLock lock(&mu_);
    keys_.erase(key);
  };
  // Joining an elastic job: the key's pushes are numbered from the largest
  // count of the rank's earlier holder over its slices (the entry makes every
  // slice agree), and the key's rounds are entered before the first push
  // (EnterRounds).
  // Until then its pulls carry the smallest count (a pull waits for the
  // pushes it names).
  auto enter_later = [&](const RequestTracker::RejoinReplies& rejoin) {
    absl::MutexLock lock(&mu_);
    KeyInfo& info = keys_[key];
    info.next_seq = rejoin.resume_min;
    if (entered_) {
      // Declared after this worker entered the others (a key made while the
      // job runs): its first push enters the round under way.
      return;
    }
    info.enter_seq = rejoin.resume_max;
    info.open_round = rejoin.open_round_max;
    entering_.push_back(key);
    entering_pending_.store(true, std::memory_order_release);
  };
  // A restarted worker, or one joining an elastic job (generation > 0): its
  // rank's pushes may be on the servers already, and the others have passed
  // the init barriers.
  bool ask_after_init = false;
  if (node_->generation() > 0) {
    RequestTracker::RejoinReplies rejoin;
    absl::Status found = RejoinKey(key, total, row_length, &rejoin);
    if (found.ok()) {
      if (rejoin.joining) {
        enter_later(rejoin);
      } else {
        absl::MutexLock lock(&mu_);
        keys_[key].next_seq = rejoin.resume_min;
        // Before the first push all keys resume together
        // (SettleResumeLocked); a key declared after that keeps its own count,
        // and so does every key of a worker that joined.
        if (resume_ != Resume::kSettled && !entered_ && entering_.empty())
          resume_ = Resume::kPending;
      }
      TESSERA_VLOG(1) << "key " << key << ": the servers took "
                      << rejoin.resume_min << " push(es) of this rank before"
                      << (rejoin.joining ? " it joined" : " the restart");
      // The others may wait for this rank in this key's init barrier (it died
      // before reaching it); the scheduler joins it only then.
      return node_->JoinBarrierIfOpen(kGroupWorkers, InitBarrier(key));
    }
    if (!absl::IsNotFound(found)) {
      forget();
      return found;
    }
    // Not (wholly) on the servers: this worker died while the job was still
    // initialising, or joined it then; do what a first life does. A joiner
    // asks again once the key is stored, to enter its rounds.
    ask_after_init = true;
  }
  absl::Status stored = absl::OkStatus();
  if (rank() == 0) {
    const uint64_t op = tracker_->NewOp();
    const uint64_t unit = row_length == 0 ? 1 : row_length;
    for (size_t i = 0; i < parts.size(); ++i) {
      const KeyPart& part = parts[i];
      Message msg = SliceMessage(wire::KV_INIT, key, part, total, row_length);
      msg.header.mutable_slice()->set_hashed_spec(hashed_spec);
      msg.header.mutable_kv_options()->set_sync_mode(sync_);
      if (value != nullptr) {
        AddFloatFrame(&msg, Buffer::CopyOf(value + part.offset * unit,
                                           part.length * unit * sizeof(float)));
      }
      // Replicated jobs: every server of the slice's chain holds it.
      for (int j = 1; j < options_.replicas; ++j) {
        Message copy = msg;
        copy.header.set_replica(j);
        KeyPart backup = part;
        backup.server_rank = (part.server_rank + j) % options_.num_servers;
        SendPart(op, backup, std::move(copy), nullptr);
      }
      SendPart(op, part, std::move(msg), nullptr, {key, i, true});
    }
    stored = tracker_->Wait(op, absl::StrCat("init of key ", key));
  }
  absl::Status barrier = node_->Barrier(kGroupWorkers, InitBarrier(key));
  if (!stored.ok()) {
    forget();
    return stored;
  }
  if (barrier.ok() && ask_after_init) {
    RequestTracker::RejoinReplies rejoin;
    if (absl::Status asked = RejoinKey(key, total, row_length, &rejoin);
        !asked.ok()) {
      forget();
      return asked;
    }
    if (rejoin.joining) enter_later(rejoin);
  }
  return barrier;
}

absl::StatusOr<KVClient::RowKey> KVClient::CheckRows(
    uint64_t key, absl::Span<const uint64_t> row_ids, const char* what) const {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    return absl::NotFoundError(
        absl::StrCat(what, " of key ", key,
                     ": the key was never initialised (call init first)"));
  }
  const KeyInfo& info = it->second;
  if (info.row_length == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " of key ", key, ": the key is dense (init, not init_rows)"));
  }
  if (info.hashed) return RowKey{info.row_length, true};
  const uint64_t num_rows = info.length / info.row_length;
  for (uint64_t id : row_ids) {
    if (id >= num_rows) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " of key ", key, ": row id ", id, " is past its ",
                       num_rows, " rows"));
    }
  }
  return RowKey{info.row_length, false};
}

size_t KVClient::PartOfRow(const std::vector<KeyPart>& parts, bool hashed,
                           uint64_t id) const {
  if (hashed)
    return static_cast<size_t>(HashedServerOf(id, options_.num_servers));
  // Parts are in increasing offset: the last one starting at or before id.
  auto after = std::upper_bound(
      parts.begin(), parts.end(), id,
      [](uint64_t v, const KeyPart& p) { return v < p.offset; });
  if (after == parts.begin()) return parts.size();  // not reached (CheckRows)
  const size_t i = static_cast<size_t>(after - parts.begin()) - 1;
  return id < parts[i].offset + parts[i].length ? i : parts.size();
}

absl::StatusOr<OpHandle> KVClient::PushRowsAsync(
    uint64_t key, absl::Span<const uint64_t> row_ids,
    absl::Span<const float> rows) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_ASSIGN_OR_RETURN(const RowKey row_key,
                           CheckRows(key, row_ids, "row push"));
  const uint64_t l = row_key.row_length;
  const bool hashed = row_key.hashed;
  std::vector<KeyPart> row_parts;
  {
    absl::MutexLock lock(&mu_);
    row_parts = keys_.at(key).parts;
  }
  if (rows.size() != row_ids.size() * l) {
    return absl::InvalidArgumentError(absl::StrCat(
        "row push of key ", key, ": ", row_ids.size(), " row ids need ",
        row_ids.size() * l, " values, not ", rows.size()));
  }
  bool two_bit;
  float threshold;
  {
    absl::MutexLock lock(&mu_);
    two_bit = two_bit_;
    threshold = threshold_;
  }
  // Each part's rows: where each is in the caller's arrays, in push order.
  std::vector<std::vector<size_t>> at_of(row_parts.size());
  for (size_t k = 0; k < row_ids.size(); ++k) {
    const size_t i = PartOfRow(row_parts, hashed, row_ids[k]);
    if (i >= at_of.size())  // CheckRows let only ids of the key through
      return absl::InternalError(absl::StrCat(
          "row push of key ", key, ": no part holds row ", row_ids[k]));
    at_of[i].push_back(k);
  }
  return SendPush(
      wire::KV_PUSH, key, nullptr,
      [&, l](uint64_t op, size_t part_index,
             const KeyPart&) -> absl::StatusOr<Message> {
        const std::vector<size_t>& at = at_of[part_index];
        const size_t n = at.size();
        // Sorted ids (the usual case) put each server's rows in one run of
        // the caller's arrays: then the frames borrow them, as a dense push
        // borrows its gradient, pinned until the push completes.
        const bool run = n == 0 || at.back() - at.front() + 1 == n;
        Message body;
        wire::DataFrame* d = body.header.add_frames();
        d->set_encoding(wire::DataFrame::RAW);
        d->set_num_bytes(n * sizeof(uint64_t));
        if (!two_bit) {
          // The values in frames of whole rows (message.h, RowsPerFrame).
          const size_t per_frame = RowsPerFrame(
              n, l * sizeof(float), static_cast<size_t>(options_.chunk_bytes));
          if (run) {
            const size_t k0 = n == 0 ? 0 : at.front();
            body.data.push_back(Buffer::Wrap(
                row_ids.data() + k0, n * sizeof(uint64_t), tracker_->Pin(op)));
            for (size_t j = 0; j < n || j == 0; j += per_frame) {
              const size_t count = std::min(per_frame, n - j);
              AddFloatFrame(&body, Buffer::Wrap(rows.data() + (k0 + j) * l,
                                                count * l * sizeof(float),
                                                tracker_->Pin(op)));
              if (n == 0) break;
            }
            return body;
          }
          // Gathered straight into the frames.
          Buffer ids = Buffer::Allocate(n * sizeof(uint64_t));
          uint64_t* id_out = reinterpret_cast<uint64_t*>(ids.mutable_data());
          for (size_t j = 0; j < n; ++j) id_out[j] = row_ids[at[j]];
          body.data.push_back(std::move(ids));
          for (size_t j = 0; j < n; j += per_frame) {
            const size_t count = std::min(per_frame, n - j);
            Buffer values = Buffer::Allocate(count * l * sizeof(float));
            float* v_out = values.mutable_floats();
            for (size_t i = 0; i < count; ++i) {
              std::memcpy(v_out + i * l, rows.data() + at[j + i] * l,
                          l * sizeof(float));
            }
            AddFloatFrame(&body, std::move(values));
          }
          return body;
        }
        // 2-bit: duplicates summed first (in push order), so each row's error
        // feedback sees its whole gradient once.
        std::vector<uint64_t> ids;
        std::vector<size_t> first;  // ids[j]'s first place in `at`
        bool repeats = false;
        {
          absl::flat_hash_map<uint64_t, size_t> seen;
          seen.reserve(n);
          for (size_t j = 0; j < n; ++j) {
            if (seen.try_emplace(row_ids[at[j]], ids.size()).second) {
              ids.push_back(row_ids[at[j]]);
              first.push_back(j);
            } else {
              repeats = true;
            }
          }
        }
        const size_t m = ids.size();
        const size_t count = m * l;
        // The values to code: the caller's run as it is, or gathered (and
        // repeats added in).
        const float* values = rows.data() + (n == 0 ? 0 : at.front() * l);
        Buffer gathered;
        if (!run || repeats) {
          gathered = Buffer::Allocate(count * sizeof(float));
          float* g = gathered.mutable_floats();
          absl::flat_hash_map<uint64_t, size_t> slot;
          if (repeats) slot.reserve(m);
          for (size_t j = 0; j < m; ++j) {
            std::memcpy(g + j * l, rows.data() + at[first[j]] * l,
                        l * sizeof(float));
            if (repeats) slot.emplace(ids[j], j);
          }
          if (repeats) {
            std::vector<bool> taken(n, false);
            for (size_t j = 0; j < m; ++j) taken[first[j]] = true;
            for (size_t j = 0; j < n; ++j) {
              if (taken[j]) continue;
              float* to = g + slot[row_ids[at[j]]] * l;
              const float* v = rows.data() + at[j] * l;
              for (uint64_t i = 0; i < l; ++i) to[i] += v[i];
            }
          }
          values = gathered.floats();
        }
        body.data.push_back(
            Buffer::CopyOf(ids.data(), ids.size() * sizeof(uint64_t)));
        d->set_num_bytes(ids.size() * sizeof(uint64_t));
        // Each row's residual: what earlier pushes of it have not sent yet.
        Buffer residual = Buffer::Allocate(count * sizeof(float));
        float* r = residual.mutable_floats();
        {
          absl::MutexLock lock(&mu_);
          KeyInfo& info = keys_[key];
          for (size_t k = 0; k < m; ++k) {
            auto [it, added] =
                info.row_slot.try_emplace(ids[k], info.row_slot.size());
            std::memcpy(r + k * l, info.RowResidual(it->second, l),
                        l * sizeof(float));
          }
        }
        trace::Span span("kv", "compress");
        span.Arg("key", static_cast<int64_t>(key));
        span.Arg("values", static_cast<int64_t>(count));
        Buffer packed =
            Buffer::Allocate(compression::TwoBitCompressedBytes(count));
        TESSERA_RETURN_IF_ERROR(compression::TwoBitQuantize(
            values, r, count, threshold, packed.mutable_data()));
        {
          absl::MutexLock lock(&mu_);
          KeyInfo& info = keys_[key];
          for (size_t k = 0; k < m; ++k) {
            std::memcpy(info.RowResidual(info.row_slot[ids[k]], l), r + k * l,
                        l * sizeof(float));
          }
        }
        AddTwoBitFrame(&body, std::move(packed), count);
        return body;
      });
}

absl::StatusOr<OpHandle> KVClient::PullRowsAsync(
    uint64_t key, absl::Span<const uint64_t> row_ids, absl::Span<float> out) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_ASSIGN_OR_RETURN(const RowKey row_key,
                           CheckRows(key, row_ids, "row pull"));
  const uint64_t l = row_key.row_length;
  if (out.size() != row_ids.size() * l) {
    return absl::InvalidArgumentError(absl::StrCat(
        "row pull of key ", key, ": ", row_ids.size(), " row ids need ",
        row_ids.size() * l, " values of output, not ", out.size()));
  }
  std::vector<KeyPart> parts;
  uint64_t total = 0, pushed = 0;
  bool bf16 = false;
  {
    absl::MutexLock lock(&mu_);
    TESSERA_RETURN_IF_ERROR(keys_.at(key).out_of_step);
    parts = keys_.at(key).parts;
    total = keys_.at(key).length / l;
    pushed = keys_.at(key).next_seq;
    bf16 = pull_two_bit_;  // pull compression: rows come as bfloat16
    ++stats_.pulls;
  }
  // Each part's rows, and where each goes in `out`.
  std::vector<std::vector<uint64_t>> ids_of(parts.size()), at_of(parts.size());
  for (size_t k = 0; k < row_ids.size(); ++k) {
    const size_t i = PartOfRow(parts, row_key.hashed, row_ids[k]);
    if (i >= parts.size())  // CheckRows let only ids of the key through
      return absl::InternalError(absl::StrCat(
          "row pull of key ", key, ": no part holds row ", row_ids[k]));
    ids_of[i].push_back(row_ids[k]);
    at_of[i].push_back(k);
  }
  const uint64_t op = tracker_->NewOp();
  const size_t value_bytes = bf16 ? sizeof(uint16_t) : sizeof(float);
  for (size_t i = 0; i < parts.size(); ++i) {
    const KeyPart& part = parts[i];
    const std::vector<uint64_t>& part_ids = ids_of[i];
    const std::vector<uint64_t>& part_at = at_of[i];
    // A pull need not visit every server. The rows it asks one server for
    // go in requests of about a slice each (pulls have no round to keep
    // whole), so that the server answers the first while the worker asks
    // for the next and copies the first into place: the stages overlap.
    const size_t per_request =
        RowsPerFrame(part_ids.size(), l * value_bytes,
                     static_cast<size_t>(options_.chunk_bytes));
    for (size_t first = 0; first < part_ids.size(); first += per_request) {
      const size_t count = std::min(per_request, part_ids.size() - first);
      std::vector<uint64_t> ids(part_ids.begin() + first,
                                part_ids.begin() + first + count);
      std::vector<uint64_t> at(part_at.begin() + first,
                               part_at.begin() + first + count);
      Message msg = SliceMessage(wire::KV_PULL, key, part, total, l);
      msg.header.set_push_seq(pushed);  // sees this worker's pushes
      msg.header.set_pull_compressed(bf16);
      wire::DataFrame* d = msg.header.add_frames();
      d->set_encoding(wire::DataFrame::RAW);
      d->set_num_bytes(ids.size() * sizeof(uint64_t));
      msg.data.push_back(
          Buffer::CopyOf(ids.data(), ids.size() * sizeof(uint64_t)));
      RequestTracker::Request request;
      request.op = op;
      request.server = ServerId(part.server_rank);
      request.length = ids.size() * l;
      request.part = {key, i, true};
      float* base = out.data();
      const auto want = bf16 ? wire::DataFrame::BF16 : wire::DataFrame::FLOAT32;
      request.on_reply = [base, at = std::move(at), l,
                          want](const Message& reply) {
        // Frames of whole rows, in order, all of the asked encoding.
        uint64_t values = 0;
        bool ok = !reply.data.empty() &&
                  static_cast<size_t>(reply.header.frames_size()) ==
                      reply.data.size();
        for (int f = 0; ok && f < reply.header.frames_size(); ++f) {
          const wire::DataFrame& d = reply.header.frames(f);
          ok = d.encoding() == want && d.num_values() % l == 0;
          values += d.num_values();
        }
        if (!ok || values != at.size() * l) {
          return absl::DataLossError(absl::StrCat(
              "row pull reply from node ", reply.header.sender(),
              " does not carry ", at.size(), " rows of ", l,
              want == wire::DataFrame::BF16 ? " as bfloat16" : " as float32"));
        }
        size_t k = 0;
        for (const Buffer& frame : reply.data) {
          if (want == wire::DataFrame::BF16) {
            const uint16_t* rows =
                reinterpret_cast<const uint16_t*>(frame.data());
            for (size_t i = 0; i < frame.size() / (2 * l); ++i, ++k)
              compression::Bf16ToFloats(rows + i * l, l, base + at[k] * l);
          } else {
            const float* rows = frame.floats();
            for (size_t i = 0; i < frame.num_floats() / l; ++i, ++k)
              std::memcpy(base + at[k] * l, rows + i * l, l * sizeof(float));
          }
        }
        return absl::OkStatus();
      };
      tracker_->Send(request, std::move(msg));
    }
  }
  return op;
}

uint64_t KVClient::ResumeRound() {
  absl::MutexLock lock(&mu_);
  SettleResumeLocked();
  return resume_round_;
}

void KVClient::SettleResumeLocked() {
  if (resume_ != Resume::kPending) return;
  resume_ = Resume::kSettled;
  // A worker that joined numbers each key's pushes on its own (EnterRounds).
  if (entered_ || !entering_.empty()) return;
  uint64_t resume = UINT64_MAX;
  for (const auto& [key, info] : keys_)
    resume = std::min(resume, info.next_seq);
  if (keys_.empty()) resume = 0;
  for (auto& [key, info] : keys_) info.next_seq = resume;
  resume_round_ = resume;
  if (options_.restart_count > 0) {
    TESSERA_LOG(INFO) << "restarted (TESSERA_RESTART_COUNT="
                      << options_.restart_count << "): resuming at round "
                      << resume;
  } else {
    TESSERA_LOG(INFO) << "joined the job (generation " << node_->generation()
                      << "): resuming at round " << resume;
  }
}

absl::Status KVClient::RejoinKey(uint64_t key, uint64_t total,
                                 uint64_t row_length,
                                 RequestTracker::RejoinReplies* replies) {
  const uint64_t op = tracker_->NewOp();
  for (const KeyPart& part : Parts(key)) {
    // The slice as the key was made (a row-sparse or hashed key's row length
    // too: the server checks it).
    Message msg = SliceMessage(wire::KV_INIT, key, part, total, row_length);
    msg.header.set_rejoin(true);
    SendPart(op, part, std::move(msg), nullptr);
  }
  return tracker_->Wait(op, absl::StrCat("rejoin of key ", key), replies);
}

absl::Status KVClient::EnterRounds() {
  if (!entering_pending_.load(std::memory_order_acquire))
    return absl::OkStatus();
  // One thread announces; a push on another waits for it here.
  absl::MutexLock entering(&enter_mu_);
  struct Entering {
    uint64_t key, total, row_length, seq;
    std::vector<KeyPart> parts;
  };
  std::vector<Entering> keys;
  uint64_t at = 0;
  {
    absl::MutexLock lock(&mu_);
    if (entering_.empty()) return absl::OkStatus();
    uint64_t low = UINT64_MAX, high = 0, low_key = 0, high_key = 0;
    for (uint64_t key : entering_) {
      const KeyInfo& info = keys_.at(key);
      const uint64_t total =
          info.row_length == 0 ? info.length : info.length / info.row_length;
      keys.push_back({key, total, info.row_length, info.enter_seq, info.parts});
      if (info.open_round < low) low = info.open_round, low_key = key;
      if (info.open_round >= high) high = info.open_round, high_key = key;
    }
    // The round numbers are each slice's own count of its rounds: they name
    // one step in every key when every key was pushed once a step from the
    // job's start (keys still in a step differ by one).
    if (high > low + 2) {
      return absl::FailedPreconditionError(absl::StrCat(
          "joining the job: the keys' rounds are too far apart to enter them "
          "at one step (key ",
          low_key, " at round ", low, ", key ", high_key, " at round ", high,
          "); a worker joins a job whose keys were all pushed once a step "
          "from its start (docs/faults.md, \"Workers join\")"));
    }
    // Two rounds past the furthest slice the rejoins saw: the slices most
    // likely have not passed it by the time the entry reaches them.
    at = high + 2;
  }
  // Every slice is entered at the same round, so that this worker is at the
  // same step in every key; a slice already past it refuses, and the entry
  // goes again, later, to all (a slice that took the earlier round takes
  // the later one instead: nothing was pushed yet).
  constexpr int kTries = 10;
  for (int attempt = 1;; ++attempt) {
    const uint64_t op = tracker_->NewOp();
    for (const Entering& k : keys) {
      for (const KeyPart& part : k.parts) {
        Message msg =
            SliceMessage(wire::KV_INIT, k.key, part, k.total, k.row_length);
        msg.header.set_rejoin(true);
        msg.header.set_enter(true);
        msg.header.set_enter_round(at);
        msg.header.set_push_seq(k.seq);
        SendPart(op, part, std::move(msg), nullptr);
      }
    }
    RequestTracker::RejoinReplies replies;
    TESSERA_RETURN_IF_ERROR(
        tracker_->Wait(op, "entry into the job's rounds", &replies));
    if (!replies.entry_refused) {
      TESSERA_LOG(INFO) << "joined the job (generation " << node_->generation()
                        << "): in every key's rounds "
                        << "from round " << at << " (" << keys.size()
                        << " key(s)" << (attempt > 1 ? ", entry try " : "")
                        << (attempt > 1 ? absl::StrCat(attempt) : "") << ")";
      absl::MutexLock lock(&mu_);
      // Its pushes are numbered from where the slices now count them. Only
      // the keys entered: one declared meanwhile waits for the next push.
      for (const Entering& k : keys) {
        KeyInfo& info = keys_.at(k.key);
        info.next_seq = k.seq;
        entering_.erase(std::remove(entering_.begin(), entering_.end(), k.key),
                        entering_.end());
      }
      entered_ = true;
      entering_pending_.store(!entering_.empty(), std::memory_order_release);
      return absl::OkStatus();
    }
    if (attempt == kTries) {
      return absl::DeadlineExceededError(absl::StrCat(
          "joining the job: the servers' rounds passed the round this worker "
          "entered at ",
          kTries, " times (last ", at, ", the furthest slice at ",
          replies.open_round_max, ")"));
    }
    // Later each time: a job whose rounds are fast needs a wider margin.
    at = std::max(at, replies.open_round_max) + 2 + attempt;
  }
}

absl::StatusOr<OpHandle> KVClient::SendPush(wire::Command cmd, uint64_t key,
                                            float* out,
                                            const PayloadFn& payload) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  // A worker joining an elastic job enters the rounds before its first push.
  TESSERA_RETURN_IF_ERROR(EnterRounds());
  std::vector<KeyPart> parts;
  uint64_t total = 0, row_length = 0;
  {
    absl::MutexLock lock(&mu_);
    const KeyInfo& info = keys_.at(key);
    TESSERA_RETURN_IF_ERROR(info.out_of_step);
    parts = info.parts;
    row_length = info.row_length;
    total = row_length == 0 ? info.length : info.length / row_length;
  }
  const uint64_t op = tracker_->NewOp();
  std::vector<Message> bodies;
  for (size_t i = 0; i < parts.size(); ++i) {
    absl::StatusOr<Message> made = payload(op, i, parts[i]);
    if (!made.ok()) {
      bodies.clear();  // unpins what was borrowed
      tracker_->FailOp(op, made.status());
      (void)tracker_->Wait(op, "push");
      return made.status();
    }
    bodies.push_back(*std::move(made));
  }
  bool windowed;
  uint64_t seq;
  {
    absl::MutexLock lock(&mu_);
    windowed = keys_[key].windowed;
    SettleResumeLocked();
    seq = keys_[key].next_seq++;
    push_ops_[op] = {key, seq};
    ++stats_.pushes;
    for (const Message& b : bodies)
      for (const Buffer& d : b.data) stats_.bytes_pushed += d.size();
  }
  std::map<int, int> windows;  // by server rank; none: not windowed
  if (row_length != 0) {
    windows = RowPushWindows(parts, bodies);
  } else if (windowed) {
    for (const KeyPart& part : parts)
      windows[part.server_rank] = PushWindow(options_);
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const KeyPart& part = parts[i];
    Message msg = std::move(bodies[i]);
    *msg.header.mutable_slice() =
        SliceMessage(cmd, key, part, total, row_length).header.slice();
    msg.header.set_command(cmd);
    msg.header.set_push_seq(seq);
    auto window = windows.find(part.server_rank);
    SendPart(op, part, std::move(msg),
             out == nullptr ? nullptr : out + part.offset, {key, i, true},
             /*replayed=*/false, window == windows.end() ? 0 : window->second);
  }
  return op;
}

std::map<int, int> KVClient::RowPushWindows(
    const std::vector<KeyPart>& parts,
    const std::vector<Message>& bodies) const {
  std::map<int, uint64_t> largest;  // by server rank: its largest slice
  for (size_t i = 0; i < parts.size(); ++i) {
    uint64_t bytes = 0;
    for (const Buffer& b : bodies[i].data) bytes += b.size();
    uint64_t& most = largest[parts[i].server_rank];
    most = std::max(most, bytes);
  }
  const uint64_t budget =
      kRowPushInflightChunks * static_cast<uint64_t>(options_.chunk_bytes);
  const int most_slices = std::max(2, PushWindow(options_));
  std::map<int, int> windows;
  for (const auto& [server, bytes] : largest) {
    windows[server] = static_cast<int>(std::clamp<uint64_t>(
        budget / std::max<uint64_t>(bytes, 1), 2, most_slices));
  }
  return windows;
}

KVClient::PayloadFn KVClient::HostPayload(uint64_t key,
                                          absl::Span<const float> grad) {
  return [this, key, grad](uint64_t op, size_t,
                           const KeyPart& part) -> absl::StatusOr<Message> {
    bool two_bit;
    float threshold;
    float* residual;
    {
      absl::MutexLock lock(&mu_);
      two_bit = two_bit_;
      threshold = threshold_;
      residual = keys_[key].residual.data();
    }
    Message body;
    if (!two_bit) {
      // Zero-copy: the frame borrows the caller's memory and pins the op.
      AddFloatFrame(
          &body, Buffer::Wrap(grad.data() + part.offset,
                              part.length * sizeof(float), tracker_->Pin(op)));
      return body;
    }
    trace::Span span("kv", "compress");
    span.Arg("key", static_cast<int64_t>(key));
    span.Arg("values", static_cast<int64_t>(part.length));
    Buffer packed =
        Buffer::Allocate(compression::TwoBitCompressedBytes(part.length));
    TESSERA_RETURN_IF_ERROR(compression::TwoBitQuantize(
        grad.data() + part.offset, residual + part.offset, part.length,
        threshold, packed.mutable_data()));
    AddTwoBitFrame(&body, std::move(packed), part.length);
    return body;
  };
}

absl::StatusOr<OpHandle> KVClient::PushAsync(uint64_t key,
                                             absl::Span<const float> grad) {
  TESSERA_RETURN_IF_ERROR(CheckKey(key, grad.size(), "push"));
  return SendPush(wire::KV_PUSH, key, nullptr, HostPayload(key, grad));
}

absl::StatusOr<OpHandle> KVClient::PushPullAsync(uint64_t key,
                                                 absl::Span<const float> grad,
                                                 absl::Span<float> out) {
  if (out.size() != grad.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pushpull of key ", key, ": gradient has ", grad.size(),
                     " values but output has ", out.size()));
  }
  TESSERA_RETURN_IF_ERROR(CheckKey(key, grad.size(), "pushpull"));
  return SendPush(wire::KV_PUSHPULL, key, out.data(), HostPayload(key, grad));
}

absl::StatusOr<OpHandle> KVClient::PushDeviceAsync(uint64_t key,
                                                   const float* device_grad,
                                                   size_t len,
                                                   void* cuda_stream) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_RETURN_IF_ERROR(CheckKey(key, len, "push"));
  bool two_bit;
  float threshold;
  {
    absl::MutexLock lock(&mu_);
    two_bit = two_bit_;
    threshold = threshold_;
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<Buffer> staged,
                           device_.Stage(key, device_grad, len, Parts(key),
                                         two_bit, threshold, cuda_stream));
  return SendPush(wire::KV_PUSH, key, nullptr,
                  [&staged, two_bit](uint64_t, size_t i, const KeyPart& part) {
                    Message body;
                    if (two_bit) {
                      AddTwoBitFrame(&body, std::move(staged[i]), part.length);
                    } else {
                      AddFloatFrame(&body, std::move(staged[i]));
                    }
                    return absl::StatusOr<Message>(std::move(body));
                  });
}

absl::StatusOr<OpHandle> KVClient::StartPull(uint64_t key, uint64_t length,
                                             const PlainReplyFn& plain,
                                             const CopiedFn& copied,
                                             const PrepareFn& prepare) {
  std::vector<KeyPart> parts;
  std::vector<std::shared_ptr<PulledCopy>> copies;
  uint64_t pushed;
  {
    absl::MutexLock lock(&mu_);
    TESSERA_RETURN_IF_ERROR(keys_.at(key).out_of_step);
    parts = keys_.at(key).parts;
    copies = keys_.at(key).pulled;
    pushed = keys_.at(key).next_seq;
    ++stats_.pulls;
  }
  const uint64_t op = tracker_->NewOp();
  if (prepare) prepare(parts);
  for (size_t i = 0; i < parts.size(); ++i) {
    const KeyPart& part = parts[i];
    Message msg = SliceMessage(wire::KV_PULL, key, part, length);
    msg.header.set_push_seq(pushed);  // sees this worker's pushes
    RequestTracker::Request request;
    request.op = op;
    request.server = ServerId(part.server_rank);
    request.length = part.length;
    request.part = {key, i, true};
    if (copies.empty()) {
      plain(i, part, &request);
    } else {
      // Compressed: the reply brings this worker's copy forward, which then
      // goes where the caller wants it.
      std::shared_ptr<PulledCopy> copy = copies[i];
      msg.header.set_pull_compressed(true);
      msg.header.set_pull_chain(copy->chain());
      msg.header.set_pull_version(copy->version());
      request.on_reply = [copy, copied, i, part](const Message& reply) {
        absl::Status applied = copy->Apply(reply);
        if (applied.ok()) copied(i, part, *copy);
        return applied;
      };
    }
    tracker_->Send(request, std::move(msg));
  }
  return op;
}

absl::StatusOr<OpHandle> KVClient::PullAsync(uint64_t key,
                                             absl::Span<float> out) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  TESSERA_RETURN_IF_ERROR(CheckKey(key, out.size(), "pull"));
  float* base = out.data();
  return StartPull(
      key, out.size(),
      [base](size_t, const KeyPart& part, RequestTracker::Request* request) {
        request->out = base + part.offset;  // copied there in Wait
      },
      [base](size_t, const KeyPart& part, const PulledCopy& copy) {
        copy.CopyTo(base + part.offset);
      });
}

absl::StatusOr<OpHandle> KVClient::PullViewAsync(uint64_t key,
                                                 PulledValue* out) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull_view of key ", key, ": no PulledValue to fill"));
  }
  uint64_t length = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = keys_.find(key);
    if (it != keys_.end()) length = it->second.length;
  }
  TESSERA_RETURN_IF_ERROR(CheckKey(key, length, "pull_view"));
  auto rep = std::make_shared<PulledValue::Rep>();
  rep->length = length;
  absl::StatusOr<OpHandle> op = StartPull(
      key, length,
      [rep](size_t i, const KeyPart& part, RequestTracker::Request* request) {
        // The reply's frame itself becomes the part: no copy.
        request->on_reply = [rep, i, n = part.length](const Message& reply) {
          if (reply.data.size() != 1 || reply.header.frames_size() != 1 ||
              reply.header.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
              reply.header.frames(0).num_values() != n ||
              reply.data[0].size() != n * sizeof(float)) {
            return absl::DataLossError(
                absl::StrCat("reply from node ", reply.header.sender(),
                             " does not carry ", n, " float values"));
          }
          rep->frames[i] = reply.data[0];
          return absl::OkStatus();
        };
      },
      [rep](size_t i, const KeyPart& part, const PulledCopy& copy) {
        Buffer values = Buffer::Allocate(part.length * sizeof(float));
        copy.CopyTo(values.mutable_floats());
        rep->frames[i] = std::move(values);
      },
      [&rep](const std::vector<KeyPart>& parts) {
        // Before any request goes: the replies fill frames[i].
        for (const KeyPart& part : parts) {
          rep->offsets.push_back(part.offset);
          rep->lengths.push_back(part.length);
        }
        rep->frames.resize(parts.size());
      });
  if (!op.ok()) return op.status();
  out->rep_ = std::move(rep);
  return op;
}

absl::Status KVClient::Wait(OpHandle handle) {
  absl::Status status = tracker_->Wait(handle, "operation");
  absl::MutexLock lock(&mu_);
  auto push = push_ops_.find(handle);
  if (push == push_ops_.end()) return status;
  const auto [key, seq] = push->second;
  push_ops_.erase(push);
  // A server refuses a push it never took (too much of this worker waits on
  // the key): the servers' count of this worker's pushes stays behind.
  if (absl::IsResourceExhausted(status) && keys_[key].out_of_step.ok()) {
    keys_[key].out_of_step = absl::FailedPreconditionError(absl::StrCat(
        "key ", key, ": push ", seq, " of this worker was refused (",
        status.message(),
        "); its later pushes and pulls of the key would wait for it for ever"));
  }
  return status;
}

absl::Status KVClient::Barrier() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  return node_->Barrier(kGroupWorkers);
}

absl::Status KVClient::Close() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  closed_ = true;
  if (options_.elastic()) {
    // An elastic job's workers need not push the same number of rounds (one
    // that joined later trains later): the goodbye goes first, so that the
    // servers' rounds go on without this worker while it waits in the
    // barrier for the others.
    Message bye;
    bye.header.set_command(wire::KV_FINISH);
    absl::Status said = Broadcast(bye, "goodbye to the servers");
    if (!said.ok()) TESSERA_LOG(WARNING) << said.message();
  }
  absl::Status barrier = node_->Barrier(kGroupWorkers, "close");
  if (barrier.ok() && !options_.elastic()) {
    // Tells each server this worker is done with it; one that heard it from
    // every worker ends without failure should the scheduler then vanish.
    Message bye;
    bye.header.set_command(wire::KV_FINISH);
    absl::Status said = Broadcast(bye, "goodbye to the servers");
    if (!said.ok()) TESSERA_LOG(WARNING) << said.message();
  }
  absl::Status done = barrier.ok() ? node_->Finish() : barrier;
  node_->Stop();
  return done;
}

absl::Status KVClient::Leave() {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  if (!options_.elastic()) {
    return absl::FailedPreconditionError(
        "Leave: the job is not elastic (TESSERA_ELASTIC is unset); a worker "
        "that stops early ends the job");
  }
  closed_ = true;
  absl::Status left = node_->Leave();
  node_->Stop();
  if (left.ok()) {
    TESSERA_LOG(INFO) << "left the job (TESSERA_ELASTIC): the rounds go on "
                         "without this worker";
  }
  return left;
}

KVWorkerStats KVClient::stats() const {
  KVWorkerStats s;
  {
    absl::MutexLock lock(&mu_);
    s = stats_;
  }
  s.bytes_pulled = tracker_->bytes_pulled();
  s.bytes_pulled_float32 = tracker_->bytes_pulled_float32();
  s.resends = tracker_->resends();
  return s;
}

void KVClient::ServersChanged() {
  Node* node = live_node_.load(std::memory_order_acquire);
  if (node == nullptr) return;  // Start reads the states once it has the node
  // A hand-back: the server that answered these slices holds what was sent
  // to it since it stopped taking pushes; it goes to the one answering now.
  for (int first : routes_.Update(node->server_states()))
    tracker_->ResendNowTo(ServerId(first), absl::InfiniteFuture());
}

void KVClient::FailOver(int server) {
  if (!IsServerId(server)) return;
  // A table change can come while Node::Start still runs (node_ is not set
  // yet): Start reads the states then, and nothing was sent to replay.
  Node* node = live_node_.load(std::memory_order_acquire);
  if (node == nullptr) return;
  // The table read here may already hold later changes (a hand-back that
  // came in the same table): the slices whose acting primary moved are
  // resent too, not only what waited for the dead server.
  const std::vector<int> moved = routes_.Update(node->server_states());
  if (options_.single_copy) {
    // One copy: a server that answered for slices is gone only after they
    // moved (a death ends the job).
    TESSERA_LOG(INFO) << node->Describe(server)
                      << " left; its key slices moved to the next server, and "
                         "what waited for it is sent there now";
  } else {
    TESSERA_LOG(WARNING) << node->Describe(server)
                         << " died; its key slices' next replicas answer for "
                            "them, and what waited for it is sent to them now";
  }
  tracker_->ResendNowTo(server, absl::InfiniteFuture());
  for (int first : moved) {
    if (ServerId(first) != server)
      tracker_->ResendNowTo(ServerId(first), absl::InfiniteFuture());
  }
}

void KVClient::ReplayTo(int server) {
  if (!IsServerId(server)) return;
  std::vector<ReplayLog::Entry> replay = replay_log_.For(RankOfId(server));
  Node* node = live_node_.load(std::memory_order_acquire);
  if (node == nullptr) return;  // during Start: nothing sent yet
  TESSERA_LOG(INFO) << node->Describe(server) << " restarted; replaying "
                    << replay.size() << " message(s) to it";
  // The replay goes first, then what was in flight: a pull in flight must
  // reach the restarted server after the pushes it follows, or it is answered
  // before they are applied (a stale value; fault_test under TSan, where the
  // replay took longer than the resend thread's tick).
  const absl::Time replay_start = absl::Now();
  for (ReplayLog::Entry& e : replay)
    SendPart(0, e.part, std::move(e.msg), nullptr, e.ref, /*replayed=*/true);
  tracker_->ResendNowTo(server, replay_start);
}

}  // namespace tessera
