// dlt::Status -> absl::Status: the codes are the same canonical numbers, so
// the kind (and the tf.errors class) is kept; context is prepended.
#ifndef TF_DLT_OPS_CC_KERNELS_STATUS_UTIL_H_
#define TF_DLT_OPS_CC_KERNELS_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "native/core/status.h"

namespace tensorflow {
namespace dlt_ops {

inline absl::Status ToAbsl(const dlt::Status& s, const std::string& context = "") {
  if (s.ok()) return absl::OkStatus();
  const std::string message = context.empty() ? s.message() : context + ": " + s.message();
  return absl::Status(static_cast<absl::StatusCode>(s.code()), message);
}

}  // namespace dlt_ops
}  // namespace tensorflow

#endif  // TF_DLT_OPS_CC_KERNELS_STATUS_UTIL_H_
