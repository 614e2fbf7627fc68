// The data-plane client's connections: one pool per shard, connecting with
// backoff within the deadline, the Hello that authenticates and learns the
// shard's limits, and returning connections to the pool.
#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "native/core/routing.h"
#include "native/net/buffer.h"
#include "native/net/client.h"
#include "native/net/client_call.h"
#include "native/net/frame_call.h"
#include "native/net/socket.h"

namespace dlt {

using net::Clock;

namespace {

// Receive buffers above this size are freed when their connection goes idle.
constexpr size_t kKeepBufferBytes = 64u << 20;

// A shard's addresses as given: primary|standby|...
std::string Joined(const std::vector<std::string>& addresses) {
  std::string all;
  for (const std::string& a : addresses) all += (all.empty() ? "" : "|") + a;
  return all;
}

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

Status Client::Hello(ShardState& st, const std::string& address, int fd, wire::HelloReply* reply,
                     Clock::time_point deadline) {
  DLT_RETURN_IF_ERROR(
      net::SayHello(fd, options_.auth_token, wire::kFlagTopology, 0, deadline, reply));
  bool kept;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    kept = st.Kept(address);
  }
  if (kept && (reply->num_shards != st.count || reply->shard_index != st.index ||
               reply->layout_epoch < st.layout_epoch)) {
    // Named for this shard before the layout: it serves elsewhere now, or
    // an older layout (restarted with its flags), never this place.
    return Unavailable(address + " was shard " + std::to_string(st.index) +
                       "'s before layout epoch " + std::to_string(st.layout_epoch) +
                       " and serves shard " + std::to_string(reply->shard_index) + " of " +
                       std::to_string(reply->num_shards) + " at layout epoch " +
                       std::to_string(reply->layout_epoch) + ": passed over");
  }
  if (reply->num_shards != st.count || reply->shard_index != st.index) {
    const std::string place = "server says it is shard " + std::to_string(reply->shard_index) +
                              " of " + std::to_string(reply->num_shards) +
                              ", but the client lists it as shard " + std::to_string(st.index) +
                              " of " + std::to_string(st.count);
    if (reply->layout_epoch > st.layout_epoch) {
      // Re-sharded since this client learned its layout: it learns the new one.
      return Aborted(place + " of layout epoch " + std::to_string(st.layout_epoch) +
                     "; the server is at layout epoch " + std::to_string(reply->layout_epoch));
    }
    if (reply->layout_epoch < st.layout_epoch) {
      // A re-shard's switch has not reached it yet: writes are held
      // meanwhile, and the client waits for it as for held writes.
      return Aborted(place + " of layout epoch " + std::to_string(st.layout_epoch) +
                     "; the server has not switched from layout epoch " +
                     std::to_string(reply->layout_epoch) +
                     " yet (a re-shard under way), or was started again with the flags of that "
                     "layout: this place is --shard-index " +
                     std::to_string(st.index) + " --num-shards " + std::to_string(st.count));
    }
    if (reply->num_shards != st.count) {
      return FailedPrecondition(place + ": the cluster has " + std::to_string(reply->num_shards) +
                                " shards and the client lists " + std::to_string(st.count) +
                                "; list every shard's address, in shard-index order");
    }
    return FailedPrecondition(place + "; list the shard addresses in shard-index order");
  }
  if (reply->layout_epoch > st.layout_epoch && !reply->layout.empty()) {
    // In its place still, but re-sharded since (a shard of the same count
    // replaced, or a switch undone): the new layout may route elsewhere.
    return Aborted("shard " + std::to_string(st.index) + " at " + address +
                   " serves layout epoch " + std::to_string(reply->layout_epoch) +
                   ", newer than this client's " + std::to_string(st.layout_epoch));
  }
  std::lock_guard<std::mutex> lock(st.mu);
  const bool other_lineage = reply->lineage != 0 && st.lineage != 0 && reply->lineage != st.lineage;
  // Noted for FollowRestart only once the shard was met: a first greeting
  // takes the newest copy of any lineage.
  if (other_lineage && st.greeted) st.restarted_lineage = reply->lineage;
  if (reply->epoch < st.epoch) {
    // A primary that came back after its standby took over, or one cut off
    // from clients that moved on: never the copy to use. One of another
    // lineage may be a replica set restarted whole (FollowRestart).
    return Unavailable("shard " + std::to_string(st.index) + " at " + address + " is at epoch " +
                       std::to_string(reply->epoch) + ", older than epoch " +
                       std::to_string(st.epoch) + " this client met: its standby took over");
  }
  if (other_lineage && st.greeted) {
    // A process that started since this client met the shard: it holds
    // none of the rows written to the copy met (or a checkpoint's), while
    // a standby of that copy may still take over. Used only once no
    // address of the shard serves or follows that copy (FollowRestart),
    // and then the call fails DATA_LOSS: never silently.
    return Unavailable("shard " + std::to_string(st.index) + " at " + address +
                       " is a process that started since this client met the shard (another "
                       "lineage): the rows written to the shard before are not there");
  }
  st.epoch = reply->epoch;
  if (reply->lineage != 0) st.lineage = reply->lineage;
  // Standbys the primary names, after those the client was given.
  for (size_t from = 0; from < reply->standbys.size();) {
    size_t bar = reply->standbys.find('|', from);
    if (bar == std::string::npos) bar = reply->standbys.size();
    const std::string standby = reply->standbys.substr(from, bar - from);
    if (!standby.empty() &&
        std::find(st.addresses.begin(), st.addresses.end(), standby) == st.addresses.end()) {
      st.addresses.push_back(standby);
      has_standbys_.store(true);
    }
    // Kept from the layout before, and named by this place's copy: its own.
    st.Unkeep(standby);
    from = bar + 1;
  }
  return OkStatus();
}

void Client::Adopt(ShardState& st, const std::string& address, const wire::HelloReply& reply) {
  std::lock_guard<std::mutex> lock(st.mu);
  st.Unkeep(address);
  // The copy used from now on is this one (a first greeting's other
  // addresses may have answered at the same epoch, of another lineage),
  // and a restart noted before it is no longer in question.
  st.epoch = std::max(st.epoch, reply.epoch);
  if (reply.lineage != 0) st.lineage = reply.lineage;
  st.restarted_lineage = 0;
  st.address = address;
  st.info.address = address;
  st.info.shard_index = reply.shard_index;
  st.info.num_shards = reply.num_shards;
  st.info.admin_port = reply.admin_port;
  st.info.max_frame_bytes = reply.max_frame_bytes;
  st.greeted = true;
  st.greeted_ms = NowMs();
}

Status Client::Acquire(ShardState& st, Conn* conn, Clock::time_point deadline) {
  const int64_t now = NowMs();
  uint64_t switches;
  for (;;) {
    Conn pooled;
    {
      std::lock_guard<std::mutex> lock(st.mu);
      switches = st.switches;
      if (st.idle.empty()) break;
      // Time for a Hello: a new connection (the pooled ones stay).
      if (options_.regreet_ms > 0 && now - st.greeted_ms > options_.regreet_ms) break;
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
  DLT_RETURN_IF_ERROR(Connect(st, &fd, deadline));
  conn->fd = fd;
  conn->reused = false;
  conn->switches = switches;
  return OkStatus();
}

Status Client::Connect(ShardState& st, int* out_fd, Clock::time_point deadline) {
  std::vector<std::string> addresses;
  std::string current;
  bool first;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    addresses = st.addresses;
    current = st.address;
    first = !st.greeted;
  }
  wire::HelloReply reply;
  if (first && addresses.size() > 1) {
    // The first greeting of a shard with standbys: the newest copy that
    // greets wins (a primary that came back empty after its standby took
    // over is older than that standby).
    int best = -1;
    uint64_t best_epoch = 0;
    Status last = Unavailable("no address greets");
    Status misplaced;
    std::string tried;  // what each address that did not greet said
    for (const std::string& address : addresses) {
      int fd = -1;
      wire::HelloReply r;
      const Status s = ConnectTo(st, address, &fd, &r, deadline);
      if (!s.ok()) {
        tried += (tried.empty() ? "" : "; ") + address + ": " + s.message();
        if (s.code() == Code::kFailedPrecondition) {
          // Another place (a member restarted with stale flags): the next
          // address may greet; said only when none does.
          if (misplaced.ok()) misplaced = s;
          continue;
        }
        if (s.code() != Code::kUnavailable) {
          if (best >= 0) net::CloseFd(best);
          return s.WithContext(address);
        }
        last = s;
        continue;
      }
      if (best >= 0 && r.epoch <= best_epoch) {
        net::CloseFd(fd);
        continue;
      }
      if (best >= 0) net::CloseFd(best);
      best = fd;
      best_epoch = r.epoch;
      reply = r;
      current = address;
    }
    if (best < 0) return Status((misplaced.ok() ? last : misplaced).code(), tried);
    Adopt(st, current, reply);
    *out_fd = best;
    return OkStatus();
  }
  // The address last connected to first, then the others.
  std::vector<std::string> order = {current};
  for (const std::string& other : addresses) {
    if (other != current) order.push_back(other);
  }
  Status s, misplaced;  // misplaced: as above
  std::string tried;
  for (const std::string& address : order) {
    s = ConnectTo(st, address, out_fd, &reply, deadline);
    if (s.ok()) {
      Adopt(st, address, reply);
      return s;
    }
    if (order.size() > 1) {  // which address said what
      tried += (tried.empty() ? "" : "; ") + address + ": " + s.message();
      s = Status(s.code(), tried);
    }
    if (s.code() == Code::kFailedPrecondition) {
      if (misplaced.ok()) misplaced = s;
    } else if (s.code() != Code::kUnavailable) {
      return s;
    }
  }
  if (misplaced.ok()) {
    // Followed from now on; this call fails, never retried: what the shard
    // held is gone, and the trainer must know (resilient_fit reloads).
    const Status restarted = FollowRestart(st, deadline);
    if (!restarted.ok()) return restarted;
  }
  return misplaced.ok() ? s : misplaced;
}

Status Client::FollowRestart(ShardState& st, Clock::time_point call_deadline) {
  std::vector<std::string> addresses;
  uint64_t known, candidate;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    for (const std::string& a : st.addresses) {
      if (!st.Kept(a)) addresses.push_back(a);  // a kept one serves no copy of this place
    }
    known = st.lineage;
    candidate = st.restarted_lineage;
    st.restarted_lineage = 0;
  }
  // None, or the lineage already followed (another call took it meanwhile).
  if (candidate == 0 || candidate == known) return OkStatus();
  uint64_t newest = 0;
  bool serves = false;
  for (const std::string& address : addresses) {
    const Clock::time_point deadline =
        std::min(call_deadline, Clock::now() + std::chrono::milliseconds(std::min(
                                                   options_.connect_timeout_ms, kAskLayoutMs)));
    int fd = -1;
    bool refused = false;
    if (!net::Connect(address, deadline, &fd, &refused).ok()) {
      if (refused) continue;  // nothing listens there
      return OkStatus();      // no answer: it may serve the lineage met
    }
    wire::HelloReply r;
    const Status s = net::SayHello(fd, options_.auth_token, wire::kFlagTopology, 0, deadline, &r);
    net::CloseFd(fd);
    if (s.code() == Code::kUnavailable) {
      // A standby, or a copy replaced: serves none. A standby of the copy
      // this client met may take over with every row: wait for it.
      if (FollowsLineage(st, address, known)) return OkStatus();
      continue;
    }
    if (!s.ok() || r.lineage != candidate || r.shard_index != st.index ||
        r.num_shards != st.count) {
      return OkStatus();
    }
    newest = std::max(newest, r.epoch);
    serves = true;
  }
  if (!serves) return OkStatus();
  uint64_t epoch;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.lineage != known) return OkStatus();  // another call followed it meanwhile
    epoch = st.epoch;
    st.lineage = candidate;
    st.epoch = newest;
  }
  return DataLoss("shard " + std::to_string(st.index) + ": every copy of the shard at epoch " +
                  std::to_string(epoch) +
                  " is gone, and its restarted processes serve from epoch " +
                  std::to_string(newest) +
                  " afresh (what they loaded, or nothing); the client uses them from now on. "
                  "Reload a checkpoint so that every shard agrees again");
}

