// Private to the data-plane client's sources (client.cc,
// client_connections.cc, client_exchange.cc): a shard's connection pool
// state and one shard's part of an exchange. Nothing else includes it.
#ifndef TF_DLT_NATIVE_NET_CLIENT_CALL_H_
#define TF_DLT_NATIVE_NET_CLIENT_CALL_H_

#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "native/net/client.h"

namespace dlt {

struct Client::ShardState {
  // Its place in its layout.
  uint32_t index = 0, count = 0;
  uint64_t layout_epoch = 1;
  // The shard's primary, then its standbys (an address "a|b|c").
  std::vector<std::string> addresses;
  mutable std::mutex mu;
  // Those of `addresses` carried over from the layout before (a standby
  // attached since the switch, or a process the switch left out): used
  // only where they serve this place at this layout (Client::Hello).
  // Guarded by mu.
  std::vector<std::string> kept;
  std::string address;     // the one last connected to (first: the primary); guarded by mu
  std::vector<Conn> idle;  // guarded by mu
  bool greeted = false;    // guarded by mu
  int64_t greeted_ms = 0;  // when its last Hello was; guarded by mu
  bool retired = false;    // its layout was left: pools nothing; guarded by mu
  uint64_t epoch = 0;      // the newest copy's met; guarded by mu
  uint64_t lineage = 0;    // that copy's lineage (0: unknown); guarded by mu
  // The lineage of an older copy a Hello refused, when not `lineage`: the
  // shard's whole replica set may have restarted (Client::FollowRestart).
  // Guarded by mu.
  uint64_t restarted_lineage = 0;
  ShardInfo info;  // guarded by mu
  // Bumped when a call found another copy serving in place of the one it
  // heard nothing from (Client::CheckSilent): connections made before are
  // to the copy left, and are not used again. Guarded by mu.
  uint64_t switches = 0;
  // When CheckSilent may ask the other addresses next; guarded by mu.
  std::chrono::steady_clock::time_point next_silence_probe{};

  // Whether `a` is one of `kept`; the caller holds mu.
  bool Kept(const std::string& a) const {
    return std::find(kept.begin(), kept.end(), a) != kept.end();
  }
  // `a` met serving this place: one of the shard's copies now. The caller
  // holds mu.
  void Unkeep(const std::string& a) {
    kept.erase(std::remove(kept.begin(), kept.end(), a), kept.end());
  }

  // It lists standbys (given, or named by a Hello).
  bool HasStandbys() const {
    std::lock_guard<std::mutex> lock(mu);
    return addresses.size() > 1;
  }
};

// The shards calls route by (a re-shard's switch brings a new one).
struct Client::Layout {
  uint64_t epoch = 1;
  std::vector<ShardState*> shards;  // owned by Client::states_
};

// Whether a pull of `rows` rows into `out` places them with non-temporal
// stores: whole 64-byte lines (rows of a multiple of 16 floats, `out`
// aligned, as TensorFlow aligns tensors) into an output too large to stay
// in cache (kStreamPlaceBytes), where an ordinary store first reads each
// line it writes (on the 2-core VM: 10-20% less client CPU a pull with a
// busy neighbour, within the noise on a quiet machine).
bool StreamsPulledRows(const float* out, size_t row_floats, size_t rows);
inline constexpr size_t kStreamPlaceBytes = size_t{4} << 20;

// One shard's part of an exchange: frames to send, a handler for replies.
struct Client::Call {
  struct Frame {
    uint8_t header[wire::kHeaderBytes];
    std::string prefix;
    const void* body[2] = {nullptr, nullptr};
    size_t body_bytes[2] = {0, 0};
    size_t reply_bytes = 0;  // the payload its reply must have
    PushId id;               // an identified push frame's
    size_t Bytes() const {
      return wire::kHeaderBytes + prefix.size() + body_bytes[0] + body_bytes[1];
    }
  };
  size_t shard = 0;  // its index in the call's layout
  ShardState* state = nullptr;
  wire::Opcode opcode = wire::Opcode::kPull;
  std::vector<Frame> frames;
  // Frames the shard refused unapplied (ABORTED), and why: sent again once
  // routed by a newer layout.
  std::vector<size_t> refused;
  Status refusal;
  uint64_t first_request_id = 0;
  // The call carries rows [first_row, first_row + num_rows) of the shard's
  // part (its connection's run of them), frame f the rows from first_row +
  // f * rows_per_frame on.
  size_t rows_per_frame = 0;
  size_t first_row = 0;
  size_t num_rows = 0;
  // A push's frames cut between ids (FramesById in client.cc): frame f the
  // rows [frame_starts[f], frame_starts[f + 1]); empty: the stride above.
  std::vector<size_t> frame_starts;
  size_t FrameBegin(size_t f) const {
    return frame_starts.empty() ? first_row + f * rows_per_frame : frame_starts[f];
  }
  size_t FrameRows(size_t f) const {
    return frame_starts.empty() ? std::min(rows_per_frame, first_row + num_rows - FrameBegin(f))
                                : frame_starts[f + 1] - frame_starts[f];
  }
  // Run by the thread that exchanges this call, before it sends: fills the
  // frames' bodies for rows [begin, end) of the shard's part.
  std::function<void(size_t begin, size_t end)> fill;
  // Called with each whole reply frame's payload; for a call with `rows`
  // set, with the reply's fixed part (`bytes` = rows.fixed) once it is in,
  // before the rows are read.
  std::function<Status(size_t frame, const uint8_t* payload, size_t bytes)> on_reply;

  // Pulls: the rows of a reply are received through a small staging buffer
  // that stays in cache (StageBytes) and copied to their places in the
  // caller's memory as they arrive, so no reply is buffered whole. Row r of
  // frame f goes to out + at * row_floats, at = pos[k] (or k without `pos`),
  // k = first_row + f * rows_per_frame + r; the reply's first `fixed`
  // payload bytes are buffered for on_reply.
  struct RowTarget {
    float* out = nullptr;  // nullptr: replies are buffered whole
    const uint32_t* pos = nullptr;
    size_t row_floats = 0;
    size_t fixed = 0;
    // A state pull's dim (0 for other pulls): a reply whose rows are of
    // another width names the table's slot floats (CheckReply).
    size_t state_dim = 0;
    // Scattered rows are written with non-temporal stores
    // (StreamsPulledRows).
    bool stream = false;
  } rows;

  // Bytes of its requests and their replies.
  size_t Bytes() const {
    size_t bytes = 0;
    for (const Frame& f : frames) bytes += f.Bytes() + f.reply_bytes;
    return bytes;
  }
  // Fills up to `max_iov` iovecs with the unsent bytes from `offset` of frame
  // `frame_index` on; returns how many.
  int FillIov(size_t frame_index, size_t offset, struct iovec* iov, int max_iov) const;
  // The staging buffer's size: whole rows, about kStageBytes, at least one.
  size_t StageBytes() const;
  // Copies `count` whole rows from `src`, rows `first` on of frame `frame`,
  // to their places.
  void PlaceRows(size_t frame, size_t first, const uint8_t* src, size_t count) const;
  // Checks a reply header against the request it answers (id not answered
  // yet, opcode, exact payload size) before its payload is read.
  Status CheckReply(const wire::FrameHeader& frame, const std::vector<bool>& answered) const;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_CLIENT_CALL_H_
