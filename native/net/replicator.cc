#include "native/net/replicator.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <utility>

#include "native/core/routing.h"
#include "native/core/table_config.h"
#include "native/core/task_pool.h"
#include "native/net/frame_call.h"
#include "native/net/socket.h"
#include "native/net/wire.h"

namespace dlt {
namespace {

using Clock = std::chrono::steady_clock;

// Rows a whole copy reads from the table per Exporter call.
constexpr size_t kCopyRows = 16384;
// Pause before connecting again after a failure.
constexpr int kRetryMs = 100;
// Fewest rows of a round's frame (more frames let more threads read them),
// frames kept for the next round, and frames sent ahead of their replies.
constexpr size_t kMinFrameRows = 4096;
constexpr size_t kKeptFrames = 32;
constexpr size_t kFramesInFlight = 64;
// Connections a round's rows travel over at most (with cores to spare).
constexpr size_t kMaxLanes = 4;
// A round's end frame beside its push ids: the frame's header and fields,
// the epoch.
constexpr size_t kRoundEndRoom = 4096;
// An idle standby's empty round, this often (Round): a primary paused past
// a takeover meets the standby's fence within it, not at its next write.
constexpr int kHeartbeatMs = 1000;

}  // namespace

Replicator::Replicator(std::shared_ptr<Shard> shard, std::string standby, ReplicatorOptions options)
    : shard_(std::move(shard)), standby_(std::move(standby)), options_(std::move(options)) {
  status_.standby = standby_;
}

Replicator::~Replicator() { Stop(); }

void Replicator::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (thread_.joinable() || stop_ || status_.ended) return;
  const Status acquired = shard_->AcquireStream(&stream_);
  if (!acquired.ok()) {
    status_.error = acquired.message();
    status_.ended = true;  // Written fails at once
    return;
  }
  shard_->push_ledger().set_tracked(stream_, true);
  thread_ = std::thread([this] { Run(); });
}

void Replicator::Stop() {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    thread.swap(thread_);
  }
  cv_.notify_all();
  Reconnect();  // a frame in flight to a standby that hangs ends now, not at its timeout
  if (thread.joinable()) thread.join();
  Disconnect();
  std::lock_guard<std::mutex> lock(mu_);  // Follow may run meanwhile
  if (stream_ == kNoStream) return;
  for (auto& [name, table] : mirrored_) table->StopChangeLog(stream_);  // nobody reads them now
  mirrored_.clear();
  shard_->push_ledger().set_tracked(stream_, false);
  shard_->ReleaseStream(stream_);
  stream_ = kNoStream;
}

uint64_t Replicator::Applied() {
  std::lock_guard<std::mutex> lock(mu_);
  return taken_ + 1;
}

Status Replicator::Written(uint64_t need, uint64_t view_version, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!options_.sync) {
    if (unsent_since_ == Clock::time_point{}) unsent_since_ = Clock::now();
    return OkStatus();
  }
  return WaitWritten(lock, need, view_version, timeout_ms);
}

Status Replicator::Held(uint64_t need, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!options_.sync && unsent_since_ == Clock::time_point{}) unsent_since_ = Clock::now();
  return WaitWritten(lock, need, 0, timeout_ms);
}

Status Replicator::WaitWritten(std::unique_lock<std::mutex>& lock, uint64_t need,
                               uint64_t view_version, int timeout_ms) {
  const int wait_ms = timeout_ms > 0 ? timeout_ms : options_.write_timeout_ms;
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  for (;;) {
    if (applied_ >= need) {
      if (view_applied_ >= view_version) return OkStatus();  // a round holding it is done
      need = taken_ + 1;                                     // a later round tells the view
    }
    if (stop_ || status_.ended) {
      return Unavailable("replication to standby " + standby_ + " stopped: " + status_.error);
    }
    if (!status_.connected && status_.connects > 0) {  // known to be down
      return Unavailable("standby " + standby_ + " is not connected: " + status_.error);
    }
    const uint64_t failures = connect_failures_;
    wanted_ = true;
    cv_.notify_all();
    const bool done = cv_.wait_until(lock, deadline, [&] {
      return applied_ >= need || failed_ >= need || stop_ || connect_failures_ != failures;
    });
    if (applied_ >= need) continue;
    if (!done) {
      return DeadlineExceeded("standby " + standby_ + " did not apply the write within " +
                              std::to_string(wait_ms) + " ms");
    }
    return Unavailable("standby " + standby_ + " did not apply the write: " +
                       (stop_ ? std::string("replication stopped") : status_.error));
  }
}

void Replicator::Reconnect() {
  std::lock_guard<std::mutex> lock(fd_mu_);
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);  // the round under way fails; the next connects
  for (int lane : lanes_) shutdown(lane, SHUT_RDWR);
}

