#include "worker/client/local_group.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace tessera {
namespace {

constexpr uint64_t kMagic = 0x7465737365726147;  // "tesseraG"
constexpr absl::Duration kLook = absl::Milliseconds(50);
constexpr size_t kRegionAlign = 64;
// The header's page; the regions follow it.
constexpr size_t kHeaderBytes = 4096;

enum Reason : uint32_t { kEnded = 1, kLate = 2, kLeft = 3 };

uint32_t Code(int member, Reason reason) {
  return static_cast<uint32_t>(member + 1) | (reason << 8);
}

std::string Errno() { return std::strerror(errno); }

// Whether process `pid` still runs (a zombie, ended but not yet reaped by
// its parent, does not).
bool Running(int32_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() ||
         (line[paren + 2] != 'Z' && line[paren + 2] != 'X');
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t seen,
               absl::Duration at_most) {
  const timespec ts = absl::ToTimespec(at_most);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts,
          nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX,
          nullptr, nullptr, 0);
}

absl::Status CheckOptions(const LocalGroup::Options& o) {
  if (o.name.size() < 2 || o.name.size() > 200 || o.name[0] != '/' ||
      o.name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("local group name '", o.name,
                     "': expected '/' and 1-199 characters without '/'"));
  }
  if (o.size < 1 || o.size > LocalGroup::kMaxMembers) {
    return absl::InvalidArgumentError(absl::StrCat("local group size ", o.size,
                                                   ": expected 1 to ",
                                                   LocalGroup::kMaxMembers));
  }
  if (o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "local group rank ", o.rank, ": expected 0 to ", o.size - 1));
  }
  if (o.capacity < kRegionAlign || o.capacity % kRegionAlign != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local group capacity ", o.capacity,
                     ": expected a positive multiple of ", kRegionAlign));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("local group timeout: expected > 0");
  }
  return absl::OkStatus();
}

}  // namespace

struct LocalGroup::Header {
  std::atomic<uint64_t> magic;
  uint32_t size;
  uint32_t reserved;
  uint64_t capacity;
  std::atomic<uint32_t> arrived;
  std::atomic<uint32_t> generation;  // the futex word: barriers passed
  std::atomic<uint32_t> broken;      // 0, or Code(member, reason)
  std::atomic<int32_t> pid[kMaxMembers];
  std::atomic<uint32_t> entered[kMaxMembers];  // barriers each entered
};

namespace {
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free,
              "the group's words are shared between processes");
}  // namespace

absl::StatusOr<std::unique_ptr<LocalGroup>> LocalGroup::Join(
    const Options& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  static_assert(sizeof(Header) <= kHeaderBytes, "the header fits its page");
  const size_t bytes =
      kHeaderBytes + (static_cast<size_t>(options.size) + 1) * options.capacity;
  absl::StatusOr<std::pair<void*, size_t>> mapped =
      options.rank == 0 ? Create(options, bytes) : Open(options, bytes);
  if (!mapped.ok()) return mapped.status();
  std::unique_ptr<LocalGroup> group(
      new LocalGroup(options, mapped->first, mapped->second));
  group->header()->pid[options.rank].store(getpid());
  absl::Status joined = group->Barrier();
  // Every member has the segment mapped (or the group failed): its name
  // is not needed any more.
  if (options.rank == 0) shm_unlink(options.name.c_str());
  if (!joined.ok()) return joined;
  return group;
}

absl::StatusOr<std::pair<void*, size_t>> LocalGroup::Create(
    const Options& options, size_t bytes) {
  // A segment of this name left by a group that failed before all joined.
  shm_unlink(options.name.c_str());
  const int fd =
      shm_open(options.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("local group ", options.name, ": shm_open: ", Errno()));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string err = Errno();
    close(fd);
    shm_unlink(options.name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("local group ", options.name, ": cannot size ", bytes,
                     " bytes of shared memory: ", err));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const std::string err = Errno();
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(options.name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("local group ", options.name, ": mmap: ", err));
  }
  Header* h = new (base) Header();  // the zero bytes ftruncate gave
  h->size = static_cast<uint32_t>(options.size);
  h->capacity = options.capacity;
  h->magic.store(kMagic);
  return std::make_pair(base, bytes);
}

