// HashedEngine: a server's slice of a hashed row key (issue #29; slice_engine.h):
// rows named by arbitrary uint64 ids, created for the ids it admits, at most
// `capacity` of them (server/hashed_table.h says exactly when). Pushes and
// pulls are a row-sparse key's (a RAW frame of ids, then float32 frames of
// whole rows or one 2-bit frame); a dist_sync round sums each id's pushes
// exactly (RowRound) and counts how many pushes named it, then the table
// applies the round in one order whatever order the pushes came in; dist_async
// applies each push as a round of its own.
#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/compression/bf16.h"
#include "common/hashed_spec.h"
#include "common/metrics.h"
#include "server/hashed_table.h"
#include "server/key_store.h"
#include "server/replication.h"
#include "server/row_payload.h"
#include "server/slice_engine.h"

namespace tessera {
namespace {

// The key's series: tessera_server_hashed_*{key="..."}.
struct HashedMetrics {
  explicit HashedMetrics(uint64_t key) {
    MetricsRegistry& r = MetricsRegistry::Global();
    const MetricLabels labels = {{"key", absl::StrCat(key)}};
    rows = r.GetGauge("tessera_server_hashed_rows",
                      "Rows a hashed key holds on this server.", labels);
    admitted =
        r.GetCounter("tessera_server_hashed_admitted_total",
                     "Rows a hashed key created for ids it admitted.", labels);
    evicted =
        r.GetCounter("tessera_server_hashed_evicted_total",
                     "Rows of a hashed key evicted: for room at its capacity "
                     "(reason=\"capacity\") or for age (reason=\"expired\").",
                     {{"key", absl::StrCat(key)}, {"reason", "capacity"}});
    expired =
        r.GetCounter("tessera_server_hashed_evicted_total",
                     "Rows of a hashed key evicted: for room at its capacity "
                     "(reason=\"capacity\") or for age (reason=\"expired\").",
                     {{"key", absl::StrCat(key)}, {"reason", "expired"}});
    refused = r.GetCounter(
        "tessera_server_hashed_refused_total",
        "Admitted ids of a hashed key left without a row: the key was at its "
        "capacity with every row pushed in the same round.",
        labels);
    dropped = r.GetCounter(
        "tessera_server_hashed_dropped_total",
        "Pushed ids of a hashed key not admitted yet (admit_after): their "
        "gradients were not applied.",
        labels);
  }
  Gauge* rows;
  Counter* admitted;
  Counter* evicted;
  Counter* expired;
  Counter* refused;
  Counter* dropped;
};

class HashedEngine : public RoundSliceEngine<RowRound> {
 public:
  HashedEngine(StoredKey& key, int num_workers, SyncRound::Mode sum_mode,
               const HashedSpec& spec)
      : RoundSliceEngine(key, num_workers, key.row_length, sum_mode),
        table_(key.row_length, spec),
        metrics_(key.key) {}

  absl::Status Pull(const Message& request, Message* reply,
                    EngineContext& ctx) override {
    absl::StatusOr<std::vector<uint64_t>> ids = Ids(request);
    if (!ids.ok()) return ids.status();
    const uint64_t l = key_.row_length;
    const bool bf16 = request.header.pull_compressed();
    const size_t value_bytes = bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t n = ids->size();
    const size_t per_frame = RowsPerFrame(n, l * value_bytes, size_t{1} << 20);
    std::vector<float> row(l);
    for (size_t first = 0; first < n || first == 0; first += per_frame) {
      const size_t count = std::min(per_frame, n - first);
      Buffer out = Buffer::Allocate(count * l * value_bytes);
      for (size_t i = 0; i < count; ++i) {
        if (bf16) {
          table_.Read((*ids)[first + i], row.data());
          compression::FloatsToBf16(
              row.data(), l,
              reinterpret_cast<uint16_t*>(out.mutable_data()) + i * l);
        } else {
          table_.Read((*ids)[first + i], out.mutable_floats() + i * l);
        }
      }
      if (bf16) {
        AddBf16Frame(reply, std::move(out));
      } else {
        AddFloatFrame(reply, std::move(out));
      }
      if (n == 0) break;
    }
    return absl::OkStatus();
  }

  absl::Status CheckPush(const Message& msg,
                         const ServerSettings& settings) const override {
    absl::StatusOr<std::vector<uint64_t>> ids = Ids(msg);
    if (!ids.ok()) return ids.status();
    return CheckRowPush(msg, ids->size(), key_.row_length, settings, Names());
  }

