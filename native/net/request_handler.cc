#include "native/net/request_handler.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "native/core/routing.h"
#include "native/core/table_config.h"
#include "native/core/task_pool.h"
#include "native/net/stream_apply.h"

namespace dlt {
namespace {

using Clock = std::chrono::steady_clock;

// A Hello with another token than the shard's (or none): how to give it.
constexpr char kWrongToken[] =
    "wrong or missing auth token (a client takes it as auth_token= or from the file "
    "TF_DLT_AUTH_TOKEN_FILE names; tf-dlt commands as --auth-token-file)";

// `s` with its table named, unless its message names it already (a table's
// own push errors do: "push to table 'x': ...").
Status InTable(const Status& s, const std::string& table) {
  if (s.message().find("table '" + table + "'") != std::string::npos) return s;
  return s.WithContext("table '" + table + "'");
}

// Whether `given` equals `secret`, in a time that depends on the secret's
// length alone (it took the longer of the two, so a long guess showed the
// secret's length).
bool ConstantTimeEquals(const std::string& given, const std::string& secret) {
  size_t diff = given.size() ^ secret.size();
  for (size_t i = 0; i < secret.size(); ++i) {
    const uint8_t x = i < given.size() ? static_cast<uint8_t>(given[i]) : 0;
    diff |= static_cast<size_t>(x ^ static_cast<uint8_t>(secret[i]));
  }
  return diff == 0;
}

uint64_t MicrosSince(Clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count());
}

// Writes a reply frame of `body` for `request_id` into `reply`.
size_t Respond(wire::Opcode opcode, uint64_t request_id, const std::string& body,
               net::Buffer* reply) {
  uint8_t* out = reply->Reserve(wire::kHeaderBytes + body.size());
  wire::EncodeHeader({opcode, wire::kFlagResponse, request_id, static_cast<uint32_t>(body.size())},
                     out);
  if (!body.empty()) std::memcpy(out + wire::kHeaderBytes, body.data(), body.size());
  return wire::kHeaderBytes + body.size();
}

}  // namespace

RequestHandler::RequestHandler(std::shared_ptr<Shard> shard, std::string auth_token,
                               uint32_t max_frame_bytes, ServerCounters* counters)
    : shard_(std::move(shard)),
      auth_token_(std::move(auth_token)),
      max_frame_bytes_(max_frame_bytes),
      counters_(counters) {}

Status RequestHandler::CheckHeader(const wire::FrameHeader& header, bool authenticated) const {
  if (header.flags & wire::kFlagResponse) {
    return InvalidArgument("a request frame must not carry the response flag");
  }
  if (authenticated) return OkStatus();
  if (header.opcode != wire::Opcode::kHello) {
    return Unauthenticated("the first frame on a connection must be Hello");
  }
  if (header.payload_bytes > wire::kMaxHelloRequestBytes) {
    return InvalidArgument("Hello payload of " + std::to_string(header.payload_bytes) +
                           " bytes exceeds the " + std::to_string(wire::kMaxHelloRequestBytes) +
                           " bytes a Hello may have");
  }
  return OkStatus();
}

size_t RequestHandler::ReplyBound(const wire::FrameHeader& header,
                                  const uint8_t* pull_sizes) const {
  // Errors and small replies: a fixed allowance (error messages are short).
  constexpr size_t kSmallReply =
      wire::kHeaderBytes + wire::kErrorFixed + wire::kMaxErrorMessageBytes;
  if (header.opcode != wire::Opcode::kPull || pull_sizes == nullptr) return kSmallReply;
  uint32_t dim, num_ids;
  std::memcpy(&dim, pull_sizes, 4);
  std::memcpy(&num_ids, pull_sizes + 4, 4);
  // A state pull's rows hold the slots and step too (at most 2 slots per
  // value): the table is not known yet, so bound by the widest.
  const bool state = IsStatePull(static_cast<PullMode>(pull_sizes[10]));
  const uint64_t width = state ? StateFloats(dim, 2 * dim) : uint64_t{dim};
  const uint64_t body = wire::kPullReplyFixed + uint64_t{4} * width * num_ids;
  if (body > max_frame_bytes_) {
    // A plain pull this large is refused with an error; a state pull's
    // table may keep fewer slots, so its reply may be a whole frame.
    return state ? wire::kHeaderBytes + size_t{max_frame_bytes_} : kSmallReply;
  }
  return std::max<size_t>(kSmallReply, wire::kHeaderBytes + body);
}