Status Replicator::Pause(bool pause) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!pause) {
    paused_ = false;
    cv_.notify_all();
    return OkStatus();
  }
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms);
  if (thread_.joinable() && status_.connected && !paused_) {
    // A write acknowledged before the hold may wait for its round still.
    const uint64_t need = taken_ + 1;
    wanted_ = true;
    cv_.notify_all();
    cv_.wait_until(lock, deadline, [&] {
      return applied_ >= need || failed_ >= need || stop_ || status_.ended || !status_.connected;
    });
  }
  paused_ = true;
  cv_.notify_all();
  if (!cv_.wait_until(lock, deadline, [&] { return !busy_; })) {
    return DeadlineExceeded("the round to standby " + standby_ +
                            " in progress did not end within " +
                            std::to_string(options_.io_timeout_ms) + " ms");
  }
  return OkStatus();
}

void Replicator::Follow(const std::vector<std::shared_ptr<Table>>& first,
                        const std::function<std::vector<std::shared_ptr<Table>>()>& swap) {
  bool was_paused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_paused = paused_;
  }
  if (!was_paused) static_cast<void>(Pause(true));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stream_ != kNoStream) {
      for (const std::shared_ptr<Table>& table : first) {
        if (!table->change_log_running(stream_)) table->StartChangeLog(stream_);
      }
    }
  }
  const std::vector<std::shared_ptr<Table>> tables = swap();
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Only a standby caught up holds them (a round still under way, or a
    // connection just made, finds the tables replaced and copies them).
    if (stream_ != kNoStream && !busy_ && status_.connected && marked_) {
      // The tables left keep their logs: an undone switch serves them again
      // with the rows pulls made meanwhile still logged.
      mirrored_.clear();
      for (const std::shared_ptr<Table>& table : tables) {
        if (!table->change_log_running(stream_)) table->StartChangeLog(stream_);
        mirrored_[table->config().name] = table;
      }
    }
  }
  if (!was_paused) static_cast<void>(Pause(false));
}

ReplicationStatus Replicator::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  ReplicationStatus s = status_;
  if (!options_.sync && unsent_since_ != Clock::time_point{}) {
    s.lag_seconds = std::chrono::duration<double>(Clock::now() - unsent_since_).count();
  }
  if (down_since_ != Clock::time_point{}) {
    s.down_seconds = std::chrono::duration<double>(Clock::now() - down_since_).count();
  }
  return s;
}

void Replicator::Run() {
  Clock::time_point next_round = Clock::now();
  for (;;) {
    uint64_t round = 0;
    Clock::time_point oldest_unsent;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (busy_) {
        busy_ = false;
        if (paused_) cv_.notify_all();  // Pause waits for it
      }
      cv_.wait(lock, [&] { return stop_ || !paused_; });
      if (fd_ < 0 && status_.connects > 0) {
        // Reconnecting after a failure: not too often.
        cv_.wait_for(lock, std::chrono::milliseconds(kRetryMs), [&] { return stop_; });
      } else if (fd_ >= 0) {
        cv_.wait_until(lock, next_round, [&] { return stop_ || (options_.sync && wanted_); });
      }
      if (stop_ || status_.ended) return;
      if (paused_) continue;
      busy_ = true;
      if (fd_ >= 0) {
        round = ++begun_;
        wanted_ = false;
        oldest_unsent = unsent_since_;
        unsent_since_ = Clock::time_point{};
      }
    }
    if (fd_ < 0) {
      const Status connected = Connect();
      if (!connected.ok() && options_.on_failure) options_.on_failure();
      std::lock_guard<std::mutex> lock(mu_);
      ++status_.connects;
      status_.connected = connected.ok();
      status_.caught_up = false;
      if (connected.ok()) {
        down_since_ = Clock::time_point{};
      } else if (down_since_ == Clock::time_point{}) {
        down_since_ = Clock::now();
      }
      if (!connected.ok()) {
        status_.error = connected.message();
        status_.ended = options_.range_stream;
        ++connect_failures_;
        cv_.notify_all();  // waiting writes fail now
      }
      continue;
    }
    next_round = Clock::now() + std::chrono::milliseconds(options_.interval_ms);
    const Status s = Round(round);
    // The group stops counting on this standby before a write waiting on
    // the round learns that it failed.
    if (!s.ok() && options_.on_failure) options_.on_failure();
    std::lock_guard<std::mutex> lock(mu_);
    taken_ = round;  // also when it failed before its take
    if (s.ok()) {
      applied_ = round;
      view_applied_ = round_view_;
      ++status_.rounds;
      status_.caught_up = true;
      status_.error.clear();
    } else {
      failed_ = round;
      status_.connected = false;
      down_since_ = Clock::now();
      status_.caught_up = false;
      status_.error = s.message();
      status_.ended = options_.range_stream;
      // The writes of the failed round are still not on the standby.
      if (oldest_unsent != Clock::time_point{} &&
          (unsent_since_ == Clock::time_point{} || oldest_unsent < unsent_since_)) {
        unsent_since_ = oldest_unsent;
      }
      Disconnect();
    }
    cv_.notify_all();
  }
}

