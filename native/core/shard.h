// A shard: the named tables one server process holds, and the bucket range
// it owns. Thread-safe; tables are shared_ptrs so a request that found a
// table keeps it alive across a concurrent drop or load.
#ifndef TF_DLT_NATIVE_CORE_SHARD_H_
#define TF_DLT_NATIVE_CORE_SHARD_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "native/core/push_ledger.h"
#include "native/core/routing.h"
#include "native/core/status.h"
#include "native/core/table.h"

namespace dlt {

class Shard {
 public:
  // Shard `shard_index` of `num_shards`; an index of `num_shards` makes a
  // shard that owns no bucket (a process that joins a layout by a re-shard,
  // or left one).
  Shard(uint32_t shard_index, uint32_t num_shards);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  // INVALID_ARGUMENT unless shard `shard_index` of `num_shards` is a place
  // in a layout (an index equal to the count: a shard that owns no bucket).
  static Status CheckPlace(uint32_t shard_index, uint32_t num_shards);
  // Its place in the layout; a re-shard changes it (Adopt).
  uint32_t shard_index() const { return Index(place_.load()); }
  uint32_t num_shards() const { return Count(place_.load()); }
  uint32_t first_bucket() const { return First(place_.load()); }
  uint32_t end_bucket() const { return End(place_.load()); }
  bool OwnsBucket(uint32_t bucket) const {
    const uint64_t place = place_.load();
    return bucket >= First(place) && bucket < End(place);
  }
  // The layout this shard serves (live re-sharding, docs/replication.md):
  // 1 until a re-shard, then the re-shard's; and its shards' addresses
  // ("" until a re-shard), ',' between shards.
  uint64_t layout_epoch() const { return layout_epoch_.load(); }
  std::string layout_addresses() const;
  // Serves `next` (a shard of the next layout, filled by range streams)
  // from now on: its place, tables and applied push ids replace this
  // shard's, at layout `layout_epoch` of `addresses`. The layout switched
  // from is kept until DropPreviousLayout (the re-shard committed) or
  // RevertLayout (another process failed to switch: serves it again).
  void Adopt(Shard* next, uint64_t layout_epoch, std::string addresses);
  // Serves the layout switched from again, at the newer `layout_epoch`
  // with its `addresses` (clients that learned the layout switched to
  // learn this one as newer, and no epoch is used twice); false when there
  // is none to go back to (the epoch and addresses are taken all the same:
  // every process of an undone re-shard takes them).
  bool RevertLayout(uint64_t layout_epoch, std::string addresses);
  void DropPreviousLayout();
  // A switch kept the layout it left (until DropPreviousLayout or
  // RevertLayout).
  bool has_previous_layout() const;
  // A standby (or a process restarted after a re-shard) takes the place
  // and layout its primary or replica set serves now: a place of other
  // buckets only while it holds no table (FAILED_PRECONDITION otherwise),
  // the same place's newer layout epoch at any time.
  Status TakePlace(uint32_t shard_index, uint32_t num_shards, uint64_t layout_epoch,
                   std::string addresses);

  // Creates a table. Creating one that exists with the same configuration
  // succeeds with *created = false; a different configuration is
  // ALREADY_EXISTS naming both. The optimizer may not be known yet
  // (`provisional`: a Keras layer following a model not compiled yet):
  //  - a provisional request for a table that exists with the same
  //    configuration but another optimizer takes the existing table;
  //  - a request that knows its optimizer settles a provisional table: one
  //    nothing trained yet (no push) is replaced, in one step, by one with
  //    that optimizer holding the same rows (values, update counts, stamps;
  //    fresh slots). Two trainers racing agree: the first settles it, the
  //    second finds it settled.
  Status CreateTable(const TableConfig& config, bool* created, bool provisional = false);
  Status DropTable(const std::string& name);
  // NOT_FOUND naming the shard and the tables it has when `name` is absent.
  Status GetTable(const std::string& name, std::shared_ptr<Table>* table) const;
  std::vector<std::shared_ptr<Table>> Tables() const;
  // Installs `tables`, replacing same-named ones, in one step.
  void InstallTables(const std::vector<std::shared_ptr<Table>>& tables);

