// FirstNonFinite: the check that keeps NaN and infinity out of tables, shared
// by the table core (per shard) and the client (before anything is sent, so a
// multi-shard push or assign is rejected everywhere or nowhere).
#ifndef TF_DLT_NATIVE_CORE_FINITE_H_
#define TF_DLT_NATIVE_CORE_FINITE_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dlt {

// Index of the first NaN or infinity in `v[0..n)`, or n. The scan is a
// branch-free OR of exponent tests (it vectorizes); the slow search runs only
// when something is wrong.
inline size_t FirstNonFinite(const float* v, size_t n) {
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &v[i], sizeof(bits));
    any |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  if (!any) return n;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return i;
  }
  return n;
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_FINITE_H_