bool Client::FollowsLineage(const ShardState& st, const std::string& address, uint64_t lineage) {
  // Only a standby answers a replica's Hello; it names the lineage of the
  // primary it follows (a replica set's member learning its role, its own).
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(std::min(options_.connect_timeout_ms, kAskLayoutMs));
  int fd = -1;
  if (!net::Connect(address, deadline, &fd).ok()) return false;
  wire::HelloReply r;
  const Status s = net::SayHello(fd, options_.auth_token, wire::kFlagTopology | wire::kFlagReplica,
                                 0, deadline, &r);
  net::CloseFd(fd);
  return s.ok() && r.lineage == lineage && r.shard_index == st.index && r.num_shards == st.count;
}

Status Client::ConnectTo(ShardState& st, const std::string& address, int* out_fd,
                         wire::HelloReply* reply, Clock::time_point call_deadline) {
  // With standbys, an address that does not answer soon (a host gone
  // without a reset, a hung process) gives way to the next. Never past the
  // request's deadline: a peer that accepts and never answers costs the
  // call no more than its own timeout.
  const int wait_ms = st.HasStandbys() ? std::min(options_.connect_timeout_ms, kReplicaConnectMs)
                                       : options_.connect_timeout_ms;
  const Clock::time_point deadline =
      std::min(call_deadline, Clock::now() + std::chrono::milliseconds(wait_ms));
  if (Clock::now() >= deadline) {
    return Unavailable("connect: the request's deadline passed before " + address + " was tried");
  }
  int backoff_ms = options_.retry_backoff_ms;
  for (;;) {
    int fd = -1;
    Status s = net::Connect(address, deadline, &fd);
    if (!s.ok()) {
      if (s.code() == Code::kDeadlineExceeded || s.code() == Code::kInvalidArgument) {
        // A shard that cannot be reached in time is unavailable, not slow.
        return Unavailable("connect: " + s.message());
      }
      return s;  // it says "connect: ..." (or what failed before: resolving, a socket)
    }
    // The Hello's own wait, as before, within the request's.
    s = Hello(st, address, fd, reply,
              std::min(call_deadline,
                       Clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms)));
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

void Client::Release(ShardState& st, Conn conn) {
  conn.idle_since_ms = NowMs();
  std::lock_guard<std::mutex> lock(st.mu);
  // Connections idle too long go first (the pool is used from its back).
  while (!st.idle.empty() &&
         conn.idle_since_ms - st.idle.front().idle_since_ms > options_.idle_close_ms) {
    net::CloseFd(st.idle.front().fd);
    st.idle.erase(st.idle.begin());
  }
  // A connection to a copy another took over from is not used again.
  if (!st.retired && conn.switches == st.switches &&
      static_cast<int>(st.idle.size()) < options_.max_idle_connections) {
    conn.buffer.Trim(kKeepBufferBytes);
    st.idle.push_back(std::move(conn));
  } else {
    net::CloseFd(conn.fd);
  }
}

Client::FrameLimits Client::FrameLimit(ShardState& st) {
  std::lock_guard<std::mutex> lock(st.mu);
  return {std::min(options_.frame_bytes, st.info.max_frame_bytes), st.info.max_frame_bytes};
}

Status Client::GetShardInfos(std::vector<ShardInfo>* infos) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
  int backoff_ms = options_.retry_backoff_ms;
  int retries = 0;
  for (;;) {
    const std::shared_ptr<const Layout> layout = CurrentLayout();
    Status s = GreetAll(*layout, infos, deadline);
    // A shard serves a newer layout: that one's shards.
    if (s.code() == Code::kAborted && LearnLayout(*layout, deadline).ok()) {
      s = GreetAll(*CurrentLayout(), infos, deadline);
    }
    // No copy of a shard greets (its standby is taking over, say): again
    // until the deadline, as a pull is.
    if (s.code() != Code::kUnavailable || !PauseToRetry(&retries, &backoff_ms, deadline)) {
      return s;
    }
  }
}