  // The pushes this shard applied, by id (docs/replication.md).
  PushLedger& push_ledger() { return push_ledger_; }
  // A row stream's number (< kMaxStreams) for its change logs and applied
  // push ids; RESOURCE_EXHAUSTED when every one is taken.
  Status AcquireStream(uint32_t* stream);
  void ReleaseStream(uint32_t stream);
  // Which copy of the shard this is (docs/replication.md): 1 for one that
  // began as a primary; a standby holds its primary's and takes one more
  // when it takes over. Clients refuse a shard older than one they met.
  uint64_t epoch() const { return epoch_.load(); }
  void set_epoch(uint64_t epoch) { epoch_.store(epoch); }
  // Epoch fencing (docs/replication.md, "Who takes over"). A standby that
  // grants another's takeover fences the primary it followed: it takes no
  // round of a primary older than fence_epoch() and tells its epoch as at
  // least that. A primary that meets a standby telling a newer epoch was
  // replaced (superseded_by(): that epoch, 0 while it was not): it answers
  // trainers UNAVAILABLE, so they go to the new one, and acknowledges no
  // write.
  void Fence(uint64_t epoch);
  uint64_t fence_epoch() const { return fence_epoch_.load(); }
  // The newer of epoch() and fence_epoch(): the oldest primary a standby
  // takes rounds of, and what it tells a primary's Hello.
  uint64_t newest_epoch() const { return std::max(epoch(), fence_epoch()); }
  // A standby about to follow the primary at `epoch` of `lineage` (it chose
  // that one): holds that epoch and lineage, and takes rounds of no older
  // primary.
  void FollowEpoch(uint64_t epoch, uint64_t lineage = 0) {
    epoch_.store(epoch);
    fence_epoch_.store(epoch);
    if (lineage != 0) lineage_.store(lineage);
  }
  // Which line of copies this is (docs/replication.md, "A replica set
  // restarted whole"): random, never 0, for a process that starts; a standby
  // holds its primary's and keeps it when it takes over. Epochs order the
  // copies of one lineage; a client that met a newer epoch takes an older
  // one only of another lineage, once no address of the shard serves its.
  uint64_t lineage() const { return lineage_.load(); }
  // `by` says in words who replaced it ("standby H:P serves it at epoch
  // 3"), for the refusals and the log; Supersede(0) clears both.
  void Supersede(uint64_t epoch, std::string by = "");
  uint64_t superseded_by() const { return superseded_by_.load(); }
  std::string replaced_by() const;

  // Checks that every id routes to this shard; INVALID_ARGUMENT otherwise
  // (the client's shard list is wrong), or ABORTED after a re-shard (the
  // client's layout is older: it should learn the new one and send again).
  Status CheckOwnership(const int64_t* ids, size_t n) const;
  // GetTable and CheckOwnership at one moment: a request never meets the
  // table of one layout and the buckets of another.
  Status TableFor(const std::string& name, const int64_t* ids, size_t n,
                  std::shared_ptr<Table>* table) const;

  // A table for this shard's buckets (not installed).
  std::shared_ptr<Table> NewTable(const TableConfig& config) const;

  // Removes the expired rows of every table with a ttl, one stripe at a
  // time; returns the rows removed.
  size_t Sweep();
  // Sweeps every `interval_ms` (> 0) on a background thread until
  // destruction or StopSweeper; a second call only changes the interval.
  // The shard applies its tables' policies on its own while it sweeps:
  // the memory keeper trims tiered tables to max_rows only then. A
  // standby or a read-only follower sweeps not: it holds its sender's rows
  // as they are (the sender's policy evicts, and sends the removals).
  void StartSweeper(int interval_ms);
  void StopSweeper();

