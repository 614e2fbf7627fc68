#include "native/net/data_server.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "native/core/routing.h"
#include "native/net/buffer.h"
#include "native/net/socket.h"

namespace dlt {
namespace {

using net::Clock;
constexpr int kPollMs = 200;
// Buffers above this size are released after the request that needed them.
constexpr size_t kKeepBufferBytes = 16u << 20;

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  size_t diff = a.size() ^ b.size();
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  for (size_t i = 0; i < n; ++i) {
    const uint8_t x = i < a.size() ? static_cast<uint8_t>(a[i]) : 0;
    const uint8_t y = i < b.size() ? static_cast<uint8_t>(b[i]) : 0;
    diff |= static_cast<size_t>(x ^ y);
  }
  return diff == 0;
}

uint64_t MicrosSince(Clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count());
}

}  // namespace

DataServer::DataServer(std::shared_ptr<Shard> shard, DataServerOptions options)
    : shard_(std::move(shard)), options_(std::move(options)), admin_port_(options_.admin_port) {}

DataServer::~DataServer() { Stop(); }

Status DataServer::Start() {
  if (options_.max_frame_bytes < wire::kMinMaxFrameBytes) {
    return InvalidArgument("max frame bytes must be at least " +
                           std::to_string(wire::kMinMaxFrameBytes) + ", got " +
                           std::to_string(options_.max_frame_bytes));
  }
  if (options_.max_connections < 1) {
    return InvalidArgument("the connection limit must be at least 1");
  }
  DLT_RETURN_IF_ERROR(net::Listen(options_.bind, options_.port, 128, &listen_fd_, &port_));
  acceptor_ = std::thread([this] { AcceptLoop(); });
  return OkStatus();
}

void DataServer::Stop() {
  if (stopping_.exchange(true)) return;
  if (acceptor_.joinable()) acceptor_.join();
  net::CloseFd(listen_fd_);
  listen_fd_ = -1;
  std::lock_guard<std::mutex> lock(mu_);
  for (Connection& c : connections_) {
    if (c.thread.joinable()) c.thread.join();
  }
  connections_.clear();
}

void DataServer::ReapFinished() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->done.load()) {
      it->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void DataServer::AcceptLoop() {
  while (!stopping_.load()) {
    struct pollfd p = {listen_fd_, POLLIN, 0};
    const int rc = poll(&p, 1, kPollMs);
    ReapFinished();
    if (rc <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    net::SetNonBlocking(fd);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    counters_.connections_accepted.fetch_add(1);
    if (counters_.connections_open.load() >= static_cast<uint64_t>(options_.max_connections)) {
      const std::string payload = wire::EncodeError(
          Code::kResourceExhausted,
          "server is at its limit of " + std::to_string(options_.max_connections) + " connections");
      uint8_t header[wire::kHeaderBytes];
      wire::EncodeHeader(
          {wire::Opcode::kError, wire::kFlagResponse, 0, static_cast<uint32_t>(payload.size())},
          header);
      struct iovec iov[2] = {{header, sizeof(header)},
                             {const_cast<char*>(payload.data()), payload.size()}};
      (void)net::SendAll(fd, iov, 2, Clock::now() + std::chrono::seconds(1));
      counters_.errors[static_cast<int>(Code::kResourceExhausted)].fetch_add(1);
      net::CloseFd(fd);
      continue;
    }
    counters_.connections_open.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu_);
    connections_.emplace_back();
    Connection* c = &connections_.back();
    c->fd = fd;
    c->thread = std::thread([this, c] { Serve(c); });
  }
}

void DataServer::Serve(Connection* connection) {
  const int fd = connection->fd;
  const auto io_timeout = std::chrono::milliseconds(options_.io_timeout_ms);
  bool authenticated = false;
  net::Buffer in;
  std::string reply;
  uint8_t header_bytes[wire::kHeaderBytes];
  while (!stopping_.load()) {
    struct pollfd p = {fd, POLLIN, 0};
    const int rc = poll(&p, 1, kPollMs);
    if (rc == 0) continue;
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) break;
    const Clock::time_point deadline = Clock::now() + io_timeout;
    if (!net::RecvAll(fd, header_bytes, sizeof(header_bytes), deadline).ok()) {
      break;  // closed, reset or truncated header: nothing to answer
    }
    counters_.bytes_in.fetch_add(sizeof(header_bytes));
    wire::FrameHeader header;
    Status s = wire::DecodeHeader(header_bytes, options_.max_frame_bytes, &header);
    if (s.ok() && (header.flags & wire::kFlagResponse)) {
      s = InvalidArgument("a request frame must not carry the response flag");
    }
    bool keep_open = true;
    if (!s.ok()) {
      // The stream cannot be resynchronised: answer and close.
      counters_.errors[static_cast<int>(s.code())].fetch_add(1);
      const std::string payload = wire::EncodeError(s.code(), s.message());
      reply.resize(wire::kHeaderBytes);
      wire::EncodeHeader({wire::Opcode::kError, wire::kFlagResponse, header.request_id,
                          static_cast<uint32_t>(payload.size())},
                         reinterpret_cast<uint8_t*>(&reply[0]));
      reply += payload;
      keep_open = false;
    } else {
      uint8_t* payload = in.Reserve(header.payload_bytes);
      if (!net::RecvAll(fd, payload, header.payload_bytes, deadline).ok()) break;
      counters_.bytes_in.fetch_add(header.payload_bytes);
      keep_open = Handle(header, payload, &authenticated, &reply);
    }
    struct iovec iov = {&reply[0], reply.size()};
    if (!net::SendAll(fd, &iov, 1, Clock::now() + io_timeout).ok()) break;
    counters_.bytes_out.fetch_add(reply.size());
    if (reply.capacity() > kKeepBufferBytes) std::string().swap(reply);
    in.Trim(kKeepBufferBytes);
    if (!keep_open) break;
  }
  net::CloseFd(fd);
  counters_.connections_open.fetch_sub(1);
  connection->done.store(true);
}

