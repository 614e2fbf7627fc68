// Load generator for the data plane (bench/bench_connections.py): opens N
// connections to one shard, says Hello on each, then keeps one request in
// flight per connection (closed loop) for a measured interval, on one thread.
//
//   loadgen ADDRESS CONNECTIONS SECONDS pull|push|idle IDS DIM TABLE [TOKEN]
//
// Prints one JSON line: requests, rows/s, latency p50/p99 (microseconds),
// errors. In "idle" mode it only connects and greets, prints "ready", and
// holds the connections until its standard input closes.
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "native/net/socket.h"
#include "native/net/wire.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Conn {
  int fd = -1;
  uint8_t header[dlt::wire::kHeaderBytes];
  size_t header_got = 0;
  std::vector<uint8_t> payload;
  size_t payload_got = 0;
  Clock::time_point started;
  uint64_t rng = 0;
};

std::string Frame(dlt::wire::Opcode op, uint64_t id, const std::string& payload) {
  uint8_t header[dlt::wire::kHeaderBytes];
  dlt::wire::EncodeHeader({op, 0, id, static_cast<uint32_t>(payload.size())}, header);
  return std::string(reinterpret_cast<char*>(header), sizeof(header)) + payload;
}

uint64_t Next(uint64_t* s) {  // xorshift64*
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}

std::string Request(Conn* c, bool push, uint32_t ids, uint32_t dim, const std::string& table) {
  std::string p = push ? dlt::wire::EncodePushPrefix(table, dim, ids, 0.01f)
                       : dlt::wire::EncodePullPrefix(table, dim, ids, dlt::PullMode::kInsert);
  for (uint32_t i = 0; i < ids; ++i) {
    const int64_t id = static_cast<int64_t>(Next(&c->rng) % 1000000);
    p.append(reinterpret_cast<const char*>(&id), 8);
  }
  if (push) p.append(size_t{4} * dim * ids, '\0');
  return Frame(push ? dlt::wire::Opcode::kPush : dlt::wire::Opcode::kPull, 2, p);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr,
                 "usage: loadgen ADDRESS CONNECTIONS SECONDS pull|push|idle IDS DIM TABLE "
                 "[TOKEN]\n");
    return 2;
  }
  const std::string address = argv[1];
  const int n = std::atoi(argv[2]);
  const double seconds = std::atof(argv[3]);
  const std::string mode = argv[4];
  const uint32_t ids = static_cast<uint32_t>(std::atoi(argv[5]));
  const uint32_t dim = static_cast<uint32_t>(std::atoi(argv[6]));
  const std::string table = argv[7];
  dlt::wire::HelloRequest hello;
  hello.token = argc > 8 ? argv[8] : "";
  const std::string hello_frame =
      Frame(dlt::wire::Opcode::kHello, 1, dlt::wire::EncodeHelloRequest(hello));

  std::vector<Conn> conns(n);
  uint64_t errors = 0;
  for (int i = 0; i < n; ++i) {
    Conn& c = conns[i];
    c.rng = 0x9e3779b97f4a7c15ull * (i + 1);
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    if (!dlt::net::Connect(address, deadline, &c.fd).ok()) {
      std::fprintf(stderr, "connect %d failed\n", i);
      return 1;
    }
    struct iovec iov = {const_cast<char*>(hello_frame.data()), hello_frame.size()};
    if (!dlt::net::SendAll(c.fd, &iov, 1, deadline).ok()) return 1;
  }
  for (Conn& c : conns) {  // every Hello reply
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    uint8_t header[dlt::wire::kHeaderBytes];
    dlt::wire::FrameHeader h;
    if (!dlt::net::RecvAll(c.fd, header, sizeof(header), deadline).ok() ||
        !dlt::wire::DecodeHeader(header, 1 << 20, &h).ok()) {
      return 1;
    }
    std::vector<uint8_t> body(h.payload_bytes);
    if (!dlt::net::RecvAll(c.fd, body.data(), body.size(), deadline).ok()) return 1;
    if (h.opcode != dlt::wire::Opcode::kHello) ++errors;
  }
  if (mode == "idle") {
    std::printf("ready %llu\n", static_cast<unsigned long long>(errors));
    std::fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof(buf)) > 0) {
    }
    for (Conn& c : conns) close(c.fd);
    return 0;
  }
  const bool push = mode == "push";
  const int ep = epoll_create1(0);
  // Requests fit a socket's send buffer: sent whole, blocking at worst.
  auto send_request = [&](Conn& c) {
    std::string out = Request(&c, push, ids, dim, table);
    struct iovec iov = {&out[0], out.size()};
    c.started = Clock::now();
    if (!dlt::net::SendAll(c.fd, &iov, 1, c.started + std::chrono::seconds(30)).ok()) ++errors;
  };
  for (int i = 0; i < n; ++i) {
    struct epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.u32 = static_cast<uint32_t>(i);
    epoll_ctl(ep, EPOLL_CTL_ADD, conns[i].fd, &ev);
    send_request(conns[i]);
  }
  const auto warm_end = Clock::now() + std::chrono::milliseconds(1000);
  const auto end = warm_end + std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
  std::vector<uint32_t> latencies;
  uint64_t requests = 0;
  std::vector<struct epoll_event> events(256);
  while (Clock::now() < end) {
    const int k = epoll_wait(ep, events.data(), static_cast<int>(events.size()), 100);
    for (int e = 0; e < k; ++e) {
      Conn& c = conns[events[e].data.u32];
      for (;;) {
        if (c.header_got < dlt::wire::kHeaderBytes) {
          const ssize_t r =
              recv(c.fd, c.header + c.header_got, dlt::wire::kHeaderBytes - c.header_got, 0);
          if (r <= 0) break;
          c.header_got += static_cast<size_t>(r);
          if (c.header_got < dlt::wire::kHeaderBytes) continue;
          dlt::wire::FrameHeader h;
          (void)dlt::wire::DecodeHeader(c.header, UINT32_MAX, &h);
          c.payload.resize(h.payload_bytes);
          c.payload_got = 0;
          if (h.opcode == dlt::wire::Opcode::kError) ++errors;
        }
        if (c.payload_got < c.payload.size()) {
          const ssize_t r =
              recv(c.fd, c.payload.data() + c.payload_got, c.payload.size() - c.payload_got, 0);
          if (r <= 0) break;
          c.payload_got += static_cast<size_t>(r);
          if (c.payload_got < c.payload.size()) continue;
        }
        // A whole reply: count it and send the next request.
        const auto now = Clock::now();
        if (now >= warm_end) {
          ++requests;
          latencies.push_back(static_cast<uint32_t>(
              std::chrono::duration_cast<std::chrono::microseconds>(now - c.started).count()));
        }
        c.header_got = 0;
        send_request(c);
        break;
      }
    }
  }
  std::sort(latencies.begin(), latencies.end());
  auto pct = [&](double q) {
    return latencies.empty()
               ? 0.0
               : static_cast<double>(latencies[static_cast<size_t>(q * (latencies.size() - 1))]);
  };
  std::printf(
      "{\"connections\": %d, \"mode\": \"%s\", \"requests\": %llu, \"rows_per_s\": %.1f, "
      "\"p50_us\": %.1f, \"p99_us\": %.1f, \"errors\": %llu}\n",
      n, mode.c_str(), static_cast<unsigned long long>(requests),
      static_cast<double>(requests) * ids / seconds, pct(0.5), pct(0.99),
      static_cast<unsigned long long>(errors));
  for (Conn& c : conns) close(c.fd);
  return 0;
}
