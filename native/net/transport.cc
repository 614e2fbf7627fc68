#include "native/net/transport.h"

#include <utility>

#include "native/core/shard.h"

namespace dlt {

size_t TableExport::Next(size_t max_rows, std::vector<int64_t>* ids, std::vector<float>* values,
                         std::vector<float>* slots, std::vector<uint32_t>* steps,
                         std::vector<uint32_t>* buckets, std::vector<uint32_t>* touched) {
  const size_t at = ids->size(), d = dim(), k = slot_floats();
  ids->resize(at + max_rows);
  values->resize((at + max_rows) * d);
  slots->resize((at + max_rows) * k);
  steps->resize(at + max_rows);
  buckets->resize(at + max_rows);
  touched->resize(at + max_rows);
  const RowBuffers out{ids->data() + at,   values->data() + at * d, slots->data() + at * k,
                       steps->data() + at, buckets->data() + at,    touched->data() + at};
  const size_t got = exporter_.Next(max_rows, out);
  ids->resize(at + got);
  values->resize((at + got) * d);
  slots->resize((at + got) * k);
  steps->resize(at + got);
  buckets->resize(at + got);
  touched->resize(at + got);
  return got;
}

namespace {

class Tcp : public Transport {
 public:
  Tcp(std::vector<std::string> addresses, const ClientOptions& options)
      : client_(std::move(addresses), options) {}
  bool embedded() const override { return false; }

  Status Pull(const std::string& table, uint32_t dim, const int64_t* ids, size_t n, PullMode mode,
              float* out, bool dedup, size_t* sent) override {
    return client_.Pull(table, dim, ids, n, mode, out, dedup, sent);
  }
  Status PullState(const std::string& table, uint32_t dim, uint32_t slot_floats, const int64_t* ids,
                   size_t n, float* out) override {
    return client_.PullState(table, dim, slot_floats, ids, n, out);
  }
  Status Push(const std::string& table, uint32_t dim, const int64_t* ids, const float* grads,
              size_t n, float learning_rate) override {
    return client_.Push(table, dim, ids, grads, n, learning_rate);
  }
  Status Assign(const std::string& table, uint32_t dim, const int64_t* ids, const float* values,
                size_t n) override {
    return client_.Assign(table, dim, ids, values, n);
  }
  Status CreateTable(const TableConfig&) override {
    return FailedPrecondition(
        "tables of shard servers are created through their control plane "
        "(tf_dlt.Client.create_table), not by Dlt>CreateTable");
  }
  Status DropTable(const std::string&) override {
    return FailedPrecondition(
        "tables of shard servers are dropped through their control plane "
        "(tf_dlt.Client.drop_table), not by Dlt>DropTable");
  }
  Status OpenExport(const std::string&, uint32_t, const std::string&, const std::string&,
                    std::unique_ptr<TableExport>*) override {
    return FailedPrecondition(
        "rows on shard servers are exported with tf_dlt.Client.save, not Dlt>ExportTable");
  }
  Status Import(const std::string&, uint32_t, const int64_t*, const float*, const float*, size_t,
                const uint32_t*, const uint32_t*, size_t) override {
    return FailedPrecondition(
        "rows on shard servers are imported with tf_dlt.Client.load, not Dlt>ImportTable");
  }
  Status GetState(const std::string&, uint32_t, TableStateData*) override {
    return FailedPrecondition("a table on shard servers is saved with tf_dlt.Client.save");
  }
  Status SetState(const std::string&, uint32_t, const TableStateData&) override {
    return FailedPrecondition("a table on shard servers is loaded with tf_dlt.Client.load");
  }
  Status MarkLoaded(const std::string&, uint32_t, const std::string&) override {
    return FailedPrecondition("a table on shard servers is loaded with tf_dlt.Client.load");
  }

 private:
  Client client_;
};

// How often embedded tables with a ttl are swept.
constexpr int kEmbeddedSweepMs = 10000;

class Embedded : public Transport {
 public:
  bool embedded() const override { return true; }

