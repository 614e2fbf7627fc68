// The receiving side of range streams (live re-sharding,
// docs/replication.md): the shard of the next layout this process prepares
// while it serves its current one. Every old owner of some of its buckets
// streams them here (a Replicator with ReplicatorOptions::range_stream): it
// makes each table for its bucket range, copies the range's rows, then sends
// their changes in rounds with the ids of the pushes it applied. Frames are
// applied as they come: the re-shard's switch waits until every stream ran a
// last round after writes stopped, so the prepared shard is whole then.
#ifndef TF_DLT_NATIVE_NET_RESHARD_TARGET_H_
#define TF_DLT_NATIVE_NET_RESHARD_TARGET_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "native/core/shard.h"
#include "native/core/status.h"
#include "native/net/wire.h"

namespace dlt {

class ReshardTarget {
 public:
  // Takes `next` (empty; made by the caller, with its memory policy) as the
  // shard being prepared, replacing one prepared before; returns its
  // generation (> 0). Streams to an earlier one are refused from now on.
  uint64_t Prepare(std::shared_ptr<Shard> next);
  // Drops the shard being prepared (a re-shard aborted, or switched to it).
  void Clear();
  // The shard being prepared (null: none) and its generation.
  std::shared_ptr<Shard> next(uint64_t* generation = nullptr) const;

  // A range stream's Hello: FAILED_PRECONDITION when no shard is being
  // prepared; otherwise the generation its frames must name.
  Status Greet(uint64_t* generation, uint32_t* shard_index, uint32_t* num_shards) const;
  // Applies a range stream's StandbyTable or Replicate frame on a
  // connection that greeted `generation`; *rows counts a Replicate's rows.
  // FAILED_PRECONDITION (*stale) for a connection greeting another
  // generation: its frames never reach the shard prepared now.
  Status Apply(const wire::FrameHeader& header, const uint8_t* payload, uint64_t generation,
               uint32_t* rows, bool* stale);

 private:
  Status ApplyTable(const wire::StandbyTableRequest& request, Shard* next);
  using Range = std::pair<uint32_t, uint32_t>;  // buckets [first, end)
  mutable std::mutex mu_;
  std::shared_ptr<Shard> next_;  // guarded by mu_
  uint64_t generation_ = 0;      // guarded by mu_
  // The bucket ranges each table was made for by its senders; guarded by mu_.
  std::map<std::string, std::set<Range>> ranges_;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_RESHARD_TARGET_H_
