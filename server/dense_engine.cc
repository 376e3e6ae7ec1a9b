// DenseEngine: a slice of one array (slice_engine.h). Pushes are float32 or
// 2-bit; a dist_sync round sums them exactly (SyncRound); pulls take the
// whole slice, or (compressed) the changes since the worker's copy as 2-bit
// frames against a chain of versions (PullShadow).
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/compression/counts.h"
#include "common/compression/two_bit.h"
#include "common/hashed_spec.h"
#include "common/status_macros.h"
#include "server/key_store.h"
#include "server/pull_shadow.h"
#include "server/round_kernels.h"
#include "server/slice_engine.h"

namespace tessera {
namespace {

class DenseEngine : public RoundSliceEngine<SyncRound> {
 public:
  DenseEngine(StoredKey& key, int num_workers, SyncRound::Mode sum_mode)
      : RoundSliceEngine(key, num_workers, key.length, sum_mode) {}

  absl::Status Pull(const Message& request, Message* reply,
                    EngineContext& ctx) override {
    if (!request.header.pull_compressed()) {
      AddFloatFrame(reply, key_.weights);
      return absl::OkStatus();
    }
    if (shadow_ == nullptr)
      shadow_ = std::make_unique<PullShadow>(key_.weights, ctx.NewChain());
    shadow_->Answer(key_.weights, request.header, reply);
    return absl::OkStatus();
  }

  bool TakesGroupPushes() const override { return true; }

  absl::Status CheckPush(const Message& msg,
                         const ServerSettings& settings) const override {
    TESSERA_RETURN_IF_ERROR(CheckPayload(msg, settings));
    const wire::DataFrame::Encoding encoding = msg.header.frames(0).encoding();
    if (encoding == wire::DataFrame::TWO_BIT) {
      absl::Status codes =
          compression::TwoBitValidate(msg.data[0].data(), msg.data[0].size(),
                                      key_.length, settings.threshold);
      if (codes.ok()) return codes;
      return absl::Status(codes.code(), absl::StrCat("push of key ", key_.key,
                                                     ": ", codes.message()));
    }
    if (encoding != wire::DataFrame::COUNTS8 &&
        encoding != wire::DataFrame::COUNTS4) {
      return absl::OkStatus();
    }
    TESSERA_RETURN_IF_ERROR(CheckCountsFrame(msg, settings));
    return CheckCounts(msg);
  }

  absl::StatusOr<Pushed> Push(const Message& msg,
                              const ServerSettings& settings,
                              EngineContext& ctx) override {
    // The frames again (cheap, and what makes reading them safe); the
    // counts' range and the 2-bit codes were checked in CheckPush.
    TESSERA_RETURN_IF_ERROR(CheckPayload(msg, settings));
    const wire::DataFrame::Encoding encoding = msg.header.frames(0).encoding();
    const bool two_bit = encoding == wire::DataFrame::TWO_BIT;
    const bool counts = encoding == wire::DataFrame::COUNTS8 ||
                        encoding == wire::DataFrame::COUNTS4;
    Buffer group_counts;  // a group's 2-bit push: int8 counts
    if (counts) {
      TESSERA_ASSIGN_OR_RETURN(group_counts, GroupCounts(msg, settings));
    }
    if (key_.sync) {
      const int rank = RankOfId(msg.header.sender());
      absl::Status added =
          two_bit  ? round_.AddTwoBit(rank, msg.data[0], settings.threshold,
                                      msg.header)
          : counts ? round_.AddCounts(rank, group_counts, settings.threshold,
                                      msg.header)
                   : round_.AddFloats(rank, msg.data[0], msg.header);
      if (absl::IsDataLoss(added)) ctx.CountMalformed();
      TESSERA_RETURN_IF_ERROR(added);
      // A local group's push holds its mates' pushes of the round.
      for (int mate : msg.header.group_ranks()) round_.Cover(mate);
      return round_.complete() ? Pushed::kRoundComplete : Pushed::kAdded;
    }
    // dist_async: the gradient as float32 (a 2-bit one decoded), applied.
    Buffer grad = msg.data[0];
    if (counts) {
      grad = Buffer::Allocate(key_.length * sizeof(float));
      const int8_t* c = reinterpret_cast<const int8_t*>(group_counts.data());
      float* out = grad.mutable_floats();
      for (uint64_t i = 0; i < key_.length; ++i)
        out[i] =
            static_cast<float>(static_cast<double>(c[i]) * settings.threshold);
    } else if (two_bit) {
      grad = Buffer::Allocate(key_.length * sizeof(float));
      absl::Status s = compression::TwoBitDequantize(
          msg.data[0].data(), msg.data[0].size(), key_.length,
          settings.threshold, grad.mutable_floats());
      if (!s.ok()) {
        ctx.CountMalformed();
        return s;
      }
    }
    if (settings.optimizer == nullptr) {
      return absl::FailedPreconditionError(
          "dist_async needs an optimizer on the servers: call set_optimizer "
          "before pushing");
    }
    ctx.TimedUpdate(
        key_, [&] { key_.ApplyUpdate(*settings.optimizer, grad.floats()); });
    if (key_.replicated) update_ = std::move(grad);
    return Pushed::kApplied;
  }

