#include "native/net/row_cache.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "native/core/dedup.h"
#include "native/core/finite.h"
#include "native/core/optimizer.h"
#include "native/core/routing.h"
#include "native/core/table.h"

namespace dlt {
namespace {

constexpr uint32_t kSketchRows = 4;
constexpr uint32_t kSampled = 8;  // rows compared when the cache is full

uint64_t NextRandom(uint64_t* state) {
  *state ^= *state << 13;
  *state ^= *state >> 7;
  *state ^= *state << 17;
  return *state;
}

}  // namespace

size_t SlotIndex::Home(int64_t id) const {
  return Mix64(static_cast<uint64_t>(id)) & (entries_.size() - 1);
}

uint32_t SlotIndex::Find(int64_t id) const {
  if (entries_.empty()) return kNone;
  const size_t mask = entries_.size() - 1;
  for (size_t i = Home(id);; i = (i + 1) & mask) {
    const Entry& e = entries_[i];
    if (e.slot == kNone) return kNone;
    if (e.id == id) return e.slot;
  }
}

void SlotIndex::Set(int64_t id, uint32_t slot) {
  if ((size_ + 1) * 2 > entries_.size()) Grow();
  const size_t mask = entries_.size() - 1;
  for (size_t i = Home(id);; i = (i + 1) & mask) {
    Entry& e = entries_[i];
    if (e.slot == kNone) {
      e = {id, slot};
      ++size_;
      return;
    }
    if (e.id == id) {
      e.slot = slot;
      return;
    }
  }
}

void SlotIndex::Erase(int64_t id) {
  if (entries_.empty()) return;
  const size_t mask = entries_.size() - 1;
  size_t i = Home(id);
  while (entries_[i].slot != kNone && entries_[i].id != id) i = (i + 1) & mask;
  if (entries_[i].slot == kNone) return;
  // Backward shift: move later entries of the run into the hole when their
  // home does not lie (cyclically) between the hole and them.
  for (size_t j = (i + 1) & mask; entries_[j].slot != kNone; j = (j + 1) & mask) {
    const size_t home = Home(entries_[j].id);
    if (((j - home) & mask) >= ((j - i) & mask)) {
      entries_[i] = entries_[j];
      i = j;
    }
  }
  entries_[i].slot = kNone;
  --size_;
}

void SlotIndex::Grow() {
  std::vector<Entry> old;
  old.swap(entries_);
  entries_.assign(std::max<size_t>(64, old.size() * 2), Entry{0, kNone});
  size_ = 0;
  for (const Entry& e : old) {
    if (e.slot != kNone) Set(e.id, e.slot);
  }
}

std::string RowCacheOptionsError(const RowCacheOptions& options) {
  if (options.max_rows == 0) return "a hot-row cache needs rows >= 1";
  if (options.max_rows > (size_t{1} << 31)) return "a hot-row cache holds at most 2^31 rows";
  if (options.max_staleness_steps == 0 && options.max_staleness_ms == 0) {
    return "a hot-row cache needs a staleness bound: max_staleness_steps or max_staleness_ms "
           "(other trainers' pushes reach cached rows only when they are refreshed)";
  }
  if (options.min_count == 0 || options.min_count > 255) {
    return "a hot-row cache's min_count must be in [1, 255], got " +
           std::to_string(options.min_count);
  }
  return "";
}

RowCache::RowCache(uint32_t dim, const OptimizerConfig& optimizer, RowCacheOptions options)
    : dim_(dim),
      optimizer_(optimizer),
      options_(options),
      slot_floats_(SlotsPerValue(optimizer.kind) * dim),
      // Bytes of a state pull's row against a plain pull's (id included).
      fill_cost_((sizeof(int64_t) + sizeof(float) * StateFloats(dim, slot_floats_)) /
                 static_cast<double>(sizeof(int64_t) + sizeof(float) * dim)),
      // Counters for the ids competing for the rows, not only the rows: a
      // count-min sketch only overestimates, and a tail id that looks
      // frequent is cached in the place of a hot one. 10 per row (2^20 at
      // least, so that counts span hundreds of lookups before they halve;
      // 2^22 at most: 16 MiB).
      sketch_width_(static_cast<uint32_t>(
          std::clamp<size_t>(options.max_rows * 10, size_t{1} << 20, size_t{1} << 22))),

