#include "native/core/shard.h"

#include <fcntl.h>
#include <malloc.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <system_error>

#include "native/core/random.h"
#include "native/core/routing.h"
#include "native/core/sketch.h"

namespace dlt {

namespace {

uint64_t NewLineage() {
  const uint64_t lineage = RandomWord();
  return lineage != 0 ? lineage : 1;
}

}  // namespace

Shard::Shard(uint32_t shard_index, uint32_t num_shards)
    : place_(uint64_t{shard_index} << 32 | num_shards), lineage_(NewLineage()) {}

std::string Shard::layout_addresses() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return layout_addresses_;
}

void Shard::Adopt(Shard* next, uint64_t layout_epoch, std::string addresses) {
  Previous dropped;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    std::unique_lock<std::shared_mutex> next_lock(next->mu_);
    dropped = std::move(previous_);  // a switch before this one's, never finished
    previous_.held = true;
    previous_.tables.swap(tables_);
    previous_.place = place_.load();
    previous_.layout_epoch = layout_epoch_.load();
    previous_.addresses = std::move(layout_addresses_);
    tables_.swap(next->tables_);
    place_.store(next->place_.load());
    layout_epoch_.store(layout_epoch);
    layout_addresses_ = std::move(addresses);
  }
  push_ledger_.Absorb(&next->push_ledger_);
  {
    // Its tables count as this shard's (staged until installed).
    std::lock_guard<std::mutex> lock(made_mu_);
    std::lock_guard<std::mutex> next_lock(next->made_mu_);
    made_.insert(made_.end(), next->made_.begin(), next->made_.end());
  }
}

bool Shard::RevertLayout(uint64_t layout_epoch, std::string addresses) {
  std::map<std::string, std::shared_ptr<Table>> next;  // dropped outside the lock
  std::unique_lock<std::shared_mutex> lock(mu_);
  const bool reverted = previous_.held;
  if (reverted) {
    next.swap(tables_);
    tables_.swap(previous_.tables);
    place_.store(previous_.place);
    layout_epoch_.store(previous_.layout_epoch);
    layout_addresses_ = std::move(previous_.addresses);
    previous_ = Previous();
  }
  if (layout_epoch > layout_epoch_.load()) {
    layout_epoch_.store(layout_epoch);
    layout_addresses_ = std::move(addresses);
  }
  lock.unlock();
  return reverted;
}

bool Shard::has_previous_layout() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return previous_.held;
}

void Shard::DropPreviousLayout() {
  Previous dropped;  // its tables go outside the lock
  std::unique_lock<std::shared_mutex> lock(mu_);
  dropped = std::move(previous_);
  previous_ = Previous();
}

Status Shard::CheckPlace(uint32_t shard_index, uint32_t num_shards) {
  if (num_shards == 0 || num_shards > kNumBuckets || shard_index > num_shards) {
    return InvalidArgument("shard index " + std::to_string(shard_index) + " of " +
                           std::to_string(num_shards) + " is invalid: need 0 <= index < " +
                           "num_shards <= " + std::to_string(kNumBuckets) +
                           " (index == num_shards: a shard that owns no bucket yet)");
  }
  return OkStatus();
}

Status Shard::TakePlace(uint32_t shard_index, uint32_t num_shards, uint64_t layout_epoch,
                        std::string addresses) {
  DLT_RETURN_IF_ERROR(CheckPlace(shard_index, num_shards));
  // Checked and taken at one moment: a table made meanwhile keeps the place.
  std::unique_lock<std::shared_mutex> lock(mu_);
  const uint64_t place = uint64_t{shard_index} << 32 | num_shards;
  if (!tables_.empty() && place != place_.load()) {
    return FailedPrecondition("shard " + std::to_string(this->shard_index()) + " holds " +
                              std::to_string(tables_.size()) +
                              " tables: it keeps its place in the layout");
  }
  place_.store(place);
  layout_epoch_.store(layout_epoch);
  layout_addresses_ = std::move(addresses);
  previous_ = Previous();
  return OkStatus();
}

