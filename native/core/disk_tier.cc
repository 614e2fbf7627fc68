#include "native/core/disk_tier.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "native/core/routing.h"
#include "native/core/task_pool.h"

namespace dlt {
namespace {

// A tier grows (doubles) past this fill; the two-choice placement keeps a
// page from filling before its stripe does, well beyond it.
constexpr uint64_t kFillNum = 3, kFillDen = 4;
constexpr size_t kMinSlotsPerPage = 32;
constexpr size_t kDiskPage = 4096;
constexpr uint64_t kSecondSalt = 0x452821e638d01377ULL;
constexpr uint64_t kPrintSalt = 0xbe5466cf34e90c6cULL;
// Bytes a resize reads per call.
constexpr size_t kResizeReadBytes = size_t{1} << 20;

size_t RoundUpTo(size_t v, size_t to) { return (v + to - 1) / to * to; }

// An errno-like code of FullRead: the file ended before the bytes asked for.
constexpr int kShortRead = -1;

std::mutex fault_mu;
DiskFaults pending_faults;              // guarded by fault_mu
std::atomic<bool> faults_armed{false};  // any pending: checked on every I/O

bool AnyPending(const DiskFaults& f) {
  return f.failing_reads + f.short_reads + f.failing_writes > 0;
}

// One injected fault for a read (or a write) about to run: 0 (none), an
// errno, or kShortRead.
int TakeFault(bool read) {
  if (!faults_armed.load(std::memory_order_relaxed)) return 0;
  std::lock_guard<std::mutex> lock(fault_mu);
  DiskFaults& f = pending_faults;
  int fault = 0;
  if (read && f.failing_reads > 0) {
    --f.failing_reads;
    fault = f.read_errno;
  } else if (read && f.short_reads > 0) {
    --f.short_reads;
    fault = kShortRead;
  } else if (!read && f.failing_writes > 0) {
    --f.failing_writes;
    fault = f.write_errno;
  }
  faults_armed.store(AnyPending(f), std::memory_order_relaxed);
  return fault;
}

Status FullWrite(int fd, const char* data, size_t n, off_t offset, int* err) {
  if (const int fault = TakeFault(false); fault != 0) {
    *err = fault;
    return Internal("write");
  }
  while (n > 0) {
    const ssize_t w = pwrite(fd, data, n, offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return Internal("write");
    }
    data += w;
    n -= static_cast<size_t>(w);
    offset += w;
  }
  return OkStatus();
}

Status FullRead(int fd, char* data, size_t n, off_t offset, int* err) {
  const int fault = TakeFault(true);
  if (fault > 0) {
    *err = fault;
    return Internal("read");
  }
  while (n > 0) {
    // An injected short read: half the bytes, then the end of the file.
    const ssize_t r = fault == kShortRead && n > 1 ? pread(fd, data, n / 2, offset)
                      : fault == kShortRead        ? 0
                                                   : pread(fd, data, n, offset);
    if (r < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return Internal("read");
    }
    if (r == 0) {  // past the end: the file was truncated under us
      *err = kShortRead;
      return Internal("read");
    }
    data += r;
    n -= static_cast<size_t>(r);
    offset += r;
    if (fault == kShortRead) {
      *err = kShortRead;
      return Internal("read");
    }
  }
  return OkStatus();
}

// Threads that run the cold reads of a batch at once (a device serves many
// reads in flight far faster than one after another).
TaskPool& ReadPool() {
  static TaskPool* pool = TaskPool::Create(16);
  return *pool;
}

}  // namespace

void InjectDiskFaults(const DiskFaults& faults) {
  std::lock_guard<std::mutex> lock(fault_mu);
  pending_faults = faults;
  faults_armed.store(AnyPending(faults), std::memory_order_relaxed);
}

TierFile::TierFile(std::string path, size_t record_bytes, uint32_t first_bucket,
                   uint32_t num_buckets)
    : path_(std::move(path)),
      record_bytes_(record_bytes),
      first_bucket_(first_bucket),
      num_buckets_(std::max<uint32_t>(num_buckets, 1)),
      slot_bytes_(sizeof(int64_t) + record_bytes),
      page_bytes_(std::max(kDiskPage, RoundUpTo(kMinSlotsPerPage * slot_bytes_, kDiskPage))) {
  slots_per_page_ = static_cast<uint32_t>(page_bytes_ / slot_bytes_);
}

TierFile::~TierFile() {
  if (fd_ >= 0) {
    close(fd_);
    unlink(path_.c_str());
  }
}

Status TierFile::ReadError(int err) const {
  read_errors_.fetch_add(1, std::memory_order_relaxed);
  if (err == kShortRead) {
    return Internal("disk tier read failed for " + path_ +
                    ": the file ends before the row (truncated?)");
  }
  return IoError("read", err);
}

Status TierFile::WriteError(const char* what, int err) const {
  write_errors_.fetch_add(1, std::memory_order_relaxed);
  return IoError(what, err);
}

Status TierFile::IoError(const char* what, int err) const {
  const std::string message =
      std::string("disk tier ") + what + " failed for " + path_ + ": " + std::strerror(err);
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) return ResourceExhausted(message);
  return Internal(message);
}

