#include "worker/client/pulled_copy.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/compression/two_bit.h"

namespace tessera {

uint64_t PulledCopy::chain() const {
  absl::MutexLock lock(&mu_);
  return chain_;
}

uint64_t PulledCopy::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

absl::Status PulledCopy::Apply(const Message& reply) {
  const wire::Header& h = reply.header;
  absl::MutexLock lock(&mu_);
  // The analysis does not see that a lambda runs under the caller's lock.
  auto bad = [&](const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    chain_ = 0;  // the next pull asks for the shadow whole
    version_ = 0;
    return absl::DataLossError(
        absl::StrCat("compressed pull reply from node ", h.sender(), ": ", why));
  };
  if (reply.data.size() != static_cast<size_t>(h.frames_size()))
    return bad("frames do not match their descriptors");
  if (h.pull_chain() == 0 || h.pull_version() == 0)
    return bad("no chain or version");
  if (h.pull_from_version() == 0) {
    // The server's shadow, whole.
    if (reply.data.size() != 1 ||
        h.frames(0).encoding() != wire::DataFrame::FLOAT32 ||
        h.frames(0).num_values() != length_ ||
        reply.data[0].size() != length_ * sizeof(float)) {
      return bad(absl::StrCat("expected ", length_, " float32 values"));
    }
    values_.assign(reply.data[0].floats(), reply.data[0].floats() + length_);
    chain_ = h.pull_chain();
    version_ = h.pull_version();
    return absl::OkStatus();
  }
  const uint64_t from = h.pull_from_version();
  const uint64_t to = h.pull_version();
  if (to < from || to - from != reply.data.size())
    return bad(absl::StrCat("versions ", from, " to ", to, " in ",
                            reply.data.size(), " frames"));
  if (h.pull_chain() != chain_ || version_ < from)
    return bad(absl::StrCat("changes from version ", from, " of chain ",
                            h.pull_chain(), " but this copy holds version ",
                            version_, " of chain ", chain_));
  // Check every frame before applying any: a bad one changes nothing.
  for (size_t i = 0; i < reply.data.size(); ++i) {
    const wire::DataFrame& d = h.frames(static_cast<int>(i));
    if (d.encoding() != wire::DataFrame::TWO_BIT || d.num_values() != length_)
      return bad(absl::StrCat("frame ", i, " is not 2-bit for ", length_,
                              " values"));
    absl::Status ok = compression::TwoBitValidate(
        reply.data[i].data(), reply.data[i].size(), length_, d.threshold());
    if (!ok.ok()) return bad(absl::StrCat("frame ", i, ": ", ok.message()));
  }
  for (size_t i = 0; i < reply.data.size(); ++i) {
    if (from + 1 + i <= version_) continue;  // an overlapping pull applied it
    (void)compression::TwoBitDequantizeAdd(
        reply.data[i].data(), reply.data[i].size(), length_,
        h.frames(static_cast<int>(i)).threshold(), values_.data());
  }
  version_ = std::max(version_, to);
  return absl::OkStatus();
}

void PulledCopy::CopyTo(float* out) const {
  absl::MutexLock lock(&mu_);
  std::memcpy(out, values_.data(), values_.size() * sizeof(float));
}

}  // namespace tessera