std::vector<uint64_t> Client::MetLineages() const {
  const std::shared_ptr<const Layout> layout = CurrentLayout();
  std::vector<uint64_t> out;
  for (ShardState* st : layout->shards) {
    std::lock_guard<std::mutex> lock(st->mu);
    out.push_back(st->greeted ? st->lineage : 0);
  }
  return out;
}

Status Client::Regreet() {
  const std::shared_ptr<const Layout> layout = CurrentLayout();
  for (ShardState* st : layout->shards) {
    std::lock_guard<std::mutex> lock(st->mu);
    for (Conn& idle : st->idle) net::CloseFd(idle.fd);
    st->idle.clear();
    ++st->switches;  // connections in use are not pooled again
    st->greeted = false;
    st->epoch = st->lineage = st->restarted_lineage = 0;
  }
  std::vector<ShardInfo> infos;
  return GetShardInfos(&infos);
}

void Client::CloseIdle() {
  std::lock_guard<std::timed_mutex> lock(layout_mu_);  // states_ grows under it
  for (auto& st : states_) {
    std::lock_guard<std::mutex> st_lock(st->mu);
    for (Conn& idle : st->idle) net::CloseFd(idle.fd);
    st->idle.clear();
  }
}

std::string Client::GreetingContext(const ShardState& st) const {
  std::lock_guard<std::mutex> lock(st.mu);
  // With several, the message names what each said.
  return Context(st.index, st.addresses.size() < 2 ? st.address : Joined(st.addresses), "greeting");
}

