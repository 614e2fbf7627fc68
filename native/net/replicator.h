// A primary's side of the row stream (docs/replication.md): keeps one
// standby shard holding every table of this shard. On connecting it makes
// each table afresh on the standby and copies it whole; afterwards, in
// rounds, it sends the rows each table's change log names as they are then
// (a removed row as a removal). A round's changes are taken after every
// write Applied() marked for it, so a write waiting in Written() (sync
// replication) returns once the standby applied a round that holds it.
// A table replaced here (a load) or whose log overflowed is copied whole
// again; a lost connection is re-made and everything copied again.
#ifndef TF_DLT_NATIVE_NET_REPLICATOR_H_
#define TF_DLT_NATIVE_NET_REPLICATOR_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "native/core/shard.h"
#include "native/core/status.h"
#include "native/net/buffer.h"
#include "native/net/request_handler.h"
#include "native/net/wire.h"

namespace dlt {

struct ReplicatorOptions {
  std::string auth_token;  // the standby's
  // Sync: a write is acknowledged once its standby applied it; async: at
  // once, and the standby lags by up to a round.
  bool sync = true;
  int connect_timeout_ms = 5000;
  // Bound of one frame's exchange with the standby.
  int io_timeout_ms = 30000;
  // Sync: bound of a write's wait for this standby. Past it a group stops
  // counting on the standby (it leaves the in-sync set and is copied
  // afresh), so it stays below clients' request deadline (30 s by
  // default): a standby that stops answering stalls pushes, not fails them.
  int write_timeout_ms = 10000;
  // Rounds run at least this often (rows a pull made, expiry) and, in async
  // mode, this often at most.
  int interval_ms = 10;
  // Largest Replicate payload (capped by the standby's maximum frame).
  uint32_t frame_bytes = 8u << 20;
  // A round's rows are read while the push gate is held and sent after it
  // is released, up to this many bytes of frames; past them the gate stays
  // held until the rest are sent.
  uint64_t round_buffer_bytes = uint64_t{64} << 20;
  // A range stream (live re-sharding, docs/replication.md) instead of a
  // standby: `standby` names a process preparing a shard of the next layout
  // (ReshardTarget), and only the buckets this shard owns of that one's
  // are sent (tables made and dropped by range). It never reconnects: a
  // failure ends it (the re-shard aborts or begins it again).
  bool range_stream = false;
  // The fraction of the time a whole copy may keep this thread busy
  // (0 < copy_pace <= 1): after each batch of rows it waits what the
  // batch took times (1 / copy_pace - 1), leaving the cores to training.
  // A re-shard's streams take it from `tf-dlt reshard --pace`.
  double copy_pace = 1.0;
  // A ReplicaGroup's standby: the group's in-sync set, which each round
  // tells the standby when it changed since last told; called `joining` at
  // the take of a round that copied tables whole (under the push gate: the
  // group counts the standby from then on).
  std::function<wire::InSyncView(bool joining)> view;
  // A ReplicaGroup's standby: called after a round or a connection failed
  // (the group stops counting on this standby).
  std::function<void()> on_failure;
  // Tests only: called in each round right after its take, while the
  // round holds the push gate.
  std::function<void()> after_take;
  // Tests only: called in a round after it copied the tables its take found
  // overflowed, before it takes again (the push gate released).
  std::function<void()> after_copy;
};

struct ReplicationStatus {
  std::string standby;
  bool connected = false;
  // Every table was copied whole since the connection was made.
  bool caught_up = false;
  uint64_t rounds = 0;         // rounds the standby acknowledged
  uint64_t rows_sent = 0;      // rows of rounds and whole copies
  uint64_t removals_sent = 0;  // removed ids
  uint64_t tables_copied = 0;  // whole copies made
  uint64_t connects = 0;       // connections made
  // Seconds since the oldest write not yet on the standby was
  // acknowledged here (0 when the standby holds every acknowledged write).
  double lag_seconds = 0;
  // Seconds since the connection was lost or its last attempt began to
  // fail (0 while connected).
  double down_seconds = 0;
  std::string error;  // the last failure ("" once a round succeeded since)
  // A range stream: the buckets it carries, and whether it ended (failed).
  uint32_t first_bucket = 0, end_bucket = 0;
  bool ended = false;
};

class Replicator : public WriteListener {
 public:
  Replicator(std::shared_ptr<Shard> shard, std::string standby, ReplicatorOptions options);
  ~Replicator() override;
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;

