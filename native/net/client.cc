#include "native/net/client.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "native/core/dedup.h"
#include "native/core/finite.h"
#include "native/core/routing.h"
#include "native/net/buffer.h"
#include "native/net/socket.h"

namespace dlt {

using net::Clock;

struct Client::ShardState {
  std::string address;
  std::mutex mu;
  std::vector<Conn> idle;  // guarded by mu
  bool greeted = false;    // guarded by mu
  ShardInfo info;          // guarded by mu
};

// One shard's part of an exchange: frames to send, a handler for replies.
struct Client::Call {
  struct Frame {
    uint8_t header[wire::kHeaderBytes];
    std::string prefix;
    const void* body[2] = {nullptr, nullptr};
    size_t body_bytes[2] = {0, 0};
    size_t reply_bytes = 0;  // the payload its reply must have
    size_t Bytes() const {
      return wire::kHeaderBytes + prefix.size() + body_bytes[0] + body_bytes[1];
    }
  };
  size_t shard = 0;
  wire::Opcode opcode = wire::Opcode::kPull;
  std::vector<Frame> frames;
  uint64_t first_request_id = 0;
  // Called with each whole reply frame's payload; for a call with `rows`
  // set, with the reply's fixed part (`bytes` = rows.fixed) once it is in,
  // before the rows are read.
  std::function<Status(size_t frame, const uint8_t* payload, size_t bytes)> on_reply;

  // Pulls: the rows of a reply are received through a small staging buffer
  // that stays in cache (StageBytes) and copied to their places in the
  // caller's memory as they arrive, so no reply is buffered whole. Row r of
  // frame f goes to out + at * row_floats, at = pos[f * rows_per_frame + r]
  // (or f * rows_per_frame + r without `pos`); the reply's first `fixed`
  // payload bytes are buffered for on_reply.
  struct RowTarget {
    float* out = nullptr;  // nullptr: replies are buffered whole
    const uint32_t* pos = nullptr;
    size_t rows_per_frame = 0;
    size_t row_floats = 0;
    size_t fixed = 0;
  } rows;

