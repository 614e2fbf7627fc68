// Serves request frames of the DLT wire protocol v1 against a Shard: Hello
// (version and token), Pull, Push and Assign. No I/O here: the data-plane
// server reads whole frames and sends the reply frames this writes.
#ifndef TF_DLT_NATIVE_NET_REQUEST_HANDLER_H_
#define TF_DLT_NATIVE_NET_REQUEST_HANDLER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <vector>

#include "native/core/shard.h"
#include "native/core/status.h"
#include "native/net/buffer.h"
#include "native/net/reshard_target.h"
#include "native/net/server_stats.h"
#include "native/net/wire.h"

namespace dlt {

// Told of every write a primary applied (docs/replication.md): Written
// returns once the write's standby holds it (sync replication), or at once
// (async). An error means the write is applied here but not acknowledged.
class WriteListener {
 public:
  virtual ~WriteListener() = default;
  // Called once a write was applied (an identified push: while it still
  // holds the push gate); the mark it returns goes to Written.
  virtual uint64_t Applied() = 0;
  // Returns once the write marked `mark` may be acknowledged.
  virtual Status Written(uint64_t mark) = 0;
  // A re-shard's switch, or its undoing (writes are held): `swap` makes the
  // shard serve other tables and returns them, which its standby holds as
  // they are then (it switched, or switches, too); the changes of `first`
  // (the tables switched to) count from before the swap.
  // The standbys' addresses ('|' between them) clients learn from the
  // shard's Hello.
  virtual std::string standbys() const { return ""; }
  virtual void Follow(const std::vector<std::shared_ptr<Table>>& first,
                      const std::function<std::vector<std::shared_ptr<Table>>()>& swap) {
    (void)first;
    swap();
  }
};

class RequestHandler {
 public:
  RequestHandler(std::shared_ptr<Shard> shard, std::string auth_token, uint32_t max_frame_bytes,
                 ServerCounters* counters);

  void set_admin_port(uint32_t port) { admin_port_.store(port); }
  // A read-only shard (it serves checkpoints) refuses pushes and
  // assignments, and a pull never creates a row (absent ids read zeros).
  void set_read_only(bool read_only) { read_only_.store(read_only); }
  uint32_t max_frame_bytes() const { return max_frame_bytes_; }
  // A standby (docs/replication.md) takes StandbyTable and Replicate frames
  // from its primary and answers trainers' requests UNAVAILABLE (they go to
  // the primary); any other shard refuses those frames.
  // Becoming a standby again (a primary stepping down) forgets that it was
  // caught up. Taking over drops the rows of a round its primary did not finish and,
  // with `new_epoch`, makes this copy one epoch newer than its primary's
  // and than the epoch it fenced (Shard::Fence; without: a shard that only
  // waited to learn its role begins as a primary at the epoch it has, or
  // the one it fenced). Either clears Shard::superseded_by.
  void set_standby(bool standby, bool new_epoch = true);
  bool standby() const { return standby_.load(); }
  // A standby holds every table its primary had at some moment: the
  // primary said so after its copies; false again while a connection's
  // copies begin afresh. A table its primary replaces (a load) or makes
  // while it is caught up is copied into a table of its own, installed at
  // the end of the round that finishes the copy; the copy it replaces, or
  // the table dropped meanwhile, stays until then, so it stays caught up
  // through the copy. Only such a standby may take over.
  bool standby_caught_up() const { return caught_up_.load(); }
  // The addresses of this primary's standbys ('|' between them), told to
  // clients in the Hello's topology part; "" (the default): the write
  // listener's (WriteListener::standbys).
  void set_standbys(const std::string& standbys) {
    std::lock_guard<std::mutex> lock(staged_mu_);
    standbys_ = standbys;
  }
  // On a standby: the in-sync set its primary told it last (version 0:
  // none told since it became a standby).
  wire::InSyncView insync_view() const {
    std::lock_guard<std::mutex> lock(staged_mu_);
    return insync_;
  }
  // Called after each push or assignment is applied; null: none.
  void set_write_listener(std::shared_ptr<WriteListener> listener) {
    std::atomic_store(&listener_, std::move(listener));
  }
  std::shared_ptr<WriteListener> write_listener() const { return std::atomic_load(&listener_); }