Status Client::GreetAll(const Layout& layout, std::vector<ShardInfo>* infos,
                        Clock::time_point deadline) {
  infos->clear();
  for (ShardState* st : layout.shards) {
    bool greeted;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      greeted = st->greeted;
    }
    if (!greeted) {
      Conn conn;
      Status s = Acquire(*st, &conn, deadline);
      // (s says which step failed: "connect: ...", "Hello: ...")
      if (!s.ok()) return UnlessLayoutLeft(*st, s.WithContext(GreetingContext(*st)), deadline);
      Release(*st, std::move(conn));
    }
    std::lock_guard<std::mutex> lock(st->mu);
    infos->push_back(st->info);
    std::vector<std::string> copies;  // less those kept from before, not met here yet
    for (const std::string& a : st->addresses) {
      if (!st->Kept(a)) copies.push_back(a);
    }
    infos->back().replicas = Joined(copies);
    infos->back().lineage = st->lineage;
    infos->back().epoch = st->epoch;
  }
  return OkStatus();
}

std::shared_ptr<const Client::Layout> Client::CurrentLayout() const {
  return std::atomic_load(&layout_);
}

size_t Client::num_shards() const { return CurrentLayout()->shards.size(); }

uint64_t Client::layout_epoch() const { return CurrentLayout()->epoch; }

