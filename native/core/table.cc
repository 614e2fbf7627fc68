// A table's storage and hot paths: construction, pulls, pushes, assignment,
// import, sizes and counters, and reserving room. Its tier, policy and
// export parts are table_tier.cc, table_policy.cc and table_export.cc.
#include "native/core/table.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>

#include "native/core/dedup.h"
#include "native/core/finite.h"
#include "native/core/half.h"
#include "native/core/initializer.h"
#include "native/core/optimizer.h"
#include "native/core/table_stripe.h"

namespace dlt {

size_t Table::RecordBytes(const TableConfig& config) {
  const size_t slots = size_t{SlotsPerValue(config.optimizer.kind)} * config.dim;
  return RoundUp(sizeof(RowHeader) + size_t{DtypeBytes(config.policy.value_dtype)} * config.dim +
                     size_t{DtypeBytes(config.policy.slot_dtype)} * slots,
                 8);
}

Table::Table(const TableConfig& config, uint32_t first_bucket, uint32_t end_bucket)
    : config_(config),
      slot_floats_(SlotsPerValue(config.optimizer.kind) * config.dim),
      value_bytes_(DtypeBytes(config.policy.value_dtype) * config.dim),
      record_bytes_(RecordBytes(config)),
      first_bucket_(first_bucket),
      end_bucket_(end_bucket),
      wide_(config.policy.value_dtype == static_cast<uint64_t>(StorageDtype::kFloat32) &&
            config.policy.slot_dtype == static_cast<uint64_t>(StorageDtype::kFloat32)),
      stripes_(new Stripe[kStripes]) {
  const uint64_t owned = end_bucket - first_bucket;
  uint64_t buckets_in[kStripes] = {};
  for (uint32_t b = 0; b < kNumBuckets; ++b) {
    uint32_t s = 0;
    if (b >= end_bucket) {
      s = kStripes - 1;
    } else if (b >= first_bucket) {
      s = static_cast<uint32_t>((b - first_bucket) * uint64_t{kStripes} / owned);
      ++buckets_in[s];
    }
    stripe_of_bucket_[b] = static_cast<uint8_t>(s);
  }
  // Each stripe holds at most its share of max_rows: the share of the
  // table's buckets it serves (ids spread evenly over buckets), rounded
  // down, so the quotas never add up to more than max_rows.
  for (uint32_t s = 0; s < kStripes; ++s) {
    stripe_quota_[s] = config.policy.max_rows * buckets_in[s] / owned;
  }
  if (config.policy.admission == static_cast<uint64_t>(AdmissionKind::kFrequency)) {
    sketch_ =
        std::make_unique<FrequencySketch>(config.policy.sketch_bytes, first_bucket, end_bucket);
  }
}

Table::~Table() {
  stripes_.reset();  // closes and unlinks the tier files
  if (!tier_dir_.empty()) rmdir(tier_dir_.c_str());
}

uint32_t Table::Now() const {
  if (config_.policy.clock == static_cast<uint64_t>(ClockKind::kSeconds)) {
    return static_cast<uint32_t>(std::time(nullptr));
  }
  return static_cast<uint32_t>(pushes_.load(std::memory_order_relaxed));
}

void Table::ReadValues(const char* record, float* out) const {
  LoadValues(record + sizeof(RowHeader), config_.policy.value_dtype, config_.dim, out);
}

void Table::ReadSlots(const char* record, float* out) const {
  LoadValues(record + sizeof(RowHeader) + value_bytes_, config_.policy.slot_dtype, slot_floats_,
             out);
}

void Table::WriteRow(char* record, int64_t id, uint32_t step, const float* values,
                     const float* slots, bool stochastic) {
  const uint64_t key =
      Mix64(Mix64(config_.seed ^ kRoundSalt) ^ static_cast<uint64_t>(id)) + step * kGolden;
  StoreValues(values, config_.policy.value_dtype, stochastic, key, config_.dim,
              record + sizeof(RowHeader));
  if (slot_floats_ == 0) return;
  StoreValues(slots, config_.policy.slot_dtype, stochastic, key ^ kSlotRoundSalt, slot_floats_,
              record + sizeof(RowHeader) + value_bytes_);
}

void Table::GroupByStripe(const int64_t* ids, size_t n, std::vector<uint64_t>* hashes,
                          std::vector<uint32_t>* order, std::vector<uint32_t>* starts) const {
  hashes->resize(n);
  order->resize(n);
  starts->assign(kStripes + 1, 0);
  std::vector<uint32_t>& s = *starts;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t h = Mix64(static_cast<uint64_t>(ids[i]));
    (*hashes)[i] = h;
    ++s[StripeOf(h) + 1];
  }
  for (uint32_t k = 0; k < kStripes; ++k) s[k + 1] += s[k];
  std::vector<uint32_t> next(s.begin(), s.end() - 1);
  for (size_t i = 0; i < n; ++i) {
    (*order)[next[StripeOf((*hashes)[i])]++] = static_cast<uint32_t>(i);
  }
}

uint32_t Table::FindOrCreate(Stripe* stripe, uint64_t hash, int64_t id) {
  uint32_t rec = stripe->Find(hash, id);
  if (rec != kEmpty) return rec;
  rec = stripe->Insert(hash, id, record_bytes_);
  if (rec == kEmpty) return kEmpty;
  rows_.fetch_add(1, std::memory_order_relaxed);
  char* r = stripe->Record(rec, record_bytes_);
  auto* header = reinterpret_cast<RowHeader*>(r);
  header->step = 0;
  header->touched = Now();
  stripe->Generation(rec) = static_cast<uint16_t>(generation_.load(std::memory_order_relaxed));
  NoteChange(stripe, id);
  if (wide_) {
    float* values = reinterpret_cast<float*>(r + sizeof(RowHeader));
    InitializeRow(config_.initializer, config_.seed, id, config_.dim, values);
    InitializeSlots(config_.optimizer, config_.dim, values + config_.dim);
    return rec;
  }
  thread_local std::vector<float> values, slots;
  values.resize(config_.dim);
  slots.resize(slot_floats_);
  InitializeRow(config_.initializer, config_.seed, id, config_.dim, values.data());
  InitializeSlots(config_.optimizer, config_.dim, slots.data());
  WriteRow(r, id, 0, values.data(), slots.data(), /*stochastic=*/false);
  return rec;
}

