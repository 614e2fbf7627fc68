// A shard: the named tables one server process holds, and the bucket range
// it owns. Thread-safe; tables are shared_ptrs so a request that found a
// table keeps it alive across a concurrent drop or load.
#ifndef TF_DLT_NATIVE_CORE_SHARD_H_
#define TF_DLT_NATIVE_CORE_SHARD_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "native/core/status.h"
#include "native/core/table.h"

namespace dlt {

class Shard {
 public:
  Shard(uint32_t shard_index, uint32_t num_shards);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  uint32_t shard_index() const { return shard_index_; }
  uint32_t num_shards() const { return num_shards_; }
  uint32_t first_bucket() const { return first_bucket_; }
  uint32_t end_bucket() const { return end_bucket_; }
  bool OwnsBucket(uint32_t bucket) const { return bucket >= first_bucket_ && bucket < end_bucket_; }

  // Creates a table. Creating one that exists with the same configuration
  // succeeds with *created = false; a different configuration is
  // ALREADY_EXISTS naming both.
  Status CreateTable(const TableConfig& config, bool* created);
  Status DropTable(const std::string& name);
  // NOT_FOUND naming the shard and the tables it has when `name` is absent.
  Status GetTable(const std::string& name, std::shared_ptr<Table>* table) const;
  std::vector<std::shared_ptr<Table>> Tables() const;
  // Installs `tables`, replacing same-named ones, in one step.
  void InstallTables(const std::vector<std::shared_ptr<Table>>& tables);

  // Checks that every id routes to this shard; INVALID_ARGUMENT otherwise.
  Status CheckOwnership(const int64_t* ids, size_t n) const;

  // A table for this shard's buckets (not installed).
  std::shared_ptr<Table> NewTable(const TableConfig& config) const;

  // Removes the expired rows of every table with a ttl, one stripe at a
  // time; returns the rows removed.
  size_t Sweep();
  // Sweeps every `interval_ms` (> 0) on a background thread until
  // destruction or StopSweeper; a second call only changes the interval.
  void StartSweeper(int interval_ms);
  void StopSweeper();

 private:
  const uint32_t shard_index_;
  const uint32_t num_shards_;
  const uint32_t first_bucket_;
  const uint32_t end_bucket_;
  mutable std::shared_mutex mu_;
  std::map<std::string, std::shared_ptr<Table>> tables_;  // guarded by mu_

  std::mutex sweeper_mu_;
  std::condition_variable sweeper_cv_;
  std::thread sweeper_;        // guarded by sweeper_mu_
  int sweep_interval_ms_ = 0;  // guarded by sweeper_mu_
  // Bumped by every StopSweeper: a sweeper thread runs while it is the one
  // it started under, so a restart never revives a thread being stopped.
  uint64_t sweeper_generation_ = 0;  // guarded by sweeper_mu_
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_SHARD_H_
