// RowEngine: a slice of a row-sparse key, num_rows x row_length float32
// (slice_engine.h). Pushes and pulls name rows (a RAW frame of uint64 row ids
// of the whole key, then, for pushes, the rows' values, float32 or 2-bit). A
// dist_sync round sums the rows pushed (RowRound) and updates only those
// (MXNet's lazy update); dist_async applies each push to its rows.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/compression/bf16.h"
#include "server/key_store.h"
#include "server/replication.h"
#include "server/row_payload.h"
#include "server/slice_engine.h"

namespace tessera {
namespace {

class RowEngine : public RoundSliceEngine<RowRound> {
 public:
  // Row pull replies travel in frames of about this many bytes.
  static constexpr size_t kReplyFrameBytes = size_t{1} << 20;

  RowEngine(StoredKey& key, int num_workers, SyncRound::Mode sum_mode)
      : RoundSliceEngine(key, num_workers, key.row_length, sum_mode) {}

  absl::Status Pull(const Message& request, Message* reply,
                    EngineContext& ctx) override {
    absl::StatusOr<std::vector<uint64_t>> rows = LocalRows(request);
    if (!rows.ok()) return rows.status();
    const uint64_t l = key_.row_length;
    const float* w = key_.weights.floats();
    // bfloat16 rows when the pull asks for compression: half the bytes, each
    // value rounded to nearest even. Frames of whole rows, about 1 MiB each.
    const bool bf16 = request.header.pull_compressed();
    const size_t value_bytes = bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t n = rows->size();
    const size_t per_frame = RowsPerFrame(n, l * value_bytes, kReplyFrameBytes);
    for (size_t first = 0; first < n || first == 0; first += per_frame) {
      const size_t count = std::min(per_frame, n - first);
      Buffer out = Buffer::Allocate(count * l * value_bytes);
      if (bf16) {
        uint16_t* h = reinterpret_cast<uint16_t*>(out.mutable_data());
        for (size_t i = 0; i < count; ++i)
          compression::FloatsToBf16(w + (*rows)[first + i] * l, l, h + i * l);
        AddBf16Frame(reply, std::move(out));
      } else {
        float* f = out.mutable_floats();
        for (size_t i = 0; i < count; ++i) {
          std::memcpy(f + i * l, w + (*rows)[first + i] * l, l * sizeof(float));
        }
        AddFloatFrame(reply, std::move(out));  // zero rows: an empty frame
      }
      if (n == 0) break;
    }
    return absl::OkStatus();
  }

  absl::Status CheckPush(const Message& msg,
                         const ServerSettings& settings) const override {
    absl::StatusOr<std::vector<uint64_t>> rows = LocalRows(msg);
    if (!rows.ok()) return rows.status();
    return CheckRowPush(msg, rows->size(), key_.row_length, settings, Names());
  }

  absl::StatusOr<Pushed> Push(const Message& msg,
                              const ServerSettings& settings,
                              EngineContext& ctx) override {
    // CheckPush's checks again (cheap, and what makes reading the frames
    // safe); a 2-bit frame's codes were checked there.
    absl::StatusOr<std::vector<uint64_t>> rows = LocalRows(msg);
    if (!rows.ok()) return rows.status();
    const uint64_t l = key_.row_length;
    absl::StatusOr<bool> two_bit =
        CheckRowPayload(msg, rows->size(), l, settings, Names());
    if (!two_bit.ok()) return two_bit.status();
    if (key_.sync) {
      const int rank = RankOfId(msg.header.sender());
      if (*two_bit) {
        // Counted straight into the round's sum.
        absl::Status ok = round_.AddTwoBit(rank, *std::move(rows), msg.data[1],
                                           settings.threshold, msg.header);
        if (!ok.ok()) {
          ctx.CountMalformed();
          return ok;
        }
      } else {
        round_.Add(rank, *std::move(rows),
                   std::vector<Buffer>(msg.data.begin() + 1, msg.data.end()),
                   msg.header);
      }
      return round_.complete() ? Pushed::kRoundComplete : Pushed::kAdded;
    }
    // Row i's values, wherever its frame put them.
    Buffer decoded;
    absl::StatusOr<std::vector<const float*>> row_values =
        RowValues(msg, *two_bit, rows->size(), l, settings.threshold, &decoded);
    if (!row_values.ok()) {
      ctx.CountMalformed();
      return row_values.status();
    }
    if (settings.optimizer == nullptr) {
      return absl::FailedPreconditionError(
          "dist_async needs an optimizer on the servers: call set_optimizer "
          "before pushing");
    }
    // Duplicate ids of one push are summed first (in push order), then each
    // row is updated once.
    const RowSums sums = SumRepeatedRows(*rows, *row_values, l);
    ctx.TimedUpdate(key_, [&] {
      key_.ApplyRowUpdates(*settings.optimizer, sums.ids, sums.values.data());
    });
    if (key_.replicated) {
      update_ = Message();
      AddRowUpdate(
          &update_, sums.ids, nullptr,
          [&sums, l](size_t i) { return sums.values.data() + i * l; }, l);
    }
    return Pushed::kApplied;
  }

