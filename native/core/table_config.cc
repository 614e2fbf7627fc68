#include "native/core/table_config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <sstream>

#include "native/core/routing.h"

namespace dlt {
namespace {

bool Finite(float v) { return std::isfinite(v); }

// `name` with every byte outside printable ASCII as \xNN: error messages
// stay valid UTF-8 whatever a request held.
std::string Escaped(const std::string& name) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : name) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

Status ValidatePolicy(const PolicyConfig& p, const std::string& where) {
  for (const PolicyField& f : kPolicyFields) {
    if (f.values != nullptr && p.*f.member >= f.num_values) {
      return InvalidArgument(where + "unknown " + f.name + " " + std::to_string(p.*f.member));
    }
  }
  if (p.admission == static_cast<uint64_t>(AdmissionKind::kFrequency)) {
    if (p.min_count < 1 || p.min_count > kMaxMinCount) {
      return InvalidArgument(where + "frequency admission needs min_count in [1, " +
                             std::to_string(kMaxMinCount) + "], got " +
                             std::to_string(p.min_count));
    }
    if (p.sketch_bytes < kNumBuckets * 4 * 8 || p.sketch_bytes > kMaxSketchBytes) {
      return InvalidArgument(where + "frequency admission needs sketch_bytes in [" +
                             std::to_string(kNumBuckets * 4 * 8) + ", 2^40], got " +
                             std::to_string(p.sketch_bytes));
    }
  }
  if (p.admission == static_cast<uint64_t>(AdmissionKind::kProbability) &&
      !(p.probability > 0.0f && p.probability <= 1.0f)) {
    return InvalidArgument(where + "probability admission needs a probability in (0, 1], got " +
                           std::to_string(p.probability));
  }
  if (p.max_rows != 0 && (p.max_rows < kMinMaxRows || p.max_rows > kMaxMaxRows)) {
    return InvalidArgument(where + "max_rows must be 0 (unbounded) or in [4096, 2^40], got " +
                           std::to_string(p.max_rows));
  }
  if (p.ttl > kMaxTtl) {
    return InvalidArgument(where + "ttl must be at most 2^31-1, got " + std::to_string(p.ttl));
  }
  return OkStatus();
}

}  // namespace

Status ValidateTableName(const std::string& name) {
  if (name.empty()) return InvalidArgument("table name must not be empty");
  if (name.size() > kMaxTableNameBytes) {
    return InvalidArgument("table name is " + std::to_string(name.size()) + " bytes, at most " +
                           std::to_string(kMaxTableNameBytes) + " allowed");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.' || c == '/';
    if (!ok) {
      return InvalidArgument("table name '" + Escaped(name) +
                             "' may only hold letters, digits and _-./");
    }
  }
  // '/' separates parts (an HDF5 group in a checkpoint): none empty, none
  // "." or "..", so a name is never a path that leads elsewhere.
  size_t start = 0;
  while (start <= name.size()) {
    const size_t end = std::min(name.find('/', start), name.size());
    const std::string part = name.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") {
      return InvalidArgument("table name '" + Escaped(name) +
                             "' has an empty, '.' or '..' part between its '/'s");
    }
    start = end + 1;
  }
  return OkStatus();
}

