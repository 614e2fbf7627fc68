// The data plane under an adversary: idle sockets, oversize and slow frames,
// connection caps, memory bounds, many connections, and peers that send
// malformed replies. Real sockets on loopback, bounded waits.
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "native/core/routing.h"
#include "native/core/shard.h"
#include "native/net/buffer.h"
#include "native/net/client.h"
#include "native/net/client_call.h"
#include "native/net/data_server.h"
#include "native/net/frame_call.h"
#include "native/net/socket.h"
#include "native/net/wire.h"
#include "tests/cpp/harness.h"

namespace dlt {
namespace {

using Clock = std::chrono::steady_clock;

// Table "emb" of `dim` (uniform initializer, the default optimizer).
void CreateEmb(Shard* shard, uint32_t dim) {
  TableConfig c;
  c.name = "emb";
  c.dim = dim;
  c.initializer.kind = InitializerKind::kUniform;
  bool created;
  EXPECT_OK(shard->CreateTable(c, &created));
}

std::shared_ptr<Shard> ShardWithTable(uint32_t dim) {
  auto shard = std::make_shared<Shard>(0, 1);
  CreateEmb(shard.get(), dim);
  return shard;
}

std::string Address(const DataServer& server) {
  return "127.0.0.1:" + std::to_string(server.port());
}

std::string FrameOf(wire::Opcode op, uint64_t id, const std::string& payload) {
  uint8_t header[wire::kHeaderBytes];
  wire::EncodeHeader({op, 0, id, static_cast<uint32_t>(payload.size())}, header);
  return std::string(reinterpret_cast<char*>(header), sizeof(header)) + payload;
}

std::string HelloFrame(const std::string& token = "") {
  wire::HelloRequest hello;
  hello.token = token;
  return FrameOf(wire::Opcode::kHello, 1, wire::EncodeHelloRequest(hello));
}

std::string PullFrame(uint64_t id, uint32_t dim, const std::vector<int64_t>& ids) {
  std::string p =
      wire::EncodePullPrefix("emb", dim, static_cast<uint32_t>(ids.size()), PullMode::kInsert);
  p.append(reinterpret_cast<const char*>(ids.data()), ids.size() * 8);
  return FrameOf(wire::Opcode::kPull, id, p);
}

// A raw socket to a server, closed on destruction.
class Raw {
 public:
  explicit Raw(const std::string& address) {
    EXPECT_OK(net::Connect(address, Clock::now() + std::chrono::seconds(5), &fd_));
  }
  ~Raw() { net::CloseFd(fd_); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  int fd() const { return fd_; }

  Status Send(const std::string& bytes) {
    struct iovec iov = {const_cast<char*>(bytes.data()), bytes.size()};
    return net::SendAll(fd_, &iov, 1, Clock::now() + std::chrono::seconds(5));
  }
  // The next frame: its header and payload.
  Status Read(wire::FrameHeader* header, std::string* payload, int timeout_ms = 5000) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    uint8_t bytes[wire::kHeaderBytes];
    DLT_RETURN_IF_ERROR(net::RecvAll(fd_, bytes, sizeof(bytes), deadline));
    DLT_RETURN_IF_ERROR(wire::DecodeHeader(bytes, UINT32_MAX, header));
    payload->assign(header->payload_bytes, '\0');
    return net::RecvAll(fd_, &(*payload)[0], payload->size(), deadline);
  }
  Status Greet(const std::string& token = "") {
    DLT_RETURN_IF_ERROR(Send(HelloFrame(token)));
    wire::FrameHeader h;
    std::string payload;
    DLT_RETURN_IF_ERROR(Read(&h, &payload));
    if (h.opcode != wire::Opcode::kHello) {
      return wire::DecodeError(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
    }
    return OkStatus();
  }
  // True once the peer has closed (end of stream or reset) within the time.
  bool ClosedByPeer(int timeout_ms) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    char buf[4096];
    while (Clock::now() < deadline) {
      struct pollfd p = {fd_, POLLIN, 0};
      if (poll(&p, 1, net::RemainingMs(deadline)) <= 0) continue;
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
};

bool WaitFor(const std::function<bool()>& done, int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

std::vector<int64_t> Iota(size_t n) {
  std::vector<int64_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(i);
  return ids;
}

// Sockets that never say a word used to hold the server's threads: 4x the
// old cap of 64 of them now only push each other out, and a trainer still
// connects and pulls at once.
DLT_TEST(TestIdleSocketsCannotLockOutATrainer) {
  auto shard = ShardWithTable(8);
  DataServerOptions o;
  o.max_unauthenticated = 16;
  o.hello_timeout_ms = 60000;  // the cap, not the deadline, is what is tested
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  std::vector<std::unique_ptr<Raw>> idle;
  for (int i = 0; i < 256; ++i) idle.push_back(std::make_unique<Raw>(Address(server)));
  EXPECT(WaitFor([&] { return server.counters().connections_evicted.load() >= 240; }, 10000));
  ClientOptions co;
  co.connect_timeout_ms = 1000;
  co.request_timeout_ms = 1000;
  Client client({Address(server)}, co);
  const std::vector<int64_t> ids = Iota(100);
  std::vector<float> out(100 * 8);
  EXPECT_OK(client.Pull("emb", 8, ids.data(), ids.size(), PullMode::kInsert, out.data()));
  EXPECT(server.counters().connections_open.load() <= 16 + 2);
}

DLT_TEST(TestHelloDeadlineClosesSilentSockets) {
  auto shard = ShardWithTable(8);
  DataServerOptions o;
  o.hello_timeout_ms = 200;
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  std::vector<std::unique_ptr<Raw>> idle;
  for (int i = 0; i < 5; ++i) idle.push_back(std::make_unique<Raw>(Address(server)));
  for (auto& r : idle) EXPECT(r->ClosedByPeer(5000));
  EXPECT(server.counters().hello_timeouts.load() == 5);
  // One that greets in time stays.
  Raw greeted(Address(server));
  EXPECT_OK(greeted.Greet());
  EXPECT(!greeted.ClosedByPeer(500));
}

// Before the Hello nothing larger than a Hello is read: an oversize frame
// is refused from its header, without allocating its body.
DLT_TEST(TestNothingLargerThanAHelloBeforeHello) {
  auto shard = ShardWithTable(8);
  DataServerOptions o;
  o.auth_token = "secret";
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  {
    Raw r(Address(server));
    uint8_t header[wire::kHeaderBytes];
    wire::EncodeHeader({wire::Opcode::kHello, 0, 1, 64u << 20}, header);
    EXPECT_OK(r.Send(std::string(reinterpret_cast<char*>(header), sizeof(header))));
    wire::FrameHeader h;
    std::string payload;
    EXPECT_OK(r.Read(&h, &payload));
    const Status s =
        wire::DecodeError(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
    EXPECT(h.opcode == wire::Opcode::kError && s.code() == Code::kInvalidArgument);
    EXPECT(s.message().find("exceeds the 4104 bytes a Hello may have") != std::string::npos);
    EXPECT(r.ClosedByPeer(2000));
    EXPECT(server.counters().buffered_bytes.load() == 0);
  }
  {
    Raw r(Address(server));  // a Pull before the Hello
    EXPECT_OK(r.Send(PullFrame(7, 8, {1, 2})));
    wire::FrameHeader h;
    std::string payload;
    EXPECT_OK(r.Read(&h, &payload));
    EXPECT(h.request_id == 7 && h.opcode == wire::Opcode::kError);
    EXPECT(wire::DecodeError(reinterpret_cast<const uint8_t*>(payload.data()), payload.size())
               .code() == Code::kUnauthenticated);
    EXPECT(r.ClosedByPeer(2000));
  }
  {
    Raw r(Address(server));  // the wrong token
    EXPECT(r.Greet("wrong").code() == Code::kUnauthenticated);
    EXPECT(r.ClosedByPeer(2000));
  }
}

DLT_TEST(TestConnectionCapRefusesThenRetriedHelloGetsIn) {
  auto shard = ShardWithTable(8);
  DataServerOptions o;
  o.max_connections = 2;
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  EXPECT(server.max_connections() == 2);
  auto a = std::make_unique<Raw>(Address(server));
  Raw b(Address(server));
  EXPECT_OK(a->Greet());
  EXPECT_OK(b.Greet());
  const std::vector<int64_t> ids = Iota(4);
  std::vector<float> out(4 * 8);
  ClientOptions quick;
  quick.connect_timeout_ms = 300;
  Client refused({Address(server)}, quick);
  const Status s = refused.Pull("emb", 8, ids.data(), 4, PullMode::kInsert, out.data());
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find("limit of 2 connections") != std::string::npos);
  EXPECT(server.counters().connections_refused.load() >= 2);  // retried before giving up
  // A slot frees while a patient client retries its Hello with backoff.
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    a.reset();
  });
  ClientOptions patient;
  patient.connect_timeout_ms = 5000;
  Client later({Address(server)}, patient);
  EXPECT_OK(later.Pull("emb", 8, ids.data(), 4, PullMode::kInsert, out.data()));
  release.join();
}

DLT_TEST(TestIdleAndSlowConnectionsAreClosed) {
  auto shard = ShardWithTable(8);
  DataServerOptions o;
  o.idle_timeout_ms = 200;
  o.io_timeout_ms = 300;
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  Raw idle(Address(server));
  EXPECT_OK(idle.Greet());
  EXPECT(idle.ClosedByPeer(5000));
  EXPECT(server.counters().idle_timeouts.load() == 1);
  Raw slow(Address(server));  // a slow writer: 30 bytes of a frame, then nothing
  EXPECT_OK(slow.Greet());
  EXPECT_OK(slow.Send(PullFrame(2, 8, Iota(16)).substr(0, 30)));
  EXPECT(slow.ClosedByPeer(5000));
  EXPECT(server.counters().io_timeouts.load() == 1);
  // A slow reader: a 4 MiB reply it never reads is dropped after io_timeout
  // while other connections are served.
  Raw reader(Address(server));
  EXPECT_OK(reader.Greet());
  int small = 4096;
  setsockopt(reader.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  EXPECT_OK(reader.Send(PullFrame(3, 8, Iota(131072))));
  Client client({Address(server)}, ClientOptions());
  const std::vector<int64_t> ids = Iota(64);
  std::vector<float> out(64 * 8);
  EXPECT_OK(client.Pull("emb", 8, ids.data(), ids.size(), PullMode::kInsert, out.data()));
  EXPECT(WaitFor([&] { return server.counters().io_timeouts.load() == 2; }, 5000));
  EXPECT(WaitFor([&] { return server.counters().buffered_bytes.load() == 0; }, 2000));
}

// A standby that acknowledges each write after `delay_ms`.
class SlowStandby : public WriteListener {
 public:
  explicit SlowStandby(int delay_ms) : delay_ms_(delay_ms) {}
  uint64_t Applied() override { return 1; }
  Status Written(uint64_t) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    return OkStatus();
  }

 private:
  const int delay_ms_;
};

DLT_TEST(TestAFrameServedLongerThanTheIoTimeoutIsAnswered) {
  // The I/O timeout bounds a frame's arrival and its reply's departure, not
  // the time the shard takes to serve it (a push waiting for its standby, or
  // for the memory keeper): the reaper closed such a connection while its
  // push was being applied, so the push was applied and its peer told the
  // connection was lost.
  auto shard = ShardWithTable(8);
  DataServerOptions o;
  o.io_timeout_ms = 300;
  DataServer server(shard, o);
  server.set_write_listener(std::make_shared<SlowStandby>(1000));
  EXPECT_OK(server.Start());
  Raw r(Address(server));
  EXPECT_OK(r.Greet());
  const std::vector<int64_t> ids = Iota(4);
  const std::vector<float> grads(4 * 8, 0.5f);
  std::string push = wire::EncodePushPrefix("emb", 8, 4, 0.1f);
  push.append(reinterpret_cast<const char*>(ids.data()), ids.size() * 8);
  push.append(reinterpret_cast<const char*>(grads.data()), grads.size() * 4);
  EXPECT_OK(r.Send(FrameOf(wire::Opcode::kPush, 9, push)));
  wire::FrameHeader h;
  std::string payload;
  EXPECT_OK(r.Read(&h, &payload, 5000));
  EXPECT(h.opcode == wire::Opcode::kPush && h.request_id == 9);
  EXPECT(server.counters().io_timeouts.load() == 0);
  // Its I/O time runs again for the next frame.
  EXPECT_OK(r.Send(PullFrame(10, 8, Iota(16)).substr(0, 30)));
  EXPECT(r.ClosedByPeer(5000));
  EXPECT(server.counters().io_timeouts.load() == 1);
}

DLT_TEST(TestAHelloReplyOfTheLongestStandbysAndLayoutIsTaken) {
  // A Hello's reply may carry standbys and a layout of their largest sizes,
  // and the lineage after them: the bound a client read it within left the
  // lineage out, so such a shard was refused by every client (INTERNAL:
  // "reply of 69688 bytes exceeds 69680").
  auto shard = ShardWithTable(8);
  const std::string layout(wire::kMaxLayoutBytes, 'l'), standbys(wire::kMaxStandbysBytes, 's');
  shard->RevertLayout(2, layout);  // none to go back to: the layout is taken all the same
  DataServer server(shard, DataServerOptions());
  server.set_standbys(standbys);
  EXPECT_OK(server.Start());
  int fd = -1;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  EXPECT_OK(net::Connect(Address(server), deadline, &fd));
  wire::HelloReply reply;
  EXPECT_OK(net::SayHello(fd, "", wire::kFlagTopology, 1, deadline, &reply));
  EXPECT(reply.layout == layout && reply.standbys == standbys && reply.lineage != 0);
  net::CloseFd(fd);
}

DLT_TEST(TestPipelinedFramesAreAnsweredInOrder) {
  auto shard = ShardWithTable(4);
  DataServer server(shard, DataServerOptions());
  EXPECT_OK(server.Start());
  Raw r(Address(server));
  EXPECT_OK(r.Greet());
  std::string frames;
  for (uint64_t id = 10; id < 20; ++id) frames += PullFrame(id, 4, Iota(id));
  EXPECT_OK(r.Send(frames));
  for (uint64_t id = 10; id < 20; ++id) {
    wire::FrameHeader h;
    std::string payload;
    EXPECT_OK(r.Read(&h, &payload));
    EXPECT(h.request_id == id && h.opcode == wire::Opcode::kPull);
    EXPECT(payload.size() == wire::kPullReplyFixed + 16 * id);
  }
}

// Past max_buffered_bytes connections wait their turn instead of failing,
// and every byte is given back.
DLT_TEST(TestMemoryBoundMakesConnectionsWaitNotFail) {
  auto shard = ShardWithTable(16);
  DataServerOptions o;
  o.max_buffered_bytes = 256 << 10;
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      Client client({Address(server)}, ClientOptions());
      std::vector<int64_t> ids = Iota(20000);
      for (auto& id : ids) id += t * 100000;
      std::vector<float> out(ids.size() * 16), grads(ids.size() * 16, 0.01f);
      for (int round = 0; round < 5; ++round) {
        if (!client.Pull("emb", 16, ids.data(), ids.size(), PullMode::kInsert, out.data()).ok() ||
            !client.Push("emb", 16, ids.data(), grads.data(), ids.size(), 0.1f).ok()) {
          failures.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT(failures.load() == 0);
  EXPECT(server.counters().memory_waits.load() > 0);
  EXPECT(WaitFor([&] { return server.counters().buffered_bytes.load() == 0; }, 2000));
  EXPECT(server.counters().connections_waiting.load() == 0);
}

// A server whose buffer (256 KiB) a connection can fill with one frame, and
// two greeted connections to it.
struct SmallBufferServer {
  explicit SmallBufferServer(int io_timeout_ms)
      : server(ShardWithTable(16), Options(io_timeout_ms)),
        holder(Started(server)),
        other(Address(server)) {
    EXPECT_OK(holder.Greet());
    EXPECT_OK(other.Greet());
  }
  static std::string Started(DataServer& server) {
    EXPECT_OK(server.Start());
    return Address(server);
  }
  static DataServerOptions Options(int io_timeout_ms) {
    DataServerOptions o;
    o.max_buffered_bytes = 256 << 10;
    o.io_timeout_ms = io_timeout_ms;
    return o;
  }
  // `holder` takes 250 KiB of the 256 (its frame's payload never comes).
  void Hold() {
    const std::string held = FrameOf(wire::Opcode::kPush, 7, std::string(250 << 10, '\0'));
    EXPECT_OK(holder.Send(held.substr(0, wire::kHeaderBytes + 16)));
    EXPECT(WaitFor([&] { return server.counters().buffered_bytes.load() >= (250u << 10); }, 5000));
  }
  DataServer server;
  Raw holder, other;
};

DLT_TEST(TestAFrameReadWholeBeforeItsMemoryWaitIsServedWhenWoken) {
  // A frame whose every byte came with its head (an empty Push) waits for
  // memory behind a large one; woken, it must be served at once: no more
  // bytes will arrive to wake it, and the connections behind it wait on it
  // (it was left until the I/O timeout closed it, unanswered).
  SmallBufferServer s(60000);
  s.Hold();
  EXPECT_OK(s.other.Send(FrameOf(wire::Opcode::kPush, 8, "")));
  EXPECT(WaitFor([&] { return s.server.counters().connections_waiting.load() == 1; }, 5000));
  shutdown(s.holder.fd(), SHUT_RDWR);  // gone: its memory is given back
  wire::FrameHeader h;
  std::string payload;
  EXPECT_OK(s.other.Read(&h, &payload, 10000));
  EXPECT(h.opcode == wire::Opcode::kError && h.request_id == 8);
  EXPECT(s.server.counters().connections_waiting.load() == 0);
}

DLT_TEST(TestAFrameWaitingForMemoryKeepsItsIoTimeUntilWoken) {
  // A frame's I/O deadline stops while it waits for memory: it was kept,
  // so a frame queued behind one that held the memory for most of an I/O
  // timeout was closed unanswered before its turn came.
  SmallBufferServer s(3000);
  const std::string frame = FrameOf(wire::Opcode::kPush, 8, "");
  EXPECT_OK(s.other.Send(frame.substr(0, 1)));  // its frame's I/O time starts: t = 0
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  s.Hold();                                  // until its own I/O deadline (t = 4 s)
  EXPECT_OK(s.other.Send(frame.substr(1)));  // waits from t = 1 s, past its old deadline (3 s)
  EXPECT(WaitFor([&] { return s.server.counters().connections_waiting.load() == 1; }, 1500));
  wire::FrameHeader h;
  std::string payload;
  EXPECT_OK(s.other.Read(&h, &payload, 10000));
  EXPECT(h.opcode == wire::Opcode::kError && h.request_id == 8);
  EXPECT(s.server.counters().io_timeouts.load() == 1);  // the holder's alone
}

DLT_TEST(TestTwoThousandConnectionsServedAtOnce) {
  auto shard = ShardWithTable(4);
  DataServerOptions o;
  o.worker_threads = 2;
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  std::vector<std::unique_ptr<Raw>> conns;
  for (int i = 0; i < 2000; ++i) {
    conns.push_back(std::make_unique<Raw>(Address(server)));
    EXPECT_OK(conns.back()->Send(HelloFrame()));
  }
  for (size_t i = 0; i < conns.size(); ++i) {
    EXPECT_OK(conns[i]->Send(PullFrame(2, 4, {static_cast<int64_t>(i), -1})));
  }
  int answered = 0;
  for (auto& c : conns) {
    wire::FrameHeader h;
    std::string payload;
    bool ok = c->Read(&h, &payload).ok() && h.opcode == wire::Opcode::kHello;
    ok = ok && c->Read(&h, &payload).ok() && h.opcode == wire::Opcode::kPull;
    answered += ok;
  }
  EXPECT(answered == 2000);
  EXPECT(server.counters().connections_authenticated.load() == 2000);
}

// A stand-in shard that greets correctly, then answers the first
// `requests` requests with whatever `reply` builds from each header and
// payload; with `trickle`, a few bytes at a time (1 to 7, a slow writer),
// with `chunk`, in writes of that many bytes.
class FakeShard {
 public:
  using Reply = std::function<std::string(const wire::FrameHeader&, const std::string&)>;
  explicit FakeShard(Reply reply, bool trickle = false, int requests = 1, size_t chunk = 0)
      : reply_(std::move(reply)), trickle_(trickle), requests_(requests), chunk_(chunk) {
    EXPECT_OK(net::Listen("127.0.0.1", 0, 4, &listen_fd_, &port_));
    thread_ = std::thread([this] { Run(); });
  }
  ~FakeShard() {
    thread_.join();
    net::CloseFd(listen_fd_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  void Run() {
    struct pollfd p = {listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 5000) <= 0) return;
    const int fd = accept(listen_fd_, nullptr, nullptr);
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    for (int frame = 0; frame < 1 + requests_; ++frame) {
      uint8_t bytes[wire::kHeaderBytes];
      wire::FrameHeader h;
      if (!net::RecvAll(fd, bytes, sizeof(bytes), deadline).ok()) break;
      (void)wire::DecodeHeader(bytes, UINT32_MAX, &h);
      std::string payload(h.payload_bytes, '\0');
      if (!net::RecvAll(fd, &payload[0], payload.size(), deadline).ok()) break;
      std::string out;
      if (frame == 0) {
        wire::HelloReply hello;
        hello.num_shards = 1;
        hello.num_buckets = kNumBuckets;
        hello.max_frame_bytes = 1 << 20;
        const std::string body = wire::EncodeHelloReply(hello, /*topology=*/true);
        uint8_t header[wire::kHeaderBytes];
        wire::EncodeHeader({wire::Opcode::kHello, wire::kFlagResponse, h.request_id,
                            static_cast<uint32_t>(body.size())},
                           header);
        out = std::string(reinterpret_cast<char*>(header), sizeof(header)) + body;
      } else {
        out = reply_(h, payload);
      }
      for (size_t at = 0, step = 1; at < out.size(); at += step, step = step % 7 + 1) {
        if (!trickle_) step = chunk_ > 0 ? chunk_ : out.size();
        struct iovec iov = {&out[at], std::min(step, out.size() - at)};
        if (!net::SendAll(fd, &iov, 1, deadline).ok()) break;
        if (trickle_) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    // Hold the connection briefly so the client reads what was sent.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    close(fd);
  }

  Reply reply_;
  bool trickle_ = false;
  int requests_ = 1;
  size_t chunk_ = 0;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

std::string ReplyHeader(wire::Opcode op, uint64_t id, uint32_t payload_bytes) {
  uint8_t header[wire::kHeaderBytes];
  wire::EncodeHeader({op, wire::kFlagResponse, id, payload_bytes}, header);
  return std::string(reinterpret_cast<char*>(header), sizeof(header));
}

// A reply's size is checked against what its request expects before a
// byte of it is read: an empty Pull reply (once a null dereference) and a
// header claiming 4 GiB both fail cleanly.
DLT_TEST(TestServerReservesAStatePullsWholeReply) {
  // A state pull's reply is reserved before the table is known, at 2 slots
  // per value; past the frame limit at that width it may still fit (SGD
  // keeps none), and was reserved as an error's few KB: replies of up to a
  // frame each, held past --max-buffered-bytes.
  ServerCounters counters;
  constexpr uint32_t kDim = 1024, kIds = 10000, kMaxFrame = 64u << 20;
  RequestHandler handler(ShardWithTable(kDim), "", kMaxFrame, &counters);
  wire::FrameHeader header{wire::Opcode::kPull, 0, 1, 0};
  uint8_t sizes[12] = {};
  std::memcpy(sizes, &kDim, 4);
  std::memcpy(sizes + 4, &kIds, 4);
  sizes[10] = static_cast<uint8_t>(PullMode::kState);
  const size_t real = wire::kHeaderBytes + wire::kPullReplyFixed +
                      size_t{4} * StateFloats(kDim, 0) * kIds;  // SGD: no slots
  EXPECT(real <= wire::kHeaderBytes + size_t{kMaxFrame});
  EXPECT(handler.ReplyBound(header, sizes) >= real);
}

DLT_TEST(TestClientBoundsReplySizes) {
  const std::vector<int64_t> ids = Iota(4);
  std::vector<float> out(4 * 8);
  ClientOptions o;
  o.request_timeout_ms = 2000;
  o.pull_retries = 0;
  {
    FakeShard fake([](const wire::FrameHeader& h, const std::string&) {
      return ReplyHeader(wire::Opcode::kPull, h.request_id, 0);
    });
    Client client({fake.address()}, o);
    const Status s = client.Pull("emb", 8, ids.data(), 4, PullMode::kInsert, out.data());
    EXPECT(s.code() == Code::kInternal);
    EXPECT(s.message().find("reply of 0 bytes; the request expects 136") != std::string::npos);
  }
  {
    FakeShard fake([](const wire::FrameHeader& h, const std::string&) {
      return ReplyHeader(wire::Opcode::kPull, h.request_id, UINT32_MAX);
    });
    Client client({fake.address()}, o);
    const Status s = client.Pull("emb", 8, ids.data(), 4, PullMode::kInsert, out.data());
    EXPECT(s.code() == Code::kInternal && s.message().find("4294967295") != std::string::npos);
  }
  {
    FakeShard fake([](const wire::FrameHeader& h, const std::string&) {
      return ReplyHeader(wire::Opcode::kError, h.request_id, 1u << 20);
    });
    Client client({fake.address()}, o);
    const Status s = client.Pull("emb", 8, ids.data(), 4, PullMode::kInsert, out.data());
    EXPECT(s.code() == Code::kInternal && s.message().find("largest error") != std::string::npos);
  }
  for (const Code code : {Code::kAborted, Code::kNotFound}) {
    // An error naming a request id the client never used says the stream
    // is out of step: a refusal (ABORTED: sent again) is not taken as the
    // refusal of a frame past its calls', nor another error as the call's.
    FakeShard fake([code](const wire::FrameHeader& h, const std::string&) {
      const std::string body = wire::EncodeError(code, "switched, or no table 'emb'");
      return ReplyHeader(wire::Opcode::kError, h.request_id + 1000,
                         static_cast<uint32_t>(body.size())) +
             body;
    });
    Client client({fake.address()}, o);
    const Status s = client.Pull("emb", 8, ids.data(), 4, PullMode::kInsert, out.data());
    EXPECT(s.code() == Code::kInternal &&
           s.message().find("unknown request id") != std::string::npos);
  }
  {
    // The same for one frame's call (a Hello, a replica's round).
    int fds[2];
    EXPECT(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    const std::string body = wire::EncodeError(Code::kNotFound, "no table 'emb'");
    const std::string reply =
        ReplyHeader(wire::Opcode::kError, 8, static_cast<uint32_t>(body.size())) + body;
    EXPECT(write(fds[1], reply.data(), reply.size()) == static_cast<ssize_t>(reply.size()));
    std::string got;
    const Status s = net::ReceiveReply(fds[0], wire::Opcode::kPull, 7, 1 << 20,
                                       Clock::now() + std::chrono::seconds(5), &got, nullptr);
    EXPECT(s.code() == Code::kInternal &&
           s.message().find("expected the reply to request 7") != std::string::npos);
    close(fds[0]);
    close(fds[1]);
  }
}

DLT_TEST(TestAFramePastItsLimitIsRefusedBeforeAnythingIsSent) {
  // A frame's header holds its length in 32 bits: a payload over 4 GiB (or
  // past the peer's frame limit) is refused with RESOURCE_EXHAUSTED before
  // a byte goes, never sent with its length cut (the peer read the rest of
  // the payload as frames of their own).
  int fds[2];
  EXPECT(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds) == 0);  // as connections are
  auto nothing_arrived = [&]() {
    char byte;
    return recv(fds[1], &byte, 1, MSG_DONTWAIT) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  };
  // Zero pages, never touched: 4 GiB and 16 bytes of address space, not memory.
  const size_t huge = (size_t{1} << 32) + 16;
  void* payload =
      mmap(nullptr, huge, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  EXPECT(payload != MAP_FAILED);
  const auto deadline = Clock::now() + std::chrono::milliseconds(300);
  Status s = net::SendFrame(fds[0], wire::Opcode::kReplicate, 1, payload, huge, deadline);
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find("4294967312 bytes") != std::string::npos &&
         s.message().find("nothing sent") != std::string::npos);
  EXPECT(nothing_arrived());
  // Past the peer's limit: refused at once, the call waiting for no reply.
  const std::string body(5000, 'x');
  s = net::SendFrame(fds[0], wire::Opcode::kReplicate, 2, body.data(), body.size(), deadline, 0,
                     4096);
  EXPECT(s.code() == Code::kResourceExhausted &&
         s.message().find("frame limit of 4096 bytes") != std::string::npos);
  EXPECT(nothing_arrived());
  std::string reply;
  const auto began = Clock::now();
  s = net::CallFrame(fds[0], wire::Opcode::kStandbyTable, 3, body.data(), body.size(), 64,
                     Clock::now() + std::chrono::seconds(5), &reply, 0, 4096);
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(Clock::now() - began < std::chrono::seconds(2));
  EXPECT(nothing_arrived());
  // Within it: sent whole.
  EXPECT_OK(
      net::SendFrame(fds[0], wire::Opcode::kReplicate, 4, body.data(), 4096, deadline, 0, 4096));
  std::string got(wire::kHeaderBytes + 4096, '\0');
  EXPECT_OK(net::RecvAll(fds[1], &got[0], got.size(), Clock::now() + std::chrono::seconds(5)));
  wire::FrameHeader h;
  EXPECT_OK(wire::DecodeHeader(reinterpret_cast<const uint8_t*>(got.data()), 4096, &h));
  EXPECT(h.request_id == 4 && h.payload_bytes == 4096);
  munmap(payload, huge);
  close(fds[0]);
  close(fds[1]);
}

// A "shard" that accepts connections and never answers on them (a hung
// process): on 127.0.0.1, port 0.
struct SilentPeer {
  int listener = -1;
  int port = 0;
  std::atomic<bool> stop{false};
  std::vector<int> accepted;  // the accepting thread's, until it is joined
  std::thread acceptor;
  SilentPeer() {
    EXPECT_OK(net::Listen("127.0.0.1", 0, 16, &listener, &port));
    acceptor = std::thread([this] {
      while (!stop.load()) {
        pollfd p{listener, POLLIN, 0};
        if (poll(&p, 1, 20) <= 0) continue;
        const int fd = accept(listener, nullptr, nullptr);
        if (fd >= 0) accepted.push_back(fd);
      }
    });
  }
  ~SilentPeer() {
    stop.store(true);
    acceptor.join();
    for (const int fd : accepted) close(fd);
    net::CloseFd(listener);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

DLT_TEST(TestConnectingToAPeerThatNeverAnswersEndsByTheRequestsDeadline) {
  // A shard (or every shard asked for a layout) that accepts and never
  // says Hello costs a call its request deadline, not the connect timeout
  // per connection and address: the call ends UNAVAILABLE by then.
  ClientOptions o;
  o.connect_timeout_ms = 8000;
  o.request_timeout_ms = 500;
  const auto late = std::chrono::milliseconds(o.request_timeout_ms + 1500);
  std::vector<int64_t> ids = {1, 2, 3};
  std::vector<float> out(3 * 4);
  {
    SilentPeer peer;
    Client client({peer.address()}, o);
    auto began = Clock::now();
    Status s = client.Pull("emb", 4, ids.data(), ids.size(), PullMode::kInsert, out.data());
    EXPECT(s.code() == Code::kUnavailable || s.code() == Code::kDeadlineExceeded);
    EXPECT(Clock::now() - began < late);
    std::vector<float> grads(3 * 4, 0.5f);
    began = Clock::now();
    s = client.Push("emb", 4, ids.data(), grads.data(), ids.size(), 0.1f);
    EXPECT(s.code() == Code::kUnavailable || s.code() == Code::kDeadlineExceeded);
    EXPECT(Clock::now() - began < late);
    std::vector<ShardInfo> infos;
    began = Clock::now();
    s = client.GetShardInfos(&infos);
    EXPECT(s.code() == Code::kUnavailable || s.code() == Code::kDeadlineExceeded);
    EXPECT(Clock::now() - began < late);
  }
  {
    // Learning a layout asks every address: each silent one cost up to
    // kAskLayoutMs, past the request's deadline.
    SilentPeer a, b, c, d;
    Client client({a.address(), b.address(), c.address(), d.address()}, o);
    const auto began = Clock::now();
    EXPECT(!client.LearnNewerLayout());
    EXPECT(Clock::now() - began < late);
  }
  {
    // A shard not reached makes a call look for a newer layout at the
    // other shards' addresses: each silent one cost kAskLayoutMs past the
    // request's deadline (4 s here).
    int gone = -1, gone_port = 0;
    EXPECT_OK(net::Listen("127.0.0.1", 0, 1, &gone, &gone_port));
    net::CloseFd(gone);  // connections to it are refused
    SilentPeer a, b, c, d;
    Client client({"127.0.0.1:" + std::to_string(gone_port),
                   a.address() + "|" + b.address() + "|" + c.address() + "|" + d.address()},
                  o);
    const auto began = Clock::now();
    const Status s = client.Pull("emb", 4, ids.data(), ids.size(), PullMode::kInsert, out.data());
    EXPECT(s.code() == Code::kUnavailable || s.code() == Code::kDeadlineExceeded);
    EXPECT(Clock::now() - began < late);
  }
}

// A Pull reply of rows whose values name their id (id + k / 8 for float k).
std::string RowsReply(const wire::FrameHeader& h, const std::string& payload, uint32_t dim) {
  wire::TableRequest request;
  EXPECT_OK(wire::DecodePullRequest(reinterpret_cast<const uint8_t*>(payload.data()),
                                    payload.size(), &request));
  std::string body(wire::kPullReplyFixed + sizeof(float) * dim * request.num_ids, '\0');
  wire::EncodePullReplyPrefix(dim, request.num_ids, reinterpret_cast<uint8_t*>(&body[0]));
  for (uint32_t i = 0; i < request.num_ids; ++i) {
    for (uint32_t k = 0; k < dim; ++k) {
      const float v = static_cast<float>(request.ids[i]) + static_cast<float>(k) / 8;
      std::memcpy(&body[wire::kPullReplyFixed + sizeof(float) * (size_t{i} * dim + k)], &v, 4);
    }
  }
  return ReplyHeader(wire::Opcode::kPull, h.request_id, static_cast<uint32_t>(body.size())) + body;
}

// Rows from a slow writer (rows and the reply's fixed part split across
// reads at every offset), staged and copied to their places: each distinct
// id is asked once, its row lands at its first position and is copied to
// its repeats, and nothing past the output is written. A reply naming the
// wrong dim is refused before a row of it is placed.
DLT_TEST(TestPullRepliesTrickledToTheirPlaces) {
  const uint32_t dim = 3;
  const std::vector<int64_t> ids = {5, 9, 5, 7, 9, 5, 11};
  const size_t guard = 16;
  ClientOptions o;
  o.request_timeout_ms = 5000;
  o.pull_retries = 0;
  std::vector<float> out(ids.size() * dim + guard, -1.0f);
  uint32_t asked = 0;
  {
    FakeShard fake(
        [&asked](const wire::FrameHeader& h, const std::string& payload) {
          wire::TableRequest request;
          if (wire::DecodePullRequest(reinterpret_cast<const uint8_t*>(payload.data()),
                                      payload.size(), &request)
                  .ok()) {
            asked = request.num_ids;
          }
          return RowsReply(h, payload, dim);
        },
        /*trickle=*/true);
    Client client({fake.address()}, o);
    size_t sent = 0;
    EXPECT_OK(client.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, out.data(),
                          /*dedup=*/true, &sent));
    EXPECT(sent == 4);
  }
  EXPECT(asked == 4);  // the fake's thread has ended
  for (size_t i = 0; i < ids.size(); ++i) {
    for (uint32_t k = 0; k < dim; ++k) {
      EXPECT(out[i * dim + k] == static_cast<float>(ids[i]) + static_cast<float>(k) / 8);
    }
  }
  for (size_t g = ids.size() * dim; g < out.size(); ++g) EXPECT(out[g] == -1.0f);

  std::fill(out.begin(), out.end(), -1.0f);
  {
    FakeShard fake(
        [](const wire::FrameHeader& h, const std::string& payload) {
          std::string reply = RowsReply(h, payload, dim);
          const uint32_t wrong = dim + 1;  // same size, wrong dim named
          std::memcpy(&reply[wire::kHeaderBytes], &wrong, 4);
          return reply;
        },
        /*trickle=*/true);
    Client client({fake.address()}, o);
    const Status s = client.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, out.data());
    EXPECT(s.code() == Code::kInternal);
    EXPECT(s.message().find("names dim 4") != std::string::npos);
  }
  for (float v : out) EXPECT(v == -1.0f);
}

// Replies of many frames, each several times the client's staging buffer,
// written in odd chunks: reads end inside rows and fill the stage, and the
// rows of every frame land in place (with repeats copied).
DLT_TEST(TestPullRepliesLargerThanTheStage) {
  const uint32_t dim = 256;  // 1 KiB rows: the stage holds 256
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 1200; ++i) ids.push_back(i % 900 * 3);  // 900 distinct
  const size_t guard = 64;
  std::vector<float> out(ids.size() * dim + guard, -1.0f);
  ClientOptions o;
  o.request_timeout_ms = 10000;
  o.pull_retries = 0;
  o.frame_bytes = 512u << 10;  // about 510 rows a frame: 2 frames
  {
    FakeShard fake([](const wire::FrameHeader& h,
                      const std::string& payload) { return RowsReply(h, payload, dim); },
                   /*trickle=*/false, /*requests=*/2, /*chunk=*/4099);
    Client client({fake.address()}, o);
    size_t sent = 0;
    EXPECT_OK(client.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, out.data(),
                          /*dedup=*/true, &sent));
    EXPECT(sent == 900);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    for (uint32_t k = 0; k < dim; k += 51) {
      EXPECT(out[i * dim + k] == static_cast<float>(ids[i]) + static_cast<float>(k) / 8);
    }
  }
  for (size_t g = ids.size() * dim; g < out.size(); ++g) EXPECT(out[g] == -1.0f);
}

// Two shards (of two) serving on loopback, each given its tables by `tables`.
struct TwoShards {
  std::vector<std::shared_ptr<Shard>> shards;
  std::vector<std::unique_ptr<DataServer>> servers;
  std::vector<std::string> addresses;
  explicit TwoShards(const std::function<void(Shard*)>& tables) {
    for (uint32_t i = 0; i < 2; ++i) {
      shards.push_back(std::make_shared<Shard>(i, 2));
      tables(shards.back().get());
      servers.push_back(std::make_unique<DataServer>(shards.back(), DataServerOptions()));
      EXPECT_OK(servers.back()->Start());
      addresses.push_back(Address(*servers.back()));
    }
  }
};

// A pull into a large 64-byte-aligned output (as TensorFlow allocates it)
// places its rows with non-temporal stores: every row, repeats included,
// lands as an ordinary placement puts it, from one exchange thread or
// several, and nothing past the output is written.
DLT_TEST(TestLargePullsStreamedToTheirPlacesExactly) {
  const uint32_t dim = 64;
  const TwoShards cluster([&](Shard* shard) { CreateEmb(shard, dim); });
  const std::vector<std::string>& addresses = cluster.addresses;
  // 40,000 ids of 25,000 distinct: 10 MB of rows, scattered over 2 shards.
  std::vector<int64_t> ids(40000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 7919) % 25000) - 9000;
  const size_t floats = ids.size() * dim, guard = 64;
  float* aligned = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * (floats + guard)));
  std::vector<float> plain(floats + guard + 4, -1.0f);
  float* unaligned = plain.data() + (reinterpret_cast<uintptr_t>(plain.data()) % 64 == 0 ? 4 : 0);
  EXPECT(StreamsPulledRows(aligned, dim, ids.size()));
  EXPECT(!StreamsPulledRows(unaligned, dim, ids.size()));
  EXPECT(!StreamsPulledRows(aligned, 24, ids.size()));  // rows of partial lines
  EXPECT(!StreamsPulledRows(aligned, dim, 1000));       // small enough to stay in cache
  for (const int threads : {1, 4}) {
    ClientOptions o;
    o.exchange_threads = threads;
    Client client(addresses, o);
    std::fill(aligned, aligned + floats + guard, -1.0f);
    std::fill(plain.begin(), plain.end(), -1.0f);
    size_t sent = 0;
    EXPECT_OK(client.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, unaligned, true));
    EXPECT_OK(
        client.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, aligned, true, &sent));
    EXPECT(sent == 25000);
    EXPECT(std::memcmp(aligned, unaligned, sizeof(float) * floats) == 0);
    EXPECT(std::count(aligned + floats, aligned + floats + guard, -1.0f) ==
           static_cast<std::ptrdiff_t>(guard));
    // Uniform rows are not zero: each row arrived.
    size_t zero_rows = 0;
    for (size_t r = 0; r < ids.size(); ++r) {
      zero_rows += std::all_of(aligned + r * dim, aligned + (r + 1) * dim,
                               [](float v) { return v == 0.0f; });
    }
    EXPECT(zero_rows == 0);
  }
  std::free(aligned);
}

// A pooled connection the server closed while idle is noticed before use,
// so a push (never retried) does not fail on it.
DLT_TEST(TestPooledConnectionClosedByTheServerIsNotUsed) {
  auto shard = ShardWithTable(8);
  DataServerOptions o;
  o.idle_timeout_ms = 100;
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  Client client({Address(server)}, ClientOptions());
  const std::vector<int64_t> ids = Iota(8);
  std::vector<float> out(8 * 8), grads(8 * 8, 1.0f);
  EXPECT_OK(client.Pull("emb", 8, ids.data(), 8, PullMode::kInsert, out.data()));
  EXPECT(WaitFor([&] { return server.counters().idle_timeouts.load() == 1; }, 5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), 8, 0.1f));
}

// After a Regreet (as before a checkpoint load) calls go back to reusing
// pooled connections: a connection a call returns keeps the switch count it
// was made at, so the pool does not take it for one to a copy left behind
// and close it (once every later call connected and said Hello afresh).
DLT_TEST(TestConnectionsArePooledAgainAfterARegreet) {
  auto shard = ShardWithTable(8);
  DataServer server(shard, DataServerOptions());
  EXPECT_OK(server.Start());
  ClientOptions o;
  o.exchange_threads = 1;
  Client client({Address(server)}, o);
  const std::vector<int64_t> ids = Iota(8);
  std::vector<float> out(8 * 8), grads(8 * 8, 1.0f);
  EXPECT_OK(client.Pull("emb", 8, ids.data(), 8, PullMode::kInsert, out.data()));
  EXPECT_OK(client.Regreet());
  const uint64_t accepted = server.counters().connections_accepted.load();
  for (int i = 0; i < 4; ++i) {
    EXPECT_OK(client.Pull("emb", 8, ids.data(), 8, PullMode::kInsert, out.data()));
    EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), 8, 0.1f));
  }
  EXPECT(server.counters().connections_accepted.load() == accepted);
}

