// Byte buffers of the data plane: a growable buffer that never zero-fills
// (frames are fully written before they are read), and a small pool that
// recycles large ones so big frames do not page-fault fresh memory each time.
#ifndef TF_DLT_NATIVE_NET_BUFFER_H_
#define TF_DLT_NATIVE_NET_BUFFER_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace dlt {
namespace net {

class Buffer {
 public:
  Buffer() = default;
  ~Buffer() { Account(0); }
  Buffer(Buffer&& other) noexcept : data_(std::move(other.data_)), capacity_(other.capacity_) {
    other.capacity_ = 0;
  }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      Account(0);  // what this one held is freed
      data_ = std::move(other.data_);
      capacity_ = other.capacity_;
      other.capacity_ = 0;
    }
    return *this;
  }

  // Returns storage for at least `bytes`; earlier contents are not kept.
  uint8_t* Reserve(size_t bytes) {
    if (bytes > capacity_) {
      // operator new[] aligns to 16, so 8-byte fields at 8-byte offsets of
      // the payload are aligned.
      data_.reset(new uint8_t[bytes]);
      Account(bytes);
    }
    return data_.get();
  }
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t capacity() const { return capacity_; }
  // Frees storage above `keep` bytes so one huge frame does not pin memory.
  void Trim(size_t keep) {
    if (capacity_ > keep) Release();
  }
  void Release() {
    data_.reset();
    Account(0);
  }
  // Bytes the process's Buffers hold now (frames in flight and pooled): a
  // shard's memory keeper counts them within the room it holds back for
  // buffers, not as memory that rows must give way to.
  static uint64_t HeldBytes() {
    const int64_t held = held_bytes_.load(std::memory_order_relaxed);
    return held > 0 ? static_cast<uint64_t>(held) : 0;
  }

 private:
  // Sets the capacity to `capacity`, counting the change.
  void Account(size_t capacity) {
    if (capacity == capacity_) return;  // (an empty one destroyed: no atomic add)
    held_bytes_.fetch_add(static_cast<int64_t>(capacity) - static_cast<int64_t>(capacity_),
                          std::memory_order_relaxed);
    capacity_ = capacity;
  }

  static inline std::atomic<int64_t> held_bytes_{0};
  std::unique_ptr<uint8_t[]> data_;
  size_t capacity_ = 0;
};

// Keeps up to `max_buffers` buffers of at most `max_bytes` each for reuse,
// until one goes unused for a while (ReleaseIdle). Thread-safe.
class BufferPool {
 public:
  BufferPool(size_t max_buffers, size_t max_bytes)
      : max_buffers_(max_buffers), max_bytes_(max_bytes) {}

  // A buffer with capacity for `bytes`: the smallest pooled one that fits,
  // else a new one.
  Buffer Get(size_t bytes) {
    Buffer out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].capacity() >= bytes &&
            (best == free_.size() || free_[i].capacity() < free_[best].capacity())) {
          best = i;
        }
      }
      if (best < free_.size()) {
        out = std::move(free_[best]);
        Remove(best);
      }
    }
    out.Reserve(bytes);
    return out;
  }

  // Takes `buffer` back; keeps it when it is small enough and the pool has
  // room (else replaces a smaller pooled one, or frees it).
  void Put(Buffer buffer) {
    if (buffer.capacity() == 0 || buffer.capacity() > max_bytes_) return;
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < max_buffers_) {
      free_.push_back(std::move(buffer));
      since_.push_back(now);
      return;
    }
    auto smallest = std::min_element(
        free_.begin(), free_.end(),
        [](const Buffer& a, const Buffer& b) { return a.capacity() < b.capacity(); });
    if (smallest->capacity() < buffer.capacity()) {
      *smallest = std::move(buffer);
      since_[smallest - free_.begin()] = now;
    }
  }

  // Frees the buffers pooled for `idle` or longer, none having taken them:
  // those of one large request (a whole table pulled) would otherwise stay
  // with the process, and a memory budget's keeper counts them against its
  // rows. Returns the bytes freed.
  size_t ReleaseIdle(std::chrono::milliseconds idle,
                     std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
    std::vector<Buffer> idle_buffers;  // freed outside the lock
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = free_.size(); i-- > 0;) {
        if (now - since_[i] < idle) continue;
        idle_buffers.push_back(std::move(free_[i]));
        Remove(i);
      }
    }
    size_t bytes = 0;
    for (const Buffer& b : idle_buffers) bytes += b.capacity();
    return bytes;
  }

 private:
  using Clock = std::chrono::steady_clock;

  void Remove(size_t i) {  // under mu_
    free_[i] = std::move(free_.back());
    since_[i] = since_.back();
    free_.pop_back();
    since_.pop_back();
  }

  const size_t max_buffers_;
  const size_t max_bytes_;
  std::mutex mu_;
  std::vector<Buffer> free_;  // guarded by mu_
  // When each of free_ was put back; guarded by mu_.
  std::vector<Clock::time_point> since_;
};

}  // namespace net
}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_BUFFER_H_
