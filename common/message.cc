#include "common/message.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera {
namespace {

uint64_t TwoBitBytes(uint64_t values) { return 4 * ((values + 15) / 16); }

absl::Status CheckFrame(const wire::DataFrame& desc, size_t actual,
                        size_t index) {
  if (desc.num_bytes() != actual) {
    return absl::DataLossError(absl::StrCat("frame ", index, " has ", actual,
                                            " bytes but its descriptor says ",
                                            desc.num_bytes()));
  }
  switch (desc.encoding()) {
    case wire::DataFrame::FLOAT32:
      if (desc.num_values() > (uint64_t{1} << 61) ||
          desc.num_bytes() != 4 * desc.num_values()) {
        return absl::DataLossError(absl::StrCat("float32 frame ", index, " of ",
                                                actual, " bytes cannot hold ",
                                                desc.num_values(), " values"));
      }
      break;
    case wire::DataFrame::TWO_BIT:
      if (desc.num_values() > (uint64_t{1} << 61) ||
          desc.num_bytes() != TwoBitBytes(desc.num_values())) {
        return absl::DataLossError(absl::StrCat(
            "2-bit frame ", index, " of ", actual, " bytes cannot hold ",
            desc.num_values(), " values (expected ",
            TwoBitBytes(desc.num_values()), " bytes)"));
      }
      break;
    case wire::DataFrame::BF16:
      if (desc.num_values() > (uint64_t{1} << 61) ||
          desc.num_bytes() != 2 * desc.num_values()) {
        return absl::DataLossError(
            absl::StrCat("bfloat16 frame ", index, " of ", actual,
                         " bytes cannot hold ", desc.num_values(), " values"));
      }
      break;
    case wire::DataFrame::COUNTS8:
      if (desc.num_bytes() != desc.num_values()) {
        return absl::DataLossError(absl::StrCat("count frame ", index, " of ",
                                                actual, " bytes cannot hold ",
                                                desc.num_values(), " values"));
      }
      break;
    case wire::DataFrame::COUNTS4:
      if (desc.num_values() > (uint64_t{1} << 62) ||
          desc.num_bytes() != (desc.num_values() + 1) / 2) {
        return absl::DataLossError(
            absl::StrCat("4-bit count frame ", index, " of ", actual,
                         " bytes cannot hold ", desc.num_values(), " values"));
      }
      break;
    case wire::DataFrame::RAW:
      break;
    default:
      return absl::DataLossError(absl::StrCat(
          "frame ", index, " has unknown encoding ", desc.encoding()));
  }
  return absl::OkStatus();
}

}  // namespace

void AddFloatFrame(Message* msg, Buffer values) {
  wire::DataFrame* d = msg->header.add_frames();
  d->set_encoding(wire::DataFrame::FLOAT32);
  d->set_num_values(values.size() / sizeof(float));
  d->set_num_bytes(values.size());
  msg->data.push_back(std::move(values));
}

void AddBf16Frame(Message* msg, Buffer values) {
  wire::DataFrame* d = msg->header.add_frames();
  d->set_encoding(wire::DataFrame::BF16);
  d->set_num_values(values.size() / 2);
  d->set_num_bytes(values.size());
  msg->data.push_back(std::move(values));
}

void AddRawFrame(Message* msg, Buffer bytes) {
  wire::DataFrame* d = msg->header.add_frames();
  d->set_encoding(wire::DataFrame::RAW);
  d->set_num_bytes(bytes.size());
  msg->data.push_back(std::move(bytes));
}

size_t RowsPerFrame(size_t rows, size_t row_bytes, size_t frame_bytes) {
  const size_t by_size =
      std::max<size_t>(1, frame_bytes / std::max<size_t>(1, row_bytes));
  const size_t by_count = (rows + kMaxRowFrames - 1) / kMaxRowFrames;
  return std::max(by_size, by_count);
}

void AddTwoBitFrame(Message* msg, Buffer packed, uint64_t num_values) {
  wire::DataFrame* d = msg->header.add_frames();
  d->set_encoding(wire::DataFrame::TWO_BIT);
  d->set_num_values(num_values);
  d->set_num_bytes(packed.size());
  msg->data.push_back(std::move(packed));
}

absl::StatusOr<size_t> CheckForEncoding(const Message& msg) {
  if (static_cast<size_t>(msg.header.frames_size()) != msg.data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("message has ", msg.data.size(), " data frames but ",
                     msg.header.frames_size(), " descriptors"));
  }
  for (size_t i = 0; i < msg.data.size(); ++i) {
    absl::Status s = CheckFrame(msg.header.frames(static_cast<int>(i)),
                                msg.data[i].size(), i);
    if (!s.ok()) return absl::InvalidArgumentError(s.message());
  }
  return msg.header.ByteSizeLong();
}

bool SerializeHeader(const Message& msg, void* out, size_t size) {
  // ByteSizeLong was computed by CheckForEncoding and is cached in the header.
  return msg.header.SerializeWithCachedSizesToArray(
             static_cast<uint8_t*>(out)) == static_cast<uint8_t*>(out) + size;
}

