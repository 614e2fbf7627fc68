// Dlt>Assign (set rows with fresh slots, on either transport; async, the work
// runs on the client's worker threads) and Dlt>ExportTable (every row of an
// embedded table). Used to move tables between transports.
#include <string>
#include <vector>

#include "ops/cc/kernels/client_resource.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace dlt_ops {
namespace {

absl::Status ReadTableAttrs(OpKernelConstruction* ctx, std::string* table, uint32_t* dim) {
  int64_t d;
  TF_RETURN_IF_ERROR(ctx->GetAttr("table", table));
  TF_RETURN_IF_ERROR(ctx->GetAttr("dim", &d));
  if (d > dlt::kMaxDim) {
    return absl::InvalidArgumentError("dim must be at most " + std::to_string(dlt::kMaxDim));
  }
  *dim = static_cast<uint32_t>(d);
  return absl::OkStatus();
}

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

class ExportTableOp : public OpKernel {
 public:
  explicit ExportTableOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    std::vector<int64_t> ids;
    std::vector<float> values;
    OP_REQUIRES_OK(ctx, client->Export(table_, dim_, &ids, &values));
    const int64_t n = static_cast<int64_t>(ids.size());
    Tensor* ids_out = nullptr;
    Tensor* values_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &ids_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, dim_}), &values_out));
    std::copy(ids.begin(), ids.end(), ids_out->flat<int64_t>().data());
    std::copy(values.begin(), values.end(), values_out->flat<float>().data());
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>ExportTable").Device(DEVICE_CPU), ExportTableOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
