#include "native/core/half.h"

#include <cmath>
#include <cstring>

#include "native/core/routing.h"
#include "native/core/table_config.h"

namespace dlt {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
constexpr uint16_t kBf16MaxMagnitude = 0x7f7f;  // largest finite bfloat16
constexpr uint16_t kF16MaxMagnitude = 0x7bff;   // 65504

inline uint32_t FloatBits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

inline float BitsFloat(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// Magnitude bits of the largest 16-bit value <= |v| (v finite, |v| below
// the format's overflow threshold handled by the caller).
inline uint16_t Bf16TowardZero(float magnitude) {
  return static_cast<uint16_t>(FloatBits(magnitude) >> 16);
}

inline uint16_t F16TowardZero(float magnitude) {
  if (magnitude < 6.103515625e-05f) {                       // below 2^-14: subnormal half
    return static_cast<uint16_t>(magnitude * 16777216.0f);  // floor(m / 2^-24)
  }
  const uint32_t b = FloatBits(magnitude);
  const uint32_t exponent = ((b >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>((exponent << 10) | ((b >> 13) & 0x3ff));
}

inline float F16Magnitude(uint16_t m) {
  const uint32_t exponent = m >> 10, mantissa = m & 0x3ff;
  if (exponent == 0) return static_cast<float>(mantissa) * 5.9604644775390625e-08f;  // 2^-24
  return BitsFloat(((exponent - 15 + 127) << 23) | (mantissa << 13));
}

inline float Bf16Magnitude(uint16_t m) { return BitsFloat(static_cast<uint32_t>(m) << 16); }

// Rounds finite `v` to 16 bits: `u` in [0, 1) picks the value above with
// probability equal to the fraction of the gap (stochastic), or u < 0 asks
// for round-to-nearest-even.
template <bool kBf16>
uint16_t Round(float v, double u) {
  const uint16_t sign = (FloatBits(v) >> 16) & 0x8000;
  const float m = std::fabs(v);
  const uint16_t max_magnitude = kBf16 ? kBf16MaxMagnitude : kF16MaxMagnitude;
  const float max_value = kBf16 ? Bf16Magnitude(max_magnitude) : F16Magnitude(max_magnitude);
  if (!(m < max_value)) return sign | max_magnitude;
  const uint16_t lo = kBf16 ? Bf16TowardZero(m) : F16TowardZero(m);
  const float lo_value = kBf16 ? Bf16Magnitude(lo) : F16Magnitude(lo);
  if (lo_value == m) return sign | lo;
  const uint16_t hi = lo + 1;
  const float hi_value = kBf16 ? Bf16Magnitude(hi) : F16Magnitude(hi);
  const double above = static_cast<double>(m) - lo_value, gap = hi_value - lo_value;
  bool up;
  if (u < 0) {
    up = above * 2 > gap || (above * 2 == gap && (lo & 1));
  } else {
    up = u * gap < above;
  }
  return sign | (up ? hi : lo);
}

// The j-th uniform draw in [0, 1) for a rounding key, 53 bits.
inline double Uniform(uint64_t key, uint32_t j) {
  return static_cast<double>(Mix64(key + (uint64_t{j} + 1) * kGolden) >> 11) *
         (1.0 / 9007199254740992.0);
}

}  // namespace

uint16_t ToBfloat16Nearest(float v) { return Round<true>(v, -1.0); }
uint16_t ToFloat16Nearest(float v) { return Round<false>(v, -1.0); }

float Bfloat16ToFloat(uint16_t bits) { return BitsFloat(static_cast<uint32_t>(bits) << 16); }

float Float16ToFloat(uint16_t bits) {
  if ((bits & 0x7c00) == 0x7c00) {  // infinity or NaN (never stored)
    return BitsFloat(((bits & 0x8000u) << 16) | 0x7f800000u | ((bits & 0x3ffu) << 13));
  }
  const float m = F16Magnitude(bits & 0x7fff);
  return (bits & 0x8000) ? -m : m;
}

void LoadValues(const void* src, uint64_t dtype, uint32_t n, float* dst) {
  switch (static_cast<StorageDtype>(dtype)) {
    case StorageDtype::kFloat32:
      std::memcpy(dst, src, sizeof(float) * n);
      return;
    case StorageDtype::kBfloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (uint32_t j = 0; j < n; ++j) dst[j] = Bfloat16ToFloat(s[j]);
      return;
    }
    case StorageDtype::kFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (uint32_t j = 0; j < n; ++j) dst[j] = Float16ToFloat(s[j]);
      return;
    }
  }
}

void StoreValues(const float* src, uint64_t dtype, bool stochastic, uint64_t key, uint32_t n,
                 void* dst) {
  auto* d = static_cast<uint16_t*>(dst);
  switch (static_cast<StorageDtype>(dtype)) {
    case StorageDtype::kFloat32:
      std::memcpy(dst, src, sizeof(float) * n);
      return;
    case StorageDtype::kBfloat16:
      for (uint32_t j = 0; j < n; ++j)
        d[j] = Round<true>(src[j], stochastic ? Uniform(key, j) : -1);
      return;
    case StorageDtype::kFloat16:
      for (uint32_t j = 0; j < n; ++j) {
        d[j] = Round<false>(src[j], stochastic ? Uniform(key, j) : -1);
      }
      return;
  }
}

}  // namespace dlt
