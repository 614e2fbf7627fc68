#include "native/net/data_server.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>

#include "native/net/socket.h"

namespace dlt {
namespace {

// epoll tags of the two fds that are not connections.
constexpr uint64_t kListenTag = 1;
constexpr uint64_t kWakeTag = 2;
// Frames one connection may have served per turn before others get theirs.
constexpr int kFramesPerTurn = 16;
// Connections accepted per turn of the listening socket.
constexpr int kAcceptsPerTurn = 64;
// Buffers kept for reuse: at most this large each.
constexpr size_t kPoolBufferBytes = 16u << 20;
// How long a pooled buffer may go unused before it is freed.
constexpr auto kPoolIdle = std::chrono::seconds(2);
// File descriptors kept free for everything but connections (control
// plane, checkpoints, logs).
constexpr int kMaxAutoConnections = 65536;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

struct DataServer::Conn {
  enum class Stage : uint8_t {
    kHead,     // reading the next frame's header (and a Pull's sizes)
    kMemory,   // head checked; waiting for memory for the payload and reply
    kPayload,  // reading the payload
  };
  int fd = -1;
  bool authenticated = false;
  RequestHandler::Peer peer;  // RequestHandler::Handle's
  Stage stage = Stage::kHead;
  // The header, then for a Pull the first 8 payload bytes (dim, id count),
  // which size its reply: memory for a frame and its reply is reserved in
  // one step, so no connection holds memory while it waits for more.
  uint8_t head[wire::kHeaderBytes + 12];
  size_t head_got = 0;
  size_t head_want = wire::kHeaderBytes;
  wire::FrameHeader header;
  net::Buffer payload;
  size_t payload_got = 0;
  net::Buffer out;  // the reply being sent
  size_t out_bytes = 0;
  size_t out_sent = 0;
  bool close_after_reply = false;
  // The peer shut down its side (EPOLLRDHUP seen): not waited for again, as
  // it stays signalled (a reply then waits for room without a busy loop).
  bool peer_closed = false;
  uint64_t reserved = 0;        // bytes of counters_.buffered_bytes this connection holds
  uint64_t reply_reserved = 0;  // of which for the reply
  // Waiting for memory (guarded by mu_): queued with `want` bytes; a woken
  // connection reserves ahead of the queue once.
  bool in_waiting = false;
  bool resumed = false;
  uint64_t want = 0;
  bool in_unauthenticated = false;  // guarded by mu_
  bool timed_out = false;           // guarded by mu_
  std::list<Conn*>::iterator all_it, unauth_it, wait_it;
  // Read by the reaper: when and why the connection is closed unless it
  // makes progress.
  std::atomic<int64_t> deadline_ms{LLONG_MAX};
  std::atomic<Deadline> deadline_kind{Deadline::kNone};
};

DataServer::DataServer(std::shared_ptr<Shard> shard, DataServerOptions options)
    : shard_(std::move(shard)),
      options_(std::move(options)),
      handler_(shard_, options_.auth_token, options_.max_frame_bytes, &counters_),
      pool_(8, kPoolBufferBytes) {
  handler_.set_admin_port(options_.admin_port);
  handler_.set_payload_pool(&pool_);
  handler_.set_max_staged_bytes(options_.max_buffered_bytes);
  // Its buffers are counted within the memory keeper's reserve.
  shard_->SetBufferBytes([] { return net::Buffer::HeldBytes(); });
}

DataServer::~DataServer() {
  shard_->SetBufferBytes(nullptr);
  Stop();
}

Status DataServer::SwitchLayout(uint64_t layout_epoch, const std::string& addresses) {
  const std::shared_ptr<Shard> next = reshard_target().next();
  if (next == nullptr) {
    return FailedPrecondition(
        "this process prepares no shard of a next layout: nothing to switch to");
  }
  if (layout_epoch <= shard_->layout_epoch()) {
    return FailedPrecondition("layout epoch " + std::to_string(layout_epoch) +
                              " is not newer than this shard's, " +
                              std::to_string(shard_->layout_epoch()));
  }
  // The standby's logs of the tables start before they serve: no write is
  // applied to them unlogged.
  auto adopt = [&] {
    shard_->Adopt(next.get(), layout_epoch, addresses);
    return shard_->Tables();
  };
  const std::shared_ptr<WriteListener> listener = handler_.write_listener();
  if (listener != nullptr) {
    listener->Follow(next->Tables(), adopt);
  } else {
    adopt();
  }
  reshard_target().Clear();
  return OkStatus();
}

bool DataServer::RevertLayout(uint64_t layout_epoch, const std::string& addresses) {
  bool reverted = false;
  auto revert = [&] {
    reverted = shard_->RevertLayout(layout_epoch, addresses);
    return shard_->Tables();
  };
  const std::shared_ptr<WriteListener> listener = handler_.write_listener();
  if (listener != nullptr && shard_->has_previous_layout()) {
    listener->Follow({}, revert);
  } else {
    revert();
  }
  return reverted;
}

Status DataServer::Start() {
  // Once: a second start would start threads over those it holds (or, after
  // Stop, leave them unjoined at its end), and either aborts the process.
  if (stopping_.load()) {
    return FailedPrecondition(
        "this data server was stopped: a stopped server does not start again");
  }
  if (listen_fd_ >= 0 || reaper_.joinable()) {
    return FailedPrecondition("this data server has started already");
  }
  const DataServerOptions& o = options_;
  if (o.max_frame_bytes < wire::kMinMaxFrameBytes) {
    return InvalidArgument("max frame bytes must be at least " +
                           std::to_string(wire::kMinMaxFrameBytes) + ", got " +
                           std::to_string(o.max_frame_bytes));
  }
  if (o.max_connections < 0 || o.max_unauthenticated < 1 || o.worker_threads < 0 ||
      o.other_fds < 0) {
    return InvalidArgument(
        "max connections must be >= 0 (0: automatic), max unauthenticated >= 1, worker threads "
        ">= 0 (0: one per core), other file descriptors >= 0");
  }
  if (o.hello_timeout_ms <= 0 || o.io_timeout_ms <= 0 || o.idle_timeout_ms < 0) {
    return InvalidArgument("hello and io timeouts must be > 0 and the idle timeout >= 0");
  }
  if (o.max_buffered_bytes == 0) return InvalidArgument("max buffered bytes must be > 0");
  if (o.port < 0 || o.port > 65535 || o.admin_port > 65535) {
    // A larger port was bound modulo 65536 (70000 listened on 4464).
    return InvalidArgument("port and admin port must be 0-65535 (0: any free one), got port " +
                           std::to_string(o.port) + ", admin port " + std::to_string(o.admin_port));
  }

  // Connections are file descriptors: raise the soft limit as far as needed
  // (up to the hard limit) and size the authenticated cap from it.
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return Internal("getrlimit(RLIMIT_NOFILE) failed");
  const rlim_t unauth = static_cast<rlim_t>(o.max_unauthenticated);
  const rlim_t others = static_cast<rlim_t>(o.other_fds);
  const rlim_t wanted = (o.max_connections > 0 ? static_cast<rlim_t>(o.max_connections)
                                               : static_cast<rlim_t>(kMaxAutoConnections)) +
                        unauth + others;
  if (limit.rlim_cur < wanted && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = std::min(wanted, limit.rlim_max);
    setrlimit(RLIMIT_NOFILE, &limit);
    getrlimit(RLIMIT_NOFILE, &limit);
  }
  const rlim_t room = limit.rlim_cur > unauth + others ? limit.rlim_cur - unauth - others : 0;
  if (o.max_connections > 0) {
    if (static_cast<rlim_t>(o.max_connections) > room) {
      return InvalidArgument(std::to_string(o.max_connections) + " connections plus " +
                             std::to_string(o.max_unauthenticated) +
                             " unauthenticated ones and the process's others (admin connections, "
                             "files) need " +
                             std::to_string(wanted) + " file descriptors; this process may open " +
                             std::to_string(limit.rlim_cur) +
                             " (ulimit -n): raise it or lower the connection caps");
    }
    max_connections_ = o.max_connections;
  } else {
    if (room < 1) {
      return InvalidArgument("the open-file limit " + std::to_string(limit.rlim_cur) +
                             " (ulimit -n) leaves no room for connections after " +
                             std::to_string(o.max_unauthenticated) +
                             " unauthenticated ones and the process's " +
                             std::to_string(o.other_fds) +
                             " others (admin connections, files): raise it or lower "
                             "--max-unauthenticated or --max-admin-connections");
    }
    max_connections_ = static_cast<int>(std::min<rlim_t>(room, kMaxAutoConnections));
  }

  DLT_RETURN_IF_ERROR(net::Listen(o.bind, o.port, 4096, &listen_fd_, &port_));
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epoll_fd_ < 0 || wake_fd_ < 0) return Internal("cannot create epoll or eventfd");
  struct epoll_event ev = {};
  ev.events = EPOLLIN;  // level-triggered, not one-shot: wakes every worker
  ev.data.u64 = kWakeTag;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.u64 = kListenTag;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);