uint64_t TierFile::PagesFor(uint64_t rows, uint64_t pages) const {
  pages = std::max<uint64_t>(pages, 1);
  while (pages * slots_per_page_ * kFillNum < rows * kFillDen) pages *= 2;
  return pages;
}

Status TierFile::Open(uint64_t rows) {
  const uint64_t pages = PagesFor(rows, 1);
  if (pages > MaxPages()) {
    return InvalidArgument("disk tier " + path_ + " cannot hold " + std::to_string(rows) + " rows");
  }
  fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd_ < 0) return IoError("open", errno);
  const Status sized = Resize(static_cast<uint32_t>(pages));
  if (!sized.ok()) {  // closed again, so a later Put retries
    close(fd_);
    unlink(path_.c_str());
    fd_ = -1;
  }
  return sized;
}

void TierFile::Reserve(uint64_t rows) {
  if (fd_ < 0) {
    size_hint_ = std::max(size_hint_, rows);
    return;
  }
  const uint64_t pages = PagesFor(rows, num_pages_);
  if (pages != num_pages_ && pages <= MaxPages()) {
    (void)Resize(static_cast<uint32_t>(pages));  // Put grows it (and reports) otherwise
  }
}

void TierFile::Place(uint64_t hash, uint32_t* first, uint32_t* second,
                     uint16_t* fingerprint) const {
  // The pages of the row's bucket: [begin, begin + width). A bucket outside
  // the stripe's range (a table serving every bucket from one stripe's
  // view) gets the whole file.
  const uint32_t bucket = BucketOfHash(hash) - first_bucket_;  // wraps when below the range
  uint64_t begin = 0, width = num_pages_;
  if (bucket < num_buckets_) {
    begin = uint64_t{bucket} * num_pages_ / num_buckets_;
    width = std::max<uint64_t>(1, (uint64_t{bucket} + 1) * num_pages_ / num_buckets_ - begin);
  }
  // Two hash draws in [0, width), from bits the bucket does not use.
  *first = static_cast<uint32_t>(begin + (((hash >> 32) * width) >> 32));
  *second = static_cast<uint32_t>(begin + ((Mix64(hash ^ kSecondSalt) >> 32) * width >> 32));
  const auto print = static_cast<uint16_t>(Mix64(hash + kPrintSalt) >> 48);
  *fingerprint = print == 0 ? 1 : print;
}

uint32_t TierFile::UsedIn(uint32_t page) const {
  const uint16_t* f = fingerprints_.data() + size_t{page} * slots_per_page_;
  uint32_t used = 0;
  for (uint32_t s = 0; s < slots_per_page_; ++s) used += f[s] != 0;
  return used;
}

int64_t TierFile::KeyOf(const char* slot_data) {
  int64_t key;
  std::memcpy(&key, slot_data, sizeof(key));
  return key;
}

size_t TierFile::SlotOffset(uint32_t slot) const {
  return size_t{slot / slots_per_page_} * page_bytes_ +
         size_t{slot % slots_per_page_} * slot_bytes_;
}

Status TierFile::ReadSlot(uint32_t slot, char* buffer) const {
  int err = 0;
  if (!FullRead(fd_, buffer, slot_bytes_, static_cast<off_t>(SlotOffset(slot)), &err).ok()) {
    return ReadError(err);
  }
  return OkStatus();
}

Status TierFile::ReadPages(uint32_t first, uint32_t n, char* buffer) const {
  int err = 0;
  if (!FullRead(fd_, buffer, size_t{n} * page_bytes_,
                static_cast<off_t>(size_t{first} * page_bytes_), &err)
           .ok()) {
    return ReadError(err);
  }
  return OkStatus();
}

