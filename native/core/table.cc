#include "native/core/table.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "native/core/finite.h"
#include "native/core/initializer.h"
#include "native/core/optimizer.h"

namespace dlt {
namespace {

constexpr uint32_t kEmpty = 0xffffffffu;
// Records in the first arena chunk of a stripe; chunk k holds kBase << k.
constexpr uint32_t kBaseRecordsLog2 = 6;
constexpr uint32_t kMaxChunks = 32;
constexpr size_t kHugePage = size_t{2} << 20;
// Prefetch distances (in ids) of the batched lookup's index probes and row copies.
constexpr uint32_t kProbeAhead = 32;
constexpr uint32_t kCopyAhead = 8;
// Rows ahead whose record and gradient a push prefetches.
constexpr uint32_t kApplyAhead = 2;

struct RowHeader {
  int64_t id;
  uint32_t step;
  uint32_t reserved;
};
static_assert(sizeof(RowHeader) == 16, "row header layout");

struct IndexEntry {
  int64_t key;
  uint32_t record;
  uint32_t reserved;
};

inline size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

// Allocator of the index: blocks of 2 MiB and more come from mmap with
// MADV_HUGEPAGE, so a probe of a large index misses the TLB far less (with
// THP in "madvise" mode malloc'd memory stays on 4 KiB pages).
template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT: rebinding

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return std::allocator<T>().allocate(n);
    void* p = mmap(nullptr, RoundUp(bytes, 4096), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, RoundUp(bytes, 4096), MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) {
      std::allocator<T>().deallocate(p, n);
    } else {
      munmap(p, RoundUp(bytes, 4096));
    }
  }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const {
    return false;
  }
};

using Index = std::vector<IndexEntry, HugePageAllocator<IndexEntry>>;

}  // namespace

// One stripe: lock, index and arena. Records are never moved or freed while
// the table lives, so a record number stays valid across index growth.
struct Table::Stripe {
  mutable std::shared_mutex mu;
  Index index;  // capacity is a power of two (or empty)
  uint32_t num_records = 0;
  char* chunks[kMaxChunks] = {};
  size_t chunk_bytes[kMaxChunks] = {};
  uint32_t num_chunks = 0;

  ~Stripe() {
    for (uint32_t k = 0; k < num_chunks; ++k) munmap(chunks[k], chunk_bytes[k]);
  }

  static uint32_t ChunkOf(uint32_t record, uint32_t* offset) {
    const uint32_t q = (record >> kBaseRecordsLog2) + 1;
    const uint32_t k = 31 - static_cast<uint32_t>(__builtin_clz(q));
    *offset = record - (((1u << k) - 1) << kBaseRecordsLog2);
    return k;
  }

  char* Record(uint32_t record, size_t record_bytes) const {
    uint32_t offset;
    const uint32_t k = ChunkOf(record, &offset);
    return chunks[k] + static_cast<size_t>(offset) * record_bytes;
  }

  void PrefetchSlot(uint64_t hash) const {
    if (!index.empty()) __builtin_prefetch(&index[(hash >> 12) & (index.size() - 1)]);
  }

  // Looks `key` up; returns its record or kEmpty. Caller holds mu (any mode).
  uint32_t Find(uint64_t hash, int64_t key) const {
    if (index.empty()) return kEmpty;
    const size_t mask = index.size() - 1;
    for (size_t i = (hash >> 12) & mask;; i = (i + 1) & mask) {
      const IndexEntry& e = index[i];
      if (e.record == kEmpty) return kEmpty;
      if (e.key == key) return e.record;
    }
  }

  void Grow() {
    const size_t capacity = index.empty() ? 16 : index.size() * 2;
    Index next(capacity, IndexEntry{0, kEmpty, 0});
    const size_t mask = capacity - 1;
    for (const IndexEntry& e : index) {
      if (e.record == kEmpty) continue;
      size_t i = (Mix64(static_cast<uint64_t>(e.key)) >> 12) & mask;
      while (next[i].record != kEmpty) i = (i + 1) & mask;
      next[i] = e;
    }
    index.swap(next);
  }

