#include "native/core/sketch.h"

#include <algorithm>
#include <cstring>

#include "native/core/routing.h"

namespace dlt {

uint32_t FrequencySketch::WidthFor(uint64_t sketch_bytes) {
  const uint64_t w = sketch_bytes / (uint64_t{kNumBuckets} * kDepth);
  return static_cast<uint32_t>(std::max<uint64_t>(8, std::min<uint64_t>(w, uint64_t{1} << 24)));
}

FrequencySketch::FrequencySketch(uint64_t sketch_bytes, uint32_t first_bucket, uint32_t end_bucket)
    : width_(WidthFor(sketch_bytes)),
      first_(first_bucket),
      end_(end_bucket),
      counters_(size_t{end_bucket - first_bucket} * kDepth * width_, 0),
      added_(end_bucket - first_bucket, 0) {}

uint64_t FrequencySketch::BytesFor(uint64_t sketch_bytes, uint32_t first_bucket,
                                   uint32_t end_bucket) {
  return uint64_t{end_bucket - first_bucket} *
         (kDepth * uint64_t{WidthFor(sketch_bytes)} + sizeof(uint32_t));
}

uint32_t FrequencySketch::Column(uint64_t hash, uint32_t row) const {
  // The bucket took hash % 4096; the columns take other bits, one mix per row.
  return static_cast<uint32_t>(Mix64(hash + (uint64_t{row} + 1) * 0x9e3779b97f4a7c15ULL) % width_);
}

uint32_t FrequencySketch::Estimate(uint64_t hash) const {
  const uint32_t bucket = BucketOfHash(hash);
  if (!Owns(bucket)) return 0;
  const uint8_t* s = Slice(bucket);
  uint32_t est = kMaxCount;
  for (uint32_t r = 0; r < kDepth; ++r) {
    est = std::min<uint32_t>(est, s[size_t{r} * width_ + Column(hash, r)]);
  }
  return est;
}

uint32_t FrequencySketch::Add(uint64_t hash) {
  const uint32_t bucket = BucketOfHash(hash);
  if (!Owns(bucket)) return 0;
  uint8_t* s = Slice(bucket);
  uint8_t* cells[kDepth];
  uint32_t est = kMaxCount;
  for (uint32_t r = 0; r < kDepth; ++r) {
    cells[r] = &s[size_t{r} * width_ + Column(hash, r)];
    est = std::min<uint32_t>(est, *cells[r]);
  }
  if (est < kMaxCount) {
    // Conservative update: only the counters at the minimum grow.
    for (uint8_t* c : cells) {
      if (*c == est) ++*c;
    }
    ++est;
  }
  uint32_t& added = added_[bucket - first_];
  if (++added >= window()) {
    for (uint32_t i = 0; i < slice_counters(); ++i) s[i] >>= 1;
    added /= 2;
  }
  return est;
}

void FrequencySketch::ReadSlice(uint32_t bucket, uint8_t* counters, uint32_t* added) const {
  std::memcpy(counters, Slice(bucket), slice_counters());
  *added = added_[bucket - first_];
}

void FrequencySketch::WriteSlice(uint32_t bucket, const uint8_t* counters, uint32_t added) {
  std::memcpy(Slice(bucket), counters, slice_counters());
  added_[bucket - first_] = added;
}

}  // namespace dlt
