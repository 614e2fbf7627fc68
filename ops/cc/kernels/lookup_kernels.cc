// Dlt>Lookup: rows of ids of any shape. Remote (tcp): pulled on the client's
// worker threads, each distinct id once (dlt::Client routes them by bucket,
// every touched shard at once, and copies the rows to their places in input
// order as they arrive); ComputeAsync blocks only for small lookups (kInlineFloats), pulled on
// the calling thread. Embedded: the in-process table is read in place.
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "native/core/dedup.h"
#include "ops/cc/kernels/client_resource.h"
#include "ops/cc/kernels/table_attrs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/env.h"

namespace tensorflow {
namespace dlt_ops {
namespace {

// The attrs table, dim, training and missing of Dlt>Lookup and Dlt>PullAhead.
absl::Status ReadLookupAttrs(OpKernelConstruction* ctx, std::string* table, uint32_t* dim,
                             dlt::PullMode* mode) {
  bool training = true;
  std::string missing;
  TF_RETURN_IF_ERROR(ReadTableAttrs(ctx, table, dim));
  TF_RETURN_IF_ERROR(ctx->GetAttr("training", &training));
  TF_RETURN_IF_ERROR(ctx->GetAttr("missing", &missing));
  *mode = training
              ? dlt::PullMode::kInsert
              : (missing == "zeros" ? dlt::PullMode::kZerosNoInsert : dlt::PullMode::kInitNoInsert);
  return absl::OkStatus();
}

// A lookup through the table's hot-row cache: each distinct id once; the
// fresh cached rows are served at once (on the calling thread: no I/O), and
// the frequent ids' rows (or stale cached ones) pulled with their state and
// cached while the rest is pulled plainly, both at once on worker threads;
// the pull that finishes last assembles the rows.
class CachedLookup {
 public:
  using Finish = std::function<void(const absl::Status&)>;

  static void Start(ClientResource* c, std::shared_ptr<dlt::RowCache> cache,
                    const std::string& table, uint32_t dim, dlt::PullMode mode, const int64_t* id,
                    int64_t n, float* rows, Finish finish) {
    auto job = std::shared_ptr<CachedLookup>(
        new CachedLookup(c, std::move(cache), table, dim, mode, n, rows, std::move(finish)));
    job->Plan(id);
    const bool fill = !job->fill_ids_.empty(), plain = !job->plain_ids_.empty();
    job->pending_ = int{fill} + int{plain};
    if (!fill && !plain) return job->Complete();
    if (fill) {
      c->Schedule([job]() {
        job->fill_status_ =
            job->c_->PullState(job->table_, job->dim_, job->cache_->slot_floats(),
                               job->fill_ids_.data(), job->fill_ids_.size(), job->states_.data(),
                               job->mode_ == dlt::PullMode::kInsert, &job->inserted_);
        job->Done();
      });
    }
    if (plain) {
      c->Schedule([job]() {
        job->plain_status_ =
            job->c_->Pull(job->table_, job->dim_, job->plain_ids_.data(), job->plain_ids_.size(),
                          job->mode_, job->plain_rows_.data());
        job->Done();
      });
    }
  }

 private:
  CachedLookup(ClientResource* c, std::shared_ptr<dlt::RowCache> cache, const std::string& table,
               uint32_t dim, dlt::PullMode mode, int64_t n, float* rows, Finish finish)
      : c_(c),
        cache_(std::move(cache)),
        table_(table),
        dim_(dim),
        mode_(mode),
        n_(n),
        rows_(rows),
        finish_(std::move(finish)) {}

  void Plan(const int64_t* id) {
    // Only the Deduper is the thread's: unique_ and slot_ are this job's,
    // read later on the worker that finishes it.
    struct Scratch {
      dlt::Deduper dedup;
    };
    Scratch own;
    dlt::ThreadScratch(static_cast<size_t>(n_), own).dedup.Run(id, n_, &unique_, &slot_);
    distinct_.resize(unique_.size() * dim_);
    // A monotonic clock: the wall clock stepped back (NTP) kept rows fresh
    // past their age limit, and stepped forward made every row stale.
    now_ms_ = std::chrono::duration_cast<std::chrono::milliseconds>(
                  std::chrono::steady_clock::now().time_since_epoch())
                  .count();
    cache_->Lookup(unique_.data(), unique_.size(), now_ms_, distinct_.data(), &plan_);
    c_->CountCached(plan_);
    for (uint32_t p : plan_.fill) fill_ids_.push_back(unique_[p]);
    for (uint32_t p : plan_.plain) plain_ids_.push_back(unique_[p]);
    states_.resize(fill_ids_.size() * dlt::StateFloats(dim_, cache_->slot_floats()));
    plain_rows_.resize(plain_ids_.size() * dim_);
  }

