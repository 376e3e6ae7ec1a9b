// MemoryNetwork: a process-local network for tests and simulations. Transports
// created from the same MemoryNetwork reach each other by "ip:port"; messages
// are encoded and decoded exactly as on the wire, but travel through queues
// instead of sockets, so schedulers, servers and workers run in one process.
//
//   MemoryNetwork net;
//   Scheduler scheduler(options, net.NewTransport());
//   Node::Start(server_options, callbacks, net.NewTransport());
//
// Thread-safety: NewTransport and every transport's methods may be called from
// any thread (Receive from one thread at a time per transport).
#ifndef TESSERA_TESTS_SUPPORT_MEMORY_NETWORK_H_
#define TESSERA_TESTS_SUPPORT_MEMORY_NETWORK_H_

#include <memory>

#include "common/transport.h"

namespace tessera {

class MemoryNetwork {
 public:
  MemoryNetwork();
  ~MemoryNetwork();
  std::unique_ptr<Transport> NewTransport();
  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_MEMORY_NETWORK_H_
