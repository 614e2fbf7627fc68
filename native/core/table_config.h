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
  // Adagrad with Keras' arithmetic on sparse gradients: the accumulator
  // takes the square of each occurrence of an id in a push, and
  // w -= lr * g / sqrt(acc + eps) (keras.optimizers.Adagrad).
  kKerasAdagrad = 4,
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float initial_accumulator = 0.1f;  // kAdagrad, kKerasAdagrad, kFtrl
  float epsilon = 1e-7f;             // kAdagrad, kKerasAdagrad, kAdam
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

// Number of float32 optimizer slots per value (0 for SGD, 1 for Adagrad and
// Keras Adagrad, 2 for Adam and FTRL).
uint32_t SlotsPerValue(OptimizerKind kind);

const char* OptimizerName(OptimizerKind kind);
const char* InitializerName(InitializerKind kind);
// The kind named `name` ("uniform", "adagrad", ...); false when unknown.
bool ParseInitializerKind(const std::string& name, InitializerKind* kind);
bool ParseOptimizerKind(const std::string& name, OptimizerKind* kind);

// The float parameters of each part of a config, by name. This is the one
// list of a table config's fields in C++: the Python bindings, the op
// attribute encoding, SameTable and Describe all walk it, and its names are
// those of tf_dlt.initializers / tf_dlt.optimizers and of the proto.
struct InitializerField {
  const char* name;
  float InitializerConfig::* member;
};
struct OptimizerField {
  const char* name;
  float OptimizerConfig::* member;
};
inline constexpr InitializerField kInitializerFields[] = {
    {"value", &InitializerConfig::value},   {"minval", &InitializerConfig::minval},
    {"maxval", &InitializerConfig::maxval}, {"mean", &InitializerConfig::mean},
    {"stddev", &InitializerConfig::stddev},
};
inline constexpr OptimizerField kOptimizerFields[] = {
    {"initial_accumulator", &OptimizerConfig::initial_accumulator},
    {"epsilon", &OptimizerConfig::epsilon},
    {"beta1", &OptimizerConfig::beta1},
    {"beta2", &OptimizerConfig::beta2},
    {"learning_rate_power", &OptimizerConfig::learning_rate_power},
    {"l1", &OptimizerConfig::l1},
    {"l2", &OptimizerConfig::l2},
};

// A config as one line of text, e.g. "name=emb dim=16 seed=0
// initializer=uniform initializer.minval=-0.05 ... optimizer=adagrad
// optimizer.epsilon=1e-07 ...": every field, floats to float32 precision
// ("%.9g"). The op attribute of Dlt>CreateTable; Decode is its inverse and
// validates nothing but the syntax (ValidateTableConfig does the rest).
std::string EncodeTableConfig(const TableConfig& config);
Status DecodeTableConfig(const std::string& text, TableConfig* config);

// True when both configs describe the same table (name, dim, seed,
// initializer and optimizer with all hyper-parameters).
bool SameTable(const TableConfig& a, const TableConfig& b);

// A human-readable one-line description, used in error messages.
std::string Describe(const TableConfig& config);

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_TABLE_CONFIG_H_