  // Appends a record for `key`; caller holds mu exclusively and has checked
  // the key is absent. Returns the record, or kEmpty when memory ran out.
  uint32_t Insert(uint64_t hash, int64_t key, size_t record_bytes) {
    if (num_records >= kEmpty - 1) return kEmpty;  // record numbers are 32-bit
    if (IndexMustGrow(num_records, index.size())) Grow();
    uint32_t offset;
    const uint32_t k = ChunkOf(num_records, &offset);
    if (k >= num_chunks) {
      if (k >= kMaxChunks) return kEmpty;
      const size_t bytes = RoundUp((size_t{1} << (k + kBaseRecordsLog2)) * record_bytes, 4096);
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) return kEmpty;
      if (bytes >= kHugePage) madvise(p, bytes, MADV_HUGEPAGE);
      chunks[k] = static_cast<char*>(p);
      chunk_bytes[k] = bytes;
      num_chunks = k + 1;
    }
    const size_t mask = index.size() - 1;
    size_t i = (hash >> 12) & mask;
    while (index[i].record != kEmpty) i = (i + 1) & mask;
    index[i] = IndexEntry{key, num_records, 0};
    return num_records++;
  }
};

Table::Table(const TableConfig& config)
    : config_(config),
      slot_floats_(SlotsPerValue(config.optimizer.kind) * config.dim),
      record_bytes_(RoundUp(sizeof(RowHeader) + sizeof(float) * (config.dim + slot_floats_), 8)),
      stripes_(new Stripe[kStripes]) {}

Table::~Table() = default;

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
  char* r = stripe->Record(rec, record_bytes_);
  auto* header = reinterpret_cast<RowHeader*>(r);
  header->id = id;
  header->step = 0;
  header->reserved = 0;
  float* values = reinterpret_cast<float*>(r + sizeof(RowHeader));
  InitializeRow(config_.initializer, config_.seed, id, config_.dim, values);
  InitializeSlots(config_.optimizer, config_.dim, values + config_.dim);
  return rec;
}

void Table::Pull(const int64_t* ids, size_t n, PullMode mode, float* out) {
  thread_local std::vector<uint64_t> hashes;
  thread_local std::vector<uint32_t> order, starts, missing, recs;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  const uint32_t dim = config_.dim;
  const size_t row_bytes = sizeof(float) * dim;
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    Stripe& stripe = stripes_[s];
    missing.clear();
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      // Three stages a few ids apart, so the cache misses of the index
      // probe, the record read and the output write overlap.
      const uint32_t begin = starts[s], end = starts[s + 1];
      recs.resize(end - begin);
      for (uint32_t k = begin; k < end; ++k) {
        if (k + kProbeAhead < end) stripe.PrefetchSlot(hashes[order[k + kProbeAhead]]);
        const uint32_t pos = order[k];
        const uint32_t rec = stripe.Find(hashes[pos], ids[pos]);
        recs[k - begin] = rec;
        if (rec != kEmpty)
          __builtin_prefetch(stripe.Record(rec, record_bytes_) + sizeof(RowHeader));
      }
      for (uint32_t k = begin; k < end; ++k) {
        if (k + kCopyAhead < end && recs[k + kCopyAhead - begin] != kEmpty) {
          const char* next = stripe.Record(recs[k + kCopyAhead - begin], record_bytes_);
          for (size_t b = 0; b < sizeof(RowHeader) + row_bytes; b += 64)
            __builtin_prefetch(next + b);
        }
        const uint32_t pos = order[k];
        const uint32_t rec = recs[k - begin];
        if (rec == kEmpty) {
          missing.push_back(pos);
          continue;
        }
        std::memcpy(out + size_t{pos} * dim, stripe.Record(rec, record_bytes_) + sizeof(RowHeader),
                    row_bytes);
      }
    }
    if (missing.empty()) continue;
    if (mode == PullMode::kZerosNoInsert) {
      for (uint32_t pos : missing) std::memset(out + size_t{pos} * dim, 0, row_bytes);
      continue;
    }
    if (mode == PullMode::kInitNoInsert) {
      for (uint32_t pos : missing) {
        InitializeRow(config_.initializer, config_.seed, ids[pos], dim, out + size_t{pos} * dim);
      }
      continue;
    }
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    for (uint32_t pos : missing) {
      float* dst = out + size_t{pos} * dim;
      const uint32_t rec = FindOrCreate(&stripe, hashes[pos], ids[pos]);
      if (rec == kEmpty) {  // out of address space: serve without storing
        InitializeRow(config_.initializer, config_.seed, ids[pos], dim, dst);
        continue;
      }
      std::memcpy(dst, stripe.Record(rec, record_bytes_) + sizeof(RowHeader), row_bytes);
    }
  }
}

