// ForwardingTransport: passes everything to another transport; tests
// override what they fault (drop, delay, hold up).
//
//   class Slow : public ForwardingTransport {
//     using ForwardingTransport::ForwardingTransport;
//     absl::Status Send(int peer, const Message& m) override { ... }
//   };
#ifndef TESSERA_TESTS_SUPPORT_FORWARDING_TRANSPORT_H_
#define TESSERA_TESTS_SUPPORT_FORWARDING_TRANSPORT_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/transport.h"

namespace tessera {

class ForwardingTransport : public Transport {
 public:
  explicit ForwardingTransport(std::unique_ptr<Transport> inner)
      : inner_(std::move(inner)) {}
  absl::StatusOr<int> Bind(const std::string& ip, int port) override {
    return inner_->Bind(ip, port);
  }
  absl::Status Connect(int peer, const std::string& ip, int port) override {
    return inner_->Connect(peer, ip, port);
  }
  void Disconnect(int peer) override { inner_->Disconnect(peer); }
  absl::Status Send(int peer, const Message& msg) override {
    return inner_->Send(peer, msg);
  }
  absl::StatusOr<Message> Receive(absl::Duration timeout) override {
    return inner_->Receive(timeout);
  }
  uint64_t malformed_count() const override {
    return inner_->malformed_count();
  }
  absl::Time caught_up_at() const override { return inner_->caught_up_at(); }
  // A sealed transport's keys, identities and counts: a wrapped one still
  // seals (the rogue-node harness wraps a real node's).
  void ForgetPeer(int peer) override { inner_->ForgetPeer(peer); }
  uint64_t wrong_sender_count() const override {
    return inner_->wrong_sender_count();
  }
  uint64_t refused_connection_count() const override {
    return inner_->refused_connection_count();
  }
  uint64_t unsent_dropped_count() const override {
    return inner_->unsent_dropped_count();
  }
  std::string node_key() const override { return inner_->node_key(); }
  bool nodes_have_own_keys() const override {
    return inner_->nodes_have_own_keys();
  }
  int sealed_port() const override { return inner_->sealed_port(); }
  void SetPeerIdentity(int peer, const PeerIdentity& identity) override {
    inner_->SetPeerIdentity(peer, identity);
  }
  SealedDrops sealed_drops() const override { return inner_->sealed_drops(); }
  std::vector<LostLink> TakeLostLinks() override {
    return inner_->TakeLostLinks();
  }
  void DiscardUnsent() override { inner_->DiscardUnsent(); }
  void Close() override { inner_->Close(); }

 protected:
  std::unique_ptr<Transport> inner_;
};

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_FORWARDING_TRANSPORT_H_
