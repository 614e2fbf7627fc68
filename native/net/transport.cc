#include "native/net/transport.h"

#include <utility>

#include "native/core/shard.h"

namespace dlt {

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
                   size_t n, float* out, bool insert) override {
    return client_.PullState(table, dim, slot_floats, ids, n, out, insert);
  }
  Status Push(const std::string& table, uint32_t dim, const int64_t* ids, const float* grads,
              size_t n, float learning_rate) override {
    return client_.Push(table, dim, ids, grads, n, learning_rate);
  }
  Status Assign(const std::string& table, uint32_t dim, const int64_t* ids, const float* values,
                size_t n) override {
    return client_.Assign(table, dim, ids, values, n);
  }
  Status Regreet() override { return client_.Regreet(); }
  std::vector<uint64_t> MetLineages() const override { return client_.MetLineages(); }
  uint64_t LayoutEpoch() const override { return client_.layout_epoch(); }

 private:
  Client client_;
};

class Embedded : public Transport {
 public:
  bool embedded() const override { return true; }
  Status Regreet() override { return OkStatus(); }
  std::vector<uint64_t> MetLineages() const override { return {}; }
  uint64_t LayoutEpoch() const override { return 0; }

  Status Pull(const std::string& table, uint32_t dim, const int64_t* ids, size_t n, PullMode mode,
              float* out, bool /*dedup*/, size_t* sent) override {
    if (sent != nullptr) *sent = n;
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "Lookup", &t));
    if (IsStatePull(mode)) {
      return InvalidArgument("Pull modes kState and kStateInsert return wider rows: use PullState");
    }
    return t->Pull(ids, n, mode, out);
  }
  Status PullState(const std::string& table, uint32_t dim, uint32_t slot_floats, const int64_t* ids,
                   size_t n, float* out, bool insert) override {
    std::shared_ptr<Table> t;
    DLT_RETURN_IF_ERROR(Find(table, dim, "Lookup", &t));
    if (t->slot_floats() != slot_floats) {
      return FailedPrecondition("table '" + table + "' keeps " + std::to_string(t->slot_floats()) +
                                " optimizer slot floats per row, the caller expects " +
                                std::to_string(slot_floats));
    }
    return t->Pull(ids, n, insert ? PullMode::kStateInsert : PullMode::kState, out);
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

 private:
  static std::string Where(const std::string& table, const char* op) {
    return "embedded table '" + table + "' " + op;
  }
  // The table, checked to have `dim`.
  Status Find(const std::string& table, uint32_t dim, const char* op, std::shared_ptr<Table>* out) {
    DLT_RETURN_IF_ERROR(shard_->GetTable(table, out).WithContext(Where(table, op)));
    if ((*out)->dim() != dim) {
      return InvalidArgument(Where(table, op) + ": the table has dim " +
                             std::to_string((*out)->dim()) + ", the op says " +
                             std::to_string(dim));
    }
    return OkStatus();
  }

  const std::shared_ptr<Shard> shard_ = EmbeddedShard();
};

}  // namespace

std::unique_ptr<Transport> TcpTransport(std::vector<std::string> addresses,
                                        const ClientOptions& options) {
  return std::make_unique<Tcp>(std::move(addresses), options);
}

std::unique_ptr<Transport> EmbeddedTransport() { return std::make_unique<Embedded>(); }

}  // namespace dlt
