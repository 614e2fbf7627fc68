// Dlt>Lookup: rows of ids of any shape. Remote (tcp): the ids are
// deduplicated, the distinct ones pulled on the client's worker threads (routed
// by bucket, every touched shard at once) and the rows stitched back in input
// order; ComputeAsync never blocks. Embedded: the in-process table is read in
// place.
#include <cstring>
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

// Pulls `n` ids into `rows` ([n, dim], input order), each distinct id once.
// Runs on a worker thread: they persist, so the scratch keeps its storage
// between steps.
absl::Status PullDistinct(ClientResource* c, const std::string& table, uint32_t dim,
                          dlt::PullMode mode, const int64_t* id, int64_t n, float* rows) {
  thread_local dlt::Deduper dedup;
  thread_local std::vector<int64_t> unique, slot;
  thread_local std::vector<float> distinct;
  dedup.Run(id, n, &unique, &slot);
  if (static_cast<int64_t>(unique.size()) == n) return c->Pull(table, dim, id, n, mode, rows);
  distinct.resize(unique.size() * dim);
  absl::Status status = c->Pull(table, dim, unique.data(), unique.size(), mode, distinct.data());
  if (status.ok()) dlt::GatherBySlot(distinct.data(), slot.data(), n, dim, rows);
  return status;
}

// Pulls `n` ids into `rows` ([n, dim], input order) through the table's
// hot-row cache: each distinct id once; fresh cached rows are served, the
// frequent ids' rows (and stale cached ones) pulled with their state and
// cached, the rest pulled plainly. Runs on a worker thread.
absl::Status PullCached(ClientResource* c, dlt::RowCache* cache, const std::string& table,
                        uint32_t dim, dlt::PullMode mode, const int64_t* id, int64_t n,
                        float* rows) {
  thread_local dlt::Deduper dedup;
  thread_local std::vector<int64_t> unique, slot, some_ids;
  thread_local std::vector<float> distinct, states, some_rows;
  thread_local std::vector<uint32_t> absent;
  thread_local dlt::RowCache::Plan plan;
  dedup.Run(id, n, &unique, &slot);
  distinct.resize(unique.size() * dim);
  const int64_t now_ms = static_cast<int64_t>(Env::Default()->NowMicros() / 1000);
  cache->Lookup(unique.data(), unique.size(), now_ms, distinct.data(), &plan);
  c->CountCached(plan);
  // Scatters `some_rows` (rows of the positions `at`) into `distinct`.
  auto scatter = [dim](const std::vector<uint32_t>& at) {
    for (size_t k = 0; k < at.size(); ++k) {
      std::memcpy(&distinct[size_t{at[k]} * dim], &some_rows[k * dim], sizeof(float) * dim);
    }
  };
  if (!plan.fill.empty()) {
    some_ids.resize(plan.fill.size());
    for (size_t k = 0; k < plan.fill.size(); ++k) some_ids[k] = unique[plan.fill[k]];
    states.resize(plan.fill.size() * dlt::StateFloats(dim, cache->slot_floats()));
    absl::Status status = c->PullState(table, dim, cache->slot_floats(), some_ids.data(),
                                       some_ids.size(), states.data());
    if (!status.ok()) {
      return absl::Status(status.code(), "hot-row cache of table '" + table +
                                             "': " + std::string(status.message()));
    }
    some_rows.resize(plan.fill.size() * dim);
    cache->Fill(some_ids.data(), some_ids.size(), states.data(), now_ms, some_rows.data(), &absent);
    for (uint32_t a : absent) plan.plain.push_back(plan.fill[a]);
    if (!absent.empty()) {  // not written by Fill; overwritten by the plain pull below
      size_t kept = 0;
      for (size_t k = 0, a = 0; k < plan.fill.size(); ++k) {
        if (a < absent.size() && absent[a] == k) {
          ++a;
          continue;
        }
        plan.fill[kept] = plan.fill[k];
        std::memmove(&some_rows[kept * dim], &some_rows[k * dim], sizeof(float) * dim);
        ++kept;
      }
      plan.fill.resize(kept);
    }
    scatter(plan.fill);
  }
  if (!plan.plain.empty()) {
    some_ids.resize(plan.plain.size());
    for (size_t k = 0; k < plan.plain.size(); ++k) some_ids[k] = unique[plan.plain[k]];
    some_rows.resize(plan.plain.size() * dim);
    TF_RETURN_IF_ERROR(
        c->Pull(table, dim, some_ids.data(), some_ids.size(), mode, some_rows.data()));
    scatter(plan.plain);
  }
  dlt::GatherBySlot(distinct.data(), slot.data(), n, dim, rows);
  return absl::OkStatus();
}

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
      OP_REQUIRES_OK_ASYNC(ctx, client->Pull(table_, dim_, id, n, mode_, rows), done);
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
    if (std::shared_ptr<dlt::RowCache> cache = c->CacheOf(table_)) {
      c->Schedule([this, c, ids, id, n, rows, cache, finish]() {
        finish(PullCached(c, cache.get(), table_, dim_, mode_, id, n, rows));
      });
      return;
    }
    std::shared_ptr<dlt::PulledAhead> ahead = c->TakePulledAhead(table_, dim_, mode_, id, n);
    if (ahead == nullptr) {
      c->Schedule([this, c, ids, id, n, rows, finish]() {
        finish(PullDistinct(c, table_, dim_, mode_, id, n, rows));
      });
      return;
    }
    if (ahead->done() && ahead->ok() && ahead->StaleIds().empty()) {
      ahead->CopyRows(rows);  // the common case: no I/O left
      finish(absl::OkStatus());
      return;
    }
    // Runs once the pull ahead finished, on the worker that finished it (or
    // here, if it has): refresh what this client pushed since, or pull the
    // batch anew if the pull ahead failed.
    ahead->Then([this, c, ids, id, n, rows, ahead, finish]() {
      c->Schedule([this, c, ids, id, n, rows, ahead, finish]() {
        finish(ahead->ok() ? RowsPulledAhead(c, ahead.get(), rows)
                           : PullDistinct(c, table_, dim_, mode_, id, n, rows));
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
                        refresh_);
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
  dlt::PullMode mode_ = dlt::PullMode::kInsert;
  bool refresh_ = true;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>Lookup").Device(DEVICE_CPU), LookupOp);
REGISTER_KERNEL_BUILDER(Name("Dlt>PullAhead").Device(DEVICE_CPU), PullAheadOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
