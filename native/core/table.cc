#include "native/core/table.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>

#include "native/core/finite.h"
#include "native/core/half.h"
#include "native/core/initializer.h"
#include "native/core/optimizer.h"

namespace dlt {
namespace {

constexpr uint32_t kEmpty = 0xffffffffu;
// Records in the first arena chunk of a stripe; chunk k holds kBase << k.
constexpr uint32_t kBaseRecordsLog2 = 6;
constexpr uint32_t kMaxChunks = 32;
constexpr size_t kHugePage = size_t{2} << 20;
// Prefetch distances (in ids) of the batched lookup's index probes and row copies.
constexpr uint32_t kProbeAhead = 32;
constexpr uint32_t kCopyAhead = 8;
// Rows ahead whose record and gradient a push prefetches.
constexpr uint32_t kApplyAhead = 2;
// Index slots a removal pass examines per hold of a stripe's lock.
constexpr size_t kRemovalSlots = 8192;
// Disk tier pages a pass over cold rows reads per hold of a stripe's lock,
// and rows a demotion writes per hold.
constexpr uint32_t kColdPagesPerHold = 32;
constexpr size_t kDemoteBatch = 256;
// Milliseconds a push waits at most for the memory keeper while the RAM
// rows are far past their limit (back-pressure instead of memory growth).
constexpr int kRoomWaits = 100;
// Salts of the per-id random streams (initial rows use their own).
constexpr uint64_t kAdmitSalt = 0x243f6a8885a308d3ULL;
constexpr uint64_t kRoundSalt = 0x13198a2e03707344ULL;
constexpr uint64_t kSlotRoundSalt = 0xa4093822299f31d0ULL;
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// A record: this header, then the values, then the optimizer slots. The
// id lives in the index entry that points at the record.
struct RowHeader {
  uint32_t step;     // updates applied (Adam's t; LFU's frequency)
  uint32_t touched;  // clock stamp of the last update (or creation)
};
static_assert(sizeof(RowHeader) == 8, "row header layout");

// 12 bytes, unaligned keys: x86 loads them at full speed.
struct __attribute__((packed)) IndexEntry {
  int64_t key;
  uint32_t record;
};
static_assert(sizeof(IndexEntry) == 12, "index entry layout");

// An id removed while a save is tracked, with the generation then.
struct __attribute__((packed)) Removal {
  int64_t key;
  uint32_t generation;
};
static_assert(sizeof(Removal) == 12, "removal log entry layout");

inline size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

// A stripe's removal log may hold this many entries plus a quarter of its
// rows; past that the table stops tracking (its next delta is written in
// full) rather than grow without bound.
constexpr size_t kLogSlack = 4096;

// Allocator of the index: blocks of 2 MiB and more come from mmap with
// MADV_HUGEPAGE, so a probe of a large index misses the TLB far less (with
// THP in "madvise" mode malloc'd memory stays on 4 KiB pages).
template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT: rebinding

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return std::allocator<T>().allocate(n);
    void* p = mmap(nullptr, RoundUp(bytes, 4096), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, RoundUp(bytes, 4096), MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) {
      std::allocator<T>().deallocate(p, n);
    } else {
      munmap(p, RoundUp(bytes, 4096));
    }
  }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const {
    return false;
  }
};

using Index = std::vector<IndexEntry, HugePageAllocator<IndexEntry>>;

}  // namespace

// One stripe: lock, index and arena. Records never move while the table
// lives; a removed row's record goes to a free list and is reused.
struct Table::Stripe {
  mutable std::shared_mutex mu;
  Index index;               // capacity is a power of two (or empty)
  uint32_t num_records = 0;  // records ever allocated (live + free)
  uint32_t live = 0;
  // Rows ever removed or moved between tiers (exports re-check rows after
  // one).
  uint64_t removals = 0;
  std::vector<uint32_t> free_records;
  char* chunks[kMaxChunks] = {};
  size_t chunk_bytes[kMaxChunks] = {};
  // Per record: the generation of its last write (change tracking).
  std::unique_ptr<uint16_t[]> generations[kMaxChunks];
  uint32_t num_chunks = 0;
  std::vector<Removal> removed;    // ids removed while a save is tracked
  std::unique_ptr<TierFile> tier;  // cold rows (with a disk tier)

  ~Stripe() {
    for (uint32_t k = 0; k < num_chunks; ++k) munmap(chunks[k], chunk_bytes[k]);
  }

  // The first record of arena chunk k: the records of chunks 0..k-1.
  static size_t FirstRecordOf(uint32_t k) { return ((size_t{1} << k) - 1) << kBaseRecordsLog2; }

  static uint32_t ChunkOf(uint32_t record, uint32_t* offset) {
    const uint32_t q = (record >> kBaseRecordsLog2) + 1;
    const uint32_t k = 31 - static_cast<uint32_t>(__builtin_clz(q));
    *offset = record - static_cast<uint32_t>(FirstRecordOf(k));
    return k;
  }

  char* Record(uint32_t record, size_t record_bytes) const {
    uint32_t offset;
    const uint32_t k = ChunkOf(record, &offset);
    return chunks[k] + static_cast<size_t>(offset) * record_bytes;
  }

  uint16_t& Generation(uint32_t record) {
    uint32_t offset;
    const uint32_t k = ChunkOf(record, &offset);
    return generations[k][offset];
  }
  uint16_t Generation(uint32_t record) const {
    uint32_t offset;
    const uint32_t k = ChunkOf(record, &offset);
    return generations[k][offset];
  }

  size_t Home(uint64_t hash) const { return (hash >> 12) & (index.size() - 1); }

  void PrefetchSlot(uint64_t hash) const {
    if (!index.empty()) __builtin_prefetch(&index[Home(hash)]);
  }

  // The index slot holding `key`, or kEmpty. Caller holds mu (any mode).
  size_t FindSlot(uint64_t hash, int64_t key) const {
    if (index.empty()) return kEmpty;
    const size_t mask = index.size() - 1;
    for (size_t i = Home(hash);; i = (i + 1) & mask) {
      const IndexEntry& e = index[i];
      if (e.record == kEmpty) return kEmpty;
      if (e.key == key) return i;
    }
  }

  // Looks `key` up; returns its record or kEmpty. Caller holds mu (any mode).
  uint32_t Find(uint64_t hash, int64_t key) const {
    const size_t i = FindSlot(hash, key);
    return i == kEmpty ? kEmpty : index[i].record;
  }

  void Grow() { GrowTo(index.empty() ? 16 : index.size() * 2); }

  // Rehashes into `capacity` (a power of two) slots.
  void GrowTo(size_t capacity) {
    Index next(capacity, IndexEntry{0, kEmpty});
    const size_t mask = capacity - 1;
    for (const IndexEntry& e : index) {
      if (e.record == kEmpty) continue;
      size_t i = (Mix64(static_cast<uint64_t>(e.key)) >> 12) & mask;
      while (next[i].record != kEmpty) i = (i + 1) & mask;
      next[i] = e;
    }
    index.swap(next);
  }

  // Adds a record for `key`; caller holds mu exclusively and has checked
  // the key is absent. Returns the record, or kEmpty when memory ran out.
  uint32_t Insert(uint64_t hash, int64_t key, size_t record_bytes) {
    if (IndexMustGrow(live, index.size())) Grow();
    uint32_t rec;
    if (!free_records.empty()) {
      rec = free_records.back();
      free_records.pop_back();
    } else {
      if (num_records >= kEmpty - 1) return kEmpty;  // record numbers are 32-bit
      uint32_t offset;
      const uint32_t k = ChunkOf(num_records, &offset);
      if (k >= num_chunks && !AddChunk(record_bytes)) return kEmpty;
      rec = num_records++;
    }
    const size_t mask = index.size() - 1;
    size_t i = Home(hash);
    while (index[i].record != kEmpty) i = (i + 1) & mask;
    index[i] = IndexEntry{key, rec};
    ++live;
    return rec;
  }

