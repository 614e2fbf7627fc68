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

#include "native/core/routing.h"
#include "native/core/sketch.h"
#include "native/core/status.h"
#include "native/core/table_config.h"

namespace dlt {

// What a pull does with an id the table does not hold yet.
enum class PullMode : uint8_t {
  kInsert = 0,         // training: create the row with its initial value
  kInitNoInsert = 1,   // inference: return the initial value, insert nothing
  kZerosNoInsert = 2,  // inference: return zeros, insert nothing
};

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

  // Writes the rows of `ids[0..n)` to `out` ([n, dim]). Thread-safe. In
  // training mode (kInsert) an absent id gets a row only when admission
  // admits it on a pull (every id, or Probability admission); otherwise it
  // reads the unadmitted default and nothing is stored.
  void Pull(const int64_t* ids, size_t n, PullMode mode, float* out);

  // Applies `grads` ([n, dim]) with learning rate `lr`; repeated ids are
  // summed first; absent ids that admission admits are created with their
  // initial value, others are counted (Frequency) and dropped. Stamps every
  // row it updates. Rejects (and changes nothing for) non-finite gradients
  // or learning rates.
  Status Push(const int64_t* ids, const float* grads, size_t n, float lr);

  // Sets the values of rows (created if absent) and resets their optimizer
  // slots and steps. Rejects (and changes nothing for) non-finite values.
  Status Assign(const int64_t* ids, const float* values, size_t n);

  // Inserts or overwrites rows. `slots` may be null (fresh slots), `steps`
  // may be null (step 0) and `touched` may be null (stamped now). Rejects
  // (and changes nothing for) rows or slots holding NaN or infinity.
  Status Import(const int64_t* ids, const float* values, const float* slots, const uint32_t* steps,
                size_t n, const uint32_t* touched = nullptr);

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
  std::vector<int64_t> RemovedSince(uint32_t since) const;
  // Removes the rows of `ids` that are present; returns how many.
  size_t Erase(const int64_t* ids, size_t n);
  // Removes every row of buckets [first, end) except the ids of `keep`;
  // returns how many.
  size_t EraseBuckets(uint32_t first, uint32_t end, const int64_t* keep = nullptr,
                      size_t num_keep = 0);
  // Sizes the index and arena of every stripe for `rows` rows spread evenly
  // over this table's buckets, and touches the new memory now, with
  // `threads` threads (a load fills the table at memory speed after it).
  void Reserve(size_t rows, uint32_t threads);
  static constexpr size_t kTrackedSaves = 4;

  // The table's clock (ClockKind): pushes this table has taken, or
  // seconds since the Unix epoch; 32 bits, compared modulo 2^32.
  uint32_t Now() const;
  // Sets the push clock (a loaded table continues from its checkpoint).
  void SetPushClock(uint32_t pushes) { pushes_.store(pushes); }

  size_t size() const;
  // Bytes in use: rows with their slots, the index and the sketch.
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

  // Iterates the rows present when each stripe is reached, sorted by
  // (bucket, id). Rows are copied in chunks, holding each stripe's lock only
  // while a chunk is copied; concurrent pushes may land between chunks.
  // With `since` (a SaveStart's), only the rows changed after it.
  class Exporter {
   public:
    explicit Exporter(Table* table) : table_(table) {}
    Exporter(Table* table, uint32_t since) : table_(table), changed_only_(true), since_(since) {}
    // Copies up to `max_rows` rows; returns how many (0 at the end).
    size_t Next(size_t max_rows, const RowBuffers& out);

   private:
    Table* table_;
    bool changed_only_ = false;
    uint32_t since_ = 0;
    uint32_t stripe_ = 0;
    bool loaded_ = false;
    size_t pos_ = 0;
    uint64_t removals_ = 0;  // the stripe's removals when order_ was made
    struct Entry {
      uint32_t bucket;
      uint32_t record;
      int64_t id;
    };
    std::vector<Entry> order_;  // this stripe's rows sorted by (bucket, id)
  };

 private:
  struct Stripe;

  // Whether the policy admits an absent id on a push; counts it in the
  // sketch (once per push: `counted` holds the hashes counted by this push).
  bool AdmitOnPush(uint64_t hash, int64_t id, std::vector<uint64_t>* counted);
  bool ProbabilityAdmits(int64_t id) const;
  // Fills `out` with the unadmitted default of `id`.
  void Unadmitted(int64_t id, float* out) const;
  // Removes this stripe's lowest-scoring rows when it holds more than its
  // quota of max_rows. Caller holds the lock.
  void EvictFrom(Stripe* stripe, uint32_t now);
  // Rows removed by Shrink / Expire into `counter`.
  size_t Remove(uint64_t min_count, uint64_t unseen_for, uint32_t now,
                std::atomic<uint64_t>* counter);
  // Copies a stored row's values (or slots) to/from float32.
  void ReadValues(const char* record, float* out) const;
  void ReadSlots(const char* record, float* out) const;
  void WriteRow(char* record, int64_t id, uint32_t step, const float* values, const float* slots,
                bool stochastic);
  // Removes the rows of `keys` (present ones) from `stripe`, logging them
  // while a save is tracked; returns how many. Caller holds the lock
  // exclusively.
  size_t EraseFrom(Stripe* stripe, const std::vector<int64_t>& keys);
  // Whether a row stamped `row_generation` changed after `since`.
  bool ChangedSince(uint16_t row_generation, uint32_t since) const;

  uint32_t StripeOf(uint64_t hash) const { return stripe_of_bucket_[BucketOfHash(hash)]; }
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
  std::atomic<bool> logging_{false};       // removals are logged
  std::atomic<bool> log_overflow_{false};  // a stripe's log outgrew its cap
  std::atomic<int64_t> rows_{0};
  std::atomic<uint64_t> admitted_{0}, refused_{0}, expired_{0}, evicted_{0}, shrunk_{0};
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_TABLE_H_
