// Status codes and the Status value shared by the table core, the wire
// protocol, the data-plane server and the client. Code numbers equal the
// gRPC / absl canonical codes so they map one to one onto tf.errors classes.
#ifndef TF_DLT_NATIVE_CORE_STATUS_H_
#define TF_DLT_NATIVE_CORE_STATUS_H_

#include <cstdint>
#include <string>
#include <utility>

namespace dlt {

enum class Code : uint32_t {
  kOk = 0,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,  // rows a shard held are gone (its every process restarted)
  kUnauthenticated = 16,
};

// Returns the canonical upper-case name of `code` ("INVALID_ARGUMENT").
const char* CodeName(Code code);

// True for the codes a peer may legitimately send in an error frame.
bool IsWireCode(uint32_t code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>".
  Status WithContext(const std::string& context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
inline Status InvalidArgument(std::string m) {
  return Status(Code::kInvalidArgument, std::move(m));
}
inline Status NotFound(std::string m) { return Status(Code::kNotFound, std::move(m)); }
inline Status AlreadyExists(std::string m) { return Status(Code::kAlreadyExists, std::move(m)); }
inline Status ResourceExhausted(std::string m) {
  return Status(Code::kResourceExhausted, std::move(m));
}
inline Status FailedPrecondition(std::string m) {
  return Status(Code::kFailedPrecondition, std::move(m));
}
// Refused before anything was applied, for a reason that passes (a
// re-shard's switch): send it again, after learning the layout.
inline Status Aborted(std::string m) { return Status(Code::kAborted, std::move(m)); }
inline Status Internal(std::string m) { return Status(Code::kInternal, std::move(m)); }
inline Status Unavailable(std::string m) { return Status(Code::kUnavailable, std::move(m)); }
inline Status DataLoss(std::string m) { return Status(Code::kDataLoss, std::move(m)); }
inline Status Unauthenticated(std::string m) {
  return Status(Code::kUnauthenticated, std::move(m));
}
inline Status DeadlineExceeded(std::string m) {
  return Status(Code::kDeadlineExceeded, std::move(m));
}

#define DLT_RETURN_IF_ERROR(expr)    \
  do {                               \
    ::dlt::Status _dlt_s = (expr);   \
    if (!_dlt_s.ok()) return _dlt_s; \
  } while (0)

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_STATUS_H_