bool Client::LearnNewerLayout() {
  return LearnLayout(*CurrentLayout(),
                     Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms))
      .ok();
}

Status Client::CheckSilent(ShardState& st, uint64_t switches, int64_t silent_ms,
                           Clock::time_point deadline) {
  std::vector<std::string> others;
  std::string current;
  uint64_t epoch;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.switches != switches) {
      return Unavailable("another call found " + st.address + " serving in its place");
    }
    const Clock::time_point now = Clock::now();
    if (now < st.next_silence_probe) return OkStatus();
    st.next_silence_probe = now + std::chrono::milliseconds(kSilenceProbeMs);
    current = st.address;
    epoch = st.epoch;
    for (const std::string& address : st.addresses) {
      if (address != current && !st.Kept(address)) others.push_back(address);
    }
  }
  for (const std::string& address : others) {
    wire::HelloReply reply;
    // A standby that has not taken over refuses a trainer's Hello.
    if (!AskLayout(address, &reply, deadline) || reply.shard_index != st.index ||
        reply.num_shards != st.count || reply.epoch <= epoch) {
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(st.mu);
      if (st.switches == switches) {
        st.address = address;
        ++st.switches;
        for (Conn& idle : st.idle) net::CloseFd(idle.fd);
        st.idle.clear();
      }
    }
    return Unavailable("nothing from " + current + " for " + std::to_string(silent_ms) +
                       " ms, and " + address + " took over at epoch " +
                       std::to_string(reply.epoch));
  }
  return OkStatus();
}

