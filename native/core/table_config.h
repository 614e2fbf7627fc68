// Table configuration: dimension, deterministic initializer and server-side
// optimizer (the "update_method"). Plain data, validated once at creation.
#ifndef TF_DLT_NATIVE_CORE_TABLE_CONFIG_H_
#define TF_DLT_NATIVE_CORE_TABLE_CONFIG_H_

#include <cstdint>
#include <string>

#include "native/core/status.h"

namespace dlt {

enum class InitializerKind : uint32_t {
  kZeros = 0,
  kConstant = 1,
  kUniform = 2,
  kNormal = 3,
  kTruncatedNormal = 4,
};

struct InitializerConfig {
  InitializerKind kind = InitializerKind::kZeros;
  float value = 0.0f;     // kConstant
  float minval = -0.05f;  // kUniform
  float maxval = 0.05f;
  float mean = 0.0f;  // kNormal, kTruncatedNormal
  float stddev = 0.05f;
};

enum class OptimizerKind : uint32_t {
  kSgd = 0,
  kAdagrad = 1,
  kAdam = 2,
  kFtrl = 3,
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float initial_accumulator = 0.1f;  // kAdagrad, kFtrl
  float epsilon = 1e-7f;             // kAdagrad, kAdam
  float beta1 = 0.9f;                // kAdam
  float beta2 = 0.999f;
  float learning_rate_power = -0.5f;  // kFtrl
  float l1 = 0.0f;
  float l2 = 0.0f;
};

struct TableConfig {
  std::string name;
  uint32_t dim = 0;
  uint64_t seed = 0;
  InitializerConfig initializer;
  OptimizerConfig optimizer;
};

// Largest accepted dim (one row is at most 256 KiB of values).
inline constexpr uint32_t kMaxDim = 65536;
// Longest accepted table name, in bytes.
inline constexpr uint32_t kMaxTableNameBytes = 255;

Status ValidateTableName(const std::string& name);
Status ValidateTableConfig(const TableConfig& config);

// Number of float32 optimizer slots per value (0 for SGD, 1 for Adagrad, 2 for
// Adam and FTRL).
uint32_t SlotsPerValue(OptimizerKind kind);

const char* OptimizerName(OptimizerKind kind);
const char* InitializerName(InitializerKind kind);

// True when both configs describe the same table (name, dim, seed,
// initializer and optimizer with all hyper-parameters).
bool SameTable(const TableConfig& a, const TableConfig& b);

// A human-readable one-line description, used in error messages.
std::string Describe(const TableConfig& config);

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_TABLE_CONFIG_H_
