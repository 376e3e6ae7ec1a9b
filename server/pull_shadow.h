// PullShadow: what the workers that pull one key slice compressed hold, kept
// on the server as a chain of versions, so that a pull can send the change of
// the weights 2-bit coded and the worker's copy never drifts from what the
// server believes it holds.
//
// Version 1 of a chain is the weights as they were when the first compressed
// pull came. When the weights have changed since the newest version, the next
// compressed pull of a worker that holds the newest version (or none) makes a
// new one (a worker behind is brought to the newest first; at the end of a
// dist_sync round the server makes it at once): r = weights - shadow, a threshold t =
// mean |r| (chosen per version, so it follows the size of the changes as the
// learning rate and the gradients do; a fixed threshold would send nothing
// once the changes shrink below it, or ±t far too coarse while they are big),
// the 2-bit code of r with t in MXNet's format, and shadow += decoded code.
// What the shadow still lacks, r minus what was sent, is the error feedback:
// it goes out in later versions. The worker applies the same codes with the
// same float32 additions (TwoBitDequantizeAdd), so its copy is the shadow,
// bit for bit.
//
//   PullShadow shadow(weights, chain);      // on the first compressed pull
//   shadow.MarkChanged();                   // after every update of the weights
//   shadow.Answer(weights, request.header, &reply);
//
// A worker holding version v of the same chain gets the codes of versions
// v+1.. (none when it is current); one whose copy the chain cannot bring
// forward (none, another chain, or older than the kept history) gets the
// shadow itself as float32 and then compressed pulls again. Memory: the shadow
// (4 bytes per value) and the newest kHistory codes (1/16 of that each).
//
// Thread-safety: none; owned with its key (see KVServer).
#ifndef TESSERA_SERVER_PULL_SHADOW_H_
#define TESSERA_SERVER_PULL_SHADOW_H_

#include <cstdint>
#include <deque>

#include "common/buffer.h"
#include "common/message.h"

namespace tessera {

class PullShadow {
 public:
  // Versions whose codes are kept for workers that fell behind.
  static constexpr size_t kHistory = 8;

  PullShadow(const Buffer& weights, uint64_t chain);

  // The weights changed: the next pull makes a new version.
  void MarkChanged() { changed_ = true; }
  // Makes that version now (when pulls are sure to follow: the end of a
  // dist_sync round), so the pulls find it ready.
  void CatchUp(const Buffer& weights);

  // Answers a compressed pull: the header's pull_chain and pull_version say
  // what the worker holds; sets the reply's pull_* fields and data frames.
  void Answer(const Buffer& weights, const wire::Header& request,
              Message* reply);

  uint64_t chain() const { return chain_; }
  uint64_t version() const { return version_; }
  const Buffer& shadow() const { return shadow_; }

 private:
  // Makes a new version from `weights` (or none when nothing differs).
  void Advance(const Buffer& weights);

  struct Change {
    uint64_t version = 0;
    float threshold = 0;
    Buffer packed;
  };
  const uint64_t chain_;
  uint64_t version_ = 1;
  Buffer shadow_;  // float32; copy on write (replies share it)
  std::deque<Change> history_;
  bool changed_ = false;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_PULL_SHADOW_H_
