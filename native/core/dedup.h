// Deduplication of id batches (the lookup kernels, pulls ahead): distinct ids
// in order of first appearance and the slot of every input id. Its open-addressing
// table keeps its storage between calls (ThreadScratch keeps one per thread
// for batches up to a bound), so a training step does not pay fresh memory
// for it.
#ifndef TF_DLT_NATIVE_CORE_DEDUP_H_
#define TF_DLT_NATIVE_CORE_DEDUP_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native/core/routing.h"

namespace dlt {

class Deduper {
 public:
  // `n` < 2^32 (the ops and the client bound their batches below that).
  void Run(const int64_t* ids, int64_t n, std::vector<int64_t>* unique,
           std::vector<int64_t>* slot) {
    unique->clear();
    slot->resize(n);
    int64_t* slots = slot->data();
    Visit(
        ids, static_cast<size_t>(n),
        [&](size_t i, uint64_t, uint32_t u) {
          unique->push_back(ids[i]);
          slots[i] = u;
        },
        [&](size_t i, uint32_t u) { slots[i] = u; });
  }

  // The same pass with the caller's actions: first(i, hash, u) for an id seen
  // for the first time at i (hash: Mix64 of the id, as routing uses it; u: its
  // index among the distinct ids, counting from 0), repeat(i, u) for a later
  // occurrence of distinct id u.
  template <typename First, typename Repeat>
  void Visit(const int64_t* ids, size_t n, First&& first, Repeat&& repeat) {
    Prepare(n);
    const size_t mask = mask_;
    const uint32_t stamp = stamp_;
    Entry* entries = entries_.data();
    // Each probe is likely a cache miss: it starts kProbeAhead ids early,
    // with the hash kept for when its id comes.
    uint64_t ahead[kProbeAhead];
    for (size_t i = 0; i < std::min(n, kProbeAhead); ++i) {
      ahead[i] = Mix64(static_cast<uint64_t>(ids[i]));
      __builtin_prefetch(&entries[Home(ahead[i], mask)]);
    }
    uint32_t distinct = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t hash = ahead[i % kProbeAhead];
      if (i + kProbeAhead < n) {
        const uint64_t next = Mix64(static_cast<uint64_t>(ids[i + kProbeAhead]));
        ahead[i % kProbeAhead] = next;
        __builtin_prefetch(&entries[Home(next, mask)]);
      }
      const int64_t id = ids[i];
      size_t h = Home(hash, mask);
      while (entries[h].stamp == stamp && entries[h].key != id) h = (h + 1) & mask;
      if (entries[h].stamp != stamp) {
        entries[h] = {id, distinct, stamp};
        first(i, hash, distinct++);
      } else {
        repeat(i, entries[h].value);
      }
    }
  }

  // The index in the last Run's `unique` of `id`, or -1 if it was not there.
  int64_t Find(int64_t id) const {
    if (entries_.empty()) return -1;
    size_t h = Home(Mix64(static_cast<uint64_t>(id)), mask_);
    while (entries_[h].stamp == stamp_) {
      if (entries_[h].key == id) return entries_[h].value;
      h = (h + 1) & mask_;
    }
    return -1;
  }

 private:
  static constexpr size_t kProbeAhead = 16;

  // An id's first slot: hash bits above the routing bucket's (BucketOfHash
  // takes the low 12), so ids of few buckets (a shard's, a table stripe's)
  // spread over the table instead of piling onto a few runs. With the low
  // bits, a load's batch of one stripe's rows (64 buckets) probed hundreds
  // of slots an id.
  static size_t Home(uint64_t hash, size_t mask) { return (hash >> 12) & mask; }

  // Room for `n` ids at most half full, emptied.
  void Prepare(size_t n) {
    size_t capacity = 16;
    while (capacity < 2 * n) capacity <<= 1;
    if (entries_.size() < capacity) {
      entries_.assign(capacity, Entry{});
      stamp_ = 0;
    }
    // A new stamp empties the table without touching it, except once every
    // 2^32 runs.
    if (++stamp_ == 0) {
      for (Entry& e : entries_) e.stamp = 0;
      stamp_ = 1;
    }
    mask_ = capacity - 1;
  }

  // Key and value share a cache line; `stamp` marks the run that filled it.
  struct Entry {
    int64_t key = 0;
    uint32_t value = 0;
    uint32_t stamp = 0;
  };
  std::vector<Entry> entries_;
  size_t mask_ = 0;
  uint32_t stamp_ = 0;
};

// A Deduper with its outputs: the base of a call site's scratch.
struct DedupScratch {
  Deduper dedup;
  std::vector<int64_t> unique, slot;

  void Run(const int64_t* ids, size_t n) {
    dedup.Run(ids, static_cast<int64_t>(n), &unique, &slot);
  }
};

// The largest batch (in ids) whose scratch a thread keeps for its next call:
// about 12 MiB of dedup storage at most per thread.
inline constexpr size_t kKeepScratchIds = size_t{1} << 18;

// The calling thread's kept `Scratch` for a batch of `n` ids, or `own` (the
// caller's, freed after its call) when the batch is larger. Each call site
// passes a type of its own (a DedupScratch extended with what else it keeps),
// so no two sites share a thread's scratch.
template <typename Scratch>
Scratch& ThreadScratch(size_t n, Scratch& own) {
  thread_local Scratch kept;
  return n <= kKeepScratchIds ? kept : own;
}

// The rows of a batch in input order ([n, dim] into `out`) from the rows of
// its distinct ids (`distinct`, in the order of Deduper::Run's `unique`) and
// each input id's `slot`.
inline void GatherBySlot(const float* distinct, const int64_t* slot, size_t n, size_t dim,
                         float* out) {
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(out + i * dim, distinct + static_cast<size_t>(slot[i]) * dim, sizeof(float) * dim);
  }
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_DEDUP_H_
