#include "native/core/disk_tier.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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
// Prefetch buffers above this size are freed when dropped: each stripe of
// each table has its own, so what they keep adds up (64 KiB: 4 MiB a table
// at most; at 1 MiB one pull of a whole table left 22 MiB kept, which a
// budget's keeper counts against the rows). A small batch's cold rows fit.
constexpr size_t kKeepPrefetchBytes = size_t{64} << 10;
// Bytes a resize reads per call, and stores per PutBatch where it does not
// build the new pages in memory.
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
  } else if (!read && f.passing_writes > 0 && f.failing_writes > 0) {
    --f.passing_writes;
  } else if (!read && f.failing_writes > 0) {
    --f.failing_writes;
    fault = f.write_errno;
  }
  faults_armed.store(AnyPending(f), std::memory_order_relaxed);
  return fault;
}

// Writes `n` bytes at `offset`, a 4 KiB page (or the part of one) per
// pwrite. A larger write makes the page cache hold the file in large
// folios (ext4, Linux 6.16 on), and every later small write into one walks
// all its blocks: measured here, a 56-byte pwrite (a demotion) cost 0.7 us
// into pages written 4 KiB at a time, 8 us into pages written 1 MiB at a
// time and 16 us after 32 MiB writes. Bulk writes (loads, resizes) pay a
// syscall per page instead (1.8 GB/s).
Status FullWrite(int fd, const char* data, size_t n, off_t offset, int* err) {
  while (n > 0) {
    const size_t piece = std::min(n, kDiskPage - static_cast<size_t>(offset) % kDiskPage);
    if (const int fault = TakeFault(false); fault != 0) {
      *err = fault;
      return Internal("write");
    }
    const ssize_t w = pwrite(fd, data, piece, offset);
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

// Whether any of the `n` fingerprints at `f` is `print`: a page's scan
// without an early exit, which the compiler vectorizes (most lookups match
// nothing: an absent id, or a row in its other page).
bool AnyEqual(const uint16_t* f, uint32_t n, uint16_t print) {
  uint32_t hits = 0;
  for (uint32_t s = 0; s < n; ++s) hits |= f[s] == print;
  return hits != 0;
}

// Reads of a tier file are random: no read-ahead. Sequential reads (a
// save's listing, a resize) would otherwise bring pages in as large folios,
// which make later small writes slow (see FullWrite): a 56-byte pwrite cost
// 17 us after 128 KiB reads with read-ahead, 0.9 us without.
void NoReadAhead(int fd) { (void)posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM); }

// A new file at `path`, read-write: whatever was there is unlinked first (a
// link, or a hard link planted to another file, is never opened through:
// O_TRUNC truncated what it named), and one made again meanwhile is an
// error (EEXIST), not followed.
int OpenNew(const std::string& path) {
  unlink(path.c_str());
  return open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
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
                   uint32_t num_buckets, size_t group_bytes)
    : path_(std::move(path)),
      record_bytes_(record_bytes),
      first_bucket_(first_bucket),
      num_buckets_(std::max<uint32_t>(num_buckets, 1)),
      group_bytes_(group_bytes),
      slot_bytes_(kSlotExtraBytes + record_bytes) {
  key_salt_ =
      Mix64(reinterpret_cast<uintptr_t>(this) ^
            static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  const Page page = PageFor(record_bytes);
  page_bytes_ = page.bytes;
  slots_per_page_ = page.slots;
  page_ram_bytes_ = page.ram_bytes;
}

TierFile::Page TierFile::PageFor(size_t record_bytes) {
  Page page;
  const size_t slot_bytes = kSlotExtraBytes + record_bytes;
  page.bytes = std::max(kDiskPage, RoundUpTo(kMinSlotsPerPage * slot_bytes, kDiskPage));
  page.slots = static_cast<uint32_t>(page.bytes / slot_bytes);
  page.ram_bytes = page.slots * kRamBytesPerSlot + (page.slots + 7) / 8 + sizeof(uint16_t);
  return page;
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
  fd_ = OpenNew(path_);
  if (fd_ < 0) return IoError("open", errno);
  NoReadAhead(fd_);
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
    // Not past what a file can hold (Open would refuse every Put): ignored,
    // as an open file ignores it.
    if (PagesFor(rows, 1) <= MaxPages()) size_hint_ = std::max(size_hint_, rows);
    return;
  }
  const uint64_t pages = PagesFor(rows, num_pages_);
  if (pages != num_pages_ && pages <= MaxPages()) {
    (void)Resize(static_cast<uint32_t>(pages));  // Put grows it (and reports) otherwise
  }
}

void TierFile::Window(uint32_t bucket, uint64_t pages, uint64_t* begin, uint64_t* width) const {
  *begin = 0;
  *width = pages;
  if (bucket < num_buckets_) {
    *begin = uint64_t{bucket} * pages / num_buckets_;
    *width = std::max<uint64_t>(1, (uint64_t{bucket} + 1) * pages / num_buckets_ - *begin);
  }
}

void TierFile::SetPages(uint32_t pages) {
  num_pages_ = pages;
  windows_.resize(size_t{num_buckets_} + 1);
  for (uint32_t b = 0; b <= num_buckets_; ++b) {
    windows_[b] = static_cast<uint32_t>(uint64_t{b} * pages / num_buckets_);
  }
}

void TierFile::Place(uint64_t hash, uint32_t* first, uint32_t* second,
                     uint16_t* fingerprint) const {
  // The pages of the row's bucket: [begin, begin + width). A bucket outside
  // the stripe's range (a table serving every bucket from one stripe's
  // view) gets the whole file.
  const uint32_t bucket = BucketOfHash(hash) - first_bucket_;  // wraps below the range
  uint64_t begin = 0, width = num_pages_;
  if (bucket < num_buckets_) {  // the windows Window computes, kept per file size
    begin = windows_[bucket];
    width = std::max<uint64_t>(1, windows_[bucket + 1] - begin);
  }
  // Two hash draws in [0, width), from bits the bucket does not use.
  *first = static_cast<uint32_t>(begin + (((hash >> 32) * width) >> 32));
  *second = static_cast<uint32_t>(begin + ((Mix64(hash ^ kSecondSalt) >> 32) * width >> 32));
  const auto print = static_cast<uint16_t>(Mix64(hash + kPrintSalt) >> 48);
  *fingerprint = print == 0 ? 1 : print;
}

void TierFile::ClearPrints(uint32_t pages) {
  fingerprints_.assign(size_t{pages} * slots_per_page_, 0);
  used_.assign(pages, 0);
  ghosts_.assign((size_t{pages} * slots_per_page_ + 63) / 64, 0);
}

void TierFile::GhostAll() {
  std::fill(ghosts_.begin(), ghosts_.end(), 0);
  for (uint32_t slot = 0; slot < fingerprints_.size(); ++slot) {
    if (fingerprints_[slot] != 0) MarkGhost(slot);
  }
  window_rows_ = 0;
}

void TierFile::NoteMovedOut(uint32_t slot, uint64_t window) {
  if (++window_rows_ > window) {  // a new window
    std::fill(ghosts_.begin(), ghosts_.end(), 0);
    window_rows_ = 1;
  }
  MarkGhost(slot);
}

void TierFile::PrefetchFingerprints(uint64_t hash) const {
  if (num_pages_ == 0) return;
  uint32_t pages[2];
  uint16_t print;
  Place(hash, &pages[0], &pages[1], &print);
  constexpr size_t kLine = 64;
  for (const uint32_t page : pages) {
    if (UsedIn(page) == 0) continue;  // (the counts are small: in cache)
    const char* f = reinterpret_cast<const char*>(&fingerprints_[size_t{page} * slots_per_page_]);
    const char* end = f + slots_per_page_ * sizeof(uint16_t);
    for (const char* line = f; line < end; line += kLine) __builtin_prefetch(line);
    __builtin_prefetch(end - 1);
  }
}

int64_t TierFile::KeyOf(const char* slot_data) const {
  uint64_t stored;
  std::memcpy(&stored, slot_data, sizeof(stored));
  return static_cast<int64_t>(stored ^ key_salt_);
}

uint16_t TierFile::GenerationAfter(const char* record) const {
  uint16_t generation;
  std::memcpy(&generation, record + record_bytes_, sizeof(generation));
  return generation;
}

void TierFile::FillSlot(char* to, int64_t key, const char* record, uint16_t generation) const {
  const uint64_t stored = static_cast<uint64_t>(key) ^ key_salt_;
  std::memcpy(to, &stored, sizeof(stored));
  std::memcpy(to + sizeof(key), record, record_bytes_);
  std::memcpy(to + sizeof(key) + record_bytes_, &generation, sizeof(generation));
}

size_t TierFile::SlotOffset(uint32_t slot) const {
  return size_t{slot / slots_per_page_} * page_bytes_ +
         size_t{slot % slots_per_page_} * slot_bytes_;
}

Status TierFile::CheckSlot(uint32_t slot, const char* data) const {
  const int64_t key = KeyOf(data);
  uint32_t first, second;
  uint16_t print;
  Place(Mix64(static_cast<uint64_t>(key)), &first, &second, &print);
  const uint32_t page = slot / slots_per_page_;
  if (print == fingerprints_[slot] && (page == first || page == second)) return OkStatus();
  read_errors_.fetch_add(1, std::memory_order_relaxed);
  return DataLoss("disk tier " + path_ + ": slot " + std::to_string(slot) + " holds id " +
                  std::to_string(key) +
                  ", which this shard never wrote there (the file was changed outside the "
                  "process, or the device returned other bytes): its rows cannot be trusted; "
                  "load a checkpoint");
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
  try {
    PrefetchSlots(hashes, rows, n);
  } catch (...) {  // (bad_alloc) no slot listed without its bytes
    DropPrefetched();
    throw;
  }
}

void TierFile::PrefetchSlots(const uint64_t* hashes, const uint32_t* rows, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t pages[2];
    uint16_t print;
    Place(hashes[rows[i]], &pages[0], &pages[1], &print);
    for (int c = 0; c < (pages[0] == pages[1] ? 1 : 2); ++c) {
      const uint32_t first = pages[c] * slots_per_page_;
      if (!AnyEqual(&fingerprints_[first], slots_per_page_, print)) continue;
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
  if (prefetch_data_.capacity() > kKeepPrefetchBytes) {
    // One big pull's buffers are not kept for the table's life (the keeper
    // counts only ram_bytes).
    std::vector<uint32_t>().swap(prefetched_);
    std::vector<char>().swap(prefetch_data_);
    return;
  }
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
    // (An empty page, as a load's pages are before its batch lands in them.)
    if (UsedIn(pages[c]) == 0) continue;
    const uint32_t first = pages[c] * slots_per_page_;
    if (!AnyEqual(&fingerprints_[first], slots_per_page_, print)) continue;
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
      if (KeyOf(buffer.data()) != key) {  // a fingerprint collision, or damage
        DLT_RETURN_IF_ERROR(CheckSlot(s, buffer.data()));
        continue;
      }
      std::memcpy(record, RecordOf(buffer.data()), record_bytes_);
      *slot = s;
      *generation = GenerationAfter(RecordOf(buffer.data()));
      return OkStatus();
    }
  }
  return OkStatus();
}

