#include "native/net/frame_call.h"

#include <sys/uio.h>

#include "native/core/routing.h"

namespace dlt {
namespace net {

namespace {

// A payload a frame can carry: a header's length is 32 bits (a longer one
// went out with its length cut, and the peer read the rest as frames), and
// a frame past the peer's limit is refused there after the whole payload.
Status CheckPayload(wire::Opcode opcode, size_t payload_bytes, uint32_t max_payload_bytes) {
  const uint64_t limit = max_payload_bytes == 0 ? uint64_t{UINT32_MAX} : max_payload_bytes;
  if (payload_bytes <= limit) return OkStatus();
  return ResourceExhausted("frame payload of " + std::to_string(payload_bytes) + " bytes (opcode " +
                           std::to_string(static_cast<int>(opcode)) +
                           ") exceeds the frame limit of " + std::to_string(limit) +
                           " bytes; nothing sent");
}

}  // namespace

Status SendFrame(int fd, wire::Opcode opcode, uint64_t request_id, const void* payload,
                 size_t payload_bytes, Clock::time_point deadline, uint16_t flags,
                 uint32_t max_payload_bytes) {
  DLT_RETURN_IF_ERROR(CheckPayload(opcode, payload_bytes, max_payload_bytes));
  uint8_t header[wire::kHeaderBytes];
  wire::EncodeHeader({opcode, flags, request_id, static_cast<uint32_t>(payload_bytes)}, header);
  struct iovec iov[2] = {{header, sizeof(header)}, {const_cast<void*>(payload), payload_bytes}};
  return SendAll(fd, iov, 2, deadline);
}

Status ReceiveReply(int fd, wire::Opcode opcode, uint64_t request_id, size_t max_reply_bytes,
                    Clock::time_point deadline, std::string* reply, bool* answered) {
  uint8_t reply_header[wire::kHeaderBytes];
  DLT_RETURN_IF_ERROR(RecvAll(fd, reply_header, sizeof(reply_header), deadline));
  if (answered != nullptr) *answered = true;
  wire::FrameHeader h;
  DLT_RETURN_IF_ERROR(wire::DecodeHeader(reply_header, UINT32_MAX, &h));
  // Read no more than the reply or an error can hold.
  const size_t allowed = h.opcode == wire::Opcode::kError
                             ? wire::kErrorFixed + wire::kMaxErrorMessageBytes
                             : max_reply_bytes;
  if (h.payload_bytes > allowed) {
    return Internal("reply of " + std::to_string(h.payload_bytes) + " bytes exceeds " +
                    std::to_string(allowed));
  }
  reply->assign(h.payload_bytes, '\0');
  DLT_RETURN_IF_ERROR(RecvAll(fd, &(*reply)[0], reply->size(), deadline));
  const auto* p = reinterpret_cast<const uint8_t*>(reply->data());
  if (h.opcode == wire::Opcode::kError && h.request_id == request_id) {
    return wire::DecodeError(p, reply->size());
  }
  if (h.opcode != opcode || !(h.flags & wire::kFlagResponse) || h.request_id != request_id) {
    return Internal("expected the reply to request " + std::to_string(request_id) + " (opcode " +
                    std::to_string(static_cast<int>(opcode)) + ")");
  }
  return OkStatus();
}

Status CallFrame(int fd, wire::Opcode opcode, uint64_t request_id, const void* payload,
                 size_t payload_bytes, size_t max_reply_bytes, Clock::time_point deadline,
                 std::string* reply, uint16_t flags, uint32_t max_payload_bytes) {
  // Nothing goes: there is no reply to wait for.
  DLT_RETURN_IF_ERROR(CheckPayload(opcode, payload_bytes, max_payload_bytes));
  const Status sent =
      SendFrame(fd, opcode, request_id, payload, payload_bytes, deadline, flags, max_payload_bytes);
  bool answered = false;
  const Status received =
      ReceiveReply(fd, opcode, request_id, max_reply_bytes, deadline, reply, &answered);
  if (!answered) return sent.ok() ? received : sent;
  return received.ok() ? sent : received;
}

Status SayHello(int fd, const std::string& token, uint16_t flags, uint64_t request_id,
                Clock::time_point deadline, wire::HelloReply* reply) {
  wire::HelloRequest request;
  request.token = token;
  const std::string payload = wire::EncodeHelloRequest(request);
  const bool topology = flags & wire::kFlagTopology;
  // The topology part: the standbys, the layout and the lineage after them
  // (left out, a reply of the longest standbys and layout was refused).
  const size_t max_reply =
      wire::kHelloReplyBytes +
      (topology ? wire::kHelloTopologyFixed + wire::kMaxStandbysBytes + wire::kHelloLayoutFixed +
                      wire::kMaxLayoutBytes + sizeof(uint64_t)
                : 0);
  std::string body;
  const Status called = CallFrame(fd, wire::Opcode::kHello, request_id, payload.data(),
                                  payload.size(), max_reply, deadline, &body, flags);
  if (called.code() == Code::kInvalidArgument &&
      called.message().rfind("bad frame magic", 0) == 0) {
    // What answers is no shard's data port (its admin port's gRPC, say).
    return Status(called.code(), called.message() +
                                     " (is this a shard's data port, its --port? Its admin "
                                     "and metrics ports answer no Hello)");
  }
  DLT_RETURN_IF_ERROR(called);
  DLT_RETURN_IF_ERROR(wire::DecodeHelloReply(reinterpret_cast<const uint8_t*>(body.data()),
                                             body.size(), reply, topology));
  if (reply->num_buckets != kNumBuckets) {
    return FailedPrecondition("server routes over " + std::to_string(reply->num_buckets) +
                              " buckets, this build over " + std::to_string(kNumBuckets));
  }
  return OkStatus();
}

}  // namespace net
}  // namespace dlt
