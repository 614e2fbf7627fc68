// The table core's memory policy: removal (backward-shift deletion, record
// reuse) against a map oracle, eviction, ttl, admission and its sketch, and
// 16-bit storage against exhaustive conversions.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "native/core/half.h"
#include "native/core/initializer.h"
#include "native/core/routing.h"
#include "native/core/shard.h"
#include "native/core/sketch.h"
#include "native/core/table.h"
#include "tests/cpp/harness.h"

namespace dlt {
namespace {

TableConfig PolicyTable(uint32_t dim) {
  TableConfig c;
  c.name = "p";
  c.dim = dim;
  c.seed = 9;
  c.initializer.kind = InitializerKind::kUniform;
  c.optimizer.kind = OptimizerKind::kAdagrad;
  return c;
}

// The ids removed from `t` since generation `since` (the log complete).
std::vector<int64_t> Removed(const Table& t, uint32_t since) {
  std::vector<int64_t> ids;
  EXPECT_OK(t.RemovedSince(since, &ids));
  return ids;
}

// Every row of `t` as id -> (values, step).
std::map<int64_t, std::pair<std::vector<float>, uint32_t>> Contents(Table* t) {
  std::map<int64_t, std::pair<std::vector<float>, uint32_t>> out;
  Table::Exporter ex(t);
  const uint32_t dim = t->dim();
  std::vector<int64_t> ids(512);
  std::vector<float> values(512 * dim), slots(512 * t->slot_floats());
  std::vector<uint32_t> steps(512), buckets(512);
  const RowBuffers b{ids.data(), values.data(), slots.data(), steps.data(), buckets.data()};
  size_t got;
  while ((got = ex.Next(512, b)) > 0) {
    for (size_t i = 0; i < got; ++i) {
      out[ids[i]] = {std::vector<float>(&values[i * dim], &values[(i + 1) * dim]), steps[i]};
    }
  }
  return out;
}

DLT_TEST(TestRemovalMatchesAnOracleUnderChurn) {
  // Rounds of imports and shrinks: the table must always hold exactly the
  // oracle's rows, whatever the probe chains the deletions rewrote.
  Table t(PolicyTable(2));
  std::map<int64_t, std::pair<std::vector<float>, uint32_t>> oracle;
  std::mt19937_64 rng(5);
  for (int round = 0; round < 30; ++round) {
    std::vector<int64_t> ids;
    std::vector<float> values;
    std::vector<uint32_t> steps;
    for (int i = 0; i < 3000; ++i) {
      const int64_t id = static_cast<int64_t>(rng() % 20000) - 10000;
      const uint32_t step = static_cast<uint32_t>(rng() % 8);
      ids.push_back(id);
      values.push_back(static_cast<float>(id));
      values.push_back(static_cast<float>(round));
      steps.push_back(step);
    }
    EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, steps.data(), ids.size()));
    for (size_t i = 0; i < ids.size(); ++i) {
      oracle[ids[i]] = {{values[2 * i], values[2 * i + 1]}, steps[i]};
    }
    const uint64_t min_count = 1 + round % 4;
    const size_t removed = t.Shrink(min_count, 0, t.Now());
    size_t expected = 0;
    for (auto it = oracle.begin(); it != oracle.end();) {
      if (it->second.second < min_count) {
        it = oracle.erase(it);
        ++expected;
      } else {
        ++it;
      }
    }
    EXPECT(removed == expected);
    EXPECT(t.size() == oracle.size());
  }
  EXPECT(Contents(&t) == oracle);
  // Every remaining id is found by a pull; a removed one reads its default.
  std::vector<int64_t> ids;
  for (const auto& e : oracle) ids.push_back(e.first);
  std::vector<float> out(ids.size() * 2);
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kZerosNoInsert, out.data()));
  bool found = true;
  for (size_t i = 0; i < ids.size(); ++i) found = found && out[2 * i] == static_cast<float>(ids[i]);
  EXPECT(found);
}

