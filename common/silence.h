// Silence: how long a peer has been silent, judged by what the observer could
// have heard. A node whose own receiving was held up (a receive thread busy
// with a long message or a backlog of bulk records, a process the machine did
// not schedule) hears nothing in that time from anyone, and must not take its
// own delay for the peer's death (issue #46: a server on a 2-core machine
// running 289 processes declared the scheduler dead after 10 s without its
// heartbeat answers, which sat unread in its own queue).
//
// The observer notes when a receive last found nothing waiting
// (`heard_until`): everything sent before then has been heard. Silence counts
// up to that time, not up to now. An observer whose receiving never catches
// up still judges by the clock, at kHeldUpFactor times the time-out, so that
// nothing waits for ever.
//
//   const Silence s = MeasureSilence(last_heard_from, heard_until, now);
//   if (s.TooLong(timeout)) ... declare the peer gone, naming s.Describe() ...
#ifndef TESSERA_COMMON_SILENCE_H_
#define TESSERA_COMMON_SILENCE_H_

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace tessera {

// An observer whose receiving has been held up throughout still declares a
// peer gone after this many time-outs of silence by the clock.
inline constexpr int kHeldUpFactor = 3;

struct Silence {
  absl::Duration heard;  // up to when the observer last caught up
  absl::Duration wall;   // up to now

  bool TooLong(absl::Duration timeout) const {
    return heard > timeout || wall > kHeldUpFactor * timeout;
  }
  // "10.03s", or "31s (this node's receiving was held up for the last 28s)".
  std::string Describe(absl::Time now, absl::Time heard_until) const {
    std::string d =
        absl::FormatDuration(absl::Trunc(wall, absl::Milliseconds(10)));
    if (wall - heard > absl::Seconds(1)) {
      absl::StrAppend(&d, " (this node's receiving was held up for the last ",
                      absl::FormatDuration(absl::Trunc(now - heard_until,
                                                       absl::Milliseconds(10))),
                      ")");
    }
    return d;
  }
};

inline Silence MeasureSilence(absl::Time last_heard_from,
                              absl::Time heard_until, absl::Time now) {
  Silence s;
  s.wall = now - last_heard_from;
  s.heard = std::max(absl::ZeroDuration(),
                     std::min(now, heard_until) - last_heard_from);
  return s;
}

}  // namespace tessera

#endif  // TESSERA_COMMON_SILENCE_H_
