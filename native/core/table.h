// One embedding table: int64 id -> row of `dim` float32 values plus optimizer
// slots, stored together in an arena. The table is split into kStripes
// stripes by routing bucket; each stripe has its own lock, open-addressing
// index and arena, so growing one stripe stalls only the readers of that
// 1/kStripes of the table. No TF or Python headers.
#ifndef TF_DLT_NATIVE_CORE_TABLE_H_
#define TF_DLT_NATIVE_CORE_TABLE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "native/core/disk_tier.h"
#include "native/core/pull_mode.h"
#include "native/core/push_ledger.h"
#include "native/core/routing.h"
#include "native/core/sketch.h"
#include "native/core/status.h"
#include "native/core/table_config.h"

namespace dlt {

inline constexpr uint32_t kNoState = 0xffffffffu;

inline constexpr uint32_t kStripes = 64;

// True when a stripe index of `capacity` slots must grow before it takes
// one more record after `records` (load factor at most 0.75). In 64 bits, so
// it keeps growing past 2^30 records.
inline bool IndexMustGrow(uint64_t records, uint64_t capacity) {
  return (records + 1) * 4 > capacity * 3;
}
static_assert(kNumBuckets % kStripes == 0, "stripes must split buckets evenly");

// Rows copied out of a table by an Exporter; arrays sized by the caller.
struct RowBuffers {
  int64_t* ids = nullptr;       // [n]
  float* values = nullptr;      // [n, dim]
  float* slots = nullptr;       // [n, slot_floats]; may be null when 0 slots
  uint32_t* steps = nullptr;    // [n]
  uint32_t* buckets = nullptr;  // [n] routing bucket of each id
  uint32_t* touched = nullptr;  // [n] last-touched stamps; may be null
};

// Where a save stands in a table's change tracking (Table::BeginSave).
struct SaveStart {
  bool tracked = false;     // the base is a save or load this table tracks
  uint32_t since = 0;       // its generation: rows changed after it are new
  uint32_t base_clock = 0;  // the table's clock at the base
};

// What the table's memory policy did since it was created.
struct TableCounters {
  uint64_t admitted = 0;  // rows created by training (pull or push)
  uint64_t refused = 0;   // pushed ids that were not admitted (per id and push)
  uint64_t expired = 0;   // rows removed by ttl sweeps
  uint64_t evicted = 0;   // rows removed to stay within max_rows
  uint64_t shrunk = 0;    // rows removed by explicit Shrink calls
};

// Where a table's rows live (docs/tiered_storage.md).
struct TierStats {
  uint64_t ram_rows = 0;
  uint64_t disk_rows = 0;
  uint64_t ram_bytes = 0;   // Table::bytes()
  uint64_t disk_bytes = 0;  // the tier files' sizes
  uint64_t promotions = 0;  // cold rows a pull or push moved into RAM
  // Pushes applied to cold rows where they lie: RAM was near its limit and
  // the row neither above the memory keeper's cut nor a ghost (WorthRam).
  uint64_t disk_updates = 0;
  uint64_t demotions = 0;   // rows moved to the disk tier
  uint64_t disk_reads = 0;  // slots read from the tier files
  // Tier file reads and writes that failed (I/O errors, short reads, a full disk).
  uint64_t disk_read_errors = 0, disk_write_errors = 0;
  // The three counters' rates over the keeper's last second.
  double promotions_per_s = 0, demotions_per_s = 0, disk_reads_per_s = 0;
  std::string error;  // the last disk error ("" when none since)
};

class Table {
 public:
  // `config` must have passed ValidateTableConfig. The table serves ids of
  // buckets [first_bucket, end_bucket) (its shard's); only the admission
  // sketch depends on that range.
  explicit Table(const TableConfig& config, uint32_t first_bucket = 0,
                 uint32_t end_bucket = kNumBuckets);
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  const TableConfig& config() const { return config_; }
  uint32_t dim() const { return config_.dim; }
  // Optimizer slot floats per row (SlotsPerValue * dim).
  uint32_t slot_floats() const { return slot_floats_; }

  // A record: a header (update count and last-touched stamp), the values,
  // then the optimizer slots, 8-byte aligned; beside it, the generation of
  // its last write (change tracking). tools/capacity.py plans with these.
  static constexpr size_t kRecordHeaderBytes = 8;
  static constexpr size_t kGenerationBytes = 2;
  static size_t RecordBytes(const TableConfig& config);