  int threads = o.worker_threads;
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  reaper_ = std::thread([this] { ReaperLoop(); });
  return OkStatus();
}

void DataServer::Stop() {
  if (stopping_.exchange(true)) return;
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
  }
  reaper_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
  // Only this thread is left: give waiting replies a second, then close.
  const auto deadline = net::Clock::now() + std::chrono::seconds(1);
  std::vector<Conn*> all(conns_.begin(), conns_.end());
  for (Conn* c : all) {
    if (c->out_sent < c->out_bytes) {
      struct iovec iov = {c->out.data() + c->out_sent, c->out_bytes - c->out_sent};
      (void)net::SendAll(c->fd, &iov, 1, deadline);
    }
    Close(c);
  }
  net::CloseFd(listen_fd_);
  net::CloseFd(epoll_fd_);
  net::CloseFd(wake_fd_);
  listen_fd_ = epoll_fd_ = wake_fd_ = -1;
}

void DataServer::WorkerLoop() {
  while (!stopping_.load()) {
    struct epoll_event ev;
    const int n = epoll_wait(epoll_fd_, &ev, 1, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    if (n == 0) continue;
    if (ev.data.u64 == kWakeTag) break;
    if (ev.data.u64 == kListenTag) {
      AcceptAll();
      continue;
    }
    Serve(static_cast<Conn*>(ev.data.ptr), ev.events);
  }
}

void DataServer::ReaperLoop() {
  const auto& o = options_;
  int tick = std::min(o.hello_timeout_ms, o.io_timeout_ms);
  if (o.idle_timeout_ms > 0) tick = std::min(tick, o.idle_timeout_ms);
  tick = std::clamp(tick / 4, 10, 250);
  std::unique_lock<std::mutex> wait_lock(reaper_mu_);
  while (!stopping_.load()) {
    reaper_cv_.wait_for(wait_lock, std::chrono::milliseconds(tick));
    if (stopping_.load()) break;
    const int64_t now = NowMs();
    std::vector<Conn*> owned;  // waiting connections: nobody else owns them
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Conn* c : conns_) {
        if (c->timed_out || c->deadline_ms.load(std::memory_order_relaxed) > now) continue;
        c->timed_out = true;
        switch (c->deadline_kind.load(std::memory_order_relaxed)) {
          case Deadline::kHello:
            counters_.hello_timeouts.fetch_add(1);
            break;
          case Deadline::kIdle:
            counters_.idle_timeouts.fetch_add(1);
            break;
          default:
            counters_.io_timeouts.fetch_add(1);
        }
        if (c->in_waiting) {
          waiting_.erase(c->wait_it);
          c->in_waiting = false;
          counters_.connections_waiting.fetch_sub(1);
          owned.push_back(c);
        } else {
          // Its owner (or the worker epoll hands the hang-up to) closes it.
          shutdown(c->fd, SHUT_RDWR);
        }
      }
    }
    for (Conn* c : owned) Close(c);
    pool_.ReleaseIdle(kPoolIdle);
    if (accept_paused_.exchange(false)) {
      struct epoll_event ev = {};
      ev.events = EPOLLIN | EPOLLONESHOT;
      ev.data.u64 = kListenTag;
      epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
    }
    WakeWaiting();
  }
}

