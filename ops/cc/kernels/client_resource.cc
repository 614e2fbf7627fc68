#include "ops/cc/kernels/client_resource.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "ops/cc/kernels/status_util.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/logging.h"

namespace tensorflow {
namespace dlt_ops {

ClientResource::ClientResource(ClientResourceOptions options)
    : options_(std::move(options)),
      transport_(options_.addresses.empty() ? dlt::EmbeddedTransport()
                                            : dlt::TcpTransport(options_.addresses, options_.tcp)),
      // A push holds the resource until it is done, even if every handle
      // goes away.
      pushes_(
          options_.max_inflight_pushes,
          [this](std::function<void()> fn) {
            Ref();
            Schedule([this, fn = std::move(fn)]() {
              fn();
              Unref();
            });
          },
          &counters_.push_wait),
      work_(options_.worker_threads) {}

ClientResource::~ClientResource() = default;

std::string ClientResource::DebugString() const {
  if (embedded()) return "DltClient(embedded)";
  std::string out = "DltClient(tcp:";
  for (size_t i = 0; i < options_.addresses.size(); ++i) {
    out += (i ? "," : "") + options_.addresses[i];
  }
  return out + ")";
}

void ClientResource::Count(const absl::Status& status, size_t rows, uint32_t dim, uint64_t micros,
                           std::atomic<uint64_t>& calls, std::atomic<uint64_t>& row_count,
                           std::atomic<uint64_t>& bytes, std::atomic<uint64_t>& failures,
                           dlt::LatencyHistogram& latency) {
  calls.fetch_add(1, std::memory_order_relaxed);
  if (!status.ok()) {
    failures.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  row_count.fetch_add(rows, std::memory_order_relaxed);
  bytes.fetch_add(rows * (sizeof(int64_t) + sizeof(float) * dim), std::memory_order_relaxed);
  latency.Record(micros);
}

absl::Status ClientResource::Pull(const std::string& table, uint32_t dim, const int64_t* ids,
                                  size_t n, dlt::PullMode mode, float* out, bool dedup) {
  const uint64_t start = Env::Default()->NowMicros();
  size_t sent = n;
  const absl::Status status = ToAbsl(transport_->Pull(table, dim, ids, n, mode, out, dedup, &sent));
  Count(status, sent, dim, Env::Default()->NowMicros() - start, counters_.pulls,
        counters_.pulled_rows, counters_.pull_bytes, counters_.pull_errors, counters_.pull_latency);
  return status;
}

absl::Status ClientResource::PullState(const std::string& table, uint32_t dim, uint32_t slot_floats,
                                       const int64_t* ids, size_t n, float* out, bool insert,
                                       bool* inserted) {
  const uint64_t start = Env::Default()->NowMicros();
  insert = insert && !state_insert_refused_.load(std::memory_order_relaxed);
  absl::Status status = ToAbsl(transport_->PullState(table, dim, slot_floats, ids, n, out, insert));
  if (insert && absl::IsInvalidArgument(status)) {
    // Perhaps shards older than kStateInsert: what they can serve instead.
    const absl::Status plain =
        ToAbsl(transport_->PullState(table, dim, slot_floats, ids, n, out, false));
    if (plain.ok()) {
      if (!state_insert_refused_.exchange(true)) {
        LOG(WARNING) << "tf_dlt: the shards of table '" << table << "' refuse the trainer's "
                     << "state pull (" << status.message() << "): they predate it. The "
                     << "hot-row cache fills with the older state pull and pulls ids without "
                     << "a row again; upgrade the shards.";
      }
      insert = false;
    }
    status = plain;
  }
  if (inserted != nullptr) *inserted = insert;
  Count(status, n, dlt::StateFloats(dim, slot_floats), Env::Default()->NowMicros() - start,
        counters_.pulls, counters_.pulled_rows, counters_.pull_bytes, counters_.pull_errors,
        counters_.pull_latency);
  return status;
}

absl::Status ClientResource::ConfigureCache(const dlt::TableConfig& config,
                                            const dlt::RowCacheOptions& options) {
  if (embedded()) return absl::OkStatus();  // rows are in this process already
  mutex_lock lock(cache_mu_);
  if (options.max_rows == 0) {
    caches_.erase(config.name);
    return absl::OkStatus();
  }
  const std::string error = dlt::RowCacheOptionsError(options);
  if (!error.empty()) return absl::InvalidArgumentError("table '" + config.name + "': " + error);
  caches_[config.name] = std::make_shared<dlt::RowCache>(config.dim, config.optimizer, options);
  return absl::OkStatus();
}

std::shared_ptr<dlt::RowCache> ClientResource::CacheOf(const std::string& table) const {
  mutex_lock lock(cache_mu_);
  if (caches_.empty()) return nullptr;
  auto it = caches_.find(table);
  return it == caches_.end() ? nullptr : it->second;
}

absl::Status ClientResource::CacheFor(const std::string& table, uint32_t dim,
                                      std::shared_ptr<dlt::RowCache>* cache) const {
  *cache = CacheOf(table);
  if (*cache == nullptr || (*cache)->dim() == dim) return absl::OkStatus();
  const uint32_t cached = (*cache)->dim();
  *cache = nullptr;
  return absl::InvalidArgumentError(
      "table '" + table + "': this op's dim is " + std::to_string(dim) +
      ", its hot-row cache's (the table config it was configured with) " + std::to_string(cached));
}

absl::Status ClientResource::PushToCache(const std::string& table, uint32_t dim, const int64_t* ids,
                                         const float* grads, size_t n, float learning_rate) {
  std::shared_ptr<dlt::RowCache> cache;
  TF_RETURN_IF_ERROR(CacheFor(table, dim, &cache));
  if (cache != nullptr) return ToAbsl(cache->Pushed(ids, grads, n, learning_rate));
  return absl::OkStatus();
}

absl::Status ClientResource::Push(const std::string& table, uint32_t dim, const int64_t* ids,
                                  const float* grads, size_t n, float learning_rate) {
  const uint64_t start = Env::Default()->NowMicros();
  const absl::Status status = ToAbsl(transport_->Push(table, dim, ids, grads, n, learning_rate));
  // Even a failed push may have been applied in part.
  RefreshAhead(pull_ahead_.Pushed(table, ids, n));
  if (!status.ok()) {
    // The cache applied it already: read those rows from the shards again.
    if (std::shared_ptr<dlt::RowCache> cache = CacheOf(table)) cache->Invalidate(ids, n);
  }
  Count(status, n, dim, Env::Default()->NowMicros() - start, counters_.pushes,
        counters_.pushed_rows, counters_.push_bytes, counters_.push_errors, counters_.push_latency);
  return status;
}

void ClientResource::Schedule(std::function<void()> fn) {
  work_.Schedule([this, fn = std::move(fn), queued = Env::Default()->NowMicros()]() {
    counters_.worker_wait.Record(Env::Default()->NowMicros() - queued);
    fn();
  });
}

void ClientResource::PullAheadOf(const std::string& table, uint32_t dim, dlt::PullMode mode,
                                 const int64_t* ids, size_t n, bool refresh,
                                 uint32_t pulls_per_batch) {
  // A cached table's lookup serves its hot rows from the cache and pulls
  // the rest itself (docs/keras.md).
  if (CacheOf(table) != nullptr) return;
  std::shared_ptr<dlt::PulledAhead> pulled =
      pull_ahead_.Begin(table, mode, dim, ids, n, refresh, pulls_per_batch);
  Ref();
  Schedule([this, pulled]() {
    const absl::Status status = Pull(pulled->table(), pulled->dim(), pulled->unique().data(),
                                     pulled->unique().size(), pulled->mode(), pulled->rows());
    pulled->Finish(status.ok());
    RefreshNow(pulled.get());  // what pushes marked while it was pulled
    Unref();
  });
}

void ClientResource::RefreshAhead(std::vector<std::shared_ptr<dlt::PulledAhead>> marked) {
  for (std::shared_ptr<dlt::PulledAhead>& pulled : marked) {
    Ref();
    Schedule([this, pulled = std::move(pulled)]() {
      RefreshNow(pulled.get());
      Unref();
    });
  }
}

void ClientResource::RefreshNow(dlt::PulledAhead* pulled) {
  std::vector<int64_t> ids = pulled->BeginRefresh();
  std::vector<float> rows;
  while (!ids.empty()) {
    rows.resize(ids.size() * pulled->dim());
    const absl::Status status =
        Pull(pulled->table(), pulled->dim(), ids.data(), ids.size(), pulled->mode(), rows.data());
    if (status.ok()) pull_ahead_.CountRefreshed(ids.size());
    ids = pulled->RefreshDone(status.ok() ? rows.data() : nullptr);
  }
}

namespace {

void AppendHistogram(const char* name, const dlt::LatencyHistogram& h, std::string* out) {
  *out += "\"";
  *out += name;
  *out += "\":{\"sum_us\":" + std::to_string(h.SumMicros()) + ",\"buckets\":[";
  const std::vector<uint64_t> counts = h.Snapshot();
  for (size_t i = 0; i < counts.size(); ++i) {
    if (i) *out += ",";
    *out += std::to_string(counts[i]);
  }
  *out += "]}";
}

}  // namespace

std::string ClientResource::StatsJson() const {
  const int inflight = pushes_.inflight(), waiting = pushes_.waiting();
  const Counters& c = counters_;
  const dlt::PullAhead::Counts ahead = pull_ahead_.counts();
  dlt::RowCache::Counts cached;
  uint64_t cache_bytes = 0, cache_bytes_saved = 0, cache_capacity = 0;
  {
    mutex_lock lock(cache_mu_);
    for (const auto& [name, cache] : caches_) {
      const dlt::RowCache::Counts k = cache->counts();
      cached.hits += k.hits;
      cached.misses += k.misses;
      cached.fills += k.fills;
      cached.refreshes += k.refreshes;
      cached.evictions += k.evictions;
      cached.applied += k.applied;
      cached.rows += k.rows;
      cached.max_steps = std::max(cached.max_steps, k.max_steps);
      cache_bytes += k.rows * cache->row_bytes() + cache->fixed_bytes();
      cache_capacity += cache->options().max_rows * cache->row_bytes() + cache->fixed_bytes();
      // What a pull of those rows would have cost (Count's arithmetic).
      cache_bytes_saved += k.hits * (sizeof(int64_t) + sizeof(float) * cache->dim());
    }
  }
  std::string out = "{";
  const std::pair<const char*, uint64_t> scalars[] = {
      {"pulls", c.pulls.load()},
      {"pulled_rows", c.pulled_rows.load()},
      {"pull_bytes", c.pull_bytes.load()},
      {"pull_errors", c.pull_errors.load()},
      {"pushes", c.pushes.load()},
      {"pushed_rows", c.pushed_rows.load()},
      {"push_bytes", c.push_bytes.load()},
      {"push_errors", c.push_errors.load()},
      {"pushes_in_flight", static_cast<uint64_t>(inflight)},
      {"pushes_waiting", static_cast<uint64_t>(waiting)},
      {"pulls_ahead", ahead.begun},
      {"pulls_ahead_used", ahead.taken},
      {"pulls_ahead_dropped", ahead.dropped},
      {"pulled_ahead_stale_rows", ahead.stale_rows},
      {"pulled_ahead_refreshed_rows", ahead.refreshed_rows},
      {"cache_hits", cached.hits},
      {"cache_misses", cached.misses},
      {"cache_fills", cached.fills},
      {"cache_refreshes", cached.refreshes},
      {"cache_evictions", cached.evictions},
      {"cache_applied_rows", cached.applied},
      {"cache_rows", cached.rows},
      {"cache_bytes", cache_bytes},
      {"cache_capacity_bytes", cache_capacity},
      {"cache_bytes_saved", cache_bytes_saved},
      {"cache_max_staleness_steps", cached.max_steps},
  };
  for (const auto& [name, value] : scalars) {
    out += "\"" + std::string(name) + "\":" + std::to_string(value) + ",";
  }
  AppendHistogram("pull_latency", c.pull_latency, &out);
  out += ",";
  AppendHistogram("push_latency", c.push_latency, &out);
  out += ",";
  AppendHistogram("lookup_latency", c.lookup_latency, &out);
  out += ",";
  AppendHistogram("worker_wait", c.worker_wait, &out);
  out += ",";
  AppendHistogram("push_wait", c.push_wait, &out);
  out += ",";
  AppendHistogram("cache_staleness", c.cache_staleness, &out);
  // As strings: JSON numbers past 2^53 lose digits in some readers. The
  // layout epoch first: the lineages are of that layout's shards.
  const uint64_t layout_epoch = transport_->LayoutEpoch();
  const std::vector<uint64_t> lineages = transport_->MetLineages();
  out += ",\"layout_epoch\":" + std::to_string(layout_epoch);
  out += ",\"lineages\":[";
  for (size_t i = 0; i < lineages.size(); ++i) {
    out += (i ? ",\"" : "\"") + std::to_string(lineages[i]) + "\"";
  }
  out += "]}";
  return out;
}

absl::Status ClientResource::Regreet() { return ToAbsl(transport_->Regreet(), "Regreet"); }

absl::Status ClientResource::Assign(const std::string& table, uint32_t dim, const int64_t* ids,
                                    const float* values, size_t n) {
  const absl::Status status = ToAbsl(transport_->Assign(table, dim, ids, values, n));
  RefreshAhead(pull_ahead_.Pushed(table, ids, n));
  if (std::shared_ptr<dlt::RowCache> cache = CacheOf(table)) cache->Invalidate(ids, n);
  return status;
}

void ClientResource::EnqueuePush(std::function<absl::Status()> work,
                                 std::function<void(absl::Status)> admitted,
                                 std::function<void(absl::Status)> finished) {
  dlt::PushQueue::Done on_finished;
  if (finished) {
    on_finished = [finished = std::move(finished)](const dlt::Status& s) { finished(ToAbsl(s)); };
  }
  pushes_.Enqueue([work = std::move(work)]() { return FromAbsl(work()); },
                  [admitted = std::move(admitted)](const dlt::Status& s) { admitted(ToAbsl(s)); },
                  std::move(on_finished));
}

void ClientResource::Flush(std::function<void(absl::Status)> done) {
  pushes_.Flush([done = std::move(done)](const dlt::Status& s) { done(ToAbsl(s)); });
}

}  // namespace dlt_ops
}  // namespace tensorflow