DLT_TEST(TestTtlIsExactAtItsBoundary) {
  TableConfig c = PolicyTable(1);
  c.policy.ttl = 3;
  Table t(c);
  const int64_t a = 1, b = 2;
  const float g = 1.0f;
  EXPECT_OK(t.Push(&a, &g, 1, 0.1f));  // clock 1: a stamped 1
  for (int i = 0; i < 3; ++i) EXPECT_OK(t.Push(&b, &g, 1, 0.1f));
  EXPECT(t.Now() == 4 && t.Expire(t.Now()) == 0 && t.size() == 2);  // a is 3 pushes old
  EXPECT_OK(t.Push(&b, &g, 1, 0.1f));
  EXPECT(t.Expire(t.Now()) == 1 && t.size() == 1);  // 4 pushes old: gone
  EXPECT(t.counters().expired == 1);
  // Stamps compare modulo 2^32: a clock that wrapped still measures ages.
  t.SetPushClock(0xfffffffeu);
  EXPECT_OK(t.Push(&b, &g, 1, 0.1f));  // stamped 0xffffffff
  t.SetPushClock(2);                   // 3 pushes later, wrapped
  EXPECT(t.Expire(2) == 0);
  EXPECT(t.Expire(3) == 1);
}

DLT_TEST(TestStampsAheadOfTheClockAreAgeZero) {
  // Under the seconds clock a row stamped ahead of now (a checkpoint saved on
  // a host whose clock runs ahead, a clock stepped back) is fresh: neither a
  // 30-day ttl nor a shrink by age takes it; a row really 31 days old goes.
  TableConfig c = PolicyTable(1);
  c.policy.clock = static_cast<uint64_t>(ClockKind::kSeconds);
  c.policy.ttl = 30 * 86400;
  Table t(c);
  const uint32_t now = t.Now();
  const std::vector<int64_t> ids = {1, 2, 3};
  const std::vector<float> values = {1.0f, 2.0f, 3.0f};
  const std::vector<uint32_t> steps = {1, 1, 1};
  const std::vector<uint32_t> touched = {now + 2, now + 86400, now - 31 * 86400};
  EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, steps.data(), 3, touched.data()));
  EXPECT(t.Expire(now) == 1 && t.size() == 2);
  EXPECT(t.Shrink(0, 3600, now) == 0 && t.size() == 2);
}

DLT_TEST(TestEvictionKeepsTheBoundAndTheFrequentRows) {
  for (EvictionKind kind : {EvictionKind::kLfu, EvictionKind::kLru}) {
    TableConfig c = PolicyTable(2);
    c.policy.max_rows = 5000;
    c.policy.eviction = static_cast<uint64_t>(kind);
    Table t(c);
    std::vector<int64_t> hot(200);
    for (int i = 0; i < 200; ++i) hot[i] = i;
    std::vector<float> grads(2 * 20000, 0.01f);
    for (int round = 0; round < 50; ++round) {
      // LFU: hot rows are updated often; LRU: they were touched last.
      if (kind == EvictionKind::kLfu || round == 49) {
        EXPECT_OK(t.Push(hot.data(), grads.data(), hot.size(), 0.1f));
      }
      std::vector<int64_t> cold(400);
      for (int i = 0; i < 400; ++i) cold[i] = 1000 + round * 400 + i;
      EXPECT_OK(t.Push(cold.data(), grads.data(), cold.size(), 0.1f));
      EXPECT(t.size() <= 5000);
    }
    if (kind == EvictionKind::kLru) EXPECT_OK(t.Push(hot.data(), grads.data(), hot.size(), 0.1f));
    const auto rows = Contents(&t);
    size_t hot_kept = 0;
    for (int64_t id : hot) hot_kept += rows.count(id);
    EXPECT(hot_kept == hot.size());
    EXPECT(t.counters().evicted == 200 + 50 * 400 - t.size());
  }
}