  // Maps the next arena chunk (and its generations); false when out of
  // chunks or memory.
  bool AddChunk(size_t record_bytes) {
    const uint32_t k = num_chunks;
    if (k >= kMaxChunks) return false;
    const size_t records = size_t{1} << (k + kBaseRecordsLog2);
    const size_t bytes = RoundUp(records * record_bytes, 4096);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    if (bytes >= kHugePage) madvise(p, bytes, MADV_HUGEPAGE);
    generations[k].reset(new (std::nothrow) uint16_t[records]);
    if (!generations[k]) {
      munmap(p, bytes);
      return false;
    }
    chunks[k] = static_cast<char*>(p);
    chunk_bytes[k] = bytes;
    num_chunks = k + 1;
    return true;
  }

  // Removes the entry at index slot `i` (backward-shift deletion, so the
  // index never holds tombstones) and frees its record. Caller holds mu
  // exclusively.
  void EraseSlot(size_t i) {
    const size_t mask = index.size() - 1;
    free_records.push_back(index[i].record);
    --live;
    ++removals;
    size_t hole = i;
    for (size_t j = (i + 1) & mask; index[j].record != kEmpty; j = (j + 1) & mask) {
      const size_t home = (Mix64(static_cast<uint64_t>(index[j].key)) >> 12) & mask;
      // The entry at j may move into the hole unless its home lies
      // cyclically in (hole, j].
      const bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
      if (stays) continue;
      index[hole] = index[j];
      hole = j;
    }
    index[hole] = IndexEntry{0, kEmpty};
  }

  // Removes the rows of `keys` that are present, by key, since each
  // removal may shift other entries; logs them with `generation` when
  // `log`. Returns how many were removed. Caller holds mu exclusively.
  size_t EraseKeys(const std::vector<int64_t>& keys, bool log, uint32_t generation) {
    size_t erased = 0;
    for (int64_t key : keys) {
      const size_t slot = FindSlot(Mix64(static_cast<uint64_t>(key)), key);
      if (slot == kEmpty) continue;
      EraseSlot(slot);
      ++erased;
      if (log) removed.push_back(Removal{key, generation});
    }
    return erased;
  }
};

Table::Table(const TableConfig& config, uint32_t first_bucket, uint32_t end_bucket)
    : config_(config),
      slot_floats_(SlotsPerValue(config.optimizer.kind) * config.dim),
      value_bytes_(DtypeBytes(config.policy.value_dtype) * config.dim),
      record_bytes_(RoundUp(sizeof(RowHeader) + value_bytes_ +
                                size_t{DtypeBytes(config.policy.slot_dtype)} * slot_floats_,
                            8)),
      first_bucket_(first_bucket),
      end_bucket_(end_bucket),
      wide_(config.policy.value_dtype == static_cast<uint64_t>(StorageDtype::kFloat32) &&
            config.policy.slot_dtype == static_cast<uint64_t>(StorageDtype::kFloat32)),
      stripes_(new Stripe[kStripes]) {
  const uint64_t owned = end_bucket - first_bucket;
  uint64_t buckets_in[kStripes] = {};
  for (uint32_t b = 0; b < kNumBuckets; ++b) {
    uint32_t s = 0;
    if (b >= end_bucket) {
      s = kStripes - 1;
    } else if (b >= first_bucket) {
      s = static_cast<uint32_t>((b - first_bucket) * uint64_t{kStripes} / owned);
      ++buckets_in[s];
    }
    stripe_of_bucket_[b] = static_cast<uint8_t>(s);
  }
  // Each stripe holds at most its share of max_rows: the share of the
  // table's buckets it serves (ids spread evenly over buckets), rounded
  // down, so the quotas never add up to more than max_rows.
  for (uint32_t s = 0; s < kStripes; ++s) {
    stripe_quota_[s] = config.policy.max_rows * buckets_in[s] / owned;
  }
  if (config.policy.admission == static_cast<uint64_t>(AdmissionKind::kFrequency)) {
    sketch_ =
        std::make_unique<FrequencySketch>(config.policy.sketch_bytes, first_bucket, end_bucket);
  }
}

Table::~Table() {
  stripes_.reset();  // closes and unlinks the tier files
  if (!tier_dir_.empty()) rmdir(tier_dir_.c_str());
}

void Table::AttachTier(const std::string& dir) {
  tier_dir_ = dir;
  for (uint32_t s = 0; s < kStripes; ++s) {
    char name[32];
    std::snprintf(name, sizeof(name), "/stripe-%02u.tier", s);
    stripes_[s].tier = std::make_unique<TierFile>(dir + name, record_bytes_);
  }
}

void Table::WaitForRoom() const {
  const uint64_t limit = ram_limit_.load(std::memory_order_relaxed);
  if (!has_tier() || limit == 0) return;
  for (int i = 0; i < kRoomWaits && ram_rows() > limit + limit / 8; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool Table::RamFull(const Stripe& stripe) const {
  const uint64_t limit = ram_limit_.load(std::memory_order_relaxed);
  if (limit == 0 || !stripe.tier) return false;
  // A stripe's share, plus a margin for uneven stripes and for rows that
  // arrive between two passes of the keeper.
  return stripe.live >= limit / kStripes + limit / (16 * kStripes) + 16;
}

Status Table::Promote(Stripe* stripe, uint64_t hash, int64_t id, uint32_t* rec) {
  *rec = kEmpty;
  if (!stripe->tier || stripe->tier->rows() == 0) return OkStatus();
  char* scratch = ScratchRecord();
  uint32_t slot;
  uint16_t generation = 0;
  DLT_RETURN_IF_ERROR(stripe->tier->Find(hash, id, scratch, &slot, &generation));
  if (slot == TierFile::kNoSlot) return OkStatus();
  const uint32_t r = stripe->Insert(hash, id, record_bytes_);
  if (r == kEmpty) {
    return ResourceExhausted("table '" + config_.name + "' cannot grow: out of address space");
  }
  std::memcpy(stripe->Record(r, record_bytes_), scratch, record_bytes_);
  stripe->Generation(r) = generation;  // a move is not a change
  stripe->tier->Remove(slot);
  ++stripe->removals;
  cold_rows_.fetch_sub(1, std::memory_order_relaxed);
  promotions_.fetch_add(1, std::memory_order_relaxed);
  *rec = r;
  return OkStatus();
}

void Table::FillRecord(char* r, int64_t id, uint32_t step, uint32_t touched, const float* values,
                       const float* slots) {
  auto* header = reinterpret_cast<RowHeader*>(r);
  header->step = step;
  header->touched = touched;
  WriteRow(r, id, step, values, slots, /*stochastic=*/false);
}

template <typename Hold, typename Fn>
Status Table::ForEachCold(Stripe* stripe, Hold hold, Fn fn) {
  TierFile* tier = stripe->tier.get();
  if (tier == nullptr) return OkStatus();
  std::vector<char> buffer;
  for (uint32_t first = 0;; first += kColdPagesPerHold) {
    auto lock = hold();
    if (first >= tier->pages()) break;
    const uint32_t n = std::min(kColdPagesPerHold, tier->pages() - first);
    const uint32_t per_page = tier->slots_per_page();
    bool any = false;
    for (uint32_t slot = first * per_page; slot < (first + n) * per_page && !any; ++slot) {
      any = tier->Used(slot);
    }
    if (!any) continue;
    buffer.resize(size_t{n} * tier->page_bytes());
    DLT_RETURN_IF_ERROR(tier->ReadPages(first, n, buffer.data()));
    for (uint32_t p = 0; p < n; ++p) {
      const char* page = buffer.data() + size_t{p} * tier->page_bytes();
      for (uint32_t s = 0; s < per_page; ++s) {
        const uint32_t slot = (first + p) * per_page + s;
        if (!tier->Used(slot)) continue;
        const char* data = tier->SlotIn(page, s);
        fn(slot, TierFile::KeyOf(data), TierFile::RecordOf(data));
      }
    }
  }
  return OkStatus();
}

uint64_t Table::Score(const char* record, uint32_t now) const {
  const auto* h = reinterpret_cast<const RowHeader*>(record);
  const uint32_t age = now - h->touched;
  // Lowest first: fewest updates (LFU), then longest untouched.
  const uint64_t recency = 0xffffffffu - age;
  const bool lfu = config_.policy.eviction == static_cast<uint64_t>(EvictionKind::kLfu);
  return lfu ? (uint64_t{h->step} << 32) | recency : recency;
}

std::vector<int64_t> Table::Lowest(std::vector<std::pair<uint64_t, int64_t>>* scored, size_t want) {
  want = std::min(want, scored->size());
  std::vector<int64_t> keys;
  if (want == 0) return keys;
  std::nth_element(scored->begin(), scored->begin() + (want - 1), scored->end());
  keys.reserve(want);
  for (size_t v = 0; v < want; ++v) keys.push_back((*scored)[v].second);
  return keys;
}

size_t Table::Demote(size_t want, Status* status) {
  *status = OkStatus();
  const bool to_disk = has_tier();
  const uint32_t now = Now();
  const size_t total = ram_rows();
  if (want == 0 || total == 0) return 0;
  size_t moved = 0;
  std::vector<std::pair<uint64_t, int64_t>> scored;
  for (uint32_t s = 0; s < kStripes && status->ok(); ++s) {
    Stripe& stripe = stripes_[s];
    std::vector<int64_t> victims;
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      // This stripe's share of the rows to move, rounded up.
      const size_t share = (want * size_t{stripe.live} + total - 1) / total;
      if (share == 0) continue;
      scored.clear();
      scored.reserve(stripe.live);
      for (const IndexEntry& e : stripe.index) {
        if (e.record == kEmpty) continue;
        scored.emplace_back(Score(stripe.Record(e.record, record_bytes_), now), e.key);
      }
      victims = Lowest(&scored, share);
    }
    if (!to_disk) {
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      const size_t erased = EraseFrom(&stripe, victims);
      evicted_.fetch_add(erased, std::memory_order_relaxed);
      moved += erased;
      continue;
    }
    // A batch of rows per hold of the lock: pulls of this stripe wait for
    // at most a batch of disk writes.
    for (size_t begin = 0; begin < victims.size() && status->ok(); begin += kDemoteBatch) {
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      const size_t end = std::min(victims.size(), begin + kDemoteBatch);
      for (size_t v = begin; v < end; ++v) {
        const int64_t key = victims[v];
        const uint64_t hash = Mix64(static_cast<uint64_t>(key));
        const size_t slot = stripe.FindSlot(hash, key);
        if (slot == kEmpty) continue;  // removed (or moved) since it was chosen
        const uint32_t rec = stripe.index[slot].record;
        *status =
            stripe.tier->Put(hash, key, stripe.Record(rec, record_bytes_), stripe.Generation(rec));
        if (!status->ok()) break;
        stripe.EraseSlot(slot);
        cold_rows_.fetch_add(1, std::memory_order_relaxed);
        ++moved;
      }
    }
  }
  demotions_.fetch_add(to_disk ? moved : 0, std::memory_order_relaxed);
  return moved;
}

size_t Table::EvictAcrossTiers() {
  if (!has_tier() || config_.policy.max_rows == 0) return 0;
  const uint32_t now = Now();
  size_t evicted = 0;
  std::vector<std::pair<uint64_t, int64_t>> scored;
  for (uint32_t s = 0; s < kStripes; ++s) {
    Stripe& stripe = stripes_[s];
    const uint64_t quota = stripe_quota_[s];
    size_t rows;
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      rows = stripe.live + stripe.tier->rows();
      if (rows <= quota + quota / 32) continue;
      scored.clear();
      for (const IndexEntry& e : stripe.index) {
        if (e.record == kEmpty) continue;
        scored.emplace_back(Score(stripe.Record(e.record, record_bytes_), now), e.key);
      }
    }
    const Status read = ForEachCold(
        &stripe, [&] { return std::shared_lock<std::shared_mutex>(stripe.mu); },
        [&](uint32_t, int64_t key, const char* record) {
          scored.emplace_back(Score(record, now), key);
        });
    if (!read.ok()) {
      SetTierError(read.message());
      continue;
    }
    // Down to the quota less the same slack EvictFrom leaves.
    const std::vector<int64_t> victims = Lowest(&scored, rows - quota + quota / 32);
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    evicted += EraseFrom(&stripe, victims);
  }
  evicted_.fetch_add(evicted, std::memory_order_relaxed);
  return evicted;
}

