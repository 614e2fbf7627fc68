// Replays a stream of lookups through the hot-row cache (dlt::RowCache)
// with no TensorFlow and no shards, for bench/bench_cache.py --replay: the
// bytes the cache pulls, counted as dlt_pull_bytes counts them, against
// pulling every row plainly. Its pulls are served as the shards serve a
// trainer's (kStateInsert: a state pull of an id no lookup has pulled before
// makes its row, as a plain pull would, and returns its state). The
// trainer's push of each lookup's rows changes no bytes pulled; it is
// applied (Pushed, gradients of the distinct ids) for the CPU the cache
// spends, reported per lookup in microseconds: lookup_us, fill_us,
// pushed_us.
//
//   cache_replay STREAM ROWS STALENESS_STEPS MIN_COUNT
//
// STREAM: int32 lookups, then per lookup int32 n and n distinct int64 ids
// (little-endian). The table is dim 8 with Adagrad, the CTR model's. Prints
// one JSON line.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "native/core/table.h"
#include "native/net/row_cache.h"

namespace {

bool Read(FILE* f, void* out, size_t bytes) { return std::fread(out, 1, bytes, f) == bytes; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s STREAM ROWS STALENESS_STEPS MIN_COUNT\n", argv[0]);
    return 2;
  }
  FILE* f = std::fopen(argv[1], "rb");
  if (f == nullptr) {
    std::perror(argv[1]);
    return 1;
  }
  dlt::RowCacheOptions options;
  options.max_rows = std::strtoull(argv[2], nullptr, 10);
  options.max_staleness_steps = static_cast<uint32_t>(std::strtoul(argv[3], nullptr, 10));
  options.min_count = static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10));
  const std::string error = dlt::RowCacheOptionsError(options);
  if (!error.empty()) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 2;
  }
  constexpr uint32_t kDim = 8;
  dlt::OptimizerConfig optimizer;
  optimizer.kind = dlt::OptimizerKind::kKerasAdagrad;
  dlt::RowCache cache(kDim, optimizer, options);
  const uint32_t width = dlt::StateFloats(kDim, cache.slot_floats());
  const double plain_bytes = sizeof(int64_t) + sizeof(float) * kDim;
  const double state_bytes = sizeof(int64_t) + sizeof(float) * width;

  int32_t lookups = 0;
  if (!Read(f, &lookups, sizeof(lookups))) return 1;
  std::vector<int64_t> ids, fill_ids;
  std::vector<float> rows, states, filled;
  std::vector<uint32_t> absent;
  dlt::RowCache::Plan plan;
  double pulled = 0, uncached = 0;
  using Clock = std::chrono::steady_clock;
  Clock::duration in_lookup{}, in_fill{}, in_pushed{};
  std::vector<float> grads;
  for (int32_t l = 0; l < lookups; ++l) {
    int32_t n = 0;
    if (!Read(f, &n, sizeof(n))) return 1;
    ids.resize(n);
    if (!Read(f, ids.data(), sizeof(int64_t) * n)) return 1;
    rows.resize(size_t(n) * kDim);
    const Clock::time_point start = Clock::now();
    cache.Lookup(ids.data(), ids.size(), 0, rows.data(), &plan);
    in_lookup += Clock::now() - start;
    uncached += n * plain_bytes;
    pulled += plan.plain.size() * plain_bytes + plan.fill.size() * state_bytes;
    fill_ids.clear();
    for (uint32_t p : plan.fill) fill_ids.push_back(ids[p]);
    states.assign(fill_ids.size() * width, 0.0f);  // every row held (step 0)
    filled.resize(fill_ids.size() * kDim);
    const Clock::time_point filling = Clock::now();
    cache.Fill(fill_ids.data(), fill_ids.size(), states.data(), 0, filled.data(), &absent);
    const Clock::time_point pushing = Clock::now();
    in_fill += pushing - filling;
    grads.assign(size_t(n) * kDim, 0.01f);
    const dlt::Status applied = cache.Pushed(ids.data(), grads.data(), ids.size(), 0.1f);
    if (!applied.ok()) {
      std::fprintf(stderr, "cache_replay: push refused: %s\n", applied.message().c_str());
      return 1;
    }
    in_pushed += Clock::now() - pushing;
  }
  std::fclose(f);
  const dlt::RowCache::Counts c = cache.counts();
  const auto us = [&](Clock::duration d) {
    return std::chrono::duration<double, std::micro>(d).count() / std::max(lookups, 1);
  };
  std::printf("{\"bytes_vs_no_cache\": %.4f, \"hits\": %" PRIu64 ", \"fills\": %" PRIu64
              ", \"refreshes\": %" PRIu64 ", \"evictions\": %" PRIu64 ", \"rows\": %" PRIu64
              ", \"lookup_us\": %.1f, \"fill_us\": %.1f, \"pushed_us\": %.1f}\n",
              pulled / uncached, c.hits, c.fills, c.refreshes, c.evictions, c.rows, us(in_lookup),
              us(in_fill), us(in_pushed));
  return 0;
}
