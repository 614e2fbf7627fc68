// Deterministic row initialization: the initial row of an id is a pure
// function of (table seed, id), computed with a counter-based generator, so
// it never depends on shard count, insertion order or process.
#ifndef TF_DLT_NATIVE_CORE_INITIALIZER_H_
#define TF_DLT_NATIVE_CORE_INITIALIZER_H_

#include <cstdint>

#include "native/core/table_config.h"

namespace dlt {

// Writes the `dim` initial values of `id` into `out`.
void InitializeRow(const InitializerConfig& config, uint64_t seed, int64_t id, uint32_t dim,
                   float* out);

// Writes the initial optimizer slots of one row (`SlotsPerValue * dim` floats).
void InitializeSlots(const OptimizerConfig& config, uint32_t dim, float* slots);

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_INITIALIZER_H_
