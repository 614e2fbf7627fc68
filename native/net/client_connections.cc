// The data-plane client's connections: one pool per shard, connecting with
// backoff within the deadline, the Hello that authenticates and learns the
// shard's limits, and returning connections to the pool.
#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "native/core/routing.h"
#include "native/net/buffer.h"
#include "native/net/client.h"
#include "native/net/client_call.h"
#include "native/net/frame_call.h"
#include "native/net/socket.h"

namespace dlt {

using net::Clock;

Status Client::Hello(size_t shard, const std::string& address, int fd, wire::HelloReply* reply) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms);
  DLT_RETURN_IF_ERROR(
      net::SayHello(fd, options_.auth_token, wire::kFlagTopology, 0, deadline, reply));
  if (reply->num_shards != shards_.size() || reply->shard_index != shard) {
    return FailedPrecondition("server says it is shard " + std::to_string(reply->shard_index) +
                              " of " + std::to_string(reply->num_shards) +
                              ", but the client lists it as shard " + std::to_string(shard) +
                              " of " + std::to_string(shards_.size()) +
                              "; list the shard addresses in shard-index order");
  }
  ShardState& st = *shards_[shard];
  std::lock_guard<std::mutex> lock(st.mu);
  if (reply->epoch < st.epoch) {
    // A primary that came back after its standby took over, or one cut off
    // from clients that moved on: never the copy to use.
    return Unavailable("shard " + std::to_string(shard) + " at " + address + " is at epoch " +
                       std::to_string(reply->epoch) + ", older than epoch " +
                       std::to_string(st.epoch) + " this client met: its standby took over");
  }
  st.epoch = reply->epoch;
  // Standbys the primary names, after those the client was given.
  for (size_t from = 0; from < reply->standbys.size();) {
    size_t bar = reply->standbys.find('|', from);
    if (bar == std::string::npos) bar = reply->standbys.size();
    const std::string standby = reply->standbys.substr(from, bar - from);
    if (!standby.empty() &&
        std::find(st.addresses.begin(), st.addresses.end(), standby) == st.addresses.end()) {
      st.addresses.push_back(standby);
      has_standbys_.store(true);
    }
    from = bar + 1;
  }
  return OkStatus();
}

void Client::Adopt(size_t shard, const std::string& address, const wire::HelloReply& reply) {
  ShardState& st = *shards_[shard];
  std::lock_guard<std::mutex> lock(st.mu);
  st.address = address;
  st.info.address = address;
  st.info.shard_index = reply.shard_index;
  st.info.num_shards = reply.num_shards;
  st.info.admin_port = reply.admin_port;
  st.info.max_frame_bytes = reply.max_frame_bytes;
  st.greeted = true;
}

namespace {

// Receive buffers above this size are freed when their connection goes idle.
constexpr size_t kKeepBufferBytes = 64u << 20;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

// True when a pooled connection was closed (or spoke out of turn) while
// idle: a non-blocking peek finds end-of-stream, an error or stray bytes.
bool ClosedWhileIdle(int fd) {
  uint8_t byte;
  const ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return !(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
}

}  // namespace

Status Client::Acquire(size_t shard, Conn* conn) {
  ShardState& st = *shards_[shard];
  const int64_t now = NowMs();
  for (;;) {
    Conn pooled;
    {
      std::lock_guard<std::mutex> lock(st.mu);
      if (st.idle.empty()) break;
      pooled = std::move(st.idle.back());
      st.idle.pop_back();
    }
    if (now - pooled.idle_since_ms > options_.idle_close_ms || ClosedWhileIdle(pooled.fd)) {
      net::CloseFd(pooled.fd);
      continue;
    }
    *conn = std::move(pooled);
    conn->reused = true;
    return OkStatus();
  }
  int fd = -1;
  DLT_RETURN_IF_ERROR(Connect(shard, &fd));
  conn->fd = fd;
  conn->reused = false;
  return OkStatus();
}

Status Client::Connect(size_t shard, int* out_fd) {
  ShardState& st = *shards_[shard];
  std::vector<std::string> addresses;
  std::string current;
  bool first;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    addresses = st.addresses;
    current = st.address;
    first = !st.greeted;
  }
  wire::HelloReply reply;
  if (first && addresses.size() > 1) {
    // The first greeting of a shard with standbys: the newest copy that
    // greets wins (a primary that came back empty after its standby took
    // over is older than that standby).
    int best = -1;
    uint64_t best_epoch = 0;
    Status last = Unavailable("no address greets");
    for (const std::string& address : addresses) {
      int fd = -1;
      wire::HelloReply r;
      const Status s = ConnectTo(shard, address, &fd, &r);
      if (!s.ok()) {
        if (s.code() != Code::kUnavailable) {
          if (best >= 0) net::CloseFd(best);
          return s;
        }
        last = s;
        continue;
      }
      if (best >= 0 && r.epoch <= best_epoch) {
        net::CloseFd(fd);
        continue;
      }
      if (best >= 0) net::CloseFd(best);
      best = fd;
      best_epoch = r.epoch;
      reply = r;
      current = address;
    }
    if (best < 0) return last;
    Adopt(shard, current, reply);
    *out_fd = best;
    return OkStatus();
  }
  Status s = ConnectTo(shard, current, out_fd, &reply);
  if (s.ok()) Adopt(shard, current, reply);
  for (const std::string& other : addresses) {
    if (s.ok() || s.code() != Code::kUnavailable) break;
    if (other == current) continue;
    s = ConnectTo(shard, other, out_fd, &reply);
    if (s.ok()) Adopt(shard, other, reply);
  }
  return s;
}