size_t Table::RamBytes(bool fixed_only) const {
  size_t total = sketch_ ? sketch_->bytes() : 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    const Stripe& stripe = stripes_[s];
    std::shared_lock<std::shared_mutex> lock(stripe.mu);
    total +=
        stripe.removed.capacity() * sizeof(Removal) + (stripe.tier ? stripe.tier->ram_bytes() : 0);
    if (fixed_only) continue;
    total += size_t{stripe.num_records} * (record_bytes_ + sizeof(uint16_t)) +
             stripe.index.size() * sizeof(IndexEntry) +
             stripe.free_records.capacity() * sizeof(uint32_t);
  }
  return total;
}

size_t Table::ram_fixed_bytes() const { return RamBytes(/*fixed_only=*/true); }

char* Table::ScratchRecord() const {
  thread_local std::vector<char> scratch;
  scratch.resize(record_bytes_);
  return scratch.data();
}

size_t Table::ram_rows() const {
  const int64_t ram =
      rows_.load(std::memory_order_relaxed) - cold_rows_.load(std::memory_order_relaxed);
  return ram < 0 ? 0 : static_cast<size_t>(ram);
}

void Table::SetTierError(const std::string& error) {
  std::lock_guard<std::mutex> lock(tier_error_mu_);
  tier_error_ = error;
}

void Table::UpdateTierRates(double seconds) {
  const TierStats now = tier_stats();
  std::lock_guard<std::mutex> lock(tier_error_mu_);
  if (seconds > 0) {
    rates_.promotions_per_s = (now.promotions - rates_.promotions) / seconds;
    rates_.demotions_per_s = (now.demotions - rates_.demotions) / seconds;
    rates_.disk_reads_per_s = (now.disk_reads - rates_.disk_reads) / seconds;
  }
  rates_.promotions = now.promotions;
  rates_.demotions = now.demotions;
  rates_.disk_reads = now.disk_reads;
}

TierStats Table::tier_stats() const {
  TierStats t;
  t.ram_rows = ram_rows();
  const int64_t cold = cold_rows_.load(std::memory_order_relaxed);
  t.disk_rows = cold < 0 ? 0 : static_cast<uint64_t>(cold);
  t.ram_bytes = bytes();
  for (uint32_t s = 0; s < kStripes && has_tier(); ++s) {
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    t.disk_bytes += stripes_[s].tier->disk_bytes();
    t.disk_reads += stripes_[s].tier->reads();
  }
  t.promotions = promotions_.load(std::memory_order_relaxed);
  t.demotions = demotions_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(tier_error_mu_);
  t.error = tier_error_;
  t.promotions_per_s = rates_.promotions_per_s;
  t.demotions_per_s = rates_.demotions_per_s;
  t.disk_reads_per_s = rates_.disk_reads_per_s;
  return t;
}

uint32_t Table::Now() const {
  if (config_.policy.clock == static_cast<uint64_t>(ClockKind::kSeconds)) {
    return static_cast<uint32_t>(std::time(nullptr));
  }
  return static_cast<uint32_t>(pushes_.load(std::memory_order_relaxed));
}

void Table::ReadValues(const char* record, float* out) const {
  LoadValues(record + sizeof(RowHeader), config_.policy.value_dtype, config_.dim, out);
}

void Table::ReadSlots(const char* record, float* out) const {
  LoadValues(record + sizeof(RowHeader) + value_bytes_, config_.policy.slot_dtype, slot_floats_,
             out);
}

void Table::WriteRow(char* record, int64_t id, uint32_t step, const float* values,
                     const float* slots, bool stochastic) {
  const uint64_t key =
      Mix64(Mix64(config_.seed ^ kRoundSalt) ^ static_cast<uint64_t>(id)) + step * kGolden;
  StoreValues(values, config_.policy.value_dtype, stochastic, key, config_.dim,
              record + sizeof(RowHeader));
  if (slot_floats_ == 0) return;
  StoreValues(slots, config_.policy.slot_dtype, stochastic, key ^ kSlotRoundSalt, slot_floats_,
              record + sizeof(RowHeader) + value_bytes_);
}

bool Table::ProbabilityAdmits(int64_t id) const {
  const uint64_t bits = Mix64(Mix64(config_.seed ^ kAdmitSalt) ^ static_cast<uint64_t>(id));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0) <
         static_cast<double>(config_.policy.probability);
}