  // Writes the rows of `ids[0..n)` to `out` ([n, dim]). Thread-safe. In
  // training mode (kInsert) an absent id gets a row only when admission
  // admits it on a pull (every id, or Probability admission); otherwise it
  // reads the unadmitted default and nothing is stored. A cold row (disk
  // tier) moves into RAM unless RAM is at its limit: then it is read where
  // it is, and an absent id reads its initial value without a row (its
  // push makes it). Fails only on a disk error. The state modes write
  // StateFloats(dim, slot_floats()) floats per id (PullState).
  Status Pull(const int64_t* ids, size_t n, PullMode mode, float* out);
  // Each id's row with its optimizer state: values, slots, and the update
  // count's bits (kNoState where RAM holds no row for it). With a
  // `fallback` plain mode, an id RAM does not hold is pulled as that mode
  // pulls it: when that leaves its row in RAM (a kInsert made it, or moved
  // it in from disk) its state is read; else it keeps kNoState and gets the
  // values that pull returned. Without one, such an id reads zeros.
  Status PullState(const int64_t* ids, size_t n, const PullMode* fallback, float* out);

  // Applies `grads` ([n, dim]) with learning rate `lr`; repeated ids are
  // summed first; absent ids that admission admits are created with their
  // initial value, others are counted (Frequency) and dropped. Stamps every
  // row it updates. Rejects (and changes nothing for) non-finite gradients
  // or learning rates.
  Status Push(const int64_t* ids, const float* grads, size_t n, float lr);

  // Sets the values of rows (created if absent) and resets their optimizer
  // slots and steps. Rejects (and changes nothing for) non-finite values.
  // Never writes to the disk tier (cold rows move into RAM).
  Status Assign(const int64_t* ids, const float* values, size_t n);

  // Inserts or overwrites rows. `slots` may be null (fresh slots), `steps`
  // may be null (step 0) and `touched` may be null (stamped now). Rejects
  // (and changes nothing for) rows or slots holding NaN or infinity. With
  // a disk tier and RAM at its limit, rows go to disk when `to_disk` (a
  // load; never on the request path), else cold rows move into RAM.
  // `evict` false: no stripe is trimmed to its share of max_rows as rows
  // come in (a copy of a shard's rows, whose sender's policy evicts and
  // sends the removals; or a load of no more rows per shard than a saving
  // shard held, which may have passed max_rows between its evictions: the
  // policy trims the excess as training goes on).
  Status Import(const int64_t* ids, const float* values, const float* slots, const uint32_t* steps,
                size_t n, const uint32_t* touched = nullptr, bool to_disk = true,
                bool evict = true);
  // Import of rows whose values and slots are already in the table's
  // storage dtypes (value_bytes and slot_bytes a row: a checkpoint's 16-bit
  // rows, copied as they are instead of widened and rounded again). Rejects
  // NaN and infinity as Import does; `evict` as Import's.
  Status ImportStored(const int64_t* ids, const void* values, const void* slots,
                      const uint32_t* steps, size_t n, const uint32_t* touched = nullptr,
                      bool evict = true);
  // Bytes of a row's stored values, and of its stored slots.
  size_t value_bytes() const { return value_bytes_; }
  size_t slot_bytes() const;

  // Removes rows updated fewer than `min_count` times (0: any count) or not
  // touched for more than `unseen_for` clock units at `now` (0: any age).
  // Holds one stripe at a time, a slice of its index at a time, so pulls
  // never wait for a whole-table pass. Returns the rows removed.
  size_t Shrink(uint64_t min_count, uint64_t unseen_for, uint32_t now);
  // Removes the rows whose ttl has passed at `now`; 0 without a ttl.
  size_t Expire(uint32_t now);