void Table::ReadState(const int64_t* ids, size_t n, float* out) const {
  const uint32_t dim = config_.dim;
  const size_t width = StateFloats(dim, slot_floats_);
  for (size_t i = 0; i < n; ++i) {
    float* row = out + i * width;
    const uint64_t hash = Mix64(static_cast<uint64_t>(ids[i]));
    const Stripe& stripe = stripes_[StripeOf(hash)];
    std::shared_lock<std::shared_mutex> lock(stripe.mu);
    const uint32_t rec = stripe.Find(hash, ids[i]);
    uint32_t step = kNoState;
    if (rec == kEmpty) {
      std::memset(row, 0, sizeof(float) * (width - 1));
    } else {
      const char* r = stripe.Record(rec, record_bytes_);
      step = reinterpret_cast<const RowHeader*>(r)->step;
      ReadValues(r, row);
      if (slot_floats_) ReadSlots(r, row + dim);
    }
    std::memcpy(row + width - 1, &step, sizeof(step));
  }
}

Status Table::PullState(const int64_t* ids, size_t n, const PullMode* fallback, float* out) {
  ReadState(ids, n, out);
  if (fallback == nullptr) return OkStatus();
  const uint32_t dim = config_.dim;
  const size_t width = StateFloats(dim, slot_floats_);
  std::vector<int64_t> absent;
  std::vector<size_t> at;
  for (size_t i = 0; i < n; ++i) {
    if (StepOfState(out + i * width, width) != kNoState) continue;
    absent.push_back(ids[i]);
    at.push_back(i);
  }
  if (absent.empty()) return OkStatus();
  std::vector<float> values(absent.size() * dim);  // as a plain reply's rows
  DLT_RETURN_IF_ERROR(Pull(absent.data(), absent.size(), *fallback, values.data()));
  const bool made = *fallback == PullMode::kInsert;  // rows it may have made or moved in
  for (size_t k = 0; k < absent.size(); ++k) {
    float* row = out + at[k] * width;
    if (made) ReadState(&absent[k], 1, row);  // in place: kNoState again if not in RAM
    if (!made || StepOfState(row, width) == kNoState) {
      std::memcpy(row, &values[k * dim], sizeof(float) * dim);
    }
  }
  return OkStatus();
}

Status Table::Pull(const int64_t* ids, size_t n, PullMode mode, float* out) {
  if (IsStatePull(mode)) {
    const PullMode insert = PullMode::kInsert;
    return PullState(ids, n, mode == PullMode::kStateInsert ? &insert : nullptr, out);
  }
  // The thread's scratch, bound once (in a shared library every use of a
  // thread_local calls __tls_get_addr, which the loops below would pay);
  // a batch past kKeepScratchIds gets its own, freed after it.
  struct Scratch {
    std::vector<uint64_t> hashes;
    std::vector<uint32_t> order, starts, missing, recs;
  };
  Scratch own;
  Scratch& scratch = ThreadScratch(n, own);
  auto& hashes = scratch.hashes;
  auto& order = scratch.order;
  auto& starts = scratch.starts;
  auto& missing = scratch.missing;
  auto& recs = scratch.recs;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  const uint32_t dim = config_.dim;
  const size_t row_bytes = sizeof(float) * dim;
  const auto admission = static_cast<AdmissionKind>(config_.policy.admission);
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    Stripe& stripe = stripes_[s];
    missing.clear();
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      // Three stages a few ids apart, so the cache misses of the index
      // probe, the record read and the output write overlap; each stage's
      // first ids are asked for before it starts (a stripe's share of a
      // small batch is a few dozen ids).
      const uint32_t begin = starts[s], end = starts[s + 1];
      recs.resize(end - begin);
      stripe.PrefetchFirstSlots(hashes.data(), order.data(), begin, end);
      for (uint32_t k = begin; k < end; ++k) {
        if (k + kProbeAhead < end) stripe.PrefetchSlot(hashes[order[k + kProbeAhead]]);
        const uint32_t pos = order[k];
        const uint32_t rec = stripe.Find(hashes[pos], ids[pos]);
        recs[k - begin] = rec;
        if (rec != kEmpty)
          __builtin_prefetch(stripe.Record(rec, record_bytes_) + sizeof(RowHeader));
      }
      for (uint32_t k = begin; k < std::min(end, begin + kCopyAhead); ++k) {
        if (recs[k - begin] != kEmpty) {
          PrefetchBytes(stripe.Record(recs[k - begin], record_bytes_),
                        sizeof(RowHeader) + value_bytes_);
        }
      }
      for (uint32_t k = begin; k < end; ++k) {
        // The record's values and the row's place, a few ids ahead.
        if (k + kCopyAhead < end && recs[k + kCopyAhead - begin] != kEmpty) {
          const char* next = stripe.Record(recs[k + kCopyAhead - begin], record_bytes_);
          PrefetchBytes(next, sizeof(RowHeader) + value_bytes_);
          PrefetchBytes<1>(out + size_t{order[k + kCopyAhead]} * dim, row_bytes);
        }
        const uint32_t pos = order[k];
        const uint32_t rec = recs[k - begin];
        if (rec == kEmpty) {
          missing.push_back(pos);
          continue;
        }
        const char* r = stripe.Record(rec, record_bytes_);
        if (wide_) {
          std::memcpy(out + size_t{pos} * dim, r + sizeof(RowHeader), row_bytes);
        } else {
          ReadValues(r, out + size_t{pos} * dim);
        }
      }
    }
    if (missing.empty()) continue;
    const bool tiered = stripe.tier != nullptr;
    if (mode == PullMode::kZerosNoInsert && !tiered) {
      for (uint32_t pos : missing) std::memset(out + size_t{pos} * dim, 0, row_bytes);
      continue;
    }
    if (mode == PullMode::kInitNoInsert && !tiered) {
      for (uint32_t pos : missing) {
        InitialValues(ids[pos], out + size_t{pos} * dim);
      }
      continue;
    }
    // Training: rows are made here only for ids admitted on sight; the
    // others read the unadmitted default until a push admits them.
    size_t admitted = 0;
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    // Cold rows move into RAM while it has room (and, near the limit, if
    // they are worth it: WorthRam); else they are read where they are, and
    // a new row is left for its push to make.
    const bool promote = !RamFull(stripe);
    const bool near_limit = tiered && NearRamLimit();
    if (tiered && missing.size() > 1) {  // the cold rows' reads at once
      stripe.tier->Prefetch(hashes.data(), missing.data(), missing.size());
    }
    // Dropped before the lock goes, on every path out (errors included).
    struct DropPrefetchedOnExit {
      TierFile* tier;
      ~DropPrefetchedOnExit() {
        if (tier != nullptr) tier->DropPrefetched();
      }
    } drop_prefetched{tiered ? stripe.tier.get() : nullptr};
    for (uint32_t pos : missing) {
      float* dst = out + size_t{pos} * dim;
      if (tiered && stripe.tier->rows() != 0) {
        uint32_t rec = stripe.Find(hashes[pos], ids[pos]);  // moved in meanwhile?
        if (rec != kEmpty) {
          ReadValues(stripe.Record(rec, record_bytes_), dst);
          continue;
        }
        char* const cold = ScratchRecord();
        uint32_t slot;
        uint16_t generation;
        DLT_RETURN_IF_ERROR(FindCold(&stripe, hashes[pos], ids[pos], cold, &slot, &generation));
        if (slot != TierFile::kNoSlot) {
          if (promote && WorthRam(stripe, cold, slot, near_limit)) {
            DLT_RETURN_IF_ERROR(
                MoveIn(&stripe, hashes[pos], ids[pos], cold, slot, generation, &rec));
          }
          ReadValues(cold, dst);
          continue;
        }
      }
      if (mode == PullMode::kZerosNoInsert) {
        std::memset(dst, 0, row_bytes);
        continue;
      }
      if (mode == PullMode::kInitNoInsert) {
        InitialValues(ids[pos], dst);
        continue;
      }
      const bool admit = admission == AdmissionKind::kAll ||
                         (admission == AdmissionKind::kProbability && ProbabilityAdmits(ids[pos]));
      uint32_t rec = kEmpty;
      if (admit && promote) {
        const uint32_t live = stripe.live;
        rec = FindOrCreate(&stripe, hashes[pos], ids[pos]);
        admitted += stripe.live - live;
      }
      if (rec == kEmpty) {  // not admitted, or out of address space: store nothing
        if (admit) {
          InitialValues(ids[pos], dst);
        } else {
          Unadmitted(ids[pos], dst);
        }
        continue;
      }
      ReadValues(stripe.Record(rec, record_bytes_), dst);
    }
    if (admitted) {
      admitted_.fetch_add(admitted, std::memory_order_relaxed);
      if (config_.policy.max_rows && !tiered) EvictFrom(&stripe, Now());
    }
  }
  return OkStatus();
}

