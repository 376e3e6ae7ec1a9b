// Tests of the IDX reader on the real Fashion-MNIST files (skipped when absent)
// and on broken files written here.
#include "worker/trainer/idx_reader.h"

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string DataDir() {
  const char* env = std::getenv("FASHION_MNIST_DIR");
  return env != nullptr && *env != 0 ? env
                                     : "/usr/share/datasets/fashion-mnist";
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

class IdxReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "/idx_reader_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const std::string& f : files_) unlink(f.c_str());
    rmdir(dir_.c_str());
  }

  std::string Path(const std::string& name) {
    files_.push_back(dir_ + "/" + name);
    return files_.back();
  }

  static std::vector<uint8_t> Header(uint32_t magic,
                                     std::vector<uint32_t> dims) {
    std::vector<uint8_t> out;
    auto put = [&](uint32_t v) {
      for (int s = 24; s >= 0; s -= 8)
        out.push_back(static_cast<uint8_t>(v >> s));
    };
    put(magic);
    for (uint32_t d : dims) put(d);
    return out;
  }

  std::string WriteGz(const std::string& name,
                      const std::vector<uint8_t>& bytes) {
    const std::string path = Path(name);
    gzFile f = gzopen(path.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    EXPECT_EQ(gzwrite(f, bytes.data(), bytes.size()),
              static_cast<int>(bytes.size()));
    gzclose(f);
    return path;
  }

  std::string WriteRaw(const std::string& name,
                       const std::vector<uint8_t>& bytes) {
    const std::string path = Path(name);
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return path;
  }

  // 3 images of 2x2 and their 3 labels.
  static std::vector<uint8_t> Images(uint32_t count = 3) {
    std::vector<uint8_t> b = Header(0x803, {count, 2, 2});
    for (uint32_t i = 0; i < count * 4; ++i)
      b.push_back(static_cast<uint8_t>(i * 10));
    return b;
  }
  static std::vector<uint8_t> Labels(std::vector<uint8_t> labels) {
    std::vector<uint8_t> b =
        Header(0x801, {static_cast<uint32_t>(labels.size())});
    b.insert(b.end(), labels.begin(), labels.end());
    return b;
  }

  std::string dir_;
  std::vector<std::string> files_;
};

TEST_F(IdxReaderTest, ReadsTheRealFashionMnistFiles) {
  const std::string dir = DataDir();
  if (!Exists(dir + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not found in " << dir;
  }
  absl::StatusOr<FashionMnist> data = LoadFashionMnist(dir);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->train.count, 60000);
  EXPECT_EQ(data->train.rows, 28);
  EXPECT_EQ(data->train.cols, 28);
  EXPECT_EQ(data->train.pixels.size(), 60000u * 784);
  EXPECT_EQ(data->test.count, 10000);
  EXPECT_EQ(data->test.pixels.size(), 10000u * 784);
  // Fashion-MNIST is balanced: 6,000 training and 1,000 test images per class.
  std::vector<int> train_counts(10), test_counts(10);
  for (uint8_t l : data->train.labels) {
    ASSERT_LT(l, 10);
    ++train_counts[l];
  }
  for (uint8_t l : data->test.labels) {
    ASSERT_LT(l, 10);
    ++test_counts[l];
  }
  EXPECT_EQ(train_counts, std::vector<int>(10, 6000));
  EXPECT_EQ(test_counts, std::vector<int>(10, 1000));
  int max_pixel = 0;
  for (size_t i = 0; i < 784 * 100; ++i)
    max_pixel = std::max<int>(max_pixel, data->train.pixels[i]);
  EXPECT_GT(max_pixel, 200);

  absl::StatusOr<FashionMnist> subset = LoadFashionMnist(dir, 2000, 500);
  ASSERT_TRUE(subset.ok()) << subset.status();
  EXPECT_EQ(subset->train.count, 2000);
  EXPECT_EQ(subset->train.labels.size(), 2000u);
  EXPECT_EQ(subset->train.pixels.size(), 2000u * 784);
  EXPECT_EQ(subset->test.count, 500);
  EXPECT_TRUE(std::equal(subset->train.labels.begin(),
                         subset->train.labels.end(),
                         data->train.labels.begin()));
}

TEST_F(IdxReaderTest, ReadsSmallGzipAndPlainFiles) {
  const std::string images = WriteGz("images.gz", Images());
  const std::string labels = WriteRaw("labels", Labels({7, 0, 9}));
  absl::StatusOr<LabeledImages> data = LoadLabeledImages(images, labels);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->count, 3);
  EXPECT_EQ(data->dim(), 4);
  EXPECT_EQ(data->labels, (std::vector<uint8_t>{7, 0, 9}));
  EXPECT_EQ(data->image(2)[1], 90);
}

TEST_F(IdxReaderTest, MissingFileIsNotFound) {
  const std::string path = dir_ + "/nope.gz";
  absl::StatusOr<IdxArray> a = ReadIdxFile(path, 3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a.status().message(),
            path + ": cannot open: No such file or directory");

  absl::StatusOr<FashionMnist> f = LoadFashionMnist(dir_);
  EXPECT_EQ(f.status().message(), dir_ +
                                      "/train-images-idx3-ubyte.gz: cannot "
                                      "open: No such file or directory");
}