Status ValidateTableConfig(const TableConfig& c) {
  DLT_RETURN_IF_ERROR(ValidateTableName(c.name));
  const std::string where = "table '" + c.name + "': ";
  if (c.dim == 0 || c.dim > kMaxDim) {
    return InvalidArgument(where + "dim must be in [1, " + std::to_string(kMaxDim) + "], got " +
                           std::to_string(c.dim));
  }
  const InitializerConfig& i = c.initializer;
  if (!Finite(i.value) || !Finite(i.minval) || !Finite(i.maxval) || !Finite(i.mean) ||
      !Finite(i.stddev)) {
    return InvalidArgument(where + "initializer parameters must be finite");
  }
  switch (i.kind) {
    case InitializerKind::kZeros:
    case InitializerKind::kConstant:
      break;
    case InitializerKind::kUniform:
      if (!(i.minval < i.maxval)) {
        return InvalidArgument(where +
                               "uniform initializer needs minval < "
                               "maxval, got [" +
                               std::to_string(i.minval) + ", " + std::to_string(i.maxval) + ")");
      }
      break;
    case InitializerKind::kNormal:
    case InitializerKind::kTruncatedNormal:
      if (!(i.stddev > 0)) {
        return InvalidArgument(where +
                               "normal initializer needs stddev > 0, "
                               "got " +
                               std::to_string(i.stddev));
      }
      break;
    default:
      return InvalidArgument(where + "unknown initializer kind " +
                             std::to_string(static_cast<uint32_t>(i.kind)));
  }
  const OptimizerConfig& o = c.optimizer;
  if (!(o.weight_decay >= 0) || !Finite(o.weight_decay)) {
    return InvalidArgument(where + "weight_decay must be finite and >= 0, got " +
                           std::to_string(o.weight_decay));
  }
  switch (o.kind) {
    case OptimizerKind::kSgd:
      break;
    case OptimizerKind::kMomentum:
      if (!(o.momentum >= 0 && o.momentum <= 1)) {
        return InvalidArgument(where + "momentum must be in [0, 1], got " +
                               std::to_string(o.momentum));
      }
      if (o.nesterov != 0.0f && o.nesterov != 1.0f) {
        return InvalidArgument(where + "nesterov must be 0 or 1, got " +
                               std::to_string(o.nesterov));
      }
      break;
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kKerasAdagrad:
      if (!(o.initial_accumulator >= 0) || !(o.epsilon >= 0) || !Finite(o.initial_accumulator) ||
          !Finite(o.epsilon)) {
        return InvalidArgument(where +
                               "adagrad needs finite "
                               "initial_accumulator >= 0 and "
                               "epsilon >= 0");
      }
      if (o.initial_accumulator == 0 && o.epsilon == 0) {
        return InvalidArgument(where +
                               "adagrad with initial_accumulator = 0 "
                               "needs epsilon > 0");
      }
      break;
    case OptimizerKind::kAdam:
      if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1)) {
        return InvalidArgument(where +
                               "adam needs beta1 and beta2 in [0, 1), "
                               "got " +
                               std::to_string(o.beta1) + ", " + std::to_string(o.beta2));
      }
      if (!(o.epsilon > 0) || !Finite(o.epsilon)) {
        return InvalidArgument(where + "adam needs a finite epsilon > 0");
      }
      break;
    case OptimizerKind::kFtrl:
      if (!(o.learning_rate_power <= 0) || !Finite(o.learning_rate_power)) {
        return InvalidArgument(where +
                               "ftrl needs learning_rate_power <= 0, "
                               "got " +
                               std::to_string(o.learning_rate_power));
      }
      if (!(o.l1 >= 0) || !(o.l2 >= 0) || !Finite(o.l1) || !Finite(o.l2)) {
        return InvalidArgument(where + "ftrl needs finite l1 >= 0, l2 >= 0");
      }
      if (!(o.initial_accumulator > 0) || !Finite(o.initial_accumulator)) {
        return InvalidArgument(where + "ftrl needs initial_accumulator > 0");
      }
      break;
    default:
      return InvalidArgument(where + "unknown optimizer kind " +
                             std::to_string(static_cast<uint32_t>(o.kind)));
  }
  return ValidatePolicy(c.policy, where);
}

uint32_t DtypeBytes(uint64_t dtype) {
  return dtype == static_cast<uint64_t>(StorageDtype::kFloat32) ? 4 : 2;
}

uint32_t SlotsPerValue(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return 0;
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kKerasAdagrad:
    case OptimizerKind::kMomentum:
      return 1;
    case OptimizerKind::kAdam:
    case OptimizerKind::kFtrl:
      return 2;
  }
  return 0;
}

namespace {

constexpr const char* kInitializerNames[] = {"zeros", "constant", "uniform", "normal",
                                             "truncated_normal"};
constexpr const char* kOptimizerNames[] = {"sgd",  "adagrad",       "adam",
                                           "ftrl", "keras_adagrad", "momentum"};
static_assert(std::size(kOptimizerNames) == kNumOptimizerKinds);

template <typename Kind, size_t N>
bool ParseKind(const char* const (&names)[N], const std::string& name, Kind* kind) {
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) {
      *kind = static_cast<Kind>(i);
      return true;
    }
  }
  return false;
}

template <size_t N>
const char* KindName(const char* const (&names)[N], uint32_t kind) {
  return kind < N ? names[kind] : "unknown";
}

const char* PolicyValueName(const PolicyConfig& p, const PolicyField& f) {
  const uint64_t v = p.*f.member;
  return v < f.num_values ? f.values[v] : "unknown";
}

std::string FloatText(float v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
  return buf;
}

}  // namespace

const char* OptimizerName(OptimizerKind kind) {
  return KindName(kOptimizerNames, static_cast<uint32_t>(kind));
}

const char* InitializerName(InitializerKind kind) {
  return KindName(kInitializerNames, static_cast<uint32_t>(kind));
}

bool ParseInitializerKind(const std::string& name, InitializerKind* kind) {
  return ParseKind(kInitializerNames, name, kind);
}

bool ParseOptimizerKind(const std::string& name, OptimizerKind* kind) {
  return ParseKind(kOptimizerNames, name, kind);
}

bool SameTable(const TableConfig& a, const TableConfig& b) {
  if (a.name != b.name || a.dim != b.dim || a.seed != b.seed ||
      a.initializer.kind != b.initializer.kind || a.optimizer.kind != b.optimizer.kind) {
    return false;
  }
  for (const InitializerField& f : kInitializerFields) {
    if (a.initializer.*f.member != b.initializer.*f.member) return false;
  }
  for (const OptimizerField& f : kOptimizerFields) {
    if (a.optimizer.*f.member != b.optimizer.*f.member) return false;
  }
  for (const PolicyField& f : kPolicyFields) {
    if (a.policy.*f.member != b.policy.*f.member) return false;
  }
  return a.policy.probability == b.policy.probability;
}

