// The trace recorder (common/trace.h): events, their JSON, the event cap.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/trace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::trace {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos;
       at = text.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ResetForTesting();
    dir_ = ::testing::TempDir();
    pattern_ = absl::StrCat(dir_, "/trace-test-{role}-{rank}.json");
  }
  void TearDown() override {
    ResetForTesting();
    unsetenv("TESSERA_TRACE_MAX_EVENTS");
  }
  std::string dir_, pattern_;
};

TEST_F(TraceTest, OffRecordsNothing) {
  EXPECT_FALSE(Enabled());
  { Span span("kv", "wait"); }
  AsyncBegin("kv", "push", 1);
  EXPECT_TRUE(Flush().ok());  // nothing to write, no file
  EXPECT_EQ(access(absl::StrCat(dir_, "/trace-test--.json").c_str(), F_OK), -1);
}

TEST_F(TraceTest, EventsAreWrittenAsChromeTraceJson) {
  ASSERT_TRUE(Start(pattern_, "worker").ok());
  SetIdentity("worker", 3);
  SetThreadName("main");
  {
    Span span("train", "step");
    span.Arg("epoch", 2);
  }
  Complete("server", "update", 1000000000123456, 1000000000124456,
           {{"key", 7}, {"values", 100}});
  const uint64_t id = NewId();
  AsyncBegin("kv", "push", id, {{"key", 3}, {"bytes", 4096}});
  std::thread other([id] {
    SetThreadName("receiver");
    AsyncEnd("kv", "push", id, {{"ok", 1}});
  });
  other.join();
  ASSERT_TRUE(Flush().ok());
  const std::string text =
      ReadFile(absl::StrCat(dir_, "/trace-test-worker-3.json"));
  EXPECT_TRUE(absl::StartsWith(text, "{\"traceEvents\":[\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(
                        "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":",
                        getpid(), ",\"tid\":0,\"args\":{\"name\":\"worker 3\"}}")));
  EXPECT_THAT(text, HasSubstr("\"args\":{\"name\":\"main\"}"));
  EXPECT_THAT(text, HasSubstr("\"args\":{\"name\":\"receiver\"}"));
  EXPECT_THAT(text, HasSubstr("{\"name\":\"update\",\"cat\":\"server\",\"ph\":"
                              "\"X\",\"ts\":1000000000123.456,"));
  EXPECT_THAT(text, HasSubstr(",\"dur\":1.000,\"args\":{\"key\":7,"
                              "\"values\":100}}"));
  EXPECT_THAT(text, HasSubstr("\"name\":\"step\",\"cat\":\"train\",\"ph\":\"X\""));
  EXPECT_THAT(text, HasSubstr("\"args\":{\"epoch\":2}"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("\"ph\":\"b\"")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("\"id\":\"0x", absl::Hex(id),
                                           "\",\"args\":{\"key\":3,\"bytes\":4096}")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("\"id\":\"0x", absl::Hex(id),
                                           "\",\"args\":{\"ok\":1}")));
  EXPECT_THAT(text, HasSubstr("\"otherData\":{\"role\":\"worker\",\"rank\":3,"
                              "\"events\":4,\"dropped_events\":0}}"));
}

TEST_F(TraceTest, EventsPastTheCapAreCountedNotKept) {
  setenv("TESSERA_TRACE_MAX_EVENTS", "10", 1);
  ASSERT_TRUE(Start(pattern_, "server").ok());
  SetIdentity("server", 0);
  for (int i = 0; i < 25; ++i) Complete("server", "update", 1000, 2000);
  ASSERT_TRUE(Flush().ok());
  const std::string text =
      ReadFile(absl::StrCat(dir_, "/trace-test-server-0.json"));
  EXPECT_EQ(Count(text, "\"name\":\"update\""), 10);
  EXPECT_THAT(text, HasSubstr("\"events\":10,\"dropped_events\":15}"));
}

TEST_F(TraceTest, UnwritablePathIsRefusedAtStart) {
  absl::Status s = Start("/nonexistent-dir/{rank}.json", "worker");
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(),
              HasSubstr("TESSERA_TRACE='/nonexistent-dir/{rank}.json': expected "
                        "a writable file path"));
  EXPECT_FALSE(Enabled());
}

TEST_F(TraceTest, ManyThreadsRecordConcurrently) {
  ASSERT_TRUE(Start(pattern_, "worker").ok());
  SetIdentity("worker", 1);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 1000; ++i) {
        const uint64_t id = NewId();
        AsyncBegin("kv", "pull", id);
        AsyncEnd("kv", "pull", id);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(Flush().ok());
  const std::string text =
      ReadFile(absl::StrCat(dir_, "/trace-test-worker-1.json"));
  EXPECT_EQ(Count(text, "\"ph\":\"b\""), 4000);
  EXPECT_EQ(Count(text, "\"ph\":\"e\""), 4000);
  EXPECT_THAT(text, Not(HasSubstr("dropped_events\":1")));
}

}  // namespace
}  // namespace tessera::trace
