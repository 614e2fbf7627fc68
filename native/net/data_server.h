// The data-plane server: DLT wire protocol v1 over TCP, event-driven. All
// sockets are non-blocking and registered (one-shot) on one epoll instance;
// a fixed pool of worker threads, one per core by default, takes whichever
// connection is ready, reads its next frame, serves it (RequestHandler) and
// sends the reply without blocking; a reply the socket cannot take yet waits
// for the socket while the worker moves on. A connection is served by one
// worker at a time, so its frames are answered in order (pipelining by
// request id works as before). No Python or GIL on the request path.
//
// Nobody can starve it: a connection must say Hello within hello_timeout,
// before which only a frame of a Hello's size is read; unauthenticated
// connections have their own cap (a new one closes the oldest), so they never
// take the slots of authenticated ones; authenticated connections are capped
// at Hello and closed after idle_timeout; a started frame must arrive, and a
// reply must be taken, within io_timeout; each connection buffers at most
// one frame and one reply, and all connections together at most
// max_buffered_bytes (a connection over it waits its turn). A standby holds
// at most max_buffered_bytes more of its primary's round until the round's
// end (past them the round is dropped and copied afresh).
#ifndef TF_DLT_NATIVE_NET_DATA_SERVER_H_
#define TF_DLT_NATIVE_NET_DATA_SERVER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "native/core/shard.h"
#include "native/core/status.h"
#include "native/net/buffer.h"
#include "native/net/request_handler.h"
#include "native/net/server_stats.h"
#include "native/net/wire.h"

namespace dlt {

struct DataServerOptions {
  std::string bind = "127.0.0.1";
  int port = 0;
  // Threads serving requests; 0: one per core.
  int worker_threads = 0;
  // Authenticated connections at once; a Hello past it is answered
  // RESOURCE_EXHAUSTED. 0: as many as the process's file limit allows.
  int max_connections = 0;
  // Connections that have not said Hello yet; a new one past this closes
  // the oldest of them.
  int max_unauthenticated = 256;
  // File descriptors the process keeps beside the data plane's connections
  // (the admin plane's connections, checkpoint and tier files): raised into
  // the open-file limit with the caps and left out of the automatic one.
  int other_fds = 256;
  // A connection must complete its Hello within this time.
  int hello_timeout_ms = 5000;
  // An authenticated connection with nothing in flight for this long is
  // closed; 0: never.
  int idle_timeout_ms = 600000;
  // Once a frame has started, the rest of it must arrive within this time,
  // and a reply must be taken by the peer within this time.
  int io_timeout_ms = 30000;
  // Bytes of frames being received and replies waiting to be sent, over all
  // connections; past it connections wait (in order) for room.
  uint64_t max_buffered_bytes = uint64_t{1} << 30;
  // Required in every Hello when non-empty.
  std::string auth_token;
  uint32_t max_frame_bytes = wire::kDefaultMaxFrameBytes;
  // Advertised in the Hello reply so clients find the control plane.
  uint32_t admin_port = 0;
};

class DataServer {
 public:
  DataServer(std::shared_ptr<Shard> shard, DataServerOptions options);
  ~DataServer();
  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;

