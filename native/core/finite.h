// The checks that keep NaN and infinity out of tables, shared by the table
// core (per shard) and the client (before anything is sent, so a multi-shard
// push or assign is rejected everywhere or nowhere): FirstNonFinite for
// values, CheckGradients for a push's gradients.
#ifndef TF_DLT_NATIVE_CORE_FINITE_H_
#define TF_DLT_NATIVE_CORE_FINITE_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "native/core/status.h"

namespace dlt {

// Index of the first NaN or infinity in `v[0..n)`, or n. The scan is a
// branch-free OR of exponent tests (it vectorizes); the slow search runs only
// when something is wrong.
inline size_t FirstNonFinite(const float* v, size_t n) {
  // An all-ones exponent plus one carries into the sign bit: and, add and
  // or only, which vectorize on any x86-64.
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &v[i], sizeof(bits));
    any |= (bits & 0x7f800000u) + 0x00800000u;
  }
  if (!(any & 0x80000000u)) return n;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return i;
  }
  return n;
}

// FirstNonFinite of `n` values stored as `dtype` (a StorageDtype: 0
// float32, 1 bfloat16, 2 float16): 16-bit values are tested in place.
inline size_t FirstNonFiniteStored(const void* v, uint64_t dtype, size_t n) {
  if (dtype == 0) return FirstNonFinite(static_cast<const float*>(v), n);
  // bfloat16's exponent is float32's top half; float16's is 5 bits.
  const uint32_t exponent = dtype == 1 ? 0x7f80u : 0x7c00u;
  const uint32_t low = exponent & (~exponent + 1);  // its lowest bit
  const auto* h = static_cast<const uint16_t*>(v);
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) any |= (h[i] & exponent) + low;
  if (!(any & 0x8000u)) return n;
  for (size_t i = 0; i < n; ++i) {
    if ((h[i] & exponent) == exponent) return i;
  }
  return n;
}

// A push's gradients may not exceed kMaxGradient in magnitude, nor the
// learning rate times their magnitude kMaxStep: past them the squares and
// steps every optimizer keeps overflow float32 at once (1e18 squared is
// 1e36, float32 ends at 3.4e38). Well-scaled gradients are many orders of
// magnitude below; the table still checks each updated row (Table::Push).
constexpr float kMaxGradient = 1e18f;
constexpr float kMaxStep = 1e36f;

// INVALID_ARGUMENT naming the first row (and its id) of `grads[0..n*dim)`
// that is non-finite or too large for learning rate `lr` (finite, >= 0),
// `op` and `outcome` framing the message; OK otherwise. One vectorized pass
// when all is well.
// `v` as printf's %g writes it (1e+20, 0.1).
inline std::string ShortFloat(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  return text;
}

// The largest |gradient| a push at learning rate `lr` may carry.
inline float GradientLimit(float lr) {
  return lr * kMaxGradient > kMaxStep ? kMaxStep / lr : kMaxGradient;
}

// Whether every value of `g[0..n)` is within `limit` (NaN is not): |v| <=
// limit on the bits (magnitudes of floats order as their bits do, and NaN
// and infinity lie above every finite limit), one integer compare a value
// with no early exit, which vectorizes: it runs on every push's gradients
// and every summed row.
inline bool WithinLimit(const float* g, size_t n, float limit) {
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &limit, sizeof(limit_bits));
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &g[i], sizeof(bits));
    any |= static_cast<uint32_t>((bits & 0x7fffffffu) > limit_bits);
  }
  return any == 0;
}

// A push's learning rate as every receiver checks it: finite and >= 0, and
// > 0 for FTRL (`ftrl`), which divides by it; `op` starts the message.
inline Status CheckLearningRate(float lr, bool ftrl, const std::string& op) {
  if (!std::isfinite(lr) || lr < 0) {
    return InvalidArgument(op + "learning rate must be finite and >= 0, got " + std::to_string(lr));
  }
  if (ftrl && !(lr > 0)) {
    return InvalidArgument(op + "ftrl needs a learning rate > 0, got " + std::to_string(lr));
  }
  return OkStatus();
}

inline Status CheckGradients(const int64_t* ids, const float* grads, size_t n, uint32_t dim,
                             float lr, const std::string& op, const std::string& outcome) {
  const float limit = GradientLimit(lr);
  const size_t total = n * dim;
  if (WithinLimit(grads, total, limit)) return OkStatus();
  for (size_t i = 0; i < total; ++i) {
    if (std::fabs(grads[i]) <= limit) continue;
    const std::string row = op + "gradient row " + std::to_string(i / dim) + " (id " +
                            std::to_string(ids[i / dim]) + ")";
    if (!std::isfinite(grads[i]))
      return InvalidArgument(row + " holds a non-finite value; " + outcome);
    return InvalidArgument(row + " holds " + ShortFloat(grads[i]) +
                           ", beyond what the optimizer state can take at learning rate " +
                           ShortFloat(lr) + " (|gradient| <= " + ShortFloat(limit) + "); " +
                           outcome);
  }
  return OkStatus();
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_FINITE_H_
