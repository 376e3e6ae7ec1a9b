// The metrics registry, its text exposition, and the HTTP endpoint.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/options.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST(MetricsRegistryTest, ExpositionOfCountersGaugesAndHistograms) {
  MetricsRegistry r;
  r.GetCounter("b_total", "Bs.", {{"command", "KV_PUSH"}})->Increment(3);
  r.GetCounter("b_total", "Bs.", {{"command", "KV_PULL"}})->Increment();
  r.GetGauge("a_depth", "Depth\nof a \\ queue.")->Set(2.5);
  Histogram* h = r.GetHistogram("c_seconds", "Cs.", {0.1, 1});
  h->Observe(0.05);
  h->Observe(0.1);  // le: the bound itself is in the bucket
  h->Observe(0.5);
  h->Observe(7);
  EXPECT_EQ(r.TextExposition(),
            "# HELP a_depth Depth\\nof a \\\\ queue.\n"
            "# TYPE a_depth gauge\n"
            "a_depth 2.5\n"
            "# HELP b_total Bs.\n"
            "# TYPE b_total counter\n"
            "b_total{command=\"KV_PULL\"} 1\n"
            "b_total{command=\"KV_PUSH\"} 3\n"
            "# HELP c_seconds Cs.\n"
            "# TYPE c_seconds histogram\n"
            "c_seconds_bucket{le=\"0.1\"} 2\n"
            "c_seconds_bucket{le=\"1\"} 3\n"
            "c_seconds_bucket{le=\"+Inf\"} 4\n"
            "c_seconds_sum 7.65\n"
            "c_seconds_count 4\n");
}

TEST(MetricsRegistryTest, SameSeriesIsTheSameCounter) {
  MetricsRegistry r;
  Counter* a = r.GetCounter("x_total", "X.", {{"k", "1"}});
  Counter* b = r.GetCounter("x_total", "X.", {{"k", "1"}});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, r.GetCounter("x_total", "X.", {{"k", "2"}}));
}

TEST(MetricsRegistryTest, LabelValuesAreEscaped) {
  MetricsRegistry r;
  r.GetCounter("x_total", "X.", {{"path", "a\"b\\c\nd"}})->Increment();
  EXPECT_THAT(r.TextExposition(),
              HasSubstr("x_total{path=\"a\\\"b\\\\c\\nd\"} 1\n"));
}

TEST(MetricsRegistryTest, CollectorsAreAddedToSeriesAndRemovedByTheirHandle) {
  MetricsRegistry r;
  r.GetCounter("y_total", "Y.")->Increment(2);
  {
    CollectorHandle one = r.AddCollector(
        "y_total", "Y.", MetricType::kCounter,
        [](MetricSamples* out) { out->push_back({{}, 10}); });
    CollectorHandle two = r.AddCollector(
        "y_total", "Y.", MetricType::kCounter, [](MetricSamples* out) {
          out->push_back({{}, 5});
          out->push_back({{{"other", "yes"}}, 1});
        });
    const std::string text = r.TextExposition();
    EXPECT_THAT(text, HasSubstr("\ny_total 17\n"));
    EXPECT_THAT(text, HasSubstr("\ny_total{other=\"yes\"} 1\n"));
  }
  EXPECT_THAT(r.TextExposition(), HasSubstr("\ny_total 2\n"));
  EXPECT_THAT(r.TextExposition(), Not(HasSubstr("other")));
}

TEST(MetricsRegistryTest, FamilyWithoutSamplesIsLeftOut) {
  MetricsRegistry r;
  { CollectorHandle gone = r.AddCollector("z", "Z.", MetricType::kGauge,
                                          [](MetricSamples*) {}); }
  EXPECT_EQ(r.TextExposition(), "");
}

TEST(MetricsRegistryTest, TooManyLabelSetsShareOneOtherSeries) {
  MetricsRegistry r;
  for (size_t i = 0; i < MetricsRegistry::kMaxSeriesPerFamily + 10; ++i)
    r.GetCounter("k_total", "K.", {{"key", absl::StrCat(i)}})->Increment();
  const std::string text = r.TextExposition();
  EXPECT_THAT(text, HasSubstr("k_total{key=\"other\"} 10\n"));
  EXPECT_THAT(text, HasSubstr("k_total{key=\"0\"} 1\n"));
  EXPECT_THAT(text, Not(HasSubstr(absl::StrCat(
                        "key=\"", MetricsRegistry::kMaxSeriesPerFamily, "\""))));
}

