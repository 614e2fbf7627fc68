// The pushes a shard applied, by id (a client's id and its push's sequence
// number): a push sent again, because its reply was lost or its primary was
// replaced by a standby, is answered with what it returned the first time
// instead of being applied twice (docs/replication.md). The row stream
// carries the ids with the rows, so a standby that takes over knows them.
#ifndef TF_DLT_NATIVE_CORE_PUSH_LEDGER_H_
#define TF_DLT_NATIVE_CORE_PUSH_LEDGER_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "native/core/status.h"

namespace dlt {

// Row streams (docs/replication.md) that may consume a shard's change logs
// and applied push ids at once: each standby's and a re-shard's range
// streams (a primary with four standbys moving its buckets to two shards of
// five processes each runs 14). Tables keep a bit per stream in a u32.
inline constexpr uint32_t kMaxStreams = 16;
static_assert(kMaxStreams <= 32, "a table's running logs are a u32 mask");

struct PushId {
  uint64_t client = 0;
  uint64_t seq = 0;
  bool operator==(const PushId& o) const { return client == o.client && seq == o.seq; }
};
static_assert(sizeof(PushId) == 16, "push ids travel as 16 bytes");

// A shared lock that a waiting exclusive holder gets before new shared
// ones (std::shared_mutex may keep a writer waiting while readers come and go).
class WriterFirstLock {
 public:
  void lock_shared();
  void unlock_shared();
  void lock();
  void unlock();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int readers_ = 0;          // guarded by mu_
  int writers_waiting_ = 0;  // guarded by mu_
  bool writer_ = false;      // guarded by mu_
};

class PushLedger {
 public:
  // Ids remembered (about 80 bytes each): a retry comes within a request
  // deadline (30 s), within this many pushes at up to ~8,000 frames/s.
  static constexpr size_t kCapacity = size_t{1} << 18;

  // Remembers up to `capacity` ids from now on (at least kCapacity). A
  // shard a re-shard prepares takes the ids of several senders, each up to
  // kCapacity: one sender's must not push another's out.
  void set_capacity(size_t capacity);
  size_t capacity() const;

  // Before applying push `id`: true when the caller applies it now (then
  // it must call End); false when it was applied before (*status: what it
  // returned). Waits while the same id is being applied by another request.
  // A part of a push a shard refused unapplied (a re-shard's switch), sent
  // again under an id of its own, names the pushes it was split from
  // (`ancestors`, `num_ancestors`): false too when one of them was applied
  // here (whole, so with this part's rows), *status what that returned. An
  // ancestor is never recorded under a part's rows: parts of one push
  // applied on one shard each stay apart.
  bool Begin(const PushId& id, Status* status, const PushId* ancestors = nullptr,
             size_t num_ancestors = 0);
  // Push `id` was applied (or failed with `status` after applying part).
  void End(const PushId& id, const Status& status);
  // A push that changed nothing (refused before applying): forgets it.
  void Abandon(const PushId& id);

  // Identified pushes hold this shared from before they apply until End;
  // the row stream holds it alone while it takes the tables' change logs
  // and TakeApplied, so it sees each push's rows and id together.
  WriterFirstLock& gate() { return gate_; }
  // While row stream `stream` (< kMaxStreams; a standby's, a re-shard's
  // range streams) tracks them, the ids End recorded since its last call;
  // caller holds gate() alone.
  void set_tracked(uint32_t stream, bool tracked);
  void TakeApplied(uint32_t stream, std::vector<PushId>* ids);
  // A standby records the ids its primary applied (as applied, OK).
  void Insert(const PushId* ids, size_t n);
  // Records as applied every push `other` finished (a re-shard's shard
  // learned them from its senders), with room for them beside kCapacity of
  // its own.
  void Absorb(PushLedger* other);
  // The newest `max` finished pushes, oldest first (a copy of every table
  // carries them, taken under gate(): a push applied before a stream
  // tracked it, or whose id a failed round took, is in the copied rows).
  void Done(size_t max, std::vector<PushId>* ids) const;
  // Forgets every finished push (a copy that stepped down dropped their
  // rows); pushes being applied stay.
  void ForgetDone();
  size_t size() const;

 private:
  // Keyed by a random secret of this process: the ids are the clients' to
  // choose, and an unkeyed hash (it was client * K ^ seq) lets one pick ids
  // that all land in one bucket of the map.
  struct Hash {
    size_t operator()(const PushId& id) const;
  };
  struct Entry {
    bool done = false;
    Status status;
  };
  void RecordLocked(const PushId& id, const Status& status);

  WriterFirstLock gate_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<PushId, Entry, Hash> entries_;  // guarded by mu_
  std::deque<PushId> order_;                         // done ids, oldest first; guarded by mu_
  size_t capacity_ = kCapacity;                      // guarded by mu_
  uint32_t tracked_ = 0;                             // streams, a bit each; guarded by mu_
  std::vector<PushId> applied_[kMaxStreams];         // guarded by mu_
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_PUSH_LEDGER_H_
