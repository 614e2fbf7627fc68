// A table's disk tier: attaching it, moving cold rows out of RAM and back,
// the back-pressure that keeps RAM rows near their limit, and its stats.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "native/core/table.h"
#include "native/core/table_stripe.h"

namespace dlt {

void Table::AttachTier(const std::string& dir) {
  tier_dir_ = dir;
  ram_slack_rows_ = TierMarginRows(16);
  for (uint32_t s = 0; s < kStripes; ++s) {
    // The stripe's buckets (contiguous): its tier file's pages follow them.
    uint32_t first = kNumBuckets, count = 0;
    for (uint32_t b = first_bucket_; b < end_bucket_; ++b) {
      if (stripe_of_bucket_[b] != s) continue;
      first = std::min(first, b);
      ++count;
    }
    char name[32];
    std::snprintf(name, sizeof(name), "/stripe-%02u.tier", s);
    stripes_[s].tier = std::make_unique<TierFile>(dir + name, record_bytes_, count ? first : 0,
                                                  count ? count : kNumBuckets);
  }
}

void Table::WaitForRoom() const {
  const uint64_t limit = ram_limit_.load(std::memory_order_relaxed);
  if (!has_tier() || limit == 0) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kRoomWaitSeconds);
  for (;;) {
    const size_t held = ram_rows();
    if (held <= limit + limit / 16) return;
    // A keeper that cannot move rows now tries again soon: pushes go on
    // meanwhile, a little past the limit, not for every failing pass.
    if (keeper_failing_.load(std::memory_order_relaxed) &&
        held <= limit + limit / kFailingKeeperSlack) {
      return;
    }
    if (std::chrono::steady_clock::now() >= deadline) return;
    std::this_thread::sleep_for(std::chrono::microseconds(kRoomWaitMicros));
  }
}

void Table::BeginHotLoad(uint64_t rows) {
  std::lock_guard<std::mutex> lock(hot_load_mu_);
  hot_load_rows_ = has_tier() ? rows : 0;
  hot_load_share_ = -1;
  hot_scores_.clear();
  hot_scores_.shrink_to_fit();
  hot_floor_ = HotFloor();
}

void Table::EndHotLoad() {
  BeginHotLoad(0);
  for (uint32_t s = 0; s < kStripes && has_tier(); ++s) {
    std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
    stripes_[s].tier->GhostAll();
  }
}

Table::HotFloor Table::HotLoadFloor(const uint32_t* steps, const uint32_t* touched, size_t n,
                                    uint32_t now) {
  std::lock_guard<std::mutex> lock(hot_load_mu_);
  if (hot_load_rows_ == 0) return HotFloor();
  if (hot_load_share_ < 0) {  // the load's first rows: how many RAM has room for
    const uint64_t limit = ram_limit_.load(std::memory_order_relaxed);
    const uint64_t held = ram_rows();
    const uint64_t room = limit > held ? limit - held : 0;
    hot_load_share_ = limit == 0 || room >= hot_load_rows_
                          ? 1.0
                          : static_cast<double>(room) / static_cast<double>(hot_load_rows_);
  }
  if (hot_load_share_ >= 1.0 || hot_scores_.size() >= kHotLoadSample) return hot_floor_;
  for (size_t i = 0; i < n && hot_scores_.size() < kHotLoadSample; ++i) {
    hot_scores_.push_back(ScoreOf(steps ? steps[i] : 0, touched ? touched[i] : now, now));
  }
  if (hot_scores_.empty()) return hot_floor_;
  // The lowest score of the hottest share of the sample, and the share of
  // the rows at that score which make up the share.
  std::vector<uint64_t> sample = hot_scores_;
  const double keep = hot_load_share_ * static_cast<double>(sample.size());
  const auto at =
      sample.begin() + std::min<std::ptrdiff_t>(static_cast<std::ptrdiff_t>(sample.size() - keep),
                                                static_cast<std::ptrdiff_t>(sample.size() - 1));
  std::nth_element(sample.begin(), at, sample.end());
  hot_floor_.active = true;
  hot_floor_.floor = *at;
  const auto above = static_cast<double>(
      std::count_if(sample.begin(), sample.end(), [&](uint64_t x) { return x > *at; }));
  const auto ties = static_cast<double>(std::count(sample.begin(), sample.end(), *at));
  hot_floor_.tie_share = std::clamp((keep - above) / ties, 0.0, 1.0);
  return hot_floor_;
}