void DataServer::AcceptAll() {
  for (int i = 0; i < kAcceptsPerTurn; ++i) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      // Out of file descriptors or memory: pause accepting; the reaper
      // resumes it on its next tick.
      counters_.accept_errors.fetch_add(1);
      accept_paused_.store(true);
      return;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    counters_.connections_accepted.fetch_add(1);
    counters_.connections_open.fetch_add(1);
    Conn* conn = new Conn;
    conn->fd = fd;
    SetDeadline(conn, Deadline::kHello, options_.hello_timeout_ms);
    Conn* evicted = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      conn->all_it = conns_.insert(conns_.end(), conn);
      conn->unauth_it = unauthenticated_.insert(unauthenticated_.end(), conn);
      conn->in_unauthenticated = true;
      if (unauthenticated_.size() > static_cast<size_t>(options_.max_unauthenticated)) {
        // The oldest connection that has not said Hello makes room: a real
        // client says Hello right after connecting, so only idlers go.
        Conn* oldest = unauthenticated_.front();
        unauthenticated_.pop_front();
        oldest->in_unauthenticated = false;
        oldest->timed_out = true;
        counters_.connections_evicted.fetch_add(1);
        if (oldest->in_waiting) {
          waiting_.erase(oldest->wait_it);
          oldest->in_waiting = false;
          counters_.connections_waiting.fetch_sub(1);
          evicted = oldest;
        } else {
          shutdown(oldest->fd, SHUT_RDWR);
        }
      }
    }
    if (evicted != nullptr) Close(evicted);
    struct epoll_event ev = {};
    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
    ev.data.ptr = conn;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
  struct epoll_event ev = {};
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.u64 = kListenTag;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
}