TEST_F(IdxReaderTest, WrongMagicIsDataLoss) {
  // A labels file where an images file belongs.
  const std::string path = WriteGz("labels-as-images.gz", Labels({1, 2, 3}));
  absl::StatusOr<IdxArray> a = ReadIdxFile(path, 3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(
      a.status().message(),
      path +
          ": bad magic 0x00000801, expected 0x00000803 (IDX file of unsigned "
          "bytes with 3 dimensions)");

  const std::string text = WriteRaw("text", {'h', 'e', 'l', 'l', 'o', '\n'});
  EXPECT_EQ(
      ReadIdxFile(text, 1).status().message(),
      text +
          ": bad magic 0x68656c6c, expected 0x00000801 (IDX file of unsigned "
          "bytes with 1 dimension)");
}

TEST_F(IdxReaderTest, TruncatedHeaderIsDataLoss) {
  std::vector<uint8_t> bytes = Images();
  bytes.resize(7);
  const std::string path = WriteGz("short-header.gz", bytes);
  absl::StatusOr<IdxArray> a = ReadIdxFile(path, 3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(a.status().message(),
            path + ": truncated header: expected 16 bytes, got 7");
}

TEST_F(IdxReaderTest, TruncatedDataIsDataLoss) {
  std::vector<uint8_t> bytes = Images();
  bytes.resize(16 + 5);
  const std::string path = WriteGz("short-data.gz", bytes);
  absl::StatusOr<IdxArray> a = ReadIdxFile(path, 3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(a.status().message(),
            path + ": truncated data: expected 12 bytes for 3x2x2, got 5");
}

TEST_F(IdxReaderTest, TrailingBytesAreDataLoss) {
  std::vector<uint8_t> bytes = Images();
  bytes.push_back(1);
  const std::string path = WriteGz("long.gz", bytes);
  EXPECT_EQ(ReadIdxFile(path, 3).status().message(),
            path + ": unexpected bytes after the 12 bytes of data");
}

TEST_F(IdxReaderTest, CutGzipStreamIsDataLoss) {
  // A big payload so that the compressed stream is long enough to cut in half.
  std::vector<uint8_t> bytes = Header(0x803, {100, 28, 28});
  uint32_t state = 1;
  for (int i = 0; i < 100 * 784; ++i) {
    state = state * 1664525u + 1013904223u;
    bytes.push_back(static_cast<uint8_t>(state >> 24));
  }
  const std::string full = WriteGz("full.gz", bytes);
  std::ifstream in(full, std::ios::binary);
  std::vector<uint8_t> gz((std::istreambuf_iterator<char>(in)),
                          std::istreambuf_iterator<char>());
  ASSERT_GT(gz.size(), 1000u);
  gz.resize(gz.size() / 2);
  const std::string cut = WriteRaw("cut.gz", gz);
  absl::StatusOr<IdxArray> a = ReadIdxFile(cut, 3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(
      std::string(a.status().message()),
      StartsWith(cut +
                 ": truncated data: expected 78400 bytes for 100x28x28, got "));
}

TEST_F(IdxReaderTest, CorruptGzipStreamIsDataLoss) {
  std::vector<uint8_t> bytes = Images();
  const std::string good = WriteGz("good.gz", bytes);
  std::ifstream in(good, std::ios::binary);
  std::vector<uint8_t> gz((std::istreambuf_iterator<char>(in)),
                          std::istreambuf_iterator<char>());
  // The CRC-32 of the payload sits 8 bytes from the end.
  gz[gz.size() - 8] ^= 0xff;
  const std::string bad = WriteRaw("bad-crc.gz", gz);
  absl::StatusOr<IdxArray> a = ReadIdxFile(bad, 3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(std::string(a.status().message()),
            bad + ": corrupt gzip stream: incorrect data check");
}

TEST_F(IdxReaderTest, CountMismatchIsInvalidArgument) {
  const std::string images = WriteGz("images.gz", Images(3));
  const std::string labels = WriteGz("labels.gz", Labels({1, 2}));
  absl::StatusOr<LabeledImages> data = LoadLabeledImages(images, labels);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(data.status().message(),
            images + ": holds 3 images but " + labels + " holds 2 labels");
}

TEST_F(IdxReaderTest, LabelOutOfRangeIsDataLoss) {
  const std::string images = WriteGz("images.gz", Images(3));
  const std::string labels = WriteGz("labels.gz", Labels({1, 10, 2}));
  absl::StatusOr<LabeledImages> data = LoadLabeledImages(images, labels);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(data.status().message(),
            labels + ": label 10 of item 1 is outside 0..9");
}

TEST_F(IdxReaderTest, ImplausibleDimensionsAreDataLoss) {
  const std::string path =
      WriteGz("huge.gz", Header(0x803, {1u << 20, 1u << 10, 1u << 10}));
  EXPECT_THAT(std::string(ReadIdxFile(path, 3).status().message()),
              HasSubstr(": implausible dimensions 1048576x1024"));
}

}  // namespace
}  // namespace tessera
