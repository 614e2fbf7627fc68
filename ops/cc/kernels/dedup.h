// Deduplication of id batches for the lookup kernels: distinct ids in order
// of first appearance and the slot of every input id. Its open-addressing
// table keeps its storage between calls (use one per thread), so a training
// step does not pay fresh memory for it.
#ifndef TF_DLT_OPS_CC_KERNELS_DEDUP_H_
#define TF_DLT_OPS_CC_KERNELS_DEDUP_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "native/core/routing.h"

namespace tensorflow {
namespace dlt_ops {

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
    const size_t mask = capacity - 1;
    std::fill(values_.begin(), values_.begin() + capacity, -1);
    unique->clear();
    slot->resize(n);
    for (int64_t i = 0; i < n; ++i) {
      size_t h = dlt::Mix64(static_cast<uint64_t>(ids[i])) & mask;
      while (values_[h] >= 0 && keys_[h] != ids[i]) h = (h + 1) & mask;
      if (values_[h] < 0) {
        keys_[h] = ids[i];
        values_[h] = static_cast<int64_t>(unique->size());
        unique->push_back(ids[i]);
      }
      (*slot)[i] = values_[h];
    }
  }

 private:
  std::vector<int64_t> keys_;
  std::vector<int64_t> values_;  // -1: empty
};

}  // namespace dlt_ops
}  // namespace tensorflow

#endif  // TF_DLT_OPS_CC_KERNELS_DEDUP_H_