namespace {

// Rows a pass moves per table at most (a pass stays short), unless a
// sixteenth of the table is more.
constexpr size_t kMovesPerPass = 262144;
// A table whose tier failed is tried again after this long, twice as long
// after each failure in a row, at most kMaxErrorBackoff: a passing fault
// (one EIO) costs a quarter of a second of demotions, not five seconds
// (pushes that do not wait for a failing keeper filled RAM meanwhile).
constexpr auto kErrorBackoff = std::chrono::milliseconds(250);
constexpr auto kMaxErrorBackoff = std::chrono::milliseconds(5000);
// Passes between two checks of max_rows across tiers.
constexpr uint64_t kPassesPerEviction = 50;
// Memory outside the tables above this share of the budget is given back
// to the system (freed heap a load or a replaced table left) at most this
// often.
constexpr double kTrimShare = 0.05;
constexpr auto kTrimInterval = std::chrono::seconds(1);
// Allocations from this size up are mapped on their own (glibc's threshold
// otherwise rises to the largest block freed, and a save's or load's 8 and
// 16 MiB buffers then stay in the heap's arenas after they are freed).
constexpr int kMmapThreshold = 1 << 20;

// Holds an exclusive flock on `dir`/LOCK; -1 when another process holds it.
// The descriptor of `dir`/LOCK, locked; -1 with errno set (ELOOP: LOCK is a
// link; EWOULDBLOCK: another process holds it).
// shard-<index> or shard-<index>-<k>, digits each.
bool IsTierDirectory(const std::string& name) {
  if (name.size() <= 6 || name.rfind("shard-", 0) != 0) return false;
  const size_t dash = name.find('-', 6);
  const auto digits = [&](size_t from, size_t to) {
    return to > from && name.find_first_not_of("0123456789", from) >= to;
  };
  if (dash == std::string::npos) return digits(6, name.size());
  return digits(6, dash) && digits(dash + 1, name.size());
}

// Whether `dir` holds only what a tier's directory does: its LOCK and a
// directory per table, t<n> (t<n>-<name> in older builds). One named like a
// tier's but holding anything else is no tier's to clear: a directory given
// as another shard's storage dir, its live tier inside, was deleted whole by
// this shard's start.
bool HoldsATierOnly(const std::string& dir) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    const bool table_dir = name.size() > 1 && name[0] == 't' && name[1] >= '0' && name[1] <= '9';
    if (name != "LOCK" && !table_dir) return false;
  }
  return !error;
}

int LockDirectory(const std::string& dir) {
  // Never through a link planted as LOCK.
  const std::string lock = dir + "/LOCK";
  const int fd = open(lock.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  // Another process's cleanup may have taken the lock, deleted the
  // directory and let go between the open and the flock: this lock is then
  // of a file gone, and the directory (made again) no one's. ESTALE: try
  // again.
  struct stat held, named;
  if (fstat(fd, &held) != 0 || lstat(lock.c_str(), &named) != 0 || held.st_nlink == 0 ||
      held.st_ino != named.st_ino || held.st_dev != named.st_dev) {
    close(fd);
    errno = ESTALE;
    return -1;
  }
  return fd;
}

}  // namespace

Shard::~Shard() {
  StopKeeper();
  StopSweeper();
  if (tier_lock_fd_ >= 0) close(tier_lock_fd_);
}

std::shared_ptr<Table> Shard::NewTable(const TableConfig& config) const {
  const uint64_t place = place_.load();
  auto table = std::make_shared<Table>(config, First(place), End(place));
  // Listed for the keeper (StagedBytes) once its tier is attached: the
  // keeper reads a stripe's tier under the stripe's lock, which
  // AttachTier does not take.
  auto publish = [&] {
    std::lock_guard<std::mutex> lock(made_mu_);
    made_.erase(std::remove_if(made_.begin(), made_.end(),
                               [](const std::weak_ptr<Table>& t) { return t.expired(); }),
                made_.end());
    made_.push_back(table);
    return table;
  };
  if (budget_ != 0) table->KeepPagesSmall();
  if (tier_root_.empty()) return publish();
  // Each table object has a directory of its own: a load builds a table
  // while the one it replaces still serves.
  // Named by a counter alone: no path is ever built from a table's name.
  const std::string dir = tier_root_ + "/t" + std::to_string(next_table_dir_++);
  // Made afresh, never followed: a link planted under the name (the
  // storage dir's cleanup leaves links alone) sent the tier files out of
  // the storage dir, truncating what they named.
  struct stat st;
  if (lstat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) unlink(dir.c_str());
  mkdir(dir.c_str(), 0700);  // a failure shows as the tier's error at its first write
  table->AttachTier(dir);
  // Until the keeper's next pass: the rows that fit what is free now,
  // beside the buffers of the load that most likely fills the table.
  const uint64_t used = ResidentBytes() + kPersistReserve;
  const uint64_t free_bytes = used < budget_ * kTargetFraction
                                  ? static_cast<uint64_t>(budget_ * kTargetFraction) - used
                                  : 0;
  table->SetRamLimit(std::max<uint64_t>(LeastRamRows(*table), free_bytes / table->ram_row_bytes()));
  return publish();
}