  absl::StatusOr<Pushed> Push(const Message& msg,
                              const ServerSettings& settings,
                              EngineContext& ctx) override {
    // CheckPush's checks again (cheap, and what makes reading the frames
    // safe); a 2-bit frame's codes were checked there.
    absl::StatusOr<std::vector<uint64_t>> ids = Ids(msg);
    if (!ids.ok()) return ids.status();
    const uint64_t l = key_.row_length;
    absl::StatusOr<bool> two_bit =
        CheckRowPayload(msg, ids->size(), l, settings, Names());
    if (!two_bit.ok()) return two_bit.status();
    // Each push names an id once for admission, however often it repeats.
    absl::flat_hash_set<uint64_t> named(ids->begin(), ids->end());
    if (key_.sync) {
      const int rank = RankOfId(msg.header.sender());
      if (*two_bit) {
        absl::Status ok = round_.AddTwoBit(rank, *ids, msg.data[1],
                                           settings.threshold, msg.header);
        if (!ok.ok()) {
          ctx.CountMalformed();
          return ok;
        }
      } else {
        round_.Add(rank, *ids,
                   std::vector<Buffer>(msg.data.begin() + 1, msg.data.end()),
                   msg.header);
      }
      for (uint64_t id : named) ++sightings_[id];
      return round_.complete() ? Pushed::kRoundComplete : Pushed::kAdded;
    }
    if (settings.optimizer == nullptr) {
      return absl::FailedPreconditionError(
          "dist_async needs an optimizer on the servers: call set_optimizer "
          "before pushing");
    }
    // One push, one round: repeated ids summed in push order.
    Buffer decoded;
    absl::StatusOr<std::vector<const float*>> row_values =
        RowValues(msg, *two_bit, ids->size(), l, settings.threshold, &decoded);
    if (!row_values.ok()) {
      ctx.CountMalformed();
      return row_values.status();
    }
    const RowSums sums = SumRepeatedRows(*ids, *row_values, l);
    const std::vector<uint32_t> once(sums.ids.size(), 1);
    ctx.TimedUpdate(key_, [&] {
      table_.ApplyRound(
          sums.ids, once, [&](size_t i) { return sums.values.data() + i * l; },
          settings.optimizer.get(), ++key_.steps);
    });
    if (key_.replicated) {
      update_ = Message();
      AddRowUpdate(
          &update_, sums.ids, &once,
          [&sums, l](size_t i) { return sums.values.data() + i * l; }, l);
    }
    Report();
    return Pushed::kApplied;
  }

  Round FinishRound(const ServerSettings& settings) override {
    RowRound::Sum sum = round_.Finish(settings.optimizer != nullptr);
    const uint64_t l = key_.row_length;
    std::vector<uint32_t> seen(sum.rows.size());
    for (size_t i = 0; i < sum.rows.size(); ++i)
      seen[i] = sightings_[sum.rows[i]];
    sightings_.clear();
    Round done;
    done.update_start = absl::Now();
    table_.ApplyRound(
        sum.rows, seen, [&sum, l](size_t i) { return sum.row(i, l); },
        settings.optimizer.get(), ++key_.steps);
    if (key_.replicated) {
      // The table's round is deterministic in what it is given: the backups
      // give theirs the same.
      update_ = Message();
      AddRowUpdate(
          &update_, sum.rows, &seen,
          [&sum, l](size_t i) { return sum.row(i, l); }, l);
    }
    done.update_end = absl::Now();
    done.requests = round_.TakeRequests();
    Report();
    return done;
  }

  bool AnswersWithWeights(wire::Command) const override { return false; }

  void TakeUpdate(Message* out) override {
    MoveFrames(std::move(update_), out);
    update_ = Message();
  }

  absl::Status ApplyReplica(const Message& update,
                            const ServerSettings& settings,
                            EngineContext& ctx) override {
    const uint64_t l = key_.row_length;
    absl::StatusOr<RowUpdate> u = ParseRowUpdate(update, l, true);
    if (!u.ok()) return u.status();
    ctx.TimedUpdate(key_, [&] {
      table_.ApplyRound(
          u->ids, u->sightings, [&u, l](size_t i) { return u->values + i * l; },
          settings.optimizer.get(), ++key_.steps);
    });
    Report();
    return absl::OkStatus();
  }

  void Snapshot(wire::CheckpointKey* out) const override {
    table_.Snapshot(out->mutable_hashed());
  }
  absl::Status Restore(const wire::CheckpointKey& saved) override {
    if (!saved.has_hashed()) {
      return absl::DataLossError(
          absl::StrCat("checkpoint of hashed key ", key_.key, " has no table"));
    }
    absl::Status ok = table_.Restore(saved.hashed());
    Report();
    return ok;
  }

  const HashedTable* hashed_table() const override { return &table_; }

 private:
  // Replicated slices: the last update's frames, until TakeUpdate.
  Message update_;

  // How a refusal of a push names it (row_payload.h).
  RowPayloadNames Names() const {
    return {absl::StrCat("push of hashed key ", key_.key), "ids",
            "hashed key push"};
  }

  // The ids of a push or pull: the first frame, RAW uint64.
  absl::StatusOr<std::vector<uint64_t>> Ids(const Message& msg) const {
    if (msg.data.empty() ||
        msg.header.frames(0).encoding() != wire::DataFrame::RAW ||
        msg.data[0].size() % sizeof(uint64_t) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("call of hashed key ", key_.key,
                       ": its first frame must hold the ids (uint64)"));
    }
    std::vector<uint64_t> ids(msg.data[0].size() / sizeof(uint64_t));
    std::memcpy(ids.data(), msg.data[0].data(), msg.data[0].size());
    return ids;
  }

  // The table's counts into the metrics (deltas since the last report).
  void Report() {
    const HashedTable::Counts& c = table_.counts();
    metrics_.admitted->Increment(c.admitted - reported_.admitted);
    metrics_.evicted->Increment(c.evicted - reported_.evicted);
    metrics_.expired->Increment(c.expired - reported_.expired);
    metrics_.refused->Increment(c.refused - reported_.refused);
    metrics_.dropped->Increment(c.dropped - reported_.dropped);
    metrics_.rows->Add(static_cast<double>(table_.rows()) -
                       static_cast<double>(reported_rows_));
    reported_rows_ = table_.rows();
    reported_ = c;
  }

  HashedTable table_;
  HashedMetrics metrics_;
  HashedTable::Counts reported_;
  uint64_t reported_rows_ = 0;
  // The open round: per id, how many pushes named it.
  absl::flat_hash_map<uint64_t, uint32_t> sightings_;
};

}  // namespace

std::unique_ptr<SliceEngine> MakeHashedEngine(StoredKey& key, int num_workers,
                                              SyncRound::Mode sum_mode,
                                              const HashedSpec& spec) {
  return std::make_unique<HashedEngine>(key, num_workers, sum_mode, spec);
}

}  // namespace tessera
