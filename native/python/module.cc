// pybind11 bindings of the native core, data-plane server and client:
// the extension tf_dlt._native. Batched calls release the GIL. Errors are
// raised as the tf_dlt.errors class of their code. Module-level names here;
// each area's classes in its binding file (bindings.h).
#include <iterator>
#include <vector>

#include "native/core/routing.h"
#include "native/core/shard.h"
#include "native/net/auth_tokens.h"
#include "native/net/server_stats.h"
#include "native/net/wire.h"
#include "native/python/bindings.h"

PYBIND11_MODULE(_native, m) {
  using namespace dlt;
  m.doc() = "Native core of tf_dlt: table core, data-plane server and client.";
  m.attr("NUM_BUCKETS") = kNumBuckets;
  m.attr("STRIPES") = kStripes;
  m.attr("PROTOCOL_VERSION") = static_cast<int>(wire::kVersion);
  m.attr("DEFAULT_MAX_FRAME_BYTES") = wire::kDefaultMaxFrameBytes;
  m.attr("MIN_MAX_FRAME_BYTES") = wire::kMinMaxFrameBytes;
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
  for (uint32_t k = 0; k < kNumOptimizerKinds; ++k) {
    const auto kind = static_cast<OptimizerKind>(k);
    optimizer_slots[OptimizerName(kind)] = SlotsPerValue(kind);
  }
  m.attr("OPTIMIZER_SLOTS") = optimizer_slots;
  py::dict dtype_bytes;
  for (uint32_t d = 0; d < std::size(kDtypeNames); ++d) dtype_bytes[kDtypeNames[d]] = DtypeBytes(d);
  m.attr("DTYPE_BYTES") = dtype_bytes;
  m.attr("RECORD_HEADER_BYTES") = Table::kRecordHeaderBytes;
  m.attr("PERSIST_RESERVE_BYTES") = dlt::Shard::kPersistReserve;
  m.attr("MIN_ROW_ROOM_BYTES") = dlt::Shard::kMinRowRoom;
  m.attr("MEMORY_TARGET_FRACTION") = dlt::Shard::kTargetFraction;
  m.attr("MEMORY_LOW_WATER") = dlt::Shard::kLowWater;
  m.attr("GENERATION_BYTES") = Table::kGenerationBytes;
  m.def("tier_page", [](size_t record_bytes) {
    const TierFile::Page page = TierFile::PageFor(record_bytes);
    return py::make_tuple(page.bytes, page.slots, page.ram_bytes);
  });
  m.def("record_bytes", [](const py::dict& d) {
    const TableConfig c = ConfigFromDict(d);
    Check(ValidateTableConfig(c));
    return Table::RecordBytes(c);
  });

  m.def("set_client_token", &SetClientToken, py::arg("name"), py::arg("token"));
  m.def(
      "read_token_file",
      [](const py::bytes& path, const std::string& named_by) {
        const std::string file = path;
        std::string token;
        CheckWithoutGil([&] { return ReadTokenFile(file, named_by, &token); });
        return token;
      },
      py::arg("path"), py::arg("named_by"));
  m.def(
      "check_token",
      [](const std::string& token, const std::string& what) { Check(CheckToken(token, what)); },
      py::arg("token"), py::arg("what"));

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

  BindTable(m);
  BindShard(m);
  BindNet(m);
}
