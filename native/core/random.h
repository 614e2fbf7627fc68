// Unpredictable 64-bit words for what must differ between processes and
// not be guessed: a client's id, a shard's lineage, a hash's keys.
#ifndef TF_DLT_NATIVE_CORE_RANDOM_H_
#define TF_DLT_NATIVE_CORE_RANDOM_H_

#include <cstdint>
#include <random>

namespace dlt {

// 64 bits from the system's random source.
inline uint64_t RandomWord() {
  std::random_device device;
  return (uint64_t{device()} << 32) | device();
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_RANDOM_H_