Status Replicator::Connect() {
  Disconnect();
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms);
  int fd = -1;
  DLT_RETURN_IF_ERROR(net::Connect(standby_, deadline, &fd));
  {
    std::lock_guard<std::mutex> lock(fd_mu_);
    fd_ = fd;
  }
  const uint16_t flags =
      options_.range_stream ? wire::kFlagMove : wire::kFlagReplica | wire::kFlagTopology;
  wire::HelloReply reply;
  Status s = net::SayHello(fd, options_.auth_token, flags, next_request_id_++, deadline, &reply);
  // Refused for serving trainers: it may have taken over from this primary.
  const bool serves = !s.ok() && !options_.range_stream && s.code() == Code::kFailedPrecondition;
  if (s.ok() && options_.range_stream) {
    // The buckets this shard owns of the next shard's.
    if (reply.num_shards == 0 || reply.shard_index >= reply.num_shards) {
      s = InvalidArgument("the next layout's shard " + std::to_string(reply.shard_index) + " of " +
                          std::to_string(reply.num_shards) + " is not a shard");
    } else {
      first_ = std::max(shard_->first_bucket(), FirstBucket(reply.shard_index, reply.num_shards));
      end_ = std::min(shard_->end_bucket(), FirstBucket(reply.shard_index + 1, reply.num_shards));
      if (first_ >= end_) {
        s = FailedPrecondition("shard " + std::to_string(reply.shard_index) + " of " +
                               std::to_string(reply.num_shards) + " at " + standby_ +
                               " takes none of this shard's buckets");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    status_.first_bucket = first_;
    status_.end_bucket = end_;
  } else if (s.ok() && reply.epoch > shard_->epoch()) {
    // The standby follows, or promised to follow, a newer primary: this
    // one was replaced (paused or cut off past the takeover). It serves no
    // trainer from now on and acknowledges no write (docs/replication.md).
    const std::string by = "its standby " + standby_ + " follows a newer primary, at epoch " +
                           std::to_string(reply.epoch);
    shard_->Supersede(reply.epoch, by);
    s = FailedPrecondition(by + ", newer than this primary's " + std::to_string(shard_->epoch()) +
                           ": this primary was replaced");
  } else if (s.ok() && (reply.shard_index != shard_->shard_index() ||
                        reply.num_shards != shard_->num_shards() ||
                        reply.layout_epoch != shard_->layout_epoch())) {
    // A standby restarted with the layout before a re-shard takes this
    // one's when it greets its primary; until then it is not this shard's.
    s = FailedPrecondition(
        "standby " + standby_ + " is shard " + std::to_string(reply.shard_index) + " of " +
        std::to_string(reply.num_shards) + " at layout epoch " +
        std::to_string(reply.layout_epoch) + "; this primary is shard " +
        std::to_string(shard_->shard_index()) + " of " + std::to_string(shard_->num_shards()) +
        " at layout epoch " + std::to_string(shard_->layout_epoch()));
  }
  if (serves) {
    Disconnect();
    s = CheckTakenOver(s, deadline);
  }
  if (!s.ok()) {
    Disconnect();
    return s.WithContext("connecting to standby " + standby_);
  }
  // The lanes: a round's rows go over several connections at once, received
  // by several of the standby's threads.
  const size_t lanes = std::min<size_t>(kMaxLanes, RowStreamPool().threads() + 1) - 1;
  for (size_t k = 0; s.ok() && k < lanes; ++k) {
    int lane = -1;
    s = net::Connect(standby_, deadline, &lane);
    if (!s.ok()) break;
    {
      std::lock_guard<std::mutex> lock(fd_mu_);
      lanes_.push_back(lane);
    }
    wire::HelloReply lane_reply;
    s = net::SayHello(lane, options_.auth_token, flags, next_request_id_++, deadline, &lane_reply);
  }
  if (!s.ok()) {
    Disconnect();
    return s.WithContext("connecting to standby " + standby_);
  }
  standby_frame_bytes_ = reply.max_frame_bytes;
  // The standby's tables are not known: every table is copied whole.
  mirrored_.clear();
  clocks_sent_.clear();
  provisional_.clear();
  marked_ = false;
  view_told_ = round_view_ = 0;
  return OkStatus();
}

Status Replicator::CheckTakenOver(Status refused, Clock::time_point deadline) {
  int fd = -1;
  if (!net::Connect(standby_, deadline, &fd).ok()) return refused;
  wire::HelloReply serving;
  const Status greeted = net::SayHello(fd, options_.auth_token, wire::kFlagTopology,
                                       next_request_id_++, deadline, &serving);
  net::CloseFd(fd);
  if (!greeted.ok() || serving.epoch <= shard_->epoch() ||
      serving.shard_index != shard_->shard_index() || serving.num_shards != shard_->num_shards() ||
      serving.layout_epoch != shard_->layout_epoch() || serving.lineage != shard_->lineage()) {
    return refused;
  }
  const std::string by =
      "its standby " + standby_ + " took over, at epoch " + std::to_string(serving.epoch);
  shard_->Supersede(serving.epoch, by);
  return FailedPrecondition(by + ", newer than this primary's " + std::to_string(shard_->epoch()) +
                            ": this primary was replaced");
}

void Replicator::Disconnect() {
  std::lock_guard<std::mutex> lock(fd_mu_);  // Stop never shuts a reused number
  if (fd_ >= 0) net::CloseFd(fd_);
  fd_ = -1;
  for (int lane : lanes_) net::CloseFd(lane);
  lanes_.clear();
}

Status Replicator::Round(uint64_t round) {
  const std::vector<std::shared_ptr<Table>> tables = shard_->Tables();
  // Tables dropped here are dropped there, at the round's end (a caught-up
  // standby keeps a table until then), so a round that drops one ends.
  bool dropped = false;
  for (auto it = mirrored_.begin(); it != mirrored_.end();) {
    const bool kept = std::any_of(tables.begin(), tables.end(),
                                  [&](const auto& t) { return t->config().name == it->first; });
    if (kept) {
      ++it;
      continue;
    }
    DLT_RETURN_IF_ERROR(SendTable(wire::kDropTable, it->second->config()));
    dropped = true;
    it->second->StopChangeLog(stream_);
    provisional_.erase(it->first);
    it = mirrored_.erase(it);
  }
  // Tables new or replaced here (a load) are copied whole first.
  bool copied = !marked_;
  for (const std::shared_ptr<Table>& table : tables) {
    const auto it = mirrored_.find(table->config().name);
    if (it != mirrored_.end() && it->second == table) continue;
    if (it != mirrored_.end()) it->second->StopChangeLog(stream_);
    DLT_RETURN_IF_ERROR(CopyWhole(table));
    copied = true;
  }
  for (const std::shared_ptr<Table>& table : tables) DLT_RETURN_IF_ERROR(SendProvisional(*table));
  // The round's take: every table's changes and the pushes applied, at one
  // moment (identified pushes hold the gate shared while they apply), so a
  // push's rows and its id reach the standby in the same round. The gate
  // stays held until the changed rows are read and sent: a row read later
  // could hold a push whose id is not in this round, which the standby,
  // taking over, would apply a second time when its client sends it again.
  PushLedger& ledger = shard_->push_ledger();
  struct Changes {
    Table* table;
    std::vector<int64_t> ids;
    std::vector<uint64_t> sketch_adds;
  };
  std::vector<Changes> changes;
  std::vector<PushId> pushed, more;
  std::unique_lock<WriterFirstLock> gate(ledger.gate(), std::defer_lock);
  for (;;) {
    std::vector<std::shared_ptr<Table>> overflowed;
    gate.lock();
    {
      std::lock_guard<std::mutex> lock(mu_);
      taken_ = round;
    }
    // A round that copies tables makes its standby one of the group's
    // in-sync set at its take (under the gate): every write applied after
    // it waits for this standby too, and every one before is in this round.
    if (copied && options_.view) options_.view(/*joining=*/true);
    for (const std::shared_ptr<Table>& table : tables) {
      Changes c{table.get(), {}, {}};
      if (table->TakeChanges(&c.ids, &c.sketch_adds, stream_).ok()) {
        KeepInRange(&c.ids, &c.sketch_adds);
        if (!c.ids.empty() || !c.sketch_adds.empty()) changes.push_back(std::move(c));
      } else {
        overflowed.push_back(table);
      }
    }
    ledger.TakeApplied(stream_, &more);
    pushed.insert(pushed.end(), more.begin(), more.end());
    if (overflowed.empty()) break;
    // What an earlier take of these tables found is in their copies now
    // (rows and sketch counts alike: counting those again would count twice).
    changes.erase(std::remove_if(changes.begin(), changes.end(),
                                 [&](const Changes& c) {
                                   return std::any_of(
                                       overflowed.begin(), overflowed.end(),
                                       [&](const auto& t) { return t.get() == c.table; });
                                 }),
                  changes.end());
    gate.unlock();
    // More changes than the log holds: copy those whole and take again, so
    // the copies' rows and the ids are in this round too.
    for (const std::shared_ptr<Table>& table : overflowed) {
      DLT_RETURN_IF_ERROR(CopyWhole(table));
      copied = true;
    }
    if (options_.after_copy) options_.after_copy();
  }
  if (copied) {
    // A copy's round carries every push the copied rows hold, as far as
    // the ledger remembers and a frame of the peer takes: those applied
    // before this stream tracked them (a standby attached, a range stream
    // began) and those a failed round took. Without them, a push sent again
    // after a takeover or a switch would be applied a second time.
    const size_t room = standby_frame_bytes_ > kRoundEndRoom
                            ? (standby_frame_bytes_ - kRoundEndRoom) / sizeof(PushId)
                            : 0;
    ledger.Done(std::min(room, PushLedger::kCapacity), &pushed);
  }
  if (options_.after_take) options_.after_take();
  // The changed rows are read into frames while the gate is held (by a few
  // threads at once where there are cores to spare) and sent once it is
  // released, so pushes apply while the standby receives the round. Past
  // options_.round_buffer_bytes the gate stays held until the rest are sent
  // (a standby's; a range stream's rounds release it, below).
  std::vector<FrameJob> jobs;
  for (const Changes& c : changes) {
    const size_t threads = static_cast<size_t>(RowStreamPool().threads()) + 1;
    const size_t per_frame = std::min(
        RowsPerFrame(*c.table), std::max(kMinFrameRows, (c.ids.size() + threads - 1) / threads));
    for (size_t first = 0; first < c.ids.size(); first += per_frame) {
      jobs.push_back({c.table, c.ids.data() + first, std::min(per_frame, c.ids.size() - first)});
    }
  }
  const auto bytes_of = [](const FrameJob& job) {
    return wire::ReplicateBytes(job.table->config().name.size(), job.table->dim(), job.n, 0,
                                job.table->slot_floats());
  };
  size_t next = 0, count = 0;
  for (;;) {
    size_t end = next;
    uint64_t bytes = 0;
    while (end < jobs.size() &&
           (end == next || bytes + bytes_of(jobs[end]) <= options_.round_buffer_bytes)) {
      bytes += bytes_of(jobs[end++]);
    }
    DLT_RETURN_IF_ERROR(ReadFrames(jobs, next, end));
    count = end - next;
    if (end == jobs.size()) break;
    // A range stream's shard serves no trainer before the switch, whose
    // last rounds (writes held) carry every push id: its rows may be read
    // after the gate is released. Sending under the gate could wait on the
    // receiving process's workers, blocked on that gate by identified
    // pushes (a stream to its own process, or two crossing streams).
    if (options_.range_stream && gate.owns_lock()) gate.unlock();
    DLT_RETURN_IF_ERROR(SendFrames(count));
    next = end;
  }
  if (gate.owns_lock()) gate.unlock();
  DLT_RETURN_IF_ERROR(SendFrames(count));
  for (const Changes& c : changes) DLT_RETURN_IF_ERROR(SendSketchCounts(c.table, c.sketch_adds));
  if (options_.range_stream) {
    // Pushes that wrote none of this stream's buckets still move the push
    // clock the target takes the latest of.
    for (const std::shared_ptr<Table>& table : tables) {
      uint64_t& sent = clocks_sent_[table->config().name];
      const uint64_t now = table->pushes();
      if (now == sent) continue;
      DLT_RETURN_IF_ERROR(SendRows(table.get(), RowsFor(*table, 0), 0, nullptr, 0));
      sent = now;
    }
  }
  // The group's in-sync set, when it changed since the standby was told.
  if (options_.view) {
    const wire::InSyncView view = options_.view(/*joining=*/false);
    if (view.version != view_told_) {
      DLT_RETURN_IF_ERROR(SendView(view));
      view_told_ = view.version;
    }
  }
  round_view_ = view_told_;
  const bool heartbeat =
      !options_.range_stream && Clock::now() - last_end_ >= std::chrono::milliseconds(kHeartbeatMs);
  if (changes.empty() && pushed.empty() && !copied && !dropped && !heartbeat) return OkStatus();
  // The round's end: a caught-up standby applies its rows and ids now; after
  // copies, the standby holds every table again and may take over.
  wire::StandbyTableRequest end;
  end.action = copied ? wire::kCaughtUp : wire::kRoundEnd;
  const uint64_t epoch = shard_->epoch();
  end.config.assign(reinterpret_cast<const char*>(&epoch), sizeof(epoch));
  end.config.append(reinterpret_cast<const char*>(pushed.data()), pushed.size() * sizeof(PushId));
  const std::string payload = wire::EncodeStandbyTable(end);
  DLT_RETURN_IF_ERROR(
      Call(static_cast<uint8_t>(wire::Opcode::kStandbyTable), payload.data(), payload.size()));
  marked_ = true;
  last_end_ = Clock::now();
  return OkStatus();
}

Status Replicator::SendView(const wire::InSyncView& view) {
  return SendStandbyTable(wire::kInSync, wire::EncodeInSyncView(view));
}

Status Replicator::CopyWhole(const std::shared_ptr<Table>& table) {
  mirrored_.erase(table->config().name);
  provisional_[table->config().name] = false;  // as the standby makes it
  // Logging starts before the copy reads anything: a write the copy misses
  // is in the next round.
  table->StartChangeLog(stream_);
  DLT_RETURN_IF_ERROR(SendTable(wire::kMakeTable, table->config()));
  const size_t batch = std::min(kCopyRows, RowsPerFrame(*table));
  const RowBuffers out = RowsFor(*table, batch);
  Table::Exporter exporter(table.get());
  exporter.set_buckets(first_, end_);
  for (;;) {
    const Clock::time_point began = Clock::now();
    const size_t n = exporter.Next(batch, out);
    if (n == 0) break;
    DLT_RETURN_IF_ERROR(SendRows(table.get(), out, n, nullptr, 0));
    DLT_RETURN_IF_ERROR(Pace(Clock::now() - began));
  }
  DLT_RETURN_IF_ERROR(exporter.error());
  // The clock too, when there were no rows to carry it.
  DLT_RETURN_IF_ERROR(SendRows(table.get(), out, 0, nullptr, 0));
  DLT_RETURN_IF_ERROR(SendSketchSlices(table.get()));
  DLT_RETURN_IF_ERROR(SendProvisional(*table));
  mirrored_[table->config().name] = table;
  std::lock_guard<std::mutex> lock(mu_);
  ++status_.tables_copied;
  return OkStatus();
}

Status Replicator::Pace(Clock::duration busy) {
  if (options_.copy_pace >= 1.0) return OkStatus();
  const auto wait = std::chrono::duration_cast<Clock::duration>(
      busy * (1.0 / std::max(options_.copy_pace, 0.01) - 1.0));
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_for(lock, wait, [&] { return stop_; })) return Unavailable("replication stopped");
  return OkStatus();
}