Status Table::Push(const int64_t* ids, const float* grads, size_t n, float lr) {
  DLT_RETURN_IF_ERROR(CheckLearningRate(lr, config_.optimizer.kind == OptimizerKind::kFtrl, ""));
  const uint32_t dim = config_.dim;
  DLT_RETURN_IF_ERROR(CheckGradients(ids, grads, n, dim, lr, "", "nothing applied"));
  WaitForRoom();
  pushes_.fetch_add(1, std::memory_order_relaxed);
  const uint32_t now = Now();
  struct Scratch {  // as in Pull: the thread's, bound once, up to kKeepScratchIds
    std::vector<uint64_t> hashes, counted;
    std::vector<uint32_t> order, starts, recs, slot_of, firsts, unique_of, kept;
    std::vector<uint32_t> cold_at, cold_slots, rewritten;
    std::vector<uint16_t> cold_generations;
    std::vector<uint8_t> made;
    std::vector<int64_t> unmade;
    std::vector<float> row;
    std::vector<char> cold_records, cold_before;
    RepeatedSums sums;
  };
  Scratch own;
  Scratch& scratch = ThreadScratch(n, own);
  auto& hashes = scratch.hashes;
  auto& counted = scratch.counted;
  auto& order = scratch.order;
  auto& starts = scratch.starts;
  auto& recs = scratch.recs;
  // Cold rows updated where they lie: per kept row, its index in
  // cold_slots (its tier slot) and cold_records (its record), or kEmpty.
  auto& cold_at = scratch.cold_at;
  auto& cold_slots = scratch.cold_slots;
  auto& cold_records = scratch.cold_records;
  auto& cold_generations = scratch.cold_generations;
  // Cold rows' records as read, and the kept rows rewritten on disk so
  // far: a failed write puts them back.
  auto& cold_before = scratch.cold_before;
  auto& rewritten = scratch.rewritten;
  // Per kept row, whether this push made it (a new id, admitted); a row
  // it made whose update is refused is removed again (`unmade`), so a
  // refused push of a new id leaves no row behind.
  auto& made = scratch.made;
  auto& unmade = scratch.unmade;
  auto& slot_of = scratch.slot_of;
  auto& firsts = scratch.firsts;
  auto& unique_of = scratch.unique_of;
  auto& kept = scratch.kept;
  auto& sums = scratch.sums;
  auto& row = scratch.row;
  const size_t row_floats = size_t{dim} + slot_floats_;
  // The first id whose update would overflow (its row is left as it was),
  // and the first whose repeats sum past the gradient limit (likewise: the
  // limit holds for what a row is updated with, not only each row sent).
  constexpr int64_t kNoOverflow = INT64_MIN;
  int64_t overflowed = kNoOverflow, summed_past = kNoOverflow;
  const float limit = GradientLimit(lr);
  const bool keep_squares = config_.optimizer.kind == OptimizerKind::kKerasAdagrad;
  // Admission that decides per id (each id once per push: `counted`).
  const bool admitting =
      static_cast<AdmissionKind>(config_.policy.admission) != AdmissionKind::kAll;
  const bool stochastic =
      config_.policy.rounding == static_cast<uint64_t>(RoundingKind::kStochastic);
  GroupByStripe(ids, n, &hashes, &order, &starts);
  for (uint32_t s = 0; s < kStripes; ++s) {
    const uint32_t begin = starts[s], end = starts[s + 1];
    if (begin == end) continue;
    Stripe& stripe = stripes_[s];
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    // Find (or admit and create) each id's record; `kept` holds the
    // positions that have one, `recs` their records (cold_at: or their
    // cold copies').
    recs.clear();
    kept.clear();
    made.clear();
    unmade.clear();
    cold_at.clear();
    cold_slots.clear();
    cold_records.clear();
    cold_generations.clear();
    if (admitting) {
      size_t cap = 16;
      while (cap < 2 * size_t{end - begin}) cap <<= 1;
      counted.assign(cap + 1, 0);  // (+1: whether a hash of 0 was seen)
    }
    // Cold rows are read one at a time: the pull before a push just read
    // them (in parallel), so these are page-cache reads. Whether RAM is
    // near its limit is read once: an id twice in the push must get the
    // same answer both times, or it would be updated in both tiers.
    const bool cold_rows = stripe.tier && stripe.tier->rows() != 0;
    const bool near_limit = cold_rows && NearRamLimit();
    uint64_t admitted = 0, refused = 0;
    // Removes the rows in `unmade`, made by this push and never updated:
    // no reader saw them (the lock is held throughout), so no removal is
    // logged; a change log that noted them as made finds them absent (a
    // standby is sent a removal of a row it never had). `admitted` counts
    // the rows that stay.
    auto unmake = [&] {
      if (unmade.empty()) return;
      stripe.EraseKeys(unmade, /*log=*/false, 0);
      rows_.fetch_sub(static_cast<int64_t>(unmade.size()), std::memory_order_relaxed);
      admitted -= unmade.size();
    };
    // Every row made so far (the push fails: it changes nothing).
    auto unmake_all = [&] {
      unmade.clear();
      for (size_t i = 0; i < kept.size(); ++i) {
        if (made[i]) unmade.push_back(ids[kept[i]]);
      }
      unmake();
    };
    stripe.PrefetchFirstSlots(hashes.data(), order.data(), begin, end);
    for (uint32_t k = begin; k < end; ++k) {
      if (k + kProbeAhead < end) stripe.PrefetchSlot(hashes[order[k + kProbeAhead]]);
      const uint32_t pos = order[k];
      uint32_t rec = stripe.Find(hashes[pos], ids[pos]);
      if (rec == kEmpty && cold_rows) {
        // A cold row moves into RAM, or is updated where it lies.
        char* const cold = ScratchRecord();
        uint32_t slot;
        uint16_t generation;
        Status found = FindCold(&stripe, hashes[pos], ids[pos], cold, &slot, &generation);
        if (found.ok() && slot != TierFile::kNoSlot) {
          if (!WorthRam(stripe, cold, slot, near_limit)) {
            kept.push_back(pos);
            made.push_back(0);
            recs.push_back(kEmpty);
            cold_at.push_back(static_cast<uint32_t>(cold_slots.size()));
            cold_slots.push_back(slot);
            cold_generations.push_back(generation);
            cold_records.insert(cold_records.end(), cold, cold + record_bytes_);
            continue;
          }
          found = MoveIn(&stripe, hashes[pos], ids[pos], cold, slot, generation, &rec);
        }
        if (!found.ok()) {
          unmake_all();
          return found;
        }
      }
      const bool make = rec == kEmpty;
      if (make) {
        bool repeat = false;
        if (!AdmitOnPush(&stripe, hashes[pos], ids[pos], &counted, &repeat)) {
          refused += repeat ? 0 : 1;
          continue;
        }
        rec = FindOrCreate(&stripe, hashes[pos], ids[pos]);
        if (rec == kEmpty) {
          unmake_all();
          return ResourceExhausted("table '" + config_.name +
                                   "' cannot grow: out of address space");
        }
        ++admitted;
      }
      kept.push_back(pos);
      made.push_back(make);
      recs.push_back(rec);
      cold_at.push_back(kEmpty);
    }
    if (refused) refused_.fetch_add(refused, std::memory_order_relaxed);
    const uint32_t count = static_cast<uint32_t>(kept.size());
    // Deduplicate by record (a cold row: by its tier slot): slot_of maps a
    // hash slot to an index in firsts.
    auto row_key = [&](uint32_t k) {
      return cold_at[k] == kEmpty ? uint64_t{recs[k]}
                                  : (uint64_t{1} << 32) | cold_slots[cold_at[k]];
    };
    size_t cap = 16;
    while (cap < 2 * size_t{count}) cap <<= 1;
    slot_of.assign(cap, kEmpty);
    firsts.clear();
    bool duplicates = false;
    unique_of.resize(count);
    for (uint32_t k = 0; k < count; ++k) {
      const uint64_t key = row_key(k);
      size_t i = static_cast<size_t>(key * 0x9e3779b1u) & (cap - 1);
      while (slot_of[i] != kEmpty && row_key(firsts[slot_of[i]]) != key) {
        i = (i + 1) & (cap - 1);
      }
      if (slot_of[i] == kEmpty) {
        slot_of[i] = static_cast<uint32_t>(firsts.size());
        firsts.push_back(k);
      } else {
        duplicates = true;
      }
      unique_of[k] = slot_of[i];
    }
    if (duplicates) {
      sums.Sum(
          count, firsts.size(), dim, keep_squares, [&](size_t k) { return unique_of[k]; },
          [&](size_t k) { return grads + size_t{kept[k]} * dim; });
    }
    // Each row's update is computed into scratch and checked before it is
    // written: one that would leave a non-finite value (optimizer state
    // grown too large for the gradient) leaves that row as it was.
    const auto generation = static_cast<uint16_t>(generation_.load(std::memory_order_relaxed));
    const size_t touched_bytes = record_bytes_;
    row.resize(row_floats);
    auto record_of = [&](uint32_t k) {
      return cold_at[k] == kEmpty ? stripe.Record(recs[k], record_bytes_)
                                  : cold_records.data() + size_t{cold_at[k]} * record_bytes_;
    };
    // Cold rows first, each rewritten where it lies: a write that fails
    // puts back those written before it and its own (a slot across a 4 KiB
    // boundary may be half written), so the push has changed none of this
    // stripe's rows, in RAM or on disk; then the RAM rows.
    cold_before.assign(cold_records.begin(), cold_records.end());
    rewritten.clear();
    auto put_back = [&](const Status& failed) {
      size_t left = 0;  // rows that could not be put back either
      for (const uint32_t k : rewritten) {
        const uint32_t c = cold_at[k];
        const Status s = stripe.tier->Rewrite(cold_slots[c], ids[kept[k]],
                                              cold_before.data() + size_t{c} * record_bytes_,
                                              cold_generations[c]);
        left += !s.ok();
      }
      const std::string what =
          left == 0 ? "; none of the push's rows in this stripe (of " + std::to_string(kStripes) +
                          ") or after it was applied"
                    : "; " + std::to_string(left) +
                          " rows on disk may be left part written (putting them back failed too)";
      return Status(failed.code(), "push to table '" + config_.name + "': " + failed.message() +
                                       what + ", those of the stripes before it were");
    };
    for (int pass = cold_slots.empty() ? 1 : 0; pass < 2; ++pass) {
      const bool cold_pass = pass == 0;
      for (size_t u = 0; u < firsts.size(); ++u) {
        const uint32_t k = firsts[u];
        if ((cold_at[k] != kEmpty) != cold_pass) continue;
        if (u + kApplyAhead < firsts.size()) {  // the record and gradient a few rows ahead
          const uint32_t ahead = firsts[u + kApplyAhead];
          const char* next = record_of(ahead);
          PrefetchBytes<1>(next, touched_bytes);
          if (!duplicates || sums.Summed(u + kApplyAhead) == nullptr) {
            const char* g = reinterpret_cast<const char*>(grads + size_t{kept[ahead]} * dim);
            PrefetchBytes(g, sizeof(float) * dim);
          }
        }
        const float* summed = duplicates ? sums.Summed(u) : nullptr;
        if (summed != nullptr && !WithinLimit(summed, dim, limit)) {
          if (summed_past == kNoOverflow) summed_past = ids[kept[k]];
          if (made[k]) unmade.push_back(ids[kept[k]]);
          continue;
        }
        const float* g = summed != nullptr ? summed : grads + size_t{kept[k]} * dim;
        char* r = record_of(k);
        auto* header = reinterpret_cast<RowHeader*>(r);
        // float32 rows are updated in place, their old values kept aside;
        // 16-bit rows are widened into scratch and stored back.
        float* v = wide_ ? reinterpret_cast<float*>(r + sizeof(RowHeader)) : row.data();
        if (wide_) {
          std::memcpy(row.data(), v, sizeof(float) * row_floats);
        } else {
          ReadValues(r, v);
          ReadSlots(r, v + dim);
        }
        uint32_t step = header->step;
        const float* sq = summed != nullptr ? sums.Squares(u) : nullptr;
        if (!ApplyRow(config_.optimizer, dim, lr, g, sq, v, v + dim, &step)) {
          if (wide_) std::memcpy(v, row.data(), sizeof(float) * row_floats);
          if (overflowed == kNoOverflow) overflowed = ids[kept[k]];
          if (made[k]) unmade.push_back(ids[kept[k]]);
          continue;
        }
        header->touched = now;
        header->step = step;
        NoteChange(&stripe, ids[kept[k]]);
        if (!wide_) WriteRow(r, ids[kept[k]], step, v, v + dim, stochastic);
        if (!cold_pass) {
          stripe.Generation(recs[k]) = generation;
          continue;
        }
        rewritten.push_back(k);
        const Status written =
            stripe.tier->Rewrite(cold_slots[cold_at[k]], ids[kept[k]], r, generation);
        if (!written.ok()) {
          const Status failed = put_back(written);
          NoteTierError(failed.message());
          // The rows it made are in RAM, not yet updated (the RAM pass
          // comes after this one): gone again, as the push changed nothing.
          unmake_all();
          return failed;
        }
      }
    }
    disk_updates_.fetch_add(rewritten.size(), std::memory_order_relaxed);
    unmake();
    if (admitted) admitted_.fetch_add(admitted, std::memory_order_relaxed);
    if (admitted && config_.policy.max_rows && !stripe.tier) EvictFrom(&stripe, now);
  }
  if (summed_past != kNoOverflow) {
    return InvalidArgument("push to table '" + config_.name + "': the gradients of id " +
                           std::to_string(summed_past) +
                           ", repeated in the push, sum past the limit a gradient may reach (|g| "
                           "<= " +
                           ShortFloat(limit) +
                           "); that row was left as it was, the push's "
                           "other rows were applied");
  }
  if (overflowed != kNoOverflow) {
    return InvalidArgument("push to table '" + config_.name + "': the update of id " +
                           std::to_string(overflowed) +
                           " would make its row non-finite (its optimizer state cannot take this "
                           "gradient); that row was left as it was, the push's other rows were "
                           "applied");
  }
  return OkStatus();
}