  // Checks a frame header before its payload is read. Before the Hello only
  // a Hello of at most a Hello's size passes, so nothing larger is ever
  // buffered for an unauthenticated peer.
  Status CheckHeader(const wire::FrameHeader& header, bool authenticated) const;

  // Upper bound of the reply frame (header included) that a request needs,
  // from its header and, for a Pull, the first 12 bytes of its payload (dim,
  // id count and mode; null when the payload is shorter): used to reserve memory
  // before the payload is read.
  size_t ReplyBound(const wire::FrameHeader& header, const uint8_t* pull_sizes) const;

  // What a connection's Hello said about its peer (0 before it, or when not
  // such a peer): a primary's connection to this standby, numbered in the
  // order they said Hello; a range stream's, by the generation of the next
  // shard it greeted (ReshardTarget).
  struct Peer {
    uint64_t replica_hello = 0;
    uint64_t move_generation = 0;
  };
  // Serves one whole request frame; writes the reply frame into `reply` and
  // returns its size. `*authenticated` turns true on a valid Hello, which
  // also sets `*peer` (the connection's).
  // `*keep_open` turns false when the connection must close after the reply.
  // A standby may keep `payload`'s buffer (a frame of its round, until the
  // round's end; then it goes to the pool set_payload_pool names).
  size_t Handle(const wire::FrameHeader& header, net::Buffer* payload, bool* authenticated,
                Peer* peer, net::Buffer* reply, bool* keep_open);
  // The shard of the next layout this process prepares (live re-sharding).
  ReshardTarget& reshard_target() { return reshard_target_; }
  // A re-shard's switch: while held, pushes and assignments are refused
  // (ABORTED: not applied, send again). Holding returns once no write is
  // being applied (DEADLINE_EXCEEDED past `timeout_ms`; the hold stays).
  Status HoldWrites(bool hold, int timeout_ms = 10000);
  // Where a standby's staged frames' buffers go once applied.
  void set_payload_pool(net::BufferPool* pool) { payload_pool_ = pool; }
  // The most bytes of frames a standby holds for its round's end; a round
  // past them is dropped and copied afresh (StageIfCaughtUp).
  void set_max_staged_bytes(uint64_t bytes) { max_staged_bytes_ = bytes; }

  // The reply frame of an error (counted by its code); returns its size.
  size_t ErrorReply(uint64_t request_id, const Status& status, net::Buffer* reply);

 private:
  // Counts a write in flight from its construction until Done (or its end).
  class WriteTicket {
   public:
    explicit WriteTicket(std::atomic<int>* in_flight) : in_flight_(in_flight) {
      if (in_flight_ != nullptr) in_flight_->fetch_add(1);
    }
    ~WriteTicket() { Done(); }
    WriteTicket(const WriteTicket&) = delete;
    WriteTicket& operator=(const WriteTicket&) = delete;
    void Done() {
      if (in_flight_ != nullptr) in_flight_->fetch_sub(1);
      in_flight_ = nullptr;
    }

