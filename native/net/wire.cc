#include "native/net/wire.h"

#include <cstring>

#include "native/core/routing.h"
#include "native/core/table_config.h"

namespace dlt {
namespace wire {
namespace {

template <typename T>
void Put(uint8_t* out, size_t offset, T value) {
  std::memcpy(out + offset, &value, sizeof(T));
}

template <typename T>
T Get(const uint8_t* in, size_t offset) {
  T value;
  std::memcpy(&value, in + offset, sizeof(T));
  return value;
}

template <typename T>
void Append(std::string* out, T value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// u32 `word`, u32 the text's length, the text: a Hello request's and a
// StandbyTable's layout.
std::string WordAndText(uint32_t word, const std::string& text) {
  std::string out;
  Append<uint32_t>(&out, word);
  Append<uint32_t>(&out, static_cast<uint32_t>(text.size()));
  out.append(text);
  return out;
}

std::string TablePrefix(const std::string& table, uint32_t dim, uint32_t num_ids, uint8_t mode,
                        float lr, const PushId* id = nullptr,
                        const std::vector<PushId>* ancestors = nullptr) {
  std::string out;
  out.reserve(kTableRequestFixed + PaddedNameBytes(table.size()) + (id ? 16 : 0) +
              (ancestors ? 8 + 16 * ancestors->size() : 0));
  Append<uint32_t>(&out, dim);
  Append<uint32_t>(&out, num_ids);
  Append<uint16_t>(&out, static_cast<uint16_t>(table.size()));
  Append<uint8_t>(&out, mode);
  Append<uint8_t>(&out, 0);
  Append<float>(&out, lr);
  out.append(table);
  out.resize(kTableRequestFixed + PaddedNameBytes(table.size()), '\0');
  if (id != nullptr) {
    Append<uint64_t>(&out, id->client);
    Append<uint64_t>(&out, id->seq);
  }
  if (ancestors != nullptr) {
    Append<uint32_t>(&out, static_cast<uint32_t>(ancestors->size()));
    Append<uint32_t>(&out, 0);
    for (const PushId& a : *ancestors) {
      Append<uint64_t>(&out, a.client);
      Append<uint64_t>(&out, a.seq);
    }
  }
  return out;
}

// Parses the common part; `row_floats_per_id` is 0 for Pull, dim for Push.
// `name`: the op errors name (Assign shares Push's layout).
Status DecodeTableRequest(const uint8_t* p, size_t bytes, bool push, TableRequest* r,
                          const char* name = nullptr) {
  const char* op = name != nullptr ? name : push ? "Push" : "Pull";
  if (bytes < kTableRequestFixed) {
    return InvalidArgument(std::string(op) + " payload of " + std::to_string(bytes) +
                           " bytes is shorter than " + "its 16-byte fixed part");
  }
  r->dim = Get<uint32_t>(p, 0);
  r->num_ids = Get<uint32_t>(p, 4);
  const uint16_t name_bytes = Get<uint16_t>(p, 8);
  const uint8_t mode = Get<uint8_t>(p, 10);
  const uint8_t reserved = Get<uint8_t>(p, 11);
  if (reserved != 0) {
    return InvalidArgument(std::string(op) + " reserved byte must be 0");
  }
  bool part = false;
  if (push) {
    if ((mode & ~(kPushIdentified | kPushPart)) != 0 || mode == kPushPart) {
      return InvalidArgument("Push flags byte must be 0, 1 or 3, got " + std::to_string(mode));
    }
    r->identified = mode & kPushIdentified;
    part = mode & kPushPart;
    r->learning_rate = Get<float>(p, 12);
  } else {
    if (mode > static_cast<uint8_t>(PullMode::kStateInsert)) {
      return InvalidArgument("Pull mode must be 0 to 4, got " + std::to_string(mode));
    }
    r->mode = static_cast<PullMode>(mode);
    if (Get<uint32_t>(p, 12) != 0) {
      return InvalidArgument("Pull reserved word must be 0");
    }
  }
  if (r->dim > kMaxDim) {
    return InvalidArgument(std::string(op) + " dim " + std::to_string(r->dim) +
                           " exceeds the maximum of " + std::to_string(kMaxDim));
  }
  const size_t id_at = kTableRequestFixed + PaddedNameBytes(name_bytes);
  size_t name_end = id_at + (r->identified ? 16 : 0);
  r->ancestors.clear();
  if (part) {
    if (bytes < name_end + 8) {
      return InvalidArgument("Push payload of " + std::to_string(bytes) +
                             " bytes ends before its ancestors' count");
    }
    const uint32_t count = Get<uint32_t>(p, name_end);
    if (count == 0 || count > kMaxPushAncestors || Get<uint32_t>(p, name_end + 4) != 0) {
      return InvalidArgument("Push ancestors: 1 to " + std::to_string(kMaxPushAncestors) +
                             " ids and a zero word, got " + std::to_string(count));
    }
    if (bytes < name_end + 8 + size_t{16} * count) {
      return InvalidArgument("Push payload of " + std::to_string(bytes) +
                             " bytes ends inside its " + std::to_string(count) + " ancestors");
    }
    for (uint32_t i = 0; i < count; ++i) {
      const size_t at = name_end + 8 + size_t{16} * i;
      r->ancestors.push_back(PushId{Get<uint64_t>(p, at), Get<uint64_t>(p, at + 8)});
    }
    name_end += 8 + size_t{16} * count;
  }
  const uint64_t row_bytes = uint64_t{8} + (push ? uint64_t{4} * r->dim : uint64_t{0});
  // Compared by division: the product of untrusted counts must never wrap.
  const bool fits = name_end <= bytes && (bytes - name_end) % row_bytes == 0 &&
                    (bytes - name_end) / row_bytes == r->num_ids;
  if (!fits) {
    const uint64_t expected = name_end + row_bytes * r->num_ids;  // dim is bounded: no wrap
    return InvalidArgument(std::string(op) + " payload is " + std::to_string(bytes) +
                           " bytes, but its header (name " + std::to_string(name_bytes) +
                           " bytes, " + std::to_string(r->num_ids) + " ids, dim " +
                           std::to_string(r->dim) + ") implies " + std::to_string(expected));
  }
  r->table.assign(reinterpret_cast<const char*>(p) + kTableRequestFixed, name_bytes);
  const size_t padded_end = id_at;
  for (size_t i = kTableRequestFixed + name_bytes; i < padded_end; ++i) {
    if (p[i] != 0) {
      return InvalidArgument(std::string(op) + " table name padding must be 0");
    }
  }
  if (r->identified) {
    r->push_id.client = Get<uint64_t>(p, padded_end);
    r->push_id.seq = Get<uint64_t>(p, padded_end + 8);
  }
  r->ids = reinterpret_cast<const int64_t*>(p + name_end);
  r->grads = push ? reinterpret_cast<const float*>(p + name_end + size_t{8} * r->num_ids) : nullptr;
  return OkStatus();
}

}  // namespace

void EncodeHeader(const FrameHeader& h, uint8_t* out) {
  Put<uint32_t>(out, 0, kMagic);
  Put<uint8_t>(out, 4, kVersion);
  Put<uint8_t>(out, 5, static_cast<uint8_t>(h.opcode));
  Put<uint16_t>(out, 6, h.flags);
  Put<uint64_t>(out, 8, h.request_id);
  Put<uint32_t>(out, 16, h.payload_bytes);
  Put<uint32_t>(out, 20, 0);
}

Status DecodeHeader(const uint8_t* in, uint32_t max_payload_bytes, FrameHeader* h) {
  h->request_id = Get<uint64_t>(in, 8);
  h->opcode = static_cast<Opcode>(Get<uint8_t>(in, 5));
  h->flags = Get<uint16_t>(in, 6);
  h->payload_bytes = Get<uint32_t>(in, 16);
  if (Get<uint32_t>(in, 0) != kMagic) {
    return InvalidArgument("bad frame magic: not a DLT frame");
  }
  if (Get<uint8_t>(in, 4) != kVersion) {
    return InvalidArgument("unsupported protocol version " + std::to_string(Get<uint8_t>(in, 4)) +
                           "; this peer speaks version " + std::to_string(kVersion));
  }
  const uint16_t allowed = h->opcode == Opcode::kHello
                               ? (kFlagResponse | kFlagReplica | kFlagTopology | kFlagMove)
                               : kFlagResponse;
  if (Get<uint32_t>(in, 20) != 0 || (h->flags & ~allowed) != 0) {
    return InvalidArgument("frame header reserved bits must be 0");
  }
  if (h->payload_bytes > max_payload_bytes) {
    return ResourceExhausted("frame payload of " + std::to_string(h->payload_bytes) +
                             " bytes exceeds the maximum of " + std::to_string(max_payload_bytes));
  }
  return OkStatus();
}

std::string EncodeHelloRequest(const HelloRequest& r) {
  return WordAndText(r.protocol_version, r.token);
}

Status DecodeHelloRequest(const uint8_t* p, size_t bytes, HelloRequest* r) {
  if (bytes < kHelloRequestFixed) {
    return InvalidArgument("Hello payload of " + std::to_string(bytes) +
                           " bytes is shorter than 8");
  }
  r->protocol_version = Get<uint32_t>(p, 0);
  const uint32_t token_bytes = Get<uint32_t>(p, 4);
  if (token_bytes > kMaxTokenBytes || kHelloRequestFixed + token_bytes != bytes) {
    return InvalidArgument("Hello token length " + std::to_string(token_bytes) +
                           " does not match its " + std::to_string(bytes) +
                           "-byte payload (tokens are at most 4096 bytes)");
  }
  r->token.assign(reinterpret_cast<const char*>(p) + kHelloRequestFixed, token_bytes);
  return OkStatus();
}

std::string EncodeHelloReply(const HelloReply& r, bool topology) {
  std::string out;
  Append<uint32_t>(&out, r.protocol_version);
  Append<uint32_t>(&out, r.shard_index);
  Append<uint32_t>(&out, r.num_shards);
  Append<uint32_t>(&out, r.num_buckets);
  Append<uint32_t>(&out, r.admin_port);
  Append<uint32_t>(&out, r.max_frame_bytes);
  if (topology) {
    Append<uint64_t>(&out, r.epoch);
    const bool fits = r.standbys.size() <= kMaxStandbysBytes;
    Append<uint32_t>(&out, fits ? static_cast<uint32_t>(r.standbys.size()) : 0);
    if (fits) out.append(r.standbys);
    Append<uint64_t>(&out, r.layout_epoch);
    const bool layout_fits = r.layout.size() <= kMaxLayoutBytes;
    Append<uint32_t>(&out, layout_fits ? static_cast<uint32_t>(r.layout.size()) : 0);
    if (layout_fits) out.append(r.layout);
    Append<uint64_t>(&out, r.lineage);
  }
  return out;
}

Status DecodeHelloReply(const uint8_t* p, size_t bytes, HelloReply* r, bool topology) {
  const size_t fixed = kHelloReplyBytes + (topology ? kHelloTopologyFixed : 0);
  const auto malformed = [&] {
    return Internal("Hello reply of " + std::to_string(bytes) + " bytes is malformed");
  };
  if (bytes < fixed || (!topology && bytes != fixed)) return malformed();
  r->layout_epoch = 1;
  r->layout.clear();
  r->lineage = 0;
  if (topology) {
    r->epoch = Get<uint64_t>(p, kHelloReplyBytes);
    const size_t standbys = Get<uint32_t>(p, kHelloReplyBytes + 8);
    if (bytes - fixed < standbys) return malformed();
    r->standbys.assign(reinterpret_cast<const char*>(p) + fixed, standbys);
    // The layout part, when the server has one.
    const size_t at = fixed + standbys;
    if (bytes != at) {
      if (bytes - at < kHelloLayoutFixed ||
          bytes - at - kHelloLayoutFixed < Get<uint32_t>(p, at + 8)) {
        return malformed();
      }
      const size_t layout = Get<uint32_t>(p, at + 8);
      r->layout_epoch = Get<uint64_t>(p, at);
      r->layout.assign(reinterpret_cast<const char*>(p) + at + kHelloLayoutFixed, layout);
      // The lineage, when the server has one; what follows it is skipped.
      const size_t lineage_at = at + kHelloLayoutFixed + layout;
      if (bytes != lineage_at) {
        if (bytes - lineage_at < 8) return malformed();
        r->lineage = Get<uint64_t>(p, lineage_at);
      }
    }
  }
  r->protocol_version = Get<uint32_t>(p, 0);
  r->shard_index = Get<uint32_t>(p, 4);
  r->num_shards = Get<uint32_t>(p, 8);
  r->num_buckets = Get<uint32_t>(p, 12);
  r->admin_port = Get<uint32_t>(p, 16);
  r->max_frame_bytes = Get<uint32_t>(p, 20);
  if (r->max_frame_bytes < kMinMaxFrameBytes) {
    // No shard takes frames this small: a client would split every call
    // into frames of nothing (0 bytes: none would ever be sent).
    return Internal("Hello reply announces a largest frame of " +
                    std::to_string(r->max_frame_bytes) + " bytes, below the protocol's least, " +
                    std::to_string(kMinMaxFrameBytes));
  }
  return OkStatus();
}

std::string EncodePullPrefix(const std::string& table, uint32_t dim, uint32_t num_ids,
                             PullMode mode) {
  return TablePrefix(table, dim, num_ids, static_cast<uint8_t>(mode), 0.0f);
}

std::string EncodePushPrefix(const std::string& table, uint32_t dim, uint32_t num_ids,
                             float learning_rate, const PushId* id,
                             const std::vector<PushId>* ancestors) {
  if (ancestors != nullptr && (id == nullptr || ancestors->empty())) ancestors = nullptr;
  const uint8_t flags = (id ? kPushIdentified : 0) | (ancestors ? kPushPart : 0);
  return TablePrefix(table, dim, num_ids, flags, learning_rate, id, ancestors);
}

Status DecodePullRequest(const uint8_t* p, size_t bytes, TableRequest* r) {
  return DecodeTableRequest(p, bytes, /*push=*/false, r);
}

Status DecodePushRequest(const uint8_t* p, size_t bytes, TableRequest* r) {
  return DecodeTableRequest(p, bytes, /*push=*/true, r);
}

std::string EncodeAssignPrefix(const std::string& table, uint32_t dim, uint32_t num_ids) {
  return TablePrefix(table, dim, num_ids, 0, 0.0f);
}

Status DecodeAssignRequest(const uint8_t* p, size_t bytes, TableRequest* r) {
  if (bytes > 10 && p[10] != 0) return InvalidArgument("Assign flags byte must be 0");
  DLT_RETURN_IF_ERROR(DecodeTableRequest(p, bytes, /*push=*/true, r, "Assign"));
  uint32_t reserved;
  std::memcpy(&reserved, p + 12, sizeof(reserved));
  if (reserved != 0) return InvalidArgument("Assign reserved word must be 0");
  if (r->identified) return InvalidArgument("Assign flags byte must be 0");
  return OkStatus();
}

std::string EncodeStandbyTable(const StandbyTableRequest& r) {
  return WordAndText(r.action, r.config);
}

Status DecodeStandbyTable(const uint8_t* p, size_t bytes, StandbyTableRequest* r) {
  if (bytes < 8) return InvalidArgument("StandbyTable payload is shorter than 8 bytes");
  r->action = Get<uint32_t>(p, 0);
  if (r->action > kInSync) {
    return InvalidArgument("StandbyTable action must be 0 to 9, got " + std::to_string(r->action));
  }
  if (uint64_t{8} + Get<uint32_t>(p, 4) != bytes) {
    return InvalidArgument("StandbyTable config length does not match its payload");
  }
  r->config.assign(reinterpret_cast<const char*>(p) + 8, bytes - 8);
  return OkStatus();
}

std::string EncodeInSyncView(const InSyncView& view) {
  std::string out;
  Append<uint64_t>(&out, view.epoch);
  Append<uint64_t>(&out, view.version);
  out.append(view.members);
  return out;
}

Status DecodeInSyncView(const std::string& bytes, InSyncView* view) {
  if (bytes.size() < 16) return InvalidArgument("an in-sync view is shorter than 16 bytes");
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  view->epoch = Get<uint64_t>(p, 0);
  view->version = Get<uint64_t>(p, 8);
  view->members.assign(bytes, 16, std::string::npos);
  return OkStatus();
}

size_t SketchSlicesBytes(size_t name_bytes, uint32_t slice_counters, size_t slices) {
  return 12 + name_bytes + slices * (8 + size_t{slice_counters});
}

std::string EncodeSketchSlices(const std::string& table, uint32_t slice_counters,
                               const uint32_t* buckets, const uint32_t* added,
                               const uint8_t* counters, size_t slices) {
  std::string out;
  out.reserve(SketchSlicesBytes(table.size(), slice_counters, slices));
  Append<uint32_t>(&out, static_cast<uint32_t>(table.size()));
  out.append(table);
  Append<uint32_t>(&out, slice_counters);
  Append<uint32_t>(&out, static_cast<uint32_t>(slices));
  for (size_t i = 0; i < slices; ++i) {
    Append<uint32_t>(&out, buckets[i]);
    Append<uint32_t>(&out, added[i]);
  }
  out.append(reinterpret_cast<const char*>(counters), slices * size_t{slice_counters});
  return out;
}

std::string EncodeSketchCounts(const std::string& table, const uint64_t* hashes, size_t n) {
  std::string out;
  Append<uint32_t>(&out, static_cast<uint32_t>(table.size()));
  out.append(table);
  out.append(reinterpret_cast<const char*>(hashes), n * sizeof(uint64_t));
  return out;
}

Status DecodeSketch(uint32_t action, const std::string& bytes, SketchRequest* r) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  if (bytes.size() < 4 || bytes.size() - 4 < Get<uint32_t>(p, 0)) {
    return InvalidArgument("a sketch frame's table name runs past its bytes");
  }
  const size_t name = Get<uint32_t>(p, 0);
  r->table.assign(bytes.data() + 4, name);
  const size_t at = 4 + name, rest = bytes.size() - at;
  if (action == kSketchCounts) {
    if (rest % 8 != 0) return InvalidArgument("a sketch counts frame holds whole u64 hashes");
    r->hashes = p + at;
    r->num_hashes = rest / 8;
    return OkStatus();
  }
  if (rest < 8) return InvalidArgument("a sketch slices frame is shorter than its counts");
  r->slice_counters = Get<uint32_t>(p, at);
  r->slices = Get<uint32_t>(p, at + 4);
  // Slices bounded first, so the product cannot wrap (a frame near 4 GiB).
  if (r->slices > (rest - 8) / 8 ||
      uint64_t{r->slices} * (8 + uint64_t{r->slice_counters}) != rest - 8) {
    return InvalidArgument("a sketch slices frame's counts do not match its bytes");
  }
  r->entries = p + at + 8;
  r->counters = r->entries + size_t{r->slices} * 8;
  return OkStatus();
}

std::string EncodeRange(uint32_t first, uint32_t end, const std::string& config) {
  std::string out;
  Append<uint32_t>(&out, first);
  Append<uint32_t>(&out, end);
  return out + config;
}

Status DecodeRange(const std::string& bytes, uint32_t* first, uint32_t* end, std::string* config) {
  if (bytes.size() < 8) return InvalidArgument("a bucket range is u32 first, u32 end, a config");
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  *first = Get<uint32_t>(p, 0);
  *end = Get<uint32_t>(p, 4);
  if (*first >= *end || *end > kNumBuckets) {
    return InvalidArgument("bucket range [" + std::to_string(*first) + ", " + std::to_string(*end) +
                           ") is not within [0, " + std::to_string(kNumBuckets) + ")");
  }
  config->assign(bytes, 8, std::string::npos);
  return OkStatus();
}

std::string EncodeProvisional(const std::string& table, bool provisional) {
  std::string out;
  Append<uint32_t>(&out, provisional ? 1 : 0);
  return out + table;
}

Status DecodeProvisional(const std::string& bytes, std::string* table, bool* provisional) {
  const uint32_t flag =
      bytes.size() < 4 ? 2 : Get<uint32_t>(reinterpret_cast<const uint8_t*>(bytes.data()), 0);
  if (flag > 1) {
    return InvalidArgument("a provisional flag is a u32 0 or 1, then the table's name");
  }
  *provisional = flag == 1;
  table->assign(bytes, 4, std::string::npos);
  return OkStatus();
}

uint64_t ReplicateBytes(size_t name_bytes, uint64_t dim, uint64_t rows, uint64_t removed,
                        uint64_t slot_floats) {
  return kTableRequestFixed + PaddedNameBytes(name_bytes) + 16 + 8 * (rows + removed) +
         rows * (8 + 4 * (dim + slot_floats));
}

ReplicateOffsets ReplicateLayout(size_t name_bytes, uint64_t dim, uint64_t rows, uint64_t removed) {
  ReplicateOffsets at;
  at.ids = kTableRequestFixed + PaddedNameBytes(name_bytes) + 16;
  at.removed_ids = at.ids + 8 * rows;
  at.steps = at.removed_ids + 8 * removed;
  at.touched = at.steps + 4 * rows;
  at.values = at.touched + 4 * rows;
  at.slots = at.values + 4 * rows * dim;
  return at;
}

void EncodeReplicateHeader(const ReplicateRequest& r, uint8_t* out) {
  const std::string prefix = TablePrefix(r.table, r.dim, r.rows, 0, 0.0f);
  std::memcpy(out, prefix.data(), prefix.size());
  const size_t at = prefix.size();
  Put<uint32_t>(out, at, r.removed);
  Put<uint32_t>(out, at + 4, r.slot_floats);
  Put<uint64_t>(out, at + 8, r.push_clock);
}

void EncodeReplicate(const ReplicateRequest& r, uint8_t* out) {
  EncodeReplicateHeader(r, out);
  const ReplicateOffsets at = ReplicateLayout(r.table.size(), r.dim, r.rows, r.removed);
  const auto put = [&](size_t offset, const void* data, size_t bytes) {
    if (bytes) std::memcpy(out + offset, data, bytes);
  };
  put(at.ids, r.ids, size_t{8} * r.rows);
  put(at.removed_ids, r.removed_ids, size_t{8} * r.removed);
  put(at.steps, r.steps, size_t{4} * r.rows);
  put(at.touched, r.touched, size_t{4} * r.rows);
  put(at.values, r.values, size_t{4} * r.rows * r.dim);
  put(at.slots, r.slots, size_t{4} * r.rows * r.slot_floats);
}

Status DecodeReplicate(const uint8_t* p, size_t bytes, ReplicateRequest* r) {
  if (bytes < kTableRequestFixed + 16) {
    return InvalidArgument("Replicate payload of " + std::to_string(bytes) + " bytes is too short");
  }
  r->dim = Get<uint32_t>(p, 0);
  r->rows = Get<uint32_t>(p, 4);
  const uint16_t name_bytes = Get<uint16_t>(p, 8);
  if (Get<uint16_t>(p, 10) != 0 || Get<uint32_t>(p, 12) != 0) {
    return InvalidArgument("Replicate reserved fields must be 0");
  }
  if (r->dim > kMaxDim) {
    return InvalidArgument("Replicate dim " + std::to_string(r->dim) + " exceeds the maximum of " +
                           std::to_string(kMaxDim));
  }
  const size_t name_end = kTableRequestFixed + PaddedNameBytes(name_bytes);
  if (name_end + 16 > bytes) return InvalidArgument("Replicate payload ends inside its header");
  r->removed = Get<uint32_t>(p, name_end);
  r->slot_floats = Get<uint32_t>(p, name_end + 4);
  r->push_clock = Get<uint64_t>(p, name_end + 8);
  if (r->slot_floats > 2 * kMaxDim) {
    return InvalidArgument("Replicate slot floats " + std::to_string(r->slot_floats) +
                           " exceed two per value");
  }
  // All counts are 32-bit and dim is bounded: the sum cannot wrap in 64 bits.
  if (ReplicateBytes(name_bytes, r->dim, r->rows, r->removed, r->slot_floats) != bytes) {
    return InvalidArgument(
        "Replicate payload is " + std::to_string(bytes) + " bytes, but its header (" +
        std::to_string(r->rows) + " rows, " + std::to_string(r->removed) + " removed, dim " +
        std::to_string(r->dim) + ", " + std::to_string(r->slot_floats) + " slot floats) implies " +
        std::to_string(ReplicateBytes(name_bytes, r->dim, r->rows, r->removed, r->slot_floats)));
  }
  r->table.assign(reinterpret_cast<const char*>(p) + kTableRequestFixed, name_bytes);
  for (size_t i = kTableRequestFixed + name_bytes; i < name_end; ++i) {
    if (p[i] != 0) return InvalidArgument("Replicate table name padding must be 0");
  }
  const ReplicateOffsets at = ReplicateLayout(name_bytes, r->dim, r->rows, r->removed);
  r->ids = reinterpret_cast<const int64_t*>(p + at.ids);
  r->removed_ids = reinterpret_cast<const int64_t*>(p + at.removed_ids);
  r->steps = reinterpret_cast<const uint32_t*>(p + at.steps);
  r->touched = reinterpret_cast<const uint32_t*>(p + at.touched);
  r->values = reinterpret_cast<const float*>(p + at.values);
  r->slots = reinterpret_cast<const float*>(p + at.slots);
  return OkStatus();
}

void EncodePullReplyPrefix(uint32_t dim, uint32_t rows, uint8_t* out) {
  Put<uint32_t>(out, 0, dim);
  Put<uint32_t>(out, 4, rows);
}

std::string EncodePushReply(uint32_t rows_applied) {
  std::string out;
  Append<uint32_t>(&out, rows_applied);
  Append<uint32_t>(&out, 0);
  return out;
}

std::string EncodeError(Code code, const std::string& message) {
  std::string text = message;
  if (text.size() > kSentErrorMessageBytes) {
    const std::string cut = " [...]";
    text.resize(kSentErrorMessageBytes - cut.size());
    // Never end inside a UTF-8 sequence.
    while (!text.empty() && (static_cast<uint8_t>(text.back()) & 0xc0) == 0x80) text.pop_back();
    if (!text.empty() && (static_cast<uint8_t>(text.back()) & 0x80)) text.pop_back();
    text += cut;
  }
  std::string out;
  Append<uint32_t>(&out, static_cast<uint32_t>(code));
  Append<uint32_t>(&out, static_cast<uint32_t>(text.size()));
  out.append(text);
  return out;
}

Status DecodeError(const uint8_t* p, size_t bytes) {
  if (bytes < kErrorFixed || bytes > kErrorFixed + kMaxErrorMessageBytes) {
    return Internal("malformed error frame from peer");
  }
  const uint32_t code = Get<uint32_t>(p, 0);
  const uint32_t length = Get<uint32_t>(p, 4);
  if (kErrorFixed + uint64_t{length} != bytes) {
    return Internal("malformed error frame from peer");
  }
  std::string message(reinterpret_cast<const char*>(p) + kErrorFixed, length);
  if (!IsWireCode(code)) {
    return Internal("peer sent error code " + std::to_string(code) + ": " + message);
  }
  return Status(static_cast<Code>(code), message);
}

}  // namespace wire
}  // namespace dlt