uint32_t TierFile::FreeSlot(uint64_t hash, uint16_t* fingerprint) const {
  const uint32_t page = EmptierPage(hash, fingerprint);
  const uint32_t used = UsedIn(page);
  if (used == slots_per_page_) return kNoSlot;
  // A page without removals fills its slots in order: the next is free.
  const uint32_t base = page * slots_per_page_;
  if (fingerprints_[base + used] == 0) return base + used;
  for (uint32_t s = base; s < base + slots_per_page_; ++s) {
    if (fingerprints_[s] == 0) return s;
  }
  return kNoSlot;
}

void TierFile::AdviseWrites(const uint64_t* hashes, size_t n) const {
  if (fd_ < 0) return;
  for (size_t i = 0; i < n; ++i) {
    uint16_t print;
    const uint32_t page = EmptierPage(hashes[i], &print);
    (void)posix_fadvise(fd_, static_cast<off_t>(size_t{page} * page_bytes_),
                        static_cast<off_t>(page_bytes_), POSIX_FADV_WILLNEED);
  }
}

Status TierFile::WriteSlot(uint32_t slot, int64_t key, const char* record, uint16_t generation) {
  thread_local std::vector<char> buffer;
  buffer.resize(slot_bytes_);
  FillSlot(buffer.data(), key, record, generation);
  const auto offset = static_cast<off_t>(SlotOffset(slot));
  int err = 0;
  if (!FullWrite(fd_, buffer.data(), slot_bytes_, offset, &err).ok()) {
    return WriteError("write", err);
  }
  return OkStatus();
}