bool Table::AdmitOnPush(uint64_t hash, int64_t id, std::vector<uint64_t>* counted) {
  switch (static_cast<AdmissionKind>(config_.policy.admission)) {
    case AdmissionKind::kAll:
      return true;
    case AdmissionKind::kProbability:
      return ProbabilityAdmits(id);
    case AdmissionKind::kFrequency:
      break;
  }
  // Count each id once per push: `counted` is an open-addressing set of
  // hashes (0 marks a free cell; a hash of 0 is stored as 1, which at worst
  // merges two ids' counts in one push).
  const uint64_t h = hash == 0 ? 1 : hash;
  const size_t mask = counted->size() - 1;
  size_t i = (h >> 7) & mask;
  while ((*counted)[i] != 0) {
    if ((*counted)[i] == h) return false;  // counted (and refused) earlier in this push
    i = (i + 1) & mask;
  }
  (*counted)[i] = h;
  return sketch_->Add(hash) >= config_.policy.min_count;
}

void Table::Unadmitted(int64_t id, float* out) const {
  if (config_.policy.unadmitted == static_cast<uint64_t>(UnadmittedValue::kInitial)) {
    InitializeRow(config_.initializer, config_.seed, id, config_.dim, out);
  } else {
    std::memset(out, 0, sizeof(float) * config_.dim);
  }
}

void Table::GroupByStripe(const int64_t* ids, size_t n, std::vector<uint64_t>* hashes,
                          std::vector<uint32_t>* order, std::vector<uint32_t>* starts) const {
  hashes->resize(n);
  order->resize(n);
  starts->assign(kStripes + 1, 0);
  std::vector<uint32_t>& s = *starts;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t h = Mix64(static_cast<uint64_t>(ids[i]));
    (*hashes)[i] = h;
    ++s[StripeOf(h) + 1];
  }
  for (uint32_t k = 0; k < kStripes; ++k) s[k + 1] += s[k];
  std::vector<uint32_t> next(s.begin(), s.end() - 1);
  for (size_t i = 0; i < n; ++i) {
    (*order)[next[StripeOf((*hashes)[i])]++] = static_cast<uint32_t>(i);
  }
}

uint32_t Table::FindOrCreate(Stripe* stripe, uint64_t hash, int64_t id) {
  uint32_t rec = stripe->Find(hash, id);
  if (rec != kEmpty) return rec;
  rec = stripe->Insert(hash, id, record_bytes_);
  if (rec == kEmpty) return kEmpty;
  rows_.fetch_add(1, std::memory_order_relaxed);
  char* r = stripe->Record(rec, record_bytes_);
  auto* header = reinterpret_cast<RowHeader*>(r);
  header->step = 0;
  header->touched = Now();
  stripe->Generation(rec) = static_cast<uint16_t>(generation_.load(std::memory_order_relaxed));
  if (wide_) {
    float* values = reinterpret_cast<float*>(r + sizeof(RowHeader));
    InitializeRow(config_.initializer, config_.seed, id, config_.dim, values);
    InitializeSlots(config_.optimizer, config_.dim, values + config_.dim);
    return rec;
  }
  thread_local std::vector<float> values, slots;
  values.resize(config_.dim);
  slots.resize(slot_floats_);
  InitializeRow(config_.initializer, config_.seed, id, config_.dim, values.data());
  InitializeSlots(config_.optimizer, config_.dim, slots.data());
  WriteRow(r, id, 0, values.data(), slots.data(), /*stochastic=*/false);
  return rec;
}

void Table::ReadState(const int64_t* ids, size_t n, float* out) const {
  const uint32_t dim = config_.dim;
  const size_t width = StateFloats(dim, slot_floats_);
  for (size_t i = 0; i < n; ++i) {
    float* row = out + i * width;
    const uint64_t hash = Mix64(static_cast<uint64_t>(ids[i]));
    const Stripe& stripe = stripes_[StripeOf(hash)];
    std::shared_lock<std::shared_mutex> lock(stripe.mu);
    const uint32_t rec = stripe.Find(hash, ids[i]);
    uint32_t step = kNoState;
    if (rec == kEmpty) {
      std::memset(row, 0, sizeof(float) * (width - 1));
    } else {
      const char* r = stripe.Record(rec, record_bytes_);
      step = reinterpret_cast<const RowHeader*>(r)->step;
      ReadValues(r, row);
      if (slot_floats_) ReadSlots(r, row + dim);
    }
    std::memcpy(row + width - 1, &step, sizeof(step));
  }
}

Status Table::Pull(const int64_t* ids, size_t n, PullMode mode, float* out) {
  if (mode == PullMode::kState) {
    ReadState(ids, n, out);
    return OkStatus();
  }
  // One thread_local, bound once: in a shared library every use of a
  // thread_local calls __tls_get_addr, which the loops below would pay.
  struct Scratch {
    std::vector<uint64_t> hashes;
    std::vector<uint32_t> order, starts, missing, recs;
  };
  thread_local Scratch tls;
  Scratch& scratch = tls;
  auto& hashes = scratch.hashes;
  auto& order = scratch.order;
  auto& starts = scratch.starts;
  auto& missing = scratch.missing;
  auto& recs = scratch.recs;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  const uint32_t dim = config_.dim;
  const size_t row_bytes = sizeof(float) * dim;
  const auto admission = static_cast<AdmissionKind>(config_.policy.admission);
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    Stripe& stripe = stripes_[s];
    missing.clear();
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      // Three stages a few ids apart, so the cache misses of the index
      // probe, the record read and the output write overlap.
      const uint32_t begin = starts[s], end = starts[s + 1];
      recs.resize(end - begin);
      for (uint32_t k = begin; k < end; ++k) {
        if (k + kProbeAhead < end) stripe.PrefetchSlot(hashes[order[k + kProbeAhead]]);
        const uint32_t pos = order[k];
        const uint32_t rec = stripe.Find(hashes[pos], ids[pos]);
        recs[k - begin] = rec;
        if (rec != kEmpty)
          __builtin_prefetch(stripe.Record(rec, record_bytes_) + sizeof(RowHeader));
      }
      for (uint32_t k = begin; k < end; ++k) {
        if (k + kCopyAhead < end && recs[k + kCopyAhead - begin] != kEmpty) {
          const char* next = stripe.Record(recs[k + kCopyAhead - begin], record_bytes_);
          for (size_t b = 0; b < sizeof(RowHeader) + value_bytes_; b += 64)
            __builtin_prefetch(next + b);
        }
        const uint32_t pos = order[k];
        const uint32_t rec = recs[k - begin];
        if (rec == kEmpty) {
          missing.push_back(pos);
          continue;
        }
        const char* r = stripe.Record(rec, record_bytes_);
        if (wide_) {
          std::memcpy(out + size_t{pos} * dim, r + sizeof(RowHeader), row_bytes);
        } else {
          ReadValues(r, out + size_t{pos} * dim);
        }
      }
    }
    if (missing.empty()) continue;
    const bool tiered = stripe.tier != nullptr;
    if (mode == PullMode::kZerosNoInsert && !tiered) {
      for (uint32_t pos : missing) std::memset(out + size_t{pos} * dim, 0, row_bytes);
      continue;
    }
    if (mode == PullMode::kInitNoInsert && !tiered) {
      for (uint32_t pos : missing) {
        InitializeRow(config_.initializer, config_.seed, ids[pos], dim, out + size_t{pos} * dim);
      }
      continue;
    }
    // Training: rows are made here only for ids admitted on sight; the
    // others read the unadmitted default until a push admits them.
    size_t admitted = 0;
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    // Cold rows move into RAM while it has room; else they are read where
    // they are, and a new row is left for its push to make.
    const bool promote = !RamFull(stripe);
    for (uint32_t pos : missing) {
      float* dst = out + size_t{pos} * dim;
      if (tiered && stripe.tier->rows() != 0) {
        uint32_t rec = stripe.Find(hashes[pos], ids[pos]);  // moved in meanwhile?
        if (rec == kEmpty && promote) {
          DLT_RETURN_IF_ERROR(Promote(&stripe, hashes[pos], ids[pos], &rec));
        }
        if (rec != kEmpty) {
          ReadValues(stripe.Record(rec, record_bytes_), dst);
          continue;
        }
        if (!promote) {
          char* cold = ScratchRecord();
          uint32_t slot;
          uint16_t generation;
          DLT_RETURN_IF_ERROR(stripe.tier->Find(hashes[pos], ids[pos], cold, &slot, &generation));
          if (slot != TierFile::kNoSlot) {
            ReadValues(cold, dst);
            continue;
          }
        }
      }
      if (mode == PullMode::kZerosNoInsert) {
        std::memset(dst, 0, row_bytes);
        continue;
      }
      if (mode == PullMode::kInitNoInsert) {
        InitializeRow(config_.initializer, config_.seed, ids[pos], dim, dst);
        continue;
      }
      const bool admit = admission == AdmissionKind::kAll ||
                         (admission == AdmissionKind::kProbability && ProbabilityAdmits(ids[pos]));
      uint32_t rec = kEmpty;
      if (admit && promote) {
        const uint32_t live = stripe.live;
        rec = FindOrCreate(&stripe, hashes[pos], ids[pos]);
        admitted += stripe.live - live;
      }
      if (rec == kEmpty) {  // not admitted, or out of address space: store nothing
        if (admit) {
          InitializeRow(config_.initializer, config_.seed, ids[pos], dim, dst);
        } else {
          Unadmitted(ids[pos], dst);
        }
        continue;
      }
      ReadValues(stripe.Record(rec, record_bytes_), dst);
    }
    if (admitted) {
      admitted_.fetch_add(admitted, std::memory_order_relaxed);
      if (config_.policy.max_rows && !tiered) EvictFrom(&stripe, Now());
    }
  }
  return OkStatus();
}