Status Replicator::ReadFrame(const FrameJob& job, Frame* frame) {
  const Table& table = *job.table;
  wire::ReplicateRequest r;
  r.table = table.config().name;
  r.dim = table.dim();
  r.slot_floats = table.slot_floats();
  r.rows = static_cast<uint32_t>(job.n);
  r.push_clock = table.pushes();
  // Laid out for every id present, the common case: the rows land in place.
  uint8_t* p =
      frame->payload.Reserve(wire::ReplicateBytes(r.table.size(), r.dim, job.n, 0, r.slot_floats));
  const wire::ReplicateOffsets at = wire::ReplicateLayout(r.table.size(), r.dim, job.n, 0);
  const RowBuffers out{reinterpret_cast<int64_t*>(p + at.ids),
                       reinterpret_cast<float*>(p + at.values),
                       reinterpret_cast<float*>(p + at.slots),
                       reinterpret_cast<uint32_t*>(p + at.steps),
                       nullptr,
                       reinterpret_cast<uint32_t*>(p + at.touched)};
  thread_local std::vector<int64_t> absent;
  size_t rows = 0;
  DLT_RETURN_IF_ERROR(job.table->ReadRows(job.ids, job.n, out, &rows, &absent));
  frame->rows = rows;
  frame->removals = absent.size();
  if (rows == job.n) {
    wire::EncodeReplicateHeader(r, p);
    frame->bytes = wire::ReplicateBytes(r.table.size(), r.dim, rows, 0, r.slot_floats);
    return OkStatus();
  }
  // Some were removed: the arrays move to where rows and removals put them.
  r.rows = static_cast<uint32_t>(rows);
  r.removed = static_cast<uint32_t>(absent.size());
  r.ids = out.ids;
  r.removed_ids = absent.data();
  r.steps = out.steps;
  r.touched = out.touched;
  r.values = out.values;
  r.slots = out.slots;
  net::Buffer packed;
  frame->bytes = wire::ReplicateBytes(r.table.size(), r.dim, r.rows, r.removed, r.slot_floats);
  wire::EncodeReplicate(r, packed.Reserve(frame->bytes));
  frame->payload = std::move(packed);
  return OkStatus();
}

