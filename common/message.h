// Message: one protobuf header plus zero-copy data frames, and its codec.
//
// On the wire a message is a multi-part ZeroMQ message: part 0 is the
// serialized wire::Header, parts 1..n are the data frames that header.frames()
// describes.
//
//   Message m;
//   m.header.set_command(wire::KV_PUSH);
//   AddFloatFrame(&m, Buffer::CopyOf(grad, n * 4));
//   std::vector<Buffer> parts = EncodeMessage(m).value();
//   absl::StatusOr<Message> back = DecodeMessage(std::move(parts));
//
// DecodeMessage never aborts: any malformed input (bad protobuf, frame count or
// size mismatch, unknown command, oversized message) is a DataLoss status.
#ifndef TESSERA_COMMON_MESSAGE_H_
#define TESSERA_COMMON_MESSAGE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/buffer.h"
#include "proto/tessera.pb.h"

namespace tessera {

// Node ids, as in ps-lite: the scheduler is 1, servers 8, 10, 12, ..., workers
// 9, 11, ...
inline constexpr int kSchedulerId = 1;
inline int ServerId(int rank) { return 8 + 2 * rank; }
inline int WorkerId(int rank) { return 9 + 2 * rank; }
inline bool IsServerId(int id) { return id >= 8 && id % 2 == 0; }
inline bool IsWorkerId(int id) { return id >= 9 && id % 2 == 1; }
inline int RankOfId(int id) { return (id - 8) / 2; }

// Barrier groups (bit set).
inline constexpr int kGroupScheduler = 1;
inline constexpr int kGroupServers = 2;
inline constexpr int kGroupWorkers = 4;
inline constexpr int kGroupAll = 7;

struct Message {
  wire::Header header;
  std::vector<Buffer> data;  // one per header.frames(), in order
  // Set by a secured transport on what it receives unsealed over a
  // connection authenticated with a node's own key (launch.py gives every
  // process one): that key (Z85). Empty for a role's key, which every node of
  // the role holds. Not on the wire.
  std::string connection_key;
};

// Appends a float32 frame and its descriptor.
void AddFloatFrame(Message* msg, Buffer values);
// Appends a 2-bit frame standing for `num_values` values.
void AddTwoBitFrame(Message* msg, Buffer packed, uint64_t num_values);
// Appends a bfloat16 frame (2 bytes per value; compression/bf16.h).
void AddBf16Frame(Message* msg, Buffer values);
// Appends a frame of opaque bytes (row ids, counts).
void AddRawFrame(Message* msg, Buffer bytes);

// Rows a frame of a row push or a row pull reply carries: whole rows of
// `row_bytes`, at most `frame_bytes` a frame (at least one row), and never so
// few that `rows` need more than kMaxRowFrames frames. Row messages travel in
// frames of about a slice (TESSERA_CHUNK_BYTES) rather than one frame of the
// whole: a receiver then gets memory its allocator reuses (glibc gives blocks
// over 32 MiB back to the system, and every fresh page costs a fault and a
// clear), as for a dense key's slices.
inline constexpr size_t kMaxRowFrames = 48;
size_t RowsPerFrame(size_t rows, size_t row_bytes, size_t frame_bytes);

struct CodecLimits {
  size_t max_header_bytes = 1 << 20;  // 1 MiB of protobuf
  size_t max_frames = 64;
  uint64_t max_message_bytes = uint64_t{8} << 30;  // 8 GiB of data frames
};

// Serializes the header and lists [header, data...]. InvalidArgument when the
// descriptors do not match the data (a programming error, reported not
// aborted).
absl::StatusOr<std::vector<Buffer>> EncodeMessage(const Message& msg);

// EncodeMessage in two steps, for a transport that serializes the header
// straight into its own frame: CheckForEncoding validates as EncodeMessage
// does and returns the header's serialized size; SerializeHeader writes it
// (REQUIRES: `size` from CheckForEncoding, header unchanged since; false only
// if protobuf fails).
absl::StatusOr<size_t> CheckForEncoding(const Message& msg);
bool SerializeHeader(const Message& msg, void* out, size_t size);

// Parses and validates the parts of one message. DataLoss on malformed input.
absl::StatusOr<Message> DecodeMessage(
    std::vector<Buffer> parts, const CodecLimits& limits = CodecLimits());
// The same, with the header frame's bytes given apart (they are only read
// during the call) and `data` the data frames.
absl::StatusOr<Message> DecodeMessage(
    const void* header, size_t header_size, std::vector<Buffer> data,
    const CodecLimits& limits = CodecLimits());

// Parses a header alone and checks its frame descriptors (consistency,
// count, sizes) against `limits`, for a receiver that assembles the frames
// itself. DataLoss on malformed input.
absl::Status DecodeHeader(const void* header, size_t header_size,
                          const CodecLimits& limits, wire::Header* out);

// A one-line description for logs ("KV_PUSH #12 9->8 key=3 [0,+100) 1 frame").
std::string DebugString(const Message& msg);

}  // namespace tessera

#endif  // TESSERA_COMMON_MESSAGE_H_