   private:
    std::atomic<int>* in_flight_;
  };
  // A write applied now, as the write listener then (if any) marks it.
  struct WriteMark {
    std::shared_ptr<WriteListener> listener;
    uint64_t mark = 0;
  };
  WriteMark MarkApplied() const;
  // UNAVAILABLE when this primary was replaced (Shard::superseded_by), for
  // trainers; else OK.
  Status Replaced() const;
  // Waits for the listener that marked the write (none: at once).
  Status AwaitStandby(const WriteMark& applied);
  // A standby's frame from its primary held until its round's end.
  struct Staged {
    wire::Opcode opcode;
    net::Buffer payload;  // the frame's, as received
    size_t bytes;
  };
  // A round's staged frames, applied at its end: the rows by a few threads
  // at once (a round names a row in one frame, or the same row twice), the
  // sketch counts in their order, then each table's push clock as the last
  // frame left it.
  Status ApplyRound(const std::vector<Staged>& staged);
  // On a caught-up standby: holds this frame from its primary until its
  // round's end (*staged); otherwise *staged is false (apply it now).
  // RESOURCE_EXHAUSTED when the round would pass max_staged_bytes: it is
  // dropped, the standby no longer caught up, and *stale set (the
  // connection closes).
  Status StageIfCaughtUp(const wire::FrameHeader& header, net::Buffer* payload, bool* staged,
                         bool* stale);
  // Empties the round's staged frames and the tables made or dropped for
  // it; caller holds staged_mu_.
  void DropStagedLocked();
  // The table a caught-up standby's copy of `name` fills until its round
  // ends (null: none; the shard's serves the frame); FAILED_PRECONDITION
  // when the round drops that table.
  Status PendingTable(const std::string& name, std::shared_ptr<Table>* table) const;
  // At a round's end: the tables made or dropped for it take their place.
  Status InstallPending(std::map<std::string, std::shared_ptr<Table>> pending);
  // A standby's StandbyTable or Replicate frame, on the connection that
  // said Hello `replica_hello`-th; *stale when that connection is older than
  // the one that began the latest copy (the frame is refused).
  Status ApplyFromPrimary(const wire::FrameHeader& header, net::Buffer* payload,
                          uint64_t replica_hello, uint32_t* rows, bool* stale);
  std::shared_ptr<Shard> shard_;
  const std::string auth_token_;
  const uint32_t max_frame_bytes_;
  std::atomic<uint32_t> admin_port_{0};
  std::atomic<bool> read_only_{false};
  std::atomic<bool> standby_{false};
  std::atomic<bool> caught_up_{false};
  std::atomic<bool> writes_held_{false};
  std::atomic<int> writes_in_flight_{0};
  // Replica Hellos so far, and the connection (by that count) that began the
  // latest whole copy: frames of connections older than it are refused, so
  // a frame a primary sent before it reconnected (still being read here, or
  // read late) never lands after the copy. Replication frames hold
  // session_mu_ shared while they apply; a copy's start holds it alone.
  std::atomic<uint64_t> replica_hellos_{0};
  std::shared_mutex session_mu_;
  uint64_t session_ = 0;  // guarded by session_mu_
  mutable std::mutex staged_mu_;
  // The round's Replicate payloads and sketch StandbyTable requests, in
  // order; guarded by staged_mu_.
  std::vector<Staged> staged_;
  uint64_t staged_bytes_ = 0;  // guarded by staged_mu_
  // A caught-up standby's tables made (copies under way) or dropped (null)
  // in the round now, by name, installed at its end; guarded by staged_mu_.
  std::map<std::string, std::shared_ptr<Table>> pending_;
  // The connection (by its Hello) that made or dropped them: a round's end
  // on another installs none of them (a copy its lost connection left half
  // done); guarded by staged_mu_.
  uint64_t pending_session_ = 0;
  // The connection (by its Hello) that made the tables named in copied_
  // (those made and not dropped on it since), and the one whose copy's end
  // (kCaughtUp) was applied last: a connection's first round copies every
  // table its primary holds, so at its end this standby drops every other
  // one (dropped there while no connection could tell); guarded by
  // staged_mu_.
  uint64_t copy_session_ = 0;
  std::set<std::string> copied_;
  uint64_t caught_up_session_ = 0;
  uint64_t max_staged_bytes_ = uint64_t{1} << 30;
  net::BufferPool* payload_pool_ = nullptr;
  std::string standbys_;                     // guarded by staged_mu_
  wire::InSyncView insync_;                  // guarded by staged_mu_
  std::shared_ptr<WriteListener> listener_;  // atomic_load / atomic_store only
  ServerCounters* counters_;
  ReshardTarget reshard_target_;
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_REQUEST_HANDLER_H_
