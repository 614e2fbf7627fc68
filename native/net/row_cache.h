// RowCache: a trainer's copy of the rows of one table's most frequent ids,
// with their optimizer state, so lookups of hot ids skip the shards. Rows
// come from state pulls (values, slots and step; kStateInsert for a
// trainer). The trainer's own pushes
// are applied to the cached rows with the table's optimizer (ApplyRow, the
// shards' arithmetic), so a single trainer reads what the shards hold; other
// trainers' pushes are seen when a row is refreshed, which happens once it
// is max_staleness_steps lookups or max_staleness_ms old. An id is cached
// once it was looked up min_count times (a count-min sketch, halved as it
// fills) and, with a staleness bound in lookups, once it is looked up often
// enough to repay its fills and refreshes (each pulls the state: 1.9x the
// bytes of a plain pull for Adagrad at dim 8, ids counted), and only at a
// count that enough ids pass to repay filling then rather than at the next
// lookup (UpdateRepays); when full, a
// newcomer replaces the least frequent of a few sampled rows if it is more
// frequent. A cached row that became too rare is dropped instead of
// refreshed. No TF headers: the C++ suite tests it.
#ifndef TF_DLT_NATIVE_NET_ROW_CACHE_H_
#define TF_DLT_NATIVE_NET_ROW_CACHE_H_

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "native/core/status.h"
#include "native/core/table_config.h"

namespace dlt {

struct RowCacheOptions {
  size_t max_rows = 0;               // the memory bound: rows held at most
  uint32_t max_staleness_steps = 0;  // lookups of the table; 0: no bound
  uint32_t max_staleness_ms = 0;     // 0: no bound (one of the two must be set)
  uint32_t min_count = 2;            // lookups of an id before it is cached
};

// Checks `options` for a table of `dim`; the message names what is wrong.
std::string RowCacheOptionsError(const RowCacheOptions& options);

// The cache's id -> slot map: open addressing with linear probing, at most
// half full, growing by doubling; erasing shifts the entries after it back.
class SlotIndex {
 public:
  static constexpr uint32_t kNone = 0xffffffffu;
  uint32_t Find(int64_t id) const;
  // Sets the slot of `id` (inserted when absent).
  void Set(int64_t id, uint32_t slot);
  void Erase(int64_t id);
  size_t size() const { return size_; }

 private:
  struct Entry {
    int64_t id;
    uint32_t slot;  // kNone: empty
  };
  size_t Home(int64_t id) const;
  void Grow();
  std::vector<Entry> entries_;
  size_t size_ = 0;
};

class RowCache {
 public:
  RowCache(uint32_t dim, const OptimizerConfig& optimizer, RowCacheOptions options);

  uint32_t dim() const { return dim_; }
  uint32_t slot_floats() const { return slot_floats_; }
  const RowCacheOptions& options() const { return options_; }
  const OptimizerConfig& optimizer() const { return optimizer_; }
  // Memory one cached row takes at most, its index entries included; and
  // the memory that does not grow with the rows (the frequency sketch).
  size_t row_bytes() const;
  size_t fixed_bytes() const { return sketch_.size(); }
  // The frequency sketch's count of `id` (at most 255; a count-min sketch
  // overestimates, never under).
  uint32_t SketchCount(int64_t id) const;