size_t RequestHandler::ErrorReply(uint64_t request_id, const Status& status, net::Buffer* reply) {
  counters_->errors[static_cast<int>(status.code())].fetch_add(1);
  return Respond(wire::Opcode::kError, request_id,
                 wire::EncodeError(status.code(), status.message()), reply);
}

size_t RequestHandler::Handle(const wire::FrameHeader& header, net::Buffer* frame,
                              bool* authenticated, Peer* peer, net::Buffer* reply,
                              bool* keep_open) {
  const uint8_t* payload = frame->data();
  const Clock::time_point start = Clock::now();
  *keep_open = true;
  const uint64_t id = header.request_id;
  auto fail = [&](const Status& s, bool close) {
    *keep_open = !close;
    return ErrorReply(id, s, reply);
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
    if (!auth_token_.empty() && !ConstantTimeEquals(hello.token, auth_token_)) {
      return fail(Unauthenticated(kWrongToken), true);
    }
    const bool replica = header.flags & wire::kFlagReplica;
    wire::HelloReply out;
    out.shard_index = shard_->shard_index();
    out.num_shards = shard_->num_shards();
    if (header.flags & wire::kFlagMove) {
      // A range stream to the shard this process prepares.
      uint64_t generation = 0;
      s = replica ? InvalidArgument("a Hello is a standby's or a range stream's, not both")
                  : reshard_target_.Greet(&generation, &out.shard_index, &out.num_shards);
      if (!s.ok()) return fail(s, true);
      peer->move_generation = generation;
    } else if (replica != standby_.load()) {
      // A standby serves its primary only; only a standby takes a primary.
      const std::string shard = "shard " + std::to_string(shard_->shard_index());
      if (replica) {
        return fail(FailedPrecondition(shard + " here is not a standby (it serves trainers)"),
                    true);
      }
      // Not counted among the errors: clients greet every copy of a shard
      // to find the one serving (before each admin write, say).
      *keep_open = false;
      const Status standby = Unavailable(
          shard + " here is a standby (it follows its primary): connect to the primary");
      return Respond(wire::Opcode::kError, id, wire::EncodeError(standby.code(), standby.message()),
                     reply);
    }
    if (!replica && !(header.flags & wire::kFlagMove)) {
      const Status replaced = Replaced();
      if (!replaced.ok()) return fail(replaced, true);
    }
    *authenticated = true;
    if (replica) peer->replica_hello = replica_hellos_.fetch_add(1) + 1;
    counters_->hellos.fetch_add(1);
    out.num_buckets = kNumBuckets;
    out.admin_port = admin_port_.load();
    out.max_frame_bytes = max_frame_bytes_;
    // A standby that promised another's takeover tells at least its fence,
    // so the primary it stopped following learns it was replaced.
    out.epoch = standby_.load() ? shard_->newest_epoch() : shard_->epoch();
    out.layout_epoch = shard_->layout_epoch();
    out.layout = shard_->layout_addresses();
    // A read-only shard serves checkpoints, not the rows written to one
    // process: its clients may take any copy of it (no lineage).
    out.lineage = read_only_.load(std::memory_order_relaxed) ? 0 : shard_->lineage();
    {
      std::lock_guard<std::mutex> lock(staged_mu_);
      out.standbys = standbys_;
    }
    if (out.standbys.empty()) {
      const std::shared_ptr<WriteListener> listener = std::atomic_load(&listener_);
      if (listener != nullptr) out.standbys = listener->standbys();
    }
    return Respond(wire::Opcode::kHello, id,
                   wire::EncodeHelloReply(out, header.flags & wire::kFlagTopology), reply);
  }
  if (!*authenticated) {
    return fail(Unauthenticated("the first frame on a connection must be Hello"), true);
  }
  if (header.opcode == wire::Opcode::kStandbyTable || header.opcode == wire::Opcode::kReplicate) {
    uint32_t rows = 0;
    bool stale = false;
    const Status applied =
        peer->move_generation != 0
            ? reshard_target_.Apply(header, frame->data(), peer->move_generation, &rows, &stale)
            : ApplyFromPrimary(header, frame, peer->replica_hello, &rows, &stale);
    if (!applied.ok()) return fail(applied, stale);
    return Respond(header.opcode, id, wire::EncodePushReply(rows), reply);
  }
  if (header.opcode != wire::Opcode::kPull && header.opcode != wire::Opcode::kPush &&
      header.opcode != wire::Opcode::kAssign) {
    return fail(
        InvalidArgument("unknown opcode " + std::to_string(static_cast<int>(header.opcode))),
        false);
  }
  if (standby_.load(std::memory_order_relaxed)) {
    return fail(Unavailable("shard " + std::to_string(shard_->shard_index()) +
                            " here is a standby (it follows its primary): requests go to the "
                            "primary"),
                false);
  }
  const Status replaced = Replaced();
  if (!replaced.ok()) return fail(replaced, false);
  const bool push = header.opcode == wire::Opcode::kPush;
  const bool assign = header.opcode == wire::Opcode::kAssign;
  const bool read_only = read_only_.load(std::memory_order_relaxed);
  if ((push || assign) && read_only) {
    return fail(
        FailedPrecondition("shard " + std::to_string(shard_->shard_index()) +
                           " is read-only (it serves checkpoints): " +
                           (push ? "pushes" : "assignments") + " go to the training shards"),
        false);
  }
  wire::TableRequest request;
  Status s = push     ? wire::DecodePushRequest(payload, header.payload_bytes, &request)
             : assign ? wire::DecodeAssignRequest(payload, header.payload_bytes, &request)
                      : wire::DecodePullRequest(payload, header.payload_bytes, &request);
  if (!s.ok()) return fail(s, false);
  // A write counts itself in flight before it checks the hold, so
  // HoldWrites (which holds, then waits until none is in flight) never
  // misses one.
  WriteTicket ticket(push || assign ? &writes_in_flight_ : nullptr);
  if ((push || assign) && writes_held_.load()) {
    return fail(Aborted("shard " + std::to_string(shard_->shard_index()) +
                        " is switching to a new layout: the write was not applied; send it again"),
                false);
  }
  std::shared_ptr<Table> table;
  s = shard_->TableFor(request.table, request.ids, request.num_ids, &table);
  if (!s.ok()) return fail(s, false);
  if (request.dim != table->dim()) {
    return fail(
        InvalidArgument("table '" + request.table + "' has dim " + std::to_string(table->dim()) +
                        ", the request says " + std::to_string(request.dim)),
        false);
  }

  if (assign) {
    s = table->Assign(request.ids, request.grads, request.num_ids);
    // Marked while still counted in flight, as a push: a hold that waits for
    // the writes in flight then finds the mark in its last round.
    const WriteMark applied = MarkApplied();
    ticket.Done();
    if (!s.ok()) return fail(InTable(s, request.table), false);
    counters_->assigned_rows.fetch_add(request.num_ids);
    s = AwaitStandby(applied);
    if (!s.ok()) return fail(s, false);
    return Respond(wire::Opcode::kAssign, id, wire::EncodePushReply(request.num_ids), reply);
  }
  if (push) {
    WriteMark applied;
    if (request.identified) {
      PushLedger& ledger = shard_->push_ledger();
      Status first;
      if (ledger.Begin(request.push_id, &first, request.ancestors.data(),
                       request.ancestors.size())) {
        // Its rows and its id reach a standby in the same round: the first
        // round to take changes after it released the gate.
        std::shared_lock<WriterFirstLock> gate(ledger.gate());
        s = table->Push(request.ids, request.grads, request.num_ids, request.learning_rate);
        if (!s.ok()) s = InTable(s, request.table);
        ledger.End(request.push_id, s);
        applied = MarkApplied();
      } else {  // sent again: applied before (or the push it is a part of), here or on the
                // primary this shard followed, or on the shard whose rows this one took
        counters_->repeated_pushes.fetch_add(1);
        s = first;
        applied = MarkApplied();
      }
    } else {
      s = table->Push(request.ids, request.grads, request.num_ids, request.learning_rate);
      if (!s.ok()) s = InTable(s, request.table);
      applied = MarkApplied();
    }
    ticket.Done();
    if (!s.ok()) return fail(s, false);
    counters_->pushes.fetch_add(1);
    counters_->pushed_rows.fetch_add(request.num_ids);
    s = AwaitStandby(applied);
    if (!s.ok()) return fail(s, false);
    counters_->push_latency.Record(MicrosSince(start));
    return Respond(wire::Opcode::kPush, id, wire::EncodePushReply(request.num_ids), reply);
  }
  const uint64_t width = IsStatePull(request.mode) ? StateFloats(request.dim, table->slot_floats())
                                                   : uint64_t{request.dim};
  const uint64_t body = wire::kPullReplyFixed + uint64_t{4} * width * request.num_ids;
  if (body > max_frame_bytes_) {
    return fail(
        ResourceExhausted("reply of " + std::to_string(body) +
                          " bytes would exceed the maximum frame of " +
                          std::to_string(max_frame_bytes_) + " bytes; send fewer ids per frame"),
        false);
  }
  uint8_t* out = reply->Reserve(wire::kHeaderBytes + body);
  wire::EncodeHeader({wire::Opcode::kPull, wire::kFlagResponse, id, static_cast<uint32_t>(body)},
                     out);
  wire::EncodePullReplyPrefix(request.dim, request.num_ids, out + wire::kHeaderBytes);
  // A read-only server inserts nothing: a training pull reads what an
  // inference pull returning zeros reads.
  float* const rows = reinterpret_cast<float*>(out + wire::kHeaderBytes + wire::kPullReplyFixed);
  const PullMode plain = PullMode::kZerosNoInsert;
  if (read_only && request.mode == PullMode::kStateInsert) {
    s = table->PullState(request.ids, request.num_ids, &plain, rows);
  } else {
    const bool insert = request.mode == PullMode::kInsert;
    s = table->Pull(request.ids, request.num_ids, read_only && insert ? plain : request.mode, rows);
  }
  // A disk tier error: the reply written so far is replaced by the error.
  if (!s.ok()) return fail(InTable(s, request.table), false);
  counters_->pulls.fetch_add(1);
  counters_->pulled_rows.fetch_add(request.num_ids);
  counters_->pull_latency.Record(MicrosSince(start));
  return wire::kHeaderBytes + body;
}