bool DataServer::Handle(const wire::FrameHeader& header, const uint8_t* payload,
                        bool* authenticated, std::string* reply) {
  const Clock::time_point start = Clock::now();
  bool keep_open = true;
  auto respond = [&](wire::Opcode opcode, const std::string& body) {
    reply->resize(wire::kHeaderBytes);
    wire::EncodeHeader(
        {opcode, wire::kFlagResponse, header.request_id, static_cast<uint32_t>(body.size())},
        reinterpret_cast<uint8_t*>(&(*reply)[0]));
    reply->append(body);
  };
  auto fail = [&](const Status& s, bool close) {
    counters_.errors[static_cast<int>(s.code())].fetch_add(1);
    respond(wire::Opcode::kError, wire::EncodeError(s.code(), s.message()));
    keep_open = !close;
    return keep_open;
  };

  if (header.opcode == wire::Opcode::kHello) {
    wire::HelloRequest hello;
    Status s = wire::DecodeHelloRequest(payload, header.payload_bytes, &hello);
    if (!s.ok()) return fail(s, true);
    if (hello.protocol_version != wire::kVersion) {
      return fail(InvalidArgument("client speaks protocol version " +
                                  std::to_string(hello.protocol_version) +
                                  "; this server speaks version 1"),
                  true);
    }
    if (!options_.auth_token.empty() && !ConstantTimeEquals(hello.token, options_.auth_token)) {
      return fail(Unauthenticated("wrong or missing auth token"), true);
    }
    *authenticated = true;
    counters_.hellos.fetch_add(1);
    wire::HelloReply out;
    out.shard_index = shard_->shard_index();
    out.num_shards = shard_->num_shards();
    out.num_buckets = kNumBuckets;
    out.admin_port = admin_port_.load();
    out.max_frame_bytes = options_.max_frame_bytes;
    respond(wire::Opcode::kHello, wire::EncodeHelloReply(out));
    return true;
  }
  if (!*authenticated) {
    return fail(Unauthenticated("the first frame on a connection must be Hello"), true);
  }
  if (header.opcode != wire::Opcode::kPull && header.opcode != wire::Opcode::kPush &&
      header.opcode != wire::Opcode::kAssign) {
    return fail(
        InvalidArgument("unknown opcode " + std::to_string(static_cast<int>(header.opcode))),
        false);
  }
  const bool push = header.opcode == wire::Opcode::kPush;
  const bool assign = header.opcode == wire::Opcode::kAssign;
  wire::TableRequest request;
  Status s = push     ? wire::DecodePushRequest(payload, header.payload_bytes, &request)
             : assign ? wire::DecodeAssignRequest(payload, header.payload_bytes, &request)
                      : wire::DecodePullRequest(payload, header.payload_bytes, &request);
  if (!s.ok()) return fail(s, false);
  std::shared_ptr<Table> table;
  s = shard_->GetTable(request.table, &table);
  if (!s.ok()) return fail(s, false);
  if (request.dim != table->dim()) {
    return fail(
        InvalidArgument("table '" + request.table + "' has dim " + std::to_string(table->dim()) +
                        ", the request says " + std::to_string(request.dim)),
        false);
  }
  s = shard_->CheckOwnership(request.ids, request.num_ids);
  if (!s.ok()) return fail(s, false);

  if (assign) {
    s = table->Assign(request.ids, request.grads, request.num_ids);
    if (!s.ok()) return fail(s.WithContext("table '" + request.table + "'"), false);
    respond(wire::Opcode::kAssign, wire::EncodePushReply(request.num_ids));
    counters_.assigned_rows.fetch_add(request.num_ids);
    return true;
  }
  if (push) {
    s = table->Push(request.ids, request.grads, request.num_ids, request.learning_rate);
    if (!s.ok()) return fail(s.WithContext("table '" + request.table + "'"), false);
    respond(wire::Opcode::kPush, wire::EncodePushReply(request.num_ids));
    counters_.pushes.fetch_add(1);
    counters_.pushed_rows.fetch_add(request.num_ids);
    counters_.push_latency.Record(MicrosSince(start));
    return true;
  }
  const uint64_t body = wire::kPullReplyFixed + uint64_t{4} * request.dim * request.num_ids;
  if (body > options_.max_frame_bytes) {
    return fail(ResourceExhausted("reply of " + std::to_string(body) +
                                  " bytes would exceed the maximum frame of " +
                                  std::to_string(options_.max_frame_bytes) +
                                  " bytes; send fewer ids per frame"),
                false);
  }
  reply->resize(wire::kHeaderBytes + body);
  uint8_t* out = reinterpret_cast<uint8_t*>(&(*reply)[0]);
  wire::EncodeHeader(
      {wire::Opcode::kPull, wire::kFlagResponse, header.request_id, static_cast<uint32_t>(body)},
      out);
  wire::EncodePullReplyPrefix(request.dim, request.num_ids, out + wire::kHeaderBytes);
  table->Pull(request.ids, request.num_ids, request.mode,
              reinterpret_cast<float*>(out + wire::kHeaderBytes + wire::kPullReplyFixed));
  counters_.pulls.fetch_add(1);
  counters_.pulled_rows.fetch_add(request.num_ids);
  counters_.pull_latency.Record(MicrosSince(start));
  return true;
}

}  // namespace dlt
