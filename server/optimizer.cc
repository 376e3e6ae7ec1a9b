#include "server/optimizer.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace tessera {
namespace {

inline float Clip(float x, float c) {
  return c > 0 ? std::min(std::max(x, -c), c) : x;
}

class Sgd : public Optimizer {
 public:
  using Optimizer::Optimizer;
  int state_slots() const override {
    return params_.at("momentum") != 0 ? 1 : 0;
  }
  void Update(float* w, const float* g, size_t n, float* const* state,
              uint64_t step) const override {
    const float lr = ScheduledLr(step), wd = params_.at("wd"),
                mom = params_.at("momentum");
    const float rescale = params_.at("rescale_grad"),
                clip = params_.at("clip_gradient");
    if (mom == 0) {
      if (wd == 0 && clip <= 0) {
        for (size_t i = 0; i < n; ++i) w[i] -= lr * (rescale * g[i]);
      } else {
        for (size_t i = 0; i < n; ++i)
          w[i] -= lr * (Clip(rescale * g[i], clip) + wd * w[i]);
      }
      return;
    }
    float* m = state[0];
    for (size_t i = 0; i < n; ++i) {
      m[i] = mom * m[i] - lr * (Clip(rescale * g[i], clip) + wd * w[i]);
      w[i] += m[i];
    }
  }
};

class Adam : public Optimizer {
 public:
  using Optimizer::Optimizer;
  int state_slots() const override { return 2; }
  void Update(float* w, const float* g, size_t n, float* const* state,
              uint64_t step) const override {
    const float lr = ScheduledLr(step), b1 = params_.at("beta1"),
                b2 = params_.at("beta2");
    const float eps = params_.at("epsilon"), wd = params_.at("wd");
    const float rescale = params_.at("rescale_grad"),
                clip = params_.at("clip_gradient");
    const double t = static_cast<double>(step);
    const float lr_t = static_cast<float>(
        lr * std::sqrt(1.0 - std::pow(b2, t)) / (1.0 - std::pow(b1, t)));
    float* m = state[0];
    float* v = state[1];
    for (size_t i = 0; i < n; ++i) {
      const float gi = Clip(rescale * g[i], clip) + wd * w[i];
      m[i] = b1 * m[i] + (1 - b1) * gi;
      v[i] = b2 * v[i] + (1 - b2) * gi * gi;
      w[i] -= lr_t * m[i] / (std::sqrt(v[i]) + eps);
    }
  }
};

class AdaMax : public Optimizer {
 public:
  using Optimizer::Optimizer;
  int state_slots() const override { return 2; }
  void Update(float* w, const float* g, size_t n, float* const* state,
              uint64_t step) const override {
    const float lr = ScheduledLr(step), b1 = params_.at("beta1"),
                b2 = params_.at("beta2");
    const float wd = params_.at("wd");
    const float rescale = params_.at("rescale_grad"),
                clip = params_.at("clip_gradient");
    const float lr_t = static_cast<float>(
        lr / (1.0 - std::pow(b1, static_cast<double>(step))));
    float* m = state[0];
    float* u = state[1];
    for (size_t i = 0; i < n; ++i) {
      const float gi = Clip(rescale * g[i], clip) + wd * w[i];
      m[i] = b1 * m[i] + (1 - b1) * gi;
      u[i] = std::max(b2 * u[i], std::fabs(gi));
      if (u[i] > 0) w[i] -= lr_t * m[i] / u[i];
    }
  }
};

class AdaGrad : public Optimizer {
 public:
  using Optimizer::Optimizer;
  int state_slots() const override { return 1; }
  void Update(float* w, const float* g, size_t n, float* const* state,
              uint64_t step) const override {
    const float lr = ScheduledLr(step), eps = params_.at("epsilon"),
                wd = params_.at("wd");
    const float rescale = params_.at("rescale_grad"),
                clip = params_.at("clip_gradient");
    float* h = state[0];
    for (size_t i = 0; i < n; ++i) {
      const float gi = Clip(rescale * g[i], clip);
      h[i] += gi * gi;
      w[i] -= lr * (gi / std::sqrt(h[i] + eps) + wd * w[i]);
    }
  }
};

struct Kind {
  std::map<std::string, float> defaults;
};

const std::map<std::string, Kind>& Kinds() {
  static const auto* kinds = new std::map<std::string, Kind>{
      {"sgd",
       {{{"lr", 0.01f},
         {"momentum", 0},
         {"wd", 0},
         {"rescale_grad", 1},
         {"clip_gradient", 0},
         {"lr_factor", 1},
         {"lr_step", 0}}}},
      {"adam",
       {{{"lr", 0.001f},
         {"beta1", 0.9f},
         {"beta2", 0.999f},
         {"epsilon", 1e-8f},
         {"wd", 0},
         {"rescale_grad", 1},
         {"clip_gradient", 0},
         {"lr_factor", 1},
         {"lr_step", 0}}}},
      {"adamax",
       {{{"lr", 0.002f},
         {"beta1", 0.9f},
         {"beta2", 0.999f},
         {"wd", 0},
         {"rescale_grad", 1},
         {"clip_gradient", 0},
         {"lr_factor", 1},
         {"lr_step", 0}}}},
      {"adagrad",
       {{{"lr", 0.01f},
         {"epsilon", 1e-7f},
         {"wd", 0},
         {"rescale_grad", 1},
         {"clip_gradient", 0},
         {"lr_factor", 1},
         {"lr_step", 0}}}},
  };
  return *kinds;
}

}  // namespace

