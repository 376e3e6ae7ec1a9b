// Host-local aggregation (issue #47, docs/local_groups.md): the workers of a
// host that the scheduler put in one local group sum their dense pushes in
// shared memory (LocalGroup) and each key part goes to its server once per
// group: part i of a key is pushed, with the group's sum, and pulled by the
// member (KeyInfo::group_first + i) % size, whose push names the group's
// other members (group_ranks) so that the server counts it for all of them.
// A pull's parts of the other members come from the group in Wait.
//
// What the group adds: float32 pushes are summed in member order and the sum
// rounded to float32 once per value before the server's exact sum; 2-bit
// pushes are summed as integer counts of codes (exact), so the server's sum
// is the same bits as without the group. Row-sparse and hashed keys are not
// grouped (each member pushes its own rows).
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/compression/counts.h"
#include "common/compression/two_bit.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/client/kv_client.h"

namespace tessera {

absl::Status KVClient::JoinLocalGroup() {
  const Node::LocalPlace place = node_->local_place();
  group_split_ = place.split;
  if (place.size < 2) {
    if (options_.local_group) {
      TESSERA_LOG(INFO) << "TESSERA_LOCAL_GROUP=1, but the node table puts "
                           "this worker in no local group (alone on its "
                           "host, or a job that is not grouped): it pushes "
                           "for itself";
    }
    return absl::OkStatus();
  }
  if (options_.restart_count > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", node_->rank(), " restarted (TESSERA_RESTART_COUNT=",
        options_.restart_count, ") into local group ", place.group,
        ": a member of a local group cannot rejoin it (docs/local_groups.md)"));
  }
  LocalGroup::Options o;
  o.name = absl::StrFormat("/tessera-%016x-g%u", place.nonce, place.group);
  o.size = static_cast<int>(place.size);
  o.rank = static_cast<int>(place.rank);
  o.timeout = options_.request_timeout;
  absl::StatusOr<std::unique_ptr<LocalGroup>> joined = LocalGroup::Join(o);
  if (!joined.ok()) {
    return absl::Status(joined.status().code(),
                        absl::StrCat("local group ", place.group, ": ",
                                     joined.status().message()));
  }
  // The members' worker ranks, by local rank: each puts its own in.
  std::vector<int32_t> ranks(place.size, 0);
  ranks[place.rank] = node_->rank();
  TESSERA_RETURN_IF_ERROR((*joined)->AllReduce(ranks.data(), ranks.size()));
  group_ranks_.assign(ranks.begin(), ranks.end());
  group_ = *std::move(joined);
  TESSERA_VLOG(1) << "in local group " << place.group << " as member "
                  << place.rank << " of " << place.size;
  return absl::OkStatus();
}

uint64_t KVClient::DenseChunk(uint64_t length) const {
  uint64_t chunk = std::max<uint64_t>(1, options_.chunk_bytes / sizeof(float));
  if (group_split_ > 1) {
    // Every member of a group carries a share of a big key (one part would
    // put the whole key on one member's connection and core).
    chunk = std::min(
        chunk, std::max<uint64_t>(kMinGroupPart,
                                  (length + group_split_ - 1) / group_split_));
  }
  return chunk;
}

std::vector<bool> KVClient::OwnedParts(const KeyInfo& info) const {
  if (group_ == nullptr) return {};
  std::vector<bool> owned(info.parts.size());
  const uint64_t size = static_cast<uint64_t>(group_->size());
  for (size_t i = 0; i < owned.size(); ++i)
    owned[i] =
        (info.group_first + i) % size == static_cast<uint64_t>(group_->rank());
  return owned;
}

std::vector<std::pair<size_t, size_t>> KVClient::OwnedRanges(
    const std::vector<KeyPart>& parts, const std::vector<bool>& owned) {
  std::vector<std::pair<size_t, size_t>> ranges;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (owned[i])
      ranges.emplace_back(parts[i].offset, parts[i].offset + parts[i].length);
  }
  return ranges;
}

namespace {

// Part `part` of `sum` as a frame that keeps `sum` alive.
Buffer PartOf(const std::shared_ptr<Buffer>& sum, size_t offset, size_t bytes) {
  return Buffer::Wrap(sum->data() + offset, bytes, sum);
}

// Appends a count frame (COUNTS4 when `packed`, else COUNTS8) of
// `threshold`s.
void AddCountsFrame(Message* msg, Buffer counts, uint64_t num_values,
                    float threshold, bool packed) {
  wire::DataFrame* d = msg->header.add_frames();
  d->set_encoding(packed ? wire::DataFrame::COUNTS4 : wire::DataFrame::COUNTS8);
  d->set_num_values(num_values);
  d->set_num_bytes(counts.size());
  d->set_threshold(threshold);
  msg->data.push_back(std::move(counts));
}

// This member's 2-bit codes of `grad` (-1, 0 or +1 a value), coded with and
// into its own error feedback as a 2-bit push without a group is.
absl::StatusOr<std::vector<int32_t>> Codes(absl::Span<const float> grad,
                                           float* residual, float threshold) {
  const size_t n = grad.size();
  std::vector<uint8_t> packed(compression::TwoBitCompressedBytes(n));
  TESSERA_RETURN_IF_ERROR(compression::TwoBitQuantize(
      grad.data(), residual, n, threshold, packed.data()));
  std::vector<float> codes(n);
  TESSERA_RETURN_IF_ERROR(compression::TwoBitDequantize(
      packed.data(), packed.size(), n, 1.0f, codes.data()));
  return std::vector<int32_t>(codes.begin(), codes.end());
}

// Bytes of a part of `length` values as a group pushes it.
uint64_t GroupPartBytes(uint64_t length, bool two_bit, bool packed) {
  if (!two_bit) return length * sizeof(float);
  return packed ? (length + 1) / 2 : length;
}

}  // namespace

