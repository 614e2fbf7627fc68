// A table's side of the row stream (docs/replication.md): the change log
// that names every row written or removed, and reading rows as they are now.

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "native/core/table.h"
#include "native/core/table_stripe.h"
#include "native/core/task_pool.h"

namespace dlt {

void Table::StartChangeLog(uint32_t stream) {
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
    Stripe::ChangeLog& log = stripes_[s].logs[stream];
    log.changes.clear();
    log.sketch_adds.clear();
    log.overflowed = false;
  }
  // A write that takes a stripe's lock after this sees the flag: the lock
  // orders it after the store.
  change_log_.fetch_or(1u << stream);
}

void Table::StopChangeLog(uint32_t stream) {
  change_log_.fetch_and(~(1u << stream));
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
    Stripe::ChangeLog& log = stripes_[s].logs[stream];
    std::vector<int64_t>().swap(log.changes);
    std::vector<uint64_t>().swap(log.sketch_adds);
    log.overflowed = false;
  }
}

Status Table::TakeChanges(std::vector<int64_t>* ids, std::vector<uint64_t>* sketch_adds,
                          uint32_t stream) {
  ids->clear();
  if (sketch_adds != nullptr) sketch_adds->clear();
  bool overflowed = false;
  thread_local std::vector<std::vector<int64_t>> taken(kStripes);
  thread_local std::vector<uint64_t> counted;
  for (uint32_t s = 0; s < kStripes; ++s) {
    Stripe& stripe = stripes_[s];
    taken[s].clear();
    counted.clear();
    {
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      Stripe::ChangeLog& log = stripe.logs[stream];
      taken[s].swap(log.changes);  // the stripe keeps the emptied buffers
      counted.swap(log.sketch_adds);
      overflowed |= log.overflowed;
      log.overflowed = false;
    }
    if (sketch_adds != nullptr)
      sketch_adds->insert(sketch_adds->end(), counted.begin(), counted.end());
  }
  if (overflowed) {
    if (sketch_adds != nullptr) sketch_adds->clear();
    return FailedPrecondition("table '" + config_.name +
                              "' changed more rows than its change log holds since it was last "
                              "read: copy the table whole");
  }
  // Each stripe's ids once (stripes' ids differ, so small sorts do what one
  // of the whole would), a few stripes at once where there are cores.
  std::vector<std::vector<int64_t>>& logs = taken;  // this thread's, not a helper's
  RowStreamPool().ParallelFor(kStripes, [&logs](size_t s) {
    std::vector<int64_t>& v = logs[s];
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
  });
  for (const std::vector<int64_t>& v : logs) ids->insert(ids->end(), v.begin(), v.end());
  return OkStatus();
}

void Table::TakeSketchSlices(uint32_t stripe_index, std::vector<uint32_t>* buckets,
                             std::vector<uint8_t>* counters, std::vector<uint32_t>* added,
                             uint32_t stream) {
  if (!sketch_) return;
  const uint32_t slice = sketch_->slice_counters();
  Stripe& stripe = stripes_[stripe_index];
  std::unique_lock<std::shared_mutex> lock(stripe.mu);
  for (uint32_t b = first_bucket_; b < end_bucket_; ++b) {
    if (stripe_of_bucket_[b] != stripe_index) continue;
    buckets->push_back(b);
    counters->resize(counters->size() + slice);
    added->push_back(0);
    sketch_->ReadSlice(b, counters->data() + counters->size() - slice, &added->back());
  }
  stripe.logs[stream].sketch_adds.clear();  // in the slices now
}

Status Table::CountInSketch(const uint64_t* hashes, size_t n) {
  if (n == 0) return OkStatus();
  if (!sketch_) {
    return InvalidArgument("table '" + config_.name + "' has no admission sketch to count in");
  }
  size_t i = 0;
  while (i < n) {
    // Consecutive hashes of one stripe under one hold of its lock.
    const uint32_t s = StripeOf(hashes[i]);
    std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
    for (; i < n && StripeOf(hashes[i]) == s; ++i) {
      if (!sketch_->Owns(BucketOfHash(hashes[i]))) {
        return InvalidArgument("table '" + config_.name + "': a sketch count for bucket " +
                               std::to_string(BucketOfHash(hashes[i])) +
                               ", which this shard does not hold");
      }
      sketch_->Add(hashes[i]);
    }
  }
  return OkStatus();
}

Status Table::ReadRows(const int64_t* ids, size_t n, const RowBuffers& out, size_t* rows,
                       std::vector<int64_t>* absent) {
  thread_local std::vector<uint64_t> hashes;
  thread_local std::vector<uint32_t> order, starts, recs;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  absent->clear();
  *rows = 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    Stripe& stripe = stripes_[s];
    // A cold read counts itself in the tier: readers of a tiered stripe
    // hold it alone.
    std::shared_lock<std::shared_mutex> shared;
    std::unique_lock<std::shared_mutex> alone;
    if (stripe.tier) {
      alone = std::unique_lock<std::shared_mutex>(stripe.mu);
    } else {
      shared = std::shared_lock<std::shared_mutex>(stripe.mu);
    }
    // Two stages a few ids apart, as Pull's: the index probes' misses
    // overlap, then the records' (rows of a round lie anywhere in RAM).
    const uint32_t begin = starts[s], end = starts[s + 1];
    recs.resize(end - begin);
    stripe.PrefetchFirstSlots(hashes.data(), order.data(), begin, end);
    for (uint32_t k = begin; k < end; ++k) {
      if (k + kProbeAhead < end) stripe.PrefetchSlot(hashes[order[k + kProbeAhead]]);
      recs[k - begin] = stripe.Find(hashes[order[k]], ids[order[k]]);
    }
    for (uint32_t k = begin; k < end; ++k) {
      if (k + kCopyAhead < end && recs[k + kCopyAhead - begin] != kEmpty) {
        const char* next = stripe.Record(recs[k + kCopyAhead - begin], record_bytes_);
        PrefetchBytes(next, record_bytes_);
      }
      const uint32_t pos = order[k];
      const uint32_t rec = recs[k - begin];
      const char* r = nullptr;
      if (rec != kEmpty) {
        r = stripe.Record(rec, record_bytes_);
      } else if (stripe.tier && stripe.tier->rows() != 0) {
        char* cold = ScratchRecord();
        uint32_t slot;
        uint16_t generation;
        DLT_RETURN_IF_ERROR(stripe.tier->Find(hashes[pos], ids[pos], cold, &slot, &generation));
        if (slot != TierFile::kNoSlot) r = cold;
      }
      if (r == nullptr) {
        absent->push_back(ids[pos]);
      } else {
        CopyOut(r, ids[pos], BucketOfHash(hashes[pos]), out, (*rows)++);
      }
    }
  }
  return OkStatus();
}

}  // namespace dlt