Status Table::Push(const int64_t* ids, const float* grads, size_t n, float lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return InvalidArgument("learning rate must be finite and >= 0, got " + std::to_string(lr));
  }
  if (config_.optimizer.kind == OptimizerKind::kFtrl && !(lr > 0)) {
    return InvalidArgument("ftrl needs a learning rate > 0, got " + std::to_string(lr));
  }
  const uint32_t dim = config_.dim;
  const size_t bad = FirstNonFinite(grads, n * dim);
  if (bad < n * dim) {
    return InvalidArgument("gradient row " + std::to_string(bad / dim) + " (id " +
                           std::to_string(ids[bad / dim]) +
                           ") holds a non-finite value; nothing applied");
  }
  WaitForRoom();
  pushes_.fetch_add(1, std::memory_order_relaxed);
  const uint32_t now = Now();
  struct Scratch {  // as in Pull: one thread_local, bound once
    std::vector<uint64_t> hashes, counted;
    std::vector<uint32_t> order, starts, recs, slot_of, firsts, unique_of, kept;
    std::vector<float> summed, squares, values, slots;
  };
  thread_local Scratch tls;
  Scratch& scratch = tls;
  auto& hashes = scratch.hashes;
  auto& counted = scratch.counted;
  auto& order = scratch.order;
  auto& starts = scratch.starts;
  auto& recs = scratch.recs;
  auto& slot_of = scratch.slot_of;
  auto& firsts = scratch.firsts;
  auto& unique_of = scratch.unique_of;
  auto& kept = scratch.kept;
  auto& summed = scratch.summed;
  auto& squares = scratch.squares;
  auto& values = scratch.values;
  auto& slots = scratch.slots;
  const bool keep_squares = config_.optimizer.kind == OptimizerKind::kKerasAdagrad;
  const bool frequency = sketch_ != nullptr;
  const bool stochastic =
      config_.policy.rounding == static_cast<uint64_t>(RoundingKind::kStochastic);
  GroupByStripe(ids, n, &hashes, &order, &starts);
  for (uint32_t s = 0; s < kStripes; ++s) {
    const uint32_t begin = starts[s], end = starts[s + 1];
    if (begin == end) continue;
    Stripe& stripe = stripes_[s];
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    // Find (or admit and create) each id's record; `kept` holds the
    // positions that have one, `recs` their records.
    recs.clear();
    kept.clear();
    if (frequency) {
      size_t cap = 16;
      while (cap < 2 * size_t{end - begin}) cap <<= 1;
      counted.assign(cap, 0);
    }
    uint64_t admitted = 0, refused = 0;
    for (uint32_t k = begin; k < end; ++k) {
      if (k + kProbeAhead < end) stripe.PrefetchSlot(hashes[order[k + kProbeAhead]]);
      const uint32_t pos = order[k];
      uint32_t rec = stripe.Find(hashes[pos], ids[pos]);
      if (rec == kEmpty && stripe.tier) {
        DLT_RETURN_IF_ERROR(Promote(&stripe, hashes[pos], ids[pos], &rec));
      }
      if (rec == kEmpty) {
        if (!AdmitOnPush(hashes[pos], ids[pos], &counted)) {
          ++refused;
          continue;
        }
        rec = FindOrCreate(&stripe, hashes[pos], ids[pos]);
        if (rec == kEmpty) {
          return ResourceExhausted("table '" + config_.name +
                                   "' cannot grow: out of address space");
        }
        ++admitted;
      }
      kept.push_back(pos);
      recs.push_back(rec);
    }
    if (admitted) admitted_.fetch_add(admitted, std::memory_order_relaxed);
    if (refused) refused_.fetch_add(refused, std::memory_order_relaxed);
    const uint32_t count = static_cast<uint32_t>(kept.size());
    // Deduplicate by record: slot_of maps a hash slot to an index in firsts.
    size_t cap = 16;
    while (cap < 2 * size_t{count}) cap <<= 1;
    slot_of.assign(cap, kEmpty);
    firsts.clear();
    bool duplicates = false;
    unique_of.resize(count);
    for (uint32_t k = 0; k < count; ++k) {
      size_t i = (size_t{recs[k]} * 0x9e3779b1u) & (cap - 1);
      while (slot_of[i] != kEmpty && recs[firsts[slot_of[i]]] != recs[k]) {
        i = (i + 1) & (cap - 1);
      }
      if (slot_of[i] == kEmpty) {
        slot_of[i] = static_cast<uint32_t>(firsts.size());
        firsts.push_back(k);
      } else {
        duplicates = true;
      }
      unique_of[k] = slot_of[i];
    }
    if (duplicates) {
      summed.assign(firsts.size() * dim, 0.0f);
      if (keep_squares) squares.assign(firsts.size() * dim, 0.0f);
      for (uint32_t k = 0; k < count; ++k) {
        const float* g = grads + size_t{kept[k]} * dim;
        float* acc = summed.data() + size_t{unique_of[k]} * dim;
        for (uint32_t j = 0; j < dim; ++j) acc[j] += g[j];
        if (!keep_squares) continue;
        float* sq = squares.data() + size_t{unique_of[k]} * dim;
        for (uint32_t j = 0; j < dim; ++j) sq[j] += g[j] * g[j];
      }
    }
    const size_t touched_bytes = record_bytes_;
    const auto generation = static_cast<uint16_t>(generation_.load(std::memory_order_relaxed));
    if (!wide_) {
      values.resize(dim);
      slots.resize(slot_floats_);
    }
    for (size_t u = 0; u < firsts.size(); ++u) {
      if (u + kApplyAhead < firsts.size()) {  // the record and gradient a few rows ahead
        const uint32_t ahead = firsts[u + kApplyAhead];
        const char* next = stripe.Record(recs[ahead], record_bytes_);
        for (size_t b = 0; b < touched_bytes; b += 64) __builtin_prefetch(next + b, 1);
        if (!duplicates) {
          const char* g = reinterpret_cast<const char*>(grads + size_t{kept[ahead]} * dim);
          for (size_t b = 0; b < sizeof(float) * dim; b += 64) __builtin_prefetch(g + b);
        }
      }
      const uint32_t k = firsts[u];
      const float* g = duplicates ? summed.data() + u * dim : grads + size_t{kept[k]} * dim;
      char* r = stripe.Record(recs[k], record_bytes_);
      auto* header = reinterpret_cast<RowHeader*>(r);
      header->touched = now;
      stripe.Generation(recs[k]) = generation;
      const float* sq = duplicates && keep_squares ? squares.data() + u * dim : nullptr;
      if (wide_) {
        float* v = reinterpret_cast<float*>(r + sizeof(RowHeader));
        ApplyRow(config_.optimizer, dim, lr, g, sq, v, v + dim, &header->step);
        continue;
      }
      ReadValues(r, values.data());
      ReadSlots(r, slots.data());
      ApplyRow(config_.optimizer, dim, lr, g, sq, values.data(), slots.data(), &header->step);
      WriteRow(r, ids[kept[k]], header->step, values.data(), slots.data(), stochastic);
    }
    if (admitted && config_.policy.max_rows && !stripe.tier) EvictFrom(&stripe, now);
  }
  return OkStatus();
}