absl::StatusOr<std::pair<void*, size_t>> LocalGroup::Open(
    const Options& options, size_t bytes) {
  const absl::Time deadline = absl::Now() + options.timeout;
  while (true) {
    const int fd = shm_open(options.name.c_str(), O_RDWR, 0);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 &&
        static_cast<size_t>(st.st_size) >= kHeaderBytes) {
      const size_t size = static_cast<size_t>(st.st_size);
      void* base =
          mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (base == MAP_FAILED) {
        return absl::ResourceExhaustedError(
            absl::StrCat("local group ", options.name, ": mmap: ", Errno()));
      }
      Header* h = static_cast<Header*>(base);
      if (h->magic.load() == kMagic) {
        if (h->size == static_cast<uint32_t>(options.size) &&
            h->capacity == options.capacity && size == bytes) {
          return std::make_pair(base, size);
        }
        const std::string made =
            absl::StrCat(h->size, " members of ", h->capacity, " bytes");
        munmap(base, size);
        return absl::FailedPreconditionError(absl::StrCat(
            "local group ", options.name, " was made for ", made,
            "; this member (rank ", options.rank, ") was told ", options.size,
            " members of ", options.capacity, " bytes"));
      }
      munmap(base, size);
    } else if (fd >= 0) {
      close(fd);
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "local group ", options.name, ": member 0 did not create it within ",
          absl::FormatDuration(options.timeout)));
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

LocalGroup::LocalGroup(const Options& options, void* base, size_t mapped)
    : options_(options), base_(base), mapped_(mapped) {}

LocalGroup::~LocalGroup() {
  // A member that leaves while the others still call: their next wait
  // ends with its name, not at their time-out.
  uint32_t none = 0;
  if (header()->broken.compare_exchange_strong(none,
                                               Code(options_.rank, kLeft))) {
    FutexWakeAll(&header()->generation);
  }
  munmap(base_, mapped_);
}

LocalGroup::Header* LocalGroup::header() const {
  return static_cast<Header*>(base_);
}

unsigned char* LocalGroup::region(int member) const {
  return static_cast<unsigned char*>(base_) + kHeaderBytes +
         static_cast<size_t>(member) * options_.capacity;
}

std::pair<size_t, size_t> LocalGroup::Share(size_t n, int member) const {
  const size_t size = static_cast<size_t>(options_.size);
  const size_t m = static_cast<size_t>(member);
  return {n * m / size, n * (m + 1) / size};
}

absl::Status LocalGroup::Broken(int member, uint32_t reason) {
  uint32_t none = 0;
  header()->broken.compare_exchange_strong(
      none, Code(member, static_cast<Reason>(reason)));
  FutexWakeAll(&header()->generation);
  return CheckMembers(absl::InfiniteFuture());
}

absl::Status LocalGroup::CheckMembers(absl::Time deadline) {
  if (!broken_.ok()) return broken_;
  Header* h = header();
  const uint32_t code = h->broken.load();
  if (code != 0) {
    const int member = static_cast<int>(code & 0xff) - 1;
    const std::string who =
        absl::StrCat("member ", member, " (pid ", h->pid[member].load(), ")");
    const std::string group = absl::StrCat(" of local group ", options_.name);
    switch (code >> 8) {
      case kLate:
        broken_ = absl::DeadlineExceededError(
            absl::StrCat(who, group, " did not arrive within ",
                         absl::FormatDuration(options_.timeout)));
        break;
      case kLeft:
        broken_ = absl::UnavailableError(
            absl::StrCat(who, group, " left it while others waited"));
        break;
      default:
        broken_ = absl::UnavailableError(
            absl::StrCat(who, group, " ended; the group cannot go on"));
    }
    return broken_;
  }
  for (int m = 0; m < options_.size; ++m) {
    if (m == options_.rank) continue;
    const int32_t pid = h->pid[m].load();
    if (pid != 0 && !Running(pid)) return Broken(m, kEnded);
  }
  if (absl::Now() < deadline) return absl::OkStatus();
  const uint32_t mine = h->entered[options_.rank].load();
  for (int m = 0; m < options_.size; ++m) {
    if (h->entered[m].load() < mine) return Broken(m, kLate);
  }
  return absl::OkStatus();
}

