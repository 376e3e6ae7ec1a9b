// The trace spans of a worker's requests (common/trace.h, TESSERA_TRACE): one
// asynchronous span per request, from its first send to its reply (or its
// failure), shared by RequestTracker's files (request_tracker.cc sends and
// answers, request_tracker_resend.cc gives up).
//
//   if (trace::Enabled()) TraceRequestBegin(msg, server);
//   ...
//   TraceRequestEnd(request_msg, DataBytes(reply), /*ok=*/true);
//
// Thread-safety: as common/trace.h (any thread).
#ifndef TESSERA_WORKER_CLIENT_REQUEST_TRACE_H_
#define TESSERA_WORKER_CLIENT_REQUEST_TRACE_H_

#include <cstdint>

#include "common/message.h"

namespace tessera {

// The bytes of a message's data frames.
uint64_t DataBytes(const Message& msg);

// A request's span: from its first send to its reply (or failure), with the
// key, the bytes it carries, the server's rank and whether it is compressed
// (a 2-bit push, a compressed pull).
void TraceRequestBegin(const Message& msg, int server);
// Ends the span of `request` (the message as sent).
void TraceRequestEnd(const Message& request, uint64_t reply_bytes, bool ok);

}  // namespace tessera

#endif  // TESSERA_WORKER_CLIENT_REQUEST_TRACE_H_