Status Table::Assign(const int64_t* ids, const float* values, size_t n) {
  const size_t bad = FirstNonFinite(values, n * config_.dim);
  if (bad < n * config_.dim) {
    return InvalidArgument("row " + std::to_string(bad / config_.dim) + " (id " +
                           std::to_string(ids[bad / config_.dim]) +
                           ") holds a non-finite value; nothing assigned");
  }
  return Import(ids, values, nullptr, nullptr, n, nullptr, /*to_disk=*/false);
}

size_t Table::slot_bytes() const {
  return size_t{DtypeBytes(config_.policy.slot_dtype)} * slot_floats_;
}

Status Table::Import(const int64_t* ids, const float* values, const float* slots,
                     const uint32_t* steps, size_t n, const uint32_t* touched, bool to_disk,
                     bool evict) {
  return ImportRows(ids, values, slots, steps, n, touched, to_disk, /*stored=*/false, evict);
}

Status Table::ImportStored(const int64_t* ids, const void* values, const void* slots,
                           const uint32_t* steps, size_t n, const uint32_t* touched, bool evict) {
  return ImportRows(ids, values, slots, steps, n, touched, /*to_disk=*/true, /*stored=*/true,
                    evict);
}

Status Table::ImportRows(const int64_t* ids, const void* values, const void* slots,
                         const uint32_t* steps, size_t n, const uint32_t* touched, bool to_disk,
                         bool stored, bool evict) {
  imports_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t value_dtype = stored ? config_.policy.value_dtype : 0;
  const uint64_t slot_dtype = stored ? config_.policy.slot_dtype : 0;
  const size_t bad = FirstNonFiniteStored(values, value_dtype, n * config_.dim);
  if (bad < n * config_.dim) {
    return InvalidArgument("row " + std::to_string(bad / config_.dim) + " (id " +
                           std::to_string(ids[bad / config_.dim]) +
                           ") holds a non-finite value; nothing imported");
  }
  if (slots != nullptr && slot_floats_ > 0) {
    const size_t bad_slot = FirstNonFiniteStored(slots, slot_dtype, n * slot_floats_);
    if (bad_slot < n * slot_floats_) {
      return InvalidArgument("optimizer slots of row " + std::to_string(bad_slot / slot_floats_) +
                             " (id " + std::to_string(ids[bad_slot / slot_floats_]) +
                             ") hold a non-finite value; nothing imported");
    }
  }
  // Scratch of this thread, named once (each use of a thread_local in a
  // shared library is a call).
  thread_local std::vector<uint64_t> tls_hashes;
  thread_local std::vector<uint32_t> tls_order, tls_starts;
  thread_local std::vector<float> tls_fresh_slots;
  std::vector<uint64_t>& hashes = tls_hashes;
  std::vector<uint32_t>& order = tls_order;
  std::vector<uint32_t>& starts = tls_starts;
  std::vector<float>& fresh_slots = tls_fresh_slots;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  const uint32_t dim = config_.dim;
  const uint32_t now = Now();
  fresh_slots.resize(slot_floats_);
  InitializeSlots(config_.optimizer, dim, fresh_slots.data());
  // A row's values and slots as given: floats, or bytes as stored.
  const size_t value_stride = stored ? value_bytes_ : sizeof(float) * dim;
  const size_t slot_stride = stored ? slot_bytes() : sizeof(float) * slot_floats_;
  thread_local std::vector<char> tls_fresh_stored;
  std::vector<char>& fresh_stored = tls_fresh_stored;
  if (stored) {
    fresh_stored.resize(slot_stride + 1);  // (+1: never empty, data() never null)
    StoreValues(fresh_slots.data(), config_.policy.slot_dtype, /*stochastic=*/false, 0,
                slot_floats_, fresh_stored.data());
  }
  const char* fresh_row_slots =
      stored ? fresh_stored.data() : reinterpret_cast<const char*>(fresh_slots.data());
  // Writes row `pos`'s values and slots into record `r` (its header set).
  auto write_row = [&](char* r, uint32_t pos) {
    const char* v = static_cast<const char*>(values) + size_t{pos} * value_stride;
    const char* sl =
        slots ? static_cast<const char*>(slots) + size_t{pos} * slot_stride : fresh_row_slots;
    if (stored) {
      std::memcpy(r + sizeof(RowHeader), v, value_bytes_);
      std::memcpy(r + sizeof(RowHeader) + value_bytes_, sl, slot_stride);
      return;
    }
    WriteRow(r, ids[pos], reinterpret_cast<const RowHeader*>(r)->step,
             reinterpret_cast<const float*>(v), reinterpret_cast<const float*>(sl),
             /*stochastic=*/false);
  };
  // Rows bound for a stripe's disk tier, written at the end of the stripe in
  // one batch (PutBatch): rows of a checkpoint come in bucket order, which
  // the tier's pages follow, so the batch is about one sequential write.
  thread_local std::vector<uint64_t> tls_cold_hashes;
  thread_local std::vector<int64_t> tls_cold_keys;
  thread_local std::vector<char> tls_cold_records;
  thread_local std::vector<uint16_t> tls_cold_generations;
  thread_local Deduper tls_cold_dedup;
  thread_local std::vector<uint32_t> tls_cold_last;
  thread_local std::vector<int64_t> tls_ram_after_cold;
  std::vector<uint64_t>& cold_hashes = tls_cold_hashes;
  std::vector<int64_t>& cold_keys = tls_cold_keys;
  std::vector<char>& cold_records = tls_cold_records;
  std::vector<uint16_t>& cold_generations = tls_cold_generations;
  Deduper& cold_dedup = tls_cold_dedup;
  std::vector<uint32_t>& cold_last = tls_cold_last;
  // Ids given a new RAM row while the stripe's batch for disk was not
  // empty: an id twice in the call may have gone to the batch first.
  std::vector<int64_t>& ram_after_cold = tls_ram_after_cold;
  char* const cold = ScratchRecord();
  thread_local std::vector<char> tls_cold_before;
  std::vector<char>& cold_before = tls_cold_before;
  // During a hot load (only with a tier: every stripe has a file), the rows
  // that go to RAM (the others to disk).
  const HotFloor hot = to_disk && has_tier() ? HotLoadFloor(steps, touched, n, now) : HotFloor();
  const bool hot_load = hot.active;
  auto colder_than_floor = [&](uint32_t pos) {
    return hot_load &&
           !hot.Admits(ScoreOf(steps ? steps[pos] : 0, touched ? touched[pos] : now, now),
                       hashes[pos]);
  };
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    Stripe& stripe = stripes_[s];
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    bool inserted = false;
    const auto generation = static_cast<uint16_t>(generation_.load(std::memory_order_relaxed));
    cold_hashes.clear();
    cold_keys.clear();
    cold_records.clear();
    cold_generations.clear();
    ram_after_cold.clear();
    const uint32_t end = starts[s + 1];
    for (uint32_t k = starts[s]; k < end; ++k) {
      // The index probe some ids ahead, and the record of a row a few ahead
      // (a probe only: an insert before it is found again below). Past
      // RAM's share (rows bound for disk, mostly new) the fingerprints of
      // their cold copies instead of a record; during a hot load, both.
      const bool ram_full = stripe.tier && to_disk && RamFull(stripe);
      if (k + kProbeAhead < end) {
        const uint64_t ahead = hashes[order[k + kProbeAhead]];
        stripe.PrefetchSlot(ahead);
        if (ram_full || hot_load) stripe.tier->PrefetchFingerprints(ahead);
      }
      if (k + kCopyAhead < end && !ram_full) {
        const uint32_t ahead = order[k + kCopyAhead];
        const uint32_t next = stripe.Find(hashes[ahead], ids[ahead]);
        if (next != kEmpty) {
          const char* r = stripe.Record(next, record_bytes_);
          PrefetchBytes<1>(r, record_bytes_);
        }
      }
      const uint32_t pos = order[k];
      uint32_t rec = stripe.Find(hashes[pos], ids[pos]);
      if (rec == kEmpty && (ram_full || colder_than_floor(pos))) {
        // RAM is full (a load past the budget), or a hot load keeps it for
        // hotter rows: the row goes to disk, over its cold copy if it has
        // one.
        uint32_t slot = TierFile::kNoSlot;
        uint16_t old_generation;
        DLT_RETURN_IF_ERROR(stripe.tier->Find(hashes[pos], ids[pos], cold, &slot, &old_generation));
        // The copy on disk as it was: a rewrite that fails puts it back (a
        // slot across a 4 KiB boundary may be half written).
        if (slot != TierFile::kNoSlot) cold_before.assign(cold, cold + record_bytes_);
        auto* cold_header = reinterpret_cast<RowHeader*>(cold);
        cold_header->step = steps ? steps[pos] : 0;
        cold_header->touched = touched ? touched[pos] : now;
        write_row(cold, pos);
        if (slot != TierFile::kNoSlot) {
          const Status written = stripe.tier->Rewrite(slot, ids[pos], cold, generation);
          if (!written.ok()) {
            const bool restored =
                stripe.tier->Rewrite(slot, ids[pos], cold_before.data(), old_generation).ok();
            const Status failed(
                written.code(),
                "import into table '" + config_.name + "': " + written.message() + "; row (id " +
                    std::to_string(ids[pos]) + ") on disk " +
                    (restored ? "left as it was"
                              : "may be left part written (putting it back "
                                "failed too)") +
                    "; the import stopped there, its other rows imported in part (importing "
                    "them again is safe)");
            NoteTierError(failed.message());
            return failed;
          }
          NoteChange(&stripe, ids[pos]);
          continue;
        }
        NoteChange(&stripe, ids[pos]);
        // Into the batch (an id twice in one call: its last row wins, below).
        cold_hashes.push_back(hashes[pos]);
        cold_keys.push_back(ids[pos]);
        cold_generations.push_back(generation);
        cold_records.insert(cold_records.end(), cold, cold + record_bytes_);
        continue;
      }
      if (rec == kEmpty && stripe.tier) {
        DLT_RETURN_IF_ERROR(Promote(&stripe, hashes[pos], ids[pos], &rec));
      }
      if (rec == kEmpty) {
        rec = stripe.Insert(hashes[pos], ids[pos], record_bytes_);
        if (rec == kEmpty) {
          return ResourceExhausted("table '" + config_.name +
                                   "' cannot grow: out of address space");
        }
        rows_.fetch_add(1, std::memory_order_relaxed);
        inserted = true;
        if (!cold_keys.empty()) ram_after_cold.push_back(ids[pos]);
      }
      char* r = stripe.Record(rec, record_bytes_);
      auto* header = reinterpret_cast<RowHeader*>(r);
      header->step = steps ? steps[pos] : 0;
      header->touched = touched ? touched[pos] : now;
      stripe.Generation(rec) = generation;
      NoteChange(&stripe, ids[pos]);
      write_row(r, pos);
    }
    if (!cold_keys.empty()) {
      // Each id once, with the row of its last occurrence, in the order of
      // their first; none that a later occurrence put in RAM (a hot load's
      // row above the floor, or RAM with room again), so a row lies in one
      // tier only. (A row in RAM first takes every later occurrence.)
      constexpr uint32_t kInRam = 0xffffffffu;
      const size_t batched = cold_keys.size();
      bool compact = false;
      cold_last.clear();
      cold_keys.insert(cold_keys.end(), ram_after_cold.begin(), ram_after_cold.end());
      cold_dedup.Visit(
          cold_keys.data(), cold_keys.size(),
          [&](size_t i, uint64_t, uint32_t) {
            // An id only in RAM comes after every batched one: left out below.
            cold_last.push_back(i < batched ? static_cast<uint32_t>(i) : kInRam);
          },
          [&](size_t i, uint32_t u) {
            cold_last[u] = i < batched ? static_cast<uint32_t>(i) : kInRam;
            compact = true;
          });
      cold_keys.resize(batched);
      if (compact) {
        size_t kept = 0;
        for (const uint32_t i : cold_last) {
          if (i == kInRam) continue;
          if (i != kept) {
            cold_hashes[kept] = cold_hashes[i];
            cold_keys[kept] = cold_keys[i];
            cold_generations[kept] = cold_generations[i];
            std::memmove(cold_records.data() + kept * record_bytes_,
                         cold_records.data() + size_t{i} * record_bytes_, record_bytes_);
          }
          ++kept;
        }
        cold_hashes.resize(kept);
        cold_keys.resize(kept);
        cold_generations.resize(kept);
        cold_records.resize(kept * record_bytes_);
      }
      DLT_RETURN_IF_ERROR(stripe.tier->PutBatch(cold_keys.size(), cold_hashes.data(),
                                                cold_keys.data(), cold_records.data(),
                                                cold_generations.data()));
      rows_.fetch_add(cold_keys.size(), std::memory_order_relaxed);
      cold_rows_.fetch_add(cold_keys.size(), std::memory_order_relaxed);
    }
    if (inserted && config_.policy.max_rows && !stripe.tier && evict) {
      EvictFrom(&stripe, now);
    }
  }
  return OkStatus();
}