  Round FinishRound(const ServerSettings& settings) override {
    // The backups apply the same rounded sum: a round of 2-bit pushes goes
    // to them as its counts (a byte a value, exact), any other as float32.
    const bool with_optimizer = settings.optimizer != nullptr;
    SyncRound::Sum sum =
        round_.Finish(key_.replicated && with_optimizer, with_optimizer);
    Round done;
    done.update_start = absl::Now();
    if (with_optimizer) {
      key_.ApplyUpdate(*settings.optimizer, sum.values);
      if (key_.replicated) {
        if (!sum.counts.empty()) {
          update_ = std::move(sum.counts);
          update_threshold_ = sum.threshold;
        } else {
          update_ = Buffer::CopyOf(sum.values, key_.length * sizeof(float));
        }
      }
    } else {
      if (!sum.push.empty()) {
        key_.weights =
            std::move(sum.push);  // one worker: its push is the value
      } else if (key_.weights.unique()) {
        // The store becomes the round's sum (all-reduce).
        std::memcpy(key_.weights.mutable_floats(), sum.values,
                    key_.length * sizeof(float));
      } else {
        // A pull reply still sends the old value: copy on write.
        key_.weights = Buffer::CopyOf(sum.values, key_.length * sizeof(float));
      }
      WeightsChanged();
      if (key_.replicated) update_ = key_.weights;  // the new value
    }
    round_.Release();
    done.update_end = absl::Now();
    done.requests = round_.TakeRequests();
    return done;
  }

  void TakeUpdate(Message* out) override {
    if (update_threshold_ != 0) {
      wire::DataFrame* d = out->header.add_frames();
      d->set_encoding(wire::DataFrame::COUNTS8);
      d->set_num_values(update_.size());
      d->set_num_bytes(update_.size());
      d->set_threshold(update_threshold_);
      out->data.push_back(std::move(update_));
    } else {
      AddFloatFrame(out, std::move(update_));
    }
    update_ = Buffer();
    update_threshold_ = 0;
  }

  absl::Status ApplyReplica(const Message& update,
                            const ServerSettings& settings,
                            EngineContext& ctx) override {
    if (update.data.size() == 1 &&
        update.header.frames(0).encoding() == wire::DataFrame::COUNTS8 &&
        update.data[0].size() == key_.length && settings.optimizer != nullptr) {
      // The primary's rounding of the same counts: the same floats.
      const float t = update.header.frames(0).threshold();
      const int8_t* c = reinterpret_cast<const int8_t*>(update.data[0].data());
      std::vector<int32_t> wide(c, c + key_.length);
      std::vector<float> sum(key_.length);
      round_kernels::CountsToFloats(wide.data(), key_.length, t, sum.data());
      ctx.TimedUpdate(
          key_, [&] { key_.ApplyUpdate(*settings.optimizer, sum.data()); });
      return absl::OkStatus();
    }
    if (update.data.size() != 1 ||
        update.header.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
        update.data[0].size() != key_.length * sizeof(float)) {
      return absl::DataLossError(absl::StrCat(
          "update of key ", key_.key, " is not ", key_.length, " float32"));
    }
    // The primary's rule: the optimizer on the rounded sum (or the async
    // push), or, with none, the sum as the value.
    if (settings.optimizer != nullptr) {
      ctx.TimedUpdate(key_, [&] {
        key_.ApplyUpdate(*settings.optimizer, update.data[0].floats());
      });
    } else {
      key_.weights = update.data[0];
      WeightsChanged();
    }
    return absl::OkStatus();
  }

  void AfterRound() override {
    // Every worker pulls after a round: its compressed version is made now,
    // while the answers travel, not when the first pull comes.
    if (shadow_ != nullptr) shadow_->CatchUp(key_.weights);
  }

  bool AnswersWithWeights(wire::Command command) const override {
    return command == wire::KV_PUSHPULL;
  }

  void WeightsChanged() override {
    if (shadow_ != nullptr) shadow_->MarkChanged();
  }

  const PullShadow* pull_shadow() const override { return shadow_.get(); }