Status Replicator::ReadFrames(const std::vector<FrameJob>& jobs, size_t begin, size_t end) {
  if (frames_.size() < end - begin) frames_.resize(end - begin);
  std::vector<Status> read(end - begin);
  RowStreamPool().ParallelFor(end - begin,
                              [&](size_t i) { read[i] = ReadFrame(jobs[begin + i], &frames_[i]); });
  for (const Status& s : read) DLT_RETURN_IF_ERROR(s);
  return OkStatus();
}

Status Replicator::SendFrames(size_t count) {
  const uint64_t first_id = next_request_id_;
  next_request_id_ += count;
  std::vector<int> fds{fd_};
  fds.insert(fds.end(), lanes_.begin(), lanes_.end());
  const size_t used = std::min(fds.size(), count);
  std::vector<Status> sent(used);
  RowStreamPool().ParallelFor(
      used, [&](size_t k) { sent[k] = SendOn(fds[k], k, used, count, first_id); });
  for (const Status& s : sent) DLT_RETURN_IF_ERROR(s);
  uint64_t rows = 0, removals = 0;
  for (size_t i = 0; i < count; ++i) {
    rows += frames_[i].rows;
    removals += frames_[i].removals;
  }
  // One huge round does not pin its frames' memory.
  for (size_t i = 0; i < frames_.size(); ++i) {
    if (i >= kKeptFrames) frames_[i].payload.Release();
  }
  std::lock_guard<std::mutex> lock(mu_);
  status_.rows_sent += rows;
  status_.removals_sent += removals;
  return OkStatus();
}

