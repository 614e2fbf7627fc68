#include "native/core/optimizer.h"

#include <cmath>

namespace dlt {
namespace {

void ApplySgd(uint32_t dim, float lr, const float* g, float* w) {
  for (uint32_t j = 0; j < dim; ++j) w[j] -= lr * g[j];
}

// ResourceSparseApplyAdagradV2: acc += g^2; w -= lr * g / (sqrt(acc) + eps).
void ApplyAdagrad(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w,
                  float* acc) {
  for (uint32_t j = 0; j < dim; ++j) {
    acc[j] += g[j] * g[j];
    w[j] -= lr * g[j] / (std::sqrt(acc[j]) + c.epsilon);
  }
}

// keras.optimizers.Adagrad on a sparse gradient: acc += sum of each
// occurrence's g^2; w -= lr * g / sqrt(acc + eps).
void ApplyKerasAdagrad(const OptimizerConfig& c, uint32_t dim, float lr, const float* g,
                       const float* squares, float* w, float* acc) {
  for (uint32_t j = 0; j < dim; ++j) {
    acc[j] += squares ? squares[j] : g[j] * g[j];
    w[j] -= lr * g[j] / std::sqrt(acc[j] + c.epsilon);
  }
}

// ResourceApplyAdam on the touched row with a per-row step count t:
// lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t); m += (g - m)(1 - b1);
// v += (g^2 - v)(1 - b2); w -= lr_t * m / (eps + sqrt(v)).
void ApplyAdam(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w, float* m,
               float* v, uint32_t step) {
  const float t = static_cast<float>(step);
  const float b1_power = std::pow(c.beta1, t);
  const float b2_power = std::pow(c.beta2, t);
  const float lr_t = lr * std::sqrt(1.0f - b2_power) / (1.0f - b1_power);
  const float one_minus_b1 = 1.0f - c.beta1;
  const float one_minus_b2 = 1.0f - c.beta2;
  for (uint32_t j = 0; j < dim; ++j) {
    m[j] += (g[j] - m[j]) * one_minus_b1;
    v[j] += (g[j] * g[j] - v[j]) * one_minus_b2;
    w[j] -= lr_t * m[j] / (c.epsilon + std::sqrt(v[j]));
  }
}

// ResourceSparseApplyFtrl (no l2 shrinkage, linear not multiplied by lr).
// `Power(x)` is x^(-learning_rate_power); the usual -0.5 gets its own
// instantiation (a sqrt) so the loop vectorizes.
template <typename PowerFn>
void FtrlLoop(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w,
              float* acc, float* linear, PowerFn power) {
  for (uint32_t j = 0; j < dim; ++j) {
    const float new_acc = acc[j] + g[j] * g[j];
    const float new_pow = power(new_acc);
    linear[j] += g[j] - (new_pow - power(acc[j])) / lr * w[j];
    const float l = linear[j];
    const float clipped = l < -c.l1 ? -c.l1 : (l > c.l1 ? c.l1 : l);
    w[j] = (clipped - l) / (new_pow / lr + 2.0f * c.l2);
    acc[j] = new_acc;
  }
}

void ApplyFtrl(const OptimizerConfig& c, uint32_t dim, float lr, const float* g, float* w,
               float* acc, float* linear) {
  const float p = c.learning_rate_power;
  if (p == -0.5f) {
    FtrlLoop(c, dim, lr, g, w, acc, linear, [](float x) { return std::sqrt(x); });
  } else {
    FtrlLoop(c, dim, lr, g, w, acc, linear, [p](float x) { return std::pow(x, -p); });
  }
}

}  // namespace

void ApplyRow(const OptimizerConfig& c, uint32_t dim, float lr, const float* grad,
              const float* grad_squares, float* values, float* slots, uint32_t* step) {
  // Every optimizer counts the pushes that touched the row (saturating):
  // Adam's t, and the update frequency that exports choose rows by.
  if (*step != UINT32_MAX) ++*step;
  switch (c.kind) {
    case OptimizerKind::kSgd:
      ApplySgd(dim, lr, grad, values);
      return;
    case OptimizerKind::kAdagrad:
      ApplyAdagrad(c, dim, lr, grad, values, slots);
      return;
    case OptimizerKind::kAdam:
      ApplyAdam(c, dim, lr, grad, values, slots, slots + dim, *step);
      return;
    case OptimizerKind::kFtrl:
      ApplyFtrl(c, dim, lr, grad, values, slots, slots + dim);
      return;
    case OptimizerKind::kKerasAdagrad:
      ApplyKerasAdagrad(c, dim, lr, grad, grad_squares, values, slots);
      return;
  }
}

}  // namespace dlt
