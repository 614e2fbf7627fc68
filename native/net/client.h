// C++ client of the data plane (no TF headers): a connection pool per shard,
// connect and request deadlines, reconnects, and pipelined requests. One call
// sends every frame it needs to every touched shard at once and gathers the
// replies, matched by request id: a small call on the calling thread, a large
// one on several connections per shard at once, each sent, received and
// placed by a thread of its own (the calling thread is one of them).
#ifndef TF_DLT_NATIVE_NET_CLIENT_H_
#define TF_DLT_NATIVE_NET_CLIENT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "native/core/pull_mode.h"
#include "native/core/push_ledger.h"
#include "native/core/status.h"
#include "native/net/buffer.h"
#include "native/net/wire.h"

namespace dlt {

struct ClientOptions {
  std::string auth_token;
  int connect_timeout_ms = 5000;
  // Deadline of one Pull or Push across all its shards and frames.
  int request_timeout_ms = 30000;
  // Target payload bytes per frame; large batches are split into frames of at
  // most this size (and never above the server's maximum).
  uint32_t frame_bytes = 8u << 20;
  // Idle connections kept per shard, each closed once idle this long
  // (shorter than the servers' idle timeout, so a pooled connection is
  // never one the server already closed).
  int max_idle_connections = 8;
  int idle_close_ms = 60000;
  // A shard is greeted again (a new connection, its Hello) once its last
  // Hello is this old, so the client learns standbys that attached since
  // and layouts that changed in its place (0: never).
  int regreet_ms = 10000;
  // A pull that fails with UNAVAILABLE (a shard restarting, a dropped
  // connection) is repeated up to this many times, after retry_backoff_ms,
  // doubling, while the request deadline allows. Pulls are idempotent;
  // pushes are repeated only when nothing was sent (a shard not reached at
  // its first greeting), never once a frame went out (one may have been
  // applied before its reply was lost).
  int pull_retries = 3;
  int retry_backoff_ms = 50;
  // A shard's address may list its standbys after its primary, "a|b"
  // (docs/replication.md), and a primary names its standbys in its Hello:
  // a connection goes to the first of them that greets a trainer (a
  // standby does once it took over) and is not older (by epoch) than a copy
  // met before; the first greeting of such a shard takes the newest copy.
  // Pulls and pushes to such shards are retried until the request
  // deadline, pausing at most kFailoverBackoffMs.
  // Threads (the calling one included) that exchange a large call's parts
  // with the shards at once, each on a connection of its own: a shard's part
  // of at least 2 MiB is split over several; a smaller part of 4,096 rows or
  // more over up to 4 connections in one loop, for the shard's worker
  // threads. 0: one per core, at most 16, on machines of 4 cores or more,
  // else 1; 1: everything on the calling thread, one connection per shard.
  int exchange_threads = 0;
};

inline constexpr int kFailoverBackoffMs = 200;
// Client::NewerLayoutThan asks the shards at most this often.
inline constexpr int kLayoutProbeMs = 200;
// The longest one Hello asking a shard for its layout may take.
inline constexpr int kAskLayoutMs = 1000;
// A call that has heard nothing for kSilentMs from a shard with standbys
// asks the shard's other addresses whether one took over (a primary host
// that died without a reset, or a process that hangs, never closes its
// connections), at most once per kSilenceProbeMs per shard; and a
// connection to such a shard (its connect and Hello) waits at most
// kReplicaConnectMs before the next address is tried.
inline constexpr int kSilentMs = 1000;
inline constexpr int kSilenceProbeMs = 200;
inline constexpr int kReplicaConnectMs = 2000;

struct ShardInfo {
  std::string address;
  // The shard's addresses as this client knows them ('|' between them):
  // those it was given, then standbys its Hellos named.
  std::string replicas;
  uint32_t shard_index = 0;
  uint32_t num_shards = 0;
  uint32_t admin_port = 0;
  uint32_t max_frame_bytes = 0;
  // The lineage of the copy this client met (0: none said one): a process
  // of another lineage restarted with none of its rows. And the newest
  // epoch it met of the shard.
  uint64_t lineage = 0;
  uint64_t epoch = 0;
};

class Client {
 public:
  Client(std::vector<std::string> addresses, ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The shards of the layout this client routes by, and its epoch (1 until
  // it met a re-shard: then it follows the shards' layout,
  // docs/replication.md).
  size_t num_shards() const;
  uint64_t layout_epoch() const;
  const ClientOptions& options() const { return options_; }

  // Says Hello to every shard (if not done yet) and returns what they said.
  Status GetShardInfos(std::vector<ShardInfo>* infos);
  // Greets every shard again as a new client would (the newest copy its
  // addresses serve, of whatever lineage), forgetting the copies met
  // before; pooled connections are closed. Before a checkpoint is loaded
  // onto every shard (they agree again): a shard restarted meanwhile then
  // fails no call of this client DATA_LOSS for rows the load replaces.
  Status Regreet();
  // The lineage of the copy of each shard this client met (0 for a shard it
  // has not greeted), in shard order; no call is made. Another client that
  // writes for this one (a save) writes only to copies of these.
  std::vector<uint64_t> MetLineages() const;
  // Closes every pooled connection now (a client its owner is done with:
  // each holds a slot of the shard's --max-connections until closed). A
  // later call connects again.
  void CloseIdle();

  // Rows of `ids` into `out` ([n, dim]); routed by bucket, one pipelined
  // exchange per touched shard, all shards at once. Retried once on a fresh
  // connection when a pooled connection turned out to be dead. With
  // `dedup`, each distinct id is sent once and its row copied to its
  // repeats; without, every id is sent (the shards answer repeats alike).
  // `sent`: how many ids went to the shards.
  Status Pull(const std::string& table, uint32_t dim, const int64_t* ids, size_t n, PullMode mode,
              float* out, bool dedup = false, size_t* sent = nullptr);
  // Pull's kState: the rows of `ids` with their optimizer state, into `out`
  // ([n, StateFloats(dim, slot_floats)]); nothing is inserted. With
  // `insert` (kStateInsert, a trainer's), an id the shard holds no row for
  // in RAM is pulled as kInsert pulls it (Table::PullState). Retried as
  // Pull. The shards' tables must have `slot_floats` slot floats per row.
  Status PullState(const std::string& table, uint32_t dim, uint32_t slot_floats, const int64_t* ids,
                   size_t n, float* out, bool insert = false);

  // Sends gradients ([n, dim]) to the owning shards. Not retried: the shard
  // may have applied it; except when shards list standbys: then each frame
  // carries an id, and a push that met UNAVAILABLE is sent again (until the
  // request deadline), the shards applying each frame once. Frames a shard
  // refused unapplied (ABORTED: a re-shard's switch) are sent again, routed
  // by the newer layout once the shards have one, until the deadline; so
  // are pulls.
  // Every occurrence of an id goes in one frame, as a shard sums an id's
  // rows within a frame (one past `frame_bytes` where the id repeats more
  // often than that holds, up to the shard's maximum).
  Status Push(const std::string& table, uint32_t dim, const int64_t* ids, const float* grads,
              size_t n, float learning_rate);

  // Sets the values of rows (fresh optimizer slots), e.g. to upload an
  // existing embedding. Rejects non-finite values. Not retried.
  Status Assign(const std::string& table, uint32_t dim, const int64_t* ids, const float* values,
                size_t n);

  // Which shard each id routes to.
  uint32_t ShardOf(int64_t id) const;
  // Asks the shards for their layout and routes by a newer one from now on
  // (a control plane that lists the shards); true when it changed.
  bool LearnNewerLayout();

 private:
  struct ShardState;
  struct Layout;
  struct Call;
  // A connection with its receive buffer, kept together in the pool so big
  // replies do not cost fresh memory on every call.
  struct Conn {
    int fd = -1;
    bool reused = false;
    uint64_t switches = 0;  // the shard's ShardState::switches when it was made
    net::Buffer buffer;
    int64_t idle_since_ms = 0;  // when it went back to the pool
  };

  // A pooled connection that is still open, or a new one (connected and
  // greeted; a Hello refused with RESOURCE_EXHAUSTED is retried with backoff
  // within the connect timeout). `deadline`: the request's; no connect or
  // Hello waits past it (UNAVAILABLE then, as a connect timeout is).
  Status Acquire(ShardState& shard, Conn* conn, std::chrono::steady_clock::time_point deadline);
  // Connects to the shard's current address, else to its others in order
  // (those that are down or standbys answer UNAVAILABLE), by `deadline`.
  Status Connect(ShardState& shard, int* fd, std::chrono::steady_clock::time_point deadline);
  Status ConnectTo(ShardState& shard, const std::string& address, int* fd, wire::HelloReply* reply,
                   std::chrono::steady_clock::time_point deadline);
  void Release(ShardState& shard, Conn conn);
  // Says Hello on `fd` (to `address`): checks the shard's place (ABORTED
  // when it serves a newer layout), refuses (UNAVAILABLE) a copy older than
  // one met before, or one of another lineage than the one met (a process
  // started since: it holds none of the rows written before), learns the
  // standbys it names.
  Status Hello(ShardState& shard, const std::string& address, int fd, wire::HelloReply* reply,
               std::chrono::steady_clock::time_point deadline);
  // After every address of `shard` refused a call, one of them as a copy of
  // another lineage (restarted_lineage): DATA_LOSS, and that lineage and its
  // newest epoch are the shard's from now on, when each address serves that
  // lineage, is a standby (of another lineage than the one met) or a
  // replaced copy (its Hello UNAVAILABLE), or refuses connections, and one
  // serves. A shard restarted, or a whole replica set, is followed so; a
  // copy of the lineage met (serving, or a standby that may take over), or
  // an address that does not answer, keeps the refusal (OK: the call's own
  // error stands; docs/replication.md).
  Status FollowRestart(ShardState& shard, std::chrono::steady_clock::time_point deadline);
  // Whether `address` is a standby of `shard` following a copy of `lineage`
  // (it answers a replica's Hello naming it).
  bool FollowsLineage(const ShardState& shard, const std::string& address, uint64_t lineage);
  // Uses `address` for `shard` from now on, with what its Hello said (a
  // kept address so met is kept no more).
  void Adopt(ShardState& shard, const std::string& address, const wire::HelloReply& reply);
  // The payload bytes of a frame to `shard`: the client's frame_bytes
  // within the shard's maximum (`ours`), and that maximum (`shard`).
  struct FrameLimits {
    uint32_t ours, shard;
  };
  FrameLimits FrameLimit(ShardState& shard);
  // The layout calls route by now.
  std::shared_ptr<const Layout> CurrentLayout() const;
  // After a shard refused a request of layout `seen` (ABORTED): asks the
  // shards for their layout and routes by a newer one from now on. OK when
  // a layout newer than `seen` is in use (learned here or by another call);
  // ABORTED when none is known yet (the switch is under way). No address
  // is asked past `deadline` (the request's), nor waited for beyond it.
  Status LearnLayout(const Layout& seen, std::chrono::steady_clock::time_point deadline);
  // After a shard of layout `seen` could not be reached (nothing sent to
  // it): true when a newer layout is in use or the first other shard that
  // answers serves one (now in use). A switch whose joining process died is
  // undone as a newer layout, which that shard never serves. At most one
  // probe per kLayoutProbeMs that found nothing, so a failover does not
  // make every client greet every shard on each retry.
  // Asks no longer than `deadline` (the call's).
  bool NewerLayoutThan(const Layout& seen, const ShardState* unreachable,
                       std::chrono::steady_clock::time_point deadline);
  // `s` from a shard that could not be reached (nothing sent to it), as
  // ABORTED when its layout was left or another shard serves a newer one
  // (a re-shard replaced it, or undid the switch that brought it: routed
  // by the newer layout); else `s`.
  Status UnlessLayoutLeft(const ShardState& shard, const Status& s,
                          std::chrono::steady_clock::time_point deadline);
  // Before a call is made again after UNAVAILABLE: pauses `*backoff_ms`,
  // doubling (to kFailoverBackoffMs with standbys), and counts the retry;
  // false when none is left (pull_retries without standbys, or the
  // deadline would pass).
  bool PauseToRetry(int* retries, int* backoff_ms, std::chrono::steady_clock::time_point deadline);
  // While a call has heard nothing for `silent_ms` on a connection to
  // `shard` (which lists standbys) made at its `switches`: UNAVAILABLE when
  // the shard's copy was replaced since (another call found it), or another
  // of its addresses serves it now at a newer epoch (a standby took over
  // from a primary that went silent: connections go there from now on);
  // else OK, to go on waiting. Asks no longer than `deadline` (the call's).
  Status CheckSilent(ShardState& shard, uint64_t switches, int64_t silent_ms,
                     std::chrono::steady_clock::time_point deadline);
  // One Hello to `address` on a connection of its own, within kAskLayoutMs
  // and by `deadline`: what it said (false: no answer).
  bool AskLayout(const std::string& address, wire::HelloReply* reply,
                 std::chrono::steady_clock::time_point deadline);
  // Routes by layout `epoch` of `addresses` ("a|a2,b,...") from now on;
  // caller holds layout_mu_.
  void UseLayoutLocked(const Layout& seen, uint64_t epoch, const std::string& addresses);
  // Waits before sending refused requests again: none when a newer layout
  // was learned; else `*backoff_ms`, doubling to kFailoverBackoffMs. False
  // when the deadline would pass.
  bool AwaitLayout(const Layout& seen, int* backoff_ms,
                   std::chrono::steady_clock::time_point deadline);
  // Greets every shard of `layout` (once) and groups the positions of `ids`
  // by shard; with `repeats`, each distinct id once (GroupByShard in
  // client.cc).
  Status Route(const Layout& layout, const int64_t* ids, size_t n,
               std::chrono::steady_clock::time_point deadline,
               std::vector<std::vector<uint32_t>>* groups,
               std::vector<std::pair<uint32_t, uint32_t>>* repeats = nullptr);
  Status GreetAll(const Layout& layout, std::vector<ShardInfo>* infos,
                  std::chrono::steady_clock::time_point deadline);
  // The most rows per frame to `shard` whose request (prefix_bytes plus
  // request_row_bytes per row) and reply (reply_row_bytes per row, 0: none)
  // fit its frame limit; and, if `most_rows`, the most such request rows a
  // frame of the shard's own maximum holds (at least `*rows`).
  Status RowsPerFrame(ShardState& shard, const char* op, uint32_t dim, size_t prefix_bytes,
                      size_t request_row_bytes, size_t reply_row_bytes, size_t* rows,
                      size_t* most_rows = nullptr);
  // Sends every call's frames and receives their replies: the calls at once
  // on threads of their own when they are large enough to pay for it
  // (ExchangeOn each), else all on the calling thread (one ExchangeOn).
  // `deadline`: the whole request's (a retry gets what is left of it).
  Status Exchange(std::vector<Call>* calls, const char* op,
                  std::chrono::steady_clock::time_point deadline, bool* any_reused);
  Status ExchangeOn(Call* calls, size_t count, const char* op,
                    std::chrono::steady_clock::time_point deadline, bool* any_reused);
  // How many connections a shard's part of `bytes` (request and reply) gets
  // when `touched` shards share the call.
  size_t LanesFor(size_t rows, size_t bytes, size_t touched) const;
  // A call for rows [first, end) of `shard`'s part, on a connection of its
  // own: frames of at most `rows_per_frame` rows (or those starting at
  // `cuts`, then `end`), each appended by add_frame(its first row, its rows,
  // the call).
  static Call RunCall(size_t shard, ShardState* state, wire::Opcode opcode, size_t first,
                      size_t end, size_t rows_per_frame, std::function<void(size_t, size_t)> fill,
                      const std::function<void(size_t, size_t, Call*)>& add_frame,
                      std::vector<size_t> cuts = {});
  // Push and Assign until `deadline`. With `ancestors`, the rows were one
  // frame a shard refused unapplied, the last of them its id (the others:
  // frames it was a part of in turn): each shard's part goes in frames of
  // ids of their own naming them (wire::kPushPart), so a shard that
  // applied one of them whole does not apply the part, and parts applied
  // on one shard never pass for each other.
  Status SendRows(wire::Opcode opcode, const std::string& table, uint32_t dim, const int64_t* ids,
                  const float* rows, size_t n, float learning_rate,
                  std::chrono::steady_clock::time_point deadline,
                  const std::vector<PushId>* ancestors);
  // Pull and PullState: rows of `row_floats` floats, retried.
  Status PullRows(const std::string& table, uint32_t dim, const int64_t* ids, size_t n,
                  PullMode mode, uint32_t row_floats, float* out, bool dedup, size_t* sent);
  Status PullOnce(const Layout& layout, const std::string& table, uint32_t dim, const int64_t* ids,
                  size_t n, PullMode mode, uint32_t row_floats, float* out, bool dedup,
                  size_t* sent, std::chrono::steady_clock::time_point deadline, bool* any_reused);
  // "shard N (address) op", the prefix of a shard's errors.
  std::string Context(const ShardState& shard, const char* op) const;
  static std::string Context(uint32_t index, const std::string& address, const char* op);
  // The greeting's: a shard with standbys names them all (its error says
  // what each address said).
  std::string GreetingContext(const ShardState& st) const;

  const ClientOptions options_;
  // Every shard this client met, by layout (a re-shard's makes new ones);
  // guarded by layout_mu_, which also orders writes of layout_.
  std::timed_mutex layout_mu_;
  std::vector<std::unique_ptr<ShardState>> states_;
  std::shared_ptr<const Layout> layout_;  // std::atomic_load / atomic_store only
  // When NewerLayoutThan last asked and found nothing, and where it starts
  // next; guarded by layout_mu_.
  std::chrono::steady_clock::time_point last_probe_{};
  size_t next_probe_ = 0;
  std::atomic<bool> has_standbys_{false};  // some shard lists standbys (given or learned)
  // Ids of pushes to shards with standbys: this client's, and the next frame's.
  uint64_t client_id_ = 0;
  std::atomic<uint64_t> next_push_seq_{1};
  std::atomic<uint64_t> next_request_id_{1};
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_CLIENT_H_