void Table::EvictFrom(Stripe* stripe, uint32_t now) {
  const uint64_t quota = stripe_quota_[stripe - stripes_.get()];
  if (stripe->live <= quota) return;
  // Evict a little below the quota, so eviction runs once per many inserts.
  const uint64_t slack = quota / 32;
  const size_t want = static_cast<size_t>(stripe->live - quota + slack);
  thread_local std::vector<std::pair<uint64_t, int64_t>> scored;  // (score, key)
  scored.clear();
  for (const IndexEntry& e : stripe->index) {
    if (e.record == kEmpty) continue;
    scored.emplace_back(Score(stripe->Record(e.record, record_bytes_), now), e.key);
  }
  evicted_.fetch_add(EraseFrom(stripe, Lowest(&scored, want)), std::memory_order_relaxed);
}

size_t Table::Remove(uint64_t min_count, uint64_t unseen_for, uint32_t now,
                     std::atomic<uint64_t>* counter) {
  if (min_count == 0 && unseen_for == 0) return 0;
  size_t removed = 0;
  std::vector<int64_t> victims;
  for (uint32_t s = 0; s < kStripes; ++s) {
    Stripe& stripe = stripes_[s];
    // A slice of the index per lock hold. Entries a removal shifts into an
    // examined slice, or an index growth between holds, can hide a row
    // from this pass; the next pass takes it.
    for (size_t begin = 0;; begin += kRemovalSlots) {
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      if (begin >= stripe.index.size()) break;
      const size_t end = std::min(stripe.index.size(), begin + kRemovalSlots);
      victims.clear();
      for (size_t i = begin; i < end; ++i) {
        const IndexEntry& e = stripe.index[i];
        if (e.record == kEmpty) continue;
        const auto* h = reinterpret_cast<const RowHeader*>(stripe.Record(e.record, record_bytes_));
        const bool rare = min_count != 0 && h->step < min_count;
        const bool stale = unseen_for != 0 && uint32_t(now - h->touched) > unseen_for;
        if (rare || stale) victims.push_back(e.key);
      }
      removed += EraseFrom(&stripe, victims);
    }
    // Cold rows: each batch of pages is read and judged under the lock.
    const Status read = ForEachCold(
        &stripe, [&] { return std::unique_lock<std::shared_mutex>(stripe.mu); },
        [&](uint32_t slot, int64_t key, const char* record) {
          const auto* h = reinterpret_cast<const RowHeader*>(record);
          const bool rare = min_count != 0 && h->step < min_count;
          const bool stale = unseen_for != 0 && uint32_t(now - h->touched) > unseen_for;
          if (!rare && !stale) return;
          EraseCold(&stripe, slot, key);
          ++removed;
        });
    if (!read.ok()) SetTierError(read.message());
  }
  counter->fetch_add(removed, std::memory_order_relaxed);
  return removed;
}

size_t Table::Shrink(uint64_t min_count, uint64_t unseen_for, uint32_t now) {
  return Remove(min_count, unseen_for, now, &shrunk_);
}

size_t Table::Expire(uint32_t now) { return Remove(0, config_.policy.ttl, now, &expired_); }

Status Table::Assign(const int64_t* ids, const float* values, size_t n) {
  const size_t bad = FirstNonFinite(values, n * config_.dim);
  if (bad < n * config_.dim) {
    return InvalidArgument("row " + std::to_string(bad / config_.dim) + " (id " +
                           std::to_string(ids[bad / config_.dim]) +
                           ") holds a non-finite value; nothing assigned");
  }
  return Import(ids, values, nullptr, nullptr, n, nullptr, /*to_disk=*/false);
}

Status Table::Import(const int64_t* ids, const float* values, const float* slots,
                     const uint32_t* steps, size_t n, const uint32_t* touched, bool to_disk) {
  const size_t bad = FirstNonFinite(values, n * config_.dim);
  if (bad < n * config_.dim) {
    return InvalidArgument("row " + std::to_string(bad / config_.dim) + " (id " +
                           std::to_string(ids[bad / config_.dim]) +
                           ") holds a non-finite value; nothing imported");
  }
  if (slots != nullptr && slot_floats_ > 0) {
    const size_t bad_slot = FirstNonFinite(slots, n * slot_floats_);
    if (bad_slot < n * slot_floats_) {
      return InvalidArgument("optimizer slots of row " + std::to_string(bad_slot / slot_floats_) +
                             " (id " + std::to_string(ids[bad_slot / slot_floats_]) +
                             ") hold a non-finite value; nothing imported");
    }
  }
  thread_local std::vector<uint64_t> hashes;
  thread_local std::vector<uint32_t> order, starts;
  thread_local std::vector<float> fresh_slots;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  const uint32_t dim = config_.dim;
  const uint32_t now = Now();
  fresh_slots.resize(slot_floats_);
  InitializeSlots(config_.optimizer, dim, fresh_slots.data());
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    Stripe& stripe = stripes_[s];
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    bool inserted = false;
    const auto generation = static_cast<uint16_t>(generation_.load(std::memory_order_relaxed));
    for (uint32_t k = starts[s]; k < starts[s + 1]; ++k) {
      const uint32_t pos = order[k];
      uint32_t rec = stripe.Find(hashes[pos], ids[pos]);
      if (rec == kEmpty && stripe.tier && to_disk && RamFull(stripe)) {
        // RAM is full (a load past the budget): the row goes to disk, over
        // its cold copy if it has one.
        char* cold = ScratchRecord();
        uint32_t slot = TierFile::kNoSlot;
        uint16_t old_generation;
        DLT_RETURN_IF_ERROR(stripe.tier->Find(hashes[pos], ids[pos], cold, &slot, &old_generation));
        const float* row_slots = slots ? slots + size_t{pos} * slot_floats_ : fresh_slots.data();
        FillRecord(cold, ids[pos], steps ? steps[pos] : 0, touched ? touched[pos] : now,
                   values + size_t{pos} * dim, row_slots);
        if (slot != TierFile::kNoSlot) {
          DLT_RETURN_IF_ERROR(stripe.tier->Rewrite(slot, ids[pos], cold, generation));
          continue;
        }
        DLT_RETURN_IF_ERROR(stripe.tier->Put(hashes[pos], ids[pos], cold, generation));
        rows_.fetch_add(1, std::memory_order_relaxed);
        cold_rows_.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      if (rec == kEmpty && stripe.tier) {
        DLT_RETURN_IF_ERROR(Promote(&stripe, hashes[pos], ids[pos], &rec));
      }
      if (rec == kEmpty) {
        rec = stripe.Insert(hashes[pos], ids[pos], record_bytes_);
        if (rec == kEmpty) {
          return ResourceExhausted("table '" + config_.name +
                                   "' cannot grow: out of address space");
        }
        rows_.fetch_add(1, std::memory_order_relaxed);
        inserted = true;
      }
      char* r = stripe.Record(rec, record_bytes_);
      auto* header = reinterpret_cast<RowHeader*>(r);
      header->step = steps ? steps[pos] : 0;
      header->touched = touched ? touched[pos] : now;
      stripe.Generation(rec) = generation;
      const float* row_slots = slots ? slots + size_t{pos} * slot_floats_ : fresh_slots.data();
      WriteRow(r, ids[pos], header->step, values + size_t{pos} * dim, row_slots,
               /*stochastic=*/false);
    }
    if (inserted && config_.policy.max_rows && !stripe.tier) EvictFrom(&stripe, now);
  }
  return OkStatus();
}

size_t Table::size() const {
  const int64_t rows = rows_.load(std::memory_order_relaxed);
  return rows < 0 ? 0 : static_cast<size_t>(rows);
}

size_t Table::bytes() const { return RamBytes(/*fixed_only=*/false); }