  // Tiered storage (docs/tiered_storage.md). `budget_bytes` (0: none) bounds
  // the process's resident memory: past it the coldest rows move to a disk
  // tier under `storage_dir`, or without one ("") are evicted. Call once,
  // before any table exists. Takes `storage_dir`/shard-<index> (locked while
  // this process lives), or where other processes of the shard hold that,
  // shard-<index>-2 ... -kMaxTierDirs (FAILED_PRECONDITION when all are held)
  // and deletes what earlier processes left there. Starts the keeper thread
  // that enforces the budget every `interval_ms`.
  //
  // The budget holds back kPersistReserve for a save's or load's buffers
  // and refuses (INVALID_ARGUMENT, naming the smallest it takes) a budget
  // that leaves the rows less than kMinRowRoom beside what the process
  // holds now. Large allocations are then always mapped (a fixed
  // M_MMAP_THRESHOLD), so what a save or load frees goes back to the system.
  Status ConfigureMemory(uint64_t budget_bytes, const std::string& storage_dir, int interval_ms);
  static constexpr uint64_t kPersistReserve = uint64_t{128} << 20;
  // Tier directories a shard's processes may take in one storage dir (a
  // primary and its standbys: at most 1 + ReplicaGroup::kMaxStandbys).
  static constexpr int kMaxTierDirs = 5;
  static constexpr uint64_t kMinRowRoom = uint64_t{16} << 20;
  // A tiered table's RAM limit is never below this share of the budget's
  // worth of its rows, nor above 64 rows a stripe (LeastRamRows).
  static constexpr double kLeastRamShare = 1.0 / 64;
  // The keeper keeps the process under this fraction of the budget (the
  // rest is headroom for rows that arrive between passes): what a load
  // may stage is sized against it too, or the keeper evicts what it loaded.
  static constexpr double kTargetFraction = 0.9;
  // Past its target the keeper moves rows out down to this fraction of it.
  static constexpr double kLowWater = 0.95;
  // A save or load runs (calls nest): meanwhile the keeper sizes the rows
  // by the memory outside the tables measured before it, so the buffers it
  // takes (within kPersistReserve) never make the keeper move rows. So
  // does it after one ends, until that memory has gone back to the system
  // (measured after a trim) or kSettle passed (not extended by the saves
  // or loads that follow within it): freed buffers, and a table a load
  // replaced, leave the process over a few passes.
  void SetPersisting(bool persisting);
  static constexpr auto kSettle = std::chrono::seconds(10);
  // One pass of the keeper: moves rows out of RAM until the tables fit
  // the budget; returns the rows moved.
  size_t KeepMemory();
  // The least RAM rows tiered table `t` is limited to.
  uint64_t LeastRamRows(const Table& t) const;
  // ResourceExhausted when a new table of `config` would leave the rows
  // less than kMinRowRoom of the budget beside the tables' fixed parts
  // (its admission sketch above all) on a shard without a tier: the
  // keeper then evicted every row it got.
  Status CheckRoomForFixedParts(const TableConfig& config) const;
  // How long a table's keeper error stays shown once nothing needs moving
  // (RAM back under its target), counted from its last failed move.
  static constexpr std::chrono::seconds kKeeperErrorHold{5};
  // What tells the keeper the bytes the data plane's buffers hold now
  // (frames in flight and pooled for reuse): they are counted within the
  // room held back for buffers (kPersistReserve), not as overhead rows
  // give way to. Null: none.
  void SetBufferBytes(std::function<uint64_t()> held);
  struct MemoryStatus {
    uint64_t budget = 0;        // bytes; 0: none
    uint64_t resident = 0;      // the process's resident bytes at the last pass
    uint64_t table_target = 0;  // bytes the RAM rows may take
    // Bytes of tables made for this shard but not installed: a load's
    // staged tables, and those a committed load replaced and keeps for a
    // rollback. Never counted as overhead: they make the keeper move no
    // installed row.
    uint64_t staged_bytes = 0;
    std::string storage_dir;  // this shard's tier directory ("": none)
  };
  MemoryStatus memory_status() const;
  // The process's resident set in bytes (/proc/self/statm).
  static uint64_t ResidentBytes();
  // The same after freed memory went back to the system (malloc_trim).
  static uint64_t TrimmedResidentBytes();
  // Bytes of the live tables NewTable made that are not installed.
  uint64_t StagedBytes() const;

 private:
  void StopKeeper();
  // What SetBufferBytes's function says now (0: none).
  uint64_t BufferBytes() const;
  // Copies every row of `from` into `to` (values, update counts, stamps;
  // fresh optimizer slots).
  static Status CopyRows(Table* from, Table* to);
  void SetRamLimits(const std::vector<std::shared_ptr<Table>>& tables, uint64_t target);
  // The place: index << 32 | count.
  static uint32_t Index(uint64_t place) { return static_cast<uint32_t>(place >> 32); }
  static uint32_t Count(uint64_t place) { return static_cast<uint32_t>(place); }
  static uint32_t First(uint64_t place) {
    return Index(place) < Count(place) ? FirstBucket(Index(place), Count(place)) : 0;
  }
  static uint32_t End(uint64_t place) {
    return Index(place) < Count(place) ? FirstBucket(Index(place) + 1, Count(place)) : 0;
  }
  Status CheckOwnershipLocked(const int64_t* ids, size_t n) const;
  Status FindLocked(const std::string& name, std::shared_ptr<Table>* table) const;
  std::atomic<uint64_t> place_;
  std::atomic<uint64_t> layout_epoch_{1};
  mutable std::shared_mutex mu_;
  std::string layout_addresses_;  // guarded by mu_
  // The layout Adopt switched from, until dropped or reverted to.
  struct Previous {
    bool held = false;
    std::map<std::string, std::shared_ptr<Table>> tables;
    uint64_t place = 0, layout_epoch = 0;
    std::string addresses;
  };
  Previous previous_;                                     // guarded by mu_
  std::map<std::string, std::shared_ptr<Table>> tables_;  // guarded by mu_
  PushLedger push_ledger_;
  std::mutex streams_mu_;
  uint32_t streams_ = 0;  // taken, a bit each; guarded by streams_mu_
  std::atomic<uint64_t> epoch_{1};
  std::atomic<uint64_t> lineage_;
  std::atomic<uint64_t> fence_epoch_{0};
  std::atomic<uint64_t> superseded_by_{0};
  mutable std::mutex replaced_by_mu_;
  std::string replaced_by_;  // guarded by replaced_by_mu_