bool Client::AskLayout(const std::string& address, wire::HelloReply* reply,
                       Clock::time_point call_deadline) {
  // Other calls wait for layout_mu_ meanwhile: a host that does not answer
  // (no reset) costs at most kAskLayoutMs, not a connect timeout.
  const Clock::time_point deadline =
      std::min(call_deadline, Clock::now() + std::chrono::milliseconds(std::min(
                                                 options_.connect_timeout_ms, kAskLayoutMs)));
  if (Clock::now() >= deadline) return false;
  int fd = -1;
  if (!net::Connect(address, deadline, &fd).ok()) return false;
  const Status s = net::SayHello(fd, options_.auth_token, wire::kFlagTopology, 0, deadline, reply);
  net::CloseFd(fd);
  return s.ok();
}

Status Client::LearnLayout(const Layout& seen, Clock::time_point deadline) {
  // Another call learning it holds layout_mu_ as long as its own deadline
  // allows: this one waits no longer than its own.
  std::unique_lock<std::timed_mutex> lock(layout_mu_, deadline);
  if (!lock.owns_lock()) {
    return Unavailable("no layout learned by the request's deadline (another call is asking)");
  }
  if (CurrentLayout()->epoch > seen.epoch) return OkStatus();  // another call learned it
  // The newest layout any shard of the one in use serves.
  uint64_t epoch = seen.epoch;
  std::string addresses;
  for (const ShardState* st : seen.shards) {
    std::vector<std::string> candidates;
    {
      std::lock_guard<std::mutex> st_lock(st->mu);
      candidates = st->addresses;
    }
    for (const std::string& address : candidates) {
      wire::HelloReply reply;
      if (AskLayout(address, &reply, deadline) && reply.layout_epoch > epoch &&
          !reply.layout.empty()) {
        epoch = reply.layout_epoch;
        addresses = reply.layout;
      }
    }
  }
  if (epoch == seen.epoch) {
    return Aborted("no shard serves a layout newer than epoch " + std::to_string(seen.epoch) +
                   " yet");
  }
  UseLayoutLocked(seen, epoch, addresses);
  return OkStatus();
}

Status Client::UnlessLayoutLeft(const ShardState& st, const Status& s, Clock::time_point deadline) {
  if (s.code() != Code::kUnavailable) return s;
  const std::shared_ptr<const Layout> now = CurrentLayout();
  if (now->epoch > st.layout_epoch || NewerLayoutThan(*now, &st, deadline)) {
    return Aborted(s.message() + "; another shard serves a newer layout");
  }
  return s;
}