TableCounters Table::counters() const {
  TableCounters c;
  c.admitted = admitted_.load(std::memory_order_relaxed);
  c.refused = refused_.load(std::memory_order_relaxed);
  c.expired = expired_.load(std::memory_order_relaxed);
  c.evicted = evicted_.load(std::memory_order_relaxed);
  c.shrunk = shrunk_.load(std::memory_order_relaxed);
  return c;
}

bool Table::SketchHolds(uint32_t first_bucket, uint32_t end_bucket) const {
  return sketch_ != nullptr && first_bucket >= first_bucket_ && end_bucket <= end_bucket_ &&
         first_bucket <= end_bucket;
}

void Table::ReadSketch(uint32_t bucket, uint8_t* counters, uint32_t* added) const {
  std::shared_lock<std::shared_mutex> lock(stripes_[stripe_of_bucket_[bucket]].mu);
  sketch_->ReadSlice(bucket, counters, added);
}

void Table::WriteSketch(uint32_t bucket, const uint8_t* counters, uint32_t added) {
  std::unique_lock<std::shared_mutex> lock(stripes_[stripe_of_bucket_[bucket]].mu);
  sketch_->WriteSlice(bucket, counters, added);
}

uint32_t Table::SketchEstimate(int64_t id) const {
  if (!sketch_) return 0;
  const uint64_t hash = Mix64(static_cast<uint64_t>(id));
  std::shared_lock<std::shared_mutex> lock(stripes_[StripeOf(hash)].mu);
  return sketch_->Estimate(hash);
}

void Table::EraseCold(Stripe* stripe, uint32_t slot, int64_t key) {
  stripe->tier->Remove(slot);
  ++stripe->removals;
  cold_rows_.fetch_sub(1, std::memory_order_relaxed);
  rows_.fetch_sub(1, std::memory_order_relaxed);
  if (logging_.load(std::memory_order_relaxed)) {
    stripe->removed.push_back(Removal{key, generation_.load(std::memory_order_relaxed)});
  }
}

size_t Table::EraseFrom(Stripe* stripe, const std::vector<int64_t>& keys) {
  const bool log = logging_.load(std::memory_order_relaxed);
  size_t erased = stripe->EraseKeys(keys, log, generation_.load(std::memory_order_relaxed));
  rows_.fetch_sub(static_cast<int64_t>(erased), std::memory_order_relaxed);
  if (stripe->tier && stripe->tier->rows() != 0 && erased < keys.size()) {
    // The keys that were not in RAM (none is now) may be cold.
    char* scratch = ScratchRecord();
    for (int64_t key : keys) {
      const uint64_t hash = Mix64(static_cast<uint64_t>(key));
      uint32_t slot;
      uint16_t generation;
      const Status found = stripe->tier->Find(hash, key, scratch, &slot, &generation);
      if (!found.ok()) {
        SetTierError(found.message());
        continue;
      }
      if (slot == TierFile::kNoSlot) continue;
      EraseCold(stripe, slot, key);
      ++erased;
    }
  }
  if (log && stripe->removed.size() > kLogSlack + stripe->live / 4) {
    // Tracking this many removals would cost more than a full write of the
    // table: stop, and let the next save write the table in full.
    log_overflow_.store(true, std::memory_order_relaxed);
    logging_.store(false, std::memory_order_relaxed);
  }
  return erased;
}

bool Table::ChangedSince(uint16_t row_generation, uint32_t since) const {
  const uint32_t window = generation_.load(std::memory_order_relaxed) - since;
  // A window of 2^16 generations or more cannot be told apart in 16 bits:
  // every row counts as changed.
  if (window >= 0xffffu) return true;
  const auto delta = static_cast<uint16_t>(row_generation - static_cast<uint16_t>(since));
  return delta != 0 && delta <= window;
}

SaveStart Table::BeginSave(const std::string& save_id, const std::string& base_id) {
  std::lock_guard<std::mutex> lock(saves_mu_);
  SaveStart start;
  if (log_overflow_.exchange(false)) {
    saves_.clear();  // the removals since any tracked save are incomplete
  }
  for (const SaveMark& mark : saves_) {
    if (!base_id.empty() && mark.id == base_id) {
      start.tracked = true;
      start.since = mark.generation;
      start.base_clock = mark.clock;
    }
  }
  // Changes from now on carry a newer generation than this save's mark.
  const uint32_t generation = generation_.fetch_add(1);
  saves_.push_back(SaveMark{save_id, generation, Now()});
  if (saves_.size() > kTrackedSaves) saves_.erase(saves_.begin());
  // Removals at or before the oldest generation still needed are dropped.
  uint32_t keep_after = saves_.front().generation;
  if (start.tracked) keep_after = std::min(keep_after, start.since);
  for (uint32_t s = 0; s < kStripes; ++s) {
    Stripe& stripe = stripes_[s];
    std::unique_lock<std::shared_mutex> stripe_lock(stripe.mu);
    auto& log = stripe.removed;
    log.erase(std::remove_if(log.begin(), log.end(),
                             [&](const Removal& r) { return r.generation <= keep_after; }),
              log.end());
    if (log.capacity() > 2 * log.size() + 1024) log.shrink_to_fit();
  }
  logging_.store(true, std::memory_order_relaxed);
  // A log that overflowed during this call may have missed removals of
  // this save's window: the save is then written in full (the flag stays
  // set, so the next save drops the marks too).
  if (log_overflow_.load()) start.tracked = false;
  return start;
}

void Table::MarkLoaded(const std::string& save_id) {
  std::lock_guard<std::mutex> lock(saves_mu_);
  const uint32_t generation = generation_.fetch_add(1);
  saves_.assign(1, SaveMark{save_id, generation, Now()});
  log_overflow_.store(false);
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::unique_lock<std::shared_mutex> stripe_lock(stripes_[s].mu);
    stripes_[s].removed.clear();
    stripes_[s].removed.shrink_to_fit();
  }
  logging_.store(true, std::memory_order_relaxed);
}

std::vector<int64_t> Table::RemovedSince(uint32_t since) const {
  std::vector<std::pair<uint32_t, int64_t>> found;  // (bucket, id)
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    for (const Removal& r : stripes_[s].removed) {
      if (r.generation > since) found.emplace_back(BucketOf(r.key), r.key);
    }
  }
  std::sort(found.begin(), found.end());
  found.erase(std::unique(found.begin(), found.end()), found.end());
  std::vector<int64_t> ids(found.size());
  for (size_t i = 0; i < found.size(); ++i) ids[i] = found[i].second;
  return ids;
}

size_t Table::Erase(const int64_t* ids, size_t n) {
  thread_local std::vector<uint64_t> hashes;
  thread_local std::vector<uint32_t> order, starts;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  std::vector<int64_t> keys;
  size_t erased = 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    keys.clear();
    for (uint32_t k = starts[s]; k < starts[s + 1]; ++k) keys.push_back(ids[order[k]]);
    std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
    erased += EraseFrom(&stripes_[s], keys);
  }
  return erased;
}

size_t Table::EraseBuckets(uint32_t first, uint32_t end, const int64_t* keep, size_t num_keep) {
  if (first >= end || end > kNumBuckets) return 0;
  std::vector<int64_t> kept(keep, keep + num_keep);
  std::sort(kept.begin(), kept.end());
  size_t erased = 0;
  std::vector<int64_t> keys;
  // Stripes hold contiguous bucket ranges, in order.
  const auto goes = [&](int64_t key) {
    const uint32_t bucket = BucketOf(key);
    return bucket >= first && bucket < end && !std::binary_search(kept.begin(), kept.end(), key);
  };
  for (uint32_t s = stripe_of_bucket_[first]; s <= stripe_of_bucket_[end - 1]; ++s) {
    Stripe& stripe = stripes_[s];
    {
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      keys.clear();
      for (const IndexEntry& e : stripe.index) {
        if (e.record != kEmpty && goes(e.key)) keys.push_back(e.key);
      }
      erased += EraseFrom(&stripe, keys);
    }
    const Status read = ForEachCold(
        &stripe, [&] { return std::unique_lock<std::shared_mutex>(stripe.mu); },
        [&](uint32_t slot, int64_t key, const char*) {
          if (!goes(key)) return;
          EraseCold(&stripe, slot, key);
          ++erased;
        });
    if (!read.ok()) SetTierError(read.message());
  }
  return erased;
}