uint64_t Shard::StagedBytes() const {
  std::vector<std::shared_ptr<Table>> made;
  {
    std::lock_guard<std::mutex> lock(made_mu_);
    for (const auto& weak : made_) {
      if (auto t = weak.lock()) made.push_back(std::move(t));
    }
  }
  uint64_t bytes = 0;
  std::shared_lock<std::shared_mutex> lock(mu_);
  for (const auto& t : made) {
    auto it = tables_.find(t->config().name);
    if (it == tables_.end() || it->second != t) bytes += t->bytes();
  }
  return bytes;
}

uint64_t Shard::ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;  // NOLINT: fscanf's types
  const int got = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  return got == 2 ? resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

uint64_t Shard::TrimmedResidentBytes() {
  malloc_trim(0);
  return ResidentBytes();
}

Status Shard::ConfigureMemory(uint64_t budget_bytes, const std::string& storage_dir,
                              int interval_ms) {
  if (budget_ != 0 || !tier_root_.empty()) {
    return FailedPrecondition("the memory budget is set once, at start");
  }
  if (!storage_dir.empty() && budget_bytes == 0) {
    return InvalidArgument("a storage dir needs a memory budget: rows move to disk past it");
  }
  if (!Tables().empty()) return FailedPrecondition("set the memory budget before tables exist");
  if (budget_bytes != 0) {
    malloc_trim(0);  // what the process holds, not what it freed
    const uint64_t held = ResidentBytes();
    const uint64_t least =
        static_cast<uint64_t>((held + kPersistReserve + kMinRowRoom) / kTargetFraction);
    if (budget_bytes < least) {
      const auto mib = [](uint64_t b) { return std::to_string((b + (1 << 20) - 1) >> 20); };
      return InvalidArgument("a memory budget of " + mib(budget_bytes) +
                             " MiB is below the smallest this shard can honour, " + mib(least) +
                             " MiB: the process holds " + mib(held) +
                             " MiB before any table, a save or load buffers up to " +
                             mib(kPersistReserve) + " MiB, and the rows need room");
    }
  }
  if (!storage_dir.empty()) {
    namespace fs = std::filesystem;
    std::error_code error;
    fs::create_directories(storage_dir, error);
    if (error) {
      return InvalidArgument("cannot create storage dir " + storage_dir + ": " + error.message());
    }
    // Tier files of shards that are gone are stale: a restart loads from a
    // checkpoint, never from them. A directory whose LOCK is held belongs to
    // a live shard process and is left alone.
    for (const auto& entry : fs::directory_iterator(storage_dir, error)) {
      const std::string name = entry.path().filename().string();
      // A tier's own directory only (shard-<index>, shard-<index>-<k>):
      // never one a user named alike.
      const bool tier = IsTierDirectory(name);
      // A link is not a tier's directory (its target is no shard's to
      // clear), whatever its name.
      if (!tier || entry.is_symlink() || !entry.is_directory()) continue;
      if (!HoldsATierOnly(entry.path().string())) continue;
      const int fd = LockDirectory(entry.path().string());
      if (fd < 0) continue;
      fs::remove_all(entry.path(), error);
      close(fd);
    }
    // shard-<index>, or where another process of the shard holds it (its
    // primary, or another standby, given the same --storage-dir: `tf-dlt
    // launch --replicas` passes every process the same flags), the first of
    // shard-<index>-2 ... -<kMaxTierDirs> free.
    const std::string first = storage_dir + "/shard-" + std::to_string(shard_index());
    std::string root;
    for (int k = 1, stale = 0; k <= kMaxTierDirs && tier_lock_fd_ < 0; ++k) {
      root = k == 1 ? first : first + "-" + std::to_string(k);
      if (fs::is_symlink(fs::symlink_status(root, error))) {
        return InvalidArgument(root + " is a link: a shard's tier directory is made by the " +
                               "shard itself, in the storage dir");
      }
      fs::create_directories(root, error);
      if (error) return InvalidArgument("cannot create " + root + ": " + error.message());
      tier_lock_fd_ = LockDirectory(root);
      if (tier_lock_fd_ < 0 && errno == ELOOP) {
        return InvalidArgument(root + "/LOCK is a link: the shard makes its own LOCK there");
      }
      if (tier_lock_fd_ < 0 && errno == ESTALE && ++stale < 100) --k;  // deleted under it
    }
    if (tier_lock_fd_ < 0) {
      return FailedPrecondition("storage dir " + first + " and " +
                                std::to_string(kMaxTierDirs - 1) +
                                " more beside it are in use by other shard processes");
    }
    tier_root_ = root;
  }
  if (budget_bytes != 0) mallopt(M_MMAP_THRESHOLD, kMmapThreshold);
  budget_ = budget_bytes;
  if (budget_ == 0) return OkStatus();
  keeper_ = std::thread([this, interval_ms] {
    std::unique_lock<std::mutex> lock(keeper_mu_);
    while (!keeper_stop_) {
      lock.unlock();
      const size_t moved = KeepMemory();
      lock.lock();
      if (moved > 0) continue;  // still over the budget: no pause
      keeper_cv_.wait_for(lock, std::chrono::milliseconds(std::max(1, interval_ms)),
                          [this] { return keeper_stop_; });
    }
  });
  return OkStatus();
}

