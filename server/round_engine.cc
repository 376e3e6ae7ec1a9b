#include "server/round_engine.h"

#include <cstring>

namespace tessera {

void SyncRound::Add(int rank, Buffer values, const wire::Header& request) {
  pushes_[rank] = std::move(values);
  requests_.push_back(request);
  ++count_;
}

void SyncRound::ReplaceRequest(int sender, const wire::Header& request) {
  for (wire::Header& h : requests_) {
    if (h.sender() == sender) h = request;
  }
}

Buffer SyncRound::TakeSum() {
  Buffer sum;
  if (pushes_.size() == 1) {
    sum = std::move(pushes_[0]);
  } else {
    sum = Buffer::Allocate(length_ * sizeof(float));
    float* out = sum.mutable_floats();
    std::memcpy(out, pushes_[0].data(), length_ * sizeof(float));
    for (size_t r = 1; r < pushes_.size(); ++r) {
      const float* g = pushes_[r].floats();
      for (uint64_t i = 0; i < length_; ++i) out[i] += g[i];
    }
  }
  for (Buffer& b : pushes_) b = Buffer();
  count_ = 0;
  return sum;
}

std::vector<wire::Header> SyncRound::TakeRequests() {
  std::vector<wire::Header> out;
  out.swap(requests_);
  return out;
}

}  // namespace tessera
