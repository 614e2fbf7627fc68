// dlt::Status <-> absl::Status: the codes are the same canonical numbers, so
// the kind (and the tf.errors class) is kept; ToAbsl prepends context.
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

// absl::Status -> dlt::Status, the same code and message.
inline dlt::Status FromAbsl(const absl::Status& s) {
  if (s.ok()) return dlt::OkStatus();
  return dlt::Status(static_cast<dlt::Code>(s.code()), std::string(s.message()));
}

}  // namespace dlt_ops
}  // namespace tensorflow

#endif  // TF_DLT_OPS_CC_KERNELS_STATUS_UTIL_H_