  void Start();
  // Stops the rounds (a frame in flight fails at once); writes waiting in
  // Written() fail. Idempotent.
  void Stop();
  // The first round to take changes after now (after a write applied; an
  // identified push calls it while it holds the push gate, which a round's
  // take waits for).
  uint64_t Applied() override;
  // Sync: returns once round `mark` (Applied's) or a later one is applied on
  // the standby (the first round after connecting copies every table
  // whole); UNAVAILABLE when the standby is known to be down, or the round
  // or the connection fails; DEADLINE_EXCEEDED past write_timeout. Async: OK
  // at once.
  Status Written(uint64_t mark) override { return Written(mark, 0); }
  // As Written, and the round that acknowledges it (or a later one) told
  // the standby the group's view `view_version` or a later one; waits at
  // most timeout_ms (0: write_timeout).
  Status Written(uint64_t mark, uint64_t view_version, int timeout_ms = 0);
  // As Written, in either mode: an async primary's admin-plane writes (a
  // load, a table made or dropped) wait for the standby as a sync one's do.
  Status Held(uint64_t mark, int timeout_ms);
  // Shuts the connection down: a frame in flight fails at once, and the
  // next round connects again and copies every table whole (a group gave
  // up waiting for this standby; Stop uses it too).
  void Reconnect();
  // A live re-shard (docs/replication.md), while writes are held. Pausing
  // runs one more round (every write acknowledged is on the standby), then
  // begins no round or connection until resumed; DEADLINE_EXCEEDED when
  // the round in progress outlasts io_timeout (paused all the same).
  Status Pause(bool pause);
  // Pauses, logs `first`, swaps; the standby holds the tables swap returns
  // as they are then (the re-shard's range streams made them there too, or
  // they are those a switch left and its undoing serves again): their
  // changes are sent from then on, nothing copied. When the standby was
  // not caught up (a connection being made, a copy under way) the next
  // round copies them whole instead.
  void Follow(const std::vector<std::shared_ptr<Table>>& first,
              const std::function<std::vector<std::shared_ptr<Table>>()>& swap) override;
  ReplicationStatus status() const;
  const std::string& standby() const { return standby_; }

 private:
  // Written's wait for round `need` (and view `view_version`); mu_ held.
  Status WaitWritten(std::unique_lock<std::mutex>& lock, uint64_t need, uint64_t view_version,
                     int timeout_ms);
  void Run();
  // Connects and says Hello (the standby must be this shard's index of
  // the same count; a range stream's target a shard sharing buckets with
  // this one).
  Status Connect();
  // After the standby refused to follow this primary because it serves
  // trainers: whether it serves this shard (its place, layout and lineage)
  // at a newer epoch, that is took over from this primary (paused or cut
  // off past the takeover, with no other standby left to tell it so). If
  // so this primary is superseded and the refusal says so.
  Status CheckTakenOver(Status refused, std::chrono::steady_clock::time_point deadline);
  bool InRange(uint32_t bucket) const { return bucket >= first_ && bucket < end_; }
  // Keeps the ids and sketch hashes of the buckets this stream carries.
  void KeepInRange(std::vector<int64_t>* ids, std::vector<uint64_t>* hashes) const;
  void Disconnect();
  // One round over every table; `round` counts rounds begun.
  Status Round(uint64_t round);
  // Makes `table` afresh on the standby and sends all its rows.
  Status CopyWhole(const std::shared_ptr<Table>& table);
  // Waits after a copy's batch that kept the thread busy `busy` (copy_pace);
  // UNAVAILABLE when stopped meanwhile.
  Status Pace(std::chrono::steady_clock::duration busy);
  // A Replicate frame of a round: the rows of some changed ids as they were
  // read (absent ones as removals).
  struct Frame {
    net::Buffer payload;
    size_t bytes = 0;
    uint64_t rows = 0, removals = 0;
  };
  struct FrameJob {
    Table* table;
    const int64_t* ids;
    size_t n;
  };
  // Reads the rows of `job` into `frame`, in place in its payload.
  static Status ReadFrame(const FrameJob& job, Frame* frame);
  // Reads jobs [begin, end) into frames_[0, end - begin), a few at once.
  Status ReadFrames(const std::vector<FrameJob>& jobs, size_t begin, size_t end);
  // Sends frames_[0, count) over the connection and its lanes, several in
  // flight on each, and awaits their replies.
  Status SendFrames(size_t count);
  // Sends frames_[first], frames_[first + stride], ... on `fd`, the frame at
  // index i with request id `first_id` + i.
  Status SendOn(int fd, size_t first, size_t stride, size_t count, uint64_t first_id);
  // Tells the standby `view` (the group's in-sync set).
  Status SendView(const wire::InSyncView& view);
  // Sends `table`'s admission sketch whole, slice by slice (after its rows).
  Status SendSketchSlices(Table* table);
  // Sends the hashes pushes counted in `table`'s sketch, in order.
  Status SendSketchCounts(Table* table, const std::vector<uint64_t>& hashes);
  Status SendTable(uint32_t action, const TableConfig& config);
  Status SendStandbyTable(uint32_t action, std::string bytes);
  // Tells the standby when `table`'s provisional flag is not what it holds.
  Status SendProvisional(const Table& table);
  Status SendRows(Table* table, const RowBuffers& rows, size_t n, const int64_t* removed,
                  size_t num_removed);
  // The replicating thread's buffers for `rows` rows of `table`.
  RowBuffers RowsFor(const Table& table, size_t rows);
  // Rows per Replicate frame of `table`.
  size_t RowsPerFrame(const Table& table) const;
  // Items of `each` bytes that fit a frame after `fixed` bytes (at least 1):
  // frames are at most options_.frame_bytes, and the standby's maximum.
  size_t PerFrame(uint64_t fixed, uint64_t each) const;
  Status Call(uint8_t opcode, const void* payload, size_t bytes);

