#include "native/core/shard.h"

#include <chrono>
#include <mutex>

#include "native/core/routing.h"

namespace dlt {

Shard::Shard(uint32_t shard_index, uint32_t num_shards)
    : shard_index_(shard_index),
      num_shards_(num_shards),
      first_bucket_(FirstBucket(shard_index, num_shards)),
      end_bucket_(FirstBucket(shard_index + 1, num_shards)) {}

Shard::~Shard() { StopSweeper(); }

std::shared_ptr<Table> Shard::NewTable(const TableConfig& config) const {
  return std::make_shared<Table>(config, first_bucket_, end_bucket_);
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
    thread = std::move(sweeper_);
  }
  sweeper_cv_.notify_all();
  if (thread.joinable()) thread.join();
}

Status Shard::CreateTable(const TableConfig& config, bool* created) {
  *created = false;
  DLT_RETURN_IF_ERROR(ValidateTableConfig(config));
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto it = tables_.find(config.name);
  if (it != tables_.end()) {
    if (SameTable(it->second->config(), config)) return OkStatus();
    return AlreadyExists("table " + Describe(it->second->config()) + " exists; cannot create " +
                         Describe(config));
  }
  tables_.emplace(config.name, NewTable(config));
  *created = true;
  return OkStatus();
}

Status Shard::DropTable(const std::string& name) {
  DLT_RETURN_IF_ERROR(ValidateTableName(name));
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (tables_.erase(name) == 0) {
    return NotFound("no table '" + name + "' on shard " + std::to_string(shard_index_));
  }
  return OkStatus();
}

Status Shard::GetTable(const std::string& name, std::shared_ptr<Table>* table) const {
  // Only valid names reach messages (a request may hold any bytes).
  DLT_RETURN_IF_ERROR(ValidateTableName(name));
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = tables_.find(name);
  if (it != tables_.end()) {
    *table = it->second;
    return OkStatus();
  }
  std::string known;
  for (const auto& entry : tables_) {
    known += (known.empty() ? "'" : ", '") + entry.first + "'";
  }
  return NotFound("no table '" + name + "' on shard " + std::to_string(shard_index_) +
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

Status Shard::CheckOwnership(const int64_t* ids, size_t n) const {
  if (num_shards_ == 1) return OkStatus();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bucket = BucketOf(ids[i]);
    if (!OwnsBucket(bucket)) {
      return InvalidArgument("id " + std::to_string(ids[i]) + " routes to shard " +
                             std::to_string(ShardOfBucket(bucket, num_shards_)) + " of " +
                             std::to_string(num_shards_) + ", not to this shard " +
                             std::to_string(shard_index_) + "; the client's shard list is wrong");
    }
  }
  return OkStatus();
}

}  // namespace dlt
