// How a client reaches its tables: over TCP to shard servers (the data-plane
// Client) or in this process (an embedded Shard, the single-machine default).
// The op library's ClientResource holds one; no TF or Python headers.
// Both serve rows only: tables are managed by the shard servers' control
// plane, or for embedded tables through dlt::EmbeddedShard().
#ifndef TF_DLT_NATIVE_NET_TRANSPORT_H_
#define TF_DLT_NATIVE_NET_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "native/core/pull_mode.h"
#include "native/core/status.h"
#include "native/net/client.h"

namespace dlt {

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
                           const int64_t* ids, size_t n, float* out, bool insert) = 0;
  virtual Status Push(const std::string& table, uint32_t dim, const int64_t* ids,
                      const float* grads, size_t n, float learning_rate) = 0;
  // Sets rows (fresh optimizer slots).
  virtual Status Assign(const std::string& table, uint32_t dim, const int64_t* ids,
                        const float* values, size_t n) = 0;
  // Client::Regreet (embedded: nothing to greet).
  virtual Status Regreet() = 0;
  // Client::MetLineages (embedded: none), and the layout epoch they are of.
  virtual std::vector<uint64_t> MetLineages() const = 0;
  virtual uint64_t LayoutEpoch() const = 0;
};

// Shard servers at `addresses` (shard-index order).
std::unique_ptr<Transport> TcpTransport(std::vector<std::string> addresses,
                                        const ClientOptions& options);
// The embedded tables of this process (EmbeddedShard()). Tables are
// created, dropped, saved and loaded through that shard, from Python.
std::unique_ptr<Transport> EmbeddedTransport();

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_TRANSPORT_H_