Status Table::Push(const int64_t* ids, const float* grads, size_t n, float lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return InvalidArgument("learning rate must be finite and >= 0, got " + std::to_string(lr));
  }
  if (config_.optimizer.kind == OptimizerKind::kFtrl && !(lr > 0)) {
    return InvalidArgument("ftrl needs a learning rate > 0, got " + std::to_string(lr));
  }
  const uint32_t dim = config_.dim;
  const size_t bad = FirstNonFinite(grads, n * dim);
  if (bad < n * dim) {
    return InvalidArgument("gradient row " + std::to_string(bad / dim) + " (id " +
                           std::to_string(ids[bad / dim]) +
                           ") holds a non-finite value; nothing applied");
  }
  thread_local std::vector<uint64_t> hashes;
  thread_local std::vector<uint32_t> order, starts, recs, slot_of, firsts, unique_of;
  thread_local std::vector<float> summed, squares;
  const bool keep_squares = config_.optimizer.kind == OptimizerKind::kKerasAdagrad;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  for (uint32_t s = 0; s < kStripes; ++s) {
    const uint32_t begin = starts[s], end = starts[s + 1];
    if (begin == end) continue;
    const uint32_t count = end - begin;
    Stripe& stripe = stripes_[s];
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    recs.resize(count);
    for (uint32_t k = 0; k < count; ++k) {
      if (k + kProbeAhead < count) stripe.PrefetchSlot(hashes[order[begin + k + kProbeAhead]]);
      const uint32_t pos = order[begin + k];
      const uint32_t rec = FindOrCreate(&stripe, hashes[pos], ids[pos]);
      if (rec == kEmpty) {
        return ResourceExhausted("table '" + config_.name + "' cannot grow: out of address space");
      }
      recs[k] = rec;
    }
    // Deduplicate by record: slot_of maps a hash slot to an index in firsts.
    size_t cap = 16;
    while (cap < 2 * size_t{count}) cap <<= 1;
    slot_of.assign(cap, kEmpty);
    firsts.clear();
    bool duplicates = false;
    unique_of.resize(count);
    for (uint32_t k = 0; k < count; ++k) {
      size_t i = (size_t{recs[k]} * 0x9e3779b1u) & (cap - 1);
      while (slot_of[i] != kEmpty && recs[firsts[slot_of[i]]] != recs[k]) {
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
      summed.assign(firsts.size() * dim, 0.0f);
      if (keep_squares) squares.assign(firsts.size() * dim, 0.0f);
      for (uint32_t k = 0; k < count; ++k) {
        const float* g = grads + size_t{order[begin + k]} * dim;
        float* acc = summed.data() + size_t{unique_of[k]} * dim;
        for (uint32_t j = 0; j < dim; ++j) acc[j] += g[j];
        if (!keep_squares) continue;
        float* sq = squares.data() + size_t{unique_of[k]} * dim;
        for (uint32_t j = 0; j < dim; ++j) sq[j] += g[j] * g[j];
      }
    }
    const size_t touched_bytes = sizeof(RowHeader) + sizeof(float) * (dim + slot_floats_);
    for (size_t u = 0; u < firsts.size(); ++u) {
      if (u + kApplyAhead < firsts.size()) {  // the record and gradient a few rows ahead
        const uint32_t ahead = firsts[u + kApplyAhead];
        const char* next = stripe.Record(recs[ahead], record_bytes_);
        for (size_t b = 0; b < touched_bytes; b += 64) __builtin_prefetch(next + b, 1);
        if (!duplicates) {
          const char* g = reinterpret_cast<const char*>(grads + size_t{order[begin + ahead]} * dim);
          for (size_t b = 0; b < sizeof(float) * dim; b += 64) __builtin_prefetch(g + b);
        }
      }
      const uint32_t k = firsts[u];
      const float* g =
          duplicates ? summed.data() + u * dim : grads + size_t{order[begin + k]} * dim;
      char* r = stripe.Record(recs[k], record_bytes_);
      auto* header = reinterpret_cast<RowHeader*>(r);
      float* values = reinterpret_cast<float*>(r + sizeof(RowHeader));
      const float* sq = duplicates && keep_squares ? squares.data() + u * dim : nullptr;
      ApplyRow(config_.optimizer, dim, lr, g, sq, values, values + dim, &header->step);
    }
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
  return Import(ids, values, nullptr, nullptr, n);
}

Status Table::Import(const int64_t* ids, const float* values, const float* slots,
                     const uint32_t* steps, size_t n) {
  const size_t bad = FirstNonFinite(values, n * config_.dim);
  if (bad < n * config_.dim) {
    return InvalidArgument("row " + std::to_string(bad / config_.dim) + " (id " +
                           std::to_string(ids[bad / config_.dim]) +
                           ") holds a non-finite value; nothing imported");
  }
  if (slots != nullptr && slot_floats_ > 0) {
    const size_t bad_slot = FirstNonFinite(slots, n * slot_floats_);
    if (bad_slot < n * slot_floats_) {
      return InvalidArgument("optimizer slots of row " + std::to_string(bad_slot / slot_floats_) +
                             " (id " + std::to_string(ids[bad_slot / slot_floats_]) +
                             ") hold a non-finite value; nothing imported");
    }
  }
  thread_local std::vector<uint64_t> hashes;
  thread_local std::vector<uint32_t> order, starts;
  GroupByStripe(ids, n, &hashes, &order, &starts);
  const uint32_t dim = config_.dim;
  for (uint32_t s = 0; s < kStripes; ++s) {
    if (starts[s] == starts[s + 1]) continue;
    Stripe& stripe = stripes_[s];
    std::unique_lock<std::shared_mutex> lock(stripe.mu);
    for (uint32_t k = starts[s]; k < starts[s + 1]; ++k) {
      const uint32_t pos = order[k];
      uint32_t rec = stripe.Find(hashes[pos], ids[pos]);
      if (rec == kEmpty) rec = stripe.Insert(hashes[pos], ids[pos], record_bytes_);
      if (rec == kEmpty) {
        return ResourceExhausted("table '" + config_.name + "' cannot grow: out of address space");
      }
      char* r = stripe.Record(rec, record_bytes_);
      auto* header = reinterpret_cast<RowHeader*>(r);
      header->id = ids[pos];
      header->step = steps ? steps[pos] : 0;
      header->reserved = 0;
      float* row = reinterpret_cast<float*>(r + sizeof(RowHeader));
      std::memcpy(row, values + size_t{pos} * dim, sizeof(float) * dim);
      if (slot_floats_ == 0) continue;
      if (slots) {
        std::memcpy(row + dim, slots + size_t{pos} * slot_floats_, sizeof(float) * slot_floats_);
      } else {
        InitializeSlots(config_.optimizer, dim, row + dim);
      }
    }
  }
  return OkStatus();
}

size_t Table::size() const {
  size_t total = 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    total += stripes_[s].num_records;
  }
  return total;
}