  // Checks the options, raises the process's open-file limit as far as the
  // connection caps need, binds and starts the workers; port() is valid
  // afterwards.
  Status Start();
  int port() const { return port_; }
  void set_admin_port(uint32_t port) { handler_.set_admin_port(port); }
  void set_read_only(bool read_only) { handler_.set_read_only(read_only); }
  // Replication (docs/replication.md): see RequestHandler.
  void set_standby(bool standby, bool new_epoch = true) {
    handler_.set_standby(standby, new_epoch);
  }
  bool standby() const { return handler_.standby(); }
  bool standby_caught_up() const { return handler_.standby_caught_up(); }
  void set_standbys(const std::string& standbys) { handler_.set_standbys(standbys); }
  wire::InSyncView insync_view() const { return handler_.insync_view(); }
  void set_write_listener(std::shared_ptr<WriteListener> listener) {
    handler_.set_write_listener(std::move(listener));
  }
  // Live re-sharding (docs/replication.md): the shard of the next layout
  // this process prepares, and the switch's hold of writes.
  ReshardTarget& reshard_target() { return handler_.reshard_target(); }
  Status HoldWrites(bool hold, int timeout_ms = 10000) {
    return handler_.HoldWrites(hold, timeout_ms);
  }
  // Serves the shard it prepared (ReshardTarget) from now on, at layout
  // `layout_epoch` of `addresses`; FAILED_PRECONDITION when none is
  // prepared. Writes held stay held. A standby replicated to follows: it
  // switched, or switches, to the same tables (docs/replication.md).
  Status SwitchLayout(uint64_t layout_epoch, const std::string& addresses);
  // Serves the layout switched from again (the re-shard failed elsewhere;
  // writes are still held) at `layout_epoch` of `addresses` (Shard::
  // RevertLayout); false when there was none to go back to.
  bool RevertLayout(uint64_t layout_epoch, const std::string& addresses);
  // Authenticated connections allowed (max_connections resolved at Start).
  int max_connections() const { return max_connections_; }
  int worker_threads() const { return static_cast<int>(workers_.size()); }
  // Stops accepting, lets each worker finish the connection in hand, sends
  // what replies the peers take within a second, and closes everything.
  // Idempotent.
  void Stop();

  const ServerCounters& counters() const { return counters_; }

 private:
  struct Conn;
  enum class Deadline : uint8_t { kHello, kIdle, kIo, kNone };

  void WorkerLoop();
  void ReaperLoop();
  void AcceptAll();
  // Serves `conn` after epoll reported `events` for it; re-arms it, parks it
  // or closes it before returning.
  void Serve(Conn* conn, uint32_t events);
  // Reads and serves frames until the socket is drained, a reply waits for
  // the socket, the connection waits for memory, or it must close. Returns
  // false when it must close now.
  bool ReadFrames(Conn* conn);
  // Serves the whole frame buffered in `conn` and starts sending its reply.
  bool ServeFrame(Conn* conn);
  // Sends as much of the waiting reply as the socket takes; false on error.
  bool Flush(Conn* conn);
  // The largest payload the frame whose header `conn` holds may announce
  // before DecodeHeader refuses it.
  uint32_t FrameLimit(const Conn& conn) const;
  // Re-registers `conn` with epoll for `events` (one-shot).
  void Arm(Conn* conn, uint32_t events);
  void Close(Conn* conn);
  void SetDeadline(Conn* conn, Deadline kind, int timeout_ms);

  // Memory of frames and replies: Reserve succeeds when `bytes` fit under
  // max_buffered_bytes (or nothing else is buffered) and no connection
  // waits before this one; otherwise the connection is queued and woken by
  // Unreserve when its turn comes.
  bool Reserve(Conn* conn, uint64_t bytes);
  void Unreserve(Conn* conn, uint64_t bytes);
  void WakeWaiting();
  // Wakes the first waiting connection if its memory fits; holds mu_.
  void WakeHeadLocked();

  std::shared_ptr<Shard> shard_;
  const DataServerOptions options_;
  ServerCounters counters_;
  RequestHandler handler_;
  net::BufferPool pool_;
  int max_connections_ = 0;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: written once at Stop, wakes every worker
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> accept_paused_{false};
  std::vector<std::thread> workers_;
  std::thread reaper_;
  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;

  std::mutex mu_;
  std::list<Conn*> conns_;            // every open connection; guarded by mu_
  std::list<Conn*> unauthenticated_;  // oldest first; guarded by mu_
  std::list<Conn*> waiting_;          // for memory, in order; guarded by mu_
  int authenticated_ = 0;             // guarded by mu_
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_DATA_SERVER_H_
