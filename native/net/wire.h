// DLT wire protocol v1: the frame layout of the data plane, specified in
// docs/wire-protocol.md and pinned by tests/data/frames_golden.txt. All
// integers and floats are little-endian.
#ifndef TF_DLT_NATIVE_NET_WIRE_H_
#define TF_DLT_NATIVE_NET_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "native/core/pull_mode.h"
#include "native/core/push_ledger.h"
#include "native/core/status.h"

namespace dlt {
namespace wire {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the DLT wire format is little-endian; so must the host be");

inline constexpr uint32_t kMagic = 0x50544c44;  // bytes "DLTP"
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 24;
inline constexpr uint16_t kFlagResponse = 0x1;
// On a Hello request: the connection is a primary's, replicating to its
// standby (docs/replication.md). A standby greets only such connections.
inline constexpr uint16_t kFlagReplica = 0x2;
// On a Hello request: the client reads the reply's topology part (the
// shard's epoch and its standbys) after the 24 fixed bytes.
inline constexpr uint16_t kFlagTopology = 0x4;
// On a Hello request: the connection carries a range stream (a re-shard,
// docs/replication.md) to the shard of the next layout this process
// prepares; the reply names that shard's index and count.
inline constexpr uint16_t kFlagMove = 0x8;
inline constexpr uint32_t kDefaultMaxFrameBytes = 64u << 20;
inline constexpr uint32_t kMinMaxFrameBytes = 4096;
inline constexpr uint32_t kMaxTokenBytes = 4096;
inline constexpr size_t kHelloRequestFixed = 8;
// The largest Hello request payload (a token of kMaxTokenBytes).
inline constexpr size_t kMaxHelloRequestBytes = kHelloRequestFixed + kMaxTokenBytes;
inline constexpr size_t kHelloReplyBytes = 24;
inline constexpr size_t kTableRequestFixed = 16;
inline constexpr size_t kPullReplyFixed = 8;
inline constexpr size_t kPushReplyBytes = 8;
inline constexpr size_t kErrorFixed = 8;
// A peer's error payload above kErrorFixed + kMaxErrorMessageBytes is
// malformed. Messages are cut to kSentErrorMessageBytes when encoded, so an
// Error frame fits the smallest maximum frame a server may announce.
inline constexpr size_t kMaxErrorMessageBytes = 4096;
inline constexpr size_t kSentErrorMessageBytes = kMinMaxFrameBytes - kErrorFixed;

enum class Opcode : uint8_t {
  kHello = 1,
  kPull = 2,
  kPush = 3,
  kAssign = 4,
  // Primary to standby (docs/replication.md): a table's configuration, and
  // rows and removals of one table.
  kStandbyTable = 5,
  kReplicate = 6,
  kError = 15,
};

struct FrameHeader {
  Opcode opcode = Opcode::kHello;
  uint16_t flags = 0;
  uint64_t request_id = 0;
  uint32_t payload_bytes = 0;
};

void EncodeHeader(const FrameHeader& header, uint8_t* out);
// Checks magic, version, reserved bits and the payload bound. Fills as much
// of `header` as could be read (request_id too) even on error.
Status DecodeHeader(const uint8_t* in, uint32_t max_payload_bytes, FrameHeader* header);

inline size_t PaddedNameBytes(size_t name_bytes) { return (name_bytes + 7) & ~size_t{7}; }

struct HelloRequest {
  uint32_t protocol_version = kVersion;
  std::string token;
};
struct HelloReply {
  uint32_t protocol_version = kVersion;
  uint32_t shard_index = 0;
  uint32_t num_shards = 0;
  uint32_t num_buckets = 0;
  uint32_t admin_port = 0;
  uint32_t max_frame_bytes = 0;
  // The topology part (kFlagTopology): u64 epoch (1 for a shard that began
  // as a primary, its primary's plus one for a standby that took over),
  // u32 bytes, then the addresses of its standbys, '|' between them.
  uint64_t epoch = 0;
  std::string standbys;
  // Then the layout (live re-sharding): u64 layout epoch (1 until a
  // re-shard), u32 bytes, then its shards' addresses, ',' between them (""
  // until a re-shard). Absent from replies of servers that predate it.
  uint64_t layout_epoch = 1;
  std::string layout;
  // Then u64 lineage (Shard::lineage; 0: a server that predates it). Bytes
  // after it are parts of later servers, skipped.
  uint64_t lineage = 0;
};
inline constexpr size_t kHelloTopologyFixed = 12;
inline constexpr size_t kMaxStandbysBytes = 4096;
inline constexpr size_t kHelloLayoutFixed = 12;
inline constexpr size_t kMaxLayoutBytes = 65536;

std::string EncodeHelloRequest(const HelloRequest& request);
Status DecodeHelloRequest(const uint8_t* payload, size_t bytes, HelloRequest* request);
// With `topology`, the topology part follows the fixed 24 bytes.
std::string EncodeHelloReply(const HelloReply& reply, bool topology = false);
Status DecodeHelloReply(const uint8_t* payload, size_t bytes, HelloReply* reply,
                        bool topology = false);

// The part of a Pull or Push request before the ids: fixed fields and the
// zero-padded table name.
std::string EncodePullPrefix(const std::string& table, uint32_t dim, uint32_t num_ids,
                             PullMode mode);
// With `id`, the push is identified (flags bit 0): the 16 bytes after the
// name hold the client's id and the push's sequence number, and a shard
// applies a push of an id only once (docs/replication.md).
inline constexpr uint8_t kPushIdentified = 0x1;
// With kPushPart too (flags bit 1), a part of a push a shard refused
// unapplied (a re-shard's switch), sent again under an id of its own: after
// the id, u32 count (1 to kMaxPushAncestors) and u32 0, then `count` ids
// (16 bytes each) of the pushes it was split from, oldest first. A shard
// that applied one of them answers as it did then, applying nothing
// (PushLedger::Begin).
inline constexpr uint8_t kPushPart = 0x2;
inline constexpr uint32_t kMaxPushAncestors = 16;
std::string EncodePushPrefix(const std::string& table, uint32_t dim, uint32_t num_ids,
                             float learning_rate, const PushId* id = nullptr,
                             const std::vector<PushId>* ancestors = nullptr);

// A parsed Pull or Push request; pointers point into the payload.
struct TableRequest {
  std::string table;
  uint32_t dim = 0;
  uint32_t num_ids = 0;
  PullMode mode = PullMode::kInsert;  // Pull only
  float learning_rate = 0.0f;         // Push only
  bool identified = false;            // Push only: push_id is set
  PushId push_id;
  std::vector<PushId> ancestors;  // Push only: a part's (kPushPart)
  const int64_t* ids = nullptr;
  const float* grads = nullptr;  // Push only
};
Status DecodePullRequest(const uint8_t* payload, size_t bytes, TableRequest* request);
Status DecodePushRequest(const uint8_t* payload, size_t bytes, TableRequest* request);
// Assign: Push's layout with the learning-rate word reserved (0); `grads`
// then points at the row values.
std::string EncodeAssignPrefix(const std::string& table, uint32_t dim, uint32_t num_ids);
Status DecodeAssignRequest(const uint8_t* payload, size_t bytes, TableRequest* request);

// StandbyTable: u32 action, u32 bytes, then those bytes:
//  - kMakeTable: make the table afresh, empty, replacing one of its name;
//    the bytes are its config as EncodeTableConfig's text;
//  - kDropTable: drop it (the same bytes);
//  - kRoundEnd: the round's rows are all sent; the bytes are the ids of the
//    pushes applied in it (16 bytes each). A caught-up standby applies a
//    round's rows and ids together only here;
//  - kCaughtUp: as kRoundEnd, and every table made since the last
//    kMakeTable is copied whole: the standby may take over;
//  - kSketchSlices: slices of a table's admission sketch as they are (its
//    whole copy): EncodeSketchSlices' bytes;
//  - kSketchCounts: the hashes pushes counted in a table's sketch, in order
//    (a round's): EncodeSketchCounts' bytes;
//  - kProvisional: whether a table is provisional (made before its optimizer
//    was known; Shard::CreateTable): u32 0 or 1, then the table's name;
//  - kInSync: which standbys of the primary hold every write it
//    acknowledged (docs/replication.md, "Several standbys"):
//    EncodeInSyncView's bytes;
//  - kMakeRange, kDropRange (range streams only): as kMakeTable and
//    kDropTable for the buckets [first, end) the stream carries: the table is
//    made if absent and those buckets' rows removed (EncodeRange's bytes).
// Answered with a Push reply (0 rows).
inline constexpr uint32_t kMakeTable = 0;
inline constexpr uint32_t kDropTable = 1;
inline constexpr uint32_t kCaughtUp = 2;
inline constexpr uint32_t kRoundEnd = 3;
inline constexpr uint32_t kSketchSlices = 4;
inline constexpr uint32_t kSketchCounts = 5;
inline constexpr uint32_t kProvisional = 6;
inline constexpr uint32_t kMakeRange = 7;
inline constexpr uint32_t kDropRange = 8;
inline constexpr uint32_t kInSync = 9;
struct StandbyTableRequest {
  uint32_t action = kMakeTable;
  std::string config;  // EncodeTableConfig; for kDropTable only the name matters
};
std::string EncodeStandbyTable(const StandbyTableRequest& request);
Status DecodeStandbyTable(const uint8_t* payload, size_t bytes, StandbyTableRequest* request);

// A primary's in-sync set as its ReplicaGroup tells its standbys: u64
// epoch (the primary's), u64 version (changes each time the set does; 0:
// never told), then the standbys' addresses, '|' between them.
struct InSyncView {
  uint64_t epoch = 0;
  uint64_t version = 0;
  std::string members;
};
std::string EncodeInSyncView(const InSyncView& view);
Status DecodeInSyncView(const std::string& bytes, InSyncView* view);

// A table's admission sketch on the stream (docs/replication.md), the bytes
// of a kSketchSlices or kSketchCounts StandbyTable: u32 the table name's
// length, the name, then
//  - slices: u32 counters per slice, u32 slices, then [slices] (u32 bucket,
//    u32 pushes counted since its halving), then [slices, counters] u8;
//  - counts: [n] u64 hashes.
struct SketchRequest {
  std::string table;
  uint32_t slice_counters = 0, slices = 0;
  const uint8_t* entries = nullptr;   // slices: [slices] (bucket, added) u32 pairs
  const uint8_t* counters = nullptr;  // slices: [slices, slice_counters] u8
  const uint8_t* hashes = nullptr;    // counts: [num_hashes] u64
  size_t num_hashes = 0;
};
// Bytes of a slices frame of `slices` slices.
size_t SketchSlicesBytes(size_t name_bytes, uint32_t slice_counters, size_t slices);
std::string EncodeSketchSlices(const std::string& table, uint32_t slice_counters,
                               const uint32_t* buckets, const uint32_t* added,
                               const uint8_t* counters, size_t slices);
std::string EncodeSketchCounts(const std::string& table, const uint64_t* hashes, size_t n);
// `bytes` of a StandbyTable of `action` kSketchSlices or kSketchCounts
// (pointers into `bytes`, read with memcpy).
Status DecodeSketch(uint32_t action, const std::string& bytes, SketchRequest* request);

// The bytes of a kMakeRange or kDropRange StandbyTable: u32 first, u32 end,
// then the table's config (EncodeTableConfig's text).
std::string EncodeRange(uint32_t first, uint32_t end, const std::string& config);
Status DecodeRange(const std::string& bytes, uint32_t* first, uint32_t* end, std::string* config);

// The bytes of a kProvisional StandbyTable.
std::string EncodeProvisional(const std::string& table, bool provisional);
Status DecodeProvisional(const std::string& bytes, std::string* table, bool* provisional);

// Replicate: the table prefix (as Push's; the word after the name's length
// reserved, 0) with `rows`, then u32 removed, u32 slot_floats, u64 the
// table's push clock, then ids [rows] i64, removed ids [removed] i64, steps
// [rows] u32, touched stamps [rows] u32, values [rows, dim] f32, slots
// [rows, slot_floats] f32. The standby writes the rows as they are (values,
// slots, step, stamp), removes the removed ids and takes the clock.
// Answered with a Push reply (rows written).
struct ReplicateRequest {
  std::string table;
  uint32_t dim = 0, rows = 0, removed = 0, slot_floats = 0;
  uint64_t push_clock = 0;
  const int64_t* ids = nullptr;
  const int64_t* removed_ids = nullptr;
  const uint32_t* steps = nullptr;
  const uint32_t* touched = nullptr;
  const float* values = nullptr;
  const float* slots = nullptr;
};
// Payload bytes of a Replicate request.
uint64_t ReplicateBytes(size_t name_bytes, uint64_t dim, uint64_t rows, uint64_t removed,
                        uint64_t slot_floats);
// Byte offsets of a Replicate payload's arrays, for writers that fill them
// in place.
struct ReplicateOffsets {
  size_t ids, removed_ids, steps, touched, values, slots;
};
ReplicateOffsets ReplicateLayout(size_t name_bytes, uint64_t dim, uint64_t rows, uint64_t removed);
// Writes the payload's header (everything before the ids) into `out`.
void EncodeReplicateHeader(const ReplicateRequest& request, uint8_t* out);
// Writes the payload into `out` (ReplicateBytes long).
void EncodeReplicate(const ReplicateRequest& request, uint8_t* out);
Status DecodeReplicate(const uint8_t* payload, size_t bytes, ReplicateRequest* request);

// Pull reply: u32 dim, u32 rows, then rows * dim float32.
void EncodePullReplyPrefix(uint32_t dim, uint32_t rows, uint8_t* out);
std::string EncodePushReply(uint32_t rows_applied);
std::string EncodeError(Code code, const std::string& message);
// Turns an error payload into the Status it carries; a malformed payload or a
// code outside the wire set becomes INTERNAL.
Status DecodeError(const uint8_t* payload, size_t bytes);

}  // namespace wire
}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_WIRE_H_
