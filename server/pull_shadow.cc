#include "server/pull_shadow.h"

#include <cmath>
#include <cstring>

#include "common/compression/two_bit.h"
#include "server/round_kernels.h"

namespace tessera {

PullShadow::PullShadow(const Buffer& weights, uint64_t chain)
    : chain_(chain), shadow_(Buffer::CopyOf(weights.data(), weights.size())) {}

void PullShadow::Advance(const Buffer& weights) {
  changed_ = false;
  const size_t n = weights.num_floats();
  const float* w = weights.floats();
  if (!shadow_.unique())
    shadow_ = Buffer::CopyOf(shadow_.data(), shadow_.size());
  float* s = shadow_.mutable_floats();
  const float t = static_cast<float>(round_kernels::MeanAbsDifference(w, s, n));
  if (t == 0) return;  // nothing differs: no new version
  ++version_;
  if (!std::isfinite(t)) {
    // Infinite or NaN weights cannot be coded: every worker takes the shadow
    // whole (the history no longer leads to this version).
    std::memcpy(s, w, n * sizeof(float));
    history_.clear();
    return;
  }
  Buffer packed = Buffer::Allocate(compression::TwoBitCompressedBytes(n));
  round_kernels::CodeChange(w, s, n, t, packed.mutable_data());
  history_.push_back(Change{version_, t, std::move(packed)});
  while (history_.size() > kHistory) history_.pop_front();
}

void PullShadow::CatchUp(const Buffer& weights) {
  if (changed_) Advance(weights);
}

void PullShadow::Answer(const Buffer& weights, const wire::Header& request,
                        Message* reply) {
  const uint64_t have = request.pull_version();
  // A worker behind the newest version first catches up to it; only one at
  // the newest makes the next (dist_async: otherwise every pull would add a
  // version, and workers would fall behind the history).
  if (changed_ && (request.pull_chain() != chain_ || have >= version_))
    Advance(weights);
  const bool same_chain =
      request.pull_chain() == chain_ && have >= 1 && have <= version_;
  const bool reachable =
      same_chain &&
      (have == version_ ||
       (!history_.empty() && have + 1 >= history_.front().version));
  reply->header.set_pull_chain(chain_);
  reply->header.set_pull_version(version_);
  if (!reachable) {
    reply->header.set_pull_from_version(0);
    AddFloatFrame(reply, shadow_);
    return;
  }
  reply->header.set_pull_from_version(have);
  for (const Change& c : history_) {
    if (c.version <= have) continue;
    AddTwoBitFrame(reply, c.packed, shadow_.num_floats());
    reply->header.mutable_frames(reply->header.frames_size() - 1)
        ->set_threshold(c.threshold);
  }
}

}  // namespace tessera
