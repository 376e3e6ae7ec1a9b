// Optimizer: the update rules a server applies to its weights, set by the
// workers with a spec string such as "sgd lr=0.1 momentum=0.9 wd=1e-4" (MXNet's
// names and defaults).
//
//   absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create("adam lr=0.001");
//   std::vector<std::vector<float>> state(opt->state_slots(), std::vector<float>(n));
//   opt->Update(w, g, n, slots, /*step=*/1);
//
// Rules (g is the pushed gradient, or the round's sum in dist_sync; clip(x)
// clamps to +-clip_gradient when clip_gradient > 0):
//   sgd:     g' = clip(rescale_grad*g); without momentum w -= lr*(g' + wd*w);
//            with it m = momentum*m - lr*(g' + wd*w); w += m.
//   adam:    g' = clip(rescale_grad*g) + wd*w; m = b1*m + (1-b1)*g';
//            v = b2*v + (1-b2)*g'^2;
//            w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+epsilon).
//   adamax:  g' = clip(rescale_grad*g) + wd*w; m = b1*m + (1-b1)*g';
//            u = max(b2*u, |g'|);
//            w -= lr/(1-b1^t) * m/u  (skipped where u == 0).
//   adagrad: g' = clip(rescale_grad*g); h += g'^2;
//            w -= lr*(g'/sqrt(h+epsilon) + wd*w).
// t is the key's update count, from 1. Every optimizer takes a step schedule,
// as MXNet's FactorScheduler: with lr_step=N > 0 the learning rate is
// multiplied by lr_factor after every N updates of a key
// (lr_t = lr * lr_factor^floor((t-1)/N)).
//
// Thread-safety: Update is const and may run on several threads for different
// keys.
#ifndef TESSERA_SERVER_OPTIMIZER_H_
#define TESSERA_SERVER_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tessera {

class Optimizer {
 public:
  // Parses a spec. "none" (or "") gives nullptr: no updater. InvalidArgument
  // names an unknown optimizer, an unknown parameter, or a value that is not a
  // finite number.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(
      const std::string& spec);

  virtual ~Optimizer() = default;

  // The canonical spec, with every parameter (e.g. "sgd clip_gradient=0 lr=0.1
  // ...").
  std::string spec() const;
  const std::string& name() const { return name_; }
  float param(const std::string& key) const { return params_.at(key); }
  // The learning rate of update `step` (from 1) under the step schedule.
  float ScheduledLr(uint64_t step) const;

  // Number of per-element state arrays (0 for plain sgd, 1 for momentum, 2 for
  // adam).
  virtual int state_slots() const = 0;

  // Updates n weights in place with gradient g. `state` has state_slots()
  // arrays of n floats (zero at the first step); `step` counts this key's
  // updates from 1.
  virtual void Update(float* w, const float* g, size_t n, float* const* state,
                      uint64_t step) const = 0;

 protected:
  Optimizer(std::string name, std::map<std::string, float> params)
      : name_(std::move(name)), params_(std::move(params)) {}
  std::string name_;
  std::map<std::string, float> params_;
};

}  // namespace tessera

#endif  // TESSERA_SERVER_OPTIMIZER_H_
