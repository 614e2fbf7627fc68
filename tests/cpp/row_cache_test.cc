// RowCache against a real Table: a trainer's cached rows, with its own pushes
// applied locally, read exactly what the table holds; other writers' pushes
// show once a row is refreshed; the memory bound, admission and eviction.
// The "shards" are one Table in this process.
#include "native/net/row_cache.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "native/core/initializer.h"
#include "native/core/table.h"
#include "tests/cpp/harness.h"

namespace dlt {
namespace {

TableConfig CacheTableConfig(OptimizerKind kind) {
  TableConfig c;
  c.name = "emb";
  c.dim = 4;
  c.optimizer.kind = kind;
  c.initializer.kind = InitializerKind::kUniform;
  c.seed = 3;
  return c;
}

// One lookup of distinct `ids` through `cache`, pulling from `table` as the
// lookup kernel of a trainer does (kStateInsert); returns the rows ([n, dim]).
std::vector<float> CachedLookup(RowCache* cache, Table* table, const std::vector<int64_t>& ids,
                                int64_t now_ms, RowCache::Plan* plan) {
  const uint32_t dim = cache->dim();
  std::vector<float> rows(ids.size() * dim, -1.0f);
  cache->Lookup(ids.data(), ids.size(), now_ms, rows.data(), plan);
  if (!plan->fill.empty()) {
    std::vector<int64_t> fill_ids;
    for (uint32_t p : plan->fill) fill_ids.push_back(ids[p]);
    const uint32_t width = StateFloats(dim, cache->slot_floats());
    std::vector<float> states(fill_ids.size() * width);
    EXPECT_OK(table->Pull(fill_ids.data(), fill_ids.size(), PullMode::kStateInsert, states.data()));
    std::vector<float> filled(fill_ids.size() * dim);
    std::vector<uint32_t> absent;
    cache->Fill(fill_ids.data(), fill_ids.size(), states.data(), now_ms, filled.data(), &absent);
    size_t a = 0;
    for (size_t k = 0; k < plan->fill.size(); ++k) {
      const bool held = !(a < absent.size() && absent[a] == k);
      if (!held) ++a;
      const float* row = held ? &filled[k * dim] : &states[k * width];  // absent: its values
      std::memcpy(&rows[plan->fill[k] * dim], row, sizeof(float) * dim);
    }
  }
  for (uint32_t p : plan->plain) {
    EXPECT_OK(table->Pull(&ids[p], 1, PullMode::kInsert, &rows[p * dim]));
  }
  return rows;
}

RowCacheOptions Options(size_t max_rows, uint32_t steps, uint32_t ms, uint32_t min_count) {
  RowCacheOptions options;
  options.max_rows = max_rows;
  options.max_staleness_steps = steps;
  options.max_staleness_ms = ms;
  options.min_count = min_count;
  return options;
}

std::vector<float> TableRows(Table* table, const std::vector<int64_t>& ids) {
  std::vector<float> rows(ids.size() * table->dim());
  EXPECT_OK(table->Pull(ids.data(), ids.size(), PullMode::kInsert, rows.data()));
  return rows;
}

// Distinct Zipf-like ids: a few hot ones in every batch, a tail that varies.
std::vector<int64_t> Batch(std::mt19937_64* rng) {
  std::vector<int64_t> ids = {1, 2, 3, 4, 5};
  for (int k = 0; k < 6; ++k) ids.push_back(100 + static_cast<int64_t>((*rng)() % 50));
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

DLT_TEST(RowCacheWithOwnPushesReadsExactlyWhatTheTableHolds) {
  for (OptimizerKind kind :
       {OptimizerKind::kSgd, OptimizerKind::kAdagrad, OptimizerKind::kKerasAdagrad,
        OptimizerKind::kAdam, OptimizerKind::kFtrl}) {
    const TableConfig config = CacheTableConfig(kind);
    Table table(config);
    RowCache cache(config.dim, config.optimizer, Options(64, 1000, 0, 2));
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<float> grad(-1.0f, 1.0f);
    size_t hits = 0;
    for (int step = 0; step < 40; ++step) {
      const std::vector<int64_t> ids = Batch(&rng);
      RowCache::Plan plan;
      const std::vector<float> rows = CachedLookup(&cache, &table, ids, 0, &plan);
      hits += plan.hits;
      EXPECT(rows == TableRows(&table, ids));  // bitwise: the same arithmetic
      // Per occurrence, as the Keras layer pushes: repeated ids are summed.
      std::vector<int64_t> pushed = ids;
      pushed.insert(pushed.end(), {ids[0], ids[1], ids[0]});
      std::vector<float> grads(pushed.size() * config.dim);
      for (float& g : grads) g = grad(rng);
      EXPECT_OK(table.Push(pushed.data(), grads.data(), pushed.size(), 0.05f));
      EXPECT_OK(cache.Pushed(pushed.data(), grads.data(), pushed.size(), 0.05f));
    }
    EXPECT(hits > 150);  // the 5 hot ids from the third step on, and part of the tail
    EXPECT(cache.counts().applied > 0 && cache.counts().refreshes == 0);
  }
}

DLT_TEST(RowCacheRefreshesRowsOtherWritersChangedAfterTheStalenessBound) {
  const TableConfig config = CacheTableConfig(OptimizerKind::kAdagrad);
  Table table(config);
  RowCache cache(config.dim, config.optimizer, Options(8, 3, 0, 1));
  const std::vector<int64_t> ids = {10, 11};
  TableRows(&table, ids);  // the rows exist
  RowCache::Plan plan;
  CachedLookup(&cache, &table, ids, 0, &plan);  // lookup 1: pulled and cached
  EXPECT(plan.fill.size() == 2 && plan.hits == 0);
  const std::vector<float> grads(2 * config.dim, 0.5f);
  EXPECT_OK(table.Push(ids.data(), grads.data(), 2, 0.1f));  // another trainer's push
  const std::vector<float> old_rows = CachedLookup(&cache, &table, ids, 0, &plan);  // lookup 2
  EXPECT(plan.hits == 2 && plan.oldest_steps == 1);
  EXPECT(old_rows != TableRows(&table, ids));   // stale, within the bound
  CachedLookup(&cache, &table, ids, 0, &plan);  // lookup 3: 2 lookups old
  EXPECT(plan.hits == 2 && plan.oldest_steps == 2);
  const std::vector<float> fresh = CachedLookup(&cache, &table, ids, 0, &plan);  // 3 old
  EXPECT(plan.hits == 0 && plan.fill.size() == 2);
  EXPECT(fresh == TableRows(&table, ids));
  EXPECT(cache.counts().refreshes == 2 && cache.counts().max_steps == 2);
}

DLT_TEST(RowCacheRefreshesAfterMaxStalenessMs) {
  const TableConfig config = CacheTableConfig(OptimizerKind::kSgd);
  Table table(config);
  RowCache cache(config.dim, config.optimizer, Options(8, 0, 100, 1));
  const std::vector<int64_t> ids = {10};
  TableRows(&table, ids);
  RowCache::Plan plan;
  CachedLookup(&cache, &table, ids, 1000, &plan);
  CachedLookup(&cache, &table, ids, 1099, &plan);
  EXPECT(plan.hits == 1 && plan.oldest_ms == 99);
  CachedLookup(&cache, &table, ids, 1100, &plan);
  EXPECT(plan.hits == 0 && plan.fill.size() == 1);
}

DLT_TEST(RowCacheAdmitsFrequentIdsAndHoldsAtMostMaxRows) {
  const TableConfig config = CacheTableConfig(OptimizerKind::kSgd);
  Table table(config);
  RowCache cache(config.dim, config.optimizer, Options(4, 1000, 0, 2));
  RowCache::Plan plan;
  // Seen once: pulled plainly, not cached.
  CachedLookup(&cache, &table, {1, 2, 3}, 0, &plan);
  EXPECT(plan.plain.size() == 3 && plan.fill.empty() && cache.counts().rows == 0);
  CachedLookup(&cache, &table, {1, 2, 3}, 0, &plan);
  EXPECT(plan.fill.size() == 3 && cache.counts().rows == 3);
  CachedLookup(&cache, &table, {1, 2, 3, 4}, 0, &plan);
  CachedLookup(&cache, &table, {1, 2, 3, 4}, 0, &plan);
  EXPECT(plan.hits == 3 && plan.fill.size() == 1 && cache.counts().rows == 4);
  // Full: a newcomer takes a slot only once it is more frequent than the
  // rarest row sampled (id 4 was looked up twice).
  for (int k = 0; k < 2; ++k) CachedLookup(&cache, &table, {9}, 0, &plan);
  EXPECT(cache.counts().rows == 4 && cache.counts().evictions == 0);
  CachedLookup(&cache, &table, {9}, 0, &plan);
  CachedLookup(&cache, &table, {9}, 0, &plan);
  EXPECT(plan.hits == 1 && cache.counts().rows == 4 && cache.counts().evictions == 1);
}

DLT_TEST(RowCacheSketchRarelyTakesANewIdForARepeatedOne) {
  // A count-min sketch overestimates: an id never seen before looks seen
  // when each of its rows' counters was bumped by others. 2^20 ids seen
  // once, in 4 rows of 2^20 counters, bump about 1 - e^-1 = 63% of each
  // row's counters, so about 0.63^4 = 16% of new ids look seen (16.1%
  // here). A row that reaches only part of its width makes it more: 25.4%
  // when the last row's column came from 16 bits of the hash.
  RowCache cache(8, OptimizerConfig{}, Options(100000, 0, 60000, 2));  // 2^20 counters a row
  RowCache::Plan plan;
  const size_t n = size_t{1} << 20;
  std::vector<int64_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(i) * 7919 + 13;
  std::vector<float> rows(n * 8);
  cache.Lookup(ids.data(), n, 0, rows.data(), &plan);
  size_t misjudged = 0;
  const size_t probes = size_t{1} << 16;
  for (size_t i = 0; i < probes; ++i) {
    misjudged += cache.SketchCount(static_cast<int64_t>(n + i) * 7919 + 13) > 0;
  }
  EXPECT(cache.SketchCount(ids[0]) >= 1 && cache.SketchCount(ids[n - 1]) >= 1);
  EXPECT(misjudged < probes / 5);
}

DLT_TEST(RowCacheFillsNoNewIdsOfACountThatIsRarelyLookedUpAgain) {
  // Every lookup: 4 hot ids, and 200 ids each looked up in two lookups in a
  // row and never again. At min_count 2 every pair id would be filled on its
  // second lookup (a state pull wasted each, 6,000 in lookups 10 to 39);
  // seeing that ids looked up twice are almost never looked up again, the
  // cache fills none of them.
  const TableConfig config = CacheTableConfig(OptimizerKind::kAdagrad);
  Table table(config);
  RowCache cache(config.dim, config.optimizer, Options(100000, 1000, 0, 2));
  RowCache::Plan plan;
  uint64_t late_fills = 0;
  for (int lookup = 0; lookup < 40; ++lookup) {
    std::vector<int64_t> ids = {1, 2, 3, 4};
    if (lookup >= 30) ids.push_back(5);  // hot from lookup 30 on
    for (int k = 0; k < 200; ++k) {
      ids.push_back(1000 + (lookup - 1) * 200 + k);  // the previous lookup's new ids
      ids.push_back(1000 + lookup * 200 + k);        // new ids
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    CachedLookup(&cache, &table, ids, 0, &plan);
    if (lookup >= 10) late_fills += plan.fill.size();
  }
  // (Before any id was looked up a third time, there was no evidence: the
  // first lookup's new ids were filled on their second.) A new hot id is
  // still filled, at the first count that ids mostly pass (3 here).
  EXPECT(late_fills == 1);
  EXPECT(plan.hits == 5 && cache.counts().rows == 5 + 200);
}

DLT_TEST(RowCacheKeepsAnIdLookedUpEveryTimeOverAnyNumberOfLookups) {
  // Counts stop at 255: over thousands of lookups of few ids (the sketch
  // far from full, so never halved for its fill), an id looked up every
  // time must still look worth its refreshes.
  const TableConfig config = CacheTableConfig(OptimizerKind::kSgd);
  Table table(config);
  RowCache cache(config.dim, config.optimizer, Options(64, 16, 0, 2));
  RowCache::Plan plan;
  size_t late_hits = 0;
  for (int lookup = 0; lookup < 6000; ++lookup) {
    CachedLookup(&cache, &table, {7, 100000 + lookup}, 0, &plan);
    if (lookup >= 5000) late_hits += plan.hits;
  }
  // A refresh every 16 lookups, a hit at the others.
  EXPECT(late_hits >= 1000 * 15 / 16);
}

DLT_TEST(RowCacheKeepsOnlyIdsThatRepayTheirRefreshes) {
  const TableConfig config = CacheTableConfig(OptimizerKind::kSgd);
  Table table(config);
  // Refreshed every 2 lookups; a fill costs (8 + 4 x 5) / (8 + 4 x 4) = 1.17
  // plain pulls, so an id must be looked up more than 0.58 times per lookup.
  RowCache cache(config.dim, config.optimizer, Options(8, 2, 0, 1));
  TableRows(&table, {1, 2});
  RowCache::Plan plan;
  for (int k = 0; k < 40; ++k) {
    const std::vector<float> rows =
        CachedLookup(&cache, &table,
                     k % 4 == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1}, 0, &plan);
    EXPECT(rows ==
           TableRows(&table, k % 4 == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1}));
  }
  // Id 1 (every lookup) stays; id 2 (every 4th) was dropped and never taken back.
  EXPECT(cache.counts().rows == 1 && cache.counts().evictions == 1);
  CachedLookup(&cache, &table, {1}, 0, &plan);
  EXPECT(plan.hits == 1 || plan.fill.size() == 1);
  CachedLookup(&cache, &table, {2}, 0, &plan);
  EXPECT(plan.plain.size() == 1);
}

DLT_TEST(RowCacheInvalidateAndRowsGoneFromTheTable) {
  const TableConfig config = CacheTableConfig(OptimizerKind::kSgd);
  Table table(config);
  RowCache cache(config.dim, config.optimizer, Options(8, 1000, 0, 1));
  RowCache::Plan plan;
  TableRows(&table, {1, 2});
  CachedLookup(&cache, &table, {1, 2}, 0, &plan);
  const int64_t one = 1;
  cache.Invalidate(&one, 1);
  CachedLookup(&cache, &table, {1, 2}, 0, &plan);
  EXPECT(plan.hits == 1 && plan.fill.size() == 1);
  // Gone from the table (evicted, expired): a trainer's state pull makes it
  // again, as its plain pull would, and the cache holds the new row.
  const std::vector<float> grad(config.dim, 1.0f);
  EXPECT_OK(table.Push(&one, grad.data(), 1, 0.5f));
  EXPECT(table.Erase(&one, 1) == 1);
  cache.Invalidate(&one, 1);
  const std::vector<float> rows = CachedLookup(&cache, &table, {1, 2}, 0, &plan);
  EXPECT(plan.fill.size() == 1 && cache.counts().rows == 2);
  EXPECT(rows == TableRows(&table, {1, 2}));
  std::vector<float> initial(config.dim);
  InitializeRow(config.initializer, config.seed, 1, config.dim, initial.data());
  EXPECT(std::vector<float>(rows.begin(), rows.begin() + config.dim) == initial);
  // A state pull that finds no row in RAM (kNoState: read on disk, or not
  // admitted) drops a cached row from the cache.
  const uint32_t width = StateFloats(config.dim, cache.slot_floats());
  std::vector<float> state(width, 0.0f), filled(config.dim);
  std::memcpy(&state[width - 1], &kNoState, sizeof(kNoState));
  std::vector<uint32_t> absent;
  cache.Fill(&one, 1, state.data(), 0, filled.data(), &absent);
  EXPECT(absent == std::vector<uint32_t>{0} && cache.counts().rows == 1);
}

DLT_TEST(SlotIndexAgreesWithAMapUnderRandomSetsAndErases) {
  SlotIndex index;
  std::unordered_map<int64_t, uint32_t> model;
  std::mt19937_64 rng(11);
  for (int op = 0; op < 200000; ++op) {
    // Few distinct ids, so runs collide and erasing shifts entries back.
    const int64_t id = static_cast<int64_t>(rng() % 3000) - 1500;
    if (rng() % 3 == 0) {
      index.Erase(id);
      model.erase(id);
    } else {
      const auto slot = static_cast<uint32_t>(rng() % 1000);
      index.Set(id, slot);
      model[id] = slot;
    }
  }
  EXPECT(index.size() == model.size());
  for (int64_t id = -1500; id < 1500; ++id) {
    auto it = model.find(id);
    EXPECT(index.Find(id) == (it == model.end() ? SlotIndex::kNone : it->second));
  }
}

DLT_TEST(RowCacheOptionsNeedRowsAndAStalenessBound) {
  RowCacheOptions options;
  EXPECT(RowCacheOptionsError(options).find("rows") != std::string::npos);
  options.max_rows = 10;
  EXPECT(RowCacheOptionsError(options).find("staleness") != std::string::npos);
  options.max_staleness_ms = 5;
  EXPECT(RowCacheOptionsError(options).empty());
  options.min_count = 0;
  EXPECT(RowCacheOptionsError(options).find("min_count") != std::string::npos);
}

DLT_TEST(TableStatePullReadsValuesSlotsAndStepInsertingNothing) {
  const TableConfig config = CacheTableConfig(OptimizerKind::kAdagrad);
  Table table(config);
  const std::vector<int64_t> ids = {4, 9};
  const std::vector<float> grads(config.dim, 1.0f);
  EXPECT_OK(table.Push(ids.data(), grads.data(), 1, 0.1f));  // id 4 exists; 9 does not
  const uint32_t width = StateFloats(config.dim, table.slot_floats());
  std::vector<float> states(2 * width);
  EXPECT_OK(table.Pull(ids.data(), 2, PullMode::kState, states.data()));
  uint32_t step4, step9;
  std::memcpy(&step4, &states[width - 1], 4);
  std::memcpy(&step9, &states[2 * width - 1], 4);
  EXPECT(step4 == 1 && step9 == kNoState);
  EXPECT(std::vector<float>(states.begin(), states.begin() + config.dim) == TableRows(&table, {4}));
  EXPECT(states[config.dim] == 0.1f + 1.0f);  // the accumulator: initial + g^2
  EXPECT(table.ram_rows() == 1);
}

DLT_TEST(TableStateInsertPullMakesRowsAsATrainingPullDoes) {
  // A trainer's state pull makes an absent id's row as its plain pull would
  // have, and returns that row's state: the cache fills it in one exchange.
  const TableConfig config = CacheTableConfig(OptimizerKind::kAdagrad);
  Table table(config), plain(config);
  const std::vector<int64_t> ids = {4, 9};
  const std::vector<float> grads(config.dim, 1.0f);
  EXPECT_OK(table.Push(ids.data(), grads.data(), 1, 0.1f));
  EXPECT_OK(plain.Push(ids.data(), grads.data(), 1, 0.1f));
  const uint32_t width = StateFloats(config.dim, table.slot_floats());
  std::vector<float> states(2 * width);
  EXPECT_OK(table.Pull(ids.data(), 2, PullMode::kStateInsert, states.data()));
  EXPECT(StepOfState(states.data(), width) == 1 && StepOfState(&states[width], width) == 0);
  EXPECT(table.ram_rows() == 2);
  const std::vector<float> want = TableRows(&plain, ids);  // makes 9 there too
  EXPECT(std::vector<float>(states.begin(), states.begin() + config.dim) ==
         std::vector<float>(want.begin(), want.begin() + config.dim));
  EXPECT(std::vector<float>(states.begin() + width, states.begin() + width + config.dim) ==
         std::vector<float>(want.begin() + config.dim, want.end()));
  EXPECT(states[width + config.dim] == 0.1f);  // the new row's initial accumulator
  std::vector<float> again(2 * width);
  EXPECT_OK(plain.Pull(ids.data(), 2, PullMode::kState, again.data()));
  EXPECT(again == states);

  // An id admission does not admit on a pull: no row, kNoState, and the
  // unadmitted default a plain training pull reads.
  TableConfig admitted = config;
  admitted.policy.admission = static_cast<uint64_t>(AdmissionKind::kFrequency);
  admitted.policy.min_count = 3;
  admitted.policy.sketch_bytes = 1 << 22;
  admitted.policy.unadmitted = static_cast<uint64_t>(UnadmittedValue::kInitial);
  Table gated(admitted);
  std::vector<float> gated_states(width, -1.0f);
  EXPECT_OK(gated.Pull(&ids[1], 1, PullMode::kStateInsert, gated_states.data()));
  EXPECT(StepOfState(gated_states.data(), width) == kNoState && gated.size() == 0);
  std::vector<float> initial(config.dim);
  EXPECT_OK(gated.Pull(&ids[1], 1, PullMode::kInsert, initial.data()));
  EXPECT(std::vector<float>(gated_states.begin(), gated_states.begin() + config.dim) == initial);
  EXPECT(initial != std::vector<float>(config.dim, 0.0f));
  EXPECT(std::all_of(gated_states.begin() + config.dim, gated_states.end() - 1,
                     [](float f) { return f == 0.0f; }));
}

}  // namespace
}  // namespace dlt
