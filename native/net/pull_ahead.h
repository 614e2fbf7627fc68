// PullAhead: rows pulled before the lookup that needs them. The input
// pipeline starts a pull of a batch's ids (Dlt>PullAhead) while the trainer
// still works on the batch before; a lookup of the same table, mode and ids
// takes it instead of pulling. Every push of this client that completes after
// a pull ahead began marks the ids it shares with that pull stale. Those are
// pulled again at once, while the pull still waits for its lookup (a refresh
// ahead), and the lookup re-pulls only what is still stale then: it reads
// each row as it stood after every push of this client that completed
// before the lookup, as a lookup without pulling ahead does. No TF headers:
// the C++ suite tests it.
#ifndef TF_DLT_NATIVE_NET_PULL_AHEAD_H_
#define TF_DLT_NATIVE_NET_PULL_AHEAD_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "native/core/dedup.h"
#include "native/core/pull_mode.h"

namespace dlt {

// One pull ahead: a batch's ids, its distinct ids, and their rows once the
// puller filled them.
class PulledAhead {
 public:
  // `refresh`: later pushes mark the ids they share stale (see PullAhead).
  PulledAhead(std::string table, PullMode mode, uint32_t dim, const int64_t* ids, size_t n,
              bool refresh = true);

  const std::string& table() const { return table_; }
  // The table's batch it was begun for (PullAhead::Begin).
  uint64_t batch() const { return batch_; }
  PullMode mode() const { return mode_; }
  uint32_t dim() const { return dim_; }
  bool refresh() const { return refresh_; }
  // The distinct ids, in order of first appearance, and their rows
  // ([unique.size(), dim]) for the puller to fill.
  const std::vector<int64_t>& unique() const { return unique_; }
  float* rows() { return rows_.data(); }
  // True when `ids` (n of them) are exactly this batch's.
  bool Matches(const int64_t* ids, size_t n) const;

  // The puller is done (`ok`: the rows are filled). Runs the continuation
  // given to Then, on this thread.
  void Finish(bool ok);
  // Runs `fn` once the pull and any refresh ahead finished: now (on this
  // thread) if they have, otherwise on the thread that finishes the last.
  void Then(std::function<void()> fn);
  bool done() const;
  bool ok() const;
  // Its rows can be copied as they are: pulled, not refreshing, none stale.
  bool ready() const;

  // A refresh ahead: the stale ids to pull again now, unmarked (empty, and
  // nothing begun, when the pull is unfinished or failed, taken by its
  // lookup, already refreshing, or nothing is stale). The refresher pulls
  // them and calls RefreshDone with their rows ([n, dim], in that order; null
  // if the pull failed: they are marked stale again and the refresh ends),
  // which gives the ids marked stale meanwhile, to pull next; empty: the
  // refresh ended (and the continuation given to Then ran).
  std::vector<int64_t> BeginRefresh();
  std::vector<int64_t> RefreshDone(const float* rows);

  // The distinct ids pushed since the pull began and not refreshed ahead
  // (set while the pull ahead waits to be taken), and writing their fresh
  // rows ([n, dim], in the order of StaleIds) over the pulled ones; for the
  // lookup that took the pull, once Then ran.
  std::vector<int64_t> StaleIds() const;
  void Refresh(const float* rows);
  // The batch's rows, in input order: [n, dim].
  void CopyRows(float* out) const;

 private:
  friend class PullAhead;
  // Marks those of `ids` this pull holds stale; the number newly marked.
  size_t MarkStale(const int64_t* ids, size_t n);
  // Its lookup took it, or it was dropped: nothing marks or refreshes it
  // from now on.
  void SetTaken();
  // Unmarks the stale ids, remembers their positions (refreshing_at_) and
  // returns them. Needs mu_.
  std::vector<int64_t> TakeStale();
  // Runs then_ if the pull and refresh are over; releases `lock` first.
  void RunThenIfIdle(std::unique_lock<std::mutex>* lock);