  // Delta checkpoints (docs/checkpoints.md). Every row a pull, push,
  // assign or import writes is stamped with the table's current generation
  // (16 bits per row, beside the arena); while the table tracks a save,
  // removed ids are logged with theirs. A save starts a new generation.
  //
  // Starts save `save_id` on top of `base_id` ("": a full save). The result
  // says whether the base is tracked: then the rows changed since it are
  // those an Exporter made with `since` yields, and RemovedSince names the
  // ids removed since. The last kTrackedSaves saves and loads are tracked.
  SaveStart BeginSave(const std::string& save_id, const std::string& base_id);
  // The table holds checkpoint `save_id` exactly (after a load): tracking
  // restarts from it, and the rows written so far count as unchanged.
  void MarkLoaded(const std::string& save_id);
  // Ids removed after generation `since`, sorted by (bucket, id), unique.
  // FAILED_PRECONDITION when the removal log overflowed since the save
  // began (a ttl sweep, shrink or eviction wave): the ids would be
  // incomplete, and the table must be written whole.
  Status RemovedSince(uint32_t since, std::vector<int64_t>* ids) const;
  // Removes the rows of `ids` that are present; returns how many. A disk
  // tier read error leaves the rows it could not look for (and is kept in
  // *error, when given: a delta load or a standby's round must not take a
  // removal it did not make for done).
  size_t Erase(const int64_t* ids, size_t n, Status* error = nullptr);
  // Removes every row of buckets [first, end) except the ids of `keep`;
  // returns how many (a disk tier read error: as Erase).
  size_t EraseBuckets(uint32_t first, uint32_t end, const int64_t* keep = nullptr,
                      size_t num_keep = 0, Status* error = nullptr);
  // Sizes the index and arena of every stripe for `rows` rows spread evenly
  // over this table's buckets, and touches the new memory now, with
  // `threads` threads (a load fills the table at memory speed after it).
  // With a disk tier, RAM is sized for the rows within the RAM limit (which
  // gives up what the tier's RAM per cold slot will take) and the tier for
  // the rest.
  void Reserve(size_t rows, uint32_t threads);
  static constexpr size_t kTrackedSaves = 4;

  // The row stream (docs/replication.md). While the change log runs, every
  // id whose row a write creates, changes or removes is logged in its
  // stripe (a move between tiers is not a change); one consumer takes the
  // log. Starting it empties it: rows written before are the consumer's to
  // copy whole (an Exporter started after StartChangeLog returns).
  // Each row stream (`stream` < kMaxStreams: a standby's, a re-shard's
  // range streams) has a log of its own.
  void StartChangeLog(uint32_t stream = 0);
  void StopChangeLog(uint32_t stream = 0);
  bool change_log_running() const { return change_log_.load(std::memory_order_relaxed) != 0; }
  bool change_log_running(uint32_t stream) const {
    return (change_log_.load(std::memory_order_relaxed) >> stream) & 1u;
  }
  // The log also holds, in order, the hash of every id a push counts in the
  // admission sketch (Frequency admission).
  // Moves the ids logged since the last call into *ids, each once (stripe
  // after stripe, each stripe's sorted),
  // and (when not null) the sketch's counted hashes into *sketch_adds, each
  // stripe's in the order counted, stripe after stripe.
  // FAILED_PRECONDITION when a stripe's log outgrew its cap meanwhile (65,536
  // entries plus a quarter of its rows; it then logs nothing more): both are
  // incomplete, and the consumer must copy the table whole again (rows and
  // sketch); the log runs on, emptied.
  Status TakeChanges(std::vector<int64_t>* ids, std::vector<uint64_t>* sketch_adds = nullptr,
                     uint32_t stream = 0);
  // The admission sketch's slices of the buckets in stripe `stripe`, as
  // they are now: their buckets into *buckets, sketch_slice_bytes() counters
  // each into *counters, pushes since halving into *added (all appended).
  // Drops the stripe's logged sketch counts, which the slices hold: a
  // consumer copying a table whole reads every stripe so after its rows.
  void TakeSketchSlices(uint32_t stripe, std::vector<uint32_t>* buckets,
                        std::vector<uint8_t>* counters, std::vector<uint32_t>* added,
                        uint32_t stream = 0);
  // Counts in the sketch, in order, the hashes another copy of this table
  // counted (TakeChanges' sketch_adds): the sketch becomes that copy's.
  // INVALID_ARGUMENT for a hash of a bucket this table's sketch does not hold.
  Status CountInSketch(const uint64_t* hashes, size_t n);
  // The rows of `ids` as they are now, wherever they are: the present ones
  // into rows 0..*rows-1 of `out` (grouped by stripe; `out.buckets` may be
  // null), the ids of absent ones into *absent. Creates nothing. Fails only
  // on a disk error.
  Status ReadRows(const int64_t* ids, size_t n, const RowBuffers& out, size_t* rows,
                  std::vector<int64_t>* absent);

