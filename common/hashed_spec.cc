#include "common/hashed_spec.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/split_mix.h"

namespace tessera {
namespace {

absl::Status Expected(absl::string_view name, absl::string_view what,
                      absl::string_view got) {
  return absl::InvalidArgumentError(absl::StrCat(
      "hashed key option ", name, ": expected ", what, ", got '", got, "'"));
}

absl::Status ParseCount(absl::string_view name, absl::string_view value,
                        uint64_t min, uint64_t* out) {
  uint64_t v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < min) {
    return Expected(
        name, min == 0 ? "a whole number >= 0" : "a whole number >= 1", value);
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ParseFinite(absl::string_view name, absl::string_view value,
                         float* out) {
  float v = 0;
  if (!absl::SimpleAtof(value, &v) || !std::isfinite(v))
    return Expected(name, "a finite number", value);
  *out = v;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HashedSpec> HashedSpec::Parse(const std::string& text) {
  HashedSpec s;
  for (absl::string_view item :
       absl::StrSplit(text, absl::ByAnyChar(" \t,"), absl::SkipEmpty())) {
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hashed key options: expected name=value, got '", item, "'"));
    }
    const absl::string_view name = item.substr(0, eq);
    const absl::string_view value = item.substr(eq + 1);
    absl::Status ok;
    if (name == "init") {
      if (value == "zeros") {
        s.init = Init::kZeros;
      } else if (value == "uniform") {
        s.init = Init::kUniform;
      } else if (value == "normal") {
        s.init = Init::kNormal;
      } else {
        ok = Expected(name, "zeros, uniform or normal", value);
      }
    } else if (name == "low") {
      ok = ParseFinite(name, value, &s.low);
    } else if (name == "high") {
      ok = ParseFinite(name, value, &s.high);
    } else if (name == "mean") {
      ok = ParseFinite(name, value, &s.mean);
    } else if (name == "std") {
      ok = ParseFinite(name, value, &s.stddev);
      if (ok.ok() && s.stddev < 0) ok = Expected(name, "a number >= 0", value);
    } else if (name == "seed") {
      ok = ParseCount(name, value, 0, &s.seed);
    } else if (name == "admit_after") {
      ok = ParseCount(name, value, 1, &s.admit_after);
      if (ok.ok() && s.admit_after > 65535)
        ok = Expected(name, "a whole number in 1..65535", value);
    } else if (name == "expire_after") {
      ok = ParseCount(name, value, 0, &s.expire_after);
    } else if (name == "capacity") {
      ok = ParseCount(name, value, 0, &s.capacity);
    } else {
      ok = absl::InvalidArgumentError(absl::StrCat(
          "hashed key options: unknown option '", name,
          "' (known: init, low, high, mean, std, seed, admit_after, "
          "expire_after, capacity)"));
    }
    if (!ok.ok()) return ok;
  }
  if (s.init == Init::kUniform && !(s.low <= s.high)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hashed key options: low=", s.low, " must not exceed high=", s.high));
  }
  if (s.init == Init::kUniform && !std::isfinite(s.high - s.low)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hashed key options: high - low (", s.high, " - ", s.low,
                     ") must be a finite float"));
  }
  return s;
}

std::string HashedSpec::ToString() const {
  const char* names[] = {"zeros", "uniform", "normal"};
  std::string out =
      absl::StrCat("init=", names[static_cast<int>(init)], " seed=", seed,
                   " admit_after=", admit_after, " expire_after=", expire_after,
                   " capacity=", capacity);
  // Floats with enough digits to come back the same.
  auto exact = [](float v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
    return std::string(buf);
  };
  if (init == Init::kUniform)
    absl::StrAppend(&out, " low=", exact(low), " high=", exact(high));
  if (init == Init::kNormal)
    absl::StrAppend(&out, " mean=", exact(mean), " std=", exact(stddev));
  return out;
}

float HashedSpec::InitialValue(uint64_t id, uint64_t column) const {
  if (init == Init::kZeros) return 0.0f;
  const uint64_t h =
      SplitMix64(SplitMix64(seed ^ 0x5851f42d4c957f2dULL) ^ SplitMix64(id) ^
                 (column * 0x9e3779b97f4a7c15ULL));
  if (init == Init::kUniform) {
    // 24 random bits: u in [0, 1), then low + (high - low) u in float32.
    const float u = static_cast<float>(h >> 40) * 0x1.0p-24f;
    return low + (high - low) * u;
  }
  // Box-Muller on two 53-bit uniforms in (0, 1) and [0, 1).
  const uint64_t h2 = SplitMix64(h ^ 0xd1b54a32d192ed03ULL);
  const double u1 = (static_cast<double>(h >> 11) + 0.5) * 0x1.0p-53;
  const double u2 = static_cast<double>(h2 >> 11) * 0x1.0p-53;
  const double z =
      std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925 * u2);
  return static_cast<float>(static_cast<double>(mean) +
                            static_cast<double>(stddev) * z);
}

int HashedServerOf(uint64_t id, int num_servers) {
  return static_cast<int>(SplitMix64(id ^ 0x2545f4914f6cdd1dULL) %
                          static_cast<uint64_t>(num_servers));
}

}  // namespace tessera
