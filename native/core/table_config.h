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
  // SGD with momentum as keras.optimizers.SGD(momentum=, nesterov=), on the
  // rows a push touches: v = momentum * v - lr * g; w += v (nesterov:
  // w += momentum * v - lr * g).
  kMomentum = 5,
};
inline constexpr uint32_t kNumOptimizerKinds = 6;

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float initial_accumulator = 0.1f;  // kAdagrad, kKerasAdagrad, kFtrl
  float epsilon = 1e-7f;             // kAdagrad, kKerasAdagrad, kAdam
  float beta1 = 0.9f;                // kAdam
  float beta2 = 0.999f;
  float learning_rate_power = -0.5f;  // kFtrl
  float l1 = 0.0f;
  float l2 = 0.0f;
  float momentum = 0.9f;  // kMomentum
  float nesterov = 0.0f;  // kMomentum: 1 for Nesterov momentum
  // Every kind: decoupled weight decay on the rows a push touches, before
  // the update, as Keras applies `weight_decay` (AdamW): w -= w * wd * lr.
  float weight_decay = 0.0f;
};

// Which ids get a row. Rows are created only for admitted ids; a pull of
// any other id returns the `unadmitted` default and stores nothing.
enum class AdmissionKind : uint32_t {
  kAll = 0,          // every id (the default)
  kFrequency = 1,    // once pushed min_count times (counted in a sketch)
  kProbability = 2,  // a pure function of (seed, id) admits a fraction
};
enum class UnadmittedValue : uint32_t { kZeros = 0, kInitial = 1 };
// What a row's "last touched" stamp counts: pushes of the table on this
// shard, or seconds (wall clock).
enum class ClockKind : uint32_t { kPushes = 0, kSeconds = 1 };
enum class EvictionKind : uint32_t { kLfu = 0, kLru = 1 };
enum class StorageDtype : uint32_t { kFloat32 = 0, kBfloat16 = 1, kFloat16 = 2 };
enum class RoundingKind : uint32_t { kStochastic = 0, kNearest = 1 };

// Memory policy of a table: admission, expiry, eviction and row storage.
// Integers and enums are held as uint64 so that one field list covers them.
struct PolicyConfig {
  uint64_t admission = 0;     // AdmissionKind
  uint64_t min_count = 1;     // kFrequency: pushes before a row is made
  uint64_t sketch_bytes = 0;  // kFrequency: sketch memory, whole table
  uint64_t unadmitted = 0;    // UnadmittedValue
  uint64_t clock = 0;         // ClockKind
  uint64_t ttl = 0;           // remove rows untouched this long; 0: never
  uint64_t max_rows = 0;      // rows per shard; 0: unbounded
  uint64_t eviction = 0;      // EvictionKind
  uint64_t value_dtype = 0;   // StorageDtype of values
  uint64_t slot_dtype = 0;    // StorageDtype of optimizer slots
  uint64_t rounding = 0;      // RoundingKind of 16-bit updates
  float probability = 1.0f;   // kProbability: fraction of ids admitted
};

struct TableConfig {
  std::string name;
  uint32_t dim = 0;
  uint64_t seed = 0;
  InitializerConfig initializer;
  OptimizerConfig optimizer;
  PolicyConfig policy;
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
    {"momentum", &OptimizerConfig::momentum},
    {"nesterov", &OptimizerConfig::nesterov},
    {"weight_decay", &OptimizerConfig::weight_decay},
};

// The policy fields, by name: enum fields name their values (index = enum
// value); plain integers have none. Names are those of TableConfig.to_dict()
// ["policy"] in Python and of the proto's PolicyConfig.
struct PolicyField {
  const char* name;
  uint64_t PolicyConfig::* member;
  const char* const* values;  // null for a plain integer
  uint32_t num_values;
};
inline constexpr const char* kAdmissionNames[] = {"all", "frequency", "probability"};
inline constexpr const char* kUnadmittedNames[] = {"zeros", "initial"};
inline constexpr const char* kClockNames[] = {"pushes", "seconds"};
inline constexpr const char* kEvictionNames[] = {"lfu", "lru"};
inline constexpr const char* kDtypeNames[] = {"float32", "bfloat16", "float16"};
inline constexpr const char* kRoundingNames[] = {"stochastic", "nearest"};
inline constexpr PolicyField kPolicyFields[] = {
    {"admission", &PolicyConfig::admission, kAdmissionNames, 3},
    {"min_count", &PolicyConfig::min_count, nullptr, 0},
    {"sketch_bytes", &PolicyConfig::sketch_bytes, nullptr, 0},
    {"unadmitted", &PolicyConfig::unadmitted, kUnadmittedNames, 2},
    {"clock", &PolicyConfig::clock, kClockNames, 2},
    {"ttl", &PolicyConfig::ttl, nullptr, 0},
    {"max_rows", &PolicyConfig::max_rows, nullptr, 0},
    {"eviction", &PolicyConfig::eviction, kEvictionNames, 2},
    {"value_dtype", &PolicyConfig::value_dtype, kDtypeNames, 3},
    {"slot_dtype", &PolicyConfig::slot_dtype, kDtypeNames, 3},
    {"rounding", &PolicyConfig::rounding, kRoundingNames, 2},
};
// The one float field of the policy.
inline constexpr const char* kProbabilityField = "probability";

// Largest accepted Frequency min_count (counters are 8-bit).
inline constexpr uint64_t kMaxMinCount = 255;
// Largest accepted ttl: stamps are 32-bit and compared modulo 2^32.
inline constexpr uint64_t kMaxTtl = (uint64_t{1} << 31) - 1;
// max_rows, when set, is in [kMinMaxRows, kMaxMaxRows]: each stripe in use
// gets a quota of at least one row, and quotas never overflow.
inline constexpr uint64_t kMinMaxRows = 4096;
inline constexpr uint64_t kMaxMaxRows = uint64_t{1} << 40;
// Largest accepted sketch_bytes (the whole table's sketch).
inline constexpr uint64_t kMaxSketchBytes = uint64_t{1} << 40;

// Bytes per stored value of a dtype (4 or 2).
uint32_t DtypeBytes(uint64_t dtype);

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
