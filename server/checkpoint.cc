#include "server/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/trace.h"
#include "server/kv_server.h"

namespace tessera {
namespace {

constexpr char kMagic[4] = {'T', 'S', 'C', 'K'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 4 + 4 + 8;

absl::Status OsError(const std::string& what, const std::string& path) {
  return absl::UnavailableError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(const std::string& in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) {
    v |= static_cast<uint64_t>(static_cast<uint8_t>(in[at + i])) << (8 * i);
  }
  return v;
}

absl::Status WriteAll(int fd, const std::string& data,
                      const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError("cannot write", path);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FsyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) return OsError("cannot open", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return OsError("cannot fsync", path);
  return absl::OkStatus();
}

}  // namespace

CheckpointStore::CheckpointStore(std::string dir, int server_rank, int keep)
    : dir_(std::move(dir)),
      server_rank_(server_rank),
      keep_(std::max(1, keep)) {}

std::string CheckpointStore::FileName(uint64_t sequence) const {
  return absl::StrFormat("%s/server-%d-%020d.ckpt", dir_, server_rank_,
                         sequence);
}

std::vector<std::string> CheckpointStore::List() const {
  std::vector<std::string> files;
  DIR* d = ::opendir(dir_.c_str());
  if (d == nullptr) return files;
  const std::string prefix = absl::StrCat("server-", server_rank_, "-");
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0 || name.size() != prefix.size() + 20 + 5 ||
        name.substr(name.size() - 5) != ".ckpt") {
      continue;
    }
    uint64_t seq = 0;
    if (!absl::SimpleAtoi(name.substr(prefix.size(), 20), &seq)) continue;
    files.push_back(absl::StrCat(dir_, "/", name));
  }
  ::closedir(d);
  std::sort(files.begin(),
            files.end());  // zero-padded: lexical order is numeric order
  return files;
}

absl::Status CheckpointStore::Write(wire::ServerCheckpoint& shard) {
  // A server's weights are its user's: a folder it creates is 0700 and every
  // file 0600 (a folder the user made keeps its own mode).
  if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) {
    return OsError("cannot create checkpoint folder", dir_);
  }
  uint64_t next = 1;
  const std::vector<std::string> existing = List();
  if (!existing.empty()) {
    const std::string& last = existing.back();
    uint64_t seq = 0;
    if (absl::SimpleAtoi(last.substr(last.size() - 25, 20), &seq))
      next = seq + 1;
  }
  shard.set_server_rank(server_rank_);
  shard.set_sequence(next);
  std::string payload;
  if (!shard.SerializeToString(&payload)) {
    return absl::InternalError("cannot serialize the checkpoint (over 2 GiB?)");
  }
  std::string file(kMagic, 4);
  PutLe(&file, kVersion, 4);
  PutLe(&file, payload.size(), 8);
  file += payload;
  const uint32_t crc = static_cast<uint32_t>(::crc32(
      0, reinterpret_cast<const Bytef*>(payload.data()), payload.size()));
  PutLe(&file, crc, 4);

  const std::string final_path = FileName(next);
  const std::string tmp_path = final_path + ".tmp";
  const int fd =
      ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, 0600);
  if (fd < 0) return OsError("cannot create", tmp_path);
  // An earlier life's leftover keeps its mode through O_TRUNC.
  absl::Status written = ::fchmod(fd, 0600) == 0
                             ? absl::OkStatus()
                             : OsError("cannot chmod", tmp_path);
  if (written.ok()) written = WriteAll(fd, file, tmp_path);
  if (written.ok() && ::fsync(fd) != 0)
    written = OsError("cannot fsync", tmp_path);
  ::close(fd);
  if (!written.ok()) {
    ::unlink(tmp_path.c_str());
    return written;
  }
  if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    const absl::Status s = OsError("cannot rename to", final_path);
    ::unlink(tmp_path.c_str());
    return s;
  }
  absl::Status synced = FsyncPath(dir_, O_RDONLY | O_DIRECTORY);
  if (!synced.ok()) return synced;
  std::vector<std::string> all = List();
  for (size_t i = 0; i + keep_ < all.size(); ++i) ::unlink(all[i].c_str());
  return absl::OkStatus();
}

