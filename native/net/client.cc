// The data-plane client's requests: routing ids to shards (each distinct id
// once, with dedup), splitting them into frames, and building pulls, pushes
// and assignments. Connections are client_connections.cc; sending and
// receiving every shard's frames at once is client_exchange.cc.
#include "native/net/client.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "native/core/dedup.h"
#include "native/core/finite.h"
#include "native/core/random.h"
#include "native/core/routing.h"
#include "native/core/table_config.h"
#include "native/net/client_call.h"
#include "native/net/socket.h"

namespace dlt {

using net::Clock;

Client::Client(std::vector<std::string> addresses, ClientOptions options)
    : options_(std::move(options)) {
  auto layout = std::make_shared<Layout>();
  for (const std::string& a : addresses) {
    states_.push_back(std::make_unique<ShardState>());
    ShardState& st = *states_.back();
    st.index = static_cast<uint32_t>(layout->shards.size());
    st.count = static_cast<uint32_t>(addresses.size());
    st.addresses = net::SplitAddresses(a);
    st.address = st.addresses.front();
    if (st.addresses.size() > 1) has_standbys_.store(true);
    layout->shards.push_back(&st);
  }
  layout_ = std::move(layout);
  client_id_ = RandomWord() ^
               static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

Client::~Client() {
  for (auto& s : states_) {
    for (Conn& c : s->idle) net::CloseFd(c.fd);
  }
}

std::string Client::Context(const ShardState& shard, const char* op) const {
  std::lock_guard<std::mutex> lock(shard.mu);
  return Context(shard.index, shard.address, op);
}

std::string Client::Context(uint32_t index, const std::string& address, const char* op) {
  return "shard " + std::to_string(index) + " (" + address + ") " + op;
}

uint32_t Client::ShardOf(int64_t id) const {
  return ShardOfBucket(BucketOf(id), static_cast<uint32_t>(num_shards()));
}

namespace {

// Positions of the ids each shard owns, in input order. With `repeats`, each
// distinct id once: the position of its first occurrence, and every later
// occurrence in `repeats` as (its position, the first's). One pass hashes each
// id once, for the dedup table and its shard both.
void GroupByShard(const int64_t* ids, size_t n, size_t num_shards,
                  std::vector<std::vector<uint32_t>>* groups,
                  std::vector<std::pair<uint32_t, uint32_t>>* repeats) {
  groups->assign(num_shards, {});
  if (num_shards == 1 && repeats == nullptr) {
    (*groups)[0].resize(n);
    for (size_t i = 0; i < n; ++i) (*groups)[0][i] = static_cast<uint32_t>(i);
    return;
  }
  for (auto& g : *groups) g.reserve(n / num_shards + n / 16 + 16);
  const auto shards = static_cast<uint32_t>(num_shards);
  if (repeats == nullptr) {
    for (size_t i = 0; i < n; ++i) {
      (*groups)[ShardOfBucket(BucketOf(ids[i]), shards)].push_back(static_cast<uint32_t>(i));
    }
    return;
  }
  struct Scratch {
    Deduper dedup;
    std::vector<uint32_t> firsts;
  };
  Scratch own;
  Scratch& scratch = ThreadScratch(n, own);
  std::vector<uint32_t>& firsts = scratch.firsts;
  firsts.clear();
  repeats->clear();
  scratch.dedup.Visit(
      ids, n,
      [&](size_t i, uint64_t hash, uint32_t) {
        firsts.push_back(static_cast<uint32_t>(i));
        (*groups)[ShardOfBucket(BucketOfHash(hash), shards)].push_back(static_cast<uint32_t>(i));
      },
      [&](size_t i, uint32_t u) { repeats->emplace_back(static_cast<uint32_t>(i), firsts[u]); });
}

// `lanes` runs of `pos` (positions of `ids`) with every occurrence of an id
// in one run, input order kept within each: consecutive ranges, except that
// a repeated id's later occurrences join the run of its first (so each lane
// reads about one part of the rows). Reorders `pos` when an id repeats;
// returns the runs' starts, then the end.
std::vector<size_t> SplitById(const int64_t* ids, size_t lanes, std::vector<uint32_t>* pos) {
  struct Scratch {
    Deduper dedup;
    std::vector<int64_t> ids;
    std::vector<uint32_t> lane_of, firsts, sorted;
  };
  Scratch own;
  const size_t n = pos->size();
  Scratch& scratch = ThreadScratch(n, own);
  scratch.ids.resize(n);
  for (size_t k = 0; k < n; ++k) scratch.ids[k] = ids[(*pos)[k]];
  std::vector<uint32_t>& lane_of = scratch.lane_of;
  std::vector<uint32_t>& firsts = scratch.firsts;
  lane_of.resize(n);
  firsts.clear();
  bool repeated = false;
  scratch.dedup.Visit(
      scratch.ids.data(), n,
      [&](size_t k, uint64_t, uint32_t) {
        firsts.push_back(static_cast<uint32_t>(k));
        lane_of[k] = static_cast<uint32_t>(k * lanes / n);
      },
      [&](size_t k, uint32_t u) {
        lane_of[k] = lane_of[firsts[u]];
        repeated = true;
      });
  std::vector<size_t> starts(lanes + 1, 0);
  for (size_t k = 0; k < n; ++k) ++starts[lane_of[k] + 1];
  for (size_t l = 0; l < lanes; ++l) starts[l + 1] += starts[l];
  if (!repeated) return starts;
  std::vector<size_t> at(starts.begin(), starts.end() - 1);
  std::vector<uint32_t>& sorted = scratch.sorted;
  sorted.resize(n);
  for (size_t k = 0; k < n; ++k) sorted[at[lane_of[k]]++] = (*pos)[k];
  pos->swap(sorted);
  return starts;
}

// Frames of at most `rows_per_frame` rows for rows [first, end) of `pos`
// (positions of `ids`) with every occurrence of an id in one frame, as a
// shard sums an id's rows only within a frame (Keras Adagrad squares each
// occurrence; split over two frames, the row is updated twice): where an id
// repeats, its occurrences join its first (input order kept otherwise) and
// frames are cut between ids. An id that occurs more often than
// `rows_per_frame` gets a frame of its own, of at most `max_rows` rows (the
// shard's maximum frame): Keras Adagrad pushes every occurrence, and a hot
// id may fill more than a frame. `cuts` gets the frames' starts, then
// `end`; left empty when no id repeats (frames of rows_per_frame rows).
// Fails naming an id that occurs more often than `max_rows`.
Status FramesById(const int64_t* ids, size_t first, size_t end, size_t rows_per_frame,
                  size_t max_rows, std::vector<uint32_t>* pos, std::vector<size_t>* cuts) {
  struct Scratch {
    Deduper dedup;
    std::vector<int64_t> ids;
    std::vector<uint32_t> distinct_of, firsts, place, sorted;
  };
  Scratch own;
  const size_t n = end - first;
  Scratch& scratch = ThreadScratch(n, own);
  uint32_t* const run = pos->data() + first;
  scratch.ids.resize(n);
  for (size_t k = 0; k < n; ++k) scratch.ids[k] = ids[run[k]];
  std::vector<uint32_t>& distinct_of = scratch.distinct_of;
  std::vector<uint32_t>& firsts = scratch.firsts;
  std::vector<uint32_t>& place = scratch.place;  // occurrences, then first place
  distinct_of.resize(n);
  firsts.clear();
  place.clear();
  bool repeated = false;
  scratch.dedup.Visit(
      scratch.ids.data(), n,
      [&](size_t k, uint64_t, uint32_t u) {
        distinct_of[k] = u;
        firsts.push_back(static_cast<uint32_t>(k));
        place.push_back(1);
      },
      [&](size_t k, uint32_t u) {
        distinct_of[k] = u;
        ++place[u];
        repeated = true;
      });
  cuts->clear();
  if (!repeated) return OkStatus();
  cuts->push_back(first);
  size_t placed = 0, frame_rows = 0;
  for (size_t u = 0; u < place.size(); ++u) {
    const uint32_t occurrences = place[u];
    if (occurrences > max_rows) {
      cuts->clear();
      return ResourceExhausted("id " + std::to_string(scratch.ids[firsts[u]]) + " occurs " +
                               std::to_string(occurrences) +
                               " times, more than one frame of the shard's maximum holds (" +
                               std::to_string(max_rows) + " rows; --max-frame-bytes)");
    }
    if (frame_rows > 0 && frame_rows + occurrences > rows_per_frame) {
      cuts->push_back(first + placed);
      frame_rows = 0;
    }
    frame_rows += occurrences;
    place[u] = static_cast<uint32_t>(placed);
    placed += occurrences;
  }
  cuts->push_back(end);
  std::vector<uint32_t>& sorted = scratch.sorted;
  sorted.resize(n);
  for (size_t k = 0; k < n; ++k) sorted[place[distinct_of[k]]++] = run[k];
  std::copy(sorted.begin(), sorted.end(), run);
  return OkStatus();
}

// Per-shard copies of a call's ids (and rows), which the thread that sends
// a part fills. Kept by the calling thread for its next call up to
// kKeepCopyBytes: fresh memory for a push's 17 MB of copies cost more CPU in
// page faults than the copying itself (bench_wire.py).
struct CallCopies {
  std::vector<std::pair<std::unique_ptr<char[]>, size_t>> buffers;

  // Buffer `i`, room for at least `count` T (its contents are not kept).
  template <typename T>
  T* Get(size_t i, size_t count) {
    if (buffers.size() <= i) buffers.resize(i + 1);
    auto& [data, size] = buffers[i];
    if (size < count * sizeof(T)) {
      data.reset(new char[count * sizeof(T)]);
      size = count * sizeof(T);
    }
    return reinterpret_cast<T*>(data.get());
  }
};

constexpr size_t kKeepCopyBytes = 32u << 20;

CallCopies& CopiesFor(size_t bytes, CallCopies& own) {
  thread_local CallCopies kept;
  return bytes <= kKeepCopyBytes ? kept : own;
}

// How many shards get a part of the call.
size_t Touched(const std::vector<std::vector<uint32_t>>& groups) {
  size_t touched = 0;
  for (const auto& g : groups) touched += g.empty() ? 0 : 1;
  return touched;
}

Status CheckBatch(size_t n, uint32_t dim) {
  if (n > UINT32_MAX) return InvalidArgument("at most 2^32-1 ids per call");
  if (dim == 0 || dim > kMaxDim) {
    return InvalidArgument("dim must be in [1, " + std::to_string(kMaxDim) + "], got " +
                           std::to_string(dim));
  }
  return OkStatus();
}

// The error of a retried request whose last attempt ran out of its
// deadline: that, and why the attempt before it failed (a standby that did
// not acknowledge, a primary not reached), which is what the caller can act
// on.
Status AfterRetries(const Status& last, const Status& before) {
  if (last.code() != Code::kDeadlineExceeded || before.ok() || before.message() == last.message()) {
    return last;
  }
  return Status(last.code(), last.message() + "; the attempt before it: " + before.message());
}

}  // namespace

Client::Call Client::RunCall(size_t shard, ShardState* state, wire::Opcode opcode, size_t first,
                             size_t end, size_t rows_per_frame,
                             std::function<void(size_t, size_t)> fill,
                             const std::function<void(size_t, size_t, Call*)>& add_frame,
                             std::vector<size_t> cuts) {
  Call call;
  call.shard = shard;
  call.state = state;
  call.opcode = opcode;
  call.rows_per_frame = rows_per_frame;
  call.first_row = first;
  call.num_rows = end - first;
  call.fill = std::move(fill);
  call.frame_starts = std::move(cuts);
  for (size_t f = 0, begin = first; begin < end; begin += call.FrameRows(f), ++f) {
    add_frame(begin, call.FrameRows(f), &call);
  }
  return call;
}

Status Client::Route(const Layout& layout, const int64_t* ids, size_t n, Clock::time_point deadline,
                     std::vector<std::vector<uint32_t>>* groups,
                     std::vector<std::pair<uint32_t, uint32_t>>* repeats) {
  std::vector<ShardInfo> infos;  // greets every shard once
  DLT_RETURN_IF_ERROR(GreetAll(layout, &infos, deadline));
  GroupByShard(ids, n, layout.shards.size(), groups, repeats);
  return OkStatus();
}

Status Client::RowsPerFrame(ShardState& shard, const char* op, uint32_t dim, size_t prefix_bytes,
                            size_t request_row_bytes, size_t reply_row_bytes, size_t* rows,
                            size_t* most_rows) {
  const FrameLimits limits = FrameLimit(shard);
  const uint32_t limit = limits.ours;
  size_t n = (limit - prefix_bytes) / request_row_bytes;
  if (reply_row_bytes > 0) n = std::min(n, (limit - wire::kPullReplyFixed) / reply_row_bytes);
  if (n == 0) {
    // A state pull's rows (a hot-row cache's) carry the optimizer slots too.
    const std::string with_state =
        reply_row_bytes > sizeof(float) * dim
            ? " with its optimizer state (" + std::to_string(reply_row_bytes) + " bytes)"
            : "";
    return ResourceExhausted(Context(shard, op) + ": one row of dim " + std::to_string(dim) +
                             with_state + " exceeds the frame limit of " + std::to_string(limit) +
                             " bytes");
  }
  *rows = n;
  if (most_rows != nullptr) {
    *most_rows = std::max(
        n, limits.shard > prefix_bytes ? (limits.shard - prefix_bytes) / request_row_bytes : 0);
  }
  return OkStatus();
}

Status Client::Pull(const std::string& table, uint32_t dim, const int64_t* ids, size_t n,
                    PullMode mode, float* out, bool dedup, size_t* sent) {
  if (IsStatePull(mode)) {
    return InvalidArgument("Pull modes kState and kStateInsert return wider rows: use PullState");
  }
  if (sent != nullptr) *sent = 0;
  return PullRows(table, dim, ids, n, mode, dim, out, dedup, sent);
}

Status Client::PullState(const std::string& table, uint32_t dim, uint32_t slot_floats,
                         const int64_t* ids, size_t n, float* out, bool insert) {
  return PullRows(table, dim, ids, n, insert ? PullMode::kStateInsert : PullMode::kState,
                  StateFloats(dim, slot_floats), out, /*dedup=*/false, nullptr);
}

Status Client::PullRows(const std::string& table, uint32_t dim, const int64_t* ids, size_t n,
                        PullMode mode, uint32_t row_floats, float* out, bool dedup, size_t* sent) {
  DLT_RETURN_IF_ERROR(CheckBatch(n, dim));
  DLT_RETURN_IF_ERROR(ValidateTableName(table));
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
  int backoff_ms = options_.retry_backoff_ms;
  int layout_backoff_ms = options_.retry_backoff_ms;
  int retries = 0;
  bool stale_retried = false;
  bool any_reused = false;
  std::shared_ptr<const Layout> layout = CurrentLayout();
  Status s = PullOnce(*layout, table, dim, ids, n, mode, row_floats, out, dedup, sent, deadline,
                      &any_reused);
  while (!s.ok() && (s.code() == Code::kUnavailable || s.code() == Code::kAborted)) {
    if (s.code() == Code::kAborted) {
      // Re-sharded: again, routed by the newer layout once there is one.
      if (!AwaitLayout(*layout, &layout_backoff_ms, deadline)) break;
      layout = CurrentLayout();
    } else if (any_reused && !stale_retried) {
      // A pooled connection that died while idle: once more at once.
      stale_retried = true;
    } else if (!PauseToRetry(&retries, &backoff_ms, deadline)) {
      break;
    }
    const Status before = s;
    s = AfterRetries(PullOnce(*layout, table, dim, ids, n, mode, row_floats, out, dedup, sent,
                              deadline, &any_reused),
                     before);
  }
  return s;
}

Status Client::PullOnce(const Layout& layout, const std::string& table, uint32_t dim,
                        const int64_t* ids, size_t n, PullMode mode, uint32_t row_floats,
                        float* out, bool dedup, size_t* sent, Clock::time_point deadline,
                        bool* any_reused) {
  *any_reused = false;
  if (sent != nullptr) *sent = 0;
  if (n == 0) return OkStatus();
  // With dedup each distinct id is asked once; its row lands at its first
  // position and is copied to the later ones.
  std::vector<std::vector<uint32_t>> groups;
  std::vector<std::pair<uint32_t, uint32_t>> repeats;
  DLT_RETURN_IF_ERROR(Route(layout, ids, n, deadline, &groups, dedup ? &repeats : nullptr));
  // Each shard's ids in request order, gathered by the thread that sends them.
  CallCopies own;
  CallCopies& copies = CopiesFor(n * sizeof(int64_t), own);
  std::vector<Call> calls;
  const size_t prefix_bytes = wire::kTableRequestFixed + wire::PaddedNameBytes(table.size());
  const size_t touched = Touched(groups);
  for (size_t s = 0; s < layout.shards.size(); ++s) {
    const std::vector<uint32_t>& pos = groups[s];
    if (pos.empty()) continue;
    ShardState* state = layout.shards[s];
    size_t rows_per_frame;
    DLT_RETURN_IF_ERROR(RowsPerFrame(*state, "Pull", dim, prefix_bytes, 8, size_t{4} * row_floats,
                                     &rows_per_frame));
    // Consecutive runs of the shard's rows, a connection each.
    const size_t lanes = LanesFor(pos.size(), pos.size() * (8 + size_t{4} * row_floats), touched);
    const bool in_order = pos.size() == n;  // every id, each once, to this shard
    const int64_t* shard_ids_ptr = ids;
    std::function<void(size_t, size_t)> fill;
    if (!in_order) {
      int64_t* to = copies.Get<int64_t>(s, pos.size());
      shard_ids_ptr = to;
      fill = [&pos, ids, to](size_t begin, size_t end) {
        for (size_t k = begin; k < end; ++k) to[k] = ids[pos[k]];
      };
    }
    for (size_t lane = 0; lane < lanes; ++lane) {
      const size_t first = pos.size() * lane / lanes, end = pos.size() * (lane + 1) / lanes;
      if (first == end) continue;
      Call call = RunCall(s, state, wire::Opcode::kPull, first, end, rows_per_frame, fill,
                          [&](size_t begin, size_t count, Call* to) {
                            Call::Frame fr;
                            fr.prefix = wire::EncodePullPrefix(table, dim,
                                                               static_cast<uint32_t>(count), mode);
                            fr.body[0] = shard_ids_ptr + begin;
                            fr.body_bytes[0] = count * 8;
                            fr.reply_bytes = wire::kPullReplyFixed + size_t{4} * row_floats * count;
                            to->frames.push_back(std::move(fr));
                          });
      call.rows.out = out;
      call.rows.pos = in_order ? nullptr : pos.data();
      call.rows.row_floats = row_floats;
      call.rows.state_dim = IsStatePull(mode) ? dim : 0;
      call.rows.stream = StreamsPulledRows(out, row_floats, n);
      call.rows.fixed = wire::kPullReplyFixed;
      call.on_reply = [rows = end - first, rows_per_frame, dim](size_t frame, const uint8_t* p,
                                                                size_t bytes) -> Status {
        if (bytes != wire::kPullReplyFixed) return Internal("Pull reply lacks its fixed part");
        const size_t count = std::min(rows_per_frame, rows - frame * rows_per_frame);
        uint32_t got_dim, got_rows;
        std::memcpy(&got_dim, p, 4);
        std::memcpy(&got_rows, p + 4, 4);
        if (got_dim != dim || got_rows != count) {
          return Internal("Pull reply names dim " + std::to_string(got_dim) + " and " +
                          std::to_string(got_rows) + " rows; the request has dim " +
                          std::to_string(dim) + " and " + std::to_string(count) + " ids");
        }
        return OkStatus();
      };
      calls.push_back(std::move(call));
    }
  }
  DLT_RETURN_IF_ERROR(Exchange(&calls, "Pull", deadline, any_reused));
  for (const Call& call : calls) {
    if (!call.refused.empty()) return call.refusal;  // pulled again whole
  }
  if (sent != nullptr) *sent = n - repeats.size();
  const size_t w = row_floats;
  for (const auto& [at, first] : repeats) {
    std::memcpy(out + size_t{at} * w, out + size_t{first} * w, sizeof(float) * w);
  }
  return OkStatus();
}

Status Client::Push(const std::string& table, uint32_t dim, const int64_t* ids, const float* grads,
                    size_t n, float learning_rate) {
  return SendRows(wire::Opcode::kPush, table, dim, ids, grads, n, learning_rate,
                  Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms), nullptr);
}

Status Client::Assign(const std::string& table, uint32_t dim, const int64_t* ids,
                      const float* values, size_t n) {
  return SendRows(wire::Opcode::kAssign, table, dim, ids, values, n, 0.0f,
                  Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms), nullptr);
}