Status Replicator::SendOn(int fd, size_t first, size_t stride, size_t count, uint64_t first_id) {
  std::deque<uint64_t> waiting;
  std::string reply;
  const auto receive = [&]() {
    const uint64_t id = waiting.front();
    waiting.pop_front();
    return net::ReceiveReply(fd, wire::Opcode::kReplicate, id, wire::kPushReplyBytes,
                             Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms),
                             &reply)
        .WithContext("standby " + standby_);
  };
  for (size_t i = first; i < count; i += stride) {
    if (waiting.size() == kFramesInFlight) DLT_RETURN_IF_ERROR(receive());
    const Status sent = net::SendFrame(
        fd, wire::Opcode::kReplicate, first_id + i, frames_[i].payload.data(), frames_[i].bytes,
        Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms), 0, standby_frame_bytes_);
    if (!sent.ok()) {
      // The standby may have said why before it closed.
      while (!waiting.empty()) DLT_RETURN_IF_ERROR(receive());
      return sent.WithContext("standby " + standby_);
    }
    waiting.push_back(first_id + i);
  }
  while (!waiting.empty()) DLT_RETURN_IF_ERROR(receive());
  return OkStatus();
}

RowBuffers Replicator::RowsFor(const Table& table, size_t rows) {
  scratch_.ids.resize(rows);
  scratch_.values.resize(rows * table.dim());
  scratch_.slots.resize(rows * table.slot_floats());
  scratch_.steps.resize(rows);
  scratch_.touched.resize(rows);
  scratch_.buckets.resize(rows);
  return RowBuffers{scratch_.ids.data(),   scratch_.values.data(),  scratch_.slots.data(),
                    scratch_.steps.data(), scratch_.buckets.data(), scratch_.touched.data()};
}