DLT_TEST(TestRowsPastQuotaSaysWhetherAnImportWouldEvict) {
  // A stripe fills its share of max_rows before the table fills: 4,096
  // rows over 64 stripes, 64 each. The rows an import would take past the
  // stripes' shares are what it would evict (none when it evicts none),
  // counting only ids the table does not hold.
  TableConfig c = PolicyTable(2);
  c.policy.max_rows = 4096;
  Table t(c);
  std::vector<int64_t> same_stripe;
  for (int64_t id = 0; same_stripe.size() < 70; ++id) {
    if (t.StripeOfBucket(BucketOf(id)) == 0) same_stripe.push_back(id);
  }
  std::vector<float> grads(2 * 70, 0.01f);
  EXPECT_OK(t.Push(same_stripe.data(), grads.data(), 60, 0.1f));
  EXPECT(t.RowsPastQuota(same_stripe.data(), 60) == 0);  // held: none new
  EXPECT(t.RowsPastQuota(same_stripe.data(), 64) == 0);  // 64 of 64
  EXPECT(t.RowsPastQuota(same_stripe.data(), 70) == 6);  // 70 of 64
  EXPECT(t.RowsPastQuota(same_stripe.data() + 60, 10) == 6);
  // Removed first (a delta's removals), held rows make room.
  EXPECT(t.RowsPastQuota(same_stripe.data() + 60, 10, same_stripe.data(), 6) == 0);
  EXPECT(t.RowsPastQuota(same_stripe.data() + 60, 10, same_stripe.data(), 5) == 1);
  // A row removed and made again comes in afresh.
  EXPECT(t.RowsPastQuota(same_stripe.data(), 64, same_stripe.data(), 4) == 0);
  EXPECT(t.RowsPastQuota(same_stripe.data() + 64, 6, same_stripe.data() + 64, 6) == 2);
  EXPECT_OK(t.Push(same_stripe.data(), grads.data(), 70, 0.1f));
  EXPECT(t.counters().evicted > 0);
  TableConfig unbounded = PolicyTable(2);
  Table u(unbounded);
  EXPECT(u.RowsPastQuota(same_stripe.data(), 70) == 0);
}

DLT_TEST(TestAShardOfFewBucketsSpreadsThemOverTheStripes) {
  // A shard of 256 owns 16 buckets: they go to 16 stripes (16 locks), in
  // bucket order, so exports stay in (bucket, id) order and eviction quotas
  // split the rows 16 ways.
  TableConfig c = PolicyTable(2);
  c.policy.max_rows = 4800;
  Table t(c, 32, 48);
  uint32_t last = 0;
  bool increasing = true;
  for (uint32_t b = 32; b < 48; ++b) {
    increasing = increasing && (b == 32 || t.StripeOfBucket(b) > last);
    last = t.StripeOfBucket(b);
  }
  EXPECT(increasing && t.StripeOfBucket(32) == 0 && last < kStripes);
  EXPECT(t.StripeOfBucket(0) == 0 && t.StripeOfBucket(4095) == kStripes - 1);
  std::vector<int64_t> ids;
  for (int64_t id = 0; ids.size() < 20000; ++id) {
    const uint32_t b = BucketOf(id);
    if (b >= 32 && b < 48) ids.push_back(id);
  }
  std::vector<float> grads(ids.size() * 2, 0.01f);
  EXPECT_OK(t.Push(ids.data(), grads.data(), ids.size(), 0.1f));
  EXPECT(t.size() <= 4800 && t.size() >= 4500);
  Table::Exporter ex(&t);
  std::vector<int64_t> out(8192);
  std::vector<float> values(8192 * 2), slots(8192 * 2);
  std::vector<uint32_t> steps(8192), buckets(8192);
  const RowBuffers rb{out.data(), values.data(), slots.data(), steps.data(), buckets.data()};
  const size_t got = ex.Next(8192, rb);
  bool sorted = got == t.size();
  for (size_t i = 1; i < got; ++i) {
    sorted = sorted &&
             (buckets[i - 1] < buckets[i] || (buckets[i - 1] == buckets[i] && out[i - 1] < out[i]));
  }
  EXPECT(sorted);
}