      sketch_(size_t{kSketchRows} * sketch_width_, 0) {}

size_t RowCache::row_bytes() const {
  // Values and slots, step, fill stamps, id, and at most 4 index entries
  // (the index is 1/4 to 1/2 full).
  return sizeof(float) * (dim_ + slot_floats_) + sizeof(uint32_t) + sizeof(uint64_t) +
         sizeof(int64_t) + sizeof(int64_t) + 4 * 16;
}

size_t RowCache::Cell(uint64_t hash, uint32_t row) const {
  // Double hashing of one 64-bit hash (a 32-bit hash per row), mapped onto
  // the row's width by a multiply: every column is reachable in every row.
  // (Shifting the hash by 16 bits a row left the last row 2^16 columns.)
  const uint32_t g = static_cast<uint32_t>(hash) + row * static_cast<uint32_t>(hash >> 32);
  return size_t{row} * sketch_width_ + static_cast<size_t>((uint64_t{g} * sketch_width_) >> 32);
}

uint32_t RowCache::Estimate(int64_t id) const {
  const uint64_t h = Mix64(static_cast<uint64_t>(id));
  uint32_t best = 255;
  for (uint32_t r = 0; r < kSketchRows; ++r) best = std::min<uint32_t>(best, sketch_[Cell(h, r)]);
  return best;
}

uint32_t RowCache::SketchCount(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Estimate(id);
}

uint32_t RowCache::Count(int64_t id) {
  // Conservative update: only the counters at the minimum grow.
  const uint64_t h = Mix64(static_cast<uint64_t>(id));
  uint8_t* cells[kSketchRows];
  uint32_t current = 255;
  for (uint32_t r = 0; r < kSketchRows; ++r) {
    cells[r] = &sketch_[Cell(h, r)];
    current = std::min<uint32_t>(current, *cells[r]);
  }
  if (current < 255) {
    for (uint8_t* c : cells) {
      if (*c == current) ++*c;
    }
  }
  const uint32_t count = std::min<uint32_t>(current + 1, 255);
  ++reached_[count];
  if (++counted_ >= uint64_t{sketch_width_} * 8) Halve();  // age: recent frequency wins
  return count;
}

void RowCache::Halve() {
  for (uint8_t& c : sketch_) c >>= 1;
  for (uint64_t& r : reached_) r /= 2;
  counted_ = 0;
  // The halved counts stand for half the lookups they counted.
  window_lookups_ = (window_lookups_ + lookups_since_halving_) / 2;
  lookups_since_halving_ = 0;
}

uint32_t RowCache::RarestSampled(uint32_t* rarest_slot) {
  uint32_t rarest = 256;
  const bool all = ids_.size() <= kSampled;  // a small cache: every row
  for (uint32_t k = 0; k < (all ? ids_.size() : kSampled); ++k) {
    const auto slot = all ? k : static_cast<uint32_t>(NextRandom(&sample_) % ids_.size());
    const uint32_t c = Estimate(ids_[slot]);
    if (c < rarest) {
      rarest = c;
      if (rarest_slot != nullptr) *rarest_slot = slot;
    }
  }
  return rarest;
}

int64_t RowCache::SlotFor(uint32_t count) {
  if (ids_.size() < options_.max_rows) {
    ids_.push_back(0);
    data_.resize(data_.size() + dim_ + slot_floats_);
    steps_.push_back(0);
    filled_step_.push_back(0);
    filled_ms_.push_back(0);
    return static_cast<int64_t>(ids_.size() - 1);
  }
  uint32_t victim = 0;
  if (RarestSampled(&victim) >= count) return -1;
  index_.Erase(ids_[victim]);
  ++counts_.evictions;
  return victim;
}

void RowCache::UpdateRepays() {
  // Filling a new id at its c-th lookup rather than at its next one costs
  // the extra bytes of a state pull now and saves a state pull at that next
  // lookup, if there is one: it pays when the share of the ids looked up c
  // times that were looked up again, reached_[c + 1] / reached_[c], exceeds
  // 1 - 1 / fill_cost_. Counts not reached yet: no evidence against.
  for (uint32_t c = 1; c < 255; ++c) {
    repays_[c] = reached_[c] == 0 || static_cast<double>(reached_[c + 1]) >
                                         (1 - 1 / fill_cost_) * static_cast<double>(reached_[c]);
  }
  repays_[255] = true;
}

bool RowCache::WorthCaching(uint32_t count) const {
  if (count < options_.min_count) return false;
  if (options_.max_staleness_steps == 0) return true;
  // Lookups of the id expected before the row must be pulled again, against
  // what a fill (and each refresh) costs in plain pulls: more, or the cache
  // pulls more bytes than it saves.
  const double covered = static_cast<double>(window_lookups_ + lookups_since_halving_);
  return count * static_cast<double>(options_.max_staleness_steps) > fill_cost_ * covered;
}

void RowCache::EraseSlot(uint32_t slot) {
  const size_t stride = dim_ + slot_floats_;
  index_.Erase(ids_[slot]);
  // Moving the last row into the freed slot keeps the slots dense.
  const auto last = static_cast<uint32_t>(ids_.size() - 1);
  if (slot != last) {
    ids_[slot] = ids_[last];
    std::memcpy(&data_[slot * stride], &data_[last * stride], sizeof(float) * stride);
    steps_[slot] = steps_[last];
    filled_step_[slot] = filled_step_[last];
    filled_ms_[slot] = filled_ms_[last];
    index_.Set(ids_[slot], slot);
  }
  ids_.pop_back();
  data_.resize(data_.size() - stride);
  steps_.pop_back();
  filled_step_.pop_back();
  filled_ms_.pop_back();
}

void RowCache::Lookup(const int64_t* ids, size_t n, int64_t now_ms, float* rows, Plan* plan) {
  plan->fill.clear();
  plan->plain.clear();
  plan->hits = 0;
  plan->oldest_steps = 0;
  plan->oldest_ms = 0;
  const size_t stride = dim_ + slot_floats_;
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t now_step = ++clock_;
  ++lookups_since_halving_;
  // Counts stop at 255, so an id looked up at every lookup must still look
  // frequent enough over the lookups the counts cover (WorthCaching: 255 x
  // max_staleness_steps > fill_cost_ x covered): the counts halve before
  // they cover 128 x max_staleness_steps / fill_cost_ lookups, however few
  // ids the lookups count.
  if (options_.max_staleness_steps != 0 &&
      fill_cost_ * static_cast<double>(window_lookups_ + lookups_since_halving_) >
          128.0 * options_.max_staleness_steps) {
    Halve();
  }
  UpdateRepays();
  size_t admitted = 0;  // new rows this lookup plans to fill
  int64_t bar = -1;     // the rarest sampled row's count, once needed
  for (size_t i = 0; i < n; ++i) {
    const uint32_t count = Count(ids[i]);
    const uint32_t slot = index_.Find(ids[i]);
    if (slot != SlotIndex::kNone) {
      const uint64_t age_steps = now_step - filled_step_[slot];
      const int64_t age_ms = now_ms - filled_ms_[slot];
      const bool fresh =
          (options_.max_staleness_steps == 0 || age_steps < options_.max_staleness_steps) &&
          (options_.max_staleness_ms == 0 ||
           age_ms < static_cast<int64_t>(options_.max_staleness_ms));
      if (fresh) {
        std::memcpy(rows + i * dim_, &data_[slot * stride], sizeof(float) * dim_);
        ++plan->hits;
        plan->oldest_steps = std::max<uint32_t>(plan->oldest_steps, age_steps);
        plan->oldest_ms = std::max(plan->oldest_ms, age_ms);
        continue;
      }
      if (WorthCaching(count)) {
        plan->fill.push_back(static_cast<uint32_t>(i));  // a refresh
        continue;
      }
      EraseSlot(slot);  // too rare now to pay for its refreshes
      ++counts_.evictions;
      plan->plain.push_back(static_cast<uint32_t>(i));
      continue;
    }
    // Pulled with its state only if ids of its count tend to be looked up
    // again, it is worth it, and it will get a slot: a free one, or one of
    // a rarer row (judged against a sample taken once per lookup).
    bool admit = repays_[count] && WorthCaching(count);
    if (admit && ids_.size() + admitted >= options_.max_rows) {
      if (bar < 0) bar = RarestSampled();
      admit = static_cast<int64_t>(count) > bar;
    }
    if (admit) ++admitted;
    (admit ? plan->fill : plan->plain).push_back(static_cast<uint32_t>(i));
  }
  counts_.hits += plan->hits;
  counts_.misses += n - plan->hits;
  counts_.max_steps = std::max<uint64_t>(counts_.max_steps, plan->oldest_steps);
}

void RowCache::Fill(const int64_t* ids, size_t n, const float* states, int64_t now_ms, float* rows,
                    std::vector<uint32_t>* absent) {
  absent->clear();
  const size_t width = StateFloats(dim_, slot_floats_);
  const size_t stride = dim_ + slot_floats_;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) {
    const float* state = states + i * width;
    const uint32_t step = StepOfState(state, width);
    const uint32_t cached = index_.Find(ids[i]);
    if (step == kNoState) {
      if (cached != SlotIndex::kNone) EraseSlot(cached);  // gone from the shards
      absent->push_back(static_cast<uint32_t>(i));
      continue;
    }
    std::memcpy(rows + i * dim_, state, sizeof(float) * dim_);
    int64_t slot;
    if (cached != SlotIndex::kNone) {
      slot = cached;
      ++counts_.refreshes;
    } else {
      slot = SlotFor(Estimate(ids[i]));
      if (slot < 0) continue;  // rarer than every row sampled: not cached
      index_.Set(ids[i], static_cast<uint32_t>(slot));
      ids_[slot] = ids[i];
    }
    std::memcpy(&data_[slot * stride], state, sizeof(float) * stride);
    steps_[slot] = step;
    filled_step_[slot] = clock_;
    filled_ms_[slot] = now_ms;
    ++counts_.fills;
  }
}