float Optimizer::ScheduledLr(uint64_t step) const {
  const float lr = params_.at("lr");
  const float step_size = params_.at("lr_step");
  if (step_size < 1 || step == 0) return lr;
  const double drops =
      std::floor(static_cast<double>(step - 1) / std::floor(step_size));
  return static_cast<float>(
      lr * std::pow(static_cast<double>(params_.at("lr_factor")), drops));
}

std::string Optimizer::spec() const {
  std::vector<std::string> parts = {name_};
  for (const auto& [k, v] : params_) parts.push_back(absl::StrCat(k, "=", v));
  return absl::StrJoin(parts, " ");
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(
    const std::string& spec) {
  std::vector<std::string> words =
      absl::StrSplit(spec, ' ', absl::SkipWhitespace());
  if (words.empty() || words[0] == "none") {
    if (words.size() > 1) {
      return absl::InvalidArgumentError("optimizer 'none' takes no parameters");
    }
    return std::unique_ptr<Optimizer>();
  }
  const std::string name = words[0];
  auto kind = Kinds().find(name);
  if (kind == Kinds().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown optimizer '", name,
                     "': expected sgd, adam, adamax, adagrad or none"));
  }
  std::map<std::string, float> params = kind->second.defaults;
  for (size_t i = 1; i < words.size(); ++i) {
    std::vector<std::string> kv =
        absl::StrSplit(words[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer parameter '", words[i], "': expected name=value"));
    }
    if (params.count(kv[0]) == 0) {
      std::vector<std::string> known;
      for (const auto& [k, v] : kind->second.defaults) known.push_back(k);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown parameter '", kv[0], "' for optimizer ", name,
                       " (known: ", absl::StrJoin(known, ", "), ")"));
    }
    float value = 0;
    if (!absl::SimpleAtof(kv[1], &value) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", kv[0], "='", kv[1], "' of optimizer ",
                       name, ": expected a finite number"));
    }
    params[kv[0]] = value;
  }
  if (name == "sgd")
    return std::unique_ptr<Optimizer>(new Sgd(name, std::move(params)));
  if (name == "adam")
    return std::unique_ptr<Optimizer>(new Adam(name, std::move(params)));
  if (name == "adamax")
    return std::unique_ptr<Optimizer>(new AdaMax(name, std::move(params)));
  return std::unique_ptr<Optimizer>(new AdaGrad(name, std::move(params)));
}

}  // namespace tessera
