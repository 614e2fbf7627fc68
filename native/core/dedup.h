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
    Slot* slots = slots_.data();
    int64_t* keys = keys_.data();
    // Each probe is likely a cache miss: it starts kProbeAhead ids early,
    // with the hash kept for when its id comes.
    uint64_t ahead[kProbeAhead];
    for (size_t i = 0; i < std::min(n, kProbeAhead); ++i) {
      ahead[i] = Mix64(static_cast<uint64_t>(ids[i]));
      __builtin_prefetch(&slots[Home(ahead[i], mask)]);
    }
    uint32_t distinct = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t hash = ahead[i % kProbeAhead];
      if (i + kProbeAhead < n) {
        const uint64_t next = Mix64(static_cast<uint64_t>(ids[i + kProbeAhead]));
        ahead[i % kProbeAhead] = next;
        __builtin_prefetch(&slots[Home(next, mask)]);
      }
      const int64_t id = ids[i];
      const uint32_t tag = Tag(hash);
      size_t h = Home(hash, mask);
      // A slot of another id whose tag matches is told apart by its key.
      while (slots[h].tag != 0 && (slots[h].tag != tag || keys[slots[h].index] != id)) {
        h = (h + 1) & mask;
      }
      if (slots[h].tag == 0) {
        slots[h] = {tag, distinct};
        keys[distinct] = id;
        first(i, hash, distinct++);
      } else {
        repeat(i, slots[h].index);
      }
    }
  }

  // The index in the last Run's `unique` of `id`, or -1 if it was not there.
  int64_t Find(int64_t id) const {
    if (slots_.empty()) return -1;
    const uint64_t hash = Mix64(static_cast<uint64_t>(id));
    const uint32_t tag = Tag(hash);
    for (size_t h = Home(hash, mask_); slots_[h].tag != 0; h = (h + 1) & mask_) {
      if (slots_[h].tag == tag && keys_[slots_[h].index] == id) return slots_[h].index;
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
  // The hash's top bits, never 0 (an empty slot's).
  static uint32_t Tag(uint64_t hash) { return static_cast<uint32_t>(hash >> 32) | 1u; }

  // Room for `n` ids at most half full, emptied: only the part a batch of
  // `n` uses is cleared (a thread's small lookups after a large one do not
  // pay for its table).
  void Prepare(size_t n) {
    size_t capacity = 16;
    while (capacity < 2 * n) capacity <<= 1;
    if (slots_.size() < capacity) slots_.resize(capacity);
    if (keys_.size() < n) keys_.resize(n);
    std::memset(slots_.data(), 0, capacity * sizeof(Slot));
    mask_ = capacity - 1;
  }

  // 8 bytes a slot (a 64-bit key beside them made 16 and missed the cache
  // twice as often): the id's tag, and its index among the distinct ids,
  // whose ids `keys_` holds in order.
  struct Slot {  // trivial: cleared by memset
    uint32_t tag;
    uint32_t index;
  };
  std::vector<Slot> slots_;
  std::vector<int64_t> keys_;
  size_t mask_ = 0;
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
// about 6 MiB of dedup storage at most per thread.
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
