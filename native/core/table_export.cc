// A table's change tracking (save generations, the removal log), removing
// rows by id or bucket, and exporting rows in (bucket, id) order.

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "native/core/table.h"
#include "native/core/table_stripe.h"

namespace dlt {

size_t Table::EraseFrom(Stripe* stripe, const std::vector<int64_t>& keys, Status* error) {
  const bool log = logging_.load(std::memory_order_relaxed);
  size_t erased = stripe->EraseKeys(keys, log, generation_.load(std::memory_order_relaxed));
  if (change_log_.load(std::memory_order_relaxed)) {
    for (int64_t key : keys) NoteChange(stripe, key);
  }
  rows_.fetch_sub(static_cast<int64_t>(erased), std::memory_order_relaxed);
  if (stripe->tier && stripe->tier->rows() != 0 && erased < keys.size()) {
    // The keys that were not in RAM (none is now) may be cold.
    char* scratch = ScratchRecord();
    for (int64_t key : keys) {
      const uint64_t hash = Mix64(static_cast<uint64_t>(key));
      uint32_t slot;
      uint16_t generation;
      const Status found = stripe->tier->Find(hash, key, scratch, &slot, &generation);
      if (!found.ok()) {
        NoteTierError(found.message());
        if (error != nullptr && error->ok()) *error = found;
        continue;
      }
      if (slot == TierFile::kNoSlot) continue;
      EraseCold(stripe, slot, key);
      ++erased;
    }
  }
  CapRemovalLog(stripe);
  return erased;
}

void Table::CapRemovalLog(Stripe* stripe) {
  // A cap on the stripe's RAM rows, cold rows' removals included: a table
  // mostly on disk keeps no log of millions of removals in RAM (12 bytes
  // each, which the memory keeper would make room for by moving rows out).
  if (!logging_.load(std::memory_order_relaxed) ||
      stripe->removed.size() <= kLogSlack + stripe->live / 4) {
    return;
  }
  // Tracking this many removals would cost more than a full write of the
  // table: stop, and let the next save write the table in full.
  log_overflow_.store(true, std::memory_order_relaxed);
  logging_.store(false, std::memory_order_relaxed);
  std::vector<Removal>().swap(stripe->removed);
}

bool Table::ChangedSince(uint16_t row_generation, uint32_t since) const {
  const uint32_t window = generation_.load(std::memory_order_relaxed) - since;
  // A window of 2^16 generations or more cannot be told apart in 16 bits:
  // every row counts as changed.
  if (window >= 0xffffu) return true;
  const auto delta = static_cast<uint16_t>(row_generation - static_cast<uint16_t>(since));
  return delta != 0 && delta <= window;
}

SaveStart Table::BeginSave(const std::string& save_id, const std::string& base_id) {
  std::lock_guard<std::mutex> lock(saves_mu_);
  SaveStart start;
  if (log_overflow_.exchange(false)) {
    saves_.clear();  // the removals since any tracked save are incomplete
  }
  for (const SaveMark& mark : saves_) {
    if (!base_id.empty() && mark.id == base_id) {
      start.tracked = true;
      start.since = mark.generation;
      start.base_clock = mark.clock;
    }
  }
  // Changes from now on carry a newer generation than this save's mark.
  const uint32_t generation = generation_.fetch_add(1);
  saves_.push_back(SaveMark{save_id, generation, Now()});
  if (saves_.size() > kTrackedSaves) saves_.erase(saves_.begin());
  // Removals at or before the oldest generation still needed are dropped.
  uint32_t keep_after = saves_.front().generation;
  if (start.tracked) keep_after = std::min(keep_after, start.since);
  for (uint32_t s = 0; s < kStripes; ++s) {
    Stripe& stripe = stripes_[s];
    std::unique_lock<std::shared_mutex> stripe_lock(stripe.mu);
    auto& log = stripe.removed;
    log.erase(std::remove_if(log.begin(), log.end(),
                             [&](const Removal& r) { return r.generation <= keep_after; }),
              log.end());
    if (log.capacity() > 2 * log.size() + 1024) log.shrink_to_fit();
  }
  logging_.store(true, std::memory_order_relaxed);
  // A log that overflowed during this call may have missed removals of
  // this save's window: the save is then written in full (the flag stays
  // set, so the next save drops the marks too).
  if (log_overflow_.load()) start.tracked = false;
  return start;
}

void Table::MarkLoaded(const std::string& save_id) {
  std::lock_guard<std::mutex> lock(saves_mu_);
  const uint32_t generation = generation_.fetch_add(1);
  saves_.assign(1, SaveMark{save_id, generation, Now()});
  log_overflow_.store(false);
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::unique_lock<std::shared_mutex> stripe_lock(stripes_[s].mu);
    stripes_[s].removed.clear();
    stripes_[s].removed.shrink_to_fit();
  }
  logging_.store(true, std::memory_order_relaxed);
}

