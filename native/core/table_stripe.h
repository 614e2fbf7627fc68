// Private to the table's own sources (table.cc, table_tier.cc,
// table_policy.cc, table_export.cc): a stripe's layout (index, arena,
// removal log, disk tier), the record layout and the constants they share.
// Nothing else includes it.
#ifndef TF_DLT_NATIVE_CORE_TABLE_STRIPE_H_
#define TF_DLT_NATIVE_CORE_TABLE_STRIPE_H_

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <vector>

#include "native/core/prefetch.h"
#include "native/core/table.h"

namespace dlt {

constexpr uint32_t kEmpty = 0xffffffffu;
// Records in the first arena chunk of a stripe; chunk k holds kBase << k.
constexpr uint32_t kBaseRecordsLog2 = 6;
constexpr uint32_t kMaxChunks = 32;
constexpr size_t kHugePage = size_t{2} << 20;
// The smallest arena chunk on huge pages in a table that keeps its pages
// small: the stripe's records before it fill 16 huge pages or more, so its
// last, partly used one adds at most a sixteenth.
constexpr size_t kFrugalHugeChunk = 16 * kHugePage;
// Prefetch distances (in ids) of the batched lookup's index probes and row copies.
constexpr uint32_t kProbeAhead = 32;
constexpr uint32_t kCopyAhead = 8;
// The keeper's cold-row choice (Table::Coldest): index slots sampled, and
// the smallest quantile of their scores a victim is at or below (1/16).
constexpr uint32_t kColdSampleSlots = 1024;
constexpr size_t kColdSampleQuantile = 16;
// Rows ahead whose record and gradient a push prefetches.
constexpr uint32_t kApplyAhead = 2;
// Index slots a removal pass examines per hold of a stripe's lock.
constexpr size_t kRemovalSlots = 8192;
// Passes over a stripe a removal that must leave no row (Table::EraseWhere)
// makes: the last under one hold of its lock.
constexpr int kExactPasses = 3;
// Candidates past those it wants an eviction across tiers takes in order
// (Table::EraseLowest): a sixteenth of them, and this many more.
constexpr size_t kEvictSpare = 16;
// A stripe gives freed records' memory back once this many, or this many
// bytes of them, and a tenth of its records, are free (Stripe::Compact):
// the memory keeper making room for a tier file's doubling moves about a
// tenth of the RAM rows out. (Counted in records alone, a stripe of wide
// rows, 64 KiB each, kept up to 64 MiB of freed records for good: after a
// load into a tiered table, the process held 120 MiB past its rows.)
constexpr uint32_t kCompactMinFree = 1024;
constexpr size_t kCompactMinFreeBytes = size_t{256} << 10;
// Disk tier pages a pass over cold rows reads per hold of a stripe's lock,
// and rows a demotion writes per hold.
constexpr uint32_t kColdPagesPerHold = 32;
constexpr size_t kColdBytesPerHold = size_t{1} << 20;
constexpr size_t kDemoteBatch = 256;
// A push waits for the memory keeper while the RAM rows are past their
// limit by 1/16, in naps of kRoomWaitMicros, for kRoomWaitSeconds at most:
// back-pressure instead of memory growth, so under sustained inserts a
// shard grows as fast as the keeper moves rows to disk and its memory stays
// within the budget. While the keeper fails to move rows (a disk error; it
// tries again soon) pushes go on until the RAM rows pass their limit by
// 1/kFailingKeeperSlack, then wait for it as above: they waited for no
// failing keeper, and one error let a shard's RAM rows grow 25-fold, its
// memory 4 times its budget.
constexpr int kRoomWaitMicros = 200;
constexpr int kRoomWaitSeconds = 10;
constexpr uint64_t kFailingKeeperSlack = 4;
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
static_assert(sizeof(RowHeader) == Table::kRecordHeaderBytes, "row header layout");

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

// A row's age at `now` in clock units, modulo 2^32 (a wrapped push clock
// still measures ages). A stamp ahead of `now` (clock skew between the hosts
// of a save and a load, a clock stepped back) is age 0, never ancient.
inline uint32_t AgeAt(uint32_t now, uint32_t touched) {
  const uint32_t age = now - touched;
  return age >= (uint32_t{1} << 31) ? 0 : age;
}

// A stripe's removal log may hold this many entries plus a quarter of its
// rows; past that the table stops tracking (its next delta is written in
// full) rather than grow without bound.
constexpr size_t kLogSlack = 4096;
// A stripe's change log (Table::TakeChanges) may hold this many ids plus
// one per four rows (2 bytes a row at most); past that the consumer takes
// the table whole again.
constexpr size_t kChangeLogSlack = size_t{1} << 16;

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

// One stripe: lock, index and arena. A removed row's record goes to a free
// list and is reused; records move only when the stripe compacts (Compact,
// under its lock, bumping `removals`).
struct Table::Stripe {
  mutable std::shared_mutex mu;
  Index index;               // capacity is a power of two (or empty)
  uint32_t num_records = 0;  // records ever allocated (live + free)
  uint32_t live = 0;
  // Arena chunks of at least this many bytes are mapped on 2 MiB pages
  // (Table::KeepPagesSmall).
  size_t huge_from = kHugePage;
  // Records whose arena pages a load's sizing faulted in ahead of the rows
  // (Table::Reserve); Compact gives back those no row came to use.
  uint32_t faulted = 0;
  // Where the memory keeper's next sweep for cold rows starts (an index
  // slot; taken modulo the index size).
  std::atomic<size_t> sweep{0};
  // The memory keeper's last cut: the lowest score (at clock `cut_now`)
  // among the rows it weighed moving out (Coldest), about the coldest RAM
  // row's. Near the RAM limit a cold row moves back into RAM only when it
  // scores above the cut (Table::AboveCut): one no hotter than the
  // coldest RAM row would only push out a row as hot. Written under the
  // lock in any mode, read under it exclusively: a push sees one cut.
  // Relaxed: the two may come from different passes.
  std::atomic<bool> has_cut{false};
  std::atomic<uint64_t> cut{0};
  std::atomic<uint32_t> cut_now{0};
  // Rows ever removed or moved between tiers (exports re-check rows after
  // one).
  uint64_t removals = 0;
  std::vector<uint32_t> free_records;
  char* chunks[kMaxChunks] = {};
  size_t chunk_bytes[kMaxChunks] = {};
  // Per record: the generation of its last write (change tracking).
  std::unique_ptr<uint16_t[]> generations[kMaxChunks];
  static_assert(sizeof(uint16_t) == Table::kGenerationBytes, "generation layout");
  uint32_t num_chunks = 0;
  std::vector<Removal> removed;  // ids removed while a save is tracked
  // Per row stream while its change log runs: the ids written or removed,
  // the hashes counted in the sketch (in order), and whether the log
  // outgrew its cap since it was last taken.
  struct ChangeLog {
    std::vector<int64_t> changes;
    std::vector<uint64_t> sketch_adds;
    bool overflowed = false;
  };
  ChangeLog logs[kMaxStreams];
  size_t ChangeLogBytes() const {
    size_t bytes = 0;
    for (const ChangeLog& log : logs) {
      bytes +=
          log.changes.capacity() * sizeof(int64_t) + log.sketch_adds.capacity() * sizeof(uint64_t);
    }
    return bytes;
  }
  // True when `log` (running) takes one more entry; at its cap it marks the
  // log overflowed and empties it. Caller holds mu exclusively.
  bool HasRoom(ChangeLog* log) const {
    if (log->overflowed) return false;
    const size_t rows = live + (tier ? tier->rows() : 0);
    if (log->changes.size() + log->sketch_adds.size() < kChangeLogSlack + rows / 4) return true;
    log->overflowed = true;
    std::vector<int64_t>().swap(log->changes);
    std::vector<uint64_t>().swap(log->sketch_adds);
    return false;
  }
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