bool Client::NewerLayoutThan(const Layout& seen, const ShardState* unreachable,
                             Clock::time_point deadline) {
  // (Another call asking holds layout_mu_ as long as its deadline allows.)
  std::unique_lock<std::timed_mutex> lock(layout_mu_, deadline);
  if (!lock.owns_lock()) return false;
  if (CurrentLayout()->epoch > seen.epoch) return true;  // another call learned it
  const Clock::time_point now = Clock::now();
  if (now - last_probe_ < std::chrono::milliseconds(kLayoutProbeMs)) return false;
  const size_t n = seen.shards.size();
  for (size_t k = 0; k < n; ++k) {
    const ShardState* st = seen.shards[(next_probe_ + k) % n];
    if (st == unreachable) continue;
    std::vector<std::string> candidates;
    {
      std::lock_guard<std::mutex> st_lock(st->mu);
      candidates = st->addresses;
    }
    for (const std::string& address : candidates) {
      wire::HelloReply reply;
      if (!AskLayout(address, &reply, deadline)) continue;
      // One answer: a process that switched serves the newer layout, and
      // after an undo every one does.
      next_probe_ = (next_probe_ + k + 1) % n;
      if (reply.layout_epoch > seen.epoch && !reply.layout.empty()) {
        UseLayoutLocked(seen, reply.layout_epoch, reply.layout);
        return true;
      }
      last_probe_ = now;
      return false;
    }
  }
  last_probe_ = now;
  return false;
}

void Client::UseLayoutLocked(const Layout& seen, uint64_t epoch, const std::string& addresses) {
  auto next = std::make_shared<Layout>();
  next->epoch = epoch;
  const std::vector<std::string> entries = net::SplitAddresses(addresses, ',');
  for (size_t j = 0; j < entries.size(); ++j) {
    auto st = std::make_unique<ShardState>();
    st->index = static_cast<uint32_t>(j);
    st->count = static_cast<uint32_t>(entries.size());
    st->layout_epoch = epoch;
    st->addresses = net::SplitAddresses(entries[j]);
    st->address = st->addresses.front();
    if (seen.shards.size() == entries.size()) {
      // The same shard's place (bucket ranges follow the count): the
      // addresses this client had for it stay candidates after the
      // layout's. The layout names the processes serving when the switch
      // was made, not a standby that attached and took over since (which
      // the client may have been given, or learned from a Hello). One the
      // switch left out, or restarted with the flags of the layout before,
      // is passed over (Hello).
      const ShardState& before = *seen.shards[j];
      std::lock_guard<std::mutex> before_lock(before.mu);
      for (const std::string& address : before.addresses) {
        if (std::find(st->addresses.begin(), st->addresses.end(), address) == st->addresses.end()) {
          st->addresses.push_back(address);
          st->kept.push_back(address);
        }
      }
    }
    if (st->addresses.size() > 1) has_standbys_.store(true);
    next->shards.push_back(st.get());
    states_.push_back(std::move(st));
  }
  std::atomic_store(&layout_, std::shared_ptr<const Layout>(std::move(next)));
  // The old layout's connections are of no more use: those idle close
  // now, those in use when they come back.
  for (ShardState* st : seen.shards) {
    std::lock_guard<std::mutex> st_lock(st->mu);
    st->retired = true;
    for (Conn& c : st->idle) net::CloseFd(c.fd);
    st->idle.clear();
  }
}

bool Client::PauseToRetry(int* retries, int* backoff_ms, Clock::time_point deadline) {
  if (*retries >= options_.pull_retries && !has_standbys_.load()) return false;
  const Clock::time_point wake = Clock::now() + std::chrono::milliseconds(*backoff_ms);
  if (wake >= deadline) return false;
  std::this_thread::sleep_until(wake);
  *backoff_ms =
      has_standbys_.load() ? std::min(2 * *backoff_ms, kFailoverBackoffMs) : 2 * *backoff_ms;
  ++*retries;
  return true;
}

bool Client::AwaitLayout(const Layout& seen, int* backoff_ms, Clock::time_point deadline) {
  if (LearnLayout(seen, deadline).ok()) return Clock::now() < deadline;
  // The switch is under way: writes are held, and the new layout comes soon.
  const Clock::time_point wake = Clock::now() + std::chrono::milliseconds(*backoff_ms);
  if (wake >= deadline) return false;
  std::this_thread::sleep_until(wake);
  *backoff_ms = std::min(2 * *backoff_ms, kFailoverBackoffMs);
  return true;
}

}  // namespace dlt
