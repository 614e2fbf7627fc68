// Dlt>LookupGrad: the gradient of looked-up rows (ids.shape + [dim]) turned
// into one summed row per distinct id, in order of first appearance; no RPC.
#include <cstring>
#include <vector>

#include "native/core/dedup.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace dlt_ops {
namespace {

class LookupGradOp : public OpKernel {
 public:
  explicit LookupGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    const Tensor& grads = ctx->input(1);
    OP_REQUIRES(ctx, grads.dims() == ids.dims() + 1,
                errors::InvalidArgument("grads must have shape ids.shape + [dim]; ids have shape ",
                                        ids.shape().DebugString(), ", grads ",
                                        grads.shape().DebugString()));
    for (int d = 0; d < ids.dims(); ++d) {
      OP_REQUIRES(ctx, grads.dim_size(d) == ids.dim_size(d),
                  errors::InvalidArgument("grads must have shape ids.shape + [dim]; ids have "
                                          "shape ",
                                          ids.shape().DebugString(), ", grads ",
                                          grads.shape().DebugString()));
    }
    const int64_t n = ids.NumElements();
    OP_REQUIRES(ctx, n < (int64_t{1} << 31),
                errors::InvalidArgument("at most 2^31-1 ids per LookupGrad, got ", n));
    const int64_t dim = grads.dim_size(grads.dims() - 1);
    const int64_t* id = ids.flat<int64_t>().data();
    const float* g = grads.flat<float>().data();
    struct Scratch : dlt::DedupScratch {};
    Scratch own;
    Scratch& scratch = dlt::ThreadScratch(static_cast<size_t>(n), own);
    scratch.Run(id, static_cast<size_t>(n));
    const std::vector<int64_t>& unique = scratch.unique;
    const std::vector<int64_t>& slot = scratch.slot;
    const int64_t u = static_cast<int64_t>(unique.size());
    Tensor* unique_ids = nullptr;
    Tensor* summed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({u}), &unique_ids));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({u, dim}), &summed));
    std::memcpy(unique_ids->flat<int64_t>().data(), unique.data(), sizeof(int64_t) * u);
    float* out = summed->flat<float>().data();
    std::memset(out, 0, sizeof(float) * u * dim);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = out + slot[i] * dim;
      const float* src = g + i * dim;
      for (int64_t j = 0; j < dim; ++j) dst[j] += src[j];
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("Dlt>LookupGrad").Device(DEVICE_CPU), LookupGradOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