  // The index slots of the first kProbeAhead ids of a run, order[begin,
  // end): a batched lookup's loop prefetches kProbeAhead ids ahead of the
  // one it probes, which never reaches these, nor any of a run shorter than
  // that (a stripe's share of a small batch: 4,096 ids over 64 stripes).
  void PrefetchFirstSlots(const uint64_t* hashes, const uint32_t* order, uint32_t begin,
                          uint32_t end) const {
    for (uint32_t k = begin; k < std::min(end, begin + kProbeAhead); ++k) {
      PrefetchSlot(hashes[order[k]]);
    }
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
    if (bytes >= huge_from) madvise(p, bytes, MADV_HUGEPAGE);
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

  // Gives back the memory of records a wave of removals freed (rows moved
  // to disk, expired, evicted, given away): free records otherwise stay in
  // the arena, and the process's memory with them. Moves the rows of the
  // highest records into free records below, unmaps or releases
  // (MADV_DONTNEED) the arena and generations above, and halves an index
  // far emptier than its load. Records move, so `removals` is bumped:
  // exports find their rows again. Also gives back the pages a load's
  // sizing faulted in past the records in use (`faulted`: sized for a RAM
  // limit that fell as the load ran, 80 MiB of wide rows stayed with the
  // process). Caller holds mu exclusively. True when records moved.
  bool Compact(size_t record_bytes) {
    const uint32_t free = num_records - live;
    // kCompactMinFree records, or fewer that hold kCompactMinFreeBytes.
    const auto min_free = static_cast<uint32_t>(
        std::clamp<size_t>(kCompactMinFreeBytes / record_bytes, 1, kCompactMinFree));
    const uint32_t spare = (min_free + 3) / 4;
    // Records [0, top) stay: the live rows and a few more for reuse.
    uint32_t top = live + live / 32 + spare;
    const bool moves = free >= min_free && free >= num_records / 10 && top < num_records;
    if (!moves) {
      top = num_records + spare;
      if (faulted <= top) return false;
    }
    faulted = 0;
    if (moves) {
      std::vector<uint32_t> below;
      below.reserve(top - live);
      for (uint32_t r : free_records) {
        if (r < top) below.push_back(r);
      }
      for (IndexEntry& e : index) {
        if (e.record == kEmpty || e.record < top) continue;
        const uint32_t to = below.back();  // as many free below top as live above it
        below.pop_back();
        std::memcpy(Record(to, record_bytes), Record(e.record, record_bytes), record_bytes);
        Generation(to) = Generation(e.record);
        e.record = to;
      }
      free_records.swap(below);
      free_records.shrink_to_fit();
      num_records = top;
      ++removals;
    }
    for (uint32_t k = num_chunks; k-- > 0;) {
      const size_t first = FirstRecordOf(k), records = size_t{1} << (k + kBaseRecordsLog2);
      if (first + records <= top) break;
      if (first >= top) {  // the whole chunk goes
        munmap(chunks[k], chunk_bytes[k]);
        chunks[k] = nullptr;
        chunk_bytes[k] = 0;
        generations[k].reset();
        num_chunks = k;
        continue;
      }
      ReleasePages(chunks[k] + (top - first) * record_bytes, chunks[k] + chunk_bytes[k]);
      ReleasePages(reinterpret_cast<char*>(generations[k].get() + (top - first)),
                   reinterpret_cast<char*>(generations[k].get() + records));
    }
    if (!moves) return false;
    // An index at under 3/16 load halves until at most 3/8 (best effort:
    // without the memory for the smaller one, it stays as it is).
    size_t capacity = index.size();
    while (capacity > 16 && !IndexMustGrow(2 * uint64_t{live}, capacity / 2)) capacity /= 2;
    if (capacity * 2 <= index.size()) {
      try {
        GrowTo(capacity);
      } catch (const std::bad_alloc&) {
      }
    }
    return true;
  }

  // Gives the whole pages within [begin, end) back to the system (they read
  // as zeros when touched again).
  static void ReleasePages(char* begin, char* end) {
    const auto page = static_cast<uintptr_t>(4096);
    const uintptr_t from = (reinterpret_cast<uintptr_t>(begin) + page - 1) & ~(page - 1);
    const uintptr_t to = reinterpret_cast<uintptr_t>(end) & ~(page - 1);
    if (to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);
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

// A row of `stripe` was written or removed. Caller holds its lock
// exclusively.
inline void Table::NoteChange(Stripe* stripe, int64_t id) {
  for (uint32_t mask = change_log_.load(std::memory_order_relaxed); mask != 0; mask &= mask - 1) {
    Stripe::ChangeLog& log = stripe->logs[__builtin_ctz(mask)];
    if (stripe->HasRoom(&log)) log.changes.push_back(id);
  }
}

// A push counted `hash` in the sketch. Caller holds the stripe's lock
// exclusively.
inline void Table::NoteSketchAdd(Stripe* stripe, uint64_t hash) {
  for (uint32_t mask = change_log_.load(std::memory_order_relaxed); mask != 0; mask &= mask - 1) {
    Stripe::ChangeLog& log = stripe->logs[__builtin_ctz(mask)];
    if (stripe->HasRoom(&log)) log.sketch_adds.push_back(hash);
  }
}

// Calls fn(slot, key, record) for every row of the stripe's disk tier, a
// few pages per hold() (which returns the lock to hold while they are read).
template <typename Hold, typename Fn>
Status Table::ForEachCold(Stripe* stripe, Hold hold, Fn fn) {
  TierFile* tier = stripe->tier.get();
  if (tier == nullptr) return OkStatus();
  std::vector<char> buffer;
  for (uint32_t next = 0;;) {
    auto lock = hold();
    if (next >= tier->pages()) break;
    // At most kColdBytesPerHold of pages (one at least): 32 pages of rows
    // of dim 8,192 were a 64 MiB buffer, held by every save's listing and
    // ttl sweep of a budgeted shard.
    const auto most = static_cast<uint32_t>(
        std::clamp<size_t>(kColdBytesPerHold / tier->page_bytes(), 1, kColdPagesPerHold));
    const uint32_t first = next, n = std::min(most, tier->pages() - first);
    next = first + n;
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
        DLT_RETURN_IF_ERROR(tier->CheckSlot(slot, data));
        fn(slot, tier->KeyOf(data), TierFile::RecordOf(data));
      }
    }
  }
  return OkStatus();
}

template <typename Goes>
size_t Table::EraseWhere(Stripe* stripe, bool exact, Goes goes, Status* error) {
  size_t erased = 0;
  std::vector<int64_t> keys;
  const int passes = exact ? kExactPasses : 1;
  for (int pass = 0; pass < passes; ++pass) {
    const bool whole = pass == kExactPasses - 1;
    std::unique_lock<std::shared_mutex> held;
    if (whole) held = std::unique_lock<std::shared_mutex>(stripe->mu);
    const auto hold = [&] {
      return whole ? std::unique_lock<std::shared_mutex>()
                   : std::unique_lock<std::shared_mutex>(stripe->mu);
    };
    // What changes when rows move: the stripe's removals from its tier
    // (less this pass's own), its index's size (a growth rehashes) and the
    // tier's layout.
    uint64_t removals = 0, layout = 0, own = 0;
    size_t slots = 0;
    bool grew = false;
    // RAM rows: a slice of the index per hold, examined again after each
    // removal: a removal shifts later entries of its probe run back, into
    // the slice (25 of 900,000 matching rows of 1M were passed over).
    for (size_t begin = 0;; begin += kRemovalSlots) {
      auto lock = hold();
      if (begin == 0) {
        removals = stripe->removals;
        layout = stripe->tier ? stripe->tier->layout() : 0;
        slots = stripe->index.size();
      }
      grew = grew || stripe->index.size() != slots;
      if (begin >= stripe->index.size()) break;
      const size_t end = std::min(stripe->index.size(), begin + kRemovalSlots);
      do {
        keys.clear();
        for (size_t i = begin; i < end; ++i) {
          const IndexEntry& e = stripe->index[i];
          if (e.record != kEmpty && goes(e.key, stripe->Record(e.record, record_bytes_))) {
            keys.push_back(e.key);
          }
        }
        erased += EraseFrom(stripe, keys, error);  // all in RAM: no removal of the tier's
      } while (!keys.empty());
    }
    const Status read =
        ForEachCold(stripe, hold, [&](uint32_t slot, int64_t key, const char* record) {
          if (!goes(key, record)) return;
          EraseCold(stripe, slot, key);
          ++erased;
          ++own;
        });
    if (!read.ok()) {
      NoteTierError(read.message());
      if (error != nullptr && error->ok()) *error = read;
    }
    auto lock = hold();
    const bool moved = grew || stripe->index.size() != slots ||
                       stripe->removals != removals + own ||
                       (stripe->tier && stripe->tier->layout() != layout);
    stripe->Compact(record_bytes_);
    if (!moved || !read.ok()) break;
  }
  return erased;
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_TABLE_STRIPE_H_