void Table::Reserve(size_t rows, uint32_t threads) {
  // A stripe's share of `n` rows spread over the buckets, with a margin.
  auto per_stripe_of = [](uint64_t n) { return n / kStripes + n / (kStripes * 16) + 64; };
  const uint64_t limit = ram_limit_.load(std::memory_order_relaxed);
  if (has_tier() && limit != 0 && rows > limit) {
    // The rows past the RAM limit go to disk: size the tier files for them.
    // The tier's RAM per cold slot comes out of the RAM rows' limit (twice:
    // fewer RAM rows make more cold ones).
    auto cold_per_stripe = [&](uint64_t ram_rows) { return per_stripe_of(rows - ram_rows); };
    uint64_t ram_rows = limit;
    for (int pass = 0; pass < 2; ++pass) {
      uint64_t tier_bytes = 0;
      for (uint32_t s = 0; s < kStripes; ++s) {
        std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
        tier_bytes += stripes_[s].tier->RamBytesFor(cold_per_stripe(ram_rows));
      }
      const uint64_t held = tier_bytes / ram_row_bytes();
      // Never above the limit given; a floor of a few rows per stripe.
      ram_rows = std::max<uint64_t>(std::min<uint64_t>(limit, kStripes * 64),
                                    limit > held ? limit - held : 0);
    }
    SetRamLimit(ram_rows);
    const size_t cold = cold_per_stripe(ram_rows);
    for (uint32_t s = 0; s < kStripes; ++s) {
      std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
      stripes_[s].tier->Reserve(cold);
    }
    rows = ram_rows;
  }
  const size_t per_stripe = per_stripe_of(rows);
  std::atomic<uint32_t> next{0};
  auto work = [&]() {
    for (uint32_t s; (s = next.fetch_add(1)) < kStripes;) {
      Stripe& stripe = stripes_[s];
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      size_t capacity = std::max<size_t>(16, stripe.index.size());
      while (IndexMustGrow(per_stripe, capacity)) capacity *= 2;
      if (capacity > stripe.index.size()) stripe.GrowTo(capacity);  // writes every slot
      const uint32_t first_new = stripe.num_chunks;
      while (stripe.num_chunks < kMaxChunks &&
             Stripe::FirstRecordOf(stripe.num_chunks) < per_stripe) {
        if (!stripe.AddChunk(record_bytes_)) break;
      }
      // Fault in now, a page at a time, the new memory the expected rows
      // will use (not the rest of the last chunk, which may be as large).
      for (uint32_t k = first_new; k < stripe.num_chunks; ++k) {
        const size_t first_record = Stripe::FirstRecordOf(k);
        if (first_record >= per_stripe) break;
        const size_t used =
            std::min(stripe.chunk_bytes[k], (per_stripe - first_record) * record_bytes_);
        for (size_t b = 0; b < used; b += 4096) stripe.chunks[k][b] = 0;
      }
    }
  };
  // Sizing is best effort: a stripe that cannot get the memory (or a
  // thread that cannot start) leaves the rest to grow as rows arrive.
  auto guarded = [&]() {
    try {
      work();
    } catch (const std::exception&) {
    }
  };
  std::vector<std::thread> pool;
  for (uint32_t t = 1; t < std::max<uint32_t>(1, threads); ++t) {
    try {
      pool.emplace_back(guarded);
    } catch (const std::exception&) {
      break;
    }
  }
  guarded();
  for (std::thread& t : pool) t.join();
}

bool Table::Exporter::List(Stripe* stripe) {
  order_.clear();
  // Rows may move between tiers while the cold rows are read a batch at a
  // time; a listing that saw a move is made again, the third time under
  // one hold of the lock.
  for (int attempt = 0; attempt < 3; ++attempt) {
    order_.clear();
    std::shared_lock<std::shared_mutex> whole;
    if (attempt == 2) whole = std::shared_lock<std::shared_mutex>(stripe->mu);
    uint64_t removals, layout;
    {
      std::shared_lock<std::shared_mutex> lock;
      if (attempt < 2) lock = std::shared_lock<std::shared_mutex>(stripe->mu);
      order_.reserve(stripe->live);
      removals = removals_ = stripe->removals;
      layout = stripe->tier ? stripe->tier->layout() : 0;
      for (const IndexEntry& e : stripe->index) {
        if (e.record == kEmpty) continue;
        if (changed_only_ && !table_->ChangedSince(stripe->Generation(e.record), since_)) continue;
        order_.push_back(Entry{BucketOf(e.key), e.record, e.key, false});
      }
    }
    if (!stripe->tier) break;
    error_ = table_->ForEachCold(
        stripe,
        [&] {
          return attempt < 2 ? std::shared_lock<std::shared_mutex>(stripe->mu)
                             : std::shared_lock<std::shared_mutex>();
        },
        [&](uint32_t slot, int64_t key, const char*) {
          if (changed_only_ && !table_->ChangedSince(stripe->tier->Generation(slot), since_)) {
            return;
          }
          order_.push_back(Entry{BucketOf(key), slot, key, true});
        });
    if (!error_.ok()) return false;
    std::shared_lock<std::shared_mutex> lock;
    if (attempt < 2) lock = std::shared_lock<std::shared_mutex>(stripe->mu);
    if (stripe->removals == removals && stripe->tier->layout() == layout) break;
  }
  std::sort(order_.begin(), order_.end(), [](const Entry& a, const Entry& b) {
    return a.bucket != b.bucket ? a.bucket < b.bucket : a.id < b.id;
  });
  return true;
}

bool Table::Exporter::Copy(Stripe* stripe, const Entry& e, const RowBuffers& out, size_t i) {
  const Table& t = *table_;
  const char* r = nullptr;
  thread_local std::vector<char> slot_data;
  if (stripe->removals == removals_ && !e.cold) {
    r = stripe->Record(e.record, t.record_bytes_);
  } else {
    // Look the row up wherever it is now (removed rows, and records
    // reused since the listing, are skipped).
    const uint64_t hash = Mix64(static_cast<uint64_t>(e.id));
    const uint32_t rec = stripe->Find(hash, e.id);
    if (rec != kEmpty) {
      r = stripe->Record(rec, t.record_bytes_);
    } else if (stripe->tier) {
      slot_data.resize(stripe->tier->slot_bytes());
      uint32_t slot = TierFile::kNoSlot;
      uint16_t generation;
      if (e.cold && e.record < stripe->tier->slots() && stripe->tier->Used(e.record)) {
        error_ = stripe->tier->ReadSlot(e.record, slot_data.data());
        if (!error_.ok()) return false;
        if (TierFile::KeyOf(slot_data.data()) == e.id) slot = e.record;
      }
      if (slot == TierFile::kNoSlot) {  // moved since the listing
        error_ =
            stripe->tier->Find(hash, e.id, slot_data.data() + sizeof(int64_t), &slot, &generation);
        if (!error_.ok()) return false;
      }
      if (slot != TierFile::kNoSlot) r = TierFile::RecordOf(slot_data.data());
    }
    if (r == nullptr) return false;
  }
  const auto* header = reinterpret_cast<const RowHeader*>(r);
  out.ids[i] = e.id;
  out.buckets[i] = e.bucket;
  out.steps[i] = header->step;
  if (out.touched) out.touched[i] = header->touched;
  t.ReadValues(r, out.values + i * t.config_.dim);
  if (t.slot_floats_) t.ReadSlots(r, out.slots + i * t.slot_floats_);
  return true;
}

size_t Table::Exporter::Next(size_t max_rows, const RowBuffers& out) {
  size_t written = 0;
  while (written < max_rows && stripe_ < kStripes && error_.ok()) {
    Stripe& stripe = table_->stripes_[stripe_];
    if (!loaded_) {
      if (!List(&stripe)) break;
      loaded_ = true;
      pos_ = 0;
    }
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      for (; pos_ < order_.size() && written < max_rows; ++pos_) {
        if (Copy(&stripe, order_[pos_], out, written)) {
          ++written;
        } else if (!error_.ok()) {
          break;
        }
      }
    }
    if (pos_ == order_.size()) {
      ++stripe_;
      loaded_ = false;
      order_.clear();
      order_.shrink_to_fit();
    }
  }
  return error_.ok() ? written : 0;
}

}  // namespace dlt