TEST(MetricsRegistryTest, ConcurrentIncrementsAreAllCounted) {
  MetricsRegistry r;
  Counter* c = r.GetCounter("n_total", "N.");
  Histogram* h = r.GetHistogram("n_seconds", "N.", LatencyBuckets());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100000; ++i) {
        c->Increment();
        h->Observe(0.001);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(c->value(), 400000u);
  EXPECT_EQ(h->snapshot().count, 400000u);
}

TEST(MetricsRegistryTest, ValuesAreWrittenShortestAndExact) {
  EXPECT_EQ(FormatMetricValue(0), "0");
  EXPECT_EQ(FormatMetricValue(12345678901234), "12345678901234");
  EXPECT_EQ(FormatMetricValue(0.00025), "0.00025");
  EXPECT_EQ(FormatMetricValue(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(FormatMetricValue(1.0 / 0.0), "+Inf");
}

TEST(MetricsRegistryTest, GlobalRegistryHasProcessMetrics) {
  const std::string text = MetricsRegistry::Global().TextExposition();
  EXPECT_THAT(text, HasSubstr("# TYPE process_resident_memory_bytes gauge\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE process_start_time_seconds gauge\n"));
}

// A plain HTTP/1.0 GET over a socket, for the endpoint tests.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  close(fd);
  return out;
}

TEST(MetricsHttpServerTest, ServesTheExpositionOnAFreePort) {
  MetricsRegistry r;
  r.GetCounter("served_total", "Served.")->Increment(42);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
      MetricsHttpServer::Start("127.0.0.1", 0, &r);
  ASSERT_TRUE(http.ok()) << http.status();
  const int port = (*http)->port();
  EXPECT_GT(port, 0);
  EXPECT_EQ((*http)->url(), absl::StrCat("http://127.0.0.1:", port, "/metrics"));
  const std::string reply = HttpGet(port, "/metrics");
  EXPECT_THAT(reply, HasSubstr("200 OK"));
  EXPECT_THAT(reply, HasSubstr("text/plain; version=0.0.4"));
  EXPECT_THAT(reply, HasSubstr("\r\n\r\n# HELP served_total Served.\n"
                               "# TYPE served_total counter\n"
                               "served_total 42\n"));
  EXPECT_THAT(HttpGet(port, "/nothing"), HasSubstr("404"));
}

// A port some other socket listens on, even one that allows SO_REUSEPORT
// (httplib's own default would share the port with it).
TEST(MetricsHttpServerTest, PortInUseIsAnErrorNamingTheVariableAndAddress) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  int yes = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &yes, sizeof(yes));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);

  Options options;
  options.metrics_port = port;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
      StartMetricsServer(options, "127.0.0.1");
  ASSERT_FALSE(http.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(http.status()));
  EXPECT_THAT(http.status().message(),
              HasSubstr(absl::StrCat("TESSERA_METRICS_PORT=", port,
                                     ": cannot listen on 127.0.0.1:", port,
                                     ": Address already in use")));
  close(fd);
}

TEST(MetricsHttpServerTest, UnsetPortStartsNothing) {
  Options options;  // metrics_port -1: TESSERA_METRICS_PORT unset
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
      StartMetricsServer(options, "127.0.0.1");
  ASSERT_TRUE(http.ok());
  EXPECT_EQ(*http, nullptr);
}

TEST(MetricsOptionsTest, MetricsPortIsParsedAndChecked) {
  auto parse = [](const char* port) {
    return ParseOptions([port](const std::string& name)
                            -> std::optional<std::string> {
      if (name == "DMLC_ROLE") return "server";
      if (name == "DMLC_PS_ROOT_URI") return "127.0.0.1";
      if (name == "DMLC_PS_ROOT_PORT") return "9000";
      if (name == "DMLC_NUM_SERVER" || name == "DMLC_NUM_WORKER") return "1";
      if (name == "TESSERA_METRICS_PORT" && port != nullptr) return port;
      return std::nullopt;
    });
  };
  EXPECT_EQ(parse(nullptr)->metrics_port, -1);
  EXPECT_EQ(parse("0")->metrics_port, 0);
  EXPECT_EQ(parse("9100")->metrics_port, 9100);
  EXPECT_EQ(parse("70000").status().message(),
            "TESSERA_METRICS_PORT='70000': expected a port number in 0..65535 "
            "(0: any free port)");
}

}  // namespace
}  // namespace tessera