Status Client::ConnectTo(size_t shard, const std::string& address, int* out_fd,
                         wire::HelloReply* reply) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms);
  int backoff_ms = options_.retry_backoff_ms;
  for (;;) {
    int fd = -1;
    Status s = net::Connect(address, deadline, &fd);
    if (!s.ok()) {
      if (s.code() == Code::kDeadlineExceeded || s.code() == Code::kInvalidArgument) {
        // A shard that cannot be reached in time is unavailable, not slow.
        return Unavailable("connect: " + s.message());
      }
      return s.WithContext("connect");
    }
    s = Hello(shard, address, fd, reply);
    if (s.ok()) {
      *out_fd = fd;
      return OkStatus();
    }
    net::CloseFd(fd);
    if (s.code() == Code::kResourceExhausted) {
      // The shard is at its connection cap: others will close; try again.
      const auto wake = Clock::now() + std::chrono::milliseconds(backoff_ms);
      if (wake < deadline) {
        std::this_thread::sleep_until(wake);
        backoff_ms *= 2;
        continue;
      }
    }
    if (s.code() == Code::kDeadlineExceeded) return Unavailable("Hello: " + s.message());
    return s.WithContext("Hello");
  }
}

void Client::Release(size_t shard, Conn conn) {
  ShardState& st = *shards_[shard];
  conn.idle_since_ms = NowMs();
  std::lock_guard<std::mutex> lock(st.mu);
  // Connections idle too long go first (the pool is used from its back).
  while (!st.idle.empty() &&
         conn.idle_since_ms - st.idle.front().idle_since_ms > options_.idle_close_ms) {
    net::CloseFd(st.idle.front().fd);
    st.idle.erase(st.idle.begin());
  }
  if (static_cast<int>(st.idle.size()) < options_.max_idle_connections) {
    conn.buffer.Trim(kKeepBufferBytes);
    st.idle.push_back(std::move(conn));
  } else {
    net::CloseFd(conn.fd);
  }
}

uint32_t Client::FrameLimit(size_t shard) {
  ShardState& st = *shards_[shard];
  std::lock_guard<std::mutex> lock(st.mu);
  return std::min(options_.frame_bytes, st.info.max_frame_bytes);
}

Status Client::GetShardInfos(std::vector<ShardInfo>* infos) {
  infos->clear();
  for (size_t i = 0; i < shards_.size(); ++i) {
    bool greeted;
    {
      std::lock_guard<std::mutex> lock(shards_[i]->mu);
      greeted = shards_[i]->greeted;
    }
    if (!greeted) {
      Conn conn;
      Status s = Acquire(i, &conn);
      if (!s.ok()) return s.WithContext(Context(i, "Hello"));
      Release(i, std::move(conn));
    }
    std::lock_guard<std::mutex> lock(shards_[i]->mu);
    infos->push_back(shards_[i]->info);
  }
  return OkStatus();
}

}  // namespace dlt
