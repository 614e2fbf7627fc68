#include "native/net/socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

namespace dlt {
namespace net {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

Status WaitFor(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    struct pollfd p = {fd, events, 0};
    const int rc = poll(&p, 1, RemainingMs(deadline));
    if (rc > 0) return OkStatus();
    if (rc == 0) return DeadlineExceeded(std::string("timed out ") + what);
    if (errno != EINTR) return Unavailable(std::string("poll: ") + ErrnoText(errno));
  }
}

}  // namespace

int RemainingMs(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return left > 0x7fffffff ? 0x7fffffff : static_cast<int>(left);
}

Status ParseAddress(const std::string& address, std::string* host, int* port) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return InvalidArgument("address '" + address + "' must be host:port");
  }
  std::string h = address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') {
    h = h.substr(1, h.size() - 2);
  }
  const std::string p = address.substr(colon + 1);
  char* end = nullptr;
  const long value = std::strtol(p.c_str(), &end, 10);
  if (h.empty() || *end != '\0' || value <= 0 || value > 65535) {
    return InvalidArgument("address '" + address +
                           "' must be host:port with "
                           "a port in 1..65535");
  }
  *host = h;
  *port = static_cast<int>(value);
  return OkStatus();
}

std::vector<std::string> SplitAddresses(const std::string& list, char separator) {
  std::vector<std::string> out;
  for (size_t from = 0;;) {
    const size_t bar = list.find(separator, from);
    out.push_back(list.substr(from, bar == std::string::npos ? bar : bar - from));
    if (bar == std::string::npos) return out;
    from = bar + 1;
  }
}

void SetNonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void CloseFd(int fd) {
  if (fd >= 0) close(fd);
}

Status Connect(const std::string& address, Clock::time_point deadline, int* out_fd, bool* refused) {
  if (refused != nullptr) *refused = false;
  bool all_refused = true;
  std::string host;
  int port = 0;
  DLT_RETURN_IF_ERROR(ParseAddress(address, &host, &port));
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* result = nullptr;
  const int gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &result);
  if (gai != 0) {
    return Unavailable("cannot resolve '" + host + "': " + gai_strerror(gai));
  }
  Status last = Unavailable("no address for '" + host + "'");
  bool tried = false;
  for (struct addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    tried = true;
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last = Unavailable("socket: " + ErrnoText(errno));
      all_refused = false;
      continue;
    }
    SetNonBlocking(fd);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      Status waited = WaitFor(fd, POLLOUT, deadline, "connecting");
      if (!waited.ok()) {
        close(fd);
        last = waited;
        all_refused = false;
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0) {
      all_refused = all_refused && errno == ECONNREFUSED;
      last = Unavailable("connect: " + ErrnoText(errno));
      close(fd);
      continue;
    }
    freeaddrinfo(result);
    *out_fd = fd;
    return OkStatus();
  }
  freeaddrinfo(result);
  if (refused != nullptr) *refused = all_refused && tried;
  return last;
}

Status Listen(const std::string& bind_host, int port, int backlog, int* out_fd, int* bound_port) {
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  struct addrinfo* result = nullptr;
  const int gai = getaddrinfo(bind_host.empty() ? nullptr : bind_host.c_str(),
                              std::to_string(port).c_str(), &hints, &result);
  if (gai != 0) {
    return InvalidArgument("cannot resolve bind address '" + bind_host + "': " + gai_strerror(gai));
  }
  Status last = Unavailable("no bind address");
  for (struct addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, backlog) != 0) {
      last = Unavailable("cannot listen on " + bind_host + ":" + std::to_string(port) + ": " +
                         ErrnoText(errno));
      close(fd);
      continue;
    }
    struct sockaddr_storage addr;
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<struct sockaddr*>(&addr), &len);
    *bound_port = addr.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    SetNonBlocking(fd);
    freeaddrinfo(result);
    *out_fd = fd;
    return OkStatus();
  }
  freeaddrinfo(result);
  return last;
}

Status SendAll(int fd, struct iovec* iov, int iovcnt, Clock::time_point deadline) {
  while (iovcnt > 0) {
    if (iov->iov_len == 0) {
      ++iov;
      --iovcnt;
      continue;
    }
    struct msghdr msg;
    std::memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        DLT_RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, "sending"));
        continue;
      }
      return Unavailable("send: " + ErrnoText(errno));
    }
    size_t sent = static_cast<size_t>(n);
    while (iovcnt > 0 && sent >= iov->iov_len) {
      sent -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + sent;
      iov->iov_len -= sent;
    }
  }
  return OkStatus();
}

Status RecvAll(int fd, void* buffer, size_t bytes, Clock::time_point deadline) {
  char* p = static_cast<char*>(buffer);
  while (bytes > 0) {
    const ssize_t n = recv(fd, p, bytes, 0);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return Unavailable("connection closed by peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      DLT_RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, "receiving"));
      continue;
    }
    return Unavailable("recv: " + ErrnoText(errno));
  }
  return OkStatus();
}

}  // namespace net
}  // namespace dlt
