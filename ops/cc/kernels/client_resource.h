// ClientResource: the state behind a Dlt>Client handle. It reaches the tables
// through a dlt::Transport: TCP (shard servers elsewhere) or embedded (the
// same table core in this process, no sockets). It also owns the worker
// threads remote calls run on, the bounded queue of asynchronous pushes, the
// client-side counters. Embedded tables are managed through
// dlt::EmbeddedShard(), not through it.
#ifndef TF_DLT_OPS_CC_KERNELS_CLIENT_RESOURCE_H_
#define TF_DLT_OPS_CC_KERNELS_CLIENT_RESOURCE_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "native/core/table.h"
#include "native/core/work_queue.h"
#include "native/net/client.h"
#include "native/net/pull_ahead.h"
#include "native/net/push_queue.h"
#include "native/net/row_cache.h"
#include "native/net/server_stats.h"
#include "native/net/transport.h"
#include "tensorflow/core/framework/resource_base.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/platform/thread_annotations.h"

namespace tensorflow {
namespace dlt_ops {

struct ClientResourceOptions {
  // Empty: embedded transport.
  std::vector<std::string> addresses;
  dlt::ClientOptions tcp;
  int max_inflight_pushes = 4;
  int worker_threads = 4;
};

class ClientResource : public ResourceBase {
 public:
  explicit ClientResource(ClientResourceOptions options);
  ~ClientResource() override;

  std::string DebugString() const override;
  bool embedded() const { return transport_->embedded(); }

  // Runs `fn` on the resource's worker threads (the time it waits for one
  // is counted as worker_wait).
  void Schedule(std::function<void()> fn);

  // Blocking pull of `n` ids into `out` ([n, dim]); with `dedup` each
  // distinct id is sent once (dlt::Client::Pull), else the ids should be
  // distinct already. The stats count the ids sent.
  absl::Status Pull(const std::string& table, uint32_t dim, const int64_t* ids, size_t n,
                    dlt::PullMode mode, float* out, bool dedup = false);
  // Blocking pull of `n` distinct ids with their optimizer state into `out`
  // ([n, StateFloats(dim, slot_floats)]; Client::PullState, `insert` as
  // there). Shards that predate kStateInsert refuse it (INVALID_ARGUMENT):
  // then the pull is made again without `insert`, and once that succeeds
  // this client asks for kState only (logged once). *inserted (when given):
  // whether the rows came from a kStateInsert pull, so that ids without
  // state carry their values.
  absl::Status PullState(const std::string& table, uint32_t dim, uint32_t slot_floats,
                         const int64_t* ids, size_t n, float* out, bool insert,
                         bool* inserted = nullptr);
  // Keeps a hot-row cache of `config`'s table (dlt::RowCache; replacing
  // one it has), or with options.max_rows 0 none. No-op when embedded.
  absl::Status ConfigureCache(const dlt::TableConfig& config, const dlt::RowCacheOptions& options);
  // The cache of `table`, or null.
  std::shared_ptr<dlt::RowCache> CacheOf(const std::string& table) const;
  // The cache of `table` (null: none) for an op of width `dim`:
  // INVALID_ARGUMENT when the cache keeps rows of another width (the op's
  // buffers are sized by its dim, the cache's rows by the config's).
  absl::Status CacheFor(const std::string& table, uint32_t dim,
                        std::shared_ptr<dlt::RowCache>* cache) const;
  // Records the staleness of a cached lookup's oldest row (`plan`).
  void CountCached(const dlt::RowCache::Plan& plan) {
    if (plan.hits > 0) counters_.cache_staleness.Record(plan.oldest_ms * 1000);
  }
  // Applies this client's push of width `dim` to the cached rows of
  // `table` (at once, so the next lookup reads it even while the push is on
  // its way); an error (CacheFor's, or a push the shards would refuse:
  // RowCache::Pushed) applies nothing.
  absl::Status PushToCache(const std::string& table, uint32_t dim, const int64_t* ids,
                           const float* grads, size_t n, float learning_rate);