  void Done() {
    if (pending_.fetch_sub(1) == 1) Complete();
  }

  // Writes `from` (rows of the positions `at`) into the distinct rows.
  void Scatter(const std::vector<uint32_t>& at, const float* from) {
    for (size_t k = 0; k < at.size(); ++k) {
      std::memcpy(&distinct_[size_t{at[k]} * dim_], from + k * dim_, sizeof(float) * dim_);
    }
  }

  void Complete() {
    absl::Status status = plain_status_;
    if (status.ok() && !fill_status_.ok()) {
      status = absl::Status(fill_status_.code(), "hot-row cache of table '" + table_ +
                                                     "': " + std::string(fill_status_.message()));
    }
    if (status.ok()) status = Assemble();
    if (status.ok()) dlt::GatherBySlot(distinct_.data(), slot_.data(), n_, dim_, rows_);
    finish_(status);
  }

  absl::Status Assemble() {
    Scatter(plan_.plain, plain_rows_.data());
    if (fill_ids_.empty()) return absl::OkStatus();
    std::vector<float> filled(fill_ids_.size() * dim_);
    std::vector<uint32_t> absent;
    cache_->Fill(fill_ids_.data(), fill_ids_.size(), states_.data(), now_ms_, filled.data(),
                 &absent);
    for (size_t k = 0, a = 0; k < fill_ids_.size(); ++k) {  // the rows Fill wrote
      if (a < absent.size() && absent[a] == k) {
        ++a;
        continue;
      }
      std::memcpy(&distinct_[size_t{plan_.fill[k]} * dim_], &filled[k * dim_],
                  sizeof(float) * dim_);
    }
    if (absent.empty()) return absl::OkStatus();
    if (inserted_) {
      // Rows the shards do not hold in RAM after pulling them as a training
      // pull does (kStateInsert): the state rows carry their values.
      const size_t width = dlt::StateFloats(dim_, cache_->slot_floats());
      for (uint32_t k : absent) {
        std::memcpy(&distinct_[size_t{plan_.fill[k]} * dim_], &states_[k * width],
                    sizeof(float) * dim_);
      }
      return absl::OkStatus();
    }
    // Inference (or shards older than kStateInsert): rows the shards do not
    // hold in RAM (new, or on the disk tier) are pulled plainly, in the
    // lookup's mode, on this worker.
    std::vector<int64_t> ids(absent.size());
    std::vector<uint32_t> at(absent.size());
    for (size_t k = 0; k < absent.size(); ++k) {
      ids[k] = fill_ids_[absent[k]];
      at[k] = plan_.fill[absent[k]];
    }
    std::vector<float> more(ids.size() * dim_);
    TF_RETURN_IF_ERROR(c_->Pull(table_, dim_, ids.data(), ids.size(), mode_, more.data()));
    Scatter(at, more.data());
    return absl::OkStatus();
  }

