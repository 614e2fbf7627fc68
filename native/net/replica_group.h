// A primary's standbys (docs/replication.md, "Several standbys"): one
// Replicator per standby, and the write listener a primary's writes wait
// on. In sync mode a write is acknowledged once every standby of the
// in-sync set applied it: the standbys whose round copying every table took
// its changes (they join at that take, under the push gate), with no round
// failed on since. A standby a round fails on (or that outlasts the I/O
// timeout) leaves the set, and the set's new version reaches every standby
// left before a write is acknowledged without it: each acknowledging round
// tells the standby the set as it is then. So the newest set any standby
// was told names only standbys holding every write acknowledged, and a
// standby left out of it knows that it is not to take over
// (tf_dlt/server/replication.py chooses who does). While the set is empty
// (none caught up yet, or the last one failed) a write is acknowledged once
// one standby applied it: none is acknowledged that no standby holds.
#ifndef TF_DLT_NATIVE_NET_REPLICA_GROUP_H_
#define TF_DLT_NATIVE_NET_REPLICA_GROUP_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "native/core/shard.h"
#include "native/core/status.h"
#include "native/net/replicator.h"
#include "native/net/request_handler.h"
#include "native/net/wire.h"

namespace dlt {

class ReplicaGroup : public WriteListener {
 public:
  // At most this many standbys (each takes one of the shard's row streams,
  // which re-shards need too).
  static constexpr size_t kMaxStandbys = 4;

  // `options`: every standby's replicator's (its view and on_failure are
  // the group's). A standby down (not connected) for `detach_after_ms` is
  // detached, but never the last one: it leaves the primary's Hello, so the
  // other standbys stop waiting for its answer when they choose who takes
  // over; it attaches again when it is back (tf_dlt/server/replication.py).
  ReplicaGroup(std::shared_ptr<Shard> shard, ReplicatorOptions options,
               int detach_after_ms = 60000);
  ~ReplicaGroup() override;
  ReplicaGroup(const ReplicaGroup&) = delete;
  ReplicaGroup& operator=(const ReplicaGroup&) = delete;

  // Replicates to the standby at `address` from now on (a standby attached
  // again, say after a restart, replaces its old replicator: its copy
  // begins afresh). FAILED_PRECONDITION past kMaxStandbys.
  Status Attach(const std::string& address);
  // Stops replicating to `address`; false when it was not attached.
  bool Detach(const std::string& address);
  // Stops every replicator. Idempotent.
  void Stop();

  uint64_t Applied() override;
  Status Written(uint64_t mark) override { return WrittenWithin(mark, 0); }
  // Returns once the standbys a write waits on (as Written) applied a round
  // that began after this call, so they hold every table as it is now: a
  // load's tables, a table made or dropped (the admin plane's writes,
  // outside the push gate, hence the round after the next to take
  // changes). At most `timeout_ms` for each standby; OK at once with no
  // standby. In async mode every standby attached is waited for (its
  // first failure returned), in-sync set or not: an async primary's
  // admin-plane writes wait as a sync one's, its pushes do not.
  Status Hold(int timeout_ms);
  // Pauses (or resumes) every standby's stream; the first error.
  Status Pause(bool pause);
  // Every standby's replicator follows the swap (Replicator::Follow), the
  // swap made once.
  void Follow(const std::vector<std::shared_ptr<Table>>& first,
              const std::function<std::vector<std::shared_ptr<Table>>()>& swap) override;

  std::vector<ReplicationStatus> statuses() const;
  // The standbys' addresses in the order they attached, '|' between them
  // (the primary's Hello names them).
  std::string addresses() const;
  std::string standbys() const override { return addresses(); }
  wire::InSyncView view() const;

 private:
  using Member = std::shared_ptr<Replicator>;
  // Written, each standby waited for at most timeout_ms (0: the write timeout).
  Status WrittenWithin(uint64_t mark, int timeout_ms);
  // Hold in async mode: each standby attached, Replicator::Held.
  Status HeldByAll(uint64_t mark, int timeout_ms);
  // A write's marks: the round each member takes changes in next, or
  // `later` rounds after it (Applied: 0; Hold: 1).
  uint64_t Mark(uint64_t later);
  struct Attached {
    std::string address;
    uint64_t id;  // this replicator's (a standby attached again gets a new one)
    Member replicator;
    uint64_t joins = 0;  // times it joined the in-sync set
  };
  // The view each round of replicator `id` tells; `joining`: at the take
  // of its round that copies every table, its standby counts from now on.
  wire::InSyncView ViewFor(uint64_t id, bool joining);
  // Replicator `id`'s standby is out of the in-sync set (a new version
  // when it was in). A replicator replaced or detached since changes
  // nothing; with `joins`, neither does one that joined again since.
  void Leave(uint64_t id, uint64_t joins = ~uint64_t{0});
  // Detaches the standbys down for detach_after_ms (at most once a second);
  // returns their replicators, to be stopped outside mu_. mu_ held.
  std::vector<Member> PruneLocked();
  void LeaveLocked(const std::string& address);  // mu_ held
  std::vector<Member> MembersLocked() const;     // mu_ held
  std::vector<Attached> Snapshot() const;        // takes mu_: members_ now
  // The member replicator `id` is, or members_.end(). mu_ held.
  std::vector<Attached>::iterator ByIdLocked(uint64_t id);
  bool InSyncLocked(const std::string& address) const;  // mu_ held
  std::string AddressesLocked() const;                  // mu_ held
  wire::InSyncView ViewLocked() const;                  // mu_ held
  void FollowFrom(size_t index, const std::vector<Member>& members,
                  const std::vector<std::shared_ptr<Table>>& first,
                  const std::function<std::vector<std::shared_ptr<Table>>()>& swap,
                  std::vector<std::shared_ptr<Table>>* tables);

  const std::shared_ptr<Shard> shard_;
  const ReplicatorOptions options_;
  const int detach_after_ms_;

  // A write's marks, one per member then, kept in a ring (a write that
  // waits longer than kMarks later writes takes each member's next round).
  struct Marks {
    uint64_t seq = 0;
    size_t count = 0;
    std::array<std::pair<uint64_t, uint64_t>, kMaxStandbys> marks;  // (replicator id, mark)
  };
  static constexpr size_t kMarks = 1024;
  // The marks of write `seq` (none where the ring lost them).
  Marks MarksOf(uint64_t seq) const;
  // The round `member` must apply for a write of `marks`: the one marked,
  // or (a member attached since, or a mark the ring lost) the next to take
  // changes.
  static uint64_t MarkOf(const Marks& marks, const Attached& member);

  mutable std::mutex mu_;
  std::vector<Attached> members_;                          // attach order; guarded by mu_
  uint64_t next_id_ = 0;                                   // guarded by mu_
  std::vector<std::string> in_sync_;                       // guarded by mu_
  uint64_t version_ = 0;                                   // guarded by mu_
  uint64_t seq_ = 0;                                       // guarded by mu_
  std::vector<Marks> marks_ = std::vector<Marks>(kMarks);  // guarded by mu_
  bool stopped_ = false;                                   // guarded by mu_
  std::chrono::steady_clock::time_point pruned_{};         // guarded by mu_
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_REPLICA_GROUP_H_
