#include "server/pull_shadow.h"

#include <cmath>
#include <cstring>

#include "common/compression/two_bit.h"
#include "common/compression/two_bit_kernels.h"

namespace tessera {

PullShadow::PullShadow(const Buffer& weights, uint64_t chain)
    : chain_(chain), shadow_(Buffer::CopyOf(weights.data(), weights.size())) {}

namespace {

// mean |w - s| over n values, in double; four fixed partial sums so the
// vectoriser can use them, in the same order every time.
double MeanAbsDifference(const float* __restrict w, const float* __restrict s,
                         size_t n) {
  double part[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (size_t j = 0; j < 4; ++j)
      part[j] += std::fabs(static_cast<double>(w[i + j] - s[i + j]));
  }
  for (; i < n; ++i) part[0] += std::fabs(static_cast<double>(w[i] - s[i]));
  return ((part[0] + part[1]) + (part[2] + part[3])) / static_cast<double>(n);
}

// Codes r = w - s against t into `out` (MXNet's layout: byte b holds elements
// 4b..4b+3, the first in the two highest bits) and adds what each code stands
// for to s, exactly as TwoBitDequantizeAdd adds it on the worker: s + (+t, -t
// or +0.0f), one float32 addition per element.
void CodeAndAdvance(const float* __restrict w, float* __restrict s, size_t n,
                    float t, uint8_t* __restrict out) {
  namespace k = compression::kernels;
  const float neg_t = -t;
  for (size_t b = 0; 4 * b < n; ++b) {
    uint32_t byte = 0;
    const size_t valid = n - 4 * b < 4 ? n - 4 * b : 4;
    for (size_t j = 0; j < valid; ++j) {
      const size_t i = 4 * b + j;
      const float r = w[i] - s[i];
      const uint32_t code =
          r >= t ? k::kCodePlus : (r <= neg_t ? k::kCodeMinus : k::kCodeZero);
      s[i] = s[i] + k::DecodeElement(code, t, neg_t);
      byte |= code << k::ByteShift(j);
    }
    out[b] = static_cast<uint8_t>(byte);
  }
}

}  // namespace

void PullShadow::Advance(const Buffer& weights) {
  changed_ = false;
  const size_t n = weights.num_floats();
  const float* w = weights.floats();
  if (!shadow_.unique()) shadow_ = Buffer::CopyOf(shadow_.data(), shadow_.size());
  float* s = shadow_.mutable_floats();
  const float t = static_cast<float>(MeanAbsDifference(w, s, n));
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
  std::memset(packed.mutable_data(), 0, packed.size());
  CodeAndAdvance(w, s, n, t, packed.mutable_data());
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
  const bool same_chain = request.pull_chain() == chain_ && have >= 1 &&
                          have <= version_;
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