absl::StatusOr<wire::ServerCheckpoint> CheckpointStore::ReadFile(
    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return OsError("cannot open", path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  auto bad = [&path](const std::string& why) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", why));
  };
  if (data.size() < kHeaderBytes + 4) return bad("shorter than its header");
  if (std::memcmp(data.data(), kMagic, 4) != 0)
    return bad("not a checkpoint (bad magic)");
  if (GetLe(data, 4, 4) != kVersion) {
    return bad(
        absl::StrCat("version ", GetLe(data, 4, 4), ", expected ", kVersion));
  }
  const uint64_t length = GetLe(data, 8, 8);
  if (length != data.size() - kHeaderBytes - 4) {
    return bad(absl::StrCat("payload of ", length, " bytes but the file holds ",
                            data.size() - kHeaderBytes - 4));
  }
  const uint32_t crc = static_cast<uint32_t>(::crc32(
      0, reinterpret_cast<const Bytef*>(data.data() + kHeaderBytes), length));
  if (crc != GetLe(data, kHeaderBytes + length, 4)) return bad("CRC mismatch");
  wire::ServerCheckpoint shard;
  if (!shard.ParseFromArray(data.data() + kHeaderBytes,
                            static_cast<int>(length))) {
    return bad("payload does not parse");
  }
  for (const wire::CheckpointKey& k : shard.keys()) {
    const uint64_t values =
        k.length() * (k.row_length() == 0 ? 1 : k.row_length());
    if (k.weights().size() != values * sizeof(float)) {
      return bad(absl::StrCat("key ", k.key(), " has ", k.weights().size(),
                              " bytes of weights for ", values, " values"));
    }
    for (const std::string& slot : k.optimizer_state()) {
      if (slot.size() != values * sizeof(float)) {
        return bad(
            absl::StrCat("key ", k.key(), " has a malformed optimizer state"));
      }
    }
  }
  return shard;
}

absl::StatusOr<std::optional<wire::ServerCheckpoint>>
CheckpointStore::LoadLatest() const {
  std::vector<std::string> files = List();
  for (auto it = files.rbegin(); it != files.rend(); ++it) {
    absl::StatusOr<wire::ServerCheckpoint> shard = ReadFile(*it);
    if (shard.ok())
      return std::optional<wire::ServerCheckpoint>(*std::move(shard));
    TESSERA_LOG(WARNING) << "skipping unreadable checkpoint: "
                         << shard.status().message();
  }
  return std::optional<wire::ServerCheckpoint>();
}

}  // namespace tessera

namespace tessera {

absl::StatusOr<CheckpointPolicy> CheckpointPolicy::Parse(
    const std::string& text) {
  CheckpointPolicy policy;
  const auto bad = [&text] {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoint-every='", text,
                     "': expected a number of updates (e.g. 100) or of "
                     "seconds (e.g. 30s), greater than 0"));
  };
  if (!text.empty() && text.back() == 's') {
    double seconds = 0;
    if (!absl::SimpleAtod(text.substr(0, text.size() - 1), &seconds) ||
        !(seconds > 0) || seconds > 1e7) {
      return bad();
    }
    policy.every = absl::Seconds(seconds);
    return policy;
  }
  if (!absl::SimpleAtoi(text, &policy.every_updates) ||
      policy.every_updates == 0) {
    return bad();
  }
  return policy;
}

Checkpointer::Checkpointer(CheckpointStore* store, CheckpointPolicy policy,
                           KVServer* server, absl::Duration write_delay)
    : store_(store),
      policy_(policy),
      server_(server),
      write_delay_(write_delay),
      last_updates_(server->updates_applied()),
      last_time_(absl::Now()),
      total_duration_(MetricsRegistry::Global().GetHistogram(
          "tessera_server_checkpoint_duration_seconds",
          "A checkpoint from the snapshot being asked for to its file "
          "written (snapshot, write, fsync, rename).",
          DurationBuckets())),
      write_duration_(MetricsRegistry::Global().GetHistogram(
          "tessera_server_checkpoint_write_duration_seconds",
          "Writing one checkpoint file (write, fsync, rename, old ones "
          "removed).",
          DurationBuckets())),
      failures_(MetricsRegistry::Global().GetCounter(
          "tessera_server_checkpoint_failures_total",
          "Checkpoints that could not be written.")) {
  writer_ = std::thread([this] {
    trace::SetThreadName("checkpoint writer");
    WriterLoop();
  });
  metric_handles_.push_back(MetricsRegistry::Global().AddCollector(
      "tessera_server_checkpoint_in_progress",
      "1 while a checkpoint is being taken or written.", MetricType::kGauge,
      [this](MetricSamples* out) {
        out->push_back({{}, busy() ? 1.0 : 0.0});
      }));
}

Checkpointer::~Checkpointer() {
  metric_handles_.clear();
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  writer_.join();
}

bool Checkpointer::busy() const {
  absl::MutexLock lock(&mu_);
  return in_progress_;
}

namespace {

std::string Megabytes(size_t bytes) {
  return absl::StrFormat("%.1f MB", static_cast<double>(bytes) / 1e6);
}

}  // namespace

void Checkpointer::ReportSlowWrite() {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  if (now - writing_since_ < kSlowWrite ||
      now - writing_reported_ < kProgressInterval) {
    return;
  }
  writing_reported_ = now;
  TESSERA_LOG(INFO) << "writing checkpoint (" << Megabytes(writing_bytes_)
                    << ", " << writing_keys_ << " key(s)): "
                    << absl::FormatDuration(
                           absl::Trunc(now - writing_since_, absl::Seconds(1)))
                    << " so far";
}