// A large call goes to each shard over several connections, each exchanged
// by a thread of its own: rows land where a one-thread exchange puts them,
// and pushes split over connections apply every row once.
DLT_TEST(TestLargeCallsSplitOverConnectionsPerShard) {
  const uint32_t dim = 64;
  const TwoShards cluster([&](Shard* shard) {
    TableConfig c;
    c.name = "emb";
    c.dim = dim;
    c.initializer.kind = InitializerKind::kUniform;
    c.optimizer.kind = OptimizerKind::kSgd;
    bool created;
    EXPECT_OK(shard->CreateTable(c, &created));
    c.name = "emb16";
    c.dim = 16;
    EXPECT_OK(shard->CreateTable(c, &created));
    // Keras Adagrad squares each occurrence of an id in a frame: a push
    // split over connections must keep an id's occurrences together.
    c.initializer.kind = InitializerKind::kZeros;
    c.optimizer.kind = OptimizerKind::kKerasAdagrad;
    for (const char* name : {"kag_serial", "kag_parallel"}) {
      c.name = name;
      EXPECT_OK(shard->CreateTable(c, &created));
    }
  });
  const auto& [shards, servers, addresses] = cluster;
  // 2^17 ids of 2^16 distinct (every second one a repeat): 8 MiB of reply
  // per shard.
  std::vector<int64_t> ids(size_t{1} << 17);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 2654435761u) % 65536);
  ClientOptions one, many;
  one.exchange_threads = 1;
  many.exchange_threads = 8;
  Client serial(addresses, one), parallel(addresses, many);
  std::vector<float> want(ids.size() * dim), got(ids.size() * dim, -1.0f);
  EXPECT_OK(serial.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, want.data(), true));
  const uint64_t before = servers[0]->counters().connections_accepted.load() +
                          servers[1]->counters().connections_accepted.load();
  const uint64_t pulls[2] = {servers[0]->counters().pulls.load(),
                             servers[1]->counters().pulls.load()};
  size_t sent = 0;
  EXPECT_OK(parallel.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, got.data(), true,
                          &sent));
  EXPECT(sent == 65536);
  EXPECT(got == want);
  // 8 threads over 2 shards: each shard's part in 4 frames, each on a
  // connection exchanged by a thread of its own (as many at once as the
  // machine has cores).
  for (int i = 0; i < 2; ++i) EXPECT(servers[i]->counters().pulls.load() - pulls[i] == 4);
  const uint64_t opened = servers[0]->counters().connections_accepted.load() +
                          servers[1]->counters().connections_accepted.load() - before;
  EXPECT(opened >= 2 && opened <= 8);
  // Every row moves by -(its count) * 0.5 (to rounding: a row's repeats may
  // be applied in different frames); a row lost or applied twice is 0.5 off.
  std::vector<float> grads(ids.size() * dim, 0.5f);
  EXPECT_OK(parallel.Push("emb", dim, ids.data(), grads.data(), ids.size(), 1.0f));
  std::vector<float> after(ids.size() * dim);
  EXPECT_OK(serial.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, after.data(), true));
  std::vector<int> count(65536, 0);
  for (int64_t id : ids) ++count[static_cast<size_t>(id)];
  for (size_t i = 0; i < ids.size(); ++i) {
    for (uint32_t k = 0; k < dim; ++k) {
      const float expected = want[i * dim + k] - 0.5f * count[static_cast<size_t>(ids[i])];
      EXPECT(std::abs(after[i * dim + k] - expected) < 1e-5f);
    }
  }
  // Distinct ids split in ranges: each row moves once more, by 0.25.
  const std::vector<int64_t> distinct(ids.begin(), ids.begin() + 65536);
  std::vector<float> quarter(distinct.size() * dim, 0.25f), moved(distinct.size() * dim);
  EXPECT_OK(parallel.Push("emb", dim, distinct.data(), quarter.data(), distinct.size(), 1.0f));
  EXPECT_OK(serial.Pull("emb", dim, distinct.data(), distinct.size(), PullMode::kInsert,
                        moved.data(), true));
  for (size_t i = 0; i < distinct.size(); ++i) {
    const float expected = after[i * dim] - 0.25f;
    EXPECT(std::abs(moved[i * dim] - expected) < 1e-5f);
  }
  // Pushes with repeats, split over connections: each id's occurrences stay
  // together, so the rows equal a one-connection push bit for bit.
  std::vector<float> varied(ids.size() * 16);
  for (size_t i = 0; i < varied.size(); ++i) varied[i] = static_cast<float>(i % 97) / 64 - 0.7f;
  EXPECT_OK(serial.Push("kag_serial", 16, ids.data(), varied.data(), ids.size(), 0.1f));
  EXPECT_OK(parallel.Push("kag_parallel", 16, ids.data(), varied.data(), ids.size(), 0.1f));
  std::vector<float> by_serial(ids.size() * 16), by_parallel(ids.size() * 16);
  EXPECT_OK(serial.Pull("kag_serial", 16, ids.data(), ids.size(), PullMode::kInsert,
                        by_serial.data(), true));
  EXPECT_OK(serial.Pull("kag_parallel", 16, ids.data(), ids.size(), PullMode::kInsert,
                        by_parallel.data(), true));
  EXPECT(by_serial == by_parallel);
  EXPECT(std::any_of(by_serial.begin(), by_serial.end(), [](float v) { return v != 0; }));
  // Parts of over 4,096 rows but under 2 MiB (16 floats a row), with fewer
  // threads than shards: split over connections in one loop, rows alike.
  ClientOptions two;
  two.exchange_threads = 2;
  Client medium(addresses, two);
  const std::vector<int64_t> some(ids.begin(), ids.begin() + 10240);
  const uint64_t before_medium[2] = {servers[0]->counters().pulls.load(),
                                     servers[1]->counters().pulls.load()};
  std::vector<float> narrow_want(some.size() * 16), narrow_got(some.size() * 16, -1.0f);
  EXPECT_OK(serial.Pull("emb16", 16, some.data(), some.size(), PullMode::kInsert,
                        narrow_want.data(), true));
  EXPECT_OK(medium.Pull("emb16", 16, some.data(), some.size(), PullMode::kInsert, narrow_got.data(),
                        true));
  EXPECT(narrow_got == narrow_want);
  // Each shard's ~5,120 rows: 1 frame from the one-connection client, 2
  // (on 2 connections) from this one.
  const uint64_t frames = servers[0]->counters().pulls.load() - before_medium[0] +
                          servers[1]->counters().pulls.load() - before_medium[1];
  EXPECT(frames == 6);
  // One shard gone: the call fails with UNAVAILABLE and the other shard's
  // connections are kept for the next call.
  servers[1]->Stop();
  ClientOptions no_retry = many;
  no_retry.pull_retries = 0;
  no_retry.connect_timeout_ms = 500;
  Client failing(addresses, no_retry);
  const Status s = failing.Pull("emb", dim, ids.data(), ids.size(), PullMode::kInsert, got.data());
  EXPECT(s.code() == Code::kUnavailable);
}

DLT_TEST(TestABufferPoolFreesWhatGoesUnused) {
  // A pooled buffer none took for the idle time is freed (one large
  // request's buffers do not stay with the process); one put back since is
  // kept, and handed out again.
  net::BufferPool pool(8, 16u << 20);
  net::Buffer large;
  large.Reserve(8u << 20);
  pool.Put(std::move(large));
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const auto between = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  net::Buffer small;
  small.Reserve(1u << 20);
  pool.Put(std::move(small));
  // An hour past `between`, less a millisecond: the large one was put back
  // before it (idle past the hour), the small one after (not yet).
  const auto idle = std::chrono::milliseconds(std::chrono::hours(1));
  const auto later = between + idle - std::chrono::milliseconds(1);
  EXPECT(pool.ReleaseIdle(idle, later) == (8u << 20));
  EXPECT(pool.ReleaseIdle(idle, later) == 0);
  EXPECT(pool.Get(4096).capacity() == (1u << 20));
  EXPECT(pool.ReleaseIdle(std::chrono::milliseconds(0)) == 0);  // it was taken
}

}  // namespace
}  // namespace dlt
