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

// An int64 tensor's values as uint32, refusing (never truncating) others.
absl::Status ToUint32(const char* what, const Tensor& t, std::vector<uint32_t>* out) {
  const int64_t n = t.NumElements();
  const int64_t* v = t.flat<int64_t>().data();
  out->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    if (v[i] < 0 || v[i] > int64_t{UINT32_MAX}) {
      return errors::InvalidArgument(what, " ", v[i], " of row ", i, " is outside [0, 2^32-1]");
    }
    (*out)[i] = static_cast<uint32_t>(v[i]);
  }
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

// Dlt>ExportTable (every row at once) and Dlt>ExportChunk (the next rows of
// a pass): ids, values, slots and steps (and for chunks, buckets and
// last-touched stamps).
class ExportOp : public OpKernel {
 public:
  explicit ExportOp(OpKernelConstruction* ctx) : OpKernel(ctx), chunked_(ctx->num_inputs() == 2) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
    if (chunked_) {
      OP_REQUIRES_OK(ctx, ctx->GetAttr("max_rows", &max_rows_));
      OP_REQUIRES_OK(ctx, ctx->GetAttr("save_id", &save_id_));
      OP_REQUIRES_OK(ctx, ctx->GetAttr("base", &base_));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    const bool start = !chunked_ || ctx->input(1).scalar<bool>()();
    std::vector<int64_t> ids, removed;
    std::vector<float> values, slots;
    std::vector<uint32_t> steps, buckets, touched;
    uint32_t slot_floats = 0;
    int64_t base_clock = -1;
    OP_REQUIRES_OK(ctx, client->Export(table_, dim_, start, chunked_ ? max_rows_ : 0, save_id_,
                                       base_, &ids, &values, &slots, &steps, &buckets, &touched,
                                       &slot_floats, &removed, &base_clock));
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
      Tensor *buckets_out, *touched_out, *removed_out, *base_clock_out;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({n}), &buckets_out));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({n}), &touched_out));
      const int64_t m = static_cast<int64_t>(removed.size());
      OP_REQUIRES_OK(ctx, ctx->allocate_output(6, TensorShape({m}), &removed_out));
      const int64_t delta = base_clock >= 0 ? 1 : 0;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(7, TensorShape({delta}), &base_clock_out));
      std::copy(buckets.begin(), buckets.end(), buckets_out->flat<int32_t>().data());
      std::copy(touched.begin(), touched.end(), touched_out->flat<int64_t>().data());
      std::copy(removed.begin(), removed.end(), removed_out->flat<int64_t>().data());
      if (delta) base_clock_out->flat<int64_t>()(0) = base_clock;
    }
  }

 private:
  const bool chunked_;
  std::string save_id_, base_;
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
    const Tensor& touched = ctx->input(5);
    const int64_t n = ids.NumElements();
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(ids.shape()) && values.dims() == 2 &&
                    values.dim_size(0) == n && values.dim_size(1) == dim_ && slots.dims() == 2 &&
                    slots.dim_size(0) == n && steps.NumElements() == n &&
                    (touched.NumElements() == n || touched.NumElements() == 0),
                errors::InvalidArgument("ImportTable needs ids [n], values [n, ", dim_,
                                        "], slots [n, k], steps [n] and touched [n] or []"));
    std::vector<uint32_t> steps32, touched32;
    OP_REQUIRES_OK(ctx, ToUint32("step count", steps, &steps32));
    OP_REQUIRES_OK(ctx, ToUint32("touched stamp", touched, &touched32));
    OP_REQUIRES_OK(
        ctx, client->Import(table_, dim_, ids.flat<int64_t>().data(), values.flat<float>().data(),
                            slots.flat<float>().data(), slots.dim_size(1), steps32.data(),
                            touched32.empty() ? nullptr : touched32.data(), n));
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>ImportTable").Device(DEVICE_CPU), ImportTableOp);

// Dlt>TableState: an embedded table's clock and admission sketch.
class TableStateOp : public OpKernel {
 public:
  explicit TableStateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    dlt::TableStateData state;
    OP_REQUIRES_OK(ctx, client->GetState(table_, dim_, &state));
    const int64_t buckets = static_cast<int64_t>(state.added.size());
    Tensor *clock, *sketch, *added;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &clock));
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(1, TensorShape({buckets, state.slice_bytes}), &sketch));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({buckets}), &added));
    clock->scalar<int64_t>()() = state.clock;
    std::copy(state.sketch.begin(), state.sketch.end(), sketch->flat<uint8_t>().data());
    std::copy(state.added.begin(), state.added.end(), added->flat<int64_t>().data());
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>TableState").Device(DEVICE_CPU), TableStateOp);

// Dlt>SetTableState: sets an embedded table's push clock and the sketch
// slices given.
class SetTableStateOp : public OpKernel {
 public:
  explicit SetTableStateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    const Tensor& clock = ctx->input(1);
    const Tensor& first_bucket = ctx->input(2);
    const Tensor& sketch = ctx->input(3);
    const Tensor& added = ctx->input(4);
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsScalar(clock.shape()) &&
                    TensorShapeUtils::IsScalar(first_bucket.shape()) && sketch.dims() == 2 &&
                    TensorShapeUtils::IsVector(added.shape()) &&
                    sketch.dim_size(0) == added.dim_size(0),
                errors::InvalidArgument("SetTableState needs scalars clock and first_bucket, "
                                        "sketch [buckets, bytes] and added [buckets]"));
    const int64_t c = clock.scalar<int64_t>()(), first = first_bucket.scalar<int64_t>()();
    OP_REQUIRES(ctx, c >= 0 && c <= int64_t{UINT32_MAX} && first >= 0 && first < (1 << 16),
                errors::InvalidArgument("SetTableState: clock ", c, " or first bucket ", first,
                                        " out of range"));
    dlt::TableStateData state;
    state.clock = static_cast<uint32_t>(c);
    state.first_bucket = static_cast<uint32_t>(first);
    state.slice_bytes = static_cast<uint32_t>(sketch.dim_size(1));
    const uint8_t* bytes = sketch.flat<uint8_t>().data();
    state.sketch.assign(bytes, bytes + sketch.NumElements());
    OP_REQUIRES_OK(ctx, ToUint32("sketch count", added, &state.added));
    OP_REQUIRES_OK(ctx, client->SetState(table_, dim_, state));
  }

 private:
  std::string table_;
  uint32_t dim_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>SetTableState").Device(DEVICE_CPU), SetTableStateOp);

// Dlt>MarkTableLoaded: an embedded table holds checkpoint `save_id` exactly.
class MarkTableLoadedOp : public OpKernel {
 public:
  explicit MarkTableLoadedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadTableAttrs(ctx, &table_, &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("save_id", &save_id_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    OP_REQUIRES_OK(ctx, client->MarkLoaded(table_, dim_, save_id_));
  }

 private:
  std::string table_, save_id_;
  uint32_t dim_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>MarkTableLoaded").Device(DEVICE_CPU), MarkTableLoadedOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