void Shard::SetBufferBytes(std::function<uint64_t()> held) {
  std::lock_guard<std::mutex> lock(buffer_bytes_mu_);
  buffer_bytes_ = std::move(held);
}

uint64_t Shard::BufferBytes() const {
  std::lock_guard<std::mutex> lock(buffer_bytes_mu_);
  return buffer_bytes_ ? buffer_bytes_() : 0;
}

void Shard::StopKeeper() {
  {
    std::lock_guard<std::mutex> lock(keeper_mu_);
    keeper_stop_ = true;
  }
  keeper_cv_.notify_all();
  if (keeper_.joinable()) keeper_.join();
}

size_t Shard::KeepMemory() {
  if (budget_ == 0) return 0;
  std::lock_guard<std::mutex> pass_lock(keeper_pass_mu_);
  auto& failed = keeper_failed_;
  const auto now = std::chrono::steady_clock::now();
  const std::vector<std::shared_ptr<Table>> tables = Tables();
  // The data plane's buffers are read before the resident memory and again
  // after it (below): a buffer freed in between (freed, then uncounted) is
  // in the first count, one made in between (counted, then touched) in the
  // second, so neither is taken for overhead. (Read once, after: a pooled
  // reply freed between the two reads counted as overhead, and rows of a
  // table within its share were evicted for good.)
  const uint64_t buffers_before = BufferBytes();
  const uint64_t resident = ResidentBytes();
  resident_.store(resident, std::memory_order_relaxed);
  // What is not the tables' (the interpreter, buffers) is measured; the
  // tables' own fixed parts (sketches, tier fingerprints) are subtracted.
  uint64_t table_bytes = 0, fixed = 0, live_bytes = 0;
  for (const auto& t : tables) {
    table_bytes += t->bytes();
    fixed += t->ram_fixed_bytes();
    live_bytes += t->ram_rows() * t->ram_row_bytes();
  }
  // Staged tables (a load's, and those a load replaced) are tables, not
  // overhead: the load was admitted with room for them (the loader checks
  // `staged_bytes`), and they never make the keeper move installed rows.
  const uint64_t staged = StagedBytes();
  staged_bytes_.store(staged, std::memory_order_relaxed);
  table_bytes += staged;
  uint64_t overhead = resident > table_bytes ? resident - table_bytes : 0;
  if (overhead > budget_ * kTrimShare && now - keeper_trimmed_ >= kTrimInterval) {
    keeper_trimmed_ = now;
    malloc_trim(0);
    const uint64_t trimmed = ResidentBytes();
    overhead = trimmed > table_bytes ? trimmed - table_bytes : 0;
  }
  // While a save or load runs, the overhead measured before it: its
  // buffers are what kPersistReserve holds back. After it, the same until
  // what it freed has left the process (the overhead is back within a trim
  // share of before) or kSettle passed since the first of them ended:
  // saves or loads that follow within it (a follower's deltas) do not
  // extend it, so the overhead is measured afresh at least that often.
  // (One that began and ended since the last pass counts as seen.)
  const bool persisting = persisting_.load(std::memory_order_acquire) > 0;
  const uint64_t begun = persists_begun_.load(std::memory_order_acquire);
  if (persisting || begun != persists_seen_) {
    if (settled_) settle_by_ = {};
    settled_ = false;
  }
  persists_seen_ = begun;
  if (!persisting && !settled_) {
    if (settle_by_ == std::chrono::steady_clock::time_point{}) {
      settle_by_ = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(
                       persist_ended_.load(std::memory_order_acquire))) +
                   kSettle;
    }
    settled_ = overhead <= steady_overhead_ + budget_ * kTrimShare || now >= settle_by_;
  }
  if (settled_ || steady_overhead_ == 0) {
    steady_overhead_ = overhead;
  } else {
    overhead = std::min(overhead, steady_overhead_);
  }
  // The data plane's buffers (a large pull's reply, frames pooled for
  // reuse) come and go as a save's do: they take the room held back for
  // buffers (kPersistReserve), and only what passes it is overhead rows
  // give way to. (Counted as overhead, one pull of a whole table evicted
  // rows of a table within its share for good where there is no tier.)
  const uint64_t buffers = std::min(std::max(buffers_before, BufferBytes()), overhead);
  const uint64_t reserve = std::max<uint64_t>(kPersistReserve, buffers);
  const double room =
      budget_ * kTargetFraction - static_cast<double>(overhead - buffers + fixed + reserve);
  const uint64_t target = room > 0 ? static_cast<uint64_t>(room) : 0;
  table_target_.store(target, std::memory_order_relaxed);
  size_t moved = 0;
  if (live_bytes > target) {
    const double excess = static_cast<double>(live_bytes) - target * kLowWater;
    for (const auto& t : tables) {
      auto f = failed.find(t);
      if (f != failed.end() && now < f->second.at) continue;
      const uint64_t rows = t->ram_rows();
      const double share = static_cast<double>(rows * t->ram_row_bytes()) / live_bytes;
      size_t want = static_cast<size_t>(excess * share / t->ram_row_bytes()) + 1;
      want = std::min(want, std::max<size_t>(kMovesPerPass, rows / 16));
      Status status;
      moved += t->Demote(want, &status);
      if (!status.ok()) {
        t->SetKeeperError(status.message());
        const auto backoff =
            f == failed.end() ? kErrorBackoff : std::min(2 * f->second.backoff, kMaxErrorBackoff);
        failed[t] = {now + backoff, backoff, now};
      } else if (f != failed.end()) {
        t->SetKeeperError("");
        failed.erase(f);
      }
    }
  } else {
    // Nothing to move: a table whose moves failed no longer fails once
    // kKeeperErrorHold passed since (its error stayed in the stats for good
    // once RAM came back under target; held a while, it does not come and
    // go as RAM passes the target and back while the disk stays full).
    for (auto f = failed.begin(); f != failed.end();) {
      if (now < f->second.failed_at + kKeeperErrorHold) {
        ++f;
        continue;
      }
      if (const std::shared_ptr<Table> t = f->first.lock()) t->SetKeeperError("");
      f = failed.erase(f);
    }
  }
  // Records the moved rows freed go back to the system while the process
  // holds more than its rows may take (else the next rows made take them
  // again, and giving them back would only churn pages).
  if (resident + kPersistReserve > budget_ * kTargetFraction) {
    for (const auto& t : tables) t->Compact();
  }
  SetRamLimits(tables, target);
  const double since = std::chrono::duration<double>(now - keeper_rated_).count();
  if (since >= 1.0) {
    for (const auto& t : tables) t->UpdateTierRates(since);
    keeper_rated_ = now;
  }
  if (++keeper_passes_ % kPassesPerEviction == 0 && sweeping_.load()) {
    for (const auto& t : tables) t->EvictAcrossTiers();
  }
  // Forget tables that are gone.
  for (auto it = failed.begin(); it != failed.end();) {
    const bool present = std::any_of(tables.begin(), tables.end(), [&](const auto& t) {
      return !it->first.owner_before(t) && !t.owner_before(it->first);
    });
    it = present ? std::next(it) : failed.erase(it);
  }
  return moved;
}

