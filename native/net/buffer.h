// A growable byte buffer that never zero-fills (frames are fully written
// before they are read).
#ifndef TF_DLT_NATIVE_NET_BUFFER_H_
#define TF_DLT_NATIVE_NET_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace dlt {
namespace net {

class Buffer {
 public:
  // Returns storage for at least `bytes`; earlier contents are not kept.
  uint8_t* Reserve(size_t bytes) {
    if (bytes > capacity_) {
      // operator new[] aligns to 16, so 8-byte fields at 8-byte offsets of
      // the payload are aligned.
      data_.reset(new uint8_t[bytes]);
      capacity_ = bytes;
    }
    return data_.get();
  }
  uint8_t* data() { return data_.get(); }
  // Frees storage above `keep` bytes so one huge frame does not pin memory.
  void Trim(size_t keep) {
    if (capacity_ > keep) {
      data_.reset();
      capacity_ = 0;
    }
  }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t capacity_ = 0;
};

}  // namespace net
}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_BUFFER_H_