void TierFile::Prefetch(const uint64_t* hashes, const uint32_t* rows, size_t n) {
  DropPrefetched();
  // Injected faults are met by the Finds' own reads.
  if (rows_ == 0 || fd_ < 0 || faults_armed.load(std::memory_order_relaxed)) return;
  for (size_t i = 0; i < n; ++i) {
    uint32_t pages[2];
    uint16_t print;
    Place(hashes[rows[i]], &pages[0], &pages[1], &print);
    for (int c = 0; c < (pages[0] == pages[1] ? 1 : 2); ++c) {
      const uint32_t first = pages[c] * slots_per_page_;
      for (uint32_t s = first; s < first + slots_per_page_; ++s) {
        if (fingerprints_[s] == print) prefetched_.push_back(s);
      }
    }
  }
  std::sort(prefetched_.begin(), prefetched_.end());
  prefetched_.erase(std::unique(prefetched_.begin(), prefetched_.end()), prefetched_.end());
  if (prefetched_.size() < 2) {  // nothing to overlap
    prefetched_.clear();
    return;
  }
  prefetch_data_.resize(prefetched_.size() * slot_bytes_);
  // The reads spread over the read pool's threads (and this one); a slot
  // whose read fails or comes back short is dropped: its Find reads it
  // again, and reports.
  std::vector<char> ok(prefetched_.size(), 0);
  ReadPool().ParallelFor(prefetched_.size(), [&](size_t j) {
    const ssize_t r = pread(fd_, prefetch_data_.data() + j * slot_bytes_, slot_bytes_,
                            static_cast<off_t>(SlotOffset(prefetched_[j])));
    ok[j] = r == static_cast<ssize_t>(slot_bytes_);
  });
  size_t kept = 0;
  for (size_t j = 0; j < prefetched_.size(); ++j) {
    if (!ok[j]) continue;
    if (kept != j) {
      prefetched_[kept] = prefetched_[j];
      std::memmove(prefetch_data_.data() + kept * slot_bytes_,
                   prefetch_data_.data() + j * slot_bytes_, slot_bytes_);
    }
    ++kept;
  }
  prefetched_.resize(kept);
}

void TierFile::DropPrefetched() {
  prefetched_.clear();
  prefetch_data_.clear();
}

Status TierFile::Find(uint64_t hash, int64_t key, char* record, uint32_t* slot,
                      uint16_t* generation) {
  *slot = kNoSlot;
  if (rows_ == 0) return OkStatus();
  uint32_t pages[2];
  uint16_t print;
  Place(hash, &pages[0], &pages[1], &print);
  thread_local std::vector<char> buffer;
  buffer.resize(slot_bytes_);
  for (int c = 0; c < (pages[0] == pages[1] ? 1 : 2); ++c) {
    const uint32_t first = pages[c] * slots_per_page_;
    for (uint32_t s = first; s < first + slots_per_page_; ++s) {
      if (fingerprints_[s] != print) continue;
      reads_.fetch_add(1, std::memory_order_relaxed);
      const auto hit = std::lower_bound(prefetched_.begin(), prefetched_.end(), s);
      if (hit != prefetched_.end() && *hit == s) {
        std::memcpy(buffer.data(),
                    prefetch_data_.data() + size_t(hit - prefetched_.begin()) * slot_bytes_,
                    slot_bytes_);
      } else {
        DLT_RETURN_IF_ERROR(ReadSlot(s, buffer.data()));
      }
      if (KeyOf(buffer.data()) != key) continue;  // a fingerprint collision
      std::memcpy(record, RecordOf(buffer.data()), record_bytes_);
      *slot = s;
      *generation = generations_[s];
      return OkStatus();
    }
  }
  return OkStatus();
}

uint32_t TierFile::FreeSlot(uint64_t hash, uint16_t* fingerprint) const {
  uint32_t first, second;
  Place(hash, &first, &second, fingerprint);
  const uint32_t page = UsedIn(second) < UsedIn(first) ? second : first;
  const uint32_t base = page * slots_per_page_;
  for (uint32_t s = base; s < base + slots_per_page_; ++s) {
    if (fingerprints_[s] == 0) return s;
  }
  return kNoSlot;
}

Status TierFile::WriteSlot(uint32_t slot, int64_t key, const char* record) {
  thread_local std::vector<char> buffer;
  buffer.resize(slot_bytes_);
  std::memcpy(buffer.data(), &key, sizeof(key));
  std::memcpy(buffer.data() + sizeof(key), record, record_bytes_);
  const auto offset = static_cast<off_t>(SlotOffset(slot));
  int err = 0;
  if (!FullWrite(fd_, buffer.data(), slot_bytes_, offset, &err).ok()) {
    return WriteError("write", err);
  }
  return OkStatus();
}

