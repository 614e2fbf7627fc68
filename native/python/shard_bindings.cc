// Bindings of Shard (the tables of one server, its bucket range, sweeps and
// the memory keeper) and the process's embedded shard.
#include <memory>
#include <string>
#include <vector>

#include "native/core/shard.h"
#include "native/python/bindings.h"

namespace dlt {

void BindShard(py::module_& m) {
  py::class_<Shard, std::shared_ptr<Shard>>(m, "Shard")
      .def(py::init([](uint32_t index, uint32_t num_shards) {
        // An index equal to the count: a shard that owns no bucket (a
        // process that joins a layout by a re-shard).
        Check(Shard::CheckPlace(index, num_shards));
        return std::make_shared<Shard>(index, num_shards);
      }))
      .def_property_readonly("shard_index", &Shard::shard_index)
      .def_property_readonly("num_shards", &Shard::num_shards)
      .def_property_readonly("epoch", &Shard::epoch)
      .def_property_readonly("fence_epoch", &Shard::fence_epoch)
      .def_property_readonly("superseded_by", &Shard::superseded_by)
      .def_property_readonly("replaced_by", &Shard::replaced_by)
      .def("fence", &Shard::Fence, py::arg("epoch"))
      .def("follow_epoch", &Shard::FollowEpoch, py::arg("epoch"), py::arg("lineage") = 0)
      .def_property_readonly("lineage", &Shard::lineage)
      .def_property_readonly("layout_epoch", &Shard::layout_epoch)
      .def_property_readonly("layout_addresses", &Shard::layout_addresses)
      .def("drop_previous_layout", &Shard::DropPreviousLayout)
      .def_property_readonly("has_previous_layout", &Shard::has_previous_layout)
      .def(
          "take_place",
          [](Shard& s, uint32_t shard_index, uint32_t num_shards, uint64_t layout_epoch,
             const std::string& addresses) {
            Check(s.TakePlace(shard_index, num_shards, layout_epoch, addresses));
          },
          py::arg("shard_index"), py::arg("num_shards"), py::arg("layout_epoch"),
          py::arg("addresses"))
      .def_property_readonly("first_bucket", &Shard::first_bucket)
      .def_property_readonly("end_bucket", &Shard::end_bucket)
      .def(
          "create_table",
          [](Shard& s, const py::dict& d, bool provisional) {
            bool created = false;
            Check(s.CreateTable(ConfigFromDict(d), &created, provisional));
            return created;
          },
          py::arg("config"), py::arg("provisional") = false)
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
      .def("sweep", &Shard::Sweep, py::call_guard<GilRelease>())
      .def("start_sweeper", &Shard::StartSweeper, py::arg("interval_ms"))
      .def("stop_sweeper", &Shard::StopSweeper, py::call_guard<GilRelease>())
      .def("install_tables",
           [](Shard& s, const std::vector<std::shared_ptr<Table>>& tables) {
             for (const auto& t : tables) {
               if (t == nullptr) throw py::type_error("install_tables takes Tables, not None");
             }
             s.InstallTables(tables);
           })
      .def(
          "configure_memory",
          [](Shard& s, uint64_t budget, const std::string& storage_dir, int interval_ms) {
            Check(s.ConfigureMemory(budget, storage_dir, interval_ms));
          },
          py::arg("budget_bytes"), py::arg("storage_dir") = "", py::arg("interval_ms") = 20)
      .def("keep_memory", &Shard::KeepMemory, py::call_guard<GilRelease>())
      .def("set_persisting", &Shard::SetPersisting, py::arg("persisting"))
      .def_static("resident_bytes", &Shard::ResidentBytes)
      .def_static("trimmed_resident_bytes", &Shard::TrimmedResidentBytes,
                  py::call_guard<GilRelease>())
      .def("memory_status",
           [](const Shard& s) {
             const Shard::MemoryStatus m = s.memory_status();
             py::dict d;
             d["budget"] = m.budget;
             d["resident"] = m.resident;
             d["table_target"] = m.table_target;
             d["staged_bytes"] = m.staged_bytes;
             d["storage_dir"] = m.storage_dir;
             return d;
           })
      .def("check_ownership", [](const Shard& s, const IdArray& ids) {
        CheckIds(ids);
        Check(s.CheckOwnership(ids.data(), static_cast<size_t>(ids.shape(0))));
      });

  m.def("embedded_shard", &EmbeddedShard);
}

}  // namespace dlt