Status RowCache::Pushed(const int64_t* ids, const float* grads, size_t n, float lr) {
  // Refused as Table::Push refuses it (nothing applied), so no row a shard
  // will never hold is served.
  DLT_RETURN_IF_ERROR(CheckLearningRate(lr, optimizer_.kind == OptimizerKind::kFtrl, "Push: "));
  DLT_RETURN_IF_ERROR(CheckGradients(ids, grads, n, dim_, lr, "Push: ", "nothing sent"));
  // As Table::Push: an id's rows are summed in order (and, for Keras
  // Adagrad, their squares), then applied once.
  struct Scratch : DedupScratch {
    RepeatedSums sums;
  };
  Scratch own;
  Scratch& scratch = ThreadScratch(n, own);
  scratch.Run(ids, n);
  const std::vector<int64_t>& unique = scratch.unique;
  const std::vector<int64_t>& slot = scratch.slot;
  RepeatedSums& sums = scratch.sums;
  const bool repeated = unique.size() < n;
  if (repeated) {
    sums.Sum(
        n, unique.size(), dim_, optimizer_.kind == OptimizerKind::kKerasAdagrad,
        [&](size_t i) { return static_cast<size_t>(slot[i]); },
        [&](size_t i) { return grads + i * dim_; });
  }
  const size_t stride = dim_ + slot_floats_;
  const float limit = GradientLimit(lr);
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t u = 0; u < unique.size(); ++u) {
    const uint32_t cached = index_.Find(unique[u]);
    if (cached == SlotIndex::kNone) continue;
    float* row = &data_[size_t{cached} * stride];
    const float* summed = repeated ? sums.Summed(u) : nullptr;
    // An id pushed once: its gradient as sent (the u-th, with no repeats).
    const float* g = summed != nullptr ? summed : grads + (repeated ? sums.First(u) : u) * dim_;
    const float* sq = summed != nullptr ? sums.Squares(u) : nullptr;
    // A row the shards leave as it was (INVALID_ARGUMENT: its repeats sum
    // past the gradient limit, or its update is not finite): read again at
    // the next lookup.
    const bool applied = (summed == nullptr || WithinLimit(summed, dim_, limit)) &&
                         ApplyRow(optimizer_, dim_, lr, g, sq, row, row + dim_, &steps_[cached]);
    if (!applied) {
      MarkStale(cached);
      continue;
    }
    ++counts_.applied;
  }
  return OkStatus();
}

void RowCache::Invalidate(const int64_t* ids, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t cached = index_.Find(ids[i]);
    if (cached != SlotIndex::kNone) MarkStale(cached);
  }
}

void RowCache::MarkStale(uint32_t cached) {
  filled_step_[cached] = clock_ - (uint64_t{1} << 40);
  filled_ms_[cached] = INT64_MIN / 4;
}

RowCache::Counts RowCache::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  Counts c = counts_;
  c.rows = ids_.size();
  return c;
}

}  // namespace dlt