  // How a lookup splits its distinct ids.
  struct Plan {
    std::vector<uint32_t> fill;   // positions to pull with their state (Fill)
    std::vector<uint32_t> plain;  // positions to pull without
    size_t hits = 0;
    uint32_t oldest_steps = 0;  // the oldest row served: lookups and ms since its pull
    int64_t oldest_ms = 0;
  };
  // One lookup of the distinct `ids` (one step of the cache's clock) at
  // `now_ms`: the fresh cached rows go to `rows` ([n, dim], by position);
  // `plan` gets the other positions: rows to (re)fill, and the rest.
  void Lookup(const int64_t* ids, size_t n, int64_t now_ms, float* rows, Plan* plan);
  // Rows pulled with their state ([n, StateFloats(dim, slot_floats)]) for
  // `ids`: cached (refreshed) and their values written to `rows` ([n, dim]).
  // The positions the shards hold no row for (kNoState) go to `absent`.
  void Fill(const int64_t* ids, size_t n, const float* states, int64_t now_ms, float* rows,
            std::vector<uint32_t>* absent);
  // This trainer pushed `grads` ([n, dim]) for `ids`: applied to the cached
  // ones as the shards apply it (repeated ids summed first). A push the
  // shards would refuse whole (a learning rate or gradient past what they
  // take) is refused here first, nothing applied; a row the shards would
  // leave as it was (its update not finite) is read again.
  Status Pushed(const int64_t* ids, const float* grads, size_t n, float lr);
  // Forgets the cached rows of `ids` (an assignment, a failed push).
  void Invalidate(const int64_t* ids, size_t n);

  struct Counts {
    uint64_t hits = 0;       // distinct ids served from the cache
    uint64_t misses = 0;     // distinct ids pulled (filled or not)
    uint64_t fills = 0;      // rows put in the cache
    uint64_t refreshes = 0;  // of those, rows that were cached but too old or marked stale
    uint64_t evictions = 0;  // rows replaced by more frequent ones or too rare to refresh
    uint64_t applied = 0;    // pushed rows applied locally
    uint64_t rows = 0;       // rows held now
    uint64_t max_steps = 0;  // the oldest row ever served, in lookups
  };
  Counts counts() const;

 private:
  // Marks cached row `cached` as pulled long ago: the next lookup of it
  // refreshes it (mu_ held).
  void MarkStale(uint32_t cached);
  uint32_t Count(int64_t id);  // counts one lookup of `id`; the estimate
  uint32_t Estimate(int64_t id) const;
  // Where an id of Mix64 `hash` counts in the sketch's `row` (an index
  // into sketch_).
  size_t Cell(uint64_t hash, uint32_t row) const;
  // Halves the counts (and reached_): recent lookups weigh more.
  void Halve();
  // A slot for a new row: a free one, or the least frequent of a sample if
  // it is rarer than `count` (evicted); -1: none.
  int64_t SlotFor(uint32_t count);
  // The lowest count among a few sampled rows (256 when empty), and
  // (when given) that row's slot.
  uint32_t RarestSampled(uint32_t* rarest_slot = nullptr);
  // Whether an id looked up `count` times (the sketch's estimate) is worth
  // a fill: min_count, and with a staleness bound in lookups, more lookups
  // expected within it than a fill costs in plain pulls.
  bool WorthCaching(uint32_t count) const;
  // Sets repays_ from reached_ (once per lookup).
  void UpdateRepays();
  // Removes the row in `slot` (the last row moves into it).
  void EraseSlot(uint32_t slot);

  const uint32_t dim_;
  const OptimizerConfig optimizer_;
  const RowCacheOptions options_;
  const uint32_t slot_floats_;
  const double fill_cost_;
  const uint32_t sketch_width_;
  mutable std::mutex mu_;
  uint64_t clock_ = 0;  // lookups so far
  SlotIndex index_;
  // Per slot: id, values and slots, step, and when it was pulled.
  std::vector<int64_t> ids_;
  std::vector<float> data_;
  std::vector<uint32_t> steps_;
  std::vector<uint64_t> filled_step_;
  std::vector<int64_t> filled_ms_;
  std::vector<uint8_t> sketch_;  // 4 rows of sketch_width_ 8-bit counters
  uint64_t counted_ = 0;         // since the sketch was last halved
  // Lookups since the sketch was last halved, and those its counts stood
  // for when it was (the counts cover about the sum).
  uint64_t lookups_since_halving_ = 0;
  uint64_t window_lookups_ = 0;
  // How many times an id's count reached c (halved with the sketch; at
  // 255, every count of an id already there), and whether filling a new id
  // at count c pays (UpdateRepays).
  uint64_t reached_[256] = {};
  bool repays_[256] = {};
  uint64_t sample_ = 0x9e3779b97f4a7c15ull;
  Counts counts_;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_ROW_CACHE_H_
