#include "native/core/optimizer.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dlt {
namespace {

// Bit 31 set when `x` is NaN or infinite (an all-ones exponent plus one
// carries into it); or-ed over a row's results inside each update loop,
// where the values are in registers, so the check costs almost nothing.
inline uint32_t NonFiniteBit(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7f800000u) + 0x00800000u;
}

uint32_t ApplySgd(uint32_t dim, float lr, const float* g, float* w) {
  uint32_t bad = 0;
  for (uint32_t j = 0; j < dim; ++j) {
    w[j] -= lr * g[j];
    bad |= NonFiniteBit(w[j]);
  }
  return bad;
}

// keras.optimizers.SGD(momentum=, nesterov=) on the row:
// v = v * momentum - g * lr; w += v, or with Nesterov w += v * momentum - g * lr.
uint32_t ApplyMomentum(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w,
                       float* v) {
  uint32_t bad = 0;
  const float mu = c.momentum;
  if (c.nesterov != 0.0f) {
    for (uint32_t j = 0; j < dim; ++j) {
      v[j] = v[j] * mu - g[j] * lr;
      w[j] += v[j] * mu - g[j] * lr;
      bad |= NonFiniteBit(w[j]) | NonFiniteBit(v[j]);
    }
  } else {
    for (uint32_t j = 0; j < dim; ++j) {
      v[j] = v[j] * mu - g[j] * lr;
      w[j] += v[j];
      bad |= NonFiniteBit(w[j]) | NonFiniteBit(v[j]);
    }
  }
  return bad;
}

// ResourceSparseApplyAdagradV2: acc += g^2; w -= lr * g / (sqrt(acc) + eps).
uint32_t ApplyAdagrad(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w,
                      float* acc) {
  uint32_t bad = 0;
  for (uint32_t j = 0; j < dim; ++j) {
    acc[j] += g[j] * g[j];
    w[j] -= lr * g[j] / (std::sqrt(acc[j]) + c.epsilon);
    bad |= NonFiniteBit(w[j]) | NonFiniteBit(acc[j]);
  }
  return bad;
}

// keras.optimizers.Adagrad on a sparse gradient: acc += sum of each
// occurrence's g^2; w -= lr * g / sqrt(acc + eps).
uint32_t ApplyKerasAdagrad(const OptimizerConfig& c, uint32_t dim, float lr, const float* g,
                           const float* squares, float* w, float* acc) {
  uint32_t bad = 0;
  for (uint32_t j = 0; j < dim; ++j) {
    acc[j] += squares ? squares[j] : g[j] * g[j];
    w[j] -= lr * g[j] / std::sqrt(acc[j] + c.epsilon);
    bad |= NonFiniteBit(w[j]) | NonFiniteBit(acc[j]);
  }
  return bad;
}

// ResourceApplyAdam on the touched row with a per-row step count t:
// lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t); m += (g - m)(1 - b1);
// v += (g^2 - v)(1 - b2); w -= lr_t * m / (eps + sqrt(v)).
uint32_t ApplyAdam(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w,
                   float* m, float* v, uint32_t step) {
  const float t = static_cast<float>(step);
  const float b1_power = std::pow(c.beta1, t);
  const float b2_power = std::pow(c.beta2, t);
  const float lr_t = lr * std::sqrt(1.0f - b2_power) / (1.0f - b1_power);
  const float one_minus_b1 = 1.0f - c.beta1;
  const float one_minus_b2 = 1.0f - c.beta2;
  uint32_t bad = 0;
  for (uint32_t j = 0; j < dim; ++j) {
    m[j] += (g[j] - m[j]) * one_minus_b1;
    v[j] += (g[j] * g[j] - v[j]) * one_minus_b2;
    w[j] -= lr_t * m[j] / (c.epsilon + std::sqrt(v[j]));
    bad |= NonFiniteBit(w[j]) | NonFiniteBit(m[j]) | NonFiniteBit(v[j]);
  }
  return bad;
}

// ResourceSparseApplyFtrl (no l2 shrinkage, linear not multiplied by lr).
// `Power(x)` is x^(-learning_rate_power); the usual -0.5 gets its own
// instantiation (a sqrt) so the loop vectorizes.
template <typename PowerFn>
uint32_t FtrlLoop(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w,
                  float* acc, float* linear, PowerFn power) {
  uint32_t bad = 0;
  for (uint32_t j = 0; j < dim; ++j) {
    const float new_acc = acc[j] + g[j] * g[j];
    const float new_pow = power(new_acc);
    linear[j] += g[j] - (new_pow - power(acc[j])) / lr * w[j];
    const float l = linear[j];
    const float clipped = l < -c.l1 ? -c.l1 : (l > c.l1 ? c.l1 : l);
    w[j] = (clipped - l) / (new_pow / lr + 2.0f * c.l2);
    acc[j] = new_acc;
    bad |= NonFiniteBit(w[j]) | NonFiniteBit(linear[j]) | NonFiniteBit(new_acc);
  }
  return bad;
}

uint32_t ApplyFtrl(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w,
                   float* acc, float* linear) {
  const float p = c.learning_rate_power;
  if (p == -0.5f) {
    return FtrlLoop(c, dim, lr, g, w, acc, linear, [](float x) { return std::sqrt(x); });
  }
  return FtrlLoop(c, dim, lr, g, w, acc, linear, [p](float x) { return std::pow(x, -p); });
}

}  // namespace

bool ApplyRow(const OptimizerConfig& c, uint32_t dim, float lr, const float* grad,
              const float* grad_squares, float* values, float* slots, uint32_t* step) {
  // Every optimizer counts the pushes that touched the row (saturating):
  // Adam's t, and the update frequency that exports choose rows by.
  if (*step != UINT32_MAX) ++*step;
  if (c.weight_decay != 0.0f) {
    // Keras's decoupled weight decay, applied before the update (AdamW).
    const float wd = c.weight_decay;
    for (uint32_t j = 0; j < dim; ++j) values[j] = values[j] - values[j] * wd * lr;
  }
  uint32_t bad = 0;
  switch (c.kind) {
    case OptimizerKind::kSgd:
      bad = ApplySgd(dim, lr, grad, values);
      break;
    case OptimizerKind::kAdagrad:
      bad = ApplyAdagrad(c, dim, lr, grad, values, slots);
      break;
    case OptimizerKind::kAdam:
      bad = ApplyAdam(c, dim, lr, grad, values, slots, slots + dim, *step);
      break;
    case OptimizerKind::kFtrl:
      bad = ApplyFtrl(c, dim, lr, grad, values, slots, slots + dim);
      break;
    case OptimizerKind::kKerasAdagrad:
      bad = ApplyKerasAdagrad(c, dim, lr, grad, grad_squares, values, slots);
      break;
    case OptimizerKind::kMomentum:
      bad = ApplyMomentum(c, dim, lr, grad, values, slots);
      break;
  }
  return (bad & 0x80000000u) == 0;
}

}  // namespace dlt