bool Table::RamFull(const Stripe& stripe) const {
  const uint64_t limit = ram_limit_.load(std::memory_order_relaxed);
  if (limit == 0 || !stripe.tier) return false;
  // A stripe's share, plus a margin for uneven stripes and for rows that
  // arrive between two passes of the keeper.
  return stripe.live >= limit / kStripes + limit / (16 * kStripes) + ram_slack_rows_;
}

uint64_t Table::TierMarginRows(uint64_t rows) const {
  return std::clamp<uint64_t>(kMarginBytes / record_bytes_, 1, rows);
}

Status Table::FindCold(Stripe* stripe, uint64_t hash, int64_t id, char* record, uint32_t* slot,
                       uint16_t* generation) {
  const Status found = stripe->tier->Find(hash, id, record, slot, generation);
  if (!found.ok()) {
    NoteTierError(found.message());  // the row stays where it is
  } else if (request_failing_.load(std::memory_order_relaxed)) {
    TierWorked();
  }
  return found;
}

Status Table::Promote(Stripe* stripe, uint64_t hash, int64_t id, uint32_t* rec) {
  *rec = kEmpty;
  if (!stripe->tier || stripe->tier->rows() == 0) return OkStatus();
  char* scratch = ScratchRecord();
  uint32_t slot;
  uint16_t generation = 0;
  DLT_RETURN_IF_ERROR(FindCold(stripe, hash, id, scratch, &slot, &generation));
  if (slot == TierFile::kNoSlot) return OkStatus();
  return MoveIn(stripe, hash, id, scratch, slot, generation, rec);
}

Status Table::MoveIn(Stripe* stripe, uint64_t hash, int64_t id, const char* record, uint32_t slot,
                     uint16_t generation, uint32_t* rec) {
  const uint32_t r = stripe->Insert(hash, id, record_bytes_);
  if (r == kEmpty) {
    return ResourceExhausted("table '" + config_.name + "' cannot grow: out of address space");
  }
  std::memcpy(stripe->Record(r, record_bytes_), record, record_bytes_);
  stripe->Generation(r) = generation;  // a move is not a change
  stripe->tier->Remove(slot);
  ++stripe->removals;
  cold_rows_.fetch_sub(1, std::memory_order_relaxed);
  promotions_.fetch_add(1, std::memory_order_relaxed);
  *rec = r;
  return OkStatus();
}

size_t Table::Demote(size_t want, Status* status) {
  *status = OkStatus();
  const bool to_disk = has_tier();
  const uint32_t now = Now();
  const size_t total = ram_rows();
  if (want == 0 || total == 0) return 0;
  size_t moved = 0;
  std::vector<std::pair<uint64_t, int64_t>> scored;
  std::vector<uint64_t> hashes;
  for (uint32_t s = 0; s < kStripes && status->ok(); ++s) {
    Stripe& stripe = stripes_[s];
    std::vector<int64_t> victims;
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      // This stripe's share of the rows to move, rounded up.
      const size_t share = (want * size_t{stripe.live} + total - 1) / total;
      if (share == 0) continue;
      victims = Coldest(&stripe, share, now, &scored);
    }
    if (!to_disk) {
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      const size_t erased = EraseFrom(&stripe, victims);
      evicted_.fetch_add(erased, std::memory_order_relaxed);
      moved += erased;
      continue;
    }
    // Rows moved out lately are ghosts for a window of the stripe's RAM
    // share (WorthRam).
    const uint64_t window =
        std::max<uint64_t>(1024, ram_limit_.load(std::memory_order_relaxed) / kStripes);
    // A batch of rows per hold of the lock: pulls of this stripe wait for
    // at most a batch of disk writes. The pages the batch writes are asked
    // for first, so those not in the page cache are read in parallel.
    for (size_t begin = 0; begin < victims.size() && status->ok(); begin += kDemoteBatch) {
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      const size_t end = std::min(victims.size(), begin + kDemoteBatch);
      hashes.clear();
      for (size_t v = begin; v < end; ++v)
        hashes.push_back(Mix64(static_cast<uint64_t>(victims[v])));
      stripe.tier->AdviseWrites(hashes.data(), hashes.size());
      for (size_t v = begin; v < end; ++v) {
        const int64_t key = victims[v];
        const uint64_t hash = hashes[v - begin];
        const size_t slot = stripe.FindSlot(hash, key);
        if (slot == kEmpty) continue;  // removed (or moved) since it was chosen
        const uint32_t rec = stripe.index[slot].record;
        uint32_t cold_slot;
        *status = stripe.tier->Put(hash, key, stripe.Record(rec, record_bytes_),
                                   stripe.Generation(rec), &cold_slot);
        if (!status->ok()) break;
        stripe.tier->NoteMovedOut(cold_slot, window);
        stripe.EraseSlot(slot);
        cold_rows_.fetch_add(1, std::memory_order_relaxed);
        ++moved;
      }
    }
  }
  demotions_.fetch_add(to_disk ? moved : 0, std::memory_order_relaxed);
  return moved;
}

