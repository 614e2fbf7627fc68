// Dlt>Push: gradient rows to the shards through the client's bounded push
// queue. Asynchronous by default (done once admitted), or synchronous (done
// once applied). ComputeAsync never blocks; done() runs exactly once.
#include <string>

#include "ops/cc/kernels/client_resource.h"
#include "ops/cc/kernels/table_attrs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace dlt_ops {
namespace {

class PushOp : public AsyncOpKernel {
 public:
  explicit PushOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sync", &sync_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK_ASYNC(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client), done);
    const Tensor ids = ctx->input(1);
    const Tensor grads = ctx->input(2);
    const Tensor& lr = ctx->input(3);
    OP_REQUIRES_ASYNC(ctx, TensorShapeUtils::IsVector(ids.shape()),
                      errors::InvalidArgument("unique_ids must be a vector, got shape ",
                                              ids.shape().DebugString()),
                      done);
    OP_REQUIRES_ASYNC(
        ctx, grads.dims() == 2 && grads.dim_size(0) == ids.dim_size(0) && grads.dim_size(1) == dim_,
        errors::InvalidArgument("grads must have shape [", ids.dim_size(0), ", ", dim_, "], got ",
                                grads.shape().DebugString()),
        done);
    OP_REQUIRES_ASYNC(ctx, TensorShapeUtils::IsScalar(lr.shape()),
                      errors::InvalidArgument("learning_rate must be a scalar"), done);
    const float learning_rate = lr.scalar<float>()();
    const int64_t n = ids.NumElements();
    ClientResource* c = client.get();
    OP_REQUIRES_OK_ASYNC(
        ctx,
        c->PushToCache(table_, dim_, ids.flat<int64_t>().data(), grads.flat<float>().data(),
                       static_cast<size_t>(n), learning_rate),
        done);
    // An empty push sends nothing, but goes through the queue like any
    // other: an earlier push's error surfaces on it (docs/ops.md).
    auto work = [c, ids, grads, n, learning_rate, table = table_, dim = dim_]() {
      if (n == 0) return absl::OkStatus();
      return c->Push(table, dim, ids.flat<int64_t>().data(), grads.flat<float>().data(),
                     static_cast<size_t>(n), learning_rate);
    };
    const bool sync = sync_;
    auto admitted = [ctx, done, sync, c, ids, n, table = table_](absl::Status status) {
      if (!status.ok()) {
        // Never sent: the cached rows it changed are read again.
        if (auto cache = c->CacheOf(table)) {
          cache->Invalidate(ids.flat<int64_t>().data(), static_cast<size_t>(n));
        }
        ctx->SetStatus(status);
        done();
      } else if (!sync) {
        done();
      }
    };
    std::function<void(absl::Status)> finished;
    if (sync) {
      finished = [ctx, done](absl::Status status) {
        ctx->SetStatus(status);
        done();
      };
    }
    c->EnqueuePush(std::move(work), std::move(admitted), std::move(finished));
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
  bool sync_ = false;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>Push").Device(DEVICE_CPU), PushOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