std::string Describe(const TableConfig& c) {
  std::ostringstream out;
  out << "'" << c.name << "' (dim " << c.dim << ", seed " << c.seed << ", "
      << InitializerName(c.initializer.kind) << " initializer, " << OptimizerName(c.optimizer.kind);
  if (c.optimizer.weight_decay != 0) out << " with weight_decay " << c.optimizer.weight_decay;
  const PolicyConfig& p = c.policy;
  if (p.admission != 0) out << ", " << PolicyValueName(p, kPolicyFields[0]) << " admission";
  if (p.ttl != 0) out << ", ttl " << p.ttl << " " << PolicyValueName(p, kPolicyFields[4]);
  if (p.max_rows != 0) out << ", max_rows " << p.max_rows;
  if (p.value_dtype != 0) out << ", " << PolicyValueName(p, kPolicyFields[8]) << " values";
  out << ")";
  return out.str();
}

std::string EncodeTableConfig(const TableConfig& c) {
  std::string out = "name=" + c.name + " dim=" + std::to_string(c.dim) +
                    " seed=" + std::to_string(c.seed) +
                    " initializer=" + InitializerName(c.initializer.kind);
  for (const InitializerField& f : kInitializerFields) {
    out += std::string(" initializer.") + f.name + "=" + FloatText(c.initializer.*f.member);
  }
  out += std::string(" optimizer=") + OptimizerName(c.optimizer.kind);
  for (const OptimizerField& f : kOptimizerFields) {
    out += std::string(" optimizer.") + f.name + "=" + FloatText(c.optimizer.*f.member);
  }
  for (const PolicyField& f : kPolicyFields) {
    out += std::string(" policy.") + f.name + "=" +
           (f.values ? PolicyValueName(c.policy, f) : std::to_string(c.policy.*f.member));
  }
  out += std::string(" policy.") + kProbabilityField + "=" + FloatText(c.policy.probability);
  return out;
}

namespace {

bool ParsePolicyValue(const PolicyField& f, const std::string& value, uint64_t* out) {
  if (f.values == nullptr) {
    char* end = nullptr;
    *out = std::strtoull(value.c_str(), &end, 10);
    return !value.empty() && value[0] != '-' && *end == '\0';
  }
  for (uint32_t i = 0; i < f.num_values; ++i) {
    if (value == f.values[i]) {
      *out = i;
      return true;
    }
  }
  return false;
}

}  // namespace

Status DecodeTableConfig(const std::string& text, TableConfig* c) {
  std::istringstream in(text);
  std::string token;
  while (in >> token) {
    const size_t eq = token.find('=');
    if (eq == std::string::npos) {
      return InvalidArgument("table config token '" + Escaped(token) + "' is not key=value");
    }
    const std::string key = token.substr(0, eq), value = token.substr(eq + 1);
    char* end = nullptr;
    bool known = true, parsed = true;
    if (key == "name") {
      c->name = value;
    } else if (key == "dim") {
      const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
      parsed = *end == '\0' && v <= UINT32_MAX;
      c->dim = static_cast<uint32_t>(v);
    } else if (key == "seed") {
      c->seed = std::strtoull(value.c_str(), &end, 10);
      parsed = *end == '\0';
    } else if (key == "initializer") {
      parsed = ParseInitializerKind(value, &c->initializer.kind);
    } else if (key == "optimizer") {
      parsed = ParseOptimizerKind(value, &c->optimizer.kind);
    } else if (key.rfind("policy.", 0) == 0 && key != std::string("policy.") + kProbabilityField) {
      known = false;
      for (const PolicyField& f : kPolicyFields) {
        if (key == std::string("policy.") + f.name) {
          known = true;
          parsed = ParsePolicyValue(f, value, &(c->policy.*f.member));
        }
      }
    } else {
      known = false;
      const float v = std::strtof(value.c_str(), &end);
      for (const InitializerField& f : kInitializerFields) {
        if (key == std::string("initializer.") + f.name) {
          c->initializer.*f.member = v;
          known = true;
        }
      }
      for (const OptimizerField& f : kOptimizerFields) {
        if (key == std::string("optimizer.") + f.name) {
          c->optimizer.*f.member = v;
          known = true;
        }
      }
      if (key == std::string("policy.") + kProbabilityField) {
        c->policy.probability = v;
        known = true;
      }
      parsed = !value.empty() && *end == '\0';
    }
    if (!known) return InvalidArgument("unknown table config field '" + Escaped(key) + "'");
    if (!parsed) {
      return InvalidArgument("table config field " + Escaped(key) + " has a bad value '" +
                             Escaped(value) + "'");
    }
  }
  return OkStatus();
}

}  // namespace dlt