void Table::Compact() {
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
    stripes_[s].Compact(record_bytes_);
  }
}

std::vector<int64_t> Table::Coldest(Stripe* stripe, size_t want, uint32_t now,
                                    std::vector<std::pair<uint64_t, int64_t>>* scored) {
  const Index& index = stripe->index;
  const size_t mask = index.size() - 1;
  // Victims come from the coldest fraction `q` of the rows: twice the
  // wave's share, at least a sixteenth; a wave of a quarter or more (q of
  // half or more) takes the coldest exactly.
  const double q = std::max(2.0 * static_cast<double>(want) / std::max<uint32_t>(stripe->live, 1),
                            1.0 / kColdSampleQuantile);
  std::vector<uint64_t> sample;
  if (q < 0.5) {
    uint64_t x = stripe->sweep.load(std::memory_order_relaxed) + kGolden;
    for (uint32_t i = 0; i < kColdSampleSlots; ++i) {
      x = Mix64(x + kGolden);
      const IndexEntry& e = index[x & mask];
      if (e.record != kEmpty) sample.push_back(Score(stripe->Record(e.record, record_bytes_), now));
    }
  }
  if (sample.size() < kColdSampleSlots / 8) {  // a wave, or a small stripe: every row scored
    scored->clear();
    scored->reserve(stripe->live);
    for (const IndexEntry& e : index) {
      if (e.record == kEmpty) continue;
      scored->emplace_back(Score(stripe->Record(e.record, record_bytes_), now), e.key);
    }
    std::vector<int64_t> keys = Lowest(scored, want);
    if (!keys.empty()) {
      const auto low = std::min_element(scored->begin(), scored->begin() + keys.size());
      NoteCut(stripe, low->first, now);
    }
    return keys;
  }
  const auto at =
      sample.begin() + static_cast<std::ptrdiff_t>(static_cast<double>(sample.size()) * q);
  std::nth_element(sample.begin(), at, sample.end());
  const uint64_t threshold = *at;
  NoteCut(stripe, *std::min_element(sample.begin(), at + 1), now);
  // The rows at or below the threshold from where the last sweep stopped.
  std::vector<int64_t> keys;
  keys.reserve(want);
  size_t i = stripe->sweep.load(std::memory_order_relaxed) & mask;
  for (size_t n = 0; n < index.size() && keys.size() < want; ++n, i = (i + 1) & mask) {
    const IndexEntry& ahead = index[(i + kProbeAhead) & mask];
    if (ahead.record != kEmpty) __builtin_prefetch(stripe->Record(ahead.record, record_bytes_));
    const IndexEntry& e = index[i];
    if (e.record == kEmpty) continue;
    if (Score(stripe->Record(e.record, record_bytes_), now) <= threshold) keys.push_back(e.key);
  }
  stripe->sweep.store(i, std::memory_order_relaxed);
  return keys;
}

void Table::NoteCut(Stripe* stripe, uint64_t score, uint32_t now) {
  stripe->cut.store(score, std::memory_order_relaxed);
  stripe->cut_now.store(now, std::memory_order_relaxed);
  stripe->has_cut.store(true, std::memory_order_relaxed);
}

bool Table::NearRamLimit() const {
  const uint64_t limit = ram_limit_.load(std::memory_order_relaxed);
  return limit != 0 && ram_rows() >= limit - limit / 16;
}

bool Table::WorthRam(const Stripe& stripe, const char* record, uint32_t slot,
                     bool near_limit) const {
  return !near_limit || AboveCut(stripe, record) || stripe.tier->MovedOutLately(slot);
}

bool Table::AboveCut(const Stripe& stripe, const char* record) const {
  if (!stripe.has_cut.load(std::memory_order_relaxed)) return true;
  const uint32_t then = stripe.cut_now.load(std::memory_order_relaxed);
  const auto* header = reinterpret_cast<const RowHeader*>(record);
  const uint64_t score = ScoreOf(header->step, header->touched, then);
  const uint64_t cut = stripe.cut.load(std::memory_order_relaxed);
  // A row touched since the cut is younger than every row it weighed.
  const bool since = static_cast<int32_t>(header->touched - then) > 0;
  return score > cut || (since && score == cut);
}

