// Server-side optimizers (update_method). Each applies one already summed
// gradient row to one stored row and its slots, with the same arithmetic as
// TensorFlow's sparse apply kernels.
#ifndef TF_DLT_NATIVE_CORE_OPTIMIZER_H_
#define TF_DLT_NATIVE_CORE_OPTIMIZER_H_

#include <cstdint>

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

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_OPTIMIZER_H_