  // Tiered storage (docs/tiered_storage.md). Keeps the table's cold rows
  // in one file per stripe under `dir` (an empty directory this table
  // owns; removed with the table). Call before the table is used.
  void AttachTier(const std::string& dir);
  // Maps only arena chunks of 32 MiB or more on 2 MiB pages (a shard with a
  // memory budget; call before rows come): a stripe's last huge page holds
  // 2 MiB however few of its bytes rows use, so a table of few or wide rows
  // per stripe (64 KiB rows, a handful a stripe) held 128 MiB past them.
  void KeepPagesSmall();
  bool has_tier() const { return !tier_dir_.empty(); }
  // `rows` (a margin of rows a stripe a tiered table takes in RAM), fewer
  // where they pass kMarginBytes of records; at least 1.
  uint64_t TierMarginRows(uint64_t rows) const;
  static constexpr uint64_t kMarginBytes = uint64_t{64} << 10;
  // Rows the RAM tier should hold (0: no limit). Past it (by a margin) a
  // pull reads a cold row where it is instead of moving it, and an import
  // places new rows on disk. Set by the shard's memory keeper.
  void SetRamLimit(uint64_t rows) { ram_limit_.store(rows, std::memory_order_relaxed); }
  uint64_t ram_limit() const { return ram_limit_.load(std::memory_order_relaxed); }
  // Before a load of `rows` rows (a checkpoint's, in bucket order) into a
  // table with a disk tier and a RAM limit: the imports that follow keep in
  // RAM only rows at least as hot (by the eviction order: stamps, and
  // update counts under LFU) as the hottest share that fits the RAM room
  // free now; colder rows go to disk wherever they come in the load. The
  // share's score is the quantile of the rows imported so far (up to
  // kHotLoadSample of them; bucket order is hash order, so the first rows
  // are a uniform sample). Without it a load fills RAM first come, and
  // after a restart the hot rows are as likely on disk as any other.
  // EndHotLoad (or rows 0): first come again. EndHotLoad also makes every
  // cold row a ghost (TierFile::GhostAll): the rows a load put on disk have
  // no history on this shard, so until the keeper has moved a window of
  // rows out, their first touch moves them into a full RAM, as LRU would.
  void BeginHotLoad(uint64_t rows);
  void EndHotLoad();
  static constexpr size_t kHotLoadSample = 65536;
  // Moves up to `rows` of the coldest RAM rows (the table's eviction
  // order) to the disk tier, or without one removes them (counted as
  // evicted). Returns how many; a disk error stops it and lands in
  // *status (the rows stay in RAM).
  size_t Demote(size_t rows, Status* status);
  // With a disk tier and max_rows: removes the lowest-scoring rows of both
  // tiers of each stripe over its quota; returns how many.
  size_t EvictAcrossTiers();
  // Gives back to the system the memory of records that moved rows, or
  // removed ones, freed (Stripe::Compact, in each stripe with a tenth of
  // its records free). Demote leaves that to the memory keeper, which calls
  // this while the process needs the memory: free records are otherwise
  // taken again by the next rows made.
  void Compact();
  // Rows in RAM, and RAM bytes a RAM row costs: its record, generation and
  // its share of the index as loaded now (12-byte slots at a load of 3/8 to
  // 3/4: 16 to 32 bytes; 24 while the table is small).
  size_t ram_rows() const;
  size_t ram_row_bytes() const;
  // RAM bytes that do not grow with the RAM rows: the sketch, the disk
  // tier's per-slot fingerprints (counted at the size a tier file's next
  // doubling gives them once it is near it, so the memory keeper makes room
  // before), removal logs.
  size_t ram_fixed_bytes() const;
  TierStats tier_stats() const;
  // The memory keeper's demotions of this table fail with `error`, or work
  // again (""): while they fail, pushes wait for it only far past the RAM
  // limit (WaitForRoom), and stats show the error.
  void SetKeeperError(const std::string& error);
  // A disk error a request or a maintenance pass met: shown in stats until
  // the tier next reads a row for a request (TierWorked). It does not stop
  // pushes waiting for the keeper, which may still move rows.
  void NoteTierError(const std::string& error);
  void TierWorked();
  // Sets the rates in tier_stats() from the counters' change since the
  // last call, `seconds` ago (the keeper calls it about once a second).
  void UpdateTierRates(double seconds);