  Status Pull(const std::string& table, uint32_t dim, const int64_t* ids, size_t n, PullMode mode,
              float* out, bool /*dedup*/, size_t* sent) override {
    if (sent != nullptr) *sent = n;
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "Lookup", &t));
    if (mode == PullMode::kState) {
      return InvalidArgument("Pull mode kState returns wider rows: use PullState");
    }
    return t->Pull(ids, n, mode, out);
  }
  Status PullState(const std::string& table, uint32_t dim, uint32_t slot_floats, const int64_t* ids,
                   size_t n, float* out) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "Lookup", &t));
    if (t->slot_floats() != slot_floats) {
      return FailedPrecondition("table '" + table + "' keeps " + std::to_string(t->slot_floats()) +
                                " optimizer slot floats per row, the caller expects " +
                                std::to_string(slot_floats));
    }
    return t->Pull(ids, n, PullMode::kState, out);
  }
  Status Push(const std::string& table, uint32_t dim, const int64_t* ids, const float* grads,
              size_t n, float learning_rate) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "Push", &t));
    return t->Push(ids, grads, n, learning_rate).WithContext(Where(table, "Push"));
  }
  Status Assign(const std::string& table, uint32_t dim, const int64_t* ids, const float* values,
                size_t n) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "Assign", &t));
    return t->Assign(ids, values, n).WithContext(Where(table, "Assign"));
  }
  Status CreateTable(const TableConfig& config) override {
    bool created = false;
    DLT_RETURN_IF_ERROR(shard_.CreateTable(config, &created).WithContext("embedded CreateTable"));
    if (config.policy.ttl != 0) shard_.StartSweeper(kEmbeddedSweepMs);
    return OkStatus();
  }
  Status DropTable(const std::string& table) override {
    return shard_.DropTable(table).WithContext(Where(table, "Drop"));
  }
  Status OpenExport(const std::string& table, uint32_t dim, const std::string& save_id,
                    const std::string& base, std::unique_ptr<TableExport>* out) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "Export", &t));
    *out = std::make_unique<TableExport>(std::move(t), save_id, base);
    return OkStatus();
  }
  Status MarkLoaded(const std::string& table, uint32_t dim, const std::string& save_id) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "MarkLoaded", &t));
    t->MarkLoaded(save_id);
    return OkStatus();
  }
  Status Import(const std::string& table, uint32_t dim, const int64_t* ids, const float* values,
                const float* slots, size_t slot_floats, const uint32_t* steps,
                const uint32_t* touched, size_t n) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "Import", &t));
    if (slot_floats != 0 && slot_floats != t->slot_floats()) {
      return InvalidArgument(Where(table, "Import") + ": the table has " +
                             std::to_string(t->slot_floats()) + " slot floats per row, got " +
                             std::to_string(slot_floats));
    }
    return t->Import(ids, values, slot_floats ? slots : nullptr, steps, n, touched)
        .WithContext(Where(table, "Import"));
  }
  Status GetState(const std::string& table, uint32_t dim, TableStateData* state) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "State", &t));
    state->clock = t->Now();
    state->first_bucket = 0;
    state->slice_bytes = t->sketch_slice_bytes();
    if (!t->has_sketch()) return OkStatus();
    state->sketch.resize(size_t{kNumBuckets} * state->slice_bytes);
    state->added.resize(kNumBuckets);
    for (uint32_t b = 0; b < kNumBuckets; ++b) {
      t->ReadSketch(b, state->sketch.data() + size_t{b} * state->slice_bytes, &state->added[b]);
    }
    return OkStatus();
  }
  Status SetState(const std::string& table, uint32_t dim, const TableStateData& state) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "SetState", &t));
    const size_t buckets = state.added.size();
    if (buckets != 0) {
      if (!t->SketchHolds(state.first_bucket, state.first_bucket + buckets) ||
          state.slice_bytes != t->sketch_slice_bytes() ||
          state.sketch.size() != buckets * state.slice_bytes) {
        return InvalidArgument(Where(table, "SetState") + ": the sketch does not fit the table (" +
                               std::to_string(t->sketch_slice_bytes()) + " bytes per bucket)");
      }
      for (size_t b = 0; b < buckets; ++b) {
        t->WriteSketch(state.first_bucket + static_cast<uint32_t>(b),
                       state.sketch.data() + b * state.slice_bytes, state.added[b]);
      }
    }
    t->SetPushClock(state.clock);
    return OkStatus();
  }

 private:
  static std::string Where(const std::string& table, const char* op) {
    return "embedded table '" + table + "' " + op;
  }
  // The table, checked to have `dim`.
  Status Find(const std::string& table, uint32_t dim, const char* op, std::shared_ptr<Table>* out) {
    DLT_RETURN_IF_ERROR(shard_.GetTable(table, out).WithContext(Where(table, op)));
    if ((*out)->dim() != dim) {
      return InvalidArgument(Where(table, op) + ": the table has dim " +
                             std::to_string((*out)->dim()) + ", the op says " +
                             std::to_string(dim));
    }
    return OkStatus();
  }

  Shard shard_{0, 1};
};

}  // namespace

std::unique_ptr<Transport> TcpTransport(std::vector<std::string> addresses,
                                        const ClientOptions& options) {
  return std::make_unique<Tcp>(std::move(addresses), options);
}

std::unique_ptr<Transport> EmbeddedTransport() { return std::make_unique<Embedded>(); }

}  // namespace dlt