size_t Replicator::PerFrame(uint64_t fixed, uint64_t each) const {
  uint64_t limit = options_.frame_bytes;
  if (standby_frame_bytes_) limit = std::min<uint64_t>(limit, standby_frame_bytes_);
  return limit > fixed + each ? static_cast<size_t>((limit - fixed) / each) : 1;
}

size_t Replicator::RowsPerFrame(const Table& table) const {
  const uint64_t fixed =
      wire::ReplicateBytes(table.config().name.size(), table.dim(), 0, 0, table.slot_floats());
  // A changed row costs at most a row or a removal, whichever is larger.
  const uint64_t row = wire::ReplicateBytes(0, table.dim(), 1, 0, table.slot_floats()) -
                       wire::ReplicateBytes(0, table.dim(), 0, 0, table.slot_floats());
  return PerFrame(fixed, row);
}

Status Replicator::SendSketchSlices(Table* table) {
  if (!table->has_sketch()) return OkStatus();
  const uint32_t slice = table->sketch_slice_bytes();
  const std::string& name = table->config().name;
  // At least one slice a frame (a standby whose frames are smaller refuses it).
  const size_t per_frame =
      PerFrame(wire::SketchSlicesBytes(name.size(), slice, 0) + 16, 8 + uint64_t{slice});
  Scratch& s = scratch_;
  const auto flush = [&]() -> Status {
    if (s.slice_buckets.empty()) return OkStatus();
    std::string bytes =
        wire::EncodeSketchSlices(name, slice, s.slice_buckets.data(), s.slice_added.data(),
                                 s.slice_counters.data(), s.slice_buckets.size());
    s.slice_buckets.clear();
    s.slice_added.clear();
    s.slice_counters.clear();
    return SendStandbyTable(wire::kSketchSlices, std::move(bytes));
  };
  for (uint32_t stripe = 0; stripe < kStripes; ++stripe) {
    // A stripe's slices at one moment, its logged counts since dropped: the
    // counts pushes make from then on come in the rounds.
    const size_t before = s.slice_buckets.size();
    table->TakeSketchSlices(stripe, &s.slice_buckets, &s.slice_counters, &s.slice_added, stream_);
    // Only this stream's buckets' slices (a stripe's buckets are contiguous).
    size_t kept = before;
    for (size_t i = before; i < s.slice_buckets.size(); ++i) {
      if (!InRange(s.slice_buckets[i])) continue;
      std::memmove(s.slice_counters.data() + kept * slice, s.slice_counters.data() + i * slice,
                   slice);
      s.slice_buckets[kept] = s.slice_buckets[i];
      s.slice_added[kept++] = s.slice_added[i];
    }
    s.slice_buckets.resize(kept);
    s.slice_added.resize(kept);
    s.slice_counters.resize(kept * slice);
    if (s.slice_buckets.size() >= per_frame) DLT_RETURN_IF_ERROR(flush());
  }
  return flush();
}