size_t Table::EvictAcrossTiers() {
  if (!has_tier() || config_.policy.max_rows == 0) return 0;
  const uint32_t now = Now();
  size_t evicted = 0;
  std::vector<std::pair<uint64_t, int64_t>> scored;
  for (uint32_t s = 0; s < kStripes; ++s) {
    Stripe& stripe = stripes_[s];
    const uint64_t quota = stripe_quota_[s];
    size_t rows;
    uint64_t removals, layout;
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      rows = stripe.live + stripe.tier->rows();
      if (rows <= quota + quota / 32) continue;
      removals = stripe.removals;
      layout = stripe.tier->layout();
      scored.clear();
      for (const IndexEntry& e : stripe.index) {
        if (e.record == kEmpty) continue;
        scored.emplace_back(Score(stripe.Record(e.record, record_bytes_), now), e.key);
      }
    }
    const Status read = ForEachCold(
        &stripe, [&] { return std::shared_lock<std::shared_mutex>(stripe.mu); },
        [&](uint32_t, int64_t key, const char* record) {
          scored.emplace_back(Score(record, now), key);
        });
    if (!read.ok()) {
      NoteTierError(read.message());
      continue;
    }
    bool moved;
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      moved = stripe.removals != removals || stripe.tier->layout() != layout;
    }
    if (moved) {
      // Rows moved out to disk during the pass were weighed in RAM and may
      // be read again from disk, and a tier file that doubled between
      // batches of pages may show a row twice (337 of a stripe's 6,276
      // weighed while the keeper moved rows out): each row once, at the
      // higher of its scores.
      std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) {
        return a.second != b.second ? a.second < b.second : a.first > b.first;
      });
      scored.erase(std::unique(scored.begin(), scored.end(),
                               [](const auto& a, const auto& b) { return a.second == b.second; }),
                   scored.end());
    }
    // Down to the quota less the same slack EvictFrom leaves.
    evicted += EraseLowest(&stripe, &scored, rows - quota + quota / 32, now);
  }
  evicted_.fetch_add(evicted, std::memory_order_relaxed);
  return evicted;
}

size_t Table::EraseLowest(Stripe* stripe, std::vector<std::pair<uint64_t, int64_t>>* scored,
                          size_t want, uint32_t now) {
  // The candidates, lowest first (sorted before the lock is taken): those
  // wanted and a few more, for rows weighed twice (moved out to disk during
  // the pass, or read again from a tier file that doubled) or scoring
  // higher now.
  const size_t m = std::min(scored->size(), want + want / 16 + kEvictSpare);
  if (want == 0 || m == 0) return 0;
  std::nth_element(scored->begin(), scored->begin() + (m - 1), scored->end());
  std::sort(scored->begin(), scored->begin() + m);
  std::unique_lock<std::shared_mutex> lock(stripe->mu);
  char* scratch = ScratchRecord();
  std::vector<int64_t> one(1);
  size_t taken = 0;
  for (size_t i = 0; i < m && taken < want; ++i) {
    // The cut: the score of the want-th lowest candidate not passed over.
    const uint64_t cut = (*scored)[std::min(m - 1, i + (want - taken) - 1)].first;
    const int64_t key = (*scored)[i].second;
    const uint64_t hash = Mix64(static_cast<uint64_t>(key));
    const uint32_t rec = stripe->Find(hash, key);
    if (rec != kEmpty) {
      if (Score(stripe->Record(rec, record_bytes_), now) > cut) continue;  // touched since
      one[0] = key;
      taken += EraseFrom(stripe, one);
      continue;
    }
    if (!stripe->tier || stripe->tier->rows() == 0) continue;
    uint32_t slot;
    uint16_t generation;
    const Status found = stripe->tier->Find(hash, key, scratch, &slot, &generation);
    if (!found.ok()) {
      NoteTierError(found.message());
      continue;
    }
    // Gone (or taken already, as a row weighed twice), or updated on disk.
    if (slot == TierFile::kNoSlot || Score(scratch, now) > cut) continue;
    EraseCold(stripe, slot, key);
    ++taken;
  }
  stripe->Compact(record_bytes_);
  return taken;
}

