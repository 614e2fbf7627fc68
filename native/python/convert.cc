// The converters and checks every binding file shares (bindings.h).
#include <string>
#include <vector>

#include "native/python/bindings.h"

namespace dlt {

[[noreturn]] void Raise(const Status& s) {
  py::object error = py::module_::import("tf_dlt.errors")
                         .attr("error_for_code")(static_cast<int>(s.code()), s.message());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

namespace {

// Entry `key` of config dict `d` (`of`: which dict); InvalidArgument naming
// the key when it has none (a bare KeyError before).
py::object Entry(const py::dict& d, const char* key, const char* of) {
  if (!d.contains(key)) {
    Raise(InvalidArgument(std::string(of) + " has no '" + key +
                          "' (tf_dlt.TableConfig.to_dict() gives a whole one)"));
  }
  return d[key];
}

}  // namespace

// A config from its dict form (tf_dlt.TableConfig.to_dict()); parameters
// not given keep their defaults. The field names come from the one list in
// table_config.h.
TableConfig ConfigFromDict(const py::dict& d) {
  TableConfig c;
  c.name = py::cast<std::string>(Entry(d, "name", "table config"));
  c.dim = py::cast<uint32_t>(Entry(d, "dim", "table config"));
  c.seed = py::cast<uint64_t>(Entry(d, "seed", "table config"));
  const py::dict init = Entry(d, "initializer", "table config");
  const std::string init_kind =
      py::cast<std::string>(Entry(init, "kind", "table config's initializer"));
  if (!ParseInitializerKind(init_kind, &c.initializer.kind)) {
    Raise(InvalidArgument("unknown initializer '" + init_kind + "'"));
  }
  for (const InitializerField& f : kInitializerFields) {
    if (init.contains(f.name)) c.initializer.*f.member = py::cast<float>(init[f.name]);
  }
  const py::dict opt = Entry(d, "optimizer", "table config");
  const std::string opt_kind =
      py::cast<std::string>(Entry(opt, "kind", "table config's optimizer"));
  if (!ParseOptimizerKind(opt_kind, &c.optimizer.kind)) {
    Raise(InvalidArgument("unknown optimizer '" + opt_kind + "'"));
  }
  for (const OptimizerField& f : kOptimizerFields) {
    if (opt.contains(f.name)) c.optimizer.*f.member = py::cast<float>(opt[f.name]);
  }
  if (!d.contains("policy")) return c;  // configs written before policies existed
  const py::dict policy = d["policy"];
  for (const PolicyField& f : kPolicyFields) {
    if (!policy.contains(f.name)) continue;
    if (f.values == nullptr) {
      c.policy.*f.member = py::cast<uint64_t>(policy[f.name]);
      continue;
    }
    const std::string value = py::cast<std::string>(policy[f.name]);
    bool known = false;
    for (uint32_t i = 0; i < f.num_values; ++i) {
      if (value == f.values[i]) {
        c.policy.*f.member = i;
        known = true;
      }
    }
    if (!known) Raise(InvalidArgument(std::string("unknown ") + f.name + " '" + value + "'"));
  }
  if (policy.contains(kProbabilityField)) {
    c.policy.probability = py::cast<float>(policy[kProbabilityField]);
  }
  return c;
}

py::dict ConfigToDict(const TableConfig& c) {
  py::dict init, opt, d;
  init["kind"] = InitializerName(c.initializer.kind);
  for (const InitializerField& f : kInitializerFields) init[f.name] = c.initializer.*f.member;
  opt["kind"] = OptimizerName(c.optimizer.kind);
  for (const OptimizerField& f : kOptimizerFields) opt[f.name] = c.optimizer.*f.member;
  d["name"] = c.name;
  d["dim"] = c.dim;
  d["seed"] = c.seed;
  d["initializer"] = init;
  d["optimizer"] = opt;
  py::dict policy;
  for (const PolicyField& f : kPolicyFields) {
    const uint64_t v = c.policy.*f.member;
    if (f.values == nullptr) {
      policy[f.name] = v;
    } else {
      policy[f.name] = v < f.num_values ? f.values[v] : "unknown";
    }
  }
  policy[kProbabilityField] = c.policy.probability;
  d["policy"] = policy;
  return d;
}

void CheckRows(const py::array& a, size_t n, size_t width, const char* what) {
  if (a.ndim() != 2 || static_cast<size_t>(a.shape(0)) != n ||
      static_cast<size_t>(a.shape(1)) != width) {
    Raise(InvalidArgument(std::string(what) + " must have shape [" + std::to_string(n) + ", " +
                          std::to_string(width) + "]"));
  }
}

void CheckIds(const IdArray& ids) {
  if (ids.ndim() != 1) Raise(InvalidArgument("ids must be a 1-D int64 array"));
}

// Update counts of `n` rows as uint32, from an array of any integer type:
// values outside [0, 2^32) are refused, never truncated.
template <typename T>
void CopySteps(const py::array& a, size_t n, uint32_t* out) {
  const auto wide = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
  for (size_t i = 0; i < n; ++i) {
    const T v = wide.data()[i];
    if (v < 0 || static_cast<uint64_t>(v) > UINT32_MAX) {
      Raise(InvalidArgument("step count " + std::to_string(v) + " of row " + std::to_string(i) +
                            " is outside [0, 2^32-1]"));
    }
    out[i] = static_cast<uint32_t>(v);
  }
}

StepArray StepsFrom(const py::object& steps, size_t n) {
  const py::array a = py::array::ensure(steps);
  const std::string kind = a ? py::str(a.dtype().attr("kind")).cast<std::string>() : "";
  if (kind != "i" && kind != "u") Raise(InvalidArgument("steps must be an integer array"));
  if (a.ndim() != 1 || static_cast<size_t>(a.shape(0)) != n) {
    Raise(InvalidArgument("steps must have shape [" + std::to_string(n) + "]"));
  }
  StepArray out(n);
  if (kind == "u") {
    CopySteps<uint64_t>(a, n, out.mutable_data());
  } else {
    CopySteps<int64_t>(a, n, out.mutable_data());
  }
  return out;
}

py::dict TableCountersToDict(const TableCounters& c) {
  py::dict d;
  d["admitted"] = c.admitted;
  d["refused"] = c.refused;
  d["expired"] = c.expired;
  d["evicted"] = c.evicted;
  d["shrunk"] = c.shrunk;
  return d;
}

py::dict TierStatsToDict(const TierStats& t) {
  py::dict d;
  d["ram_rows"] = t.ram_rows;
  d["disk_rows"] = t.disk_rows;
  d["ram_bytes"] = t.ram_bytes;
  d["disk_bytes"] = t.disk_bytes;
  d["promotions"] = t.promotions;
  d["disk_updates"] = t.disk_updates;
  d["demotions"] = t.demotions;
  d["disk_reads"] = t.disk_reads;
  d["disk_read_errors"] = t.disk_read_errors;
  d["disk_write_errors"] = t.disk_write_errors;
  d["promotions_per_s"] = t.promotions_per_s;
  d["demotions_per_s"] = t.demotions_per_s;
  d["disk_reads_per_s"] = t.disk_reads_per_s;
  d["tier_error"] = t.error;
  return d;
}

py::dict CountersToDict(const ServerCounters& c) {
  py::dict d;
  d["connections_accepted"] = c.connections_accepted.load();
  d["connections_open"] = c.connections_open.load();
  d["connections_authenticated"] = c.connections_authenticated.load();
  d["connections_refused"] = c.connections_refused.load();
  d["connections_evicted"] = c.connections_evicted.load();
  d["connections_waiting"] = c.connections_waiting.load();
  d["memory_waits"] = c.memory_waits.load();
  d["hello_timeouts"] = c.hello_timeouts.load();
  d["idle_timeouts"] = c.idle_timeouts.load();
  d["io_timeouts"] = c.io_timeouts.load();
  d["accept_errors"] = c.accept_errors.load();
  d["buffered_bytes"] = c.buffered_bytes.load();
  d["hellos"] = c.hellos.load();
  d["pulls"] = c.pulls.load();
  d["pushes"] = c.pushes.load();
  d["pulled_rows"] = c.pulled_rows.load();
  d["pushed_rows"] = c.pushed_rows.load();
  d["assigned_rows"] = c.assigned_rows.load();
  d["repeated_pushes"] = c.repeated_pushes.load();
  d["standby_rounds_dropped"] = c.standby_rounds_dropped.load();
  d["bytes_in"] = c.bytes_in.load();
  d["bytes_out"] = c.bytes_out.load();
  py::dict errors;
  for (int code = 1; code < 17; ++code) {
    const uint64_t v = c.errors[code].load();
    if (v) errors[CodeName(static_cast<Code>(code))] = v;
  }
  d["errors"] = errors;
  d["pull_latency"] = c.pull_latency.Snapshot();
  d["push_latency"] = c.push_latency.Snapshot();
  d["pull_latency_sum_us"] = c.pull_latency.SumMicros();
  d["push_latency_sum_us"] = c.push_latency.SumMicros();
  return d;
}

}  // namespace dlt
