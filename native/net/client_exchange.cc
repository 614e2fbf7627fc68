// The data-plane client's exchange: a poll loop that sends shards their
// frames and receives their replies at once, staging reply rows into their
// places as they arrive; a large call runs one such loop per connection, each
// on a thread of its own.
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "native/core/finite.h"
#include "native/core/prefetch.h"
#include "native/core/task_pool.h"
#include "native/net/buffer.h"
#include "native/net/client.h"
#include "native/net/client_call.h"
#include "native/net/socket.h"

namespace dlt {

using net::Clock;

namespace {

// Reply rows are staged in about this many bytes (a part of a core's L2).
constexpr size_t kStageBytes = 256u << 10;
// Reply rows are copied to their places with the lines of the row this
// many rows ahead already asked for.
constexpr size_t kPlaceAhead = 8;
// A connection of its own (and a thread's wake) pays for itself from about
// this many bytes of request and reply.
constexpr size_t kLaneBytes = 1u << 20;
constexpr int kMaxExchangeThreads = 16;
// Below 2 MiB a shard's part of at least 2 x kLaneRows rows is split over
// up to kMaxLoopLanes connections in one loop (on 16 cores, a pull of 16,384
// ids x dim 16 from 2 shards: 1.2-1.3 ms in one connection each, 0.75 ms in
// four; parts of 2,048 rows were slower split).
constexpr size_t kLaneRows = 2048;
constexpr size_t kMaxLoopLanes = 4;
// Below this many cores a call stays on the calling thread: on 2 cores the
// threads cut a large pull's wall time by about 7% for 20% more CPU
// (bench_wire.py), CPU a trainer's own ops need.
constexpr int kMinCoresForThreads = 4;

int CoreCount() {
  const unsigned cores = std::thread::hardware_concurrency();
  return std::clamp(static_cast<int>(cores), 1, kMaxExchangeThreads);
}

// The calling thread is one of a call's threads: the pool holds the others.
TaskPool& ExchangePool() {
  static TaskPool* pool = TaskPool::Create(CoreCount() - 1);
  return *pool;
}

size_t ExchangeThreads(const ClientOptions& options) {
  if (options.exchange_threads > 0) return static_cast<size_t>(options.exchange_threads);
  return CoreCount() < kMinCoresForThreads ? 1 : static_cast<size_t>(CoreCount());
}

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
  // The shard lists standbys: a silence is looked into (CheckSilent).
  bool replicated = false;
  uint64_t switches = 0;    // the connection's Conn::switches
  Clock::time_point heard;  // when a byte last moved either way
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

bool StreamsPulledRows(const float* out, size_t row_floats, size_t rows) {
#if defined(__SSE2__)
  const size_t row_bytes = sizeof(float) * row_floats;
  return reinterpret_cast<uintptr_t>(out) % 64 == 0 && row_bytes % 64 == 0 &&
         row_bytes * rows >= kStreamPlaceBytes;
#else
  return false;
#endif
}

void Client::Call::PlaceRows(size_t frame, size_t first, const uint8_t* src, size_t count) const {
  const size_t w = rows.row_floats;
  const size_t begin = first_row + frame * rows_per_frame + first;
  if (rows.pos == nullptr) {
    std::memcpy(rows.out + begin * w, src, sizeof(float) * w * count);
    return;
  }
  const size_t row_bytes = sizeof(float) * w;
#if defined(__SSE2__)
  if (rows.stream) {
    // Whole cache lines written around the cache: no line is read first.
    for (size_t r = 0; r < count; ++r) {
      auto* to = reinterpret_cast<__m128i*>(rows.out + size_t{rows.pos[begin + r]} * w);
      const auto* from = reinterpret_cast<const __m128i*>(src + row_bytes * r);
      for (size_t k = 0; k < row_bytes / sizeof(__m128i); ++k) {
        _mm_stream_si128(to + k, _mm_loadu_si128(from + k));
      }
    }
    _mm_sfence();  // visible before the call is seen done (or repeats copied)
    return;
  }
#endif
  // The places are scattered: each row's cache lines are asked for (to
  // write) some rows ahead, so their misses overlap instead of stalling
  // each copy in turn.
  for (size_t r = 0; r < count; ++r) {
    if (r + kPlaceAhead < count) {
      const char* ahead =
          reinterpret_cast<const char*>(rows.out + size_t{rows.pos[begin + r + kPlaceAhead]} * w);
      PrefetchBytes<1>(ahead, row_bytes);
    }
    std::memcpy(rows.out + size_t{rows.pos[begin + r]} * w, src + row_bytes * r, row_bytes);
  }
}

Status Client::Call::CheckReply(const wire::FrameHeader& frame,
                                const std::vector<bool>& answered) const {
  // An error too must answer a request of this call still unanswered: one
  // for another request says the stream is out of step.
  const uint64_t id = frame.request_id;
  if (id < first_request_id || id >= first_request_id + frames.size() ||
      answered[id - first_request_id]) {
    return Internal("reply to unknown request id " + std::to_string(id));
  }
  if (frame.opcode == wire::Opcode::kError) {
    if (frame.payload_bytes > wire::kErrorFixed + wire::kMaxErrorMessageBytes) {
      return Internal("error reply of " + std::to_string(frame.payload_bytes) +
                      " bytes exceeds the largest error frame");
    }
    return OkStatus();
  }
  if (frame.opcode != opcode) return Internal("reply opcode does not match the request");
  const size_t expected = frames[id - first_request_id].reply_bytes;
  if (frame.payload_bytes != expected && rows.state_dim > 0 &&
      frame.payload_bytes > wire::kPullReplyFixed) {
    // A state pull of a table with other slot floats than PullState was
    // told: as many rows, each of another width.
    const size_t count = (expected - wire::kPullReplyFixed) / (sizeof(float) * rows.row_floats);
    const size_t got = frame.payload_bytes - wire::kPullReplyFixed;
    const size_t width = count > 0 ? got / (sizeof(float) * count) : 0;
    if (width * sizeof(float) * count == got && width > rows.state_dim) {
      return InvalidArgument("the table has " + std::to_string(width - rows.state_dim - 1) +
                             " slot floats per row, the request says " +
                             std::to_string(rows.row_floats - rows.state_dim - 1) +
                             " (pull_state's slot_floats)");
    }
  }
  if (frame.payload_bytes != expected) {
    return Internal("reply of " + std::to_string(frame.payload_bytes) +
                    " bytes; the request expects " + std::to_string(expected));
  }
  return OkStatus();
}

size_t Client::LanesFor(size_t rows, size_t bytes, size_t touched) const {
  const size_t threads = ExchangeThreads(options_);
  if (threads <= 1) return 1;
  if (touched > 0 && threads > touched && bytes >= 2 * kLaneBytes) {
    return std::clamp<size_t>(bytes / (2 * kLaneBytes), 1, threads / touched);
  }
  // A part of many rows but too few bytes for threads of its own: a few
  // connections, which the shard's worker threads serve at once.
  return std::clamp<size_t>(rows / kLaneRows, 1, kMaxLoopLanes);
}

Status Client::Exchange(std::vector<Call>* calls, const char* op, Clock::time_point deadline,
                        bool* any_reused) {
  // One deadline for the whole call, whichever thread exchanges a part when.
  size_t bytes = 0;
  for (const Call& call : *calls) bytes += call.Bytes();
  const size_t threads = ExchangeThreads(options_);
  if (calls->size() <= 1 || threads <= 1 || bytes < 2 * kLaneBytes) {
    return ExchangeOn(calls->data(), calls->size(), op, deadline, any_reused);
  }
  // Calls beyond the threads share a loop: call c runs on thread c % threads.
  const size_t loops = std::min(threads, calls->size());
  std::vector<std::vector<Call>> groups(loops);
  for (size_t c = 0; c < calls->size(); ++c) groups[c % loops].push_back(std::move((*calls)[c]));
  std::vector<Status> status(loops);
  std::vector<char> reused(loops, 0);
  ExchangePool().ParallelFor(loops, [&](size_t g) {
    bool r = false;
    status[g] = ExchangeOn(groups[g].data(), groups[g].size(), op, deadline, &r);
    reused[g] = r;
  });
  // The calls come back in their order: a push whose shard failed over is
  // sent again, and refused frames are found in them.
  for (size_t c = 0; c < calls->size(); ++c) (*calls)[c] = std::move(groups[c % loops][c / loops]);
  *any_reused = std::find(reused.begin(), reused.end(), 1) != reused.end();
  for (const Status& s : status) {
    if (!s.ok()) return s;
  }
  return OkStatus();
}

Status Client::ExchangeOn(Call* calls, size_t count, const char* op, Clock::time_point deadline,
                          bool* any_reused) {
  *any_reused = false;
  for (size_t c = 0; c < count; ++c) {
    if (calls[c].fill) calls[c].fill(calls[c].first_row, calls[c].first_row + calls[c].num_rows);
    calls[c].refused.clear();
  }
  std::vector<Io> io(count);
  auto close_all = [&]() {
    for (Io& x : io) {
      net::CloseFd(x.fd);
      x.fd = -1;
    }
  };
  for (size_t c = 0; c < count; ++c) {
    Call& call = calls[c];
    Conn conn;
    Status s = Acquire(*call.state, &conn, deadline);
    if (!s.ok()) {
      close_all();
      s = UnlessLayoutLeft(*call.state, s.WithContext(Context(*call.state, op)), deadline);
      if (s.code() != Code::kAborted) return s;
      // The shard serves a newer layout: no frame of these calls was sent,
      // so all are refused, to be sent again routed by it.
      for (size_t k = 0; k < count; ++k) {
        calls[k].refused.resize(calls[k].frames.size());
        for (size_t f = 0; f < calls[k].frames.size(); ++f) calls[k].refused[f] = f;
        calls[k].refusal = s;
      }
      return OkStatus();
    }
    io[c].fd = conn.fd;
    io[c].switches = conn.switches;
    io[c].heard = Clock::now();
    io[c].replicated = call.state->HasStandbys();
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
  std::vector<struct pollfd> fds(count);
  size_t remaining = count;
  for (size_t c = 0; c < count; ++c) {
    if (calls[c].frames.empty()) --remaining;
  }
  while (remaining > 0) {
    bool watch = false;  // a shard with standbys owes replies
    for (size_t c = 0; c < count; ++c) {
      const Call& call = calls[c];
      const bool done = io[c].replies == call.frames.size();
      const bool sending = io[c].send_frame < call.frames.size() && io[c].send_error.ok();
      fds[c] = {done ? -1 : io[c].fd, static_cast<short>(POLLIN | (sending ? POLLOUT : 0)), 0};
      watch = watch || (!done && io[c].replicated);
    }
    const int left_ms = net::RemainingMs(deadline);
    const int rc =
        poll(fds.data(), fds.size(), watch ? std::min(left_ms, kSilenceProbeMs) : left_ms);
    if (rc < 0 && errno == EINTR) continue;
    if (watch) {
      // A primary that went silent (gone without a reset, or hung) never
      // closes the connection: a standby that took over is found instead.
      const Clock::time_point now = Clock::now();
      for (size_t c = 0; c < count; ++c) {
        Io& x = io[c];
        if (!x.replicated || x.replies == calls[c].frames.size()) continue;
        if (rc > 0 && fds[c].revents != 0) continue;  // news from it now
        const int64_t silent_ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(now - x.heard).count();
        if (silent_ms < kSilentMs) continue;
        const Status s = CheckSilent(*calls[c].state, x.switches, silent_ms, deadline);
        if (!s.ok()) {
          close_all();
          return s.WithContext(Context(*calls[c].state, op));
        }
      }
      if (rc == 0 && left_ms > 0) continue;
    }
    if (rc <= 0) {
      for (size_t c = 0; c < count; ++c) {
        if (io[c].replies < calls[c].frames.size()) {
          close_all();
          return DeadlineExceeded(Context(*calls[c].state, op) +
                                  ": no reply within the request deadline of " +
                                  std::to_string(options_.request_timeout_ms) + " ms");
        }
      }
    }
    for (size_t c = 0; c < count; ++c) {
      Call& call = calls[c];
      Io& x = io[c];
      if (fds[c].fd < 0 || fds[c].revents == 0) continue;
      auto fail = [&](const Status& s) {
        close_all();
        return s.WithContext(Context(*call.state, op));
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
          if (x.replicated) x.heard = Clock::now();
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
      if (x.replicated) x.heard = Clock::now();
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
        const size_t f = x.frame.request_id - call.first_request_id;
        if (x.frame.opcode == wire::Opcode::kError) {
          const Status error = wire::DecodeError(p, bytes);
          if (error.code() != Code::kAborted) return fail(error);
          // Refused unapplied (a re-shard's switch): the caller sends it again.
          call.refused.push_back(f);
          call.refusal = error.WithContext(Context(*call.state, op));
        }
        x.answered[f] = true;
        if (!x.direct && x.frame.opcode != wire::Opcode::kError) {
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
  for (size_t c = 0; c < count; ++c) {
    Conn conn;
    conn.fd = io[c].fd;
    // The switch it was made at: Release pools it only while that is the
    // shard's (0 would close every connection after a failover or Regreet).
    conn.switches = io[c].switches;
    conn.buffer = std::move(io[c].payload);
    Release(*calls[c].state, std::move(conn));
  }
  return OkStatus();
}

}  // namespace dlt
