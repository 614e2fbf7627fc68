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
#include <shared_mutex>
#include <vector>

#include "native/core/routing.h"
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
};

class Table {
 public:
  // `config` must have passed ValidateTableConfig.
  explicit Table(const TableConfig& config);
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  const TableConfig& config() const { return config_; }
  uint32_t dim() const { return config_.dim; }
  // Optimizer slot floats per row (SlotsPerValue * dim).
  uint32_t slot_floats() const { return slot_floats_; }

  // Writes the rows of `ids[0..n)` to `out` ([n, dim]). Thread-safe.
  void Pull(const int64_t* ids, size_t n, PullMode mode, float* out);

  // Applies `grads` ([n, dim]) with learning rate `lr`; repeated ids are
  // summed first; unseen ids are created with their initial value. Rejects
  // (and changes nothing for) non-finite gradients or learning rates.
  Status Push(const int64_t* ids, const float* grads, size_t n, float lr);

  // Sets the values of rows (created if absent) and resets their optimizer
  // slots and steps. Rejects (and changes nothing for) non-finite values.
  Status Assign(const int64_t* ids, const float* values, size_t n);

  // Inserts or overwrites rows. `slots` may be null (fresh slots) and
  // `steps` may be null (step 0). Rejects (and changes nothing for) rows or
  // slots holding NaN or infinity.
  Status Import(const int64_t* ids, const float* values, const float* slots, const uint32_t* steps,
                size_t n);

  size_t size() const;
  // Bytes in use: rows with their slots, plus the index.
  size_t bytes() const;
  // Bytes of one stored row (header, values and slots).
  size_t record_bytes() const { return record_bytes_; }

  // Iterates the rows present when each stripe is reached, sorted by
  // (bucket, id). Rows are copied in chunks, holding each stripe's lock only
  // while a chunk is copied; concurrent pushes may land between chunks.
  class Exporter {
   public:
    explicit Exporter(Table* table) : table_(table) {}
    // Copies up to `max_rows` rows; returns how many (0 at the end).
    size_t Next(size_t max_rows, const RowBuffers& out);

   private:
    Table* table_;
    uint32_t stripe_ = 0;
    bool loaded_ = false;
    size_t pos_ = 0;
    struct Entry {
      uint32_t bucket;
      uint32_t record;
      int64_t id;
    };
    std::vector<Entry> order_;  // this stripe's rows sorted by (bucket, id)
  };

 private:
  struct Stripe;

  uint32_t StripeOf(uint64_t hash) const { return BucketOfHash(hash) / (kNumBuckets / kStripes); }
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
  size_t record_bytes_;
  std::unique_ptr<Stripe[]> stripes_;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_TABLE_H_