absl::Status LocalGroup::Barrier() {
  if (!broken_.ok()) return broken_;
  Header* h = header();
  // Broken while this member was away (it was late, or another ended).
  if (h->broken.load() != 0) return CheckMembers(absl::InfiniteFuture());
  const uint32_t generation = h->generation.load();
  h->entered[options_.rank].fetch_add(1);
  if (h->arrived.fetch_add(1) + 1 == static_cast<uint32_t>(options_.size)) {
    // The last to arrive: no one can enter the next barrier before this
    // one's generation moves on (each must see it move first).
    h->arrived.store(0);
    h->generation.fetch_add(1);
    FutexWakeAll(&h->generation);
    return absl::OkStatus();
  }
  const absl::Time deadline = absl::Now() + options_.timeout;
  while (h->generation.load() == generation) {
    FutexWait(&h->generation, generation, kLook);
    if (h->generation.load() != generation) break;
    absl::Status s = CheckMembers(deadline);
    if (!s.ok() && h->generation.load() == generation) return s;
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status LocalGroup::Collective(Op op, T* data, size_t n) {
  if (!broken_.ok()) return broken_;
  if (options_.size == 1 || n == 0) return absl::OkStatus();
  const size_t per = options_.capacity / sizeof(T);
  const auto [first, last] = Share(n, options_.rank);
  T* mine = reinterpret_cast<T*>(region(options_.rank));
  T* result = reinterpret_cast<T*>(region(options_.size));
  for (size_t off = 0; off < n; off += per) {
    const size_t len = std::min(per, n - off);
    // This member's share within the window, window-relative.
    const size_t lo = std::clamp(first, off, off + len) - off;
    const size_t hi = std::clamp(last, off, off + len) - off;
    if (op == Op::kAllGather) {
      std::copy(data + off + lo, data + off + hi, mine + lo);
    } else {
      std::copy(data + off, data + off + len, mine);
    }
    if (absl::Status s = Barrier(); !s.ok()) return s;
    if (op == Op::kAllGather) {
      for (int m = 0; m < options_.size; ++m) {
        if (m == options_.rank) continue;
        const auto [a, b] = Share(n, m);
        const size_t mlo = std::clamp(a, off, off + len) - off;
        const size_t mhi = std::clamp(b, off, off + len) - off;
        const T* theirs = reinterpret_cast<const T*>(region(m));
        std::copy(theirs + mlo, theirs + mhi, data + off + mlo);
      }
    } else {
      T* sum = op == Op::kAllReduce ? result : data + off;
      SumWindow<T>(sum, lo, hi);
    }
    if (absl::Status s = Barrier(); !s.ok()) return s;
    if (op == Op::kAllReduce) std::copy(result, result + len, data + off);
  }
  return absl::OkStatus();
}

// Sums the regions' elements [lo, hi) into out[lo, hi), member after member
// in member order (each element's additions in that order).
template <typename T>
void LocalGroup::SumWindow(T* out, size_t lo, size_t hi) const {
  const T* first = reinterpret_cast<const T*>(region(0));
  std::copy(first + lo, first + hi, out + lo);
  for (int m = 1; m < options_.size; ++m) {
    const T* in = reinterpret_cast<const T*>(region(m));
    for (size_t j = lo; j < hi; ++j) {
      if constexpr (std::is_integral_v<T>) {
        // Wrapping, as the server's integer sums: no undefined overflow.
        out[j] = static_cast<T>(static_cast<uint32_t>(out[j]) +
                                static_cast<uint32_t>(in[j]));
      } else {
        out[j] += in[j];
      }
    }
  }
}

absl::Status LocalGroup::AllReduce(float* data, size_t n) {
  return Collective(Op::kAllReduce, data, n);
}
absl::Status LocalGroup::AllReduce(int32_t* data, size_t n) {
  return Collective(Op::kAllReduce, data, n);
}
absl::Status LocalGroup::ReduceScatter(float* data, size_t n) {
  return Collective(Op::kReduceScatter, data, n);
}
absl::Status LocalGroup::ReduceScatter(int32_t* data, size_t n) {
  return Collective(Op::kReduceScatter, data, n);
}
absl::Status LocalGroup::AllGather(float* data, size_t n) {
  return Collective(Op::kAllGather, data, n);
}

absl::Status LocalGroup::GatherRanges(
    float* data, size_t n, absl::Span<const std::pair<size_t, size_t>> mine) {
  if (!broken_.ok()) return broken_;
  if (options_.size == 1 || n == 0) return absl::OkStatus();
  const size_t per = options_.capacity / sizeof(float);
  float* result = reinterpret_cast<float*>(region(options_.size));
  for (size_t off = 0; off < n; off += per) {
    const size_t len = std::min(per, n - off);
    // The results' region is free once every member is here: the one
    // before may still be reading it (the last step of every collective).
    if (absl::Status s = Barrier(); !s.ok()) return s;
    // Each member writes its own ranges of the window: no two overlap.
    for (const auto& [first, last] : mine) {
      const size_t lo = std::clamp(first, off, off + len);
      const size_t hi = std::clamp(last, off, off + len);
      std::copy(data + lo, data + hi, result + (lo - off));
    }
    if (absl::Status s = Barrier(); !s.ok()) return s;
    std::copy(result, result + len, data + off);
  }
  return absl::OkStatus();
}

}  // namespace tessera