Status Table::RemovedSince(uint32_t since, std::vector<int64_t>* ids) const {
  if (log_overflow_.load()) {
    return FailedPrecondition("table '" + config_.name +
                              "': its removal log overflowed during the save (a ttl sweep, "
                              "shrink or eviction wave); the ids removed since the base are "
                              "incomplete, so the table is to be written whole");
  }
  std::vector<std::pair<uint32_t, int64_t>> found;  // (bucket, id)
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    for (const Removal& r : stripes_[s].removed) {
      if (r.generation > since) found.emplace_back(BucketOf(r.key), r.key);
    }
  }
  std::sort(found.begin(), found.end());
  found.erase(std::unique(found.begin(), found.end()), found.end());
  ids->resize(found.size());
  for (size_t i = 0; i < found.size(); ++i) (*ids)[i] = found[i].second;
  // Removals logged after the overflow check are complete only if the log
  // did not overflow meanwhile.
  if (log_overflow_.load()) return RemovedSince(since, ids);
  return OkStatus();
}

size_t Table::Erase(const int64_t* ids, size_t n, Status* error) {
  thread_local std::vector<uint64_t> hashes;
  thread_local std::vector<uint32_t> order, starts;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  std::vector<int64_t> keys;
  size_t erased = 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    keys.clear();
    for (uint32_t k = starts[s]; k < starts[s + 1]; ++k) keys.push_back(ids[order[k]]);
    std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
    erased += EraseFrom(&stripes_[s], keys, error);
  }
  return erased;
}

size_t Table::EraseBuckets(uint32_t first, uint32_t end, const int64_t* keep, size_t num_keep,
                           Status* error) {
  if (first >= end || end > kNumBuckets) return 0;
  std::vector<int64_t> kept(keep, keep + num_keep);
  std::sort(kept.begin(), kept.end());
  size_t erased = 0;
  // Stripes hold contiguous bucket ranges, in order.
  const auto goes = [&](int64_t key, const char*) {
    const uint32_t bucket = BucketOf(key);
    return bucket >= first && bucket < end && !std::binary_search(kept.begin(), kept.end(), key);
  };
  // A row a pull moves into RAM during the pass over the cold rows (a
  // follower applying a table in place) must not survive: exact.
  for (uint32_t s = stripe_of_bucket_[first]; s <= stripe_of_bucket_[end - 1]; ++s) {
    erased += EraseWhere(&stripes_[s], /*exact=*/true, goes, error);
  }
  return erased;
}

bool Table::Exporter::List(Stripe* stripe) {
  order_.clear();
  // Rows may move between tiers while the cold rows are read a batch at a
  // time; a listing that saw a move is made again, the third time under
  // one hold of the lock.
  for (int attempt = 0; attempt < 3; ++attempt) {
    order_.clear();
    std::shared_lock<std::shared_mutex> whole;
    if (attempt == 2) whole = std::shared_lock<std::shared_mutex>(stripe->mu);
    uint64_t removals, layout;
    {
      std::shared_lock<std::shared_mutex> lock;
      if (attempt < 2) lock = std::shared_lock<std::shared_mutex>(stripe->mu);
      order_.reserve(stripe->live);
      removals = removals_ = stripe->removals;
      layout = stripe->tier ? stripe->tier->layout() : 0;
      for (const IndexEntry& e : stripe->index) {
        if (e.record == kEmpty) continue;
        if (changed_only_ && !table_->ChangedSince(stripe->Generation(e.record), since_)) continue;
        const uint32_t bucket = BucketOf(e.key);
        if (bucket < first_bucket_ || bucket >= end_bucket_) continue;
        order_.push_back(Entry{bucket, e.record, e.key, false});
      }
    }
    if (!stripe->tier) break;
    error_ = table_->ForEachCold(
        stripe,
        [&] {
          return attempt < 2 ? std::shared_lock<std::shared_mutex>(stripe->mu)
                             : std::shared_lock<std::shared_mutex>();
        },
        [&](uint32_t slot, int64_t key, const char* record) {
          if (changed_only_ &&
              !table_->ChangedSince(stripe->tier->GenerationAfter(record), since_)) {
            return;
          }
          const uint32_t bucket = BucketOf(key);
          if (bucket < first_bucket_ || bucket >= end_bucket_) return;
          order_.push_back(Entry{bucket, slot, key, true});
        });
    if (!error_.ok()) return false;
    std::shared_lock<std::shared_mutex> lock;
    if (attempt < 2) lock = std::shared_lock<std::shared_mutex>(stripe->mu);
    if (stripe->removals == removals && stripe->tier->layout() == layout) break;
  }
  std::sort(order_.begin(), order_.end(), [](const Entry& a, const Entry& b) {
    return a.bucket != b.bucket ? a.bucket < b.bucket : a.id < b.id;
  });
  return true;
}

