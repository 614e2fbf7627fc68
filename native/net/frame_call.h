// One request frame and its reply on a connection of its own, within a
// deadline: the Hello that opens every client connection, and the frames a
// primary sends its standby (docs/replication.md).
#ifndef TF_DLT_NATIVE_NET_FRAME_CALL_H_
#define TF_DLT_NATIVE_NET_FRAME_CALL_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "native/core/status.h"
#include "native/net/socket.h"
#include "native/net/wire.h"

namespace dlt {
namespace net {

// Sends one `opcode` frame of `payload` and receives its reply's payload
// into *reply: an error reply becomes its Status; a reply of another opcode,
// or one longer than `max_reply_bytes`, is INTERNAL. When sending fails the
// peer may still have said why before closing: that error wins.
// `flags` go in the request's header. A payload past `max_payload_bytes`
// (the peer's frame limit; 0: none but the header's 32 bits) is refused
// (RESOURCE_EXHAUSTED) before anything is sent.
Status CallFrame(int fd, wire::Opcode opcode, uint64_t request_id, const void* payload,
                 size_t payload_bytes, size_t max_reply_bytes, Clock::time_point deadline,
                 std::string* reply, uint16_t flags = 0, uint32_t max_payload_bytes = 0);

// The two halves of CallFrame, for a sender that keeps several frames in
// flight on one connection (the peer answers them in order): SendFrame sends
// one frame; ReceiveReply receives the reply to `request_id`, setting
// *answered once a reply's header arrived. SendFrame refuses a payload
// past `max_payload_bytes` as CallFrame does.
Status SendFrame(int fd, wire::Opcode opcode, uint64_t request_id, const void* payload,
                 size_t payload_bytes, Clock::time_point deadline, uint16_t flags = 0,
                 uint32_t max_payload_bytes = 0);
Status ReceiveReply(int fd, wire::Opcode opcode, uint64_t request_id, size_t max_reply_bytes,
                    Clock::time_point deadline, std::string* reply, bool* answered = nullptr);

// Says Hello on `fd` with `token` and the Hello `flags` (wire::kFlagReplica,
// wire::kFlagTopology: the reply then carries its topology part) and
// decodes the reply into *reply. FAILED_PRECONDITION when the server routes
// over another number of buckets than this build.
Status SayHello(int fd, const std::string& token, uint16_t flags, uint64_t request_id,
                Clock::time_point deadline, wire::HelloReply* reply);

}  // namespace net
}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_FRAME_CALL_H_