DLT_TEST(TestSweeperStartsAndStopsRepeatedly) {
  // A sweeper started right after a stop runs on its own; the stopped one
  // ends (a shared stop flag once revived it and hung the next join).
  Shard shard(0, 1);
  TableConfig c = PolicyTable(1);
  c.policy.ttl = 1;
  bool created = false;
  EXPECT_OK(shard.CreateTable(c, &created));
  std::shared_ptr<Table> t;
  EXPECT_OK(shard.GetTable("p", &t));
  const int64_t a = 1, b = 2;
  const float g = 1.0f;
  EXPECT_OK(t->Push(&a, &g, 1, 0.1f));
  for (int i = 0; i < 20; ++i) {
    shard.StartSweeper(1);
    shard.StopSweeper();
  }
  EXPECT_OK(t->Push(&b, &g, 1, 0.1f));
  EXPECT_OK(t->Push(&b, &g, 1, 0.1f));  // row 1 is now 2 pushes old
  shard.StartSweeper(1);
  for (int i = 0; i < 2000 && t->size() > 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT(t->size() == 1);
  shard.StopSweeper();
}

DLT_TEST(TestFrequencyAdmissionCountsEachPushOnce) {
  TableConfig c = PolicyTable(2);
  c.policy.admission = static_cast<uint64_t>(AdmissionKind::kFrequency);
  c.policy.min_count = 3;
  c.policy.sketch_bytes = 1 << 22;
  Table t(c);
  const std::vector<int64_t> ids = {7, 7, 7, 8};  // 7 three times in one push: counted once
  const std::vector<float> grads(8, 1.0f);
  std::vector<float> out(8);
  EXPECT_OK(t.Pull(ids.data(), 4, PullMode::kInsert, out.data()));
  EXPECT(t.size() == 0 && out[0] == 0.0f);  // a pull never admits
  EXPECT_OK(t.Push(ids.data(), grads.data(), 4, 0.1f));
  EXPECT_OK(t.Push(ids.data(), grads.data(), 4, 0.1f));
  EXPECT(t.size() == 0 && t.counters().refused == 4);  // 2 ids in each of 2 pushes
  EXPECT_OK(t.Push(ids.data(), grads.data(), 4, 0.1f));
  EXPECT(t.size() == 2 && t.counters().admitted == 2);
  // The admitting push applied its gradient (summed: 3 occurrences of 7).
  std::vector<float> init(2);
  InitializeRow(c.initializer, c.seed, 7, 2, init.data());
  EXPECT_OK(t.Pull(ids.data(), 1, PullMode::kZerosNoInsert, out.data()));
  const float expected = init[0] - 0.1f * 3.0f / (std::sqrt(0.1f + 9.0f) + 1e-7f);
  EXPECT(std::fabs(out[0] - expected) < 1e-5f);
}

DLT_TEST(TestSketchNeverUndercountsAndStaysWithinItsBound) {
  // One bucket's slice of width w; n distinct ids with known counts. A
  // count-min estimate is >= the true count, and exceeds it by more than
  // e*N/w (N: pushes counted in the slice) with probability at most e^-4.
  const uint64_t sketch_bytes = uint64_t{kNumBuckets} * FrequencySketch::kDepth * 4096;
  FrequencySketch sketch(sketch_bytes, 17, 18);  // bucket 17's slice only
  const uint32_t w = sketch.width();
  EXPECT(w == 4096);
  std::map<uint64_t, uint32_t> truth;
  std::vector<uint64_t> hashes;
  std::mt19937_64 rng(3);
  // Ids of bucket 17 only, counts 1..4: 1,000 ids, 2,500 pushes (below the
  // slice's window of w pushes, so nothing is halved).
  while (hashes.size() < 1000) {
    const uint64_t h = rng();
    if (BucketOfHash(h) == 17) hashes.push_back(h);
  }
  uint64_t pushes = 0;
  for (size_t i = 0; i < hashes.size(); ++i) {
    const uint32_t count = 1 + static_cast<uint32_t>(i % 4);
    for (uint32_t k = 0; k < count; ++k) sketch.Add(hashes[i]);
    truth[hashes[i]] = count;
    pushes += count;
  }
  const double bound = std::exp(1.0) * static_cast<double>(pushes) / w;
  size_t under = 0, beyond = 0;
  for (const auto& [h, count] : truth) {
    const uint32_t est = sketch.Estimate(h);
    under += est < count;
    beyond += est > count + bound;
  }
  EXPECT(under == 0);
  EXPECT(beyond <= truth.size() * std::exp(-4.0) + 5);
  EXPECT(sketch.Estimate(rng() * kNumBuckets + 18) == 0);  // not this sketch's bucket
  // After a window of pushes the slice halves: counts age.
  const uint64_t h = hashes[3];  // true count 4
  for (uint32_t k = 0; k < sketch.window(); ++k) sketch.Add(rng() * kNumBuckets + 17);
  EXPECT(sketch.Estimate(h) < 4);
}

DLT_TEST(Test16BitRoundingMatchesExhaustiveConversions) {
  // Every finite 16-bit value converts back to itself; float32 values
  // between two neighbours round to the nearer (ties to even).
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    const float bf = Bfloat16ToFloat(b);
    if (std::isfinite(bf)) EXPECT(Bfloat16ToFloat(ToBfloat16Nearest(bf)) == bf);
    const float hf = Float16ToFloat(b);
    if (std::isfinite(hf)) EXPECT(Float16ToFloat(ToFloat16Nearest(hf)) == hf);
  }
  EXPECT(ToFloat16Nearest(1.0f + 1.0f / 2048) == 0x3c00);  // tie: to even (1.0)
  EXPECT(ToFloat16Nearest(1.0f + 3.0f / 2048) == 0x3c02);  // tie: to even
  EXPECT(ToFloat16Nearest(1e6f) == 0x7bff);                // saturates at 65504
  EXPECT(ToFloat16Nearest(-1e6f) == 0xfbff);
  EXPECT(ToBfloat16Nearest(1.0f + 1.0f / 256) == 0x3f80);                      // tie: to even
  EXPECT(Float16ToFloat(ToFloat16Nearest(3e-6f)) == 2.9802322387695312e-06f);  // subnormal
  // Stochastic rounding is unbiased: the mean of many draws is the value.
  const float x = 1.0f + 1.0f / 3.0f / 1024.0f;  // a third of a float16 step above 1
  double sum = 0;
  const uint32_t n = 200000;
  std::vector<uint16_t> out(1);
  for (uint32_t k = 0; k < n; ++k) {
    StoreValues(&x, static_cast<uint64_t>(StorageDtype::kFloat16), true, k, 1, out.data());
    sum += Float16ToFloat(out[0]);
  }
  EXPECT(std::fabs(sum / n - x) < 2e-6);
  // ... and a pure function of its key.
  uint16_t again;
  StoreValues(&x, static_cast<uint64_t>(StorageDtype::kFloat16), true, 41, 1, out.data());
  StoreValues(&x, static_cast<uint64_t>(StorageDtype::kFloat16), true, 41, 1, &again);
  EXPECT(out[0] == again);
}

