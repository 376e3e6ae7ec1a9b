#include "tests/support/memory_network.h"

#include <atomic>
#include <deque>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace tessera {

struct MemoryNetwork::State {
  struct Inbox {
    absl::Mutex mu;
    std::deque<std::vector<Buffer>> queue ABSL_GUARDED_BY(mu);
  };
  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<Inbox>> inboxes ABSL_GUARDED_BY(mu);
  int next_port ABSL_GUARDED_BY(mu) = 20000;
};

namespace {

class MemoryTransport : public Transport {
 public:
  explicit MemoryTransport(std::shared_ptr<MemoryNetwork::State> net)
      : net_(std::move(net)) {}
  ~MemoryTransport() override { Close(); }

  absl::StatusOr<int> Bind(const std::string& ip, int port) override {
    absl::MutexLock lock(&net_->mu);
    if (port == 0) port = net_->next_port++;
    const std::string address = absl::StrCat(ip, ":", port);
    if (net_->inboxes.count(address) != 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot bind ", address, ": Address already in use"));
    }
    inbox_ = std::make_shared<MemoryNetwork::State::Inbox>();
    net_->inboxes[address] = inbox_;
    address_ = address;
    return port;
  }

  absl::Status Connect(int peer, const std::string& ip, int port) override {
    absl::MutexLock lock(&mu_);
    peers_[peer] = absl::StrCat(ip, ":", port);
    return absl::OkStatus();
  }

  void Disconnect(int peer) override {
    absl::MutexLock lock(&mu_);
    peers_.erase(peer);
  }

  absl::Status Send(int peer, const Message& msg) override {
    std::string address;
    {
      absl::MutexLock lock(&mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end())
        return absl::UnavailableError(
            absl::StrCat("no connection to node ", peer));
      address = it->second;
    }
    absl::StatusOr<std::vector<Buffer>> parts = EncodeMessage(msg);
    if (!parts.ok()) return parts.status();
    std::shared_ptr<MemoryNetwork::State::Inbox> inbox;
    {
      absl::MutexLock lock(&net_->mu);
      auto it = net_->inboxes.find(address);
      if (it == net_->inboxes.end())
        return absl::OkStatus();  // like TCP before connect: dropped
      inbox = it->second;
    }
    absl::MutexLock lock(&inbox->mu);
    inbox->queue.push_back(*std::move(parts));
    return absl::OkStatus();
  }

  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    if (inbox_ == nullptr)
      return absl::FailedPreconditionError("Receive before Bind");
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      std::vector<Buffer> parts;
      {
        absl::MutexLock lock(&inbox_->mu);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(inbox_->mu) {
          return !inbox_->queue.empty() || closed_.load();
        };
        inbox_->mu.AwaitWithDeadline(absl::Condition(&ready), deadline);
        if (closed_.load()) return absl::CancelledError("transport closed");
        if (inbox_->queue.empty()) {
          caught_up_ns_.store(absl::ToUnixNanos(absl::Now()));
          return absl::DeadlineExceededError("no message");
        }
        parts = std::move(inbox_->queue.front());
        inbox_->queue.pop_front();
        // Taken the last that waited: caught up.
        if (inbox_->queue.empty())
          caught_up_ns_.store(absl::ToUnixNanos(absl::Now()));
      }
      absl::StatusOr<Message> msg = DecodeMessage(std::move(parts));
      if (msg.ok()) return msg;
      ++malformed_;
      TESSERA_LOG(WARNING) << "dropped malformed message: "
                           << msg.status().message();
    }
  }

  uint64_t malformed_count() const override { return malformed_.load(); }
  absl::Time caught_up_at() const override {
    return absl::FromUnixNanos(caught_up_ns_.load());
  }

  void Close() override {
    if (closed_.exchange(true)) return;
    if (inbox_ != nullptr) {
      absl::MutexLock lock(&net_->mu);
      net_->inboxes.erase(address_);
      absl::MutexLock inbox_lock(&inbox_->mu);  // wakes a waiting Receive
    }
  }

 private:
  std::shared_ptr<MemoryNetwork::State> net_;
  std::shared_ptr<MemoryNetwork::State::Inbox> inbox_;
  std::string address_;
  absl::Mutex mu_;
  std::map<int, std::string> peers_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> malformed_{0};
  std::atomic<int64_t> caught_up_ns_{absl::ToUnixNanos(absl::Now())};
};

}  // namespace

MemoryNetwork::MemoryNetwork() : state_(std::make_shared<State>()) {}
MemoryNetwork::~MemoryNetwork() = default;
std::unique_ptr<Transport> MemoryNetwork::NewTransport() {
  return std::make_unique<MemoryTransport>(state_);
}

}  // namespace tessera