  ClientResource* const c_;
  const std::shared_ptr<dlt::RowCache> cache_;
  const std::string table_;
  const uint32_t dim_;
  const dlt::PullMode mode_;
  const int64_t n_;
  float* const rows_;
  const Finish finish_;
  int64_t now_ms_ = 0;
  std::vector<int64_t> unique_, slot_, fill_ids_, plain_ids_;
  std::vector<float> distinct_, states_, plain_rows_;
  dlt::RowCache::Plan plan_;
  std::atomic<int> pending_{0};
  absl::Status fill_status_, plain_status_;
  bool inserted_ = false;  // the fill was a kStateInsert pull
};

// The rows of a pull ahead that finished: the ids pushed since it began are
// pulled again first.
absl::Status RowsPulledAhead(ClientResource* c, dlt::PulledAhead* ahead, float* rows) {
  const std::vector<int64_t> stale = ahead->StaleIds();
  if (!stale.empty()) {
    std::vector<float> fresh(stale.size() * ahead->dim());
    absl::Status status = c->Pull(ahead->table(), ahead->dim(), stale.data(), stale.size(),
                                  ahead->mode(), fresh.data());
    if (!status.ok()) return status;
    ahead->Refresh(fresh.data());
  }
  ahead->CopyRows(rows);
  return absl::OkStatus();
}

// Remote lookups of at most this many values are pulled on the calling
// thread (a 16 KiB reply: 256 ids of dim 16).
constexpr int64_t kInlineFloats = 4096;

class LookupOp : public AsyncOpKernel {
 public:
  explicit LookupOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadLookupAttrs(ctx, &table_, &dim_, &mode_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const uint64_t start = Env::Default()->NowMicros();
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK_ASYNC(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client), done);
    const Tensor& ids = ctx->input(1);
    const int64_t n = ids.NumElements();
    // Checked before anything is allocated.
    OP_REQUIRES_ASYNC(ctx, n < (int64_t{1} << 31),
                      errors::InvalidArgument("at most 2^31-1 ids per Lookup, got ", n), done);
    OP_REQUIRES_ASYNC(ctx, n * dim_ < (int64_t{1} << 31),
                      errors::InvalidArgument("a Lookup returns at most 2^31-1 values (8 GiB); ", n,
                                              " ids of dim ", dim_, " would be ", n * dim_),
                      done);
    TensorShape shape = ids.shape();
    OP_REQUIRES_OK_ASYNC(ctx, shape.AddDimWithStatus(dim_), done);
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, shape, &out), done);
    if (n == 0) {
      done();
      return;
    }
    const int64_t* id = ids.flat<int64_t>().data();
    float* rows = out->flat<float>().data();
    if (client->embedded()) {
      // In-process table: no I/O to wait for, and the table core handles
      // repeated ids itself, so look up in place.
      OP_REQUIRES_OK_ASYNC(ctx, client->Pull(table_, dim_, id, n, mode_, rows, /*dedup=*/false),
                           done);
      done();
      return;
    }
    ClientResource* c = client.release();  // unreffed by Finish
    auto finish = [this, ctx, done, c, start](const absl::Status& status) {
      ctx->SetStatus(status);
      c->CountLookup(Env::Default()->NowMicros() - start);
      c->Unref();
      done();
    };
    std::shared_ptr<dlt::RowCache> cache;
    if (const absl::Status status = c->CacheFor(table_, dim_, &cache); !status.ok()) {
      finish(status);
      return;
    }
    if (cache != nullptr) {
      // `ids` (a ref to the input) lives as long as the finish callback.
      CachedLookup::Start(c, std::move(cache), table_, dim_, mode_, id, n, rows,
                          [ids, finish](const absl::Status& status) { finish(status); });
      return;
    }
    std::shared_ptr<dlt::PulledAhead> ahead = c->TakePulledAhead(table_, dim_, mode_, id, n);
    if (ahead == nullptr) {
      if (n * dim_ <= kInlineFloats) {
        // Small: its round trip costs less than the hop to a worker thread
        // and back, so it blocks this thread instead.
        finish(c->Pull(table_, dim_, id, n, mode_, rows, /*dedup=*/true));
        return;
      }
      c->Schedule([this, c, ids, id, n, rows, finish]() {
        finish(c->Pull(table_, dim_, id, n, mode_, rows, /*dedup=*/true));
      });
      return;
    }
    if (ahead->ready()) {
      ahead->CopyRows(rows);  // the common case: no I/O left
      finish(absl::OkStatus());
      return;
    }
    // Runs once the pull ahead and its refresh ahead finished, on the worker
    // that finished the last (or here, if they have): pull again what this
    // client pushed since and is not refreshed yet, or pull the batch anew
    // if the pull ahead failed.
    ahead->Then([this, c, ids, id, n, rows, ahead, finish]() {
      c->Schedule([this, c, ids, id, n, rows, ahead, finish]() {
        finish(ahead->ok() ? RowsPulledAhead(c, ahead.get(), rows)
                           : c->Pull(table_, dim_, id, n, mode_, rows, /*dedup=*/true));
      });
    });
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
  dlt::PullMode mode_ = dlt::PullMode::kInsert;
};

// Dlt>PullAhead: starts the pull for a later Dlt>Lookup and forwards the ids.
class PullAheadOp : public OpKernel {
 public:
  explicit PullAheadOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadLookupAttrs(ctx, &table_, &dim_, &mode_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("refresh", &refresh_));
    int64_t pulls_per_batch = 1;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("pulls_per_batch", &pulls_per_batch));
    pulls_per_batch_ = static_cast<uint32_t>(pulls_per_batch);
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    const Tensor& ids = ctx->input(1);
    ctx->set_output(0, ids);
    if (client->embedded() || ids.NumElements() == 0) return;
    OP_REQUIRES(
        ctx, ids.NumElements() < (int64_t{1} << 31),
        errors::InvalidArgument("at most 2^31-1 ids per PullAhead, got ", ids.NumElements()));
    client->PullAheadOf(table_, dim_, mode_, ids.flat<int64_t>().data(), ids.NumElements(),
                        refresh_, pulls_per_batch_);
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
  dlt::PullMode mode_ = dlt::PullMode::kInsert;
  bool refresh_ = true;
  uint32_t pulls_per_batch_ = 1;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>Lookup").Device(DEVICE_CPU), LookupOp);
REGISTER_KERNEL_BUILDER(Name("Dlt>PullAhead").Device(DEVICE_CPU), PullAheadOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