// Ids of the rows an export yields, with `since` when given.
std::vector<int64_t> Exported(Table* t, const SaveStart* start) {
  Table::Exporter ex = start ? Table::Exporter(t, start->since) : Table::Exporter(t);
  const uint32_t dim = t->dim();
  std::vector<int64_t> ids(512), out;
  std::vector<float> values(512 * dim), slots(512 * t->slot_floats());
  std::vector<uint32_t> steps(512), buckets(512);
  const RowBuffers b{ids.data(), values.data(), slots.data(), steps.data(), buckets.data()};
  size_t got;
  while ((got = ex.Next(512, b)) > 0) out.insert(out.end(), ids.begin(), ids.begin() + got);
  std::sort(out.begin(), out.end());
  return out;
}

DLT_TEST(TestDeltaExportsOnlyRowsChangedSinceItsBase) {
  Table t(PolicyTable(2));
  std::vector<int64_t> ids(1000);
  for (int64_t i = 0; i < 1000; ++i) ids[i] = i * 7919;
  std::vector<float> grads(2 * 1000, 0.5f);
  EXPECT_OK(t.Push(ids.data(), grads.data(), ids.size(), 0.1f));
  // No tracked base: a save exports everything.
  SaveStart first = t.BeginSave("s1", "");
  EXPECT(!first.tracked);
  EXPECT(Exported(&t, nullptr).size() == 1000);
  // Change 10 rows (a push), create 5 (a pull), remove 3.
  const std::vector<int64_t> pushed(ids.begin(), ids.begin() + 10);
  EXPECT_OK(t.Push(pushed.data(), grads.data(), pushed.size(), 0.1f));
  const std::vector<int64_t> created = {-1, -2, -3, -4, -5};
  std::vector<float> out(2 * 5);
  EXPECT_OK(t.Pull(created.data(), created.size(), PullMode::kInsert, out.data()));
  const std::vector<int64_t> removed = {ids[500], ids[501], ids[502], 123456789};
  EXPECT(t.Erase(removed.data(), removed.size()) == 3);
  SaveStart second = t.BeginSave("s2", "s1");
  EXPECT(second.tracked);
  std::vector<int64_t> want(pushed);
  want.insert(want.end(), created.begin(), created.end());
  std::sort(want.begin(), want.end());
  EXPECT(Exported(&t, &second) == want);
  std::vector<int64_t> gone = Removed(t, second.since);
  std::sort(gone.begin(), gone.end());
  std::vector<int64_t> want_gone(removed.begin(), removed.begin() + 3);
  std::sort(want_gone.begin(), want_gone.end());
  EXPECT(gone == want_gone);
  // Changes after a save's start belong to the next delta, whichever base.
  EXPECT_OK(t.Push(ids.data() + 900, grads.data(), 1, 0.1f));
  SaveStart third = t.BeginSave("s3", "s2");
  EXPECT(third.tracked && Exported(&t, &third) == std::vector<int64_t>{ids[900]});
  EXPECT(Removed(t, third.since).empty());
  // A failed save (s3 never committed): the next one on s2 still sees both.
  SaveStart fourth = t.BeginSave("s4", "s2");
  EXPECT(fourth.tracked && Exported(&t, &fourth) == std::vector<int64_t>{ids[900]});
  EXPECT(Removed(t, fourth.since).empty());
  // An unknown base exports everything.
  EXPECT(!t.BeginSave("s5", "nope").tracked);
  // Only the last kTrackedSaves saves are tracked.
  for (int k = 0; k < 4; ++k) t.BeginSave("x" + std::to_string(k), "");
  EXPECT(!t.BeginSave("s6", "s2").tracked);
}

