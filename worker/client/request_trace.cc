#include "worker/client/request_trace.h"

#include "common/trace.h"

namespace tessera {

namespace {

// The trace span of a request (a literal, as trace names must be).
const char* SpanName(int command) {
  switch (command) {
    case wire::KV_INIT:
      return "init";
    case wire::KV_PUSH:
      return "push";
    case wire::KV_PULL:
      return "pull";
    case wire::KV_PUSHPULL:
      return "pushpull";
    default:
      return "request";
  }
}

}  // namespace

uint64_t DataBytes(const Message& msg) {
  uint64_t bytes = 0;
  for (const Buffer& b : msg.data) bytes += b.size();
  return bytes;
}

void TraceRequestBegin(const Message& msg, int server) {
  const wire::Header& h = msg.header;
  const bool compressed =
      h.pull_compressed() ||
      (h.frames_size() > 0 &&
       h.frames(h.frames_size() - 1).encoding() == wire::DataFrame::TWO_BIT);
  trace::AsyncBegin("kv", SpanName(h.command()), h.request_id(),
                    {{"key", static_cast<int64_t>(h.slice().key())},
                     {"bytes", static_cast<int64_t>(DataBytes(msg))},
                     {"server", RankOfId(server)},
                     {"compressed", compressed ? 1 : 0}});
}

void TraceRequestEnd(const Message& request, uint64_t reply_bytes, bool ok) {
  trace::AsyncEnd(
      "kv", SpanName(request.header.command()), request.header.request_id(),
      {{"reply_bytes", static_cast<int64_t>(reply_bytes)}, {"ok", ok ? 1 : 0}});
}

}  // namespace tessera