 private:
  // A push's payload against the slice and the settings.
  absl::Status CheckPayload(const Message& msg,
                            const ServerSettings& settings) const {
    if (msg.data.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("push of key ", key_.key, " carries ", msg.data.size(),
                       " data frames; expected 1"));
    }
    const wire::DataFrame& desc = msg.header.frames(0);
    if (desc.num_values() != key_.length) {
      return absl::InvalidArgumentError(
          absl::StrCat("push of key ", key_.key, " has ", desc.num_values(),
                       " values; the key has ", key_.length, " here"));
    }
    if (desc.encoding() == wire::DataFrame::FLOAT32) return absl::OkStatus();
    if (desc.encoding() == wire::DataFrame::COUNTS8 ||
        desc.encoding() == wire::DataFrame::COUNTS4) {
      return absl::OkStatus();  // GroupCounts checks them
    }
    if (desc.encoding() != wire::DataFrame::TWO_BIT) {
      return absl::InvalidArgumentError(
          "push payload must be float32 or 2-bit");
    }
    if (settings.compression != "2bit") {
      return absl::InvalidArgumentError(
          "2-bit payload but gradient compression is not set on this server");
    }
    return absl::OkStatus();
  }

  // A local group's 2-bit push (docs/local_groups.md): one count a value
  // (int8, or two 4-bit counts a byte) of the server's threshold, in a
  // frame of the slice's size.
  absl::Status CheckCountsFrame(const Message& msg,
                                const ServerSettings& settings) const {
    const int members = msg.header.group_ranks_size() + 1;
    if (members < 2 || settings.compression != "2bit") {
      return absl::InvalidArgumentError(absl::StrCat(
          "push of key ", key_.key,
          ": counts of 2-bit codes come only in a local group's push with "
          "2-bit compression set (",
          members - 1, " group mate(s) named, compression ",
          settings.compression, ")"));
    }
    const bool packed =
        msg.header.frames(0).encoding() == wire::DataFrame::COUNTS4;
    const uint64_t bytes = packed ? (key_.length + 1) / 2 : key_.length;
    if (msg.data[0].size() != bytes ||
        msg.header.frames(0).threshold() != settings.threshold) {
      return absl::InvalidArgumentError(absl::StrCat(
          "push of key ", key_.key, ": ", msg.data[0].size(), " bytes of ",
          packed ? "4-bit" : "8-bit", " counts of threshold ",
          msg.header.frames(0).threshold(), "; expected ", bytes, " of ",
          settings.threshold));
    }
    return absl::OkStatus();
  }

  // Each count of a frame CheckCountsFrame took within the group's size,
  // read where it lies on the wire (nothing unpacked).
  absl::Status CheckCounts(const Message& msg) const {
    const int members = msg.header.group_ranks_size() + 1;
    const bool packed =
        msg.header.frames(0).encoding() == wire::DataFrame::COUNTS4;
    const uint8_t* in = msg.data[0].data();
    for (uint64_t i = 0; i < key_.length; ++i) {
      int count;
      if (packed) {
        // A 4-bit half of 8..15 is -8..-1 (compression::UnpackCounts4).
        const uint8_t half = i % 2 == 0 ? (in[i / 2] & 0x0f) : (in[i / 2] >> 4);
        count = static_cast<int8_t>(half << 4) >> 4;
      } else {
        count = static_cast<int8_t>(in[i]);
      }
      if (count > members || count < -members) {
        return absl::InvalidArgumentError(absl::StrCat(
            "push of key ", key_.key, ": count ", count, " at value ", i,
            " from a group of ", members, " (at most ", members, " each way)"));
      }
    }
    return absl::OkStatus();
  }

  // A group push's counts (CheckPush took them) as int8, one a value.
  absl::StatusOr<Buffer> GroupCounts(const Message& msg,
                                     const ServerSettings& settings) const {
    TESSERA_RETURN_IF_ERROR(CheckCountsFrame(msg, settings));
    if (msg.header.frames(0).encoding() != wire::DataFrame::COUNTS4)
      return msg.data[0];
    Buffer counts = Buffer::Allocate(key_.length);
    compression::UnpackCounts4(
        msg.data[0].data(), key_.length,
        reinterpret_cast<int8_t*>(counts.mutable_data()));
    return counts;
  }

  // What workers pulling compressed hold (made on the first such pull).
  std::unique_ptr<PullShadow> shadow_;
  // Replicated slices: the last update, until TakeUpdate (counts of
  // update_threshold_ when that is not 0, else float32).
  Buffer update_;
  float update_threshold_ = 0;
};

}  // namespace

std::unique_ptr<SliceEngine> MakeDenseEngine(StoredKey& key, int num_workers,
                                             SyncRound::Mode sum_mode) {
  return std::make_unique<DenseEngine>(key, num_workers, sum_mode);
}

std::unique_ptr<SliceEngine> MakeSliceEngine(StoredKey& key, int num_workers,
                                             SyncRound::Mode sum_mode) {
  if (key.hashed()) {
    // Checked when the key was made (KVServer::Init, KeyStore::Restore).
    absl::StatusOr<HashedSpec> spec = HashedSpec::Parse(key.hashed_spec);
    return MakeHashedEngine(key, num_workers, sum_mode,
                            spec.ok() ? *spec : HashedSpec());
  }
  return key.row_length != 0 ? MakeRowEngine(key, num_workers, sum_mode)
                             : MakeDenseEngine(key, num_workers, sum_mode);
}

}  // namespace tessera
