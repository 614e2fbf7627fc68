// Writing a row stream's frames into a shard (docs/replication.md): the
// rows and removals of a Replicate frame, and a table's admission sketch
// slices and counts. Shared by a standby (its primary's whole shard) and by
// the shard a re-shard prepares (bucket ranges of several old owners).
#ifndef TF_DLT_NATIVE_NET_STREAM_APPLY_H_
#define TF_DLT_NATIVE_NET_STREAM_APPLY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "native/core/push_ledger.h"
#include "native/core/shard.h"
#include "native/core/status.h"
#include "native/net/wire.h"

namespace dlt {

// What a Replicate frame's push clock does to its table: nothing (a
// standby's round sets it once its rows are in), take it, or raise the
// table's to it (several senders, each with its own clock).
enum class PushClock : uint8_t { kKeep, kTake, kRaise };

// Each function below writes into `shard`'s table of the frame's name or,
// given `into`, into that table (one made for `shard` and not installed
// yet: a caught-up standby's copy of a replaced table, until its round ends).

// Writes the frame's rows and removals; every row must route to `shard`
// (INVALID_ARGUMENT otherwise).
Status ApplyRows(Shard* shard, const wire::ReplicateRequest& request, PushClock clock,
                 std::shared_ptr<Table> into = nullptr);

// Writes a sketch frame's slices or counts (wire::kSketchSlices,
// wire::kSketchCounts).
Status ApplySketch(Shard* shard, uint32_t action, const std::string& bytes,
                   std::shared_ptr<Table> into = nullptr);

// Sets the provisional flag a kProvisional frame's bytes name.
Status ApplyProvisional(Shard* shard, const std::string& bytes,
                        std::shared_ptr<Table> into = nullptr);

// The bytes of a round's end (kRoundEnd, kCaughtUp): the sender's epoch and
// the ids of the pushes applied in the round.
Status DecodeRoundEnd(const std::string& bytes, uint64_t* epoch, std::vector<PushId>* ids);

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_STREAM_APPLY_H_