Status RequestHandler::Replaced() const {
  const uint64_t by = shard_->superseded_by();
  if (by == 0 || standby_.load()) return OkStatus();
  return Unavailable("shard " + std::to_string(shard_->shard_index()) + " here was replaced (" +
                     shard_->replaced_by() + ", newer than this primary's " +
                     std::to_string(shard_->epoch()) +
                     "); it serves no trainer: list the shard's addresses as primary|standby "
                     "so clients find the newer primary");
}

RequestHandler::WriteMark RequestHandler::MarkApplied() const {
  WriteMark applied{std::atomic_load(&listener_), 0};
  if (applied.listener != nullptr) applied.mark = applied.listener->Applied();
  return applied;
}

Status RequestHandler::HoldWrites(bool hold, int timeout_ms) {
  writes_held_.store(hold);
  if (!hold) return OkStatus();
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (writes_in_flight_.load() != 0) {
    if (Clock::now() > deadline) {
      return DeadlineExceeded("shard " + std::to_string(shard_->shard_index()) + " still had " +
                              std::to_string(writes_in_flight_.load()) +
                              " writes being applied after " + std::to_string(timeout_ms) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return OkStatus();
}

Status RequestHandler::AwaitStandby(const WriteMark& applied) {
  if (applied.listener == nullptr) return OkStatus();
  const Status s = applied.listener->Written(applied.mark);
  if (s.ok()) return s;
  // Past the standby timeout the client may send it again (UNAVAILABLE,
  // as for a standby known to be down): under its id it is not applied
  // twice and waits for the standby anew, within the client's deadline.
  const Code code = s.code() == Code::kDeadlineExceeded ? Code::kUnavailable : s.code();
  return Status(code, "the write was applied on shard " + std::to_string(shard_->shard_index()) +
                          " but its standby did not acknowledge it (in doubt): " + s.message());
}

Status RequestHandler::ApplyFromPrimary(const wire::FrameHeader& header, net::Buffer* frame,
                                        uint64_t replica_hello, uint32_t* rows, bool* stale) {
  const uint8_t* payload = frame->data();
  if (!standby_.load()) {
    return FailedPrecondition("shard " + std::to_string(shard_->shard_index()) +
                              " here is not a standby: it takes no replication frames");
  }
  if (replica_hello == 0) {  // a trainer's connection (made before a step-down, say)
    *stale = true;
    return FailedPrecondition(
        "a replication frame on a connection that did not greet as a replica: refused, and the "
        "connection closed");
  }
  wire::StandbyTableRequest request;
  if (header.opcode == wire::Opcode::kStandbyTable) {
    DLT_RETURN_IF_ERROR(wire::DecodeStandbyTable(payload, header.payload_bytes, &request));
  }
  const bool copy_begins =
      header.opcode == wire::Opcode::kStandbyTable && request.action == wire::kMakeTable;
  std::shared_lock<std::shared_mutex> in_session(session_mu_, std::defer_lock);
  std::unique_lock<std::shared_mutex> new_session(session_mu_, std::defer_lock);
  // A table made or dropped on the connection whose copies made this
  // standby caught up (not on a new one, which copies every table afresh).
  bool same_session;
  if (copy_begins) {
    new_session.lock();  // after every frame being applied now
    same_session = replica_hello == session_;
    session_ = std::max(session_, replica_hello);
  } else {
    in_session.lock();
    same_session = replica_hello == session_;
  }
  if (!standby_.load()) {  // it took over while this frame waited
    *stale = true;
    return FailedPrecondition("shard " + std::to_string(shard_->shard_index()) +
                              " here took over: it takes no replication frames");
  }
  if (replica_hello < session_) {
    *stale = true;
    return FailedPrecondition(
        "a replication frame on a connection its primary made before the one that began its "
        "latest copy: refused, and the connection closed");
  }
  if (header.opcode == wire::Opcode::kStandbyTable) {
    if (request.action == wire::kRoundEnd || request.action == wire::kCaughtUp) {
      uint64_t epoch;
      std::vector<PushId> ids;
      DLT_RETURN_IF_ERROR(DecodeRoundEnd(request.config, &epoch, &ids));
      std::vector<Staged> staged;
      std::map<std::string, std::shared_ptr<Table>> pending;
      {
        std::lock_guard<std::mutex> lock(staged_mu_);
        staged.swap(staged_);  // applied now, or (on an error) never
        staged_bytes_ = 0;
        if (pending_session_ == replica_hello) pending.swap(pending_);
        pending_.clear();
      }
      const uint64_t follows = shard_->newest_epoch();
      if (epoch < follows) {
        // A primary that was replaced (this standby follows, or promised to
        // follow, a newer one): its round is dropped and its connection
        // closed, and its next Hello tells it the newer epoch.
        *stale = true;
        return FailedPrecondition("a round of a primary at epoch " + std::to_string(epoch) +
                                  ", older than epoch " + std::to_string(follows) +
                                  " this standby follows: refused (that primary was replaced)");
      }
      Status applied = InstallPending(std::move(pending));
      if (applied.ok()) applied = ApplyRound(staged);
      if (payload_pool_ != nullptr) {
        for (Staged& frame : staged) payload_pool_->Put(std::move(frame.payload));
      }
      if (!applied.ok()) {
        // Part of the round may be applied, without its pushes' ids: this
        // copy may not take over until its primary copies it afresh (the
        // connection closes; the primary connects again and copies).
        caught_up_.store(false);
        *stale = true;
        return applied;
      }
      shard_->push_ledger().Insert(ids.data(), ids.size());
      shard_->set_epoch(epoch);  // its primary's, until it takes over
      if (request.action == wire::kCaughtUp) {
        // The end of this connection's first round, which copied every
        // table its primary holds: a table held here that it did not copy
        // was dropped there while no connection could tell (the round that
        // would have dropped it failed). Kept, it served a takeover with its
        // old rows, and a table made again of its name took them.
        std::set<std::string> copied;
        bool first_copy;
        {
          std::lock_guard<std::mutex> lock(staged_mu_);
          first_copy = caught_up_session_ != replica_hello;
          caught_up_session_ = replica_hello;
          if (copy_session_ == replica_hello) copied = copied_;
        }
        for (const std::shared_ptr<Table>& table :
             first_copy ? shard_->Tables() : std::vector<std::shared_ptr<Table>>{}) {
          const std::string& name = table->config().name;
          if (copied.count(name) != 0) continue;
          const Status dropped = shard_->DropTable(name);
          if (!dropped.ok() && dropped.code() != Code::kNotFound) {
            caught_up_.store(false);
            *stale = true;
            return dropped;
          }
        }
        caught_up_.store(true);
      }
      return OkStatus();
    }
    if (request.action == wire::kProvisional) {
      std::string name;
      bool provisional;
      DLT_RETURN_IF_ERROR(wire::DecodeProvisional(request.config, &name, &provisional));
      std::shared_ptr<Table> pending;
      DLT_RETURN_IF_ERROR(PendingTable(name, &pending));
      return ApplyProvisional(shard_.get(), request.config, std::move(pending));
    }
    if (request.action == wire::kInSync) {
      wire::InSyncView view;
      DLT_RETURN_IF_ERROR(wire::DecodeInSyncView(request.config, &view));
      std::lock_guard<std::mutex> lock(staged_mu_);
      insync_ = std::move(view);
      return OkStatus();
    }
    if (request.action == wire::kSketchSlices || request.action == wire::kSketchCounts) {
      wire::SketchRequest sketch;  // checked now, applied now or at the round's end
      DLT_RETURN_IF_ERROR(wire::DecodeSketch(request.action, request.config, &sketch));
      std::shared_ptr<Table> pending;
      DLT_RETURN_IF_ERROR(PendingTable(sketch.table, &pending));
      if (pending != nullptr) {
        return ApplySketch(shard_.get(), request.action, request.config, std::move(pending));
      }
      bool staged;
      const Status held = StageIfCaughtUp(header, frame, &staged, stale);
      if (!held.ok() || staged) return held;
      return ApplySketch(shard_.get(), request.action, request.config);
    }
    TableConfig config;
    DLT_RETURN_IF_ERROR(DecodeTableConfig(request.config, &config));
    std::shared_ptr<Table> made;
    if (request.action != wire::kDropTable) {
      DLT_RETURN_IF_ERROR(ValidateTableConfig(config));
      made = shard_->NewTable(config);
    }
    {
      std::lock_guard<std::mutex> lock(staged_mu_);
      if (copy_session_ != replica_hello) {
        copy_session_ = replica_hello;
        copied_.clear();
      }
      if (made != nullptr) {
        copied_.insert(config.name);
      } else {
        copied_.erase(config.name);
      }
      if (same_session && caught_up_.load()) {
        // The copy this standby holds serves a takeover until the round
        // that finishes the new one ends.
        if (pending_session_ != replica_hello) pending_.clear();
        pending_session_ = replica_hello;
        pending_[config.name] = std::move(made);
        return OkStatus();
      }
      if (made != nullptr) {
        // Until this table is copied whole; rows of an unfinished round (a
        // connection lost) are older than the copy.
        caught_up_.store(false);
        DropStagedLocked();
      }
    }
    if (made == nullptr) {
      const Status dropped = shard_->DropTable(config.name);
      return dropped.code() == Code::kNotFound ? OkStatus() : dropped;
    }
    shard_->InstallTables({std::move(made)});
    return OkStatus();
  }
  wire::ReplicateRequest replicate;
  DLT_RETURN_IF_ERROR(wire::DecodeReplicate(payload, header.payload_bytes, &replicate));
  *rows = replicate.rows;
  std::shared_ptr<Table> pending;
  DLT_RETURN_IF_ERROR(PendingTable(replicate.table, &pending));
  if (pending != nullptr) return ApplyRows(shard_.get(), replicate, PushClock::kTake, pending);
  bool staged;
  const Status held = StageIfCaughtUp(header, frame, &staged, stale);
  if (!held.ok() || staged) return held;
  return ApplyRows(shard_.get(), replicate, PushClock::kTake);
}

Status RequestHandler::PendingTable(const std::string& name, std::shared_ptr<Table>* table) const {
  std::lock_guard<std::mutex> lock(staged_mu_);
  const auto it = pending_.find(name);
  table->reset();
  if (it == pending_.end()) return OkStatus();
  if (it->second == nullptr) {
    return FailedPrecondition("table '" + name + "' was dropped in this round: it takes no rows");
  }
  *table = it->second;
  return OkStatus();
}

Status RequestHandler::InstallPending(std::map<std::string, std::shared_ptr<Table>> pending) {
  std::vector<std::shared_ptr<Table>> made;
  for (auto& [name, table] : pending) {
    if (table != nullptr) {
      made.push_back(std::move(table));
      continue;
    }
    const Status dropped = shard_->DropTable(name);
    if (!dropped.ok() && dropped.code() != Code::kNotFound) return dropped;
  }
  shard_->InstallTables(made);
  return OkStatus();
}

void RequestHandler::set_standby(bool standby, bool new_epoch) {
  // After every replication frame being applied now: a round's end that
  // began before a takeover is not applied after it (its rows over the new
  // primary's writes, its epoch over the new one).
  std::unique_lock<std::shared_mutex> session(session_mu_);
  std::lock_guard<std::mutex> lock(staged_mu_);
  const bool was_standby = standby_.exchange(standby);
  if (standby && !was_standby) {
    // A primary that steps down follows another afresh: it holds nothing
    // of that one's until it says so, and the pushes it applied are gone
    // with its tables.
    caught_up_.store(false);
    DropStagedLocked();
    insync_ = wire::InSyncView{};
    shard_->push_ledger().ForgetDone();
  }
  const bool took_over = was_standby && !standby;
  if (took_over) {
    DropStagedLocked();  // a round its primary did not finish
    // Newer than the primary it replaces, and than any it promised to let
    // take over (that one may have served before it died).
    shard_->set_epoch(shard_->newest_epoch() + (new_epoch ? 1 : 0));
  }
  if (standby != was_standby) shard_->Supersede(0);  // it follows, or serves afresh
}

Status RequestHandler::StageIfCaughtUp(const wire::FrameHeader& header, net::Buffer* payload,
                                       bool* staged, bool* stale) {
  // A standby that may take over applies a round whole or not at all: its
  // rows and sketch counts wait for the round's end, with the pushes' ids.
  *staged = false;
  if (!caught_up_.load()) return OkStatus();
  std::lock_guard<std::mutex> lock(staged_mu_);
  if (staged_bytes_ + header.payload_bytes > max_staged_bytes_) {
    // Not held past the limit, nor applied in part (this copy could take
    // over holding half a round): dropped. The connection closes, and its
    // primary connects again and copies every table whole, applied as it
    // comes; until then this copy may not take over.
    const uint64_t bytes = staged_bytes_ + header.payload_bytes;
    caught_up_.store(false);
    DropStagedLocked();
    counters_->standby_rounds_dropped.fetch_add(1);
    *stale = true;
    return ResourceExhausted("a replication round past " + std::to_string(max_staged_bytes_) +
                             " bytes (" + std::to_string(bytes) +
                             " so far) would not fit this standby's buffer: dropped; its "
                             "primary copies every table afresh");
  }
  staged_bytes_ += header.payload_bytes;
  staged_.push_back({header.opcode, std::move(*payload), header.payload_bytes});
  *staged = true;
  return OkStatus();
}

void RequestHandler::DropStagedLocked() {
  staged_.clear();
  staged_bytes_ = 0;
  pending_.clear();
}

Status RequestHandler::ApplyRound(const std::vector<Staged>& staged) {
  std::vector<wire::ReplicateRequest> rows;
  for (const Staged& frame : staged) {
    if (frame.opcode != wire::Opcode::kReplicate) continue;
    rows.emplace_back();
    DLT_RETURN_IF_ERROR(wire::DecodeReplicate(frame.payload.data(), frame.bytes, &rows.back()));
  }
  std::vector<Status> applied(rows.size());
  RowStreamPool().ParallelFor(rows.size(), [&](size_t i) {
    applied[i] = ApplyRows(shard_.get(), rows[i], PushClock::kKeep);
  });
  for (const Status& s : applied) DLT_RETURN_IF_ERROR(s);
  for (const Staged& frame : staged) {
    if (frame.opcode == wire::Opcode::kReplicate) continue;
    wire::StandbyTableRequest request;
    DLT_RETURN_IF_ERROR(wire::DecodeStandbyTable(frame.payload.data(), frame.bytes, &request));
    DLT_RETURN_IF_ERROR(ApplySketch(shard_.get(), request.action, request.config));
  }
  for (const wire::ReplicateRequest& r : rows) {
    std::shared_ptr<Table> table;
    DLT_RETURN_IF_ERROR(shard_->GetTable(r.table, &table));
    table->SetPushClock(static_cast<uint32_t>(r.push_clock));
  }
  return OkStatus();
}

}  // namespace dlt
