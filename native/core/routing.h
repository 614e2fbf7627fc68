// Routing: id -> bucket -> shard. Mirrored by tf_dlt/routing.py and pinned by
// tests/data/routing_golden.txt, which both test suites read.
#ifndef TF_DLT_NATIVE_CORE_ROUTING_H_
#define TF_DLT_NATIVE_CORE_ROUTING_H_

#include <cstdint>

namespace dlt {

// Number of routing buckets. Fixed forever: checkpoints are grouped by it.
inline constexpr uint32_t kNumBuckets = 4096;

// The 64-bit finalizer of MurmurHash3 (a bijection on uint64).
inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

inline uint32_t BucketOfHash(uint64_t h) { return static_cast<uint32_t>(h % kNumBuckets); }

inline uint32_t BucketOf(int64_t id) { return BucketOfHash(Mix64(static_cast<uint64_t>(id))); }

// The default bucket map: shard i owns the contiguous bucket range
// [FirstBucket(i, n), FirstBucket(i + 1, n)).
inline uint32_t ShardOfBucket(uint32_t bucket, uint32_t num_shards) {
  return static_cast<uint32_t>((static_cast<uint64_t>(bucket) * num_shards) / kNumBuckets);
}

inline uint32_t FirstBucket(uint32_t shard, uint32_t num_shards) {
  // Smallest b with b * n / B >= shard.
  return static_cast<uint32_t>((static_cast<uint64_t>(shard) * kNumBuckets + num_shards - 1) /
                               num_shards);
}

inline uint32_t ShardOf(int64_t id, uint32_t num_shards) {
  return ShardOfBucket(BucketOf(id), num_shards);
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_ROUTING_H_
