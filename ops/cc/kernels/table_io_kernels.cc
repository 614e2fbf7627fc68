// Dlt>Assign (set rows with fresh slots, on either transport; async, the work
// runs on the client's worker threads), Dlt>ExportTable / Dlt>ExportChunk and
// Dlt>ImportTable (rows of an embedded table with their optimizer state). Used to move
// tables between transports and to checkpoint embedded tables.
#include <algorithm>
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

// Dlt>ExportTable (every row at once) and Dlt>ExportChunk (the next rows of
// a pass): ids, values, slots and steps (and for chunks, buckets).
class ExportOp : public OpKernel {
 public:
  explicit ExportOp(OpKernelConstruction* ctx) : OpKernel(ctx), chunked_(ctx->num_inputs() == 2) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
    if (chunked_) OP_REQUIRES_OK(ctx, ctx->GetAttr("max_rows", &max_rows_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    const bool start = !chunked_ || ctx->input(1).scalar<bool>()();
    std::vector<int64_t> ids;
    std::vector<float> values, slots;
    std::vector<uint32_t> steps, buckets;
    uint32_t slot_floats = 0;
    OP_REQUIRES_OK(ctx, client->Export(table_, dim_, start, chunked_ ? max_rows_ : 0, &ids, &values,
                                       &slots, &steps, &buckets, &slot_floats));
    const int64_t n = static_cast<int64_t>(ids.size());
    Tensor *ids_out, *values_out, *slots_out, *steps_out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &ids_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, dim_}), &values_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n, slot_floats}), &slots_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &steps_out));
    std::copy(ids.begin(), ids.end(), ids_out->flat<int64_t>().data());
    std::copy(values.begin(), values.end(), values_out->flat<float>().data());
    std::copy(slots.begin(), slots.end(), slots_out->flat<float>().data());
    std::copy(steps.begin(), steps.end(), steps_out->flat<int64_t>().data());
    if (chunked_) {
      Tensor* buckets_out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({n}), &buckets_out));
      std::copy(buckets.begin(), buckets.end(), buckets_out->flat<int32_t>().data());
    }
  }

 private:
  const bool chunked_;
  std::string table_;
  uint32_t dim_ = 0;
  int64_t max_rows_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>ExportTable").Device(DEVICE_CPU), ExportOp);
REGISTER_KERNEL_BUILDER(Name("Dlt>ExportChunk").Device(DEVICE_CPU), ExportOp);

class ImportTableOp : public OpKernel {
 public:
  explicit ImportTableOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    const Tensor& ids = ctx->input(1);
    const Tensor& values = ctx->input(2);
    const Tensor& slots = ctx->input(3);
    const Tensor& steps = ctx->input(4);
    const int64_t n = ids.NumElements();
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(ids.shape()) && values.dims() == 2 &&
                    values.dim_size(0) == n && values.dim_size(1) == dim_ && slots.dims() == 2 &&
                    slots.dim_size(0) == n && steps.NumElements() == n,
                errors::InvalidArgument("ImportTable needs ids [n], values [n, ", dim_,
                                        "], slots [n, k] and steps [n]"));
    std::vector<uint32_t> steps32(n);
    const int64_t* s = steps.flat<int64_t>().data();
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, s[i] >= 0 && s[i] <= int64_t{UINT32_MAX},
                  errors::InvalidArgument("ImportTable: step count ", s[i], " of row ", i,
                                          " is outside [0, 2^32-1]"));
      steps32[i] = static_cast<uint32_t>(s[i]);
    }
    OP_REQUIRES_OK(
        ctx, client->Import(table_, dim_, ids.flat<int64_t>().data(), values.flat<float>().data(),
                            slots.flat<float>().data(), slots.dim_size(1), steps32.data(), n));
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>ImportTable").Device(DEVICE_CPU), ImportTableOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