  // Fills up to `max_iov` iovecs with the unsent bytes from `offset` of frame
  // `frame_index` on; returns how many.
  int FillIov(size_t frame_index, size_t offset, struct iovec* iov, int max_iov) const;
  // The staging buffer's size: whole rows, about kStageBytes, at least one.
  size_t StageBytes() const;
  // Copies `count` whole rows from `src`, rows `first` on of frame `frame`,
  // to their places.
  void PlaceRows(size_t frame, size_t first, const uint8_t* src, size_t count) const;
  // Checks a reply header against the request it answers (id not answered
  // yet, opcode, exact payload size) before its payload is read.
  Status CheckReply(const wire::FrameHeader& frame, const std::vector<bool>& answered) const;
};

namespace {

// Receive buffers above this size are freed when their connection goes idle.
constexpr size_t kKeepBufferBytes = 64u << 20;
// Reply rows are staged in about this many bytes (a part of a core's L2).
constexpr size_t kStageBytes = 256u << 10;

struct Io {
  int fd = -1;
  size_t send_frame = 0;
  size_t send_offset = 0;
  Status send_error;
  size_t replies = 0;
  uint8_t header[wire::kHeaderBytes];
  size_t header_got = 0;
  wire::FrameHeader frame;
  net::Buffer payload;
  size_t payload_got = 0;
  bool in_payload = false;
  bool direct = false;  // this frame's rows are staged to Call::rows
  size_t staged = 0;    // bytes of a part row at the staging buffer's start
  std::vector<bool> answered;
};

}  // namespace

int Client::Call::FillIov(size_t frame_index, size_t offset, struct iovec* iov, int max_iov) const {
  int n = 0;
  for (size_t f = frame_index; f < frames.size() && n + 4 <= max_iov; ++f) {
    const Frame& fr = frames[f];
    const void* parts[4] = {fr.header, fr.prefix.data(), fr.body[0], fr.body[1]};
    const size_t sizes[4] = {wire::kHeaderBytes, fr.prefix.size(), fr.body_bytes[0],
                             fr.body_bytes[1]};
    for (int k = 0; k < 4; ++k) {
      if (offset >= sizes[k]) {
        offset -= sizes[k];
        continue;
      }
      iov[n].iov_base = const_cast<char*>(static_cast<const char*>(parts[k])) + offset;
      iov[n].iov_len = sizes[k] - offset;
      offset = 0;
      ++n;
    }
  }
  return n;
}

size_t Client::Call::StageBytes() const {
  const size_t row_bytes = sizeof(float) * rows.row_floats;
  return std::max<size_t>(1, kStageBytes / row_bytes) * row_bytes;
}

void Client::Call::PlaceRows(size_t frame, size_t first, const uint8_t* src, size_t count) const {
  const size_t w = rows.row_floats;
  const size_t begin = frame * rows.rows_per_frame + first;
  if (rows.pos == nullptr) {
    std::memcpy(rows.out + begin * w, src, sizeof(float) * w * count);
    return;
  }
  for (size_t r = 0; r < count; ++r) {
    std::memcpy(rows.out + size_t{rows.pos[begin + r]} * w, src + sizeof(float) * w * r,
                sizeof(float) * w);
  }
}

Status Client::Call::CheckReply(const wire::FrameHeader& frame,
                                const std::vector<bool>& answered) const {
  if (frame.opcode == wire::Opcode::kError) {
    if (frame.payload_bytes > wire::kErrorFixed + wire::kMaxErrorMessageBytes) {
      return Internal("error reply of " + std::to_string(frame.payload_bytes) +
                      " bytes exceeds the largest error frame");
    }
    return OkStatus();
  }
  const uint64_t id = frame.request_id;
  if (id < first_request_id || id >= first_request_id + frames.size() ||
      answered[id - first_request_id]) {
    return Internal("reply to unknown request id " + std::to_string(id));
  }
  if (frame.opcode != opcode) return Internal("reply opcode does not match the request");
  const size_t expected = frames[id - first_request_id].reply_bytes;
  if (frame.payload_bytes != expected) {
    return Internal("reply of " + std::to_string(frame.payload_bytes) +
                    " bytes; the request expects " + std::to_string(expected));
  }
  return OkStatus();
}

Client::Client(std::vector<std::string> addresses, ClientOptions options)
    : options_(std::move(options)) {
  for (std::string& a : addresses) {
    shards_.push_back(std::make_unique<ShardState>());
    shards_.back()->address = std::move(a);
  }
}

Client::~Client() {
  for (auto& s : shards_) {
    for (Conn& c : s->idle) net::CloseFd(c.fd);
  }
}

std::string Client::Context(size_t shard, const char* op) const {
  return "shard " + std::to_string(shard) + " (" + shards_[shard]->address + ") " + op;
}

uint32_t Client::ShardOf(int64_t id) const {
  return ShardOfBucket(BucketOf(id), static_cast<uint32_t>(shards_.size()));
}

Status Client::Hello(size_t shard, int fd) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms);
  wire::HelloRequest request;
  request.token = options_.auth_token;
  const std::string payload = wire::EncodeHelloRequest(request);
  uint8_t header[wire::kHeaderBytes];
  wire::EncodeHeader({wire::Opcode::kHello, 0, 0, static_cast<uint32_t>(payload.size())}, header);
  struct iovec iov[2] = {{header, sizeof(header)},
                         {const_cast<char*>(payload.data()), payload.size()}};
  Status s = net::SendAll(fd, iov, 2, deadline);
  uint8_t reply_header[wire::kHeaderBytes];
  // Even when sending failed the server may have explained why before closing.
  Status r = net::RecvAll(fd, reply_header, sizeof(reply_header), deadline);
  if (!r.ok()) return s.ok() ? r : s;
  wire::FrameHeader h;
  DLT_RETURN_IF_ERROR(wire::DecodeHeader(reply_header, UINT32_MAX, &h));
  // Read no more than a Hello reply or an error can hold.
  const size_t allowed = h.opcode == wire::Opcode::kError
                             ? wire::kErrorFixed + wire::kMaxErrorMessageBytes
                             : wire::kHelloReplyBytes;
  if (h.payload_bytes > allowed) {
    return Internal("Hello reply of " + std::to_string(h.payload_bytes) + " bytes exceeds " +
                    std::to_string(allowed));
  }
  std::string body(h.payload_bytes, '\0');
  DLT_RETURN_IF_ERROR(net::RecvAll(fd, &body[0], body.size(), deadline));
  const auto* p = reinterpret_cast<const uint8_t*>(body.data());
  if (h.opcode == wire::Opcode::kError) return wire::DecodeError(p, body.size());
  if (h.opcode != wire::Opcode::kHello || !(h.flags & wire::kFlagResponse)) {
    return Internal("expected a Hello reply");
  }
  wire::HelloReply reply;
  DLT_RETURN_IF_ERROR(wire::DecodeHelloReply(p, body.size(), &reply));
  if (reply.num_buckets != kNumBuckets) {
    return FailedPrecondition("server routes over " + std::to_string(reply.num_buckets) +
                              " buckets, this client over " + std::to_string(kNumBuckets));
  }
  if (reply.num_shards != shards_.size() || reply.shard_index != shard) {
    return FailedPrecondition("server says it is shard " + std::to_string(reply.shard_index) +
                              " of " + std::to_string(reply.num_shards) +
                              ", but the client lists it as shard " + std::to_string(shard) +
                              " of " + std::to_string(shards_.size()) +
                              "; list the shard addresses in shard-index order");
  }
  ShardState& st = *shards_[shard];
  std::lock_guard<std::mutex> lock(st.mu);
  st.info.address = st.address;
  st.info.shard_index = reply.shard_index;
  st.info.num_shards = reply.num_shards;
  st.info.admin_port = reply.admin_port;
  st.info.max_frame_bytes = reply.max_frame_bytes;
  st.greeted = true;
  return OkStatus();
}

