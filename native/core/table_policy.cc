// A table's memory policy: admission (probability, frequency sketch),
// eviction (LFU/LRU scores) and expiry (ttl).

#include <algorithm>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "native/core/half.h"
#include "native/core/initializer.h"
#include "native/core/table.h"
#include "native/core/table_stripe.h"

namespace dlt {

uint64_t Table::Score(const char* record, uint32_t now) const {
  const auto* h = reinterpret_cast<const RowHeader*>(record);
  return ScoreOf(h->step, h->touched, now);
}

uint64_t Table::ScoreOf(uint32_t step, uint32_t touched, uint32_t now) const {
  const uint32_t age = AgeAt(now, touched);
  // Lowest first: fewest updates (LFU), then longest untouched.
  const uint64_t recency = 0xffffffffu - age;
  const bool lfu = config_.policy.eviction == static_cast<uint64_t>(EvictionKind::kLfu);
  return lfu ? (uint64_t{step} << 32) | recency : recency;
}

std::vector<int64_t> Table::Lowest(std::vector<std::pair<uint64_t, int64_t>>* scored, size_t want) {
  want = std::min(want, scored->size());
  std::vector<int64_t> keys;
  if (want == 0) return keys;
  std::nth_element(scored->begin(), scored->begin() + (want - 1), scored->end());
  keys.reserve(want);
  for (size_t v = 0; v < want; ++v) keys.push_back((*scored)[v].second);
  return keys;
}

bool Table::ProbabilityAdmits(int64_t id) const {
  const uint64_t bits = Mix64(Mix64(config_.seed ^ kAdmitSalt) ^ static_cast<uint64_t>(id));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0) <
         static_cast<double>(config_.policy.probability);
}

bool Table::AdmitOnPush(Stripe* stripe, uint64_t hash, int64_t id, std::vector<uint64_t>* counted,
                        bool* repeat) {
  *repeat = false;
  const auto kind = static_cast<AdmissionKind>(config_.policy.admission);
  if (kind == AdmissionKind::kAll) return true;
  // Each id once per push: `counted` is an open-addressing set of hashes in
  // its first cells (0 marks a free one), a power of two of them, and in
  // its last cell whether a hash of 0 was seen.
  const size_t cells = counted->size() - 1;
  uint64_t* cell = &(*counted)[cells];
  if (hash != 0) {
    size_t i = (hash >> 7) & (cells - 1);
    while ((*counted)[i] != 0 && (*counted)[i] != hash) i = (i + 1) & (cells - 1);
    cell = &(*counted)[i];
  }
  if (*cell != 0) {  // decided (refused) earlier in this push
    *repeat = true;
    return false;
  }
  *cell = hash != 0 ? hash : 1;
  if (kind == AdmissionKind::kProbability) return ProbabilityAdmits(id);
  NoteSketchAdd(stripe, hash);
  return sketch_->Add(hash) >= config_.policy.min_count;
}

void Table::InitialValues(int64_t id, float* out) const {
  InitializeRow(config_.initializer, config_.seed, id, config_.dim, out);
  const uint64_t dtype = config_.policy.value_dtype;
  if (dtype == static_cast<uint64_t>(StorageDtype::kFloat32)) return;
  // As WriteRow stores a new row's values (nearest, never stochastic).
  thread_local std::vector<char> stored;
  stored.resize(value_bytes_);
  StoreValues(out, dtype, /*stochastic=*/false, 0, config_.dim, stored.data());
  LoadValues(stored.data(), dtype, config_.dim, out);
}

void Table::Unadmitted(int64_t id, float* out) const {
  if (config_.policy.unadmitted == static_cast<uint64_t>(UnadmittedValue::kInitial)) {
    InitialValues(id, out);
  } else {
    std::memset(out, 0, sizeof(float) * config_.dim);
  }
}

void Table::EvictFrom(Stripe* stripe, uint32_t now) {
  const uint64_t quota = stripe_quota_[stripe - stripes_.get()];
  if (stripe->live <= quota) return;
  // Evict a little below the quota, so eviction runs once per many inserts.
  const uint64_t slack = quota / 32;
  const size_t want = static_cast<size_t>(stripe->live - quota + slack);
  thread_local std::vector<std::pair<uint64_t, int64_t>> scored;  // (score, key)
  scored.clear();
  for (const IndexEntry& e : stripe->index) {
    if (e.record == kEmpty) continue;
    scored.emplace_back(Score(stripe->Record(e.record, record_bytes_), now), e.key);
  }
  evicted_.fetch_add(EraseFrom(stripe, Lowest(&scored, want)), std::memory_order_relaxed);
}

