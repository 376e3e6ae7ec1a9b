#include "worker/trainer/straggler.h"

namespace tessera {

absl::Duration Straggler::Delay(int64_t step) const {
  if (every_ <= 0 || observed_ == 0 || (step + 1) % every_ != 0)
    return absl::ZeroDuration();
  return (total_ / observed_) * (factor_ - 1);
}

void Straggler::Observe(absl::Duration compute) {
  total_ += compute;
  ++observed_;
}

}  // namespace tessera
