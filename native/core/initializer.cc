#include "native/core/initializer.h"

#include <cmath>

#include "native/core/routing.h"

namespace dlt {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
constexpr double kTwoPi = 6.283185307179586476925286766559;
// Truncated normal redraws values beyond this many standard deviations, as
// tf.random.truncated_normal does.
constexpr double kTruncation = 2.0;
constexpr int kMaxRedraws = 64;

// Counter-based generator: the n-th 64-bit draw for a row key.
inline uint64_t Draw(uint64_t row_key, uint64_t n) { return Mix64(row_key + (n + 1) * kGolden); }

// Uniform in [0, 1) with 24 random bits, exact in float.
inline float UnitFloat(uint64_t bits) {
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}

// Uniform in (0, 1] with 53 random bits.
inline double UnitDoubleOpenZero(uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

inline double StandardNormal(uint64_t row_key, uint64_t n) {
  const double u1 = UnitDoubleOpenZero(Draw(row_key, 2 * n));
  const double u2 = UnitDoubleOpenZero(Draw(row_key, 2 * n + 1));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

}  // namespace

void InitializeRow(const InitializerConfig& c, uint64_t seed, int64_t id, uint32_t dim,
                   float* out) {
  const uint64_t row_key = Mix64(Mix64(seed ^ kGolden) ^ static_cast<uint64_t>(id));
  switch (c.kind) {
    case InitializerKind::kZeros:
      for (uint32_t j = 0; j < dim; ++j) out[j] = 0.0f;
      return;
    case InitializerKind::kConstant:
      for (uint32_t j = 0; j < dim; ++j) out[j] = c.value;
      return;
    case InitializerKind::kUniform: {
      const float span = c.maxval - c.minval;
      for (uint32_t j = 0; j < dim; ++j) {
        out[j] = c.minval + span * UnitFloat(Draw(row_key, j));
      }
      return;
    }
    case InitializerKind::kNormal:
      for (uint32_t j = 0; j < dim; ++j) {
        out[j] = static_cast<float>(c.mean + c.stddev * StandardNormal(row_key, j));
      }
      return;
    case InitializerKind::kTruncatedNormal:
      for (uint32_t j = 0; j < dim; ++j) {
        double z = 0.0;
        for (int attempt = 0; attempt < kMaxRedraws; ++attempt) {
          z = StandardNormal(row_key, static_cast<uint64_t>(attempt) * dim + j);
          if (std::fabs(z) <= kTruncation) break;
        }
        // After kMaxRedraws misses (probability 0.0455^64) clamp, so the
        // result stays a pure function of (seed, id).
        z = std::fmax(-kTruncation, std::fmin(kTruncation, z));
        out[j] = static_cast<float>(c.mean + c.stddev * z);
      }
      return;
  }
}

void InitializeSlots(const OptimizerConfig& c, uint32_t dim, float* slots) {
  switch (c.kind) {
    case OptimizerKind::kSgd:
      return;
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kKerasAdagrad:
      for (uint32_t j = 0; j < dim; ++j) slots[j] = c.initial_accumulator;
      return;
    case OptimizerKind::kAdam:  // m, v
      for (uint32_t j = 0; j < 2 * dim; ++j) slots[j] = 0.0f;
      return;
    case OptimizerKind::kMomentum:  // velocity
      for (uint32_t j = 0; j < dim; ++j) slots[j] = 0.0f;
      return;
    case OptimizerKind::kFtrl:  // accumulator, linear
      for (uint32_t j = 0; j < dim; ++j) slots[j] = c.initial_accumulator;
      for (uint32_t j = dim; j < 2 * dim; ++j) slots[j] = 0.0f;
      return;
  }
}

}  // namespace dlt
