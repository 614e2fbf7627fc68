// Software prefetch of a byte range: the batched loops of the table and
// the client ask for a row's lines some rows ahead, so their misses overlap.
#ifndef TF_DLT_NATIVE_CORE_PREFETCH_H_
#define TF_DLT_NATIVE_CORE_PREFETCH_H_

#include <cstddef>
#include <cstdint>

namespace dlt {

// Asks for every cache line that [p, p + bytes) touches, the last one
// included when the range does not start on a line (a record of 136 bytes
// at offset 60 of its line touches three); kWrite = 1 for lines to be
// written.
template <int kWrite = 0>
inline void PrefetchBytes(const void* p, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), kWrite);
  }
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_PREFETCH_H_