  const std::string table_;
  const PullMode mode_;
  const uint32_t dim_;
  const bool refresh_;
  uint64_t batch_ = 0;  // set by PullAhead::Begin
  std::vector<int64_t> ids_;
  Deduper index_;  // id -> index in unique_
  std::vector<int64_t> unique_, slot_;
  std::vector<float> rows_;
  mutable std::mutex mu_;
  std::vector<uint8_t> stale_;           // per distinct id; guarded by mu_
  std::vector<uint32_t> refreshing_at_;  // positions a refresh ahead pulls
  bool done_ = false;                    // guarded by mu_
  bool ok_ = false;                      // guarded by mu_
  bool taken_ = false;                   // guarded by mu_
  bool refreshing_ = false;              // guarded by mu_
  std::function<void()> then_;           // guarded by mu_
};

// The pulls ahead of one client, per table, waiting for their lookups.
class PullAhead {
 public:
  // At most `max_per_table` pulls ahead wait per table: a new one past that
  // drops the oldest (a batch never looked up, or looked up otherwise).
  explicit PullAhead(size_t max_per_table = 8) : max_per_table_(max_per_table) {}

  // Registers a pull ahead of `ids` (copied); the caller pulls its unique()
  // into its rows() and calls Finish. Without `refresh`, pushes never mark
  // it: its rows stay as pulled (they may miss the pushes in between).
  // Each batch begins `pulls_per_batch` pulls of the table one after
  // another (a table two model inputs share: 2); they form one batch.
  std::shared_ptr<PulledAhead> Begin(const std::string& table, PullMode mode, uint32_t dim,
                                     const int64_t* ids, size_t n, bool refresh = true,
                                     uint32_t pulls_per_batch = 1);
  // The newest pull ahead of exactly these ids in `table`, `mode` and `dim`,
  // taken out (no later push marks it) with every one of the table's
  // earlier batches (dropped: their lookups skipped them); the other pulls
  // of its own batch stay for their lookups. Null if there is none.
  std::shared_ptr<PulledAhead> Take(const std::string& table, PullMode mode, uint32_t dim,
                                    const int64_t* ids, size_t n);
  // A push of `ids` to `table` completed (or failed: it may have been
  // applied in part): those ids are stale in every waiting pull ahead that
  // refreshes. Returns the pulls that got ids newly marked: the caller
  // refreshes them ahead (PulledAhead::BeginRefresh), each as soon as it
  // can, which keeps the wait of the lookups shortest (measured against
  // refreshing only the next pull to be taken, which makes fewer pulls:
  // docs/benchmarks.md).
  std::vector<std::shared_ptr<PulledAhead>> Pushed(const std::string& table, const int64_t* ids,
                                                   size_t n);
  // A refresh ahead pulled `rows` ids again.
  void CountRefreshed(size_t rows);
  // Drops every waiting pull ahead (the input pipeline that began them
  // stopped: its fit ended or failed); the number dropped.
  size_t DropAll();

  struct Counts {
    uint64_t begun = 0;           // pulls ahead started
    uint64_t taken = 0;           // lookups served by one
    uint64_t dropped = 0;         // pulls ahead no lookup took
    uint64_t stale_rows = 0;      // distinct ids marked stale
    uint64_t refreshed_rows = 0;  // ids pulled again by refreshes ahead of their lookup
  };
  Counts counts() const;

 private:
  const size_t max_per_table_;
  mutable std::mutex mu_;
  std::map<std::string, std::deque<std::shared_ptr<PulledAhead>>> waiting_;  // guarded by mu_
  struct Batches {
    uint64_t batch = 0;     // of the last pull begun
    uint32_t in_batch = 0;  // pulls begun in it
  };
  std::map<std::string, Batches> batches_;  // guarded by mu_
  Counts counts_;                           // guarded by mu_
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_PULL_AHEAD_H_
