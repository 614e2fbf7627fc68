// The data-plane server: DLT wire protocol v1 over TCP, served by C++
// threads (one per connection) with no Python or GIL on the request path.
#ifndef TF_DLT_NATIVE_NET_DATA_SERVER_H_
#define TF_DLT_NATIVE_NET_DATA_SERVER_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "native/core/shard.h"
#include "native/core/status.h"
#include "native/net/server_stats.h"
#include "native/net/wire.h"

namespace dlt {

struct DataServerOptions {
  std::string bind = "0.0.0.0";
  int port = 0;
  // Connections served at once; more are answered RESOURCE_EXHAUSTED.
  int max_connections = 64;
  // Required in every Hello when non-empty.
  std::string auth_token;
  uint32_t max_frame_bytes = wire::kDefaultMaxFrameBytes;
  // Advertised in the Hello reply so clients find the control plane.
  uint32_t admin_port = 0;
  // Once a frame has started, the rest of it must arrive within this time.
  int io_timeout_ms = 30000;
};

class DataServer {
 public:
  DataServer(std::shared_ptr<Shard> shard, DataServerOptions options);
  ~DataServer();
  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;

  // Binds and starts accepting; port() is valid afterwards.
  Status Start();
  int port() const { return port_; }
  void set_admin_port(uint32_t port) { admin_port_.store(port); }
  // Stops accepting, lets every connection finish the request in hand, and
  // joins all threads. Idempotent.
  void Stop();

  const ServerCounters& counters() const { return counters_; }

 private:
  struct Connection {
    int fd = -1;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void AcceptLoop();
  void Serve(Connection* connection);
  // Handles one request frame; returns false when the connection must close.
  bool Handle(const wire::FrameHeader& header, const uint8_t* payload, bool* authenticated,
              std::string* reply);
  void ReapFinished();

  std::shared_ptr<Shard> shard_;
  const DataServerOptions options_;
  std::atomic<uint32_t> admin_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::list<Connection> connections_;  // guarded by mu_
  ServerCounters counters_;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_DATA_SERVER_H_