void Shard::SetRamLimits(const std::vector<std::shared_ptr<Table>>& tables, uint64_t target) {
  uint64_t live_bytes = 0;
  for (const auto& t : tables) live_bytes += t->ram_rows() * t->ram_row_bytes();
  for (const auto& t : tables) {
    if (!t->has_tier()) continue;
    // Each table's share of the target: its share of the RAM rows now (an
    // even split while none are).
    const double share = live_bytes > 0
                             ? static_cast<double>(t->ram_rows() * t->ram_row_bytes()) / live_bytes
                             : 1.0 / tables.size();
    t->SetRamLimit(std::max<uint64_t>(LeastRamRows(*t),
                                      static_cast<uint64_t>(target * share / t->ram_row_bytes())));
  }
}

uint64_t Shard::LeastRamRows(const Table& t) const {
  // 64 rows a stripe, unless that passes kLeastRamShare of the budget: at
  // dim 4,096 with Adagrad 4,096 rows are 128 MiB, and a load into a
  // 265 MiB budget peaked at 500-900 MiB. At least a row a stripe.
  const uint64_t by_bytes = static_cast<uint64_t>(budget_ * kLeastRamShare) / t.ram_row_bytes();
  return std::max<uint64_t>(kStripes, std::min<uint64_t>(kStripes * 64, by_bytes));
}