Status TierFile::Put(uint64_t hash, int64_t key, const char* record, uint16_t generation,
                     uint32_t* placed) {
  DropPrefetched();  // slots written here may be among them
  if (fd_ < 0) DLT_RETURN_IF_ERROR(Open(size_hint_));
  if ((rows_ + 1) * kFillDen > uint64_t{num_pages_} * slots_per_page_ * kFillNum) {
    DLT_RETURN_IF_ERROR(Resize(num_pages_ * 2));
  }
  uint16_t print;
  uint32_t slot = FreeSlot(hash, &print);
  // Both pages full below the target fill (rows of a few buckets in a file
  // of few pages, where a bucket's two pages may be one): grow until they
  // are not, as PutBatch does (Resize refuses past the largest file).
  while (slot == kNoSlot) {
    DLT_RETURN_IF_ERROR(Resize(num_pages_ * 2));
    slot = FreeSlot(hash, &print);
  }
  DLT_RETURN_IF_ERROR(WriteSlot(slot, key, record, generation));
  SetPrint(slot, print);
  ++rows_;
  if (placed != nullptr) *placed = slot;
  return OkStatus();
}

void TierFile::SortByPage(std::vector<std::pair<uint32_t, uint32_t>>* placed) const {
  if (placed->empty()) return;
  uint32_t first = UINT32_MAX, last = 0;
  for (const auto& p : *placed) {
    first = std::min(first, p.first / slots_per_page_);
    last = std::max(last, p.first / slots_per_page_);
  }
  const size_t pages = size_t{last - first} + 1;
  if (pages > 4 * placed->size() + 1024) {  // spread thin: a comparison sort
    std::sort(placed->begin(), placed->end());
    return;
  }
  // A batch of a load fills a few bucket windows: a counting sort by page.
  std::vector<uint32_t> starts(pages + 1, 0);
  for (const auto& p : *placed) ++starts[p.first / slots_per_page_ - first + 1];
  for (size_t i = 1; i <= pages; ++i) starts[i] += starts[i - 1];
  std::vector<std::pair<uint32_t, uint32_t>> sorted(placed->size());
  for (const auto& p : *placed) sorted[starts[p.first / slots_per_page_ - first]++] = p;
  placed->swap(sorted);
}

