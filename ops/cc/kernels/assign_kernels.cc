// Dlt>Assign: sets rows with fresh slots, on either transport; async, the work
// runs on the client's worker threads.
#include <string>
#include <vector>

#include "ops/cc/kernels/client_resource.h"
#include "ops/cc/kernels/table_attrs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace dlt_ops {
namespace {

class AssignOp : public AsyncOpKernel {
 public:
  explicit AssignOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK_ASYNC(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client), done);
    const Tensor ids = ctx->input(1);
    const Tensor values = ctx->input(2);
    OP_REQUIRES_ASYNC(
        ctx,
        TensorShapeUtils::IsVector(ids.shape()) && values.dims() == 2 &&
            values.dim_size(0) == ids.dim_size(0) && values.dim_size(1) == dim_,
        errors::InvalidArgument("Assign needs ids [n] and values [n, ", dim_, "], got ",
                                ids.shape().DebugString(), " and ", values.shape().DebugString()),
        done);
    ClientResource* c = client.release();  // unreffed by the closure
    c->Schedule([this, ctx, done, c, ids, values]() {
      ctx->SetStatus(c->Assign(table_, dim_, ids.flat<int64_t>().data(),
                               values.flat<float>().data(), ids.NumElements()));
      c->Unref();
      done();
    });
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>Assign").Device(DEVICE_CPU), AssignOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
