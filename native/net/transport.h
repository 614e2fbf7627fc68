// How a client reaches its tables: over TCP to shard servers (the data-plane
// Client) or in this process (an embedded Shard, the single-machine default).
// The op library's ClientResource holds one; no TF or Python headers.
#ifndef TF_DLT_NATIVE_NET_TRANSPORT_H_
#define TF_DLT_NATIVE_NET_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "native/core/status.h"
#include "native/core/table.h"
#include "native/core/table_config.h"
#include "native/net/client.h"

namespace dlt {

// Rows of one table copied out in (bucket, id) order, a chunk at a time.
// With a `save_id`, the export is that save of the table (Table::BeginSave):
// with a tracked `base`, only the rows changed since it, and Removed() the
// ids removed since.
class TableExport {
 public:
  explicit TableExport(std::shared_ptr<Table> table, const std::string& save_id = "",
                       const std::string& base = "")
      : table_(std::move(table)),
        start_(save_id.empty() ? SaveStart{} : table_->BeginSave(save_id, base)),
        exporter_(start_.tracked ? Table::Exporter(table_.get(), start_.since)
                                 : Table::Exporter(table_.get())) {}
  uint32_t dim() const { return table_->dim(); }
  // Whether only changed rows are exported, and the table's clock at the base.
  bool delta() const { return start_.tracked; }
  uint32_t base_clock() const { return start_.base_clock; }
  std::vector<int64_t> Removed() const {
    return start_.tracked ? table_->RemovedSince(start_.since) : std::vector<int64_t>{};
  }
  uint32_t slot_floats() const { return table_->slot_floats(); }
  const Status& error() const { return exporter_.error(); }
  // Appends up to `max_rows` rows to the vectors; returns how many (0: done,
  // or a disk tier error: see error()).
  size_t Next(size_t max_rows, std::vector<int64_t>* ids, std::vector<float>* values,
              std::vector<float>* slots, std::vector<uint32_t>* steps,
              std::vector<uint32_t>* buckets, std::vector<uint32_t>* touched);

 private:
  std::shared_ptr<Table> table_;
  SaveStart start_;
  Table::Exporter exporter_;
};

// What a table keeps besides its rows: its clock and, with Frequency
// admission, the sketch slices of buckets [first_bucket, first_bucket +
// added.size()), slice_bytes each.
struct TableStateData {
  uint32_t clock = 0;
  uint32_t first_bucket = 0;
  uint32_t slice_bytes = 0;
  std::vector<uint8_t> sketch;
  std::vector<uint32_t> added;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual bool embedded() const = 0;

  // Client::Pull (`dedup`, `sent` as there; embedded: every id is read in
  // place, so `sent` is n).
  virtual Status Pull(const std::string& table, uint32_t dim, const int64_t* ids, size_t n,
                      PullMode mode, float* out, bool dedup, size_t* sent) = 0;
  // Rows with their optimizer state (Client::PullState).
  virtual Status PullState(const std::string& table, uint32_t dim, uint32_t slot_floats,
                           const int64_t* ids, size_t n, float* out) = 0;
  virtual Status Push(const std::string& table, uint32_t dim, const int64_t* ids,
                      const float* grads, size_t n, float learning_rate) = 0;
  // Sets rows (fresh optimizer slots).
  virtual Status Assign(const std::string& table, uint32_t dim, const int64_t* ids,
                        const float* values, size_t n) = 0;

  // Embedded only (shard servers do these through their control plane).
  virtual Status CreateTable(const TableConfig& config) = 0;
  virtual Status DropTable(const std::string& table) = 0;
  // An export of `table`; with a `save_id`, that save on top of `base`
  // (TableExport).
  virtual Status OpenExport(const std::string& table, uint32_t dim, const std::string& save_id,
                            const std::string& base, std::unique_ptr<TableExport>* out) = 0;
  // Inserts or overwrites rows with their optimizer slots (`slot_floats`
  // per row; 0: fresh slots), update counts and last-touched stamps (null:
  // now).
  virtual Status Import(const std::string& table, uint32_t dim, const int64_t* ids,
                        const float* values, const float* slots, size_t slot_floats,
                        const uint32_t* steps, const uint32_t* touched, size_t n) = 0;
  // The table's clock and sketch (all buckets), and setting them back
  // (the sketch slices `state` holds; the push clock).
  virtual Status GetState(const std::string& table, uint32_t dim, TableStateData* state) = 0;
  virtual Status SetState(const std::string& table, uint32_t dim, const TableStateData& state) = 0;
  // The table holds checkpoint `save_id` exactly (Table::MarkLoaded).
  virtual Status MarkLoaded(const std::string& table, uint32_t dim, const std::string& save_id) = 0;
};

// Shard servers at `addresses` (shard-index order).
std::unique_ptr<Transport> TcpTransport(std::vector<std::string> addresses,
                                        const ClientOptions& options);
// Tables in this process.
std::unique_ptr<Transport> EmbeddedTransport();

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_TRANSPORT_H_
