#include "native/net/reshard_target.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "native/core/push_ledger.h"
#include "native/core/table_config.h"
#include "native/net/stream_apply.h"

namespace dlt {

uint64_t ReshardTarget::Prepare(std::shared_ptr<Shard> next) {
  // Each sender's copy carries up to kCapacity ids of pushes it applied.
  next->push_ledger().set_capacity(PushLedger::kCapacity * kMaxStreams);
  std::lock_guard<std::mutex> lock(mu_);
  next_ = std::move(next);
  ranges_.clear();
  return ++generation_;
}

void ReshardTarget::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  next_.reset();
  ranges_.clear();
  ++generation_;
}

std::shared_ptr<Shard> ReshardTarget::next(uint64_t* generation) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (generation != nullptr) *generation = generation_;
  return next_;
}

Status ReshardTarget::Greet(uint64_t* generation, uint32_t* shard_index,
                            uint32_t* num_shards) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (next_ == nullptr) {
    return FailedPrecondition(
        "this shard prepares no shard of a next layout: it takes no range stream");
  }
  *generation = generation_;
  *shard_index = next_->shard_index();
  *num_shards = next_->num_shards();
  return OkStatus();
}

Status ReshardTarget::Apply(const wire::FrameHeader& header, const uint8_t* payload,
                            uint64_t generation, uint32_t* rows, bool* stale) {
  std::shared_ptr<Shard> next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (generation == generation_) next = next_;
  }
  if (next == nullptr) {
    *stale = true;
    return FailedPrecondition(
        "a range stream to a shard this process no longer prepares: refused, and the connection "
        "closed");
  }
  if (header.opcode == wire::Opcode::kStandbyTable) {
    wire::StandbyTableRequest request;
    DLT_RETURN_IF_ERROR(wire::DecodeStandbyTable(payload, header.payload_bytes, &request));
    return ApplyTable(request, next.get());
  }
  wire::ReplicateRequest replicate;
  DLT_RETURN_IF_ERROR(wire::DecodeReplicate(payload, header.payload_bytes, &replicate));
  *rows = replicate.rows;
  return ApplyRows(next.get(), replicate, PushClock::kRaise);
}

Status ReshardTarget::ApplyTable(const wire::StandbyTableRequest& request, Shard* next) {
  switch (request.action) {
    case wire::kRoundEnd:
    case wire::kCaughtUp: {
      // The ids of the pushes the sender applied: a push sent again to this
      // shard once it serves is applied once.
      uint64_t epoch;
      std::vector<PushId> ids;
      DLT_RETURN_IF_ERROR(DecodeRoundEnd(request.config, &epoch, &ids));
      next->push_ledger().Insert(ids.data(), ids.size());
      return OkStatus();
    }
    case wire::kProvisional:
      return ApplyProvisional(next, request.config);
    case wire::kSketchSlices:
    case wire::kSketchCounts:
      return ApplySketch(next, request.action, request.config);
    case wire::kMakeRange:
    case wire::kDropRange:
      break;
    default:
      return InvalidArgument(
          "a range stream makes and drops bucket ranges (actions 7 and 8); "
          "it sent action " +
          std::to_string(request.action));
  }
  uint32_t first, end;
  std::string bytes;
  DLT_RETURN_IF_ERROR(wire::DecodeRange(request.config, &first, &end, &bytes));
  if (first < next->first_bucket() || end > next->end_bucket()) {
    return InvalidArgument("buckets [" + std::to_string(first) + ", " + std::to_string(end) +
                           ") are not all shard " + std::to_string(next->shard_index()) + " of " +
                           std::to_string(next->num_shards()) + "'s");
  }
  TableConfig config;
  DLT_RETURN_IF_ERROR(DecodeTableConfig(bytes, &config));
  std::shared_ptr<Table> table;
  const Range range{first, end};
  if (request.action == wire::kDropRange) {
    // Every sender drops its range of a table dropped on its shard; the
    // table goes with the last range made.
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = ranges_.find(config.name);
      if (it == ranges_.end() || it->second.erase(range) == 0) return OkStatus();
      last = it->second.empty();
      if (last) ranges_.erase(it);
    }
    Status erased;
    if (next->GetTable(config.name, &table).ok())
      table->EraseBuckets(first, end, nullptr, 0, &erased);
    DLT_RETURN_IF_ERROR(erased);
    if (!last) return OkStatus();
    const Status dropped = next->DropTable(config.name);
    return dropped.code() == Code::kNotFound ? OkStatus() : dropped;
  }
  DLT_RETURN_IF_ERROR(ValidateTableConfig(config));
  bool created;
  DLT_RETURN_IF_ERROR(next->CreateTable(config, &created));
  DLT_RETURN_IF_ERROR(next->GetTable(config.name, &table));
  // Rows of an earlier copy of this range (the sender copies it afresh).
  Status erased;
  table->EraseBuckets(first, end, nullptr, 0, &erased);
  DLT_RETURN_IF_ERROR(erased);
  std::lock_guard<std::mutex> lock(mu_);
  ranges_[config.name].insert(range);
  return OkStatus();
}

}  // namespace dlt
