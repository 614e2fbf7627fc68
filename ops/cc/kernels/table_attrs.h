// The `table` and `dim` attrs every table op carries, read and checked once.
#ifndef TF_DLT_OPS_CC_KERNELS_TABLE_ATTRS_H_
#define TF_DLT_OPS_CC_KERNELS_TABLE_ATTRS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "native/core/table_config.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace dlt_ops {

inline absl::Status ReadTableAttrs(OpKernelConstruction* ctx, std::string* table, uint32_t* dim) {
  int64_t d;
  TF_RETURN_IF_ERROR(ctx->GetAttr("table", table));
  TF_RETURN_IF_ERROR(ctx->GetAttr("dim", &d));
  if (d > dlt::kMaxDim) {
    return absl::InvalidArgumentError("dim must be at most " + std::to_string(dlt::kMaxDim) +
                                      ", got " + std::to_string(d));
  }
  *dim = static_cast<uint32_t>(d);
  return absl::OkStatus();
}

}  // namespace dlt_ops
}  // namespace tensorflow

#endif  // TF_DLT_OPS_CC_KERNELS_TABLE_ATTRS_H_