size_t Table::size() const {
  const int64_t rows = rows_.load(std::memory_order_relaxed);
  return rows < 0 ? 0 : static_cast<size_t>(rows);
}

size_t Table::bytes() const { return RamBytes(/*fixed_only=*/false); }

TableCounters Table::counters() const {
  TableCounters c;
  c.admitted = admitted_.load(std::memory_order_relaxed);
  c.refused = refused_.load(std::memory_order_relaxed);
  c.expired = expired_.load(std::memory_order_relaxed);
  c.evicted = evicted_.load(std::memory_order_relaxed);
  c.shrunk = shrunk_.load(std::memory_order_relaxed);
  return c;
}

void Table::KeepPagesSmall() {
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
    stripes_[s].huge_from = kFrugalHugeChunk;
  }
}

void Table::Reserve(size_t rows, uint32_t threads) {
  // A stripe's share of `n` rows spread over the buckets, with a margin
  // (rows, at most kMarginBytes of them in a tiered table: 64 rows of dim
  // 4,096 with Adagrad a stripe were 128 MiB faulted in past the budget).
  const uint64_t margin = has_tier() ? TierMarginRows(64) : 64;
  auto per_stripe_of = [margin](uint64_t n) { return n / kStripes + n / (kStripes * 16) + margin; };
  const uint64_t limit = ram_limit_.load(std::memory_order_relaxed);
  if (has_tier() && limit != 0 && rows > limit) {
    // The rows past the RAM limit go to disk: size the tier files for them.
    // The tier's RAM per cold slot comes out of the RAM rows' limit (twice:
    // fewer RAM rows make more cold ones), counted as the memory keeper will
    // count it once the rows are in (at its doubled size near a doubling),
    // so the rows a load leaves in RAM are not moved to disk after it.
    auto cold_per_stripe = [&](uint64_t ram_rows) { return per_stripe_of(rows - ram_rows); };
    uint64_t ram_rows = limit;
    for (int pass = 0; pass < 2; ++pass) {
      uint64_t tier_bytes = 0;
      for (uint32_t s = 0; s < kStripes; ++s) {
        std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
        tier_bytes += stripes_[s].tier->RamBytesFor(cold_per_stripe(ram_rows), /*ahead=*/true);
      }
      const uint64_t held = tier_bytes / ram_row_bytes();
      // Never above the limit given; a floor of a few rows per stripe.
      ram_rows = std::max<uint64_t>(std::min<uint64_t>(limit, kStripes * margin),
                                    limit > held ? limit - held : 0);
    }
    SetRamLimit(ram_rows);
    const size_t cold = cold_per_stripe(ram_rows);
    for (uint32_t s = 0; s < kStripes; ++s) {
      std::unique_lock<std::shared_mutex> lock(stripes_[s].mu);
      stripes_[s].tier->Reserve(cold);
    }
    rows = ram_rows;
  }
  const size_t per_stripe = per_stripe_of(rows);
  std::atomic<uint32_t> next{0};
  auto work = [&]() {
    for (uint32_t s; (s = next.fetch_add(1)) < kStripes;) {
      Stripe& stripe = stripes_[s];
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      size_t capacity = std::max<size_t>(16, stripe.index.size());
      while (IndexMustGrow(per_stripe, capacity)) capacity *= 2;
      if (capacity > stripe.index.size()) stripe.GrowTo(capacity);  // writes every slot
      const uint32_t first_new = stripe.num_chunks;
      while (stripe.num_chunks < kMaxChunks &&
             Stripe::FirstRecordOf(stripe.num_chunks) < per_stripe) {
        if (!stripe.AddChunk(record_bytes_)) break;
      }
      // Fault in now, a page at a time, the new memory the expected rows
      // will use (not the rest of the last chunk, which may be as large).
      for (uint32_t k = first_new; k < stripe.num_chunks; ++k) {
        const size_t first_record = Stripe::FirstRecordOf(k);
        if (first_record >= per_stripe) break;
        const size_t used =
            std::min(stripe.chunk_bytes[k], (per_stripe - first_record) * record_bytes_);
        for (size_t b = 0; b < used; b += 4096) stripe.chunks[k][b] = 0;
        stripe.faulted = static_cast<uint32_t>(
            std::max<size_t>(stripe.faulted, first_record + used / record_bytes_));
      }
    }
  };
  // Sizing is best effort: a stripe that cannot get the memory (or a
  // thread that cannot start) leaves the rest to grow as rows arrive.
  auto guarded = [&]() {
    try {
      work();
    } catch (const std::exception&) {
    }
  };
  std::vector<std::thread> pool;
  for (uint32_t t = 1; t < std::max<uint32_t>(1, threads); ++t) {
    try {
      pool.emplace_back(guarded);
    } catch (const std::exception&) {
      break;
    }
  }
  guarded();
  for (std::thread& t : pool) t.join();
}

}  // namespace dlt