DLT_TEST(TestAnOverflowedRemovalLogIsRefusedNotPartial) {
  Table t(PolicyTable(2));
  std::vector<int64_t> ids(400000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  std::vector<float> values(ids.size() * 2, 1.0f);
  EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, nullptr, ids.size()));
  t.BeginSave("s1", "");
  const SaveStart start = t.BeginSave("s2", "s1");
  EXPECT(start.tracked);
  // Mid-save: more removals than a stripe's log holds.
  EXPECT(t.Erase(ids.data(), 360000) == 360000);
  std::vector<int64_t> gone;
  const Status s = t.RemovedSince(start.since, &gone);
  EXPECT(s.code() == Code::kFailedPrecondition &&
         s.message().find("written whole") != std::string::npos);
  EXPECT(!t.BeginSave("s3", "s2").tracked);  // the next save is whole
}

DLT_TEST(TestLoadedTableTracksFromItsCheckpoint) {
  Table t(PolicyTable(2));
  std::vector<int64_t> ids = {1, 2, 3, 4};
  std::vector<float> values(8, 1.0f);
  EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, nullptr, ids.size()));
  t.MarkLoaded("head");
  SaveStart start = t.BeginSave("next", "head");
  EXPECT(start.tracked && Exported(&t, &start).empty());
  const std::vector<int64_t> keep = {3, 2, 99};
  EXPECT(t.EraseBuckets(0, kNumBuckets, keep.data(), keep.size()) == 2 && t.size() == 2);
  EXPECT(Exported(&t, nullptr) == (std::vector<int64_t>{2, 3}));
  EXPECT(t.EraseBuckets(0, kNumBuckets) == 2 && t.size() == 0);
  EXPECT(Removed(t, start.since).size() == 4);
}

DLT_TEST(TestRemovalLogIsBoundedAndOverflowMeansAFullSave) {
  Table t(PolicyTable(1));
  t.BeginSave("s1", "");
  // Churn far past the log's cap: each round adds and removes rows.
  std::vector<int64_t> ids(40000);
  std::vector<float> values(40000, 1.0f);
  for (int round = 0; round < 8; ++round) {
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t(round) * 1000000 + int64_t(i);
    EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, nullptr, ids.size()));
    EXPECT(t.Erase(ids.data(), ids.size()) == ids.size());
  }
  const size_t bytes_full = t.bytes();
  EXPECT(!t.BeginSave("s2", "s1").tracked);  // the log overflowed
  EXPECT(t.bytes() < bytes_full);            // and was dropped
  EXPECT(t.BeginSave("s3", "s2").tracked);   // tracking resumes
}

DLT_TEST(TestReserveSizesATableForItsRowsOnSeveralThreads) {
  // A table sized first holds the same rows in no more memory than one
  // that grew as rows came (its arena is sized for the expected rows).
  const size_t n = 50000;
  std::vector<int64_t> ids(n);
  std::vector<float> values(n * 4);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(i * 2654435761u);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 97);
  Table grown(PolicyTable(4)), sized(PolicyTable(4));
  EXPECT_OK(grown.Import(ids.data(), values.data(), nullptr, nullptr, n));
  sized.Reserve(n, 2);
  EXPECT(sized.size() == 0);
  EXPECT_OK(sized.Import(ids.data(), values.data(), nullptr, nullptr, n));
  EXPECT(sized.size() == n);
  EXPECT(Contents(&sized) == Contents(&grown));
  EXPECT(sized.bytes() <= grown.bytes() * 11 / 10);
}

}  // namespace
}  // namespace dlt