bool Table::Exporter::Copy(Stripe* stripe, const Entry& e, const RowBuffers& out, size_t i) {
  const Table& t = *table_;
  const char* r = nullptr;
  thread_local std::vector<char> slot_data;
  if (stripe->removals == removals_ && !e.cold) {
    r = stripe->Record(e.record, t.record_bytes_);
  } else {
    // Look the row up wherever it is now (removed rows, and records
    // reused since the listing, are skipped).
    const uint64_t hash = Mix64(static_cast<uint64_t>(e.id));
    const uint32_t rec = stripe->Find(hash, e.id);
    if (rec != kEmpty) {
      r = stripe->Record(rec, t.record_bytes_);
    } else if (stripe->tier) {
      slot_data.resize(stripe->tier->slot_bytes());
      uint32_t slot = TierFile::kNoSlot;
      uint16_t generation;
      if (e.cold && e.record < stripe->tier->slots() && stripe->tier->Used(e.record)) {
        error_ = stripe->tier->ReadSlot(e.record, slot_data.data());
        if (!error_.ok()) return false;
        if (stripe->tier->KeyOf(slot_data.data()) == e.id) slot = e.record;
      }
      if (slot == TierFile::kNoSlot) {  // moved since the listing
        error_ =
            stripe->tier->Find(hash, e.id, slot_data.data() + sizeof(int64_t), &slot, &generation);
        if (!error_.ok()) return false;
      }
      if (slot != TierFile::kNoSlot) r = TierFile::RecordOf(slot_data.data());
    }
    if (r == nullptr) return false;
  }
  t.CopyOut(r, e.id, e.bucket, out, i);
  return true;
}

void Table::CopyOut(const char* r, int64_t id, uint32_t bucket, const RowBuffers& out,
                    size_t i) const {
  const auto* header = reinterpret_cast<const RowHeader*>(r);
  out.ids[i] = id;
  if (out.buckets) out.buckets[i] = bucket;
  out.steps[i] = header->step;
  if (out.touched) out.touched[i] = header->touched;
  ReadValues(r, out.values + i * config_.dim);
  if (slot_floats_) ReadSlots(r, out.slots + i * slot_floats_);
}

size_t Table::Exporter::Next(size_t max_rows, const RowBuffers& out) {
  size_t written = 0;
  while (written < max_rows && stripe_ < kStripes && error_.ok()) {
    Stripe& stripe = table_->stripes_[stripe_];
    if (!loaded_ && !table_->StripeMeets(stripe_, first_bucket_, end_bucket_)) {
      ++stripe_;
      continue;
    }
    if (!loaded_) {
      if (!List(&stripe)) break;
      loaded_ = true;
      pos_ = 0;
    }
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      for (; pos_ < order_.size() && written < max_rows; ++pos_) {
        if (Copy(&stripe, order_[pos_], out, written)) {
          ++written;
        } else if (!error_.ok()) {
          break;
        }
      }
    }
    if (pos_ == order_.size()) {
      ++stripe_;
      loaded_ = false;
      order_.clear();
      order_.shrink_to_fit();
    }
  }
  return error_.ok() ? written : 0;
}

}  // namespace dlt