  std::mutex sweeper_mu_;
  std::condition_variable sweeper_cv_;
  std::thread sweeper_;                // guarded by sweeper_mu_
  int sweep_interval_ms_ = 0;          // guarded by sweeper_mu_
  std::atomic<bool> sweeping_{false};  // between StartSweeper and StopSweeper
  // Bumped by every StopSweeper: a sweeper thread runs while it is the one
  // it started under, so a restart never revives a thread being stopped.
  uint64_t sweeper_generation_ = 0;  // guarded by sweeper_mu_

  // Every table NewTable made, to tell staged ones from installed ones.
  mutable std::mutex made_mu_;
  mutable std::vector<std::weak_ptr<Table>> made_;  // guarded by made_mu_

  // Tiered storage; set once by ConfigureMemory.
  uint64_t budget_ = 0;
  std::string tier_root_;  // storage_dir/shard-<index>, "" without a disk tier
  int tier_lock_fd_ = -1;
  mutable std::atomic<uint64_t> next_table_dir_{0};
  std::atomic<uint64_t> resident_{0}, table_target_{0}, staged_bytes_{0};
  std::mutex keeper_mu_;
  std::condition_variable keeper_cv_;
  bool keeper_stop_ = false;  // guarded by keeper_mu_
  std::thread keeper_;
  std::mutex keeper_pass_mu_;                             // one KeepMemory pass at a time
  uint64_t keeper_passes_ = 0;                            // guarded by keeper_pass_mu_
  std::chrono::steady_clock::time_point keeper_rated_;    // guarded by keeper_pass_mu_
  std::chrono::steady_clock::time_point keeper_trimmed_;  // guarded by keeper_pass_mu_
  std::atomic<int> persisting_{0};
  // When the last save or load ended (steady_clock ticks; 0: none yet),
  // and how many began (a pass tells from it one that began and ended
  // since the last pass; persists_seen_: the count that pass read).
  std::atomic<int64_t> persist_ended_{0};
  std::atomic<uint64_t> persists_begun_{0};
  uint64_t persists_seen_ = 0;    // guarded by keeper_pass_mu_
  uint64_t steady_overhead_ = 0;  // guarded by keeper_pass_mu_
  bool settled_ = true;           // guarded by keeper_pass_mu_
  // When the overhead is measured afresh at the latest, once no save or
  // load runs (unset: not yet known). Guarded by keeper_pass_mu_.
  std::chrono::steady_clock::time_point settle_by_;
  // SetBufferBytes's.
  mutable std::mutex buffer_bytes_mu_;
  std::function<uint64_t()> buffer_bytes_;  // guarded by buffer_bytes_mu_
  // Tables whose tier failed: when the keeper tries each again, the wait
  // after that try should it fail too, and when it last failed (guarded by
  // keeper_pass_mu_). Weak references: a table made after one was dropped
  // never shares its entry (keyed by address, it could, and waited out the
  // dropped one's backoff).
  struct KeeperRetry {
    std::chrono::steady_clock::time_point at;
    std::chrono::milliseconds backoff;
    std::chrono::steady_clock::time_point failed_at;
  };
  std::map<std::weak_ptr<Table>, KeeperRetry, std::owner_less<>> keeper_failed_;
};

// The embedded tables of this process: one Shard (index 0 of 1), the same
// one for the op library's embedded transport and for Python
// (tf_dlt._native.embedded_shard), since both link the one libdlt_core.so.
// Made on first use with a sweeper running every kEmbeddedSweepMs (a sweep
// of tables without a ttl does nothing); never destroyed, so no thread of
// the process outlives it at exit.
std::shared_ptr<Shard> EmbeddedShard();
constexpr int kEmbeddedSweepMs = 10000;

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_SHARD_H_