  // Blocking assignment of `n` rows (fresh slots).
  absl::Status Assign(const std::string& table, uint32_t dim, const int64_t* ids,
                      const float* values, size_t n);
  // Starts pulling the distinct ids of a batch (`n` ids, copied) on the
  // worker threads, for a later lookup of the same ids (TakePulledAhead);
  // `refresh` and `pulls_per_batch` as dlt::PullAhead::Begin.
  void PullAheadOf(const std::string& table, uint32_t dim, dlt::PullMode mode, const int64_t* ids,
                   size_t n, bool refresh, uint32_t pulls_per_batch = 1);
  // The pull ahead of exactly these ids, taken out; null if none waits. Every
  // push or assignment by this client that completed after it began marked
  // the ids it touched stale (PulledAhead::StaleIds).
  std::shared_ptr<dlt::PulledAhead> TakePulledAhead(const std::string& table, uint32_t dim,
                                                    dlt::PullMode mode, const int64_t* ids,
                                                    size_t n) {
    return pull_ahead_.Take(table, mode, dim, ids, n);
  }

  // Drops every pull ahead that waits for its lookup (Dlt>DropPulledAhead).
  void DropPulledAhead() { pull_ahead_.DropAll(); }
  // Greets every shard again, forgetting the copies met (Dlt>Regreet,
  // dlt::Client::Regreet).
  absl::Status Regreet();

  // Pulls again, on the worker threads, the ids pushes marked stale in
  // `marked` (PullAhead::Pushed), before their lookups take them.
  void RefreshAhead(std::vector<std::shared_ptr<dlt::PulledAhead>> marked);
  // The same for one pull, on this thread.
  void RefreshNow(dlt::PulledAhead* pulled);

  // Records a lookup (Dlt>Lookup, remote) that took `micros` from its start
  // to its rows.
  void CountLookup(uint64_t micros) { counters_.lookup_latency.Record(micros); }

  // Blocking push of `n` rows.
  absl::Status Push(const std::string& table, uint32_t dim, const int64_t* ids, const float* grads,
                    size_t n, float learning_rate);

  // Queues a push (`work` does it) on the client's dlt::PushQueue. At most
  // max_inflight_pushes run at once;
  // `admitted` runs when this one starts (or fails at once with the error of
  // an earlier asynchronous push, which it then clears). `finished`, when
  // given, gets the push's result (a synchronous push); without it the push
  // is asynchronous and its error is kept for the next Push or Flush.
  // Callbacks never run under the resource's lock.
  void EnqueuePush(std::function<absl::Status()> work, std::function<void(absl::Status)> admitted,
                   std::function<void(absl::Status)> finished);
  // Calls `done` once every push queued before it finished, with the first
  // error of those pushes not yet reported (then cleared).
  void Flush(std::function<void(absl::Status)> done);

  // This client's side, as a JSON object: pulls, pushes, rows and payload
  // bytes, failed calls, pushes in flight and waiting, latency histograms
  // (microsecond buckets of dlt::LatencyHistogram) with their sums.
  std::string StatsJson() const;

 private:
  struct Counters {
    std::atomic<uint64_t> pulls{0}, pulled_rows{0}, pull_bytes{0}, pull_errors{0};
    std::atomic<uint64_t> pushes{0}, pushed_rows{0}, push_bytes{0}, push_errors{0};
    dlt::LatencyHistogram pull_latency, push_latency, lookup_latency;
    // Waiting for a worker thread, and a push waiting to be admitted
    // (max_inflight_pushes in flight): time a training step may stall.
    dlt::LatencyHistogram worker_wait, push_wait;
    // Per cached lookup: how long ago its oldest cached row was pulled.
    dlt::LatencyHistogram cache_staleness;
  };
  // Counts one call of `rows` rows of `dim` floats that took `micros`.
  static void Count(const absl::Status& status, size_t rows, uint32_t dim, uint64_t micros,
                    std::atomic<uint64_t>& calls, std::atomic<uint64_t>& row_count,
                    std::atomic<uint64_t>& bytes, std::atomic<uint64_t>& failures,
                    dlt::LatencyHistogram& latency);

  const ClientResourceOptions options_;
  Counters counters_;
  std::unique_ptr<dlt::Transport> transport_;
  dlt::PushQueue pushes_;  // its work runs on work_, which is drained first
  dlt::PullAhead pull_ahead_;
  mutable mutex cache_mu_;
  std::map<std::string, std::shared_ptr<dlt::RowCache>> caches_ TF_GUARDED_BY(cache_mu_);
  std::atomic<bool> state_insert_refused_{false};  // by shards older than it
  dlt::WorkQueue work_;                            // last: destroyed (drained) first
};

}  // namespace dlt_ops
}  // namespace tensorflow

#endif  // TF_DLT_OPS_CC_KERNELS_CLIENT_RESOURCE_H_
