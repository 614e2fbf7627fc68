// Frequency sketch of Frequency admission: a count-min sketch with
// conservative update and 8-bit saturating counters, kept per routing
// bucket. Each bucket has its own `depth x width` counters, so a shard holds
// only its buckets' slices and a checkpoint can hand any slice to any shard
// count. Each slice ages on its own: after `width` counted pushes its
// counters are halved (TinyLFU's reset), so a slice never holds more than
// `width` pushes' worth of counts: an estimate exceeds the true count by
// more than e (2.72) with probability at most e^-4 (count-min's bound with
// N <= width). Not thread-safe: the table calls it under the lock
// of the stripe that holds the bucket.
#ifndef TF_DLT_NATIVE_CORE_SKETCH_H_
#define TF_DLT_NATIVE_CORE_SKETCH_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dlt {

class FrequencySketch {
 public:
  static constexpr uint32_t kDepth = 4;
  static constexpr uint32_t kMaxCount = 255;

  // Width per bucket row from the whole table's sketch bytes.
  static uint32_t WidthFor(uint64_t sketch_bytes);

  // Slices for buckets [first_bucket, end_bucket).
  FrequencySketch(uint64_t sketch_bytes, uint32_t first_bucket, uint32_t end_bucket);
  // bytes() of such a sketch, before it is made.
  static uint64_t BytesFor(uint64_t sketch_bytes, uint32_t first_bucket, uint32_t end_bucket);

  uint32_t width() const { return width_; }
  // Counters of one bucket's slice (kDepth * width).
  uint32_t slice_counters() const { return kDepth * width_; }
  // Pushes counted in a slice before it halves.
  uint32_t window() const { return width_; }
  uint64_t bytes() const { return counters_.size() + added_.size() * sizeof(uint32_t); }
  bool Owns(uint32_t bucket) const { return bucket >= first_ && bucket < end_; }

  // Counts one push of the id whose routing hash is `hash`; returns the
  // estimate after counting (never below the true count since the last
  // halving, at most 255).
  uint32_t Add(uint64_t hash);
  uint32_t Estimate(uint64_t hash) const;

  // A bucket's slice: `counters` gets slice_counters() bytes.
  void ReadSlice(uint32_t bucket, uint8_t* counters, uint32_t* added) const;
  void WriteSlice(uint32_t bucket, const uint8_t* counters, uint32_t added);

 private:
  uint8_t* Slice(uint32_t bucket) { return &counters_[size_t{bucket - first_} * slice_counters()]; }
  const uint8_t* Slice(uint32_t bucket) const {
    return &counters_[size_t{bucket - first_} * slice_counters()];
  }
  uint32_t Column(uint64_t hash, uint32_t row) const;

  uint32_t width_;
  uint32_t first_, end_;
  std::vector<uint8_t> counters_;  // [bucket][row][column]
  std::vector<uint32_t> added_;    // pushes counted per slice since its last halving
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_SKETCH_H_