size_t Table::RamBytes(bool fixed_only) const {
  size_t total = sketch_ ? sketch_->bytes() : 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    const Stripe& stripe = stripes_[s];
    std::shared_lock<std::shared_mutex> lock(stripe.mu);
    total += stripe.removed.capacity() * sizeof(Removal) + stripe.ChangeLogBytes();
    if (stripe.tier)
      total += fixed_only ? stripe.tier->ram_bytes_ahead() : stripe.tier->ram_bytes();
    if (fixed_only) continue;
    total += size_t{stripe.num_records} * (record_bytes_ + sizeof(uint16_t)) +
             stripe.index.size() * sizeof(IndexEntry) +
             stripe.free_records.capacity() * sizeof(uint32_t);
  }
  return total;
}

size_t Table::ram_fixed_bytes() const { return RamBytes(/*fixed_only=*/true); }

size_t Table::ram_row_bytes() const {
  uint64_t slots = 0, live = 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    slots += stripes_[s].index.size();
    live += stripes_[s].live;
  }
  const uint64_t index = live < kStripes * 16 ? 24 : slots * sizeof(IndexEntry) / live;
  return record_bytes_ + sizeof(uint16_t) + std::clamp<uint64_t>(index, 16, 32);
}

char* Table::ScratchRecord() const {
  thread_local std::vector<char> scratch;
  scratch.resize(record_bytes_);
  return scratch.data();
}

size_t Table::ram_rows() const {
  const int64_t ram =
      rows_.load(std::memory_order_relaxed) - cold_rows_.load(std::memory_order_relaxed);
  return ram < 0 ? 0 : static_cast<size_t>(ram);
}

void Table::SetKeeperError(const std::string& error) {
  std::lock_guard<std::mutex> lock(tier_error_mu_);
  keeper_error_ = error;
  keeper_failing_.store(!error.empty(), std::memory_order_relaxed);
}

void Table::NoteTierError(const std::string& error) {
  std::lock_guard<std::mutex> lock(tier_error_mu_);
  request_error_ = error;
  request_failing_.store(true, std::memory_order_relaxed);
}

void Table::TierWorked() {
  std::lock_guard<std::mutex> lock(tier_error_mu_);
  request_error_.clear();
  request_failing_.store(false, std::memory_order_relaxed);
}

void Table::UpdateTierRates(double seconds) {
  const TierStats now = tier_stats();
  std::lock_guard<std::mutex> lock(tier_error_mu_);
  if (seconds > 0) {
    rates_.promotions_per_s = (now.promotions - rates_.promotions) / seconds;
    rates_.demotions_per_s = (now.demotions - rates_.demotions) / seconds;
    rates_.disk_reads_per_s = (now.disk_reads - rates_.disk_reads) / seconds;
  }
  rates_.promotions = now.promotions;
  rates_.demotions = now.demotions;
  rates_.disk_reads = now.disk_reads;
}

TierStats Table::tier_stats() const {
  TierStats t;
  // One read of the cold count for both: a row the keeper moves to disk
  // between two reads was counted in RAM and on disk.
  const int64_t rows = rows_.load(std::memory_order_relaxed);
  const int64_t cold = cold_rows_.load(std::memory_order_relaxed);
  t.ram_rows = rows - cold < 0 ? 0 : static_cast<uint64_t>(rows - cold);
  t.disk_rows = cold < 0 ? 0 : static_cast<uint64_t>(cold);
  t.ram_bytes = bytes();
  for (uint32_t s = 0; s < kStripes && has_tier(); ++s) {
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    t.disk_bytes += stripes_[s].tier->disk_bytes();
    t.disk_reads += stripes_[s].tier->reads();
    t.disk_read_errors += stripes_[s].tier->read_errors();
    t.disk_write_errors += stripes_[s].tier->write_errors();
  }
  t.promotions = promotions_.load(std::memory_order_relaxed);
  t.disk_updates = disk_updates_.load(std::memory_order_relaxed);
  t.demotions = demotions_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(tier_error_mu_);
  t.error = keeper_error_.empty() ? request_error_ : keeper_error_;
  t.promotions_per_s = rates_.promotions_per_s;
  t.demotions_per_s = rates_.demotions_per_s;
  t.disk_reads_per_s = rates_.disk_reads_per_s;
  return t;
}

void Table::EraseCold(Stripe* stripe, uint32_t slot, int64_t key) {
  stripe->tier->Remove(slot);
  ++stripe->removals;
  cold_rows_.fetch_sub(1, std::memory_order_relaxed);
  rows_.fetch_sub(1, std::memory_order_relaxed);
  NoteChange(stripe, key);
  if (logging_.load(std::memory_order_relaxed)) {
    stripe->removed.push_back(Removal{key, generation_.load(std::memory_order_relaxed)});
    CapRemovalLog(stripe);
  }
}

}  // namespace dlt