uint32_t DataServer::FrameLimit(const Conn& conn) const {
  // Before its Hello a frame is bounded by what a Hello may hold
  // (CheckHeader, with the documented codes); a Hello, first or again, may
  // carry the longest token whatever the maximum frame.
  if (!conn.authenticated) return UINT32_MAX;
  const auto opcode = static_cast<wire::Opcode>(conn.head[5]);
  return opcode == wire::Opcode::kHello
             ? std::max<uint32_t>(options_.max_frame_bytes, wire::kMaxHelloRequestBytes)
             : options_.max_frame_bytes;
}

void DataServer::SetDeadline(Conn* conn, Deadline kind, int timeout_ms) {
  conn->deadline_kind.store(timeout_ms > 0 ? kind : Deadline::kNone, std::memory_order_relaxed);
  conn->deadline_ms.store(timeout_ms > 0 ? NowMs() + timeout_ms : LLONG_MAX,
                          std::memory_order_relaxed);
}

void DataServer::Arm(Conn* conn, uint32_t events) {
  struct epoll_event ev = {};
  ev.events = events | (conn->peer_closed ? 0u : uint32_t{EPOLLRDHUP}) | EPOLLONESHOT;
  ev.data.ptr = conn;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn->fd, &ev);
}

void DataServer::Serve(Conn* conn, uint32_t events) {
  if (events & (EPOLLERR | EPOLLHUP)) {  // reset, or shut down by the reaper
    Close(conn);
    return;
  }
  if (events & EPOLLRDHUP) conn->peer_closed = true;
  if (conn->out_sent < conn->out_bytes) {  // a reply waits for the socket
    if (!Flush(conn)) {
      Close(conn);
      return;
    }
    if (conn->out_sent < conn->out_bytes) {
      Arm(conn, EPOLLOUT);
      return;
    }
    if (conn->close_after_reply) {
      Close(conn);
      return;
    }
  }
  if (!ReadFrames(conn)) Close(conn);
}

