#include "server/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera-ckpt-XXXXXX";
    root_ = mkdtemp(tmpl);
    dir_ = root_ + "/ckpt";
  }
  void TearDown() override {
    const std::string cmd = "rm -rf " + root_;
    ASSERT_EQ(std::system(cmd.c_str()), 0);
  }

  static wire::ServerCheckpoint Shard(float base, uint64_t rounds) {
    wire::ServerCheckpoint s;
    s.set_rounds_applied(rounds);
    s.set_optimizer_spec("sgd lr=0.1 momentum=0.9");
    s.set_compression_type("2bit");
    s.set_compression_threshold(0.5f);
    wire::CheckpointKey* k = s.add_keys();
    k->set_key(7);
    k->set_offset(10);
    k->set_length(3);
    k->set_total_length(20);
    k->set_sync_mode(true);
    const float w[3] = {base, base + 1, base + 2};
    k->set_weights(std::string(reinterpret_cast<const char*>(w), sizeof(w)));
    const float m[3] = {0.5f, -0.5f, 0.25f};
    k->add_optimizer_state(
        std::string(reinterpret_cast<const char*>(m), sizeof(m)));
    k->set_steps(rounds);
    return s;
  }

  std::string root_, dir_;
};

TEST_F(CheckpointTest, WriteThenLoadLatestRoundTripsExactly) {
  CheckpointStore store(dir_, 1, 3);
  absl::StatusOr<std::optional<wire::ServerCheckpoint>> none =
      store.LoadLatest();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  wire::ServerCheckpoint a = Shard(1, 5), b = Shard(2, 6);
  ASSERT_TRUE(store.Write(a).ok());
  ASSERT_TRUE(store.Write(b).ok());
  EXPECT_EQ(a.sequence(), 1u);
  EXPECT_EQ(b.sequence(), 2u);
  absl::StatusOr<std::optional<wire::ServerCheckpoint>> got =
      store.LoadLatest();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->SerializeAsString(), b.SerializeAsString());
  EXPECT_EQ((*got)->server_rank(), 1);
  const float* w =
      reinterpret_cast<const float*>((*got)->keys(0).weights().data());
  EXPECT_EQ(w[2], 4.0f);
}

TEST_F(CheckpointTest, KeepsOnlyTheNewestKAndNoTemporaryFiles) {
  CheckpointStore store(dir_, 0, 2);
  for (int i = 0; i < 5; ++i) {
    wire::ServerCheckpoint s = Shard(static_cast<float>(i), i);
    ASSERT_TRUE(store.Write(s).ok());
  }
  std::vector<std::string> files = store.List();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_THAT(files[0], HasSubstr("server-0-00000000000000000004.ckpt"));
  EXPECT_THAT(files[1], HasSubstr("server-0-00000000000000000005.ckpt"));
  EXPECT_NE(access((files[1] + ".tmp").c_str(), F_OK), 0);
  // Another server's files in the same folder are its own.
  CheckpointStore other(dir_, 1, 2);
  EXPECT_TRUE(other.List().empty());
}

TEST_F(CheckpointTest, CorruptNewestFallsBackToTheOneBefore) {
  CheckpointStore store(dir_, 2, 3);
  wire::ServerCheckpoint a = Shard(1, 1), b = Shard(9, 2);
  ASSERT_TRUE(store.Write(a).ok());
  ASSERT_TRUE(store.Write(b).ok());
  const std::string newest = store.List().back();
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(20);
    f.put('\x5a');  // flips payload bytes: the CRC no longer matches
  }
  absl::StatusOr<wire::ServerCheckpoint> direct =
      CheckpointStore::ReadFile(newest);
  EXPECT_EQ(direct.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(direct.status().message(), HasSubstr("CRC mismatch"));
  absl::StatusOr<std::optional<wire::ServerCheckpoint>> got =
      store.LoadLatest();
  ASSERT_TRUE(got.ok());
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->sequence(), 1u);
}

TEST_F(CheckpointTest, MalformedFilesAreDataLossNamingTheProblem) {
  ASSERT_EQ(mkdir(dir_.c_str(), 0755), 0);
  auto write = [this](const std::string& name, const std::string& bytes) {
    std::ofstream(dir_ + "/" + name, std::ios::binary) << bytes;
    return dir_ + "/" + name;
  };
  EXPECT_THAT(CheckpointStore::ReadFile(write("a", "TSC")).status().message(),
              HasSubstr("shorter than its header"));
  EXPECT_THAT(
      CheckpointStore::ReadFile(
          write("b", std::string("XXXX\1\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 20)))
          .status()
          .message(),
      HasSubstr("bad magic"));
  EXPECT_THAT(
      CheckpointStore::ReadFile(
          write("c", std::string("TSCK\2\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 20)))
          .status()
          .message(),
      HasSubstr("version 2, expected 1"));
  EXPECT_THAT(
      CheckpointStore::ReadFile(
          write("d", std::string("TSCK\1\0\0\0\x09\0\0\0\0\0\0\0\0\0\0\0", 20)))
          .status()
          .message(),
      HasSubstr("payload of 9 bytes but the file holds 0"));
  EXPECT_EQ(CheckpointStore::ReadFile(dir_ + "/missing").status().code(),
            absl::StatusCode::kUnavailable);
}

// A server's weights are readable by its user only, whatever the umask: the
// folder it creates is 0700 and each file 0600, also when an earlier life
// left a world-readable temporary file behind.
TEST_F(CheckpointTest, FilesAndTheFolderTheServerMakesAreItsUsersOnly) {
  const mode_t old_umask = umask(0);
  CheckpointStore store(dir_, 0, 3);
  wire::ServerCheckpoint first = Shard(1, 1);
  ASSERT_TRUE(store.Write(first).ok());
  const std::string leftover = dir_ + "/server-0-00000000000000000002.ckpt.tmp";
  {
    std::ofstream out(leftover);
    out << "an earlier life's";
  }
  ASSERT_EQ(chmod(leftover.c_str(), 0644), 0);
  wire::ServerCheckpoint second = Shard(2, 2);
  ASSERT_TRUE(store.Write(second).ok());
  umask(old_umask);
  struct stat st;
  ASSERT_EQ(stat(dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  std::vector<std::string> files = store.List();
  ASSERT_EQ(files.size(), 2u);
  for (const std::string& f : files) {
    ASSERT_EQ(stat(f.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0600u) << f;
  }
}

TEST_F(CheckpointTest, UnwritableFolderIsAnErrorNotACrash) {
  CheckpointStore store("/proc/tessera-cannot-be-here", 0, 1);
  wire::ServerCheckpoint s = Shard(1, 1);
  absl::Status st = store.Write(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(st.message(), HasSubstr("cannot create checkpoint folder"));
}

}  // namespace
}  // namespace tessera
