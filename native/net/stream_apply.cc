#include "native/net/stream_apply.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dlt {

namespace {

// `into`, or `shard`'s table named `name`.
Status Target(Shard* shard, const std::string& name, std::shared_ptr<Table> into,
              std::shared_ptr<Table>* table) {
  if (into == nullptr) return shard->GetTable(name, table);
  *table = std::move(into);
  return OkStatus();
}

}  // namespace

Status ApplyRows(Shard* shard, const wire::ReplicateRequest& request, PushClock clock,
                 std::shared_ptr<Table> into) {
  std::shared_ptr<Table> table;
  DLT_RETURN_IF_ERROR(Target(shard, request.table, std::move(into), &table));
  if (request.dim != table->dim() || request.slot_floats != table->slot_floats()) {
    return InvalidArgument(
        "table '" + request.table + "' has dim " + std::to_string(table->dim()) + " and " +
        std::to_string(table->slot_floats()) + " slot floats per row; the sender sent dim " +
        std::to_string(request.dim) + " and " + std::to_string(request.slot_floats));
  }
  DLT_RETURN_IF_ERROR(shard->CheckOwnership(request.ids, request.rows));
  DLT_RETURN_IF_ERROR(shard->CheckOwnership(request.removed_ids, request.removed));
  if (request.rows) {
    // A copy of the sender's rows: what passes max_rows is the sender's
    // to evict (its removals follow). Trimmed here, a standby of a shard
    // that loaded past max_rows lost the rows it took over with.
    DLT_RETURN_IF_ERROR(table
                            ->Import(request.ids, request.values,
                                     request.slot_floats ? request.slots : nullptr, request.steps,
                                     request.rows, request.touched,
                                     /*to_disk=*/true, /*evict=*/false)
                            .WithContext("table '" + request.table + "'"));
  }
  if (request.removed) {
    Status erased;
    table->Erase(request.removed_ids, request.removed, &erased);
    DLT_RETURN_IF_ERROR(erased.WithContext("table '" + request.table + "'"));
  }
  const auto sent = static_cast<uint32_t>(request.push_clock);
  if (clock == PushClock::kTake) table->SetPushClock(sent);
  if (clock == PushClock::kRaise) table->RaisePushClock(sent);
  return OkStatus();
}

Status ApplySketch(Shard* shard, uint32_t action, const std::string& bytes,
                   std::shared_ptr<Table> into) {
  wire::SketchRequest r;
  DLT_RETURN_IF_ERROR(wire::DecodeSketch(action, bytes, &r));
  std::shared_ptr<Table> table;
  DLT_RETURN_IF_ERROR(Target(shard, r.table, std::move(into), &table));
  if (action == wire::kSketchCounts) {
    std::vector<uint64_t> hashes(r.num_hashes);
    if (!hashes.empty()) std::memcpy(hashes.data(), r.hashes, hashes.size() * sizeof(uint64_t));
    return table->CountInSketch(hashes.data(), hashes.size()).WithContext("from the sender");
  }
  if (!table->has_sketch() || r.slice_counters != table->sketch_slice_bytes()) {
    return InvalidArgument("table '" + r.table + "' here has sketch slices of " +
                           std::to_string(table->sketch_slice_bytes()) +
                           " counters; the sender sent " + std::to_string(r.slice_counters));
  }
  for (uint32_t i = 0; i < r.slices; ++i) {
    uint32_t bucket, added;
    std::memcpy(&bucket, r.entries + size_t{i} * 8, 4);
    std::memcpy(&added, r.entries + size_t{i} * 8 + 4, 4);
    if (!table->SketchHolds(bucket, bucket + 1)) {
      return InvalidArgument("table '" + r.table + "': a sketch slice of bucket " +
                             std::to_string(bucket) + ", which this shard does not hold");
    }
    table->WriteSketch(bucket, r.counters + size_t{i} * r.slice_counters, added);
  }
  return OkStatus();
}

Status ApplyProvisional(Shard* shard, const std::string& bytes, std::shared_ptr<Table> into) {
  std::string name;
  bool provisional;
  DLT_RETURN_IF_ERROR(wire::DecodeProvisional(bytes, &name, &provisional));
  std::shared_ptr<Table> table;
  DLT_RETURN_IF_ERROR(Target(shard, name, std::move(into), &table));
  table->set_provisional(provisional);
  return OkStatus();
}

Status DecodeRoundEnd(const std::string& bytes, uint64_t* epoch, std::vector<PushId>* ids) {
  if (bytes.size() < 8 || (bytes.size() - 8) % sizeof(PushId) != 0) {
    return InvalidArgument("a round's end holds the sender's epoch and 16 bytes a push id");
  }
  std::memcpy(epoch, bytes.data(), sizeof(*epoch));
  ids->resize((bytes.size() - 8) / sizeof(PushId));
  if (!ids->empty()) std::memcpy(ids->data(), bytes.data() + 8, ids->size() * sizeof(PushId));
  return OkStatus();
}

}  // namespace dlt