bool DataServer::Flush(Conn* conn) {
  while (conn->out_sent < conn->out_bytes) {
    const ssize_t n = send(conn->fd, conn->out.data() + conn->out_sent,
                           conn->out_bytes - conn->out_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      conn->out_sent += static_cast<size_t>(n);
      counters_.bytes_out.fetch_add(static_cast<uint64_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    return false;
  }
  // Sent: the reply's memory goes back.
  pool_.Put(std::move(conn->out));
  conn->out_bytes = conn->out_sent = 0;
  Unreserve(conn, conn->reply_reserved);
  conn->reply_reserved = 0;
  if (conn->authenticated) SetDeadline(conn, Deadline::kIdle, options_.idle_timeout_ms);
  return true;
}

bool DataServer::ReadFrames(Conn* conn) {
  using Stage = Conn::Stage;
  int served = 0;
  for (;;) {
    switch (conn->stage) {
      case Stage::kHead: {
        const ssize_t n =
            recv(conn->fd, conn->head + conn->head_got, conn->head_want - conn->head_got, 0);
        if (n == 0) return false;  // closed by the peer (mid-frame: truncated)
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) {
            Arm(conn, EPOLLIN);
            return true;
          }
          return false;
        }
        if (conn->head_got == 0 && conn->authenticated) {
          SetDeadline(conn, Deadline::kIo, options_.io_timeout_ms);
        }
        conn->head_got += static_cast<size_t>(n);
        counters_.bytes_in.fetch_add(static_cast<uint64_t>(n));
        if (conn->head_got < conn->head_want) continue;
        if (conn->head_want == wire::kHeaderBytes) {
          Status s = wire::DecodeHeader(conn->head, FrameLimit(*conn), &conn->header);
          if (s.ok()) s = handler_.CheckHeader(conn->header, conn->authenticated);
          if (!s.ok()) {
            // The stream cannot be resynchronised: answer and close.
            conn->out = pool_.Get(4096);
            conn->out_bytes = handler_.ErrorReply(conn->header.request_id, s, &conn->out);
            conn->out_sent = 0;
            conn->close_after_reply = true;
            if (!Flush(conn)) return false;
            if (conn->out_sent < conn->out_bytes) {
              SetDeadline(conn, Deadline::kIo, options_.io_timeout_ms);
              Arm(conn, EPOLLOUT);
              return true;
            }
            return false;
          }
          if (conn->header.opcode == wire::Opcode::kPull && conn->header.payload_bytes >= 12) {
            conn->head_want += 12;  // the Pull's dim, id count and mode size its reply
            continue;
          }
        }
        conn->stage = Stage::kMemory;
        break;
      }
      case Stage::kMemory: {
        const size_t prefix = conn->head_got - wire::kHeaderBytes;
        const uint64_t reply = handler_.ReplyBound(
            conn->header, prefix > 0 ? conn->head + wire::kHeaderBytes : nullptr);
        if (!Reserve(conn, conn->header.payload_bytes + reply)) return true;  // queued
        conn->reply_reserved = reply;
        conn->payload = pool_.Get(conn->header.payload_bytes);
        if (prefix > 0) std::memcpy(conn->payload.data(), conn->head + wire::kHeaderBytes, prefix);
        conn->payload_got = prefix;
        conn->stage = Stage::kPayload;
        break;
      }
      case Stage::kPayload: {
        const size_t want = conn->header.payload_bytes - conn->payload_got;
        if (want > 0) {
          const ssize_t n = recv(conn->fd, conn->payload.data() + conn->payload_got, want, 0);
          if (n == 0) return false;
          if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
              Arm(conn, EPOLLIN);
              return true;
            }
            return false;
          }
          conn->payload_got += static_cast<size_t>(n);
          counters_.bytes_in.fetch_add(static_cast<uint64_t>(n));
          if (conn->payload_got < conn->header.payload_bytes) continue;
        }
        // The frame arrived: its I/O time stops while it is served (a push
        // waits for its standby or the memory keeper within bounds of its
        // own); closed meanwhile, the push was applied and its peer told
        // the connection was lost. The reply's I/O time starts if it waits.
        if (conn->authenticated) SetDeadline(conn, Deadline::kNone, 0);
        if (!ServeFrame(conn)) return false;
        if (conn->out_sent < conn->out_bytes) {  // the socket is full: wait for it
          SetDeadline(conn, Deadline::kIo, options_.io_timeout_ms);
          Arm(conn, EPOLLOUT);
          return true;
        }
        if (conn->close_after_reply) return false;
        if (++served == kFramesPerTurn) {  // let other connections have a turn
          Arm(conn, EPOLLIN);
          return true;
        }
        break;
      }
    }
  }
}

bool DataServer::ServeFrame(Conn* conn) {
  const bool was_authenticated = conn->authenticated;
  bool authenticated = was_authenticated;
  bool keep_open = true;
  conn->out = pool_.Get(conn->reply_reserved);
  size_t reply_bytes = handler_.Handle(conn->header, &conn->payload, &authenticated, &conn->peer,
                                       &conn->out, &keep_open);
  pool_.Put(std::move(conn->payload));
  Unreserve(conn, conn->header.payload_bytes);
  conn->stage = Conn::Stage::kHead;
  conn->head_got = 0;
  conn->head_want = wire::kHeaderBytes;
  if (authenticated && !was_authenticated) {
    bool admitted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      admitted = authenticated_ < max_connections_;
      if (admitted) {
        ++authenticated_;
        counters_.connections_authenticated.fetch_add(1);
        conn->authenticated = true;
        if (conn->in_unauthenticated) {
          unauthenticated_.erase(conn->unauth_it);
          conn->in_unauthenticated = false;
        }
      }
    }
    if (!admitted) {
      counters_.connections_refused.fetch_add(1);
      reply_bytes =
          handler_.ErrorReply(conn->header.request_id,
                              ResourceExhausted("server is at its limit of " +
                                                std::to_string(max_connections_) + " connections"),
                              &conn->out);
      keep_open = false;
    }
  }
  // Charge what the reply really holds (an error may exceed the estimate).
  if (reply_bytes > conn->reply_reserved) {
    const uint64_t extra = reply_bytes - conn->reply_reserved;
    counters_.buffered_bytes.fetch_add(extra);
    conn->reserved += extra;
    conn->reply_reserved = reply_bytes;
  } else {
    Unreserve(conn, conn->reply_reserved - reply_bytes);
    conn->reply_reserved = reply_bytes;
  }
  conn->out_bytes = reply_bytes;
  conn->out_sent = 0;
  conn->close_after_reply = !keep_open;
  return Flush(conn);
}