size_t Table::bytes() const {
  size_t total = 0;
  for (uint32_t s = 0; s < kStripes; ++s) {
    std::shared_lock<std::shared_mutex> lock(stripes_[s].mu);
    total += size_t{stripes_[s].num_records} * record_bytes_ +
             stripes_[s].index.size() * sizeof(IndexEntry);
  }
  return total;
}

size_t Table::Exporter::Next(size_t max_rows, const RowBuffers& out) {
  const uint32_t dim = table_->config_.dim;
  const uint32_t slot_floats = table_->slot_floats_;
  const size_t record_bytes = table_->record_bytes_;
  size_t written = 0;
  while (written < max_rows && stripe_ < kStripes) {
    Stripe& stripe = table_->stripes_[stripe_];
    if (!loaded_) {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      order_.resize(stripe.num_records);
      for (uint32_t r = 0; r < stripe.num_records; ++r) {
        const int64_t id = reinterpret_cast<const RowHeader*>(stripe.Record(r, record_bytes))->id;
        order_[r] = Entry{BucketOf(id), r, id};
      }
      lock.unlock();
      std::sort(order_.begin(), order_.end(), [](const Entry& a, const Entry& b) {
        return a.bucket != b.bucket ? a.bucket < b.bucket : a.id < b.id;
      });
      loaded_ = true;
      pos_ = 0;
    }
    {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      for (; pos_ < order_.size() && written < max_rows; ++pos_, ++written) {
        const Entry& e = order_[pos_];
        const char* r = stripe.Record(e.record, record_bytes);
        const auto* header = reinterpret_cast<const RowHeader*>(r);
        const float* row = reinterpret_cast<const float*>(r + sizeof(RowHeader));
        out.ids[written] = e.id;
        out.buckets[written] = e.bucket;
        out.steps[written] = header->step;
        std::memcpy(out.values + written * dim, row, sizeof(float) * dim);
        if (slot_floats) {
          std::memcpy(out.slots + written * slot_floats, row + dim, sizeof(float) * slot_floats);
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
  return written;
}

}  // namespace dlt
