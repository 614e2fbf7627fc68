// Small POSIX socket helpers with deadlines, shared by server and client.
#ifndef TF_DLT_NATIVE_NET_SOCKET_H_
#define TF_DLT_NATIVE_NET_SOCKET_H_

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "native/core/status.h"

namespace dlt {
namespace net {

using Clock = std::chrono::steady_clock;

// Milliseconds left until `deadline` (>= 0).
int RemainingMs(Clock::time_point deadline);

// Splits "host:port" (or "[v6]:port"); INVALID_ARGUMENT when malformed.
Status ParseAddress(const std::string& address, std::string* host, int* port);

// A shard's addresses as listed ("primary|standby|..."), in order; with
// `separator` ',' a layout's shards ("a,b,c").
std::vector<std::string> SplitAddresses(const std::string& list, char separator = '|');

// Opens a non-blocking, TCP_NODELAY connection or fails within the deadline.
// `refused`, when given, says whether every attempt was refused (a host
// that answered: nothing listens there).
Status Connect(const std::string& address, Clock::time_point deadline, int* fd,
               bool* refused = nullptr);

// Binds and listens; *port receives the bound port (useful with port 0).
Status Listen(const std::string& bind_host, int port, int backlog, int* fd, int* bound_port);

// Sends the iovecs completely on a non-blocking socket before the deadline.
Status SendAll(int fd, struct iovec* iov, int iovcnt, Clock::time_point deadline);
// Receives exactly `bytes` on a non-blocking socket before the deadline.
// UNAVAILABLE when the peer closes first.
Status RecvAll(int fd, void* buffer, size_t bytes, Clock::time_point deadline);

void SetNonBlocking(int fd);
void CloseFd(int fd);

}  // namespace net
}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_SOCKET_H_