absl::StatusOr<std::vector<Buffer>> EncodeMessage(const Message& msg) {
  absl::StatusOr<size_t> header_size = CheckForEncoding(msg);
  if (!header_size.ok()) return header_size.status();
  Buffer header = Buffer::Allocate(*header_size);
  if (!SerializeHeader(msg, header.mutable_data(), *header_size)) {
    return absl::InternalError("cannot serialize message header");
  }
  std::vector<Buffer> parts;
  parts.reserve(1 + msg.data.size());
  parts.push_back(std::move(header));
  for (const Buffer& b : msg.data) parts.push_back(b);
  return parts;
}

absl::StatusOr<Message> DecodeMessage(std::vector<Buffer> parts,
                                      const CodecLimits& limits) {
  if (parts.empty())
    return absl::DataLossError("empty message: no header frame");
  const Buffer head = std::move(parts[0]);
  parts.erase(parts.begin());
  return DecodeMessage(head.data(), head.size(), std::move(parts), limits);
}

absl::StatusOr<Message> DecodeMessage(const void* header, size_t header_size,
                                      std::vector<Buffer> data,
                                      const CodecLimits& limits) {
  if (data.size() > limits.max_frames) {
    return absl::DataLossError(absl::StrCat("message has ", data.size(),
                                            " data frames; at most ",
                                            limits.max_frames, " are allowed"));
  }
  if (header_size > limits.max_header_bytes) {
    return absl::DataLossError(absl::StrCat("header frame of ", header_size,
                                            " bytes exceeds the limit of ",
                                            limits.max_header_bytes));
  }
  Message msg;
  if (!msg.header.ParseFromArray(header, static_cast<int>(header_size))) {
    return absl::DataLossError(absl::StrCat("header frame of ", header_size,
                                            " bytes is not a valid header"));
  }
  if (!wire::Command_IsValid(msg.header.command()) ||
      msg.header.command() == wire::CMD_UNKNOWN) {
    return absl::DataLossError(absl::StrCat(
        "unknown command ", static_cast<int>(msg.header.command())));
  }
  if (static_cast<size_t>(msg.header.frames_size()) != data.size()) {
    return absl::DataLossError(
        absl::StrCat("header describes ", msg.header.frames_size(),
                     " data frames but ", data.size(), " arrived"));
  }
  uint64_t total = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    absl::Status s =
        CheckFrame(msg.header.frames(static_cast<int>(i)), data[i].size(), i);
    if (!s.ok()) return s;
    total += data[i].size();
    if (total > limits.max_message_bytes) {
      return absl::DataLossError(
          absl::StrCat("message data exceeds the limit of ",
                       limits.max_message_bytes, " bytes"));
    }
  }
  msg.data = std::move(data);
  return msg;
}

absl::Status DecodeHeader(const void* header, size_t header_size,
                          const CodecLimits& limits, wire::Header* out) {
  if (header_size > limits.max_header_bytes) {
    return absl::DataLossError(absl::StrCat("header of ", header_size,
                                            " bytes exceeds the limit of ",
                                            limits.max_header_bytes));
  }
  if (!out->ParseFromArray(header, static_cast<int>(header_size))) {
    return absl::DataLossError(absl::StrCat("header of ", header_size,
                                            " bytes is not a valid header"));
  }
  if (!wire::Command_IsValid(out->command()) ||
      out->command() == wire::CMD_UNKNOWN) {
    return absl::DataLossError(
        absl::StrCat("unknown command ", static_cast<int>(out->command())));
  }
  if (static_cast<size_t>(out->frames_size()) > limits.max_frames) {
    return absl::DataLossError(absl::StrCat(
        "header describes ", out->frames_size(), " data frames; at most ",
        limits.max_frames, " are allowed"));
  }
  uint64_t total = 0;
  for (int i = 0; i < out->frames_size(); ++i) {
    const wire::DataFrame& d = out->frames(i);
    if (d.num_bytes() > limits.max_message_bytes) {
      return absl::DataLossError(absl::StrCat(
          "frame ", i, " of ", d.num_bytes(), " bytes exceeds the limit of ",
          limits.max_message_bytes));
    }
    absl::Status s = CheckFrame(d, d.num_bytes(), static_cast<size_t>(i));
    if (!s.ok()) return s;
    total += d.num_bytes();
    if (total > limits.max_message_bytes) {
      return absl::DataLossError(
          absl::StrCat("message data exceeds the limit of ",
                       limits.max_message_bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

std::string DebugString(const Message& msg) {
  const wire::Header& h = msg.header;
  std::string s = absl::StrCat(
      wire::Command_Name(h.command()), h.is_response() ? " reply" : "", " #",
      h.request_id(), " ", h.sender(), "->", h.recipient());
  if (h.has_slice()) {
    absl::StrAppend(&s, " key=", h.slice().key(), " [", h.slice().offset(),
                    ",+", h.slice().length(), ")");
  }
  if (h.has_status() && h.status().code() != 0) {
    absl::StrAppend(&s, " error=", h.status().message());
  }
  absl::StrAppend(&s, " ", msg.data.size(), " frame(s)");
  return s;
}

}  // namespace tessera