  // The table's clock (ClockKind): pushes this table has taken, or
  // seconds since the Unix epoch; 32 bits, compared modulo 2^32.
  uint32_t Now() const;
  // Sets the push clock (a loaded table continues from its checkpoint).
  void SetPushClock(uint32_t pushes) { pushes_.store(pushes); }
  // Raises the push clock to `pushes` if it is behind (a table filled from
  // several senders' bucket ranges takes the latest of their clocks).
  void RaisePushClock(uint32_t pushes) {
    uint64_t have = pushes_.load();
    while (have < pushes && !pushes_.compare_exchange_weak(have, pushes)) {
    }
  }
  // Pushes applied since the table was made (a loaded table starts from
  // its checkpoint's clock): 0 while nothing trained it.
  uint64_t pushes() const { return pushes_.load(std::memory_order_relaxed); }
  // Pushes plus assignments and imports made: changes when anything wrote
  // rows (Shard::CreateTable re-checks it before replacing the table).
  uint64_t writes() const { return pushes() + imports_.load(std::memory_order_relaxed); }

  // A provisional table was made before its optimizer was known (a Keras
  // layer following a model not yet compiled): Shard::CreateTable may still
  // replace it by one with another optimizer while nothing trained it.
  bool provisional() const { return provisional_.load(std::memory_order_relaxed); }
  void set_provisional(bool provisional) { provisional_.store(provisional); }

  // Rows in both tiers.
  size_t size() const;
  // Rows an import of `ids` (distinct), after `removed` are erased, would
  // take past the share of max_rows of the stripes they go to: 0 when it
  // evicts none. (0 without max_rows, and with a disk tier: its keeper
  // keeps max_rows across tiers.)
  uint64_t RowsPastQuota(const int64_t* ids, size_t n, const int64_t* removed = nullptr,
                         size_t m = 0) const;
  // Rows held past the share of max_rows of their stripes (rows imported
  // whole, none evicted): what the next rows made there would evict. (0
  // without max_rows, and with a disk tier, as above.)
  uint64_t RowsHeldPastQuota() const;
  // RAM bytes in use: rows with their slots, the index, the sketch and the
  // disk tier's per-slot fingerprints.
  size_t bytes() const;
  TableCounters counters() const;

  // The admission sketch (Frequency admission only): per bucket slices of
  // sketch_slice_bytes() counters plus a count of pushes since halving.
  bool has_sketch() const { return sketch_ != nullptr; }
  uint32_t sketch_slice_bytes() const { return sketch_ ? sketch_->slice_counters() : 0; }
  // True when the sketch holds the slices of buckets [first, end).
  bool SketchHolds(uint32_t first_bucket, uint32_t end_bucket) const;
  // One bucket's slice; the bucket must be one SketchHolds names.
  void ReadSketch(uint32_t bucket, uint8_t* counters, uint32_t* added) const;
  void WriteSketch(uint32_t bucket, const uint8_t* counters, uint32_t added);
  // Frequency estimate of an id in the sketch (0 without one).
  uint32_t SketchEstimate(int64_t id) const;
  // The stripe (lock, index, arena) that holds the rows of `bucket`.
  uint32_t StripeOfBucket(uint32_t bucket) const { return stripe_of_bucket_[bucket]; }
  // Bytes of one stored row (header, values and slots).
  size_t record_bytes() const { return record_bytes_; }

  struct Stripe;

  // Iterates the rows present when each stripe is reached, sorted by
  // (bucket, id). Rows are copied in chunks, holding each stripe's lock only
  // while a chunk is copied; concurrent pushes may land between chunks.
  // With `since` (a SaveStart's), only the rows changed after it.
  class Exporter {
   public:
    explicit Exporter(Table* table) : table_(table) {}
    Exporter(Table* table, uint32_t since) : table_(table), changed_only_(true), since_(since) {}
    // Only the rows of buckets [first, end) (a range stream's copy).
    void set_buckets(uint32_t first, uint32_t end) {
      first_bucket_ = first;
      end_bucket_ = end;
    }
    // Copies up to `max_rows` rows; returns how many (0 at the end, or
    // after a disk error: check error()).
    size_t Next(size_t max_rows, const RowBuffers& out);
    const Status& error() const { return error_; }