void Shard::SetPersisting(bool persisting) {
  if (persisting) {
    persists_begun_.fetch_add(1, std::memory_order_acq_rel);
  } else {
    persist_ended_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                         std::memory_order_release);
  }
  persisting_.fetch_add(persisting ? 1 : -1, std::memory_order_acq_rel);
}

Shard::MemoryStatus Shard::memory_status() const {
  MemoryStatus m;
  m.budget = budget_;
  m.resident = resident_.load(std::memory_order_relaxed);
  m.table_target = table_target_.load(std::memory_order_relaxed);
  m.staged_bytes = budget_ != 0 ? staged_bytes_.load(std::memory_order_relaxed) : StagedBytes();
  m.storage_dir = tier_root_;
  return m;
}

size_t Shard::Sweep() {
  size_t removed = 0;
  for (const auto& t : Tables()) {
    if (t->config().policy.ttl != 0) removed += t->Expire(t->Now());
  }
  return removed;
}

void Shard::StartSweeper(int interval_ms) {
  std::unique_lock<std::mutex> lock(sweeper_mu_);
  sweeping_.store(true);
  sweep_interval_ms_ = interval_ms > 0 ? interval_ms : 1;
  if (sweeper_.joinable()) {
    sweeper_cv_.notify_all();
    return;
  }
  const uint64_t generation = sweeper_generation_;
  sweeper_ = std::thread([this, generation] {
    std::unique_lock<std::mutex> lock(sweeper_mu_);
    const auto stopped = [this, generation] { return sweeper_generation_ != generation; };
    while (!stopped()) {
      const auto interval = std::chrono::milliseconds(sweep_interval_ms_);
      if (sweeper_cv_.wait_for(lock, interval, stopped)) break;
      lock.unlock();
      Sweep();
      lock.lock();
    }
  });
}

void Shard::StopSweeper() {
  std::thread thread;
  {
    std::unique_lock<std::mutex> lock(sweeper_mu_);
    ++sweeper_generation_;
    sweeping_.store(false);
    thread = std::move(sweeper_);
  }
  sweeper_cv_.notify_all();
  if (thread.joinable()) thread.join();
}

Status Shard::CheckRoomForFixedParts(const TableConfig& config) const {
  // (With a tier the rows past the room move to disk: slower, not lost.)
  if (budget_ == 0 || !tier_root_.empty() ||
      config.policy.admission != static_cast<uint64_t>(AdmissionKind::kFrequency)) {
    return OkStatus();
  }
  const uint64_t place = place_.load();
  const uint64_t sketch =
      FrequencySketch::BytesFor(config.policy.sketch_bytes, First(place), End(place));
  // As the keeper counts (KeepMemory): what is not the tables' is overhead.
  uint64_t table_bytes = 0, fixed = 0;
  for (const auto& t : Tables()) {
    table_bytes += t->bytes();
    fixed += t->ram_fixed_bytes();
  }
  const uint64_t resident = ResidentBytes();
  const uint64_t overhead = resident > table_bytes ? resident - table_bytes : 0;
  const double room =
      budget_ * kTargetFraction - static_cast<double>(overhead + fixed + sketch + kPersistReserve);
  if (room >= static_cast<double>(kMinRowRoom)) return OkStatus();
  const auto mib = [](double b) { return std::to_string(static_cast<int64_t>(b / (1 << 20))); };
  return ResourceExhausted(
      "table '" + config.name + "': its admission sketch takes " + mib(sketch) +
      " MiB of this shard, which leaves its rows " + mib(std::max(room, 0.0)) +
      " MiB of the memory budget of " + mib(budget_) + " MiB (the process holds " + mib(overhead) +
      " MiB, other tables' fixed parts " + mib(fixed) + " MiB, and " + mib(kPersistReserve) +
      " MiB is kept for a save's buffers): every row it got would be evicted. Give it a " +
      "smaller sketch_bytes, or the shard a larger budget or a --storage-dir for the rows");
}