Status TierFile::PutBatch(size_t n, const uint64_t* hashes, const int64_t* keys,
                          const char* records, const uint16_t* generations, uint32_t* slots) {
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
    for (const auto& [slot, row] : placed) SetPrint(slot, 0);
  };
  constexpr size_t kPlaceAhead = 8;
  for (size_t i = 0; i < n; ++i) {
    if (i + kPlaceAhead < n) PrefetchFingerprints(hashes[i + kPlaceAhead]);
    uint16_t print;
    uint32_t slot = FreeSlot(hashes[i], &print);
    if (slot == kNoSlot) {  // both pages full: grow, and place the batch anew
      unplace();
      placed.clear();
      DLT_RETURN_IF_ERROR(Resize(num_pages_ * 2));
      i = static_cast<size_t>(-1);
      continue;
    }
    SetPrint(slot, print);
    placed.emplace_back(slot, static_cast<uint32_t>(i));
  }
  SortByPage(&placed);
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
      FillSlot(buffer.data() + (SlotOffset(slot) - size_t{first} * page_bytes_), keys[row],
               records + size_t{row} * record_bytes_, generations[row]);
    }
    if (!FullWrite(fd_, buffer.data(), bytes, offset, &err).ok()) status = WriteError("write", err);
    k = end;
  }
  if (!status.ok()) {
    unplace();
    return status;
  }
  if (slots != nullptr) {
    for (const auto& [slot, row] : placed) slots[row] = slot;
  }
  rows_ += n;
  return OkStatus();
}

