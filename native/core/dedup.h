// Deduplication of id batches (the lookup kernels, pulls ahead): distinct ids
// in order of first appearance and the slot of every input id. Its open-addressing
// table keeps its storage between calls (use one per thread), so a training
// step does not pay fresh memory for it.
#ifndef TF_DLT_NATIVE_CORE_DEDUP_H_
#define TF_DLT_NATIVE_CORE_DEDUP_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native/core/routing.h"

namespace dlt {

class Deduper {
 public:
  void Run(const int64_t* ids, int64_t n, std::vector<int64_t>* unique,
           std::vector<int64_t>* slot) {
    size_t capacity = 16;
    while (capacity < 2 * static_cast<size_t>(n)) capacity <<= 1;
    if (keys_.size() < capacity) {
      keys_.resize(capacity);
      values_.resize(capacity);
    }
    mask_ = capacity - 1;
    const size_t mask = mask_;
    std::fill(values_.begin(), values_.begin() + capacity, -1);
    unique->clear();
    slot->resize(n);
    for (int64_t i = 0; i < n; ++i) {
      size_t h = Mix64(static_cast<uint64_t>(ids[i])) & mask;
      while (values_[h] >= 0 && keys_[h] != ids[i]) h = (h + 1) & mask;
      if (values_[h] < 0) {
        keys_[h] = ids[i];
        values_[h] = static_cast<int64_t>(unique->size());
        unique->push_back(ids[i]);
      }
      (*slot)[i] = values_[h];
    }
  }

  // The index in the last Run's `unique` of `id`, or -1 if it was not there.
  int64_t Find(int64_t id) const {
    if (values_.empty()) return -1;
    size_t h = Mix64(static_cast<uint64_t>(id)) & mask_;
    while (values_[h] >= 0) {
      if (keys_[h] == id) return values_[h];
      h = (h + 1) & mask_;
    }
    return -1;
  }

 private:
  std::vector<int64_t> keys_;
  std::vector<int64_t> values_;  // -1: empty
  size_t mask_ = 0;
};

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
