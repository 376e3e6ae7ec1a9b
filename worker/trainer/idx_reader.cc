#include "worker/trainer/idx_reader.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tessera {
namespace {

constexpr uint8_t kUnsignedByteType = 0x08;
// Guards the allocation against a corrupt header; Fashion-MNIST's largest file
// holds 47 MB.
constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 31;

// Closes a gzFile on scope exit.
class GzReader {
 public:
  GzReader(gzFile f, std::string path) : f_(f), path_(std::move(path)) {}
  ~GzReader() {
    if (f_ != nullptr) gzclose(f_);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to `len` bytes; returns the count read, or -1 with `error` set.
  int64_t Read(uint8_t* buf, uint64_t len, std::string* error) {
    uint64_t done = 0;
    while (done < len) {
      const unsigned chunk =
          static_cast<unsigned>(std::min<uint64_t>(len - done, 1u << 30));
      const int n = gzread(f_, buf + done, chunk);
      if (n < 0) {
        int errnum = 0;
        const char* msg = gzerror(f_, &errnum);
        *error = msg != nullptr ? msg : "gzip read error";
        // zlib puts the path in front of its message; the caller adds it
        // anyway.
        if (absl::StartsWith(*error, path_ + ": "))
          error->erase(0, path_.size() + 2);
        return -1;
      }
      if (n == 0) break;
      done += static_cast<uint64_t>(n);
    }
    return static_cast<int64_t>(done);
  }

 private:
  gzFile f_;
  const std::string path_;
};

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
         (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

absl::StatusOr<IdxArray> ReadIdxFile(const std::string& path,
                                     int expected_rank) {
  if (expected_rank < 1 || expected_rank > 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ReadIdxFile: expected_rank must be 1..4, got ", expected_rank));
  }
  errno = 0;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    return absl::NotFoundError(absl::StrCat(
        path,
        ": cannot open: ", err != 0 ? std::strerror(err) : "out of memory"));
  }
  GzReader reader(f, path);
  std::string error;

  const uint32_t expected_magic =
      (uint32_t{kUnsignedByteType} << 8) | static_cast<uint32_t>(expected_rank);
  const int header_bytes = 4 + 4 * expected_rank;
  uint8_t header[4 + 4 * 4];
  const int64_t got_header = reader.Read(header, header_bytes, &error);
  if (got_header < 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": corrupt gzip stream: ", error));
  }
  // The magic comes first so that a wrong file says so rather than "truncated".
  if (got_header >= 4 && BigEndian32(header) != expected_magic) {
    return absl::DataLossError(
        absl::StrFormat("%s: bad magic 0x%08x, expected 0x%08x (IDX file of "
                        "unsigned bytes with %d "
                        "dimension%s)",
                        path, BigEndian32(header), expected_magic,
                        expected_rank, expected_rank == 1 ? "" : "s"));
  }
  if (got_header < header_bytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": truncated header: expected ", header_bytes,
                     " bytes, got ", got_header));
  }

  IdxArray out;
  uint64_t payload = 1;
  for (int d = 0; d < expected_rank; ++d) {
    out.dims.push_back(BigEndian32(header + 4 + 4 * d));
    payload *= out.dims.back();
    if (payload > kMaxPayloadBytes) {
      return absl::DataLossError(absl::StrCat(
          path, ": implausible dimensions ", absl::StrJoin(out.dims, "x"),
          " (more than ", kMaxPayloadBytes, " bytes)"));
    }
  }
  out.data.resize(payload);
  const int64_t got = reader.Read(out.data.data(), payload, &error);
  if (got < 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": corrupt gzip stream: ", error));
  }
  if (static_cast<uint64_t>(got) < payload) {
    return absl::DataLossError(absl::StrCat(
        path, ": truncated data: expected ", payload, " bytes for ",
        absl::StrJoin(out.dims, "x"), ", got ", got));
  }
  uint8_t extra[1];
  const int64_t more = reader.Read(extra, 1, &error);
  if (more < 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": corrupt gzip stream: ", error));
  }
  if (more > 0) {
    return absl::DataLossError(absl::StrCat(
        path, ": unexpected bytes after the ", payload, " bytes of data"));
  }
  return out;
}

absl::StatusOr<LabeledImages> LoadLabeledImages(const std::string& images_path,
                                                const std::string& labels_path,
                                                int max_items,
                                                int num_classes) {
  absl::StatusOr<IdxArray> images = ReadIdxFile(images_path, 3);
  if (!images.ok()) return images.status();
  absl::StatusOr<IdxArray> labels = ReadIdxFile(labels_path, 1);
  if (!labels.ok()) return labels.status();
  if (images->dims[0] != labels->dims[0]) {
    return absl::InvalidArgumentError(
        absl::StrCat(images_path, ": holds ", images->dims[0], " images but ",
                     labels_path, " holds ", labels->dims[0], " labels"));
  }
  for (size_t i = 0; i < labels->data.size(); ++i) {
    if (labels->data[i] >= num_classes) {
      return absl::DataLossError(
          absl::StrCat(labels_path, ": label ", labels->data[i], " of item ", i,
                       " is outside 0..", num_classes - 1));
    }
  }
  LabeledImages out;
  out.count = static_cast<int>(images->dims[0]);
  out.rows = static_cast<int>(images->dims[1]);
  out.cols = static_cast<int>(images->dims[2]);
  out.pixels = std::move(images->data);
  out.labels = std::move(labels->data);
  if (max_items > 0 && max_items < out.count) {
    out.count = max_items;
    out.pixels.resize(static_cast<size_t>(max_items) * out.dim());
    out.labels.resize(max_items);
    out.pixels.shrink_to_fit();
    out.labels.shrink_to_fit();
  }
  return out;
}

absl::StatusOr<FashionMnist> LoadFashionMnist(const std::string& dir,
                                              int train_subset,
                                              int test_subset) {
  const std::string base = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  FashionMnist out;
  absl::StatusOr<LabeledImages> train =
      LoadLabeledImages(base + "train-images-idx3-ubyte.gz",
                        base + "train-labels-idx1-ubyte.gz", train_subset);
  if (!train.ok()) return train.status();
  absl::StatusOr<LabeledImages> test =
      LoadLabeledImages(base + "t10k-images-idx3-ubyte.gz",
                        base + "t10k-labels-idx1-ubyte.gz", test_subset);
  if (!test.ok()) return test.status();
  if (train->dim() != test->dim()) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, ": training images are ", train->rows, "x", train->cols,
        " but test images are ", test->rows, "x", test->cols));
  }
  out.train = *std::move(train);
  out.test = *std::move(test);
  return out;
}

}  // namespace tessera