Status TierFile::Rewrite(uint32_t slot, int64_t key, const char* record, uint16_t generation) {
  DropPrefetched();
  return WriteSlot(slot, key, record, generation);
}

void TierFile::Remove(uint32_t slot) {
  if (fingerprints_[slot] == 0) return;
  SetPrint(slot, 0);
  --rows_;
}

size_t TierFile::RamBytesFor(uint64_t rows, bool ahead) const {
  rows = std::max(rows, rows_);
  const uint64_t pages = PagesFor(rows, num_pages_);
  return (ahead && NearDoubling(rows, pages) ? 2 : 1) * pages * PageRamBytes();
}

size_t TierFile::ram_bytes() const {
  return fingerprints_.capacity() * kRamBytesPerSlot + used_.capacity() * sizeof(uint16_t) +
         ghosts_.capacity() * sizeof(uint64_t);
}

bool TierFile::NearDoubling(uint64_t rows, uint64_t pages) const {
  return rows * kFillDen * 3 >= pages * slots_per_page_ * kFillNum * 2;
}

size_t TierFile::ram_bytes_ahead() const {
  return NearDoubling(rows_, num_pages_) ? 2 * size_t{num_pages_} * PageRamBytes() : ram_bytes();
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
    SetPages(pages);
    ClearPrints(pages);
    return OkStatus();
  }
  // Into a new file: the old one stays whole (and in use) if this fails.
  const std::string next_path = path_ + ".resize";
  const int next_fd = OpenNew(next_path);
  if (next_fd < 0) return IoError("open", errno);
  NoReadAhead(next_fd);
  const int alloc_err = posix_fallocate(next_fd, 0, bytes);
  if (alloc_err != 0) {
    close(next_fd);
    unlink(next_path.c_str());
    return WriteError("allocation", alloc_err);
  }
  TierFile next(next_path, record_bytes_, first_bucket_, num_buckets_, group_bytes_);
  next.key_salt_ = key_salt_;  // slots are copied as they are
  next.fd_ = next_fd;
  next.SetPages(pages);
  next.ClearPrints(pages);
  const Status copied = CopyInto(&next);
  if (!copied.ok()) {  // counted here: `next` goes
    if (next.write_errors() > 0) write_errors_.fetch_add(next.write_errors());
    if (next.read_errors() > 0) read_errors_.fetch_add(next.read_errors());
    return copied;
  }
  if (rename(next_path.c_str(), path_.c_str()) != 0) return IoError("rename", errno);
  close(fd_);
  fd_ = next.fd_;
  next.fd_ = -1;  // `next` no longer owns (or unlinks) the file
  SetPages(next.num_pages_);
  ++layout_;
  fingerprints_.swap(next.fingerprints_);
  used_.swap(next.used_);
  ghosts_.swap(next.ghosts_);  // carried over: the window goes on
  return OkStatus();
}