Status TierFile::Put(uint64_t hash, int64_t key, const char* record, uint16_t generation) {
  DropPrefetched();  // slots written here may be among them
  if (fd_ < 0) DLT_RETURN_IF_ERROR(Open(size_hint_));
  if ((rows_ + 1) * kFillDen > uint64_t{num_pages_} * slots_per_page_ * kFillNum) {
    DLT_RETURN_IF_ERROR(Resize(num_pages_ * 2));
  }
  uint16_t print;
  uint32_t slot = FreeSlot(hash, &print);
  if (slot == kNoSlot) {  // both pages full well below the target fill: rare
    DLT_RETURN_IF_ERROR(Resize(num_pages_ * 2));
    slot = FreeSlot(hash, &print);
    if (slot == kNoSlot) return Internal("disk tier " + path_ + ": no free slot after growing");
  }
  DLT_RETURN_IF_ERROR(WriteSlot(slot, key, record));
  fingerprints_[slot] = print;
  generations_[slot] = generation;
  ++rows_;
  return OkStatus();
}

Status TierFile::PutBatch(size_t n, const uint64_t* hashes, const int64_t* keys,
                          const char* records, const uint16_t* generations) {
  if (n == 0) return OkStatus();
  DropPrefetched();
  if (fd_ < 0) DLT_RETURN_IF_ERROR(Open(std::max<uint64_t>(size_hint_, rows_ + n)));
  while ((rows_ + n) * kFillDen > uint64_t{num_pages_} * slots_per_page_ * kFillNum) {
    DLT_RETURN_IF_ERROR(Resize(num_pages_ * 2));
  }
  // Slots first (RAM only), then the writes in slot order.
  std::vector<std::pair<uint32_t, uint32_t>> placed;  // (slot, row)
  placed.reserve(n);
  auto unplace = [&]() {
    for (const auto& [slot, row] : placed) fingerprints_[slot] = 0;
  };
  for (size_t i = 0; i < n; ++i) {
    uint16_t print;
    uint32_t slot = FreeSlot(hashes[i], &print);
    if (slot == kNoSlot) {  // both pages full: grow, and place the batch anew
      unplace();
      placed.clear();
      DLT_RETURN_IF_ERROR(Resize(num_pages_ * 2));
      i = static_cast<size_t>(-1);
      continue;
    }
    fingerprints_[slot] = print;
    placed.emplace_back(slot, static_cast<uint32_t>(i));
  }
  std::sort(placed.begin(), placed.end());
  // A page held rows before this batch when it has a used slot the batch
  // did not place: `mine` counts the batch's slots per page of a run.
  constexpr size_t kRunBytes = size_t{1} << 20;
  const uint32_t run_pages = static_cast<uint32_t>(std::max<size_t>(1, kRunBytes / page_bytes_));
  std::vector<char> buffer;
  Status status;
  for (size_t k = 0; k < placed.size() && status.ok();) {
    const uint32_t first = placed[k].first / slots_per_page_;
    uint32_t last = first;  // the run: consecutive touched pages, at most run_pages
    size_t end = k;
    bool read_first = false;
    while (end < placed.size()) {
      const uint32_t page = placed[end].first / slots_per_page_;
      if (page > last + 1 || page - first >= run_pages) break;
      last = page;
      size_t mine = 0;
      while (end < placed.size() && placed[end].first / slots_per_page_ == page) ++mine, ++end;
      read_first |= UsedIn(page) > mine;
    }
    const size_t bytes = size_t{last - first + 1} * page_bytes_;
    buffer.assign(bytes, 0);
    const off_t offset = static_cast<off_t>(size_t{first} * page_bytes_);
    int err = 0;
    if (read_first && !FullRead(fd_, buffer.data(), bytes, offset, &err).ok()) {
      status = ReadError(err);
      break;
    }
    for (size_t j = k; j < end; ++j) {
      const auto [slot, row] = placed[j];
      char* to = buffer.data() + (SlotOffset(slot) - size_t{first} * page_bytes_);
      std::memcpy(to, &keys[row], sizeof(int64_t));
      std::memcpy(to + sizeof(int64_t), records + size_t{row} * record_bytes_, record_bytes_);
    }
    if (!FullWrite(fd_, buffer.data(), bytes, offset, &err).ok()) status = WriteError("write", err);
    k = end;
  }
  if (!status.ok()) {
    unplace();
    return status;
  }
  for (const auto& [slot, row] : placed) generations_[slot] = generations[row];
  rows_ += n;
  return OkStatus();
}