  const std::shared_ptr<Shard> shard_;
  const std::string standby_;
  const ReplicatorOptions options_;

  // This stream's change logs and push ids (Shard::AcquireStream);
  // kNoStream when none was free.
  static constexpr uint32_t kNoStream = ~0u;
  uint32_t stream_ = kNoStream;
  // The buckets sent: all for a standby, a range stream's from its Hello.
  uint32_t first_ = 0, end_ = kNumBuckets;

  // The replicating thread's own state.
  // Written by the replicating thread under fd_mu_; Stop shuts it down.
  std::mutex fd_mu_;
  int fd_ = -1;
  // More connections to the standby that carry a round's rows beside fd_
  // (none under 4 cores).
  std::vector<int> lanes_;
  uint32_t standby_frame_bytes_ = 0;
  uint64_t next_request_id_ = 1;
  // The tables the standby holds as this thread made them there.
  std::map<std::string, std::shared_ptr<Table>> mirrored_;
  // A range stream: each table's push clock as last sent.
  std::map<std::string, uint64_t> clocks_sent_;
  // The tables the standby was last told are provisional.
  std::map<std::string, bool> provisional_;
  bool marked_ = false;  // the standby was told it caught up since connecting
  // When the last round ended: an idle standby gets an empty round each
  // kHeartbeatMs, so a primary that was replaced learns it without a write.
  std::chrono::steady_clock::time_point last_end_{};
  uint64_t view_told_ = 0;   // the group's view version told on this connection
  uint64_t round_view_ = 0;  // the view version the last round told (or had told)
  std::vector<char> frame_;
  std::vector<Frame> frames_;  // a round's, kept for the next
  struct Scratch {
    std::vector<int64_t> ids;
    std::vector<float> values, slots;
    std::vector<uint32_t> steps, touched, buckets;
    std::vector<uint32_t> slice_buckets, slice_added;  // a sketch's slices
    std::vector<uint8_t> slice_counters;
  };
  Scratch scratch_;

  mutable std::mutex mu_;
  std::condition_variable cv_;        // rounds began or ended; a write waits
  std::thread thread_;                // guarded by mu_
  bool stop_ = false;                 // guarded by mu_
  bool wanted_ = false;               // a write waits for a round; guarded by mu_
  bool paused_ = false;               // Pause; guarded by mu_
  bool busy_ = false;                 // a round or a connection is under way; guarded by mu_
  uint64_t begun_ = 0, applied_ = 0;  // rounds; guarded by mu_
  // The last round whose take began (its changes taken after every write
  // applied before then); guarded by mu_.
  uint64_t taken_ = 0;
  uint64_t failed_ = 0;  // the last round that failed; guarded by mu_
  // The view version the last applied round had told; guarded by mu_.
  uint64_t view_applied_ = 0;
  uint64_t connect_failures_ = 0;  // guarded by mu_
  // When the oldest write acknowledged but not on the standby was
  // acknowledged (async); guarded by mu_.
  std::chrono::steady_clock::time_point unsent_since_{};
  ReplicationStatus status_;  // guarded by mu_
  // When the standby was last known down (connection lost or refused);
  // zero while connected or before the first attempt; guarded by mu_.
  std::chrono::steady_clock::time_point down_since_{};
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_REPLICATOR_H_