Status Client::SendRows(wire::Opcode opcode, const std::string& table, uint32_t dim,
                        const int64_t* ids, const float* rows, size_t n, float learning_rate,
                        Clock::time_point deadline, const std::vector<PushId>* ancestors) {
  const char* op = opcode == wire::Opcode::kPush ? "Push" : "Assign";
  const bool part = ancestors != nullptr && !ancestors->empty();
  DLT_RETURN_IF_ERROR(CheckBatch(n, dim));
  DLT_RETURN_IF_ERROR(ValidateTableName(table));
  if (n == 0) return OkStatus();
  // Checked here, before any shard gets its part, so a bad batch changes no
  // shard (each shard checks its own part again).
  if (opcode == wire::Opcode::kPush) {
    DLT_RETURN_IF_ERROR(CheckLearningRate(learning_rate, /*ftrl=*/false, "Push: "));
    DLT_RETURN_IF_ERROR(CheckGradients(ids, rows, n, dim, learning_rate, "Push: ", "nothing sent"));
  } else {
    const size_t bad = FirstNonFinite(rows, n * dim);
    if (bad < n * dim) {
      return InvalidArgument(std::string(op) + ": row " + std::to_string(bad / dim) + " (id " +
                             std::to_string(ids[bad / dim]) +
                             ") holds a non-finite value; nothing sent");
    }
  }
  std::shared_ptr<const Layout> layout = CurrentLayout();
  std::vector<std::vector<uint32_t>> groups;
  int layout_backoff_ms = options_.retry_backoff_ms;
  int backoff_ms = options_.retry_backoff_ms;
  int retries = 0;
  for (;;) {
    const Status routed = Route(*layout, ids, n, deadline, &groups);
    if (routed.ok()) break;
    if (routed.code() == Code::kAborted) {
      // A shard serves a newer layout: routed by it once it is known.
      if (!AwaitLayout(*layout, &layout_backoff_ms, deadline)) return routed;
      layout = CurrentLayout();
      continue;
    }
    // A shard not reached at its first greeting (nothing sent yet): routed
    // again, as a pull is retried, a standby taking over or a switch being
    // undone meanwhile.
    if (routed.code() != Code::kUnavailable) return routed;
    if (!PauseToRetry(&retries, &backoff_ms, deadline)) return routed;
    layout = CurrentLayout();
  }
  // After the Hellos: whether pushes carry ids (and may be sent again).
  const bool identified = opcode == wire::Opcode::kPush && has_standbys_.load();
  // Each shard's ids and rows in request order, gathered by the thread that
  // sends them.
  CallCopies own;
  CallCopies& copies = CopiesFor(n * (sizeof(int64_t) + sizeof(float) * dim), own);
  std::vector<Call> calls;
  const size_t prefix_bytes = wire::kTableRequestFixed + wire::PaddedNameBytes(table.size()) +
                              (identified || part ? 16 : 0) +
                              (part ? 8 + 16 * ancestors->size() : 0);
  const size_t touched = Touched(groups);
  const size_t row_bytes = sizeof(float) * dim;
  for (size_t s = 0; s < layout->shards.size(); ++s) {
    std::vector<uint32_t>& pos = groups[s];
    if (pos.empty()) continue;
    ShardState* state = layout->shards[s];
    size_t rows_per_frame, max_rows;
    DLT_RETURN_IF_ERROR(
        RowsPerFrame(*state, op, dim, prefix_bytes, 8 + row_bytes, 0, &rows_per_frame, &max_rows));
    // A shard sums an id's rows within a frame (Keras Adagrad squares each
    // one): every occurrence of an id goes to the same connection, so what
    // a push does never depends on how it was split. A refused frame's part
    // for a shard goes on one connection (in frames of ids of their own: its
    // prefix is longer by its ancestors).
    const size_t lanes = part ? 1 : LanesFor(pos.size(), pos.size() * (8 + row_bytes), touched);
    const std::vector<size_t> starts =
        lanes > 1 ? SplitById(ids, lanes, &pos) : std::vector<size_t>{0, pos.size()};
    // ... and in one frame (FramesById) where a connection's run takes more.
    std::vector<std::vector<size_t>> cuts(starts.size() - 1);
    bool reordered = false;
    for (size_t lane = 0; opcode == wire::Opcode::kPush && lane < cuts.size(); ++lane) {
      if (starts[lane + 1] - starts[lane] <= rows_per_frame) continue;
      const Status cut = FramesById(ids, starts[lane], starts[lane + 1], rows_per_frame, max_rows,
                                    &pos, &cuts[lane]);
      if (!cut.ok()) {
        return Status(cut.code(), Context(*state, op) + ": " + cut.message() + "; nothing sent");
      }
      reordered = reordered || !cuts[lane].empty();
    }
    const int64_t* ids_ptr = ids;
    const float* rows_ptr = rows;
    std::function<void(size_t, size_t)> fill;
    if (layout->shards.size() > 1 || lanes > 1 || reordered) {
      int64_t* to_ids = copies.Get<int64_t>(2 * s, pos.size());
      float* to_rows = copies.Get<float>(2 * s + 1, pos.size() * dim);
      ids_ptr = to_ids;
      rows_ptr = to_rows;
      fill = [&pos, ids, rows, dim, to_ids, to_rows](size_t begin, size_t end) {
        for (size_t k = begin; k < end; ++k) {
          to_ids[k] = ids[pos[k]];
          std::memcpy(to_rows + k * dim, rows + size_t{pos[k]} * dim, sizeof(float) * dim);
        }
      };
    }
    for (size_t lane = 0; lane + 1 < starts.size(); ++lane) {
      const size_t first = starts[lane], end = starts[lane + 1];
      if (first == end) continue;
      Call call = RunCall(
          s, state, opcode, first, end, rows_per_frame, fill,
          [&](size_t begin, size_t count, Call* to) {
            Call::Frame fr;
            // To shards with standbys each push frame carries an id, so it
            // can be sent again (below) and is applied once.
            fr.id = PushId{client_id_, next_push_seq_.fetch_add(1)};
            const bool with_id = identified || part;
            fr.prefix = opcode == wire::Opcode::kPush
                            ? wire::EncodePushPrefix(table, dim, static_cast<uint32_t>(count),
                                                     learning_rate, with_id ? &fr.id : nullptr,
                                                     part ? ancestors : nullptr)
                            : wire::EncodeAssignPrefix(table, dim, static_cast<uint32_t>(count));
            fr.body[0] = ids_ptr + begin;
            fr.body_bytes[0] = count * 8;
            fr.body[1] = rows_ptr + begin * dim;
            fr.body_bytes[1] = count * row_bytes;
            fr.reply_bytes = wire::kPushReplyBytes;
            to->frames.push_back(std::move(fr));
          },
          std::move(cuts[lane]));
      call.on_reply = [op](size_t, const uint8_t*, size_t bytes) -> Status {
        if (bytes != wire::kPushReplyBytes) {
          return Internal(std::string(op) + " reply has the wrong size");
        }
        return OkStatus();
      };
      calls.push_back(std::move(call));
    }
  }
  bool any_reused = false;
  Status sent = Exchange(&calls, op, deadline, &any_reused);
  if (identified || (opcode == wire::Opcode::kAssign && has_standbys_.load())) {
    // A shard's primary died or lost its standby: the same frames again, to
    // whichever address greets, until the deadline. Push frames a shard
    // applied before are answered without being applied twice (their ids);
    // an assign sets the same rows again.
    int backoff_ms = options_.retry_backoff_ms;
    while (sent.code() == Code::kUnavailable) {
      const auto wake = Clock::now() + std::chrono::milliseconds(backoff_ms);
      if (wake >= deadline) break;
      std::this_thread::sleep_until(wake);
      backoff_ms = std::min(2 * backoff_ms, kFailoverBackoffMs);
      const Status before = sent;
      sent = AfterRetries(Exchange(&calls, op, deadline, &any_reused), before);
    }
  }
  DLT_RETURN_IF_ERROR(sent);
  // Frames a shard refused unapplied (a re-shard's switch) go again, each
  // routed by the newer layout once there is one, its parts naming its id: a
  // frame in doubt before (sent again above) that its shard applied is
  // known by that id to whichever shard holds its rows now. Each part has
  // an id of its own: a part refused in turn (a second switch) and sent to
  // a shard that applied another part is applied there too.
  bool waited = false;
  for (const Call& call : calls) {
    for (size_t f : call.refused) {
      if (!waited) {
        if (!AwaitLayout(*layout, &layout_backoff_ms, deadline)) return call.refusal;
        waited = true;
      }
      const size_t begin = call.FrameBegin(f);
      const size_t count = call.FrameRows(f);
      const std::vector<uint32_t>& pos = groups[call.shard];
      std::vector<int64_t> again_ids(count);
      std::vector<float> again_rows(count * dim);
      for (size_t k = 0; k < count; ++k) {
        again_ids[k] = ids[pos[begin + k]];
        std::memcpy(&again_rows[k * dim], rows + size_t{pos[begin + k]} * dim, row_bytes);
      }
      std::vector<PushId> lineage;
      if (identified || part) {
        if (part) lineage = *ancestors;
        lineage.push_back(call.frames[f].id);
        if (lineage.size() > wire::kMaxPushAncestors) return call.refusal;  // switch after switch
      }
      DLT_RETURN_IF_ERROR(SendRows(opcode, table, dim, again_ids.data(), again_rows.data(), count,
                                   learning_rate, deadline, lineage.empty() ? nullptr : &lineage));
    }
  }
  return OkStatus();
}

}  // namespace dlt