Status TierFile::CopyInto(TierFile* next) {
  const uint64_t new_pages = next->num_pages_;
  const uint64_t group_pages = std::max<size_t>(1, group_bytes_ / page_bytes_);
  std::vector<char> old_buffer, new_buffer;
  // Rows stored by PutBatch instead of through a group's buffer: `group`
  // holds those of the group being copied (all of them when its windows are
  // larger than a buffer), stored once its pages are written; `strays`
  // those of buckets outside the stripe's range (placed anywhere in the
  // file), stored once every group is written, so no group's buffer is
  // written over one of them.
  struct Rows {
    std::vector<uint64_t> hashes;
    std::vector<int64_t> keys;
    std::vector<char> records;
    std::vector<uint16_t> generations;
    std::vector<uint32_t> ghosts;  // indexes of rows moved out lately
  } group, strays;
  auto store = [&](Rows* rows) -> Status {
    std::vector<uint32_t> slots(rows->keys.size());
    const Status stored =
        next->PutBatch(rows->keys.size(), rows->hashes.data(), rows->keys.data(),
                       rows->records.data(), rows->generations.data(), slots.data());
    if (stored.ok()) {
      for (const uint32_t i : rows->ghosts) next->MarkGhost(slots[i]);
    }
    *rows = Rows{};
    if (stored.ok() && next->num_pages_ != new_pages) {  // it grew itself: the groups are off
      return Internal("disk tier " + path_ + ": a page overflowed while growing");
    }
    return stored;
  };
  uint64_t old_done = 0;  // old pages [0, old_done) are copied
  for (uint32_t bucket = 0; bucket < num_buckets_;) {
    // A group: bucket windows whose new pages fit in one buffer (at least
    // one window), and the old pages of those windows not copied yet.
    uint64_t first, width;
    Window(bucket, new_pages, &first, &width);
    uint64_t last = first + width;
    uint32_t end_bucket = bucket + 1;
    for (; end_bucket < num_buckets_; ++end_bucket) {
      uint64_t begin, pages;
      Window(end_bucket, new_pages, &begin, &pages);
      // A window sharing a page with the group (a file of fewer pages than
      // buckets) stays in it: groups never share a page.
      if (begin + pages - first > group_pages && begin >= last) break;
      last = std::max(last, begin + pages);
    }
    uint64_t old_first, old_width;
    Window(end_bucket - 1, num_pages_, &old_first, &old_width);
    const uint64_t old_end = std::max(old_done, old_first + old_width);
    const bool built = last - first <= group_pages;  // else every row goes through PutBatch
    if (built) new_buffer.assign((last - first) * page_bytes_, 0);
    bool placed_any = false;
    const uint64_t read_pages = std::max<size_t>(1, kResizeReadBytes / page_bytes_);
    for (uint64_t p = old_done; p < old_end; p += read_pages) {
      const uint64_t n = std::min(old_end - p, read_pages);
      old_buffer.resize(n * page_bytes_);
      DLT_RETURN_IF_ERROR(
          ReadPages(static_cast<uint32_t>(p), static_cast<uint32_t>(n), old_buffer.data()));
      for (uint64_t q = 0; q < n; ++q) {
        for (uint32_t s = 0; s < slots_per_page_; ++s) {
          const uint64_t slot = (p + q) * slots_per_page_ + s;
          if (fingerprints_[slot] == 0) continue;
          const char* data = SlotIn(old_buffer.data() + q * page_bytes_, s);
          DLT_RETURN_IF_ERROR(CheckSlot(static_cast<uint32_t>(slot), data));
          const int64_t key = KeyOf(data);
          const uint64_t hash = Mix64(static_cast<uint64_t>(key));
          const uint32_t rel = BucketOfHash(hash) - first_bucket_;  // wraps below the range
          const bool mine = rel >= bucket && rel < end_bucket;
          if (built && mine) {  // its two pages lie in the buffer
            uint16_t print;
            const uint32_t to = next->FreeSlot(hash, &print);
            if (to == kNoSlot) {  // both full at under half the fill: never seen
              return Internal("disk tier " + path_ + ": a page overflowed while growing");
            }
            std::memcpy(new_buffer.data() + (next->SlotOffset(to) - first * page_bytes_), data,
                        slot_bytes_);
            next->SetPrint(to, print);
            if (MovedOutLately(static_cast<uint32_t>(slot))) next->MarkGhost(to);
            ++next->rows_;
            placed_any = true;
            continue;
          }
          Rows& rows = mine ? group : strays;
          if (MovedOutLately(static_cast<uint32_t>(slot))) {
            rows.ghosts.push_back(static_cast<uint32_t>(rows.keys.size()));
          }
          rows.hashes.push_back(hash);
          rows.keys.push_back(key);
          rows.records.insert(rows.records.end(), RecordOf(data), RecordOf(data) + record_bytes_);
          rows.generations.push_back(GenerationAfter(RecordOf(data)));
          if (mine && group.keys.size() * slot_bytes_ >= kResizeReadBytes) {
            DLT_RETURN_IF_ERROR(store(&group));
          }
        }
      }
    }
    old_done = old_end;
    if (built && placed_any) {
      int err = 0;
      if (!FullWrite(next->fd_, new_buffer.data(), new_buffer.size(),
                     static_cast<off_t>(first * page_bytes_), &err)
               .ok()) {
        return next->WriteError("write", err);
      }
    }
    DLT_RETURN_IF_ERROR(store(&group));
    bucket = end_bucket;
  }
  return store(&strays);
}

}  // namespace dlt