absl::StatusOr<OpHandle> KVClient::GroupPush(wire::Command cmd, uint64_t key,
                                             absl::Span<const float> grad,
                                             float* out) {
  TESSERA_RETURN_IF_ERROR(CheckOpen());
  bool two_bit;
  float threshold;
  float* residual;
  std::vector<bool> owned;
  std::vector<KeyPart> parts;
  {
    absl::MutexLock lock(&mu_);
    TESSERA_ASSIGN_OR_RETURN(KeyInfo * info, KeyInfoLocked(key, "push"));
    two_bit = two_bit_;
    threshold = threshold_;
    residual = info->residual.data();
    owned = OwnedParts(*info);
    parts = info->parts;
  }
  const size_t n = grad.size();
  std::shared_ptr<Buffer> sum;  // float32: the group's sum
  std::vector<int32_t> counts;  // 2-bit: the group's counts of codes
  if (!two_bit) {
    // The group's sum, in member order: the same bits at every member.
    sum = std::make_shared<Buffer>(Buffer::CopyOf(grad.data(), n * 4));
    absl::MutexLock lock(&group_mu_);
    TESSERA_RETURN_IF_ERROR(group_->AllReduce(sum->mutable_floats(), n));
  } else {
    // Each member's codes (its own error feedback), summed as integers.
    TESSERA_ASSIGN_OR_RETURN(counts, Codes(grad, residual, threshold));
    absl::MutexLock lock(&group_mu_);
    TESSERA_RETURN_IF_ERROR(group_->AllReduce(counts.data(), n));
  }
  std::vector<int> mates;
  for (int r : group_ranks_)
    if (r != node_->rank()) mates.push_back(r);
  // Counts of a group of up to 7 fit 4 bits: half the bytes of a member's
  // own 2-bit push per member of a group of 4.
  const bool packed = group_->size() <= compression::kMaxCounts4Group;
  absl::StatusOr<OpHandle> op = SendPush(
      cmd, key, out,
      [&](uint64_t, size_t, const KeyPart& part) -> absl::StatusOr<Message> {
        Message body;
        if (!two_bit) {
          AddFloatFrame(&body, PartOf(sum, part.offset * 4, part.length * 4));
          return body;
        }
        Buffer frame =
            Buffer::Allocate(GroupPartBytes(part.length, true, packed));
        const int32_t* c = counts.data() + part.offset;
        if (packed) {
          compression::PackCounts4(c, part.length, frame.mutable_data());
        } else {
          int8_t* out8 = reinterpret_cast<int8_t*>(frame.mutable_data());
          for (uint64_t i = 0; i < part.length; ++i)
            out8[i] = static_cast<int8_t>(c[i]);
        }
        AddCountsFrame(&body, std::move(frame), part.length, threshold, packed);
        return body;
      },
      owned, mates);
  if (!op.ok()) return op;
  // What each member saved: its own push without the group, less its share
  // of what the group sent (every part once, by its owner).
  const uint64_t flat = two_bit ? compression::TwoBitCompressedBytes(n) : n * 4;
  uint64_t group_sent = 0;
  for (const KeyPart& part : parts)
    group_sent += GroupPartBytes(part.length, two_bit, packed);
  const uint64_t share = group_sent / static_cast<uint64_t>(group_->size());
  absl::MutexLock lock(&mu_);
  stats_.group_bytes_saved += flat > share ? flat - share : 0;
  if (out != nullptr) group_pulls_[*op] = {out, n, OwnedRanges(parts, owned)};
  return op;
}

absl::StatusOr<OpHandle> KVClient::GroupPull(uint64_t key, float* out, size_t n,
                                             const PlainReplyFn& plain,
                                             const CopiedFn& copied) {
  std::vector<bool> owned;
  std::vector<KeyPart> parts;
  {
    absl::MutexLock lock(&mu_);
    TESSERA_ASSIGN_OR_RETURN(KeyInfo * info, KeyInfoLocked(key, "pull"));
    owned = OwnedParts(*info);
    parts = info->parts;
  }
  TESSERA_ASSIGN_OR_RETURN(OpHandle op,
                           StartPull(key, n, plain, copied, nullptr, owned));
  uint64_t mine = 0;
  for (size_t i = 0; i < parts.size(); ++i)
    if (owned[i]) mine += parts[i].length;
  absl::MutexLock lock(&mu_);
  stats_.group_bytes_saved += (n - mine) * sizeof(float);
  group_pulls_[op] = {out, n, OwnedRanges(parts, owned)};
  return op;
}

absl::Status KVClient::FinishGroupPull(OpHandle handle, absl::Status status) {
  GroupPullOp pull;
  {
    absl::MutexLock lock(&mu_);
    auto it = group_pulls_.find(handle);
    if (it == group_pulls_.end()) return status;
    pull = std::move(it->second);
    group_pulls_.erase(it);
  }
  // Every member takes part even when its own parts failed (the others wait
  // for it); the pull then fails with its own error.
  absl::Status gathered;
  {
    absl::MutexLock lock(&group_mu_);
    gathered = group_->GatherRanges(pull.out, pull.n, pull.mine);
  }
  if (!status.ok()) return status;
  return gathered;
}

}  // namespace tessera