  Round FinishRound(const ServerSettings& settings) override {
    RowRound::Sum sum = round_.Finish(settings.optimizer != nullptr);
    const uint64_t l = key_.row_length;
    Round done;
    done.update_start = absl::Now();
    if (settings.optimizer != nullptr) {
      key_.ApplyRowUpdates(*settings.optimizer, sum.rows,
                           [&sum, l](size_t i) { return sum.row(i, l); });
    } else if (!sum.rows.empty()) {
      // The rows present become the round's sum; the others keep their
      // values.
      if (!key_.weights.unique())
        key_.weights = Buffer::CopyOf(key_.weights.data(), key_.weights.size());
      float* w = key_.weights.mutable_floats();
      for (size_t i = 0; i < sum.rows.size(); ++i)
        std::memcpy(w + sum.rows[i] * l, sum.row(i, l), l * sizeof(float));
    }
    if (key_.replicated) {
      // The backups apply the same summed rows by the same rule.
      update_ = Message();
      AddRowUpdate(
          &update_, sum.rows, nullptr,
          [&sum, l](size_t i) { return sum.row(i, l); }, l);
    }
    done.update_end = absl::Now();
    done.requests = round_.TakeRequests();
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
    absl::StatusOr<RowUpdate> u = ParseRowUpdate(update, l, false);
    if (!u.ok()) return u.status();
    for (uint64_t row : u->ids) {
      if (row >= key_.rows())
        return absl::DataLossError(absl::StrCat("update of key ", key_.key,
                                                " names row ", row, " of ",
                                                key_.rows()));
    }
    if (settings.optimizer != nullptr) {
      ctx.TimedUpdate(key_, [&] {
        key_.ApplyRowUpdates(*settings.optimizer, u->ids, u->values);
      });
    } else if (!u->ids.empty()) {
      if (!key_.weights.unique())
        key_.weights = Buffer::CopyOf(key_.weights.data(), key_.weights.size());
      float* w = key_.weights.mutable_floats();
      for (size_t i = 0; i < u->ids.size(); ++i)
        std::memcpy(w + u->ids[i] * l, u->values + i * l, l * sizeof(float));
    }
    return absl::OkStatus();
  }

 private:
  // Replicated slices: the last update's frames, until TakeUpdate.
  Message update_;

  // How a refusal of a push names it (row_payload.h).
  RowPayloadNames Names() const {
    return {absl::StrCat("row push of key ", key_.key), "row ids", "row push"};
  }

  // The row ids of a push or pull as rows of this slice; InvalidArgument
  // naming the key and the id when one is outside it.
  absl::StatusOr<std::vector<uint64_t>> LocalRows(const Message& msg) const {
    if (msg.data.empty() ||
        msg.header.frames(0).encoding() != wire::DataFrame::RAW ||
        msg.data[0].size() % sizeof(uint64_t) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("row call of key ", key_.key,
                       ": its first frame must hold the row ids (uint64)"));
    }
    const size_t count = msg.data[0].size() / sizeof(uint64_t);
    std::vector<uint64_t> rows(count);
    std::memcpy(rows.data(), msg.data[0].data(), count * sizeof(uint64_t));
    for (uint64_t& row : rows) {
      if (row >= key_.total_length) {
        return absl::InvalidArgumentError(
            absl::StrCat("key ", key_.key, ": row id ", row, " is past its ",
                         key_.total_length, " rows"));
      }
      if (row < key_.offset || row >= key_.offset + key_.rows()) {
        return absl::InvalidArgumentError(
            absl::StrCat("key ", key_.key, ": row id ", row,
                         " is not on this server (it holds rows [", key_.offset,
                         ", +", key_.rows(), "))"));
      }
      row -= key_.offset;
    }
    return rows;
  }
};

}  // namespace

std::unique_ptr<SliceEngine> MakeRowEngine(StoredKey& key, int num_workers,
                                           SyncRound::Mode sum_mode) {
  return std::make_unique<RowEngine>(key, num_workers, sum_mode);
}

}  // namespace tessera