   private:
    Table* table_;
    bool changed_only_ = false;
    uint32_t since_ = 0;
    uint32_t first_bucket_ = 0, end_bucket_ = kNumBuckets;
    uint32_t stripe_ = 0;
    bool loaded_ = false;
    size_t pos_ = 0;
    uint64_t removals_ = 0;  // the stripe's removals when order_ was made
    Status error_;
    struct Entry {
      uint32_t bucket;
      uint32_t record;  // RAM record, or disk tier slot when `cold`
      int64_t id;
      bool cold;
    };
    // Lists the stripe's rows into order_; false on a disk error.
    bool List(Stripe* stripe);
    // Copies the row of `e` (wherever it now is) into row `i` of `out`;
    // false when it is gone or on a disk error.
    bool Copy(Stripe* stripe, const Entry& e, const RowBuffers& out, size_t i);
    std::vector<Entry> order_;  // this stripe's rows sorted by (bucket, id)
  };

 private:
  // Whether the policy admits an absent id on a push; counts it in the
  // sketch (once per push: `counted` holds the hashes counted by this push).
  // (`*repeat`: set when the id was counted, and refused, earlier in this
  // push: one refusal per id and push.)
  bool AdmitOnPush(Stripe* stripe, uint64_t hash, int64_t id, std::vector<uint64_t>* counted,
                   bool* repeat);
  bool ProbabilityAdmits(int64_t id) const;
  // Fills `out` with the unadmitted default of `id`.
  void Unadmitted(int64_t id, float* out) const;
  // Fills `out` with `id`'s initial values as a row made now holds them:
  // rounded to the stored dtype (a pull that makes no row reads what one
  // that makes it would).
  void InitialValues(int64_t id, float* out) const;
  // Removes this stripe's lowest-scoring rows when it holds more than its
  // quota of max_rows. Caller holds the lock.
  void EvictFrom(Stripe* stripe, uint32_t now);
  // Rows removed by Shrink / Expire into `counter`; `exact` as
  // EraseWhere's.
  size_t Remove(uint64_t min_count, uint64_t unseen_for, uint32_t now,
                std::atomic<uint64_t>* counter, bool exact);
  // Copies a stored row's values (or slots) to/from float32.
  void ReadValues(const char* record, float* out) const;
  // Pull's kState.
  void ReadState(const int64_t* ids, size_t n, float* out) const;
  void ReadSlots(const char* record, float* out) const;
  void WriteRow(char* record, int64_t id, uint32_t step, const float* values, const float* slots,
                bool stochastic);
  // Removes the rows of `keys` (present ones, in either tier) from
  // `stripe`, logging them while a save is tracked; returns how many.
  // Caller holds the lock exclusively.
  size_t EraseFrom(Stripe* stripe, const std::vector<int64_t>& keys, Status* error = nullptr);
  // Logs `id` when the change log runs (table_stripe.h).
  void NoteChange(Stripe* stripe, int64_t id);
  // Logs a count of `hash` in the sketch when the change log runs.
  void NoteSketchAdd(Stripe* stripe, uint64_t hash);
  // Copies stored record `r` of `id` into row `i` of `out`.
  void CopyOut(const char* r, int64_t id, uint32_t bucket, const RowBuffers& out, size_t i) const;
  // Removes disk tier slot `slot` (holding `key`) like EraseFrom.
  void EraseCold(Stripe* stripe, uint32_t slot, int64_t key);
  // Stops tracking removals when the stripe's log outgrew its cap (its
  // memory given back; the next save is written in full).
  void CapRemovalLog(Stripe* stripe);
  // Moves `id` from the stripe's disk tier into RAM: *rec gets its
  // record, or kEmpty when the tier does not hold it. Caller holds the
  // lock exclusively.
  Status Promote(Stripe* stripe, uint64_t hash, int64_t id, uint32_t* rec);
  // The stripe's tier Find; an error is the tier's error too.
  Status FindCold(Stripe* stripe, uint64_t hash, int64_t id, char* record, uint32_t* slot,
                  uint16_t* generation);
  // Promote's move of a cold row found in tier slot `slot` (its `record`
  // and `generation` read).
  Status MoveIn(Stripe* stripe, uint64_t hash, int64_t id, const char* record, uint32_t slot,
                uint16_t generation, uint32_t* rec);
  // Whether the stripe's RAM rows reached their share of the RAM limit.
  bool RamFull(const Stripe& stripe) const;
  // Records the memory keeper's cut in `stripe`: the lowest score at
  // clock `now` of the rows it weighed moving to disk.
  void NoteCut(Stripe* stripe, uint64_t score, uint32_t now);
  // Whether the RAM rows reached 15/16 of their limit (the keeper leaves
  // them at 0.95 of it). From there a cold row moves into RAM only if it
  // scores above the stripe's last cut (AboveCut: any before the keeper
  // made one) or is a ghost (TierFile::MovedOutLately); the others
  // stay on disk, read and updated there, so traffic that touches rows
  // once does not churn RAM. A push reads NearRamLimit once per stripe, so
  // the same id is never updated in both tiers.
  bool NearRamLimit() const;
  bool AboveCut(const Stripe& stripe, const char* record) const;
  // Whether cold `record` (in tier slot `slot`) moves into RAM.
  bool WorthRam(const Stripe& stripe, const char* record, uint32_t slot, bool near_limit) const;
  // Waits (a while at most) for the memory keeper when the RAM rows are
  // far past the RAM limit (further while the keeper cannot move rows:
  // kFailingKeeperSlack).
  void WaitForRoom() const;
  // Calls fn(slot, key, record) for every cold row of `stripe`, reading its
  // tier file a batch of pages at a time; `hold` takes (and returns) the
  // lock for each batch. Stops at a disk error.
  template <typename Hold, typename Fn>
  Status ForEachCold(Stripe* stripe, Hold hold, Fn fn);
  // Removes the rows of `stripe`, in either tier, for which goes(key,
  // record) holds, a slice of the index or a batch of cold pages per hold
  // of the lock; returns how many. Rows may move meanwhile (a pull moves a
  // cold one into RAM after the RAM pass, the keeper moves one out into
  // pages read already, the index grows or the tier file doubles): when
  // `exact`, a pass that saw a move is made again, the third time under
  // one hold, so no row that goes is left. A disk read error lands in
  // *error (when given).
  template <typename Goes>
  size_t EraseWhere(Stripe* stripe, bool exact, Goes goes, Status* error);
  // Removes `want` rows of `stripe` (held by no lock), the lowest scoring
  // at clock `now` of `scored`: (score, key) pairs of its rows weighed a
  // batch at a time, which may have moved, been weighed twice, or scored
  // higher since. Candidates are taken in order of the scores weighed; one
  // goes only while it still scores no higher than the want-th lowest of
  // those not passed over (a row pushed meanwhile stays). Returns how many.
  size_t EraseLowest(Stripe* stripe, std::vector<std::pair<uint64_t, int64_t>>* scored, size_t want,
                     uint32_t now);
  // Import's body: rows as floats, or as stored (ImportStored).
  Status ImportRows(const int64_t* ids, const void* values, const void* slots,
                    const uint32_t* steps, size_t n, const uint32_t* touched, bool to_disk,
                    bool stored, bool evict = true);
  // The lowest-scoring `want` of `scored` (score, key) pairs' keys.
  static std::vector<int64_t> Lowest(std::vector<std::pair<uint64_t, int64_t>>* scored,
                                     size_t want);
  // The keys of `want` cold rows of `stripe`, for the memory keeper: rows
  // at or below the score of the coldest fraction q (twice the wave's share
  // of the stripe's rows, at least 1/16) of a sample, found by sweeping the
  // index on from where the last sweep stopped, so about 1/q rows are
  // scored a victim instead of every row each pass. A wave of a quarter of
  // the rows or more (or a small stripe) takes the coldest exactly, every
  // row scored (`scored` is scratch). Caller holds the lock (any mode).
  std::vector<int64_t> Coldest(Stripe* stripe, size_t want, uint32_t now,
                               std::vector<std::pair<uint64_t, int64_t>>* scored);
  uint64_t Score(const char* record, uint32_t now) const;
  // The score of a row of update count `step` last touched at `touched`.
  uint64_t ScoreOf(uint32_t step, uint32_t touched, uint32_t now) const;
  // During a hot load (BeginHotLoad), which rows go to RAM: those scoring
  // above `floor`, and of those scoring `floor`, the share `tie_share` (by
  // their ids' hashes: many rows may share a stamp).
  struct HotFloor {
    bool active = false;  // false: any row
    uint64_t floor = 0;
    double tie_share = 1.0;
    bool Admits(uint64_t score, uint64_t hash) const {
      if (score != floor) return score > floor;
      return static_cast<double>(hash >> 11) * 0x1.0p-53 < tie_share;
    }
  };
  // Adds these rows' scores to a hot load's sample; the rows it sends to
  // RAM now (everything without a hot load).
  HotFloor HotLoadFloor(const uint32_t* steps, const uint32_t* touched, size_t n, uint32_t now);
  // RAM bytes of the table (the rows' part too unless `fixed_only`).
  size_t RamBytes(bool fixed_only) const;
  // This thread's buffer of one record (a cold row read or written).
  char* ScratchRecord() const;
  // Whether a row stamped `row_generation` changed after `since`.
  bool ChangedSince(uint16_t row_generation, uint32_t since) const;