Status Replicator::SendSketchCounts(Table* table, const std::vector<uint64_t>& hashes) {
  const size_t per_frame = PerFrame(4096, sizeof(uint64_t));
  for (size_t first = 0; first < hashes.size(); first += per_frame) {
    const size_t n = std::min(per_frame, hashes.size() - first);
    DLT_RETURN_IF_ERROR(SendStandbyTable(
        wire::kSketchCounts, wire::EncodeSketchCounts(table->config().name, &hashes[first], n)));
  }
  return OkStatus();
}

Status Replicator::SendProvisional(const Table& table) {
  const bool provisional = table.provisional();
  bool& told = provisional_[table.config().name];
  if (told == provisional) return OkStatus();
  DLT_RETURN_IF_ERROR(SendStandbyTable(wire::kProvisional,
                                       wire::EncodeProvisional(table.config().name, provisional)));
  told = provisional;
  return OkStatus();
}

Status Replicator::SendTable(uint32_t action, const TableConfig& config) {
  if (!options_.range_stream) return SendStandbyTable(action, EncodeTableConfig(config));
  // A range stream makes and drops its buckets' part of the table.
  return SendStandbyTable(action == wire::kMakeTable ? wire::kMakeRange : wire::kDropRange,
                          wire::EncodeRange(first_, end_, EncodeTableConfig(config)));
}

void Replicator::KeepInRange(std::vector<int64_t>* ids, std::vector<uint64_t>* hashes) const {
  if (first_ == 0 && end_ == kNumBuckets) return;
  ids->erase(std::remove_if(ids->begin(), ids->end(),
                            [this](int64_t id) { return !InRange(BucketOf(id)); }),
             ids->end());
  hashes->erase(std::remove_if(hashes->begin(), hashes->end(),
                               [this](uint64_t h) { return !InRange(BucketOfHash(h)); }),
                hashes->end());
}

Status Replicator::SendStandbyTable(uint32_t action, std::string bytes) {
  wire::StandbyTableRequest request;
  request.action = action;
  request.config = std::move(bytes);
  const std::string payload = wire::EncodeStandbyTable(request);
  return Call(static_cast<uint8_t>(wire::Opcode::kStandbyTable), payload.data(), payload.size());
}

Status Replicator::SendRows(Table* table, const RowBuffers& rows, size_t n, const int64_t* removed,
                            size_t num_removed) {
  wire::ReplicateRequest r;
  r.table = table->config().name;
  r.dim = table->dim();
  r.slot_floats = table->slot_floats();
  r.rows = static_cast<uint32_t>(n);
  r.removed = static_cast<uint32_t>(num_removed);
  r.push_clock = table->pushes();
  r.ids = rows.ids;
  r.removed_ids = removed;
  r.steps = rows.steps;
  r.touched = rows.touched;
  r.values = rows.values;
  r.slots = rows.slots;
  frame_.resize(wire::ReplicateBytes(r.table.size(), r.dim, r.rows, r.removed, r.slot_floats));
  wire::EncodeReplicate(r, reinterpret_cast<uint8_t*>(frame_.data()));
  DLT_RETURN_IF_ERROR(
      Call(static_cast<uint8_t>(wire::Opcode::kReplicate), frame_.data(), frame_.size()));
  std::lock_guard<std::mutex> lock(mu_);
  status_.rows_sent += n;
  status_.removals_sent += num_removed;
  return OkStatus();
}

Status Replicator::Call(uint8_t opcode, const void* payload, size_t bytes) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms);
  std::string reply;
  return net::CallFrame(fd_, static_cast<wire::Opcode>(opcode), next_request_id_++, payload, bytes,
                        wire::kPushReplyBytes, deadline, &reply, 0, standby_frame_bytes_)
      .WithContext("standby " + standby_);
}

}  // namespace dlt
