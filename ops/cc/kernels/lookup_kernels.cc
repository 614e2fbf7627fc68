// Dlt>Lookup: rows of ids of any shape. Remote (tcp): the ids are
// deduplicated, the distinct ones pulled on the client's worker threads (routed
// by bucket, every touched shard at once) and the rows stitched back in input
// order; ComputeAsync never blocks. Embedded: the in-process table is read in
// place.
#include <cstring>
#include <string>
#include <vector>

#include "ops/cc/kernels/client_resource.h"
#include "ops/cc/kernels/dedup.h"
#include "ops/cc/kernels/table_attrs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace dlt_ops {
namespace {

class LookupOp : public AsyncOpKernel {
 public:
  explicit LookupOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    bool training;
    std::string missing;
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("training", &training));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("missing", &missing));
    mode_ = training ? dlt::PullMode::kInsert
                     : (missing == "zeros" ? dlt::PullMode::kZerosNoInsert
                                           : dlt::PullMode::kInitNoInsert);
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
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
    if (client->embedded()) {
      // In-process table: no I/O to wait for, and the table core handles
      // repeated ids itself, so look up in place.
      OP_REQUIRES_OK_ASYNC(ctx,
                           client->Pull(table_, dim_, ids.flat<int64_t>().data(), n, mode_,
                                        out->flat<float>().data()),
                           done);
      done();
      return;
    }
    ClientResource* c = client.release();  // unreffed by the closure
    c->Schedule([this, ctx, done, c, ids, out, n]() {
      const int64_t* id = ids.flat<int64_t>().data();
      float* rows = out->flat<float>().data();
      // Remote: pull each distinct id once. Worker threads persist, so these
      // keep their storage between steps.
      thread_local Deduper dedup;
      thread_local std::vector<int64_t> unique, slot;
      thread_local std::vector<float> distinct;
      dedup.Run(id, n, &unique, &slot);
      absl::Status status;
      if (static_cast<int64_t>(unique.size()) == n) {
        status = c->Pull(table_, dim_, id, n, mode_, rows);
      } else {
        distinct.resize(unique.size() * dim_);
        status = c->Pull(table_, dim_, unique.data(), unique.size(), mode_, distinct.data());
        if (status.ok()) {
          for (int64_t i = 0; i < n; ++i) {
            std::memcpy(rows + i * dim_, distinct.data() + size_t{slot[i]} * dim_,
                        sizeof(float) * dim_);
          }
        }
      }
      ctx->SetStatus(status);
      c->Unref();
      done();
    });
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
  dlt::PullMode mode_ = dlt::PullMode::kInsert;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>Lookup").Device(DEVICE_CPU), LookupOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
