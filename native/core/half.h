// Row storage in 16 bits: float32 <-> bfloat16 / float16, with
// round-to-nearest-even or stochastic rounding. Values are always float32 on
// the wire and in TensorFlow; only the stored copy is narrowed.
#ifndef TF_DLT_NATIVE_CORE_HALF_H_
#define TF_DLT_NATIVE_CORE_HALF_H_

#include <cstdint>

namespace dlt {

// Reads `n` stored values of `dtype` (a StorageDtype) into float32.
void LoadValues(const void* src, uint64_t dtype, uint32_t n, float* dst);

// Stores `n` finite float32 values as `dtype`. For 16-bit dtypes with
// stochastic rounding, value j rounds up in magnitude with probability equal
// to its distance from the value below, using random bits that are a pure
// function of (`key`, j): reruns store the same bits. Values beyond the
// largest finite 16-bit number saturate to it.
void StoreValues(const float* src, uint64_t dtype, bool stochastic, uint64_t key, uint32_t n,
                 void* dst);

// One value, for tests: float32 -> 16-bit bits with round-to-nearest-even.
uint16_t ToBfloat16Nearest(float v);
uint16_t ToFloat16Nearest(float v);
float Bfloat16ToFloat(uint16_t bits);
float Float16ToFloat(uint16_t bits);

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_HALF_H_