uint64_t Table::RowsPastQuota(const int64_t* ids, size_t n, const int64_t* removed,
                              size_t m) const {
  if (config_.policy.max_rows == 0 || has_tier()) return 0;
  std::vector<int64_t> gone(removed, removed + m);
  std::sort(gone.begin(), gone.end());
  const auto is_gone = [&gone](int64_t id) {
    return std::binary_search(gone.begin(), gone.end(), id);
  };
  // The stripe of `id`, and whether it holds a row for it.
  const auto held = [this](int64_t id, uint32_t* stripe) {
    const uint64_t hash = Mix64(static_cast<uint64_t>(id));
    *stripe = StripeOf(hash);
    std::shared_lock<std::shared_mutex> lock(stripes_[*stripe].mu);
    return stripes_[*stripe].Find(hash, id) != kEmpty;
  };
  // Per stripe: rows held that the removals take, and ids that come in
  // where no row is held once they are made.
  std::vector<uint64_t> taken(kStripes, 0), fresh(kStripes, 0);
  uint32_t s = 0;
  for (size_t i = 0; i < gone.size(); ++i) {
    if (i > 0 && gone[i] == gone[i - 1]) continue;
    if (held(gone[i], &s)) ++taken[s];
  }
  for (size_t i = 0; i < n; ++i) {
    if (!held(ids[i], &s) || is_gone(ids[i])) ++fresh[s];
  }
  uint64_t past = 0;
  for (s = 0; s < kStripes; ++s) {
    if (fresh[s] == 0) continue;  // (a stripe past its quota evicts only as rows come in)
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    const uint64_t rows =
        stripes_[s].live - std::min<uint64_t>(taken[s], stripes_[s].live) + fresh[s];
    if (rows > stripe_quota_[s]) past += rows - stripe_quota_[s];
  }
  return past;
}

uint64_t Table::RowsHeldPastQuota() const {
  if (config_.policy.max_rows == 0 || has_tier()) return 0;
  uint64_t past = 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    if (stripes_[s].live > stripe_quota_[s]) past += stripes_[s].live - stripe_quota_[s];
  }
  return past;
}

size_t Table::Remove(uint64_t min_count, uint64_t unseen_for, uint32_t now,
                     std::atomic<uint64_t>* counter, bool exact) {
  if (min_count == 0 && unseen_for == 0) return 0;
  const auto goes = [&](int64_t, const char* record) {
    const auto* h = reinterpret_cast<const RowHeader*>(record);
    const bool rare = min_count != 0 && h->step < min_count;
    const bool stale = unseen_for != 0 && AgeAt(now, h->touched) > unseen_for;
    return rare || stale;
  };
  size_t removed = 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    removed += EraseWhere(&stripes_[s], exact, goes, nullptr);
  }
  counter->fetch_add(removed, std::memory_order_relaxed);
  return removed;
}

size_t Table::Shrink(uint64_t min_count, uint64_t unseen_for, uint32_t now) {
  // An explicit shrink takes every matching row, also one the memory
  // keeper or a pull moves between the tiers during its pass (rows written
  // after a stripe's pass may match again).
  return Remove(min_count, unseen_for, now, &shrunk_, /*exact=*/true);
}

size_t Table::Expire(uint32_t now) {
  // A sweep runs often, under traffic: one pass, no stripe held whole (a
  // row that moved between the tiers during it goes at the next sweep).
  return Remove(0, config_.policy.ttl, now, &expired_, /*exact=*/false);
}

bool Table::SketchHolds(uint32_t first_bucket, uint32_t end_bucket) const {
  return sketch_ != nullptr && first_bucket >= first_bucket_ && end_bucket <= end_bucket_ &&
         first_bucket <= end_bucket;
}

void Table::ReadSketch(uint32_t bucket, uint8_t* counters, uint32_t* added) const {
  std::shared_lock<std::shared_mutex> lock(stripes_[stripe_of_bucket_[bucket]].mu);
  sketch_->ReadSlice(bucket, counters, added);
}

void Table::WriteSketch(uint32_t bucket, const uint8_t* counters, uint32_t added) {
  std::unique_lock<std::shared_mutex> lock(stripes_[stripe_of_bucket_[bucket]].mu);
  sketch_->WriteSlice(bucket, counters, added);
}

uint32_t Table::SketchEstimate(int64_t id) const {
  if (!sketch_) return 0;
  const uint64_t hash = Mix64(static_cast<uint64_t>(id));
  std::shared_lock<std::shared_mutex> lock(stripes_[StripeOf(hash)].mu);
  return sketch_->Estimate(hash);
}

}  // namespace dlt