  uint32_t StripeOf(uint64_t hash) const { return stripe_of_bucket_[BucketOfHash(hash)]; }
  // Whether stripe `stripe` holds any of buckets [first, end).
  bool StripeMeets(uint32_t stripe, uint32_t first, uint32_t end) const {
    for (uint32_t b = first; b < end; ++b) {
      if (stripe_of_bucket_[b] == stripe) return true;
    }
    return false;
  }
  // Returns the record of `id`, creating it with its initial value and fresh
  // slots when absent; 0xffffffff when the stripe cannot grow. Caller holds
  // the stripe's lock exclusively.
  uint32_t FindOrCreate(Stripe* stripe, uint64_t hash, int64_t id);
  // Groups positions 0..n-1 by stripe into `order`; `starts` gets kStripes+1
  // offsets. `hashes` receives Mix64 of each id.
  void GroupByStripe(const int64_t* ids, size_t n, std::vector<uint64_t>* hashes,
                     std::vector<uint32_t>* order, std::vector<uint32_t>* starts) const;

  TableConfig config_;
  uint32_t slot_floats_;
  uint32_t value_bytes_;  // bytes of the stored values of a row
  size_t record_bytes_;
  uint32_t first_bucket_, end_bucket_;  // the buckets this table serves
  bool wide_;                           // values and slots stored as float32
  std::unique_ptr<Stripe[]> stripes_;
  uint64_t stripe_quota_[kStripes] = {};  // max_rows per stripe (with max_rows)
  // The table's own buckets spread over all stripes in order (a shard of
  // many owns few buckets), so stripes stay contiguous bucket ranges and an
  // export in stripe order is in bucket order. Buckets outside the range go
  // to the first or last stripe.
  uint8_t stripe_of_bucket_[kNumBuckets];
  std::unique_ptr<FrequencySketch> sketch_;  // Frequency admission only
  std::atomic<uint64_t> pushes_{0};
  std::atomic<bool> provisional_{false};
  std::atomic<uint64_t> imports_{0};
  // Change tracking: the generation rows are stamped with now, and the
  // saves (or the load) tracked, newest last.
  std::atomic<uint32_t> generation_{1};
  struct SaveMark {
    std::string id;
    uint32_t generation;
    uint32_t clock;
  };
  mutable std::mutex saves_mu_;
  std::vector<SaveMark> saves_;            // guarded by saves_mu_
  std::atomic<uint32_t> change_log_{0};    // the row streams whose logs run, a bit each
  std::atomic<bool> logging_{false};       // removals are logged
  std::atomic<bool> log_overflow_{false};  // a stripe's log outgrew its cap
  std::atomic<int64_t> rows_{0};           // both tiers
  std::atomic<uint64_t> admitted_{0}, refused_{0}, expired_{0}, evicted_{0}, shrunk_{0};
  // Tiered storage.
  std::string tier_dir_;  // "" without a disk tier
  std::atomic<int64_t> cold_rows_{0};
  std::atomic<uint64_t> ram_limit_{0};
  // RamFull's margin of rows a stripe past its share (set by AttachTier).
  uint64_t ram_slack_rows_ = 16;
  std::atomic<uint64_t> promotions_{0}, demotions_{0}, disk_updates_{0};
  // A hot load (BeginHotLoad), guarded by hot_load_mu_.
  std::mutex hot_load_mu_;
  uint64_t hot_load_rows_ = 0;        // rows the load brings (0: no hot load)
  double hot_load_share_ = -1;        // of them, the share RAM takes (< 0: not yet known)
  std::vector<uint64_t> hot_scores_;  // the sample's scores
  HotFloor hot_floor_;
  mutable std::mutex tier_error_mu_;
  std::string keeper_error_;                  // guarded by tier_error_mu_
  std::string request_error_;                 // guarded by tier_error_mu_
  std::atomic<bool> keeper_failing_{false};   // keeper_error_ is not empty
  std::atomic<bool> request_failing_{false};  // request_error_ is not empty
  TierStats rates_;                           // last counters and rates; guarded by tier_error_mu_
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_TABLE_H_