bool DataServer::Reserve(Conn* conn, uint64_t bytes) {
  const bool resumed = conn->resumed;
  conn->resumed = false;
  if (resumed || counters_.connections_waiting.load() == 0) {
    uint64_t used = counters_.buffered_bytes.load();
    while (used == 0 || used + bytes <= options_.max_buffered_bytes) {
      if (counters_.buffered_bytes.compare_exchange_weak(used, used + bytes)) {
        conn->reserved += bytes;
        // Room may be left for the next in line.
        if (resumed && counters_.connections_waiting.load() > 0) WakeWaiting();
        return true;
      }
    }
  }
  // Wait in line, out of epoll, until Unreserve makes room.
  std::lock_guard<std::mutex> lock(mu_);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->fd, nullptr);
  conn->want = bytes;
  conn->wait_it =
      resumed ? waiting_.insert(waiting_.begin(), conn) : waiting_.insert(waiting_.end(), conn);
  conn->in_waiting = true;
  // An authenticated connection's I/O deadline stops while it waits: each
  // one ahead of it holds memory for a bounded time (its own deadline, a
  // handler's), and one queued behind a few of them was closed unanswered.
  // A Hello keeps its deadline.
  if (conn->authenticated) conn->deadline_ms.store(LLONG_MAX, std::memory_order_relaxed);
  counters_.connections_waiting.fetch_add(1);
  counters_.memory_waits.fetch_add(1);
  WakeHeadLocked();  // memory may have been freed since the check above
  return false;
}

void DataServer::Unreserve(Conn* conn, uint64_t bytes) {
  if (bytes == 0) return;
  conn->reserved -= bytes;
  counters_.buffered_bytes.fetch_sub(bytes);
  if (counters_.connections_waiting.load() > 0) WakeWaiting();
}

void DataServer::WakeWaiting() {
  std::lock_guard<std::mutex> lock(mu_);
  WakeHeadLocked();
}

void DataServer::WakeHeadLocked() {
  // One at a time: the head takes its memory (ahead of the rest) before the
  // next is woken.
  if (waiting_.empty()) return;
  Conn* head = waiting_.front();
  const uint64_t used = counters_.buffered_bytes.load();
  if (used != 0 && used + head->want > options_.max_buffered_bytes) return;
  waiting_.pop_front();
  head->in_waiting = false;
  counters_.connections_waiting.fetch_sub(1);
  head->resumed = true;
  if (head->authenticated) SetDeadline(head, Deadline::kIo, options_.io_timeout_ms);  // afresh
  // Writable at once: a frame read whole with its head gets no EPOLLIN.
  struct epoll_event ev = {};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLONESHOT;
  ev.data.ptr = head;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, head->fd, &ev);
}

void DataServer::Close(Conn* conn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns_.erase(conn->all_it);
    if (conn->in_unauthenticated) unauthenticated_.erase(conn->unauth_it);
    if (conn->in_waiting) {
      waiting_.erase(conn->wait_it);
      counters_.connections_waiting.fetch_sub(1);
    }
    if (conn->authenticated) {
      --authenticated_;
      counters_.connections_authenticated.fetch_sub(1);
    }
  }
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->fd, nullptr);
  net::CloseFd(conn->fd);
  counters_.connections_open.fetch_sub(1);
  const uint64_t held = conn->reserved;
  pool_.Put(std::move(conn->payload));
  pool_.Put(std::move(conn->out));
  delete conn;
  if (held > 0) {
    counters_.buffered_bytes.fetch_sub(held);
    if (counters_.connections_waiting.load() > 0) WakeWaiting();
  }
}

}  // namespace dlt