void Checkpointer::MaybeWrite() {
  ReportSlowWrite();
  Collect();
  const uint64_t updates = server_->updates_applied();
  if (updates == last_updates_) return;  // nothing new to save
  const bool due = (policy_.every_updates > 0 &&
                    updates - last_updates_ >= policy_.every_updates) ||
                   (policy_.every > absl::ZeroDuration() &&
                    absl::Now() - last_time_ >= policy_.every);
  if (!due) return;
  {
    absl::MutexLock lock(&mu_);
    if (in_progress_) return;  // the next one starts after this one
    in_progress_ = true;
  }
  last_time_ = absl::Now();
  last_updates_ = updates;
  Start();
}

void Checkpointer::Start() {
  server_->Snapshot([this, asked = absl::Now()](wire::ServerCheckpoint shard) {
    absl::MutexLock lock(&mu_);
    to_write_ = std::move(shard);
    to_write_asked_ = asked;
  });
}

void Checkpointer::Collect() {
  std::optional<absl::StatusOr<std::shared_ptr<const wire::ServerCheckpoint>>>
      written;
  {
    absl::MutexLock lock(&mu_);
    written.swap(written_);
    if (written.has_value()) in_progress_ = false;
  }
  if (!written.has_value()) return;
  if (!written->ok()) {
    failures_->Increment();
    TESSERA_LOG(ERROR) << "checkpoint not written: "
                       << written->status().message();
    return;
  }
  const wire::ServerCheckpoint& shard = ***written;
  server_->MarkDurable(**written);
  TESSERA_VLOG(1) << "checkpoint " << shard.sequence() << ": "
                  << shard.keys_size() << " key(s), " << shard.rounds_applied()
                  << " update(s)";
}

void Checkpointer::WriterLoop() {
  while (true) {
    wire::ServerCheckpoint shard;
    absl::Time asked;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || to_write_.has_value();
      };
      mu_.Await(absl::Condition(&ready));
      // Stopped: the job is over, a snapshot not yet written is dropped.
      if (stop_) return;
      shard = *std::move(to_write_);
      to_write_.reset();
      asked = to_write_asked_;
      // From here on the write is in progress (a test's write_delay too: it
      // stands for a slow disk).
      writing_since_ = absl::Now();
      writing_bytes_ = shard.ByteSizeLong();
      writing_keys_ = shard.keys_size();
      writing_reported_ = absl::InfinitePast();
      if (write_delay_ > absl::ZeroDuration()) {
        auto stopped = [this]()
                           ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; };
        if (mu_.AwaitWithTimeout(absl::Condition(&stopped), write_delay_))
          return;
      }
    }
    const absl::Time start = absl::Now();
    absl::Status status = store_->Write(shard);
    const absl::Time end = absl::Now();
    write_duration_->ObserveDuration(end - start);
    total_duration_->ObserveDuration(end - asked);
    trace::Complete("server", "checkpoint write", absl::ToUnixNanos(start),
                    absl::ToUnixNanos(end),
                    {{"sequence", static_cast<int64_t>(shard.sequence())},
                     {"keys", shard.keys_size()}});
    absl::MutexLock lock(&mu_);
    const absl::Duration took = end - writing_since_;
    if (took >= kSlowWrite) {
      TESSERA_LOG(INFO) << (status.ok()
                                ? absl::StrCat("checkpoint ", shard.sequence(),
                                               " written in ")
                                : std::string("checkpoint failed after "))
                        << absl::FormatDuration(
                               absl::Trunc(took, absl::Milliseconds(100)))
                        << " (" << Megabytes(writing_bytes_) << ", "
                        << writing_keys_ << " key(s))";
    } else {
      TESSERA_VLOG(1) << "checkpoint write took "
                      << absl::FormatDuration(end - start);
    }
    writing_since_ = absl::InfiniteFuture();
    if (status.ok()) {
      written_ =
          std::make_shared<const wire::ServerCheckpoint>(std::move(shard));
    } else {
      written_ = status;
    }
  }
}

absl::Status Checkpointer::WriteNow() {
  {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !in_progress_ || written_.has_value();
    };
    mu_.Await(absl::Condition(&idle));
  }
  Collect();
  {
    absl::MutexLock lock(&mu_);
    in_progress_ = true;
  }
  last_time_ = absl::Now();
  last_updates_ = server_->updates_applied();
  Start();
  absl::Status result;
  {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return written_.has_value();
    };
    mu_.Await(absl::Condition(&done));
    result = written_->status();
  }
  Collect();
  return result;
}

}  // namespace tessera
