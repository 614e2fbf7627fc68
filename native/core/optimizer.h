// Server-side optimizers (update_method). Each applies one already summed
// gradient row to one stored row and its slots, with the same arithmetic as
// TensorFlow's sparse apply kernels.
#ifndef TF_DLT_NATIVE_CORE_OPTIMIZER_H_
#define TF_DLT_NATIVE_CORE_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "native/core/table_config.h"

namespace dlt {

// Updates `values` (dim floats), `slots` (SlotsPerValue(kind) * dim floats)
// with gradient `grad` (the push's rows of this id, summed) and learning rate
// `lr`, and counts the update in `step` (saturating at UINT32_MAX): Adam's
// t, the row's update frequency for every optimizer. `grad_squares`: the sum
// of each occurrence's squared gradient (null when the id occurred once, so
// it is grad^2); only Keras Adagrad uses it. Returns false when a value or
// slot it wrote is NaN or infinite (the caller restores the row).
bool ApplyRow(const OptimizerConfig& config, uint32_t dim, float lr, const float* grad,
              const float* grad_squares, float* values, float* slots, uint32_t* step);

// The sums a push needs for the rows it holds more than once: each
// occurrence's gradient summed (and, for Keras Adagrad, their squares). A
// row pushed once applies its gradient as sent, so a push of mostly distinct
// ids is not copied whole (every gradient read in the rows' order, which is
// not the order they arrived in, and written again).
class RepeatedSums {
 public:
  // Occurrence k (of n) is of distinct row distinct_of(k) (< distinct) and
  // has the gradient grad_of(k) (dim floats).
  template <class DistinctOf, class GradOf>
  void Sum(size_t n, size_t distinct, uint32_t dim, bool with_squares, DistinctOf distinct_of,
           GradOf grad_of) {
    dim_ = dim;
    at_.assign(distinct, 0);  // first each row's occurrences
    first_.resize(distinct);
    for (size_t k = 0; k < n; ++k) {
      const size_t d = distinct_of(k);
      if (at_[d]++ == 0) first_[d] = k;
    }
    uint32_t repeated = 0;
    for (uint32_t& a : at_) a = a > 1 ? repeated++ : kOnce;
    summed_.assign(size_t{repeated} * dim, 0.0f);
    squares_.assign(with_squares ? size_t{repeated} * dim : 0, 0.0f);
    if (repeated == 0) return;
    for (size_t k = 0; k < n; ++k) {
      const uint32_t a = at_[distinct_of(k)];
      if (a == kOnce) continue;
      const float* g = grad_of(k);
      float* acc = &summed_[size_t{a} * dim];
      for (uint32_t j = 0; j < dim; ++j) acc[j] += g[j];
      if (!with_squares) continue;
      float* sq = &squares_[size_t{a} * dim];
      for (uint32_t j = 0; j < dim; ++j) sq[j] += g[j] * g[j];
    }
  }
  // Distinct row u's summed gradient, or null when it occurred once.
  const float* Summed(size_t u) const {
    return at_[u] == kOnce ? nullptr : &summed_[size_t{at_[u]} * dim_];
  }
  // The occurrence where distinct row u first appears.
  size_t First(size_t u) const { return first_[u]; }
  // The sum of its squares (ApplyRow's grad_squares), or null.
  const float* Squares(size_t u) const {
    return at_[u] == kOnce || squares_.empty() ? nullptr : &squares_[size_t{at_[u]} * dim_];
  }

 private:
  static constexpr uint32_t kOnce = 0xffffffffu;
  uint32_t dim_ = 0;
  std::vector<uint32_t> at_;  // per distinct row: its place in summed_, or kOnce
  std::vector<size_t> first_;
  std::vector<float> summed_, squares_;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_OPTIMIZER_H_