Status TierFile::Rewrite(uint32_t slot, int64_t key, const char* record, uint16_t generation) {
  DropPrefetched();
  DLT_RETURN_IF_ERROR(WriteSlot(slot, key, record));
  generations_[slot] = generation;
  return OkStatus();
}

void TierFile::Remove(uint32_t slot) {
  if (fingerprints_[slot] == 0) return;
  fingerprints_[slot] = 0;
  --rows_;
}

size_t TierFile::RamBytesFor(uint64_t rows) const {
  return PagesFor(std::max(rows, rows_), num_pages_) * slots_per_page_ * 2 * sizeof(uint16_t);
}

size_t TierFile::ram_bytes() const {
  return fingerprints_.capacity() * sizeof(uint16_t) + generations_.capacity() * sizeof(uint16_t);
}

Status TierFile::Resize(uint32_t pages) {
  DropPrefetched();  // slots move
  if (pages == 0 || pages > MaxPages()) {
    return ResourceExhausted("disk tier " + path_ + " cannot grow past " +
                             std::to_string(num_pages_) + " pages");
  }
  const off_t bytes = static_cast<off_t>(size_t{pages} * page_bytes_);
  if (num_pages_ == 0) {
    const int err = posix_fallocate(fd_, 0, bytes);
    if (err != 0) return WriteError("allocation", err);
    num_pages_ = pages;
    fingerprints_.assign(size_t{pages} * slots_per_page_, 0);
    generations_.assign(size_t{pages} * slots_per_page_, 0);
    return OkStatus();
  }
  // Into a new file: the old one stays whole (and in use) if this fails.
  const std::string next_path = path_ + ".resize";
  const int next_fd = open(next_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (next_fd < 0) return IoError("open", errno);
  const int alloc_err = posix_fallocate(next_fd, 0, bytes);
  if (alloc_err != 0) {
    close(next_fd);
    unlink(next_path.c_str());
    return WriteError("allocation", alloc_err);
  }
  TierFile next(next_path, record_bytes_, first_bucket_, num_buckets_);
  next.fd_ = next_fd;
  next.num_pages_ = pages;
  next.fingerprints_.assign(size_t{pages} * slots_per_page_, 0);
  next.generations_.assign(size_t{pages} * slots_per_page_, 0);
  const uint32_t batch = static_cast<uint32_t>(std::max<size_t>(1, kResizeReadBytes / page_bytes_));
  std::vector<char> buffer(size_t{batch} * page_bytes_);
  for (uint32_t first = 0; first < num_pages_; first += batch) {
    const uint32_t n = std::min(batch, num_pages_ - first);
    DLT_RETURN_IF_ERROR(ReadPages(first, n, buffer.data()));
    for (uint32_t p = 0; p < n; ++p) {
      const char* page = buffer.data() + size_t{p} * page_bytes_;
      for (uint32_t s = 0; s < slots_per_page_; ++s) {
        const uint32_t slot = (first + p) * slots_per_page_ + s;
        if (fingerprints_[slot] == 0) continue;
        const int64_t key = KeyOf(SlotIn(page, s));
        uint16_t print;
        const uint32_t to = next.FreeSlot(Mix64(static_cast<uint64_t>(key)), &print);
        if (to == TierFile::kNoSlot) {
          return Internal("disk tier " + path_ + ": a page overflowed while growing");
        }
        const Status wrote = next.WriteSlot(to, key, RecordOf(SlotIn(page, s)));
        if (!wrote.ok()) {  // counted here: `next` goes
          write_errors_.fetch_add(1, std::memory_order_relaxed);
          return wrote;
        }
        next.fingerprints_[to] = print;
        next.generations_[to] = generations_[slot];
        ++next.rows_;
      }
    }
  }
  if (rename(next_path.c_str(), path_.c_str()) != 0) return IoError("rename", errno);
  close(fd_);
  fd_ = next.fd_;
  next.fd_ = -1;  // `next` no longer owns (or unlinks) the file
  num_pages_ = pages;
  ++layout_;
  fingerprints_.swap(next.fingerprints_);
  generations_.swap(next.generations_);
  return OkStatus();
}

}  // namespace dlt
