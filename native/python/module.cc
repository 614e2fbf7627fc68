// pybind11 bindings of the native core, data-plane server and client:
// the extension tf_dlt._native. Batched calls release the GIL. Errors are
// raised as the tf_dlt.errors class of their code.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "native/core/routing.h"
#include "native/core/shard.h"
#include "native/core/status.h"
#include "native/core/table.h"
#include "native/core/table_config.h"
#include "native/net/client.h"
#include "native/net/data_server.h"

namespace py = pybind11;

namespace dlt {
namespace {

using IdArray = py::array_t<int64_t, py::array::c_style>;
using FloatArray = py::array_t<float, py::array::c_style>;
using StepArray = py::array_t<uint32_t, py::array::c_style>;
using ByteArray = py::array_t<uint8_t, py::array::c_style>;

[[noreturn]] void Raise(const Status& s) {
  py::object error = py::module_::import("tf_dlt.errors")
                         .attr("error_for_code")(static_cast<int>(s.code()), s.message());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

// A config from its dict form (tf_dlt.TableConfig.to_dict()); parameters
// not given keep their defaults. The field names come from the one list in
// table_config.h.
TableConfig ConfigFromDict(const py::dict& d) {
  TableConfig c;
  c.name = py::cast<std::string>(d["name"]);
  c.dim = py::cast<uint32_t>(d["dim"]);
  c.seed = py::cast<uint64_t>(d["seed"]);
  const py::dict init = d["initializer"];
  const std::string init_kind = py::cast<std::string>(init["kind"]);
  if (!ParseInitializerKind(init_kind, &c.initializer.kind)) {
    Raise(InvalidArgument("unknown initializer '" + init_kind + "'"));
  }
  for (const InitializerField& f : kInitializerFields) {
    if (init.contains(f.name)) c.initializer.*f.member = py::cast<float>(init[f.name]);
  }
  const py::dict opt = d["optimizer"];
  const std::string opt_kind = py::cast<std::string>(opt["kind"]);
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

FloatArray PullTable(Table& t, const IdArray& ids, int mode) {
  CheckIds(ids);
  if (mode < 0 || mode > 2) Raise(InvalidArgument("pull mode must be 0, 1 or 2"));
  const size_t n = static_cast<size_t>(ids.shape(0));
  FloatArray out({n, static_cast<size_t>(t.dim())});
  Status status;
  {
    py::gil_scoped_release release;
    status = t.Pull(ids.data(), n, static_cast<PullMode>(mode), out.mutable_data());
  }
  if (!status.ok()) Raise(status);
  return out;
}

class PyExporter {
 public:
  PyExporter(std::shared_ptr<Table> table, const py::object& since)
      : table_(std::move(table)),
        exporter_(since.is_none() ? Table::Exporter(table_.get())
                                  : Table::Exporter(table_.get(), since.cast<uint32_t>())) {}

  py::object Next(size_t max_rows) {
    const size_t dim = table_->dim(), slots = table_->slot_floats();
    IdArray ids(max_rows);
    FloatArray values({max_rows, dim});
    FloatArray slot_values({max_rows, slots});
    StepArray steps(max_rows);
    StepArray buckets(max_rows);
    StepArray touched(max_rows);
    RowBuffers b{ids.mutable_data(),   values.mutable_data(),  slot_values.mutable_data(),
                 steps.mutable_data(), buckets.mutable_data(), touched.mutable_data()};
    size_t n;
    {
      py::gil_scoped_release release;
      n = exporter_.Next(max_rows, b);
    }
    if (!exporter_.error().ok()) Raise(exporter_.error());
    if (n == 0) return py::none();
    py::slice head(0, static_cast<py::ssize_t>(n), 1);
    return py::make_tuple(ids[head], values[head], slot_values[head], steps[head], buckets[head],
                          touched[head]);
  }

 private:
  std::shared_ptr<Table> table_;
  Table::Exporter exporter_;
};

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
  d["demotions"] = t.demotions;
  d["disk_reads"] = t.disk_reads;
  d["promotions_per_s"] = t.promotions_per_s;
  d["demotions_per_s"] = t.demotions_per_s;
  d["disk_reads_per_s"] = t.disk_reads_per_s;
  d["tier_error"] = t.error;
  return d;
}

void CheckSketch(const Table& t, uint32_t first_bucket, uint32_t end_bucket) {
  if (!t.has_sketch()) Raise(FailedPrecondition("table '" + t.config().name + "' has no sketch"));
  if (!t.SketchHolds(first_bucket, end_bucket)) {
    Raise(InvalidArgument("bucket range [" + std::to_string(first_bucket) + ", " +
                          std::to_string(end_bucket) + ") is not the table's sketch's"));
  }
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

}  // namespace
}  // namespace dlt

PYBIND11_MODULE(_native, m) {
  using namespace dlt;
  m.doc() = "Native core of tf_dlt: table core, data-plane server and client.";
  m.attr("NUM_BUCKETS") = kNumBuckets;
  m.attr("STRIPES") = kStripes;
  m.attr("PROTOCOL_VERSION") = static_cast<int>(wire::kVersion);
  m.attr("DEFAULT_MAX_FRAME_BYTES") = wire::kDefaultMaxFrameBytes;
  // The core's names and layout, so Python never copies them.
  py::dict pull_modes;
  for (size_t i = 0; i < std::size(kPullModeNames); ++i) pull_modes[kPullModeNames[i]] = i;
  m.attr("PULL_MODES") = pull_modes;
  py::dict policy_choices;
  for (const PolicyField& f : kPolicyFields) {
    if (f.values == nullptr) continue;
    py::list names;
    for (uint32_t i = 0; i < f.num_values; ++i) names.append(f.values[i]);
    policy_choices[f.name] = names;
  }
  m.attr("POLICY_CHOICES") = policy_choices;
  py::dict optimizer_slots;
  for (uint32_t k = 0; k <= static_cast<uint32_t>(OptimizerKind::kKerasAdagrad); ++k) {
    const auto kind = static_cast<OptimizerKind>(k);
    optimizer_slots[OptimizerName(kind)] = SlotsPerValue(kind);
  }
  m.attr("OPTIMIZER_SLOTS") = optimizer_slots;
  py::dict dtype_bytes;
  for (uint32_t d = 0; d < std::size(kDtypeNames); ++d) dtype_bytes[kDtypeNames[d]] = DtypeBytes(d);
  m.attr("DTYPE_BYTES") = dtype_bytes;
  m.attr("RECORD_HEADER_BYTES") = Table::kRecordHeaderBytes;
  m.attr("GENERATION_BYTES") = Table::kGenerationBytes;
  m.def("record_bytes", [](const py::dict& d) {
    const TableConfig c = ConfigFromDict(d);
    Check(ValidateTableConfig(c));
    return Table::RecordBytes(c);
  });

  m.def("bucket_of", [](const IdArray& ids) {
    CheckIds(ids);
    py::array_t<uint32_t> out(ids.shape(0));
    auto* o = out.mutable_data();
    for (py::ssize_t i = 0; i < ids.shape(0); ++i) o[i] = BucketOf(ids.data()[i]);
    return out;
  });
  m.def("encode_table_config", [](const py::dict& d) {
    const TableConfig c = ConfigFromDict(d);
    Check(ValidateTableConfig(c));
    return EncodeTableConfig(c);
  });
  m.def("validate_table_config", [](const py::dict& d) {
    const TableConfig c = ConfigFromDict(d);
    Check(ValidateTableConfig(c));
    return ConfigToDict(c);
  });
  m.def("latency_bucket_bounds_us", []() {
    std::vector<double> out;
    for (int i = 0; i < LatencyHistogram::kBuckets; ++i) {
      out.push_back(LatencyHistogram::UpperBoundMicros(i));
    }
    return out;
  });

  py::class_<Table, std::shared_ptr<Table>>(m, "Table")
      .def(py::init([](const py::dict& d, uint32_t first_bucket, uint32_t end_bucket) {
             const TableConfig c = ConfigFromDict(d);
             Check(ValidateTableConfig(c));
             if (first_bucket >= end_bucket || end_bucket > kNumBuckets) {
               Raise(InvalidArgument("bucket range is invalid"));
             }
             return std::make_shared<Table>(c, first_bucket, end_bucket);
           }),
           py::arg("config"), py::arg("first_bucket") = 0, py::arg("end_bucket") = kNumBuckets)
      .def_property_readonly("config", [](const Table& t) { return ConfigToDict(t.config()); })
      .def_property_readonly("name", [](const Table& t) { return t.config().name; })
      .def_property_readonly("dim", &Table::dim)
      .def_property_readonly("slot_floats", &Table::slot_floats)
      .def_property_readonly("record_bytes", &Table::record_bytes)
      .def("size", &Table::size)
      .def("bytes", &Table::bytes)
      .def("pull", &PullTable, py::arg("ids"), py::arg("mode") = 0)
      .def("push",
           [](Table& t, const IdArray& ids, const FloatArray& grads, float lr) {
             CheckIds(ids);
             const size_t n = static_cast<size_t>(ids.shape(0));
             CheckRows(grads, n, t.dim(), "grads");
             Status s;
             {
               py::gil_scoped_release release;
               s = t.Push(ids.data(), grads.data(), n, lr);
             }
             Check(s);
           })
      .def(
          "import_rows",
          [](Table& t, const IdArray& ids, const FloatArray& values, const py::object& slots,
             const py::object& steps, const py::object& touched) {
            CheckIds(ids);
            const size_t n = static_cast<size_t>(ids.shape(0));
            CheckRows(values, n, t.dim(), "values");
            FloatArray slot_array;
            StepArray step_array;
            const float* slot_ptr = nullptr;
            const uint32_t* step_ptr = nullptr;
            if (!slots.is_none() && t.slot_floats() > 0) {
              slot_array = slots.cast<FloatArray>();
              CheckRows(slot_array, n, t.slot_floats(), "slots");
              slot_ptr = slot_array.data();
            }
            if (!steps.is_none()) {
              step_array = StepsFrom(steps, n);
              step_ptr = step_array.data();
            }
            StepArray touched_array;
            const uint32_t* touched_ptr = nullptr;
            if (!touched.is_none()) {
              touched_array = StepsFrom(touched, n);
              touched_ptr = touched_array.data();
            }
            Status s;
            {
              py::gil_scoped_release release;
              s = t.Import(ids.data(), values.data(), slot_ptr, step_ptr, n, touched_ptr);
            }
            Check(s);
          },
          py::arg("ids"), py::arg("values"), py::arg("slots") = py::none(),
          py::arg("steps") = py::none(), py::arg("touched") = py::none())
      .def(
          "shrink",
          [](Table& t, uint64_t min_count, uint64_t unseen_for, const py::object& now) {
            const uint32_t at = now.is_none() ? t.Now() : py::cast<uint32_t>(now);
            py::gil_scoped_release release;
            return t.Shrink(min_count, unseen_for, at);
          },
          py::arg("min_count") = 0, py::arg("unseen_for") = 0, py::arg("now") = py::none())
      .def(
          "expire",
          [](Table& t, const py::object& now) {
            const uint32_t at = now.is_none() ? t.Now() : py::cast<uint32_t>(now);
            py::gil_scoped_release release;
            return t.Expire(at);
          },
          py::arg("now") = py::none())
      .def("now", &Table::Now)
      .def("set_push_clock", &Table::SetPushClock)
      .def("counters", [](const Table& t) { return TableCountersToDict(t.counters()); })
      .def("tier_stats",
           [](const Table& t) {
             TierStats stats;
             {
               py::gil_scoped_release release;
               stats = t.tier_stats();
             }
             return TierStatsToDict(stats);
           })
      .def_property_readonly("has_tier", &Table::has_tier)
      .def("set_ram_limit", &Table::SetRamLimit, py::arg("rows"))
      .def("demote",
           [](Table& t, size_t rows) {
             Status s;
             size_t moved;
             {
               py::gil_scoped_release release;
               moved = t.Demote(rows, &s);
             }
             Check(s);
             return moved;
           })
      .def_property_readonly("sketch_slice_bytes", &Table::sketch_slice_bytes)
      .def("read_sketch",
           [](const Table& t, uint32_t first_bucket, uint32_t end_bucket) {
             CheckSketch(t, first_bucket, end_bucket);
             const size_t n = end_bucket - first_bucket, width = t.sketch_slice_bytes();
             ByteArray counters({n, width});
             StepArray added(n);
             for (size_t b = 0; b < n; ++b) {
               t.ReadSketch(first_bucket + static_cast<uint32_t>(b),
                            counters.mutable_data() + b * width, added.mutable_data() + b);
             }
             return py::make_tuple(counters, added);
           })
      .def("write_sketch",
           [](Table& t, uint32_t first_bucket, const ByteArray& counters, const StepArray& added) {
             const size_t n = added.ndim() == 1 ? static_cast<size_t>(added.shape(0)) : 0;
             CheckSketch(t, first_bucket, first_bucket + static_cast<uint32_t>(n));
             CheckRows(counters, n, t.sketch_slice_bytes(), "sketch counters");
             for (size_t b = 0; b < n; ++b) {
               t.WriteSketch(first_bucket + static_cast<uint32_t>(b),
                             counters.data() + b * t.sketch_slice_bytes(), added.data()[b]);
             }
           })
      .def("sketch_estimate",
           [](const Table& t, const IdArray& ids) {
             CheckIds(ids);
             py::array_t<uint32_t> out(ids.shape(0));
             for (py::ssize_t i = 0; i < ids.shape(0); ++i) {
               out.mutable_data()[i] = t.SketchEstimate(ids.data()[i]);
             }
             return out;
           })
      .def(
          "exporter",
          [](std::shared_ptr<Table> t, const py::object& since) {
            return std::make_unique<PyExporter>(std::move(t), since);
          },
          py::arg("since") = py::none())
      .def("begin_save",
           [](Table& t, const std::string& save_id, const std::string& base) {
             py::gil_scoped_release release;
             const SaveStart s = t.BeginSave(save_id, base);
             py::gil_scoped_acquire acquire;
             return py::make_tuple(s.tracked, s.since, s.base_clock);
           })
      .def("mark_loaded", &Table::MarkLoaded, py::call_guard<py::gil_scoped_release>())
      .def("removed_since",
           [](const Table& t, uint32_t since) {
             std::vector<int64_t> ids;
             {
               py::gil_scoped_release release;
               ids = t.RemovedSince(since);
             }
             IdArray out(ids.size());
             std::copy(ids.begin(), ids.end(), out.mutable_data());
             return out;
           })
      .def("erase",
           [](Table& t, const IdArray& ids) {
             CheckIds(ids);
             py::gil_scoped_release release;
             return t.Erase(ids.data(), static_cast<size_t>(ids.shape(0)));
           })
      .def(
          "erase_buckets",
          [](Table& t, uint32_t first, uint32_t end, const py::object& keep) {
            IdArray kept;
            if (!keep.is_none()) {
              kept = keep.cast<IdArray>();
              CheckIds(kept);
            }
            const size_t n = keep.is_none() ? 0 : static_cast<size_t>(kept.shape(0));
            py::gil_scoped_release release;
            return t.EraseBuckets(first, end, n ? kept.data() : nullptr, n);
          },
          py::arg("first"), py::arg("end"), py::arg("keep") = py::none())
      .def("reserve", &Table::Reserve, py::arg("rows"), py::arg("threads") = 1,
           py::call_guard<py::gil_scoped_release>());

  py::class_<PyExporter>(m, "Exporter").def("next", &PyExporter::Next);

  py::class_<Shard, std::shared_ptr<Shard>>(m, "Shard")
      .def(py::init([](uint32_t index, uint32_t num_shards) {
        if (num_shards == 0 || num_shards > kNumBuckets || index >= num_shards) {
          Raise(InvalidArgument(
              "shard index " + std::to_string(index) + " of " + std::to_string(num_shards) +
              " is invalid: need 0 <= index < num_shards <= " + std::to_string(kNumBuckets)));
        }
        return std::make_shared<Shard>(index, num_shards);
      }))
      .def_property_readonly("shard_index", &Shard::shard_index)
      .def_property_readonly("num_shards", &Shard::num_shards)
      .def_property_readonly("first_bucket", &Shard::first_bucket)
      .def_property_readonly("end_bucket", &Shard::end_bucket)
      .def("create_table",
           [](Shard& s, const py::dict& d) {
             bool created = false;
             Check(s.CreateTable(ConfigFromDict(d), &created));
             return created;
           })
      .def("drop_table", [](Shard& s, const std::string& name) { Check(s.DropTable(name)); })
      .def("get_table",
           [](const Shard& s, const std::string& name) {
             std::shared_ptr<Table> t;
             Check(s.GetTable(name, &t));
             return t;
           })
      .def("tables", &Shard::Tables)
      .def("new_table",
           [](const Shard& s, const py::dict& d) {
             const TableConfig c = ConfigFromDict(d);
             Check(ValidateTableConfig(c));
             return s.NewTable(c);
           })
      .def("sweep", &Shard::Sweep, py::call_guard<py::gil_scoped_release>())
      .def("start_sweeper", &Shard::StartSweeper, py::arg("interval_ms"))
      .def("stop_sweeper", &Shard::StopSweeper, py::call_guard<py::gil_scoped_release>())
      .def("install_tables", &Shard::InstallTables)
      .def(
          "configure_memory",
          [](Shard& s, uint64_t budget, const std::string& storage_dir, int interval_ms) {
            Check(s.ConfigureMemory(budget, storage_dir, interval_ms));
          },
          py::arg("budget_bytes"), py::arg("storage_dir") = "", py::arg("interval_ms") = 20)
      .def("keep_memory", &Shard::KeepMemory, py::call_guard<py::gil_scoped_release>())
      .def("memory_status",
           [](const Shard& s) {
             const Shard::MemoryStatus m = s.memory_status();
             py::dict d;
             d["budget"] = m.budget;
             d["resident"] = m.resident;
             d["table_target"] = m.table_target;
             d["storage_dir"] = m.storage_dir;
             return d;
           })
      .def("check_ownership", [](const Shard& s, const IdArray& ids) {
        CheckIds(ids);
        Check(s.CheckOwnership(ids.data(), static_cast<size_t>(ids.shape(0))));
      });

  m.def("embedded_shard", &EmbeddedShard);

  py::class_<DataServer>(m, "DataServer")
      .def(py::init([](std::shared_ptr<Shard> shard, const std::string& bind, int port,
                       int max_connections, const std::string& auth_token, uint32_t max_frame_bytes,
                       uint32_t admin_port, int io_timeout_ms, int worker_threads,
                       int max_unauthenticated, int hello_timeout_ms, int idle_timeout_ms,
                       uint64_t max_buffered_bytes) {
             DataServerOptions o;
             o.bind = bind;
             o.port = port;
             o.max_connections = max_connections;
             o.auth_token = auth_token;
             o.max_frame_bytes = max_frame_bytes;
             o.admin_port = admin_port;
             o.io_timeout_ms = io_timeout_ms;
             o.worker_threads = worker_threads;
             o.max_unauthenticated = max_unauthenticated;
             o.hello_timeout_ms = hello_timeout_ms;
             o.idle_timeout_ms = idle_timeout_ms;
             o.max_buffered_bytes = max_buffered_bytes;
             return std::make_unique<DataServer>(std::move(shard), o);
           }),
           py::arg("shard"), py::arg("bind") = "127.0.0.1", py::arg("port") = 0,
           py::arg("max_connections") = 0, py::arg("auth_token") = "",
           py::arg("max_frame_bytes") = wire::kDefaultMaxFrameBytes, py::arg("admin_port") = 0,
           py::arg("io_timeout_ms") = 30000, py::arg("worker_threads") = 0,
           py::arg("max_unauthenticated") = 256, py::arg("hello_timeout_ms") = 5000,
           py::arg("idle_timeout_ms") = 600000, py::arg("max_buffered_bytes") = uint64_t{1} << 30)
      .def("start", [](DataServer& s) { Check(s.Start()); })
      .def("set_read_only", &DataServer::set_read_only)
      .def_property_readonly("port", &DataServer::port)
      .def_property_readonly("max_connections", &DataServer::max_connections)
      .def_property_readonly("worker_threads", &DataServer::worker_threads)
      .def("set_admin_port", &DataServer::set_admin_port)
      .def("stop", &DataServer::Stop, py::call_guard<py::gil_scoped_release>())
      .def("counters", [](const DataServer& s) { return CountersToDict(s.counters()); });

  py::class_<Client>(m, "Client")
      .def(py::init([](std::vector<std::string> addresses, const std::string& auth_token,
                       int connect_timeout_ms, int request_timeout_ms, uint32_t frame_bytes,
                       int max_idle_connections) {
             if (addresses.empty()) Raise(InvalidArgument("at least one shard address is needed"));
             if (connect_timeout_ms <= 0 || request_timeout_ms <= 0) {
               Raise(InvalidArgument("timeouts must be positive"));
             }
             if (frame_bytes < wire::kMinMaxFrameBytes) {
               Raise(InvalidArgument("frame_bytes must be at least 4096"));
             }
             ClientOptions o;
             o.auth_token = auth_token;
             o.connect_timeout_ms = connect_timeout_ms;
             o.request_timeout_ms = request_timeout_ms;
             o.frame_bytes = frame_bytes;
             o.max_idle_connections = max_idle_connections;
             return std::make_unique<Client>(std::move(addresses), o);
           }),
           py::arg("addresses"), py::arg("auth_token") = "", py::arg("connect_timeout_ms") = 5000,
           py::arg("request_timeout_ms") = 30000, py::arg("frame_bytes") = 8u << 20,
           py::arg("max_idle_connections") = 8)
      .def_property_readonly("num_shards", &Client::num_shards)
      .def("shard_infos",
           [](Client& c) {
             std::vector<ShardInfo> infos;
             Status s;
             {
               py::gil_scoped_release release;
               s = c.GetShardInfos(&infos);
             }
             Check(s);
             py::list out;
             for (const ShardInfo& i : infos) {
               py::dict d;
               d["address"] = i.address;
               d["shard_index"] = i.shard_index;
               d["num_shards"] = i.num_shards;
               d["admin_port"] = i.admin_port;
               d["max_frame_bytes"] = i.max_frame_bytes;
               out.append(d);
             }
             return out;
           })
      .def(
          "pull",
          [](Client& c, const std::string& table, uint32_t dim, const IdArray& ids, int mode) {
            CheckIds(ids);
            if (mode < 0 || mode > 2) Raise(InvalidArgument("pull mode must be 0, 1 or 2"));
            const size_t n = static_cast<size_t>(ids.shape(0));
            FloatArray out({n, static_cast<size_t>(dim)});
            Status s;
            {
              py::gil_scoped_release release;
              s = c.Pull(table, dim, ids.data(), n, static_cast<PullMode>(mode),
                         out.mutable_data());
            }
            Check(s);
            return out;
          },
          py::arg("table"), py::arg("dim"), py::arg("ids"), py::arg("mode") = 0)
      .def("push",
           [](Client& c, const std::string& table, uint32_t dim, const IdArray& ids,
              const FloatArray& grads, float lr) {
             CheckIds(ids);
             const size_t n = static_cast<size_t>(ids.shape(0));
             CheckRows(grads, n, dim, "grads");
             Status s;
             {
               py::gil_scoped_release release;
               s = c.Push(table, dim, ids.data(), grads.data(), n, lr);
             }
             Check(s);
           })
      .def("assign", [](Client& c, const std::string& table, uint32_t dim, const IdArray& ids,
                        const FloatArray& values) {
        CheckIds(ids);
        const size_t n = static_cast<size_t>(ids.shape(0));
        CheckRows(values, n, dim, "values");
        Status s;
        {
          py::gil_scoped_release release;
          s = c.Assign(table, dim, ids.data(), values.data(), n);
        }
        Check(s);
      });
}