Status Shard::CreateTable(const TableConfig& config, bool* created, bool provisional) {
  *created = false;
  DLT_RETURN_IF_ERROR(ValidateTableConfig(config));
  {
    std::shared_ptr<Table> have;
    if (!GetTable(config.name, &have).ok()) DLT_RETURN_IF_ERROR(CheckRoomForFixedParts(config));
  }
  while (true) {
    std::shared_ptr<Table> old;
    uint64_t writes = 0;
    {
      std::unique_lock<std::shared_mutex> lock(mu_);
      auto it = tables_.find(config.name);
      if (it == tables_.end()) {
        std::shared_ptr<Table> table = NewTable(config);
        table->set_provisional(provisional);
        tables_.emplace(config.name, std::move(table));
        *created = true;
        return OkStatus();
      }
      Table& have = *it->second;
      if (SameTable(have.config(), config)) {
        if (!provisional) have.set_provisional(false);
        return OkStatus();
      }
      TableConfig other_optimizer = have.config();
      other_optimizer.optimizer = config.optimizer;
      const bool only_optimizer = SameTable(other_optimizer, config);
      if (only_optimizer && provisional) return OkStatus();  // takes the existing table
      if (!only_optimizer || !have.provisional() || have.pushes() != 0) {
        std::string why = " exists";
        if (only_optimizer && have.pushes() != 0) {
          why = " exists and was trained (" + std::to_string(have.pushes()) + " pushes)";
        }
        return AlreadyExists("table " + Describe(have.config()) + why + "; cannot create " +
                             Describe(config));
      }
      old = it->second;
      writes = old->writes();
    }
    // The copy runs outside the shard's lock: every table's pulls and
    // pushes go on meanwhile. It replaces the table only if nothing wrote
    // to it since (else it decides again).
    std::shared_ptr<Table> settled = NewTable(config);
    DLT_RETURN_IF_ERROR(CopyRows(old.get(), settled.get()));
    std::unique_lock<std::shared_mutex> lock(mu_);
    auto it = tables_.find(config.name);
    if (it != tables_.end() && it->second == old && old->writes() == writes && old->provisional()) {
      it->second = std::move(settled);
      *created = true;
      return OkStatus();
    }
  }
}

Status Shard::CopyRows(Table* from, Table* to) {
  constexpr size_t kChunk = 4096;
  const uint32_t dim = from->dim();
  std::vector<int64_t> ids(kChunk);
  std::vector<float> values(kChunk * dim), slots(kChunk * size_t{from->slot_floats()});
  std::vector<uint32_t> steps(kChunk), buckets(kChunk), touched(kChunk);
  RowBuffers out;
  out.ids = ids.data();
  out.values = values.data();
  out.slots = slots.empty() ? nullptr : slots.data();
  out.steps = steps.data();
  out.buckets = buckets.data();
  out.touched = touched.data();
  Table::Exporter exporter(from);
  for (size_t n; (n = exporter.Next(kChunk, out)) > 0;) {
    DLT_RETURN_IF_ERROR(
        to->Import(ids.data(), values.data(), nullptr, steps.data(), n, touched.data()));
  }
  return exporter.error();
}

Status Shard::DropTable(const std::string& name) {
  DLT_RETURN_IF_ERROR(ValidateTableName(name));
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (tables_.erase(name) == 0) {
    return NotFound("no table '" + name + "' on shard " + std::to_string(shard_index()));
  }
  return OkStatus();
}