namespace {

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
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms);
  int backoff_ms = options_.retry_backoff_ms;
  for (;;) {
    int fd = -1;
    Status s = net::Connect(shards_[shard]->address, deadline, &fd);
    if (!s.ok()) {
      if (s.code() == Code::kDeadlineExceeded || s.code() == Code::kInvalidArgument) {
        // A shard that cannot be reached in time is unavailable, not slow.
        return Unavailable("connect: " + s.message());
      }
      return s.WithContext("connect");
    }
    s = Hello(shard, fd);
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

Status Client::Exchange(std::vector<Call>* calls, const char* op, bool* any_reused) {
  *any_reused = false;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
  std::vector<Io> io(calls->size());
  auto close_all = [&]() {
    for (Io& x : io) {
      net::CloseFd(x.fd);
      x.fd = -1;
    }
  };
  for (size_t c = 0; c < calls->size(); ++c) {
    Call& call = (*calls)[c];
    Conn conn;
    Status s = Acquire(call.shard, &conn);
    if (!s.ok()) {
      close_all();
      return s.WithContext(Context(call.shard, op));
    }
    io[c].fd = conn.fd;
    io[c].payload = std::move(conn.buffer);
    *any_reused = *any_reused || conn.reused;
    io[c].answered.assign(call.frames.size(), false);
    call.first_request_id = next_request_id_.fetch_add(call.frames.size());
    for (size_t f = 0; f < call.frames.size(); ++f) {
      Call::Frame& fr = call.frames[f];
      const size_t payload = fr.Bytes() - wire::kHeaderBytes;
      wire::EncodeHeader(
          {call.opcode, 0, call.first_request_id + f, static_cast<uint32_t>(payload)}, fr.header);
    }
  }
  std::vector<struct pollfd> fds(calls->size());
  size_t remaining = calls->size();
  for (size_t c = 0; c < calls->size(); ++c) {
    if ((*calls)[c].frames.empty()) --remaining;
  }
  while (remaining > 0) {
    for (size_t c = 0; c < calls->size(); ++c) {
      const Call& call = (*calls)[c];
      const bool done = io[c].replies == call.frames.size();
      const bool sending = io[c].send_frame < call.frames.size() && io[c].send_error.ok();
      fds[c] = {done ? -1 : io[c].fd, static_cast<short>(POLLIN | (sending ? POLLOUT : 0)), 0};
    }
    const int rc = poll(fds.data(), fds.size(), net::RemainingMs(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) {
      for (size_t c = 0; c < calls->size(); ++c) {
        if (io[c].replies < (*calls)[c].frames.size()) {
          close_all();
          return DeadlineExceeded(Context((*calls)[c].shard, op) + ": no reply within " +
                                  std::to_string(options_.request_timeout_ms) + " ms");
        }
      }
    }
    for (size_t c = 0; c < calls->size(); ++c) {
      Call& call = (*calls)[c];
      Io& x = io[c];
      if (fds[c].fd < 0 || fds[c].revents == 0) continue;
      auto fail = [&](const Status& s) {
        close_all();
        return s.WithContext(Context(call.shard, op));
      };
      if ((fds[c].revents & (POLLOUT | POLLERR)) && x.send_frame < call.frames.size() &&
          x.send_error.ok()) {
        struct iovec iov[64];
        const int n = call.FillIov(x.send_frame, x.send_offset, iov, 64);
        struct msghdr msg;
        std::memset(&msg, 0, sizeof(msg));
        msg.msg_iov = iov;
        msg.msg_iovlen = static_cast<size_t>(n);
        const ssize_t sent = sendmsg(x.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          // Keep reading: the server may have sent an error frame first.
          x.send_error = Unavailable(std::string("send: ") + std::strerror(errno));
        } else if (sent > 0) {
          size_t left = static_cast<size_t>(sent);
          while (left > 0) {
            const size_t in_frame = call.frames[x.send_frame].Bytes() - x.send_offset;
            if (left >= in_frame) {
              left -= in_frame;
              ++x.send_frame;
              x.send_offset = 0;
            } else {
              x.send_offset += left;
              left = 0;
            }
          }
        }
      }
      if (!(fds[c].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      for (;;) {
        ssize_t got = 0;
        size_t want;
        const size_t buffered = x.direct ? call.rows.fixed : x.frame.payload_bytes;
        if (!x.in_payload) {
          want = wire::kHeaderBytes - x.header_got;
          got = recv(x.fd, x.header + x.header_got, want, MSG_DONTWAIT);
        } else if (x.payload_got < buffered) {
          want = buffered - x.payload_got;
          got = recv(x.fd, x.payload.data() + x.payload_got, want, MSG_DONTWAIT);
        } else {
          // Rows: into the staging buffer after the fixed part, behind the
          // part of a row left from the last read; whole rows to their places.
          want = x.frame.payload_bytes - x.payload_got;
          if (want > 0) {
            uint8_t* stage = x.payload.data() + buffered;
            got = recv(x.fd, stage + x.staged, std::min(want, call.StageBytes() - x.staged),
                       MSG_DONTWAIT);
            if (got > 0) {
              const size_t row_bytes = sizeof(float) * call.rows.row_floats;
              const size_t placed = (x.payload_got - buffered - x.staged) / row_bytes;
              const size_t total = x.staged + static_cast<size_t>(got);
              const size_t whole = total / row_bytes;
              call.PlaceRows(x.frame.request_id - call.first_request_id, placed, stage, whole);
              x.staged = total - whole * row_bytes;
              if (x.staged > 0) std::memmove(stage, stage + whole * row_bytes, x.staged);
            }
          }
        }
        if (want != 0) {
          if (got == 0) {
            return fail(x.send_error.ok() ? Unavailable("connection closed by the server")
                                          : x.send_error);
          }
          if (got < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return fail(Unavailable(std::string("recv: ") + std::strerror(errno)));
          }
        }
        if (!x.in_payload) {
          x.header_got += static_cast<size_t>(got);
          if (x.header_got < wire::kHeaderBytes) continue;
          Status s = wire::DecodeHeader(x.header, UINT32_MAX, &x.frame);
          if (!s.ok()) return fail(Internal("bad reply frame: " + s.message()));
          if (!(x.frame.flags & wire::kFlagResponse)) {
            return fail(Internal("reply frame lacks the response flag"));
          }
          // The size is checked before a byte of the payload is read or
          // buffered: a reply can hold exactly what its request expects.
          s = call.CheckReply(x.frame, x.answered);
          if (!s.ok()) return fail(s);
          x.direct = call.rows.out != nullptr && x.frame.opcode == call.opcode;
          x.payload.Reserve(x.direct ? call.rows.fixed + call.StageBytes() : x.frame.payload_bytes);
          x.payload_got = 0;
          x.staged = 0;
          x.in_payload = true;
          if (x.frame.payload_bytes > 0) continue;
        } else {
          const bool had_fixed = x.payload_got >= call.rows.fixed;
          x.payload_got += static_cast<size_t>(got);
          if (x.direct && !had_fixed && x.payload_got >= call.rows.fixed) {
            // The reply's fixed part is checked before its rows are read.
            Status s = call.on_reply(x.frame.request_id - call.first_request_id, x.payload.data(),
                                     call.rows.fixed);
            if (!s.ok()) return fail(s);
          }
          if (x.payload_got < x.frame.payload_bytes) continue;
        }
        // A whole reply frame is here.
        x.in_payload = false;
        x.header_got = 0;
        const uint8_t* p = x.payload.data();
        const size_t bytes = x.frame.payload_bytes;
        if (x.frame.opcode == wire::Opcode::kError) {
          return fail(wire::DecodeError(p, bytes));
        }
        const size_t f = x.frame.request_id - call.first_request_id;
        x.answered[f] = true;
        if (!x.direct) {
          Status s = call.on_reply(f, p, bytes);
          if (!s.ok()) return fail(s);
        }
        if (++x.replies == call.frames.size()) {
          --remaining;
          break;
        }
      }
    }
  }
  for (size_t c = 0; c < calls->size(); ++c) {
    Conn conn;
    conn.fd = io[c].fd;
    conn.buffer = std::move(io[c].payload);
    Release((*calls)[c].shard, std::move(conn));
  }
  return OkStatus();
}

namespace {

// Positions of the ids each shard owns, in input order. With `repeats`, each
// distinct id once: the position of its first occurrence, and every later
// occurrence in `repeats` as (its position, the first's).
void GroupByShard(const Client& client, const int64_t* ids, size_t n, size_t num_shards,
                  std::vector<std::vector<uint32_t>>* groups,
                  std::vector<std::pair<uint32_t, uint32_t>>* repeats) {
  groups->assign(num_shards, {});
  struct Scratch : DedupScratch {
    std::vector<uint32_t> firsts;
  };
  Scratch own;
  Scratch& scratch = ThreadScratch(n, own);
  const std::vector<int64_t>& unique = scratch.unique;
  if (repeats != nullptr) {
    repeats->clear();
    scratch.Run(ids, n);
  }
  if (repeats == nullptr || unique.size() == n) {
    if (num_shards == 1) {
      (*groups)[0].resize(n);
      for (size_t i = 0; i < n; ++i) (*groups)[0][i] = static_cast<uint32_t>(i);
      return;
    }
    for (size_t i = 0; i < n; ++i) {
      (*groups)[client.ShardOf(ids[i])].push_back(static_cast<uint32_t>(i));
    }
    return;
  }
  std::vector<uint32_t>& firsts = scratch.firsts;
  firsts.clear();
  for (size_t i = 0; i < n; ++i) {
    const auto u = static_cast<size_t>(scratch.slot[i]);
    if (u == firsts.size()) {
      firsts.push_back(static_cast<uint32_t>(i));
      (*groups)[num_shards == 1 ? 0 : client.ShardOf(ids[i])].push_back(static_cast<uint32_t>(i));
    } else {
      repeats->emplace_back(static_cast<uint32_t>(i), firsts[u]);
    }
  }
}

Status CheckBatch(size_t n, uint32_t dim) {
  if (n > UINT32_MAX) return InvalidArgument("at most 2^32-1 ids per call");
  if (dim == 0 || dim > kMaxDim) {
    return InvalidArgument("dim must be in [1, " + std::to_string(kMaxDim) + "], got " +
                           std::to_string(dim));
  }
  return OkStatus();
}

}  // namespace

Status Client::Route(const int64_t* ids, size_t n, std::vector<std::vector<uint32_t>>* groups,
                     std::vector<std::pair<uint32_t, uint32_t>>* repeats) {
  std::vector<ShardInfo> infos;  // greets every shard once
  DLT_RETURN_IF_ERROR(GetShardInfos(&infos));
  GroupByShard(*this, ids, n, shards_.size(), groups, repeats);
  return OkStatus();
}

Status Client::RowsPerFrame(size_t shard, const char* op, uint32_t dim, size_t prefix_bytes,
                            size_t request_row_bytes, size_t reply_row_bytes, size_t* rows) {
  const uint32_t limit = FrameLimit(shard);
  size_t n = (limit - prefix_bytes) / request_row_bytes;
  if (reply_row_bytes > 0) n = std::min(n, (limit - wire::kPullReplyFixed) / reply_row_bytes);
  if (n == 0) {
    return ResourceExhausted(Context(shard, op) + ": one row of dim " + std::to_string(dim) +
                             " exceeds the frame limit of " + std::to_string(limit) + " bytes");
  }
  *rows = n;
  return OkStatus();
}

Status Client::Pull(const std::string& table, uint32_t dim, const int64_t* ids, size_t n,
                    PullMode mode, float* out, bool dedup, size_t* sent) {
  if (mode == PullMode::kState) {
    return InvalidArgument("Pull mode kState returns wider rows: use PullState");
  }
  if (sent != nullptr) *sent = 0;
  return PullRows(table, dim, ids, n, mode, dim, out, dedup, sent);
}

Status Client::PullState(const std::string& table, uint32_t dim, uint32_t slot_floats,
                         const int64_t* ids, size_t n, float* out) {
  return PullRows(table, dim, ids, n, PullMode::kState, StateFloats(dim, slot_floats), out,
                  /*dedup=*/false, nullptr);
}

Status Client::PullRows(const std::string& table, uint32_t dim, const int64_t* ids, size_t n,
                        PullMode mode, uint32_t row_floats, float* out, bool dedup, size_t* sent) {
  DLT_RETURN_IF_ERROR(CheckBatch(n, dim));
  DLT_RETURN_IF_ERROR(ValidateTableName(table));
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
  int backoff_ms = options_.retry_backoff_ms;
  int retries = 0;
  bool stale_retried = false;
  bool any_reused = false;
  Status s = PullOnce(table, dim, ids, n, mode, row_floats, out, dedup, sent, &any_reused);
  while (!s.ok() && s.code() == Code::kUnavailable) {
    if (any_reused && !stale_retried) {
      // A pooled connection that died while idle: once more at once.
      stale_retried = true;
    } else {
      // A shard restarting or a dropped connection: pause, doubling.
      if (retries >= options_.pull_retries) break;
      const auto wake = std::chrono::steady_clock::now() + std::chrono::milliseconds(backoff_ms);
      if (wake >= deadline) break;
      std::this_thread::sleep_until(wake);
      backoff_ms *= 2;
      ++retries;
    }
    s = PullOnce(table, dim, ids, n, mode, row_floats, out, dedup, sent, &any_reused);
  }
  return s;
}

Status Client::PullOnce(const std::string& table, uint32_t dim, const int64_t* ids, size_t n,
                        PullMode mode, uint32_t row_floats, float* out, bool dedup, size_t* sent,
                        bool* any_reused) {
  *any_reused = false;
  if (sent != nullptr) *sent = 0;
  if (n == 0) return OkStatus();
  // With dedup each distinct id is asked once; its row lands at its first
  // position and is copied to the later ones.
  std::vector<std::vector<uint32_t>> groups;
  std::vector<std::pair<uint32_t, uint32_t>> repeats;
  DLT_RETURN_IF_ERROR(Route(ids, n, &groups, dedup ? &repeats : nullptr));
  std::vector<std::vector<int64_t>> shard_ids(shards_.size());
  std::vector<Call> calls;
  const size_t prefix_bytes = wire::kTableRequestFixed + wire::PaddedNameBytes(table.size());
  for (size_t s = 0; s < shards_.size(); ++s) {
    const std::vector<uint32_t>& pos = groups[s];
    if (pos.empty()) continue;
    size_t rows_per_frame;
    DLT_RETURN_IF_ERROR(
        RowsPerFrame(s, "Pull", dim, prefix_bytes, 8, size_t{4} * row_floats, &rows_per_frame));
    const bool in_order = pos.size() == n;  // every id, each once, to this shard
    const int64_t* shard_ids_ptr = ids;
    if (!in_order) {
      shard_ids[s].resize(pos.size());
      for (size_t k = 0; k < pos.size(); ++k) shard_ids[s][k] = ids[pos[k]];
      shard_ids_ptr = shard_ids[s].data();
    }
    Call call;
    call.shard = s;
    call.opcode = wire::Opcode::kPull;
    for (size_t begin = 0; begin < pos.size(); begin += rows_per_frame) {
      const size_t count = std::min(rows_per_frame, pos.size() - begin);
      Call::Frame fr;
      fr.prefix = wire::EncodePullPrefix(table, dim, static_cast<uint32_t>(count), mode);
      fr.body[0] = shard_ids_ptr + begin;
      fr.body_bytes[0] = count * 8;
      fr.reply_bytes = wire::kPullReplyFixed + size_t{4} * row_floats * count;
      call.frames.push_back(std::move(fr));
    }
    call.rows.out = out;
    call.rows.pos = in_order ? nullptr : pos.data();
    call.rows.rows_per_frame = rows_per_frame;
    call.rows.row_floats = row_floats;
    call.rows.fixed = wire::kPullReplyFixed;
    call.on_reply = [&pos, rows_per_frame, dim](size_t frame, const uint8_t* p,
                                                size_t bytes) -> Status {
      if (bytes != wire::kPullReplyFixed) return Internal("Pull reply lacks its fixed part");
      const size_t count = std::min(rows_per_frame, pos.size() - frame * rows_per_frame);
      uint32_t got_dim, got_rows;
      std::memcpy(&got_dim, p, 4);
      std::memcpy(&got_rows, p + 4, 4);
      if (got_dim != dim || got_rows != count) {
        return Internal("Pull reply names dim " + std::to_string(got_dim) + " and " +
                        std::to_string(got_rows) + " rows; the request has dim " +
                        std::to_string(dim) + " and " + std::to_string(count) + " ids");
      }
      return OkStatus();
    };
    calls.push_back(std::move(call));
  }
  DLT_RETURN_IF_ERROR(Exchange(&calls, "Pull", any_reused));
  if (sent != nullptr) *sent = n - repeats.size();
  const size_t w = row_floats;
  for (const auto& [at, first] : repeats) {
    std::memcpy(out + size_t{at} * w, out + size_t{first} * w, sizeof(float) * w);
  }
  return OkStatus();
}

Status Client::Push(const std::string& table, uint32_t dim, const int64_t* ids, const float* grads,
                    size_t n, float learning_rate) {
  return SendRows(wire::Opcode::kPush, table, dim, ids, grads, n, learning_rate);
}

Status Client::Assign(const std::string& table, uint32_t dim, const int64_t* ids,
                      const float* values, size_t n) {
  return SendRows(wire::Opcode::kAssign, table, dim, ids, values, n, 0.0f);
}

Status Client::SendRows(wire::Opcode opcode, const std::string& table, uint32_t dim,
                        const int64_t* ids, const float* rows, size_t n, float learning_rate) {
  const char* op = opcode == wire::Opcode::kPush ? "Push" : "Assign";
  DLT_RETURN_IF_ERROR(CheckBatch(n, dim));
  DLT_RETURN_IF_ERROR(ValidateTableName(table));
  if (n == 0) return OkStatus();
  // Checked here, before any shard gets its part, so a bad batch changes no
  // shard (each shard checks its own part again).
  const size_t bad = FirstNonFinite(rows, n * dim);
  if (bad < n * dim) {
    return InvalidArgument(std::string(op) + ": row " + std::to_string(bad / dim) + " (id " +
                           std::to_string(ids[bad / dim]) +
                           ") holds a non-finite value; nothing sent");
  }
  if (opcode == wire::Opcode::kPush && (!std::isfinite(learning_rate) || learning_rate < 0)) {
    return InvalidArgument("Push: learning rate must be finite and >= 0, got " +
                           std::to_string(learning_rate));
  }
  std::vector<std::vector<uint32_t>> groups;
  DLT_RETURN_IF_ERROR(Route(ids, n, &groups));
  std::vector<std::vector<int64_t>> shard_ids(shards_.size());
  std::vector<std::vector<float>> shard_rows(shards_.size());
  std::vector<Call> calls;
  const size_t prefix_bytes = wire::kTableRequestFixed + wire::PaddedNameBytes(table.size());
  for (size_t s = 0; s < shards_.size(); ++s) {
    const std::vector<uint32_t>& pos = groups[s];
    if (pos.empty()) continue;
    size_t rows_per_frame;
    DLT_RETURN_IF_ERROR(
        RowsPerFrame(s, op, dim, prefix_bytes, 8 + size_t{4} * dim, 0, &rows_per_frame));
    const int64_t* ids_ptr = ids;
    const float* rows_ptr = rows;
    if (shards_.size() > 1) {
      shard_ids[s].resize(pos.size());
      shard_rows[s].resize(pos.size() * dim);
      for (size_t k = 0; k < pos.size(); ++k) {
        shard_ids[s][k] = ids[pos[k]];
        std::memcpy(&shard_rows[s][k * dim], rows + size_t{pos[k]} * dim, sizeof(float) * dim);
      }
      ids_ptr = shard_ids[s].data();
      rows_ptr = shard_rows[s].data();
    }
    Call call;
    call.shard = s;
    call.opcode = opcode;
    for (size_t begin = 0; begin < pos.size(); begin += rows_per_frame) {
      const size_t count = std::min(rows_per_frame, pos.size() - begin);
      Call::Frame fr;
      fr.prefix =
          opcode == wire::Opcode::kPush
              ? wire::EncodePushPrefix(table, dim, static_cast<uint32_t>(count), learning_rate)
              : wire::EncodeAssignPrefix(table, dim, static_cast<uint32_t>(count));
      fr.body[0] = ids_ptr + begin;
      fr.body_bytes[0] = count * 8;
      fr.body[1] = rows_ptr + begin * dim;
      fr.body_bytes[1] = count * dim * sizeof(float);
      fr.reply_bytes = wire::kPushReplyBytes;
      call.frames.push_back(std::move(fr));
    }
    call.on_reply = [op](size_t, const uint8_t*, size_t bytes) -> Status {
      if (bytes != wire::kPushReplyBytes) {
        return Internal(std::string(op) + " reply has the wrong size");
      }
      return OkStatus();
    };
    calls.push_back(std::move(call));
  }
  bool any_reused = false;
  return Exchange(&calls, op, &any_reused);
}

}  // namespace dlt
