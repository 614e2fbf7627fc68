// Bindings of Table (the table core: pulls, pushes, import/export, the
// sketch, the disk tier, change tracking) and its Exporter.
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "native/python/bindings.h"

namespace dlt {
namespace {

FloatArray PullTable(Table& t, const IdArray& ids, int mode) {
  CheckIds(ids);
  if (mode < 0 || mode > 2) Raise(InvalidArgument("pull mode must be 0, 1 or 2"));
  const size_t n = static_cast<size_t>(ids.shape(0));
  FloatArray out({n, static_cast<size_t>(t.dim())});
  Status status;
  {
    GilRelease release;
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
    Status error;
    {
      // One call at a time: threads that share an exporter take its rows in
      // turn (its position is no more than a plain struct). The lock is
      // taken without the GIL, so a call waiting for it blocks no thread.
      GilRelease release;
      std::lock_guard<std::mutex> lock(mu_);
      n = exporter_.Next(max_rows, b);
      error = exporter_.error();
    }
    if (!error.ok()) Raise(error);
    if (n == 0) return py::none();
    py::slice head(0, static_cast<py::ssize_t>(n), 1);
    return py::make_tuple(ids[head], values[head], slot_values[head], steps[head], buckets[head],
                          touched[head]);
  }

 private:
  std::shared_ptr<Table> table_;
  std::mutex mu_;
  Table::Exporter exporter_;  // guarded by mu_
};

void CheckSketch(const Table& t, uint32_t first_bucket, uint32_t end_bucket) {
  if (!t.has_sketch()) Raise(FailedPrecondition("table '" + t.config().name + "' has no sketch"));
  if (!t.SketchHolds(first_bucket, end_bucket)) {
    Raise(InvalidArgument("bucket range [" + std::to_string(first_bucket) + ", " +
                          std::to_string(end_bucket) + ") is not the table's sketch's"));
  }
}

// The time `now` of shrink and expire: the table's clock for None, else
// an integer 0 to 2^32 - 1 (a negative one raised a bare RuntimeError).
uint32_t NowOf(const Table& t, const py::object& now) {
  if (now.is_none()) return t.Now();
  try {
    return py::cast<uint32_t>(now);
  } catch (const py::cast_error&) {
    Raise(InvalidArgument("now must be an integer 0 to 4294967295 (None: the table's clock), got " +
                          py::cast<std::string>(py::repr(now))));
  }
}

// The update counts (or stamps) of an import: null for None, else one per
// row, held in `keep`.
const uint32_t* OptionalSteps(const py::object& steps, size_t n, StepArray* keep) {
  if (steps.is_none()) return nullptr;
  *keep = StepsFrom(steps, n);
  return keep->data();
}

}  // namespace

void BindTable(py::module_& m) {
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
      .def_property_readonly("pushes", &Table::pushes)
      .def_property("provisional", &Table::provisional, &Table::set_provisional)
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
               GilRelease release;
               s = t.Push(ids.data(), grads.data(), n, lr);
             }
             Check(s);
           })
      .def(
          "import_rows",
          [](Table& t, const IdArray& ids, const FloatArray& values, const py::object& slots,
             const py::object& steps, const py::object& touched, bool evict) {
            CheckIds(ids);
            const size_t n = static_cast<size_t>(ids.shape(0));
            CheckRows(values, n, t.dim(), "values");
            FloatArray slot_array;
            const float* slot_ptr = nullptr;
            if (!slots.is_none() && t.slot_floats() > 0) {
              slot_array = slots.cast<FloatArray>();
              CheckRows(slot_array, n, t.slot_floats(), "slots");
              slot_ptr = slot_array.data();
            }
            StepArray step_array, touched_array;
            const uint32_t* step_ptr = OptionalSteps(steps, n, &step_array);
            const uint32_t* touched_ptr = OptionalSteps(touched, n, &touched_array);
            Status s;
            {
              GilRelease release;
              s = t.Import(ids.data(), values.data(), slot_ptr, step_ptr, n, touched_ptr,
                           /*to_disk=*/true, evict);
            }
            Check(s);
          },
          py::arg("ids"), py::arg("values"), py::arg("slots") = py::none(),
          py::arg("steps") = py::none(), py::arg("touched") = py::none(), py::arg("evict") = true)
      .def(
          "import_stored_rows",
          [](Table& t, const IdArray& ids, const py::array& values, const py::object& slots,
             const py::object& steps, const py::object& touched, bool evict) {
            // Values and slots as the table stores them (uint16 rows for a
            // 16-bit dtype, float32 rows otherwise), C-contiguous.
            CheckIds(ids);
            const size_t n = static_cast<size_t>(ids.shape(0));
            auto check = [&](const py::array& a, size_t row_bytes, const char* what) {
              const bool contiguous = (a.flags() & py::array::c_style) != 0;
              if (!contiguous || a.ndim() != 2 || static_cast<size_t>(a.shape(0)) != n ||
                  static_cast<size_t>(a.shape(1) * a.itemsize()) != row_bytes) {
                throw py::value_error(std::string(what) + " must be C-contiguous rows of " +
                                      std::to_string(row_bytes) + " bytes each, one per id");
              }
            };
            check(values, t.value_bytes(), "values");
            py::array slot_array;
            const void* slot_ptr = nullptr;
            if (!slots.is_none() && t.slot_floats() > 0) {
              slot_array = slots.cast<py::array>();
              check(slot_array, t.slot_bytes(), "slots");
              slot_ptr = slot_array.data();
            }
            StepArray step_array, touched_array;
            const uint32_t* step_ptr = OptionalSteps(steps, n, &step_array);
            const uint32_t* touched_ptr = OptionalSteps(touched, n, &touched_array);
            Status s;
            {
              GilRelease release;
              s = t.ImportStored(ids.data(), values.data(), slot_ptr, step_ptr, n, touched_ptr,
                                 evict);
            }
            Check(s);
          },
          py::arg("ids"), py::arg("values"), py::arg("slots") = py::none(),
          py::arg("steps") = py::none(), py::arg("touched") = py::none(), py::arg("evict") = true)
      .def(
          "shrink",
          [](Table& t, uint64_t min_count, uint64_t unseen_for, const py::object& now) {
            const uint32_t at = NowOf(t, now);
            GilRelease release;
            return t.Shrink(min_count, unseen_for, at);
          },
          py::arg("min_count") = 0, py::arg("unseen_for") = 0, py::arg("now") = py::none())
      .def(
          "expire",
          [](Table& t, const py::object& now) {
            const uint32_t at = NowOf(t, now);
            GilRelease release;
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
               GilRelease release;
               stats = t.tier_stats();
             }
             return TierStatsToDict(stats);
           })
      .def_property_readonly("has_tier", &Table::has_tier)
      .def("set_ram_limit", &Table::SetRamLimit, py::arg("rows"))
      .def("begin_hot_load", &Table::BeginHotLoad, py::arg("rows"))
      .def("end_hot_load", &Table::EndHotLoad)
      .def("demote",
           [](Table& t, size_t rows) {
             Status s;
             size_t moved;
             {
               GilRelease release;
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
             SaveStart s;
             {
               GilRelease release;
               s = t.BeginSave(save_id, base);
             }
             return py::make_tuple(s.tracked, s.since, s.base_clock);
           })
      .def("mark_loaded", &Table::MarkLoaded, py::call_guard<GilRelease>())
      .def("removed_since",
           [](const Table& t, uint32_t since) {
             std::vector<int64_t> ids;
             Status status;
             {
               GilRelease release;
               status = t.RemovedSince(since, &ids);
             }
             Check(status);
             IdArray out(ids.size());
             std::copy(ids.begin(), ids.end(), out.mutable_data());
             return out;
           })
      .def(
          "rows_past_quota",
          [](const Table& t, const IdArray& ids, const IdArray& removed) {
            CheckIds(ids);
            CheckIds(removed);
            GilRelease release;
            return t.RowsPastQuota(ids.data(), static_cast<size_t>(ids.shape(0)), removed.data(),
                                   static_cast<size_t>(removed.shape(0)));
          },
          py::arg("ids"), py::arg("removed"))
      .def("rows_held_past_quota",
           [](const Table& t) {
             GilRelease release;
             return t.RowsHeldPastQuota();
           })
      .def("erase",
           [](Table& t, const IdArray& ids) {
             CheckIds(ids);
             size_t erased;
             Status status;
             {
               GilRelease release;
               erased = t.Erase(ids.data(), static_cast<size_t>(ids.shape(0)), &status);
             }
             Check(status);
             return erased;
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
            size_t erased;
            Status status;
            {
              GilRelease release;
              erased = t.EraseBuckets(first, end, n ? kept.data() : nullptr, n, &status);
            }
            Check(status);
            return erased;
          },
          py::arg("first"), py::arg("end"), py::arg("keep") = py::none())
      .def("reserve", &Table::Reserve, py::arg("rows"), py::arg("threads") = 1,
           py::call_guard<GilRelease>());

  py::class_<PyExporter>(m, "Exporter").def("next", &PyExporter::Next);
}

}  // namespace dlt