Status Shard::GetTable(const std::string& name, std::shared_ptr<Table>* table) const {
  // Only valid names reach messages (a request may hold any bytes).
  DLT_RETURN_IF_ERROR(ValidateTableName(name));
  std::shared_lock<std::shared_mutex> lock(mu_);
  return FindLocked(name, table);
}

Status Shard::FindLocked(const std::string& name, std::shared_ptr<Table>* table) const {
  auto it = tables_.find(name);
  if (it != tables_.end()) {
    *table = it->second;
    return OkStatus();
  }
  std::string known;
  for (const auto& entry : tables_) {
    known += (known.empty() ? "'" : ", '") + entry.first + "'";
  }
  return NotFound("no table '" + name + "' on shard " + std::to_string(shard_index()) +
                  " (tables: " + (known.empty() ? "none" : known) + ")");
}

std::vector<std::shared_ptr<Table>> Shard::Tables() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<std::shared_ptr<Table>> out;
  out.reserve(tables_.size());
  for (const auto& entry : tables_) out.push_back(entry.second);
  return out;
}

void Shard::InstallTables(const std::vector<std::shared_ptr<Table>>& tables) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  for (const auto& t : tables) tables_[t->config().name] = t;
}

void Shard::Fence(uint64_t epoch) {
  uint64_t now = fence_epoch_.load();
  while (now < epoch && !fence_epoch_.compare_exchange_weak(now, epoch)) {
  }
}

void Shard::Supersede(uint64_t epoch, std::string by) {
  std::lock_guard<std::mutex> lock(replaced_by_mu_);
  replaced_by_ = epoch == 0 ? "" : std::move(by);
  superseded_by_.store(epoch);
}

std::string Shard::replaced_by() const {
  std::lock_guard<std::mutex> lock(replaced_by_mu_);
  return replaced_by_;
}

Status Shard::AcquireStream(uint32_t* stream) {
  std::lock_guard<std::mutex> lock(streams_mu_);
  for (uint32_t k = 0; k < kMaxStreams; ++k) {
    if (streams_ & (1u << k)) continue;
    streams_ |= 1u << k;
    *stream = k;
    return OkStatus();
  }
  return ResourceExhausted("shard " + std::to_string(shard_index()) + " already runs " +
                           std::to_string(kMaxStreams) +
                           " row streams (a standby's and a re-shard's range streams)");
}

void Shard::ReleaseStream(uint32_t stream) {
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_ &= ~(1u << stream);
}

Status Shard::CheckOwnership(const int64_t* ids, size_t n) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return CheckOwnershipLocked(ids, n);
}

Status Shard::TableFor(const std::string& name, const int64_t* ids, size_t n,
                       std::shared_ptr<Table>* table) const {
  DLT_RETURN_IF_ERROR(ValidateTableName(name));
  std::shared_lock<std::shared_mutex> lock(mu_);
  // Ids of buckets given away first: a shard that left a layout holds no
  // table, and its clients must learn where the rows went.
  DLT_RETURN_IF_ERROR(CheckOwnershipLocked(ids, n));
  return FindLocked(name, table);
}

Status Shard::CheckOwnershipLocked(const int64_t* ids, size_t n) const {
  const uint64_t place = place_.load();
  const uint32_t index = Index(place), count = Count(place);
  const uint32_t first = First(place), end = End(place);
  if (count == 1 && index == 0) return OkStatus();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bucket = BucketOf(ids[i]);
    if (bucket >= first && bucket < end) continue;
    const std::string where = "id " + std::to_string(ids[i]) + " routes to shard " +
                              std::to_string(ShardOfBucket(bucket, count)) + " of " +
                              std::to_string(count) + ", not to this shard " +
                              std::to_string(index);
    if (layout_epoch_.load() > 1) {
      return Aborted(where + " (layout epoch " + std::to_string(layout_epoch_.load()) +
                     ", shards " + layout_addresses_ +
                     "): the client's layout is older; it was not applied, send it again");
    }
    return InvalidArgument(where + "; the client's shard list is wrong");
  }
  return OkStatus();
}

std::shared_ptr<Shard> EmbeddedShard() {
  static const auto* const shard = [] {
    auto* made = new std::shared_ptr<Shard>(std::make_shared<Shard>(0, 1));
    (*made)->StartSweeper(kEmbeddedSweepMs);
    return made;
  }();
  return *shard;
}

}  // namespace dlt
