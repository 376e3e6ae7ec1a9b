// LocalGroup: the worker processes of one host, summing their buffers in
// shared memory before any byte leaves the host (issue #47: MXNet's `device`
// and `dist_device_sync`, BytePS's reduction within a machine).
//
// Each member maps one POSIX shared-memory segment: a header (the barrier's
// words and each member's process id) and size + 1 regions of `capacity`
// bytes, one per member and one for results. A reduction copies the
// member's buffer into its region; after a barrier, member m sums its share
// of the elements (Share) over every member's region, always in member
// order 0, 1, ..., size - 1, so the bits do not depend on who arrived first;
// after a second barrier every member reads what it needs. Buffers larger
// than a region go in windows of `capacity` bytes.
//
//   LocalGroup::Options o;
//   o.name = "/tessera-<job id>-<host>";  // the same at every member
//   o.size = 4; o.rank = local_rank;
//   ASSIGN_OR_RETURN(auto group, LocalGroup::Join(o));
//   RETURN_IF_ERROR(group->AllReduce(grad.data(), grad.size()));
//
// No member waits for ever: a barrier's wait looks at the other members'
// processes every 50 ms and ends with an error naming a member whose process
// ended (or whose Join never came), or, after `timeout`, naming those that
// did not arrive; the group is broken after that and every member's next
// call fails the same way (a member's death ends the group, as a worker's
// death ends a job; an elastic job re-forms it by joining a new name).
//
// The segment's name is unlinked once every member has joined, so nothing
// is left in /dev/shm after the group, even when a member is killed. The
// name must be unique to one life of the group (the launcher's job id and
// the host): members that joined an older segment of the same name would
// wait at its barrier until their time-out.
//
// Thread-safety: one thread per member at a time (a member's calls are
// its steps of the group's collective sequence, and every member makes the
// same calls in the same order with the same element counts).
#ifndef TESSERA_WORKER_CLIENT_LOCAL_GROUP_H_
#define TESSERA_WORKER_CLIENT_LOCAL_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace tessera {

class LocalGroup {
 public:
  // The largest group: more workers than that on one host are rare enough.
  static constexpr int kMaxMembers = 64;

  struct Options {
    std::string name;  // "/name": no other '/', at most 200 characters
    int size = 1;      // members, 1..kMaxMembers
    int rank = 0;      // this member's place, 0..size-1
    // Bytes per region: how much of a buffer one window reduces.
    size_t capacity = size_t{8} << 20;
    // How long a barrier waits for members that are alive but late.
    absl::Duration timeout = absl::Seconds(60);
  };

  // Joins the group: member 0 creates the segment, the others wait for it
  // (at most `timeout`); returns once every member has joined.
  static absl::StatusOr<std::unique_ptr<LocalGroup>> Join(
      const Options& options);

  ~LocalGroup();
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int size() const { return options_.size; }
  int rank() const { return options_.rank; }

  // The elements [first, second) of an n-element buffer that `member` sums
  // (ReduceScatter) and contributes (AllGather): n * member / size to
  // n * (member + 1) / size.
  std::pair<size_t, size_t> Share(size_t n, int member) const;

  // Every member's `data` (n elements, the same n at every member) becomes
  // the sum over the members, added in member order.
  absl::Status AllReduce(float* data, size_t n);
  absl::Status AllReduce(int32_t* data, size_t n);

  // Only this member's Share of `data` becomes the sum; the rest of `data`
  // is left as it was.
  absl::Status ReduceScatter(float* data, size_t n);
  absl::Status ReduceScatter(int32_t* data, size_t n);

  // Every member's `data` becomes, share by share, what each member's
  // `data` held in its own Share.
  absl::Status AllGather(float* data, size_t n);
  // Every member's `data` becomes, range by range, what the member owning
  // the range held there: `mine` are this member's ranges [first, second).
  // REQUIRES: the members' ranges do not overlap and together cover
  // [0, n) (the rest of `data` would be left unspecified).
  absl::Status GatherRanges(float* data, size_t n,
                            absl::Span<const std::pair<size_t, size_t>> mine);

  // Every member's wait for the others, as the collectives use it.
  absl::Status Barrier();

 private:
  struct Header;
  enum class Op { kAllReduce, kReduceScatter, kAllGather };

  LocalGroup(const Options& options, void* base, size_t mapped);

  static absl::StatusOr<std::pair<void*, size_t>> Create(const Options& options,
                                                         size_t bytes);
  static absl::StatusOr<std::pair<void*, size_t>> Open(const Options& options,
                                                       size_t bytes);
  Header* header() const;
  unsigned char* region(int member) const;

  template <typename T>
  absl::Status Collective(Op op, T* data, size_t n);
  template <typename T>
  void SumWindow(T* out, size_t lo, size_t hi) const;

  // Why a barrier's wait cannot go on (a member's process ended, the group
  // was broken, or `deadline` passed with members missing), or OK.
  absl::Status CheckMembers(absl::Time deadline);
  // Marks the group broken by `member` (unless it already was) and wakes
  // every waiter; returns the group's error.
  absl::Status Broken(int member, uint32_t reason);

  const Options options_;
  void* base_;
  size_t mapped_;
  absl::Status broken_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_LOCAL_GROUP_H_
