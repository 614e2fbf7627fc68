// The disk tier of one table stripe: the stripe's cold rows in a file of
// fixed-size pages on local SSD (docs/tiered_storage.md). An id's place is
// computed from its hash (two candidate pages, the emptier one takes a new
// row), so the only RAM a cold row costs is its slot's 16-bit fingerprint;
// the row's id, record and 16-bit change generation are in the slot on disk.
// Occupancy lives in RAM only: freeing a slot (a promotion
// or a removal) never writes to disk, and a lookup reads just the slots whose
// fingerprint matches. Not thread-safe: the stripe's lock guards it. The file
// is a cache of the shard's own state, unlinked when the tier goes; no TF or
// Python headers.
#ifndef TF_DLT_NATIVE_CORE_DISK_TIER_H_
#define TF_DLT_NATIVE_CORE_DISK_TIER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "native/core/routing.h"
#include "native/core/status.h"

namespace dlt {

// Faults injected into every tier file's reads and writes, for tests: the
// next `failing_reads` reads fail with `read_errno`, then the next
// `short_reads` find the file ending before the row (as if truncated), and
// after `passing_writes` writes the next `failing_writes` fail with
// `write_errno`. A write is one pwrite: a slot across a 4 KiB boundary is
// written in two, so its second can fail after its first went in.
struct DiskFaults {
  int failing_reads = 0;
  int read_errno = 5;  // EIO
  int short_reads = 0;
  int passing_writes = 0;
  int failing_writes = 0;
  int write_errno = 28;  // ENOSPC
};
// Arms `faults` in place of any still pending (all zero: none).
void InjectDiskFaults(const DiskFaults& faults);

class TierFile {
 public:
  static constexpr uint32_t kNoSlot = 0xffffffffu;
  // RAM per slot (the fingerprint), and the bytes a slot holds on disk
  // besides the record: the id before it, the generation after it, and 2
  // bytes of padding (records are multiples of 8 bytes), so every record
  // in a page read into memory is 4-byte aligned, as its header's fields
  // are read.
  static constexpr size_t kRamBytesPerSlot = sizeof(uint16_t);
  static constexpr size_t kSlotExtraBytes = sizeof(int64_t) + 2 * sizeof(uint16_t);
  // A page of records of `record_bytes`: its bytes on disk, its slots, and
  // the RAM it costs (its slots' fingerprints and ghost bits, its count).
  struct Page {
    size_t bytes;
    uint32_t slots;
    size_t ram_bytes;
  };
  static Page PageFor(size_t record_bytes);

  // A tier at `path` (created, or truncated if it exists) for records of
  // `record_bytes` of ids in routing buckets [first_bucket, first_bucket +
  // num_buckets) (its stripe's); nothing is allocated until Open. A row's
  // two candidate pages lie in its bucket's window of the file (the
  // buckets split the pages in order), so rows arriving in bucket order,
  // as a checkpoint's do, fill the file from front to back: a load writes
  // it about sequentially, each page while it is in the page cache.
  // `group_bytes`: the most bytes of new pages a resize builds in memory
  // before writing them (tests set less).
  TierFile(std::string path, size_t record_bytes, uint32_t first_bucket = 0,
           uint32_t num_buckets = kNumBuckets, size_t group_bytes = kResizeGroupBytes);
  static constexpr size_t kResizeGroupBytes = size_t{32} << 20;
  ~TierFile();  // closes and unlinks the file
  TierFile(const TierFile&) = delete;
  TierFile& operator=(const TierFile&) = delete;

  // Creates the file with room for `rows` rows at the target fill.
  // RESOURCE_EXHAUSTED when the disk is full, INTERNAL on other I/O errors.
  // Put opens the file itself when it is not open.
  Status Open(uint64_t rows);
  // Pages of a file with room for `rows` rows at the target fill, at least
  // `pages`.
  uint64_t PagesFor(uint64_t rows, uint64_t pages) const;
  // Room for `rows` rows: the size the file opens with, or (best effort) a
  // resize of an open file.
  void Reserve(uint64_t rows);

  // Looks `key` up (`hash` is Mix64 of it). When found, copies its record
  // into `record` (record_bytes), its slot into *slot and its generation
  // into *generation; *slot is kNoSlot when absent.
  Status Find(uint64_t hash, int64_t key, char* record, uint32_t* slot, uint16_t* generation);
  // Reads, all at once (in parallel on a pool of read threads), every slot a
  // Find of these rows would read (those whose fingerprint matches), and
  // keeps them until DropPrefetched: the Finds that follow read memory, so
  // a pull of many cold rows waits about one device round trip, not one
  // per row. Faults and errors surface on those Finds.
  void Prefetch(const uint64_t* hashes, const uint32_t* rows, size_t n);
  // Forgets them (their buffers freed past 1 MiB).
  void DropPrefetched();
  // Brings the fingerprints of `hash`'s two candidate pages into the CPU
  // cache (a hint, no I/O): a loop over many rows calls it some rows ahead
  // of their Find or placement.
  void PrefetchFingerprints(uint64_t hash) const;
  // Asks the kernel to read in, without waiting, the page each of these
  // rows would be stored in by a Put now (a hint, no error): a write of a
  // slot into a page not in the page cache first reads the page, so a
  // batch of Puts that follows waits about one device round trip, not one
  // per row. Costs a page-cache lookup a row when the pages are cached.
  void AdviseWrites(const uint64_t* hashes, size_t n) const;
  // Stores a row that is absent from the tier; grows the file when both
  // candidate pages are full or the tier passes its target fill.
  // *slot (when given) gets the slot it took.
  Status Put(uint64_t hash, int64_t key, const char* record, uint16_t generation,
             uint32_t* slot = nullptr);
  // Stores `n` rows absent from the tier (and distinct): hashes[i], keys[i],
  // the record at records + i * record_bytes, generations[i]. Places them
  // as Put does, then writes each run of consecutive pages it touched with
  // one pwrite (reading a run first only where it holds other rows), so
  // rows in bucket order cost a sequential write, not a write per row. On
  // an error none of the `n` rows is stored.
  // `slots` (optional): where each row went.
  Status PutBatch(size_t n, const uint64_t* hashes, const int64_t* keys, const char* records,
                  const uint16_t* generations, uint32_t* slots = nullptr);
  // Notes that `slot` was just given a row moved out of RAM (Put by the
  // memory keeper); a window closes after `window` such rows.
  void NoteMovedOut(uint32_t slot, uint64_t window);
  // Makes every row a ghost (as if moved out now), in a new window.
  void GhostAll();
  // Whether `slot`'s row was moved out of RAM in the current window: RAM
  // held it lately (a ghost, as ARC keeps), so LRU would have kept it. A
  // resize forgets.
  bool MovedOutLately(uint32_t slot) const { return (ghosts_[slot >> 6] & GhostBit(slot)) != 0; }
  // Overwrites the record in `slot` (found by Find) with `record`.
  Status Rewrite(uint32_t slot, int64_t key, const char* record, uint16_t generation);
  // Frees `slot` (RAM only).
  void Remove(uint32_t slot);

  // Slots, for iteration: a slot is in use when Used(slot).
  uint32_t slots() const { return static_cast<uint32_t>(fingerprints_.size()); }
  bool Used(uint32_t slot) const { return fingerprints_[slot] != 0; }
  uint32_t slots_per_page() const { return slots_per_page_; }
  // Reads pages [first, first + n) into `buffer` (n * page_bytes()).
  Status ReadPages(uint32_t first, uint32_t n, char* buffer) const;
  // The slot data (key, record, generation) of slot `s` of a page read by
  // ReadPages.
  const char* SlotIn(const char* page, uint32_t s) const { return page + size_t{s} * slot_bytes_; }
  // The id slot data holds (stored XOR this file's random salt: zeroed or
  // overwritten bytes read as an id CheckSlot refuses, never as id 0).
  int64_t KeyOf(const char* slot_data) const;
  static const char* RecordOf(const char* slot_data) { return slot_data + sizeof(int64_t); }
  // The generation stored after `record` (RecordOf a slot's data).
  uint16_t GenerationAfter(const char* record) const;
  // Reads slot `slot` (key, record, generation) into `buffer` (slot_bytes()).
  Status ReadSlot(uint32_t slot, char* buffer) const;
  // DATA_LOSS unless used slot `slot`'s bytes `data` hold an id this file
  // would have placed there (its fingerprint, one of its two pages): the
  // file was changed outside this process (zeroed, overwritten) or the
  // device returned other bytes. Counted as a read error.
  Status CheckSlot(uint32_t slot, const char* data) const;

  uint32_t pages() const { return num_pages_; }
  // Bumped by every resize (slots move).
  uint64_t layout() const { return layout_; }
  size_t page_bytes() const { return page_bytes_; }
  size_t slot_bytes() const { return slot_bytes_; }
  uint64_t rows() const { return rows_; }
  // RAM the tier holds (per slot a fingerprint and a ghost bit, per page a
  // count of used slots).
  size_t ram_bytes() const;
  // The same once the file doubles, from 2/3 of the fill that doubles it
  // on: what the memory keeper makes room for before the doubling.
  size_t ram_bytes_ahead() const;
  // The RAM it would hold once sized for `rows` rows (Open or Reserve);
  // with `ahead`, as ram_bytes_ahead counts it once it holds them.
  size_t RamBytesFor(uint64_t rows, bool ahead = false) const;
  // Bytes of the file.
  size_t disk_bytes() const { return size_t{num_pages_} * page_bytes_; }
  // Slot reads (lookups and iteration) since creation.
  uint64_t reads() const { return reads_.load(std::memory_order_relaxed); }
  // Reads and writes (allocations included) that failed since creation.
  uint64_t read_errors() const { return read_errors_.load(std::memory_order_relaxed); }
  uint64_t write_errors() const { return write_errors_.load(std::memory_order_relaxed); }
  const std::string& path() const { return path_; }

 private:
  // The most pages a file may have (slot numbers stay below 2^31).
  uint64_t MaxPages() const { return (uint64_t{1} << 31) / slots_per_page_; }
  // The two candidate pages and the fingerprint of a hash.
  void Place(uint64_t hash, uint32_t* first, uint32_t* second, uint16_t* fingerprint) const;
  // The candidate page a new row of `hash` takes now: the emptier one.
  uint32_t EmptierPage(uint64_t hash, uint16_t* fingerprint) const {
    uint32_t first, second;
    Place(hash, &first, &second, fingerprint);
    return UsedIn(second) < UsedIn(first) ? second : first;
  }
  uint32_t UsedIn(uint32_t page) const { return used_[page]; }
  // Whether `rows` rows in `pages` pages are 2/3 of the 3/4 fill past
  // which Put doubles the file.
  bool NearDoubling(uint64_t rows, uint64_t pages) const;
  // RAM a page costs: its slots' fingerprints and ghost bits, and its count.
  size_t PageRamBytes() const { return page_ram_bytes_; }
  // Sets slot `slot`'s fingerprint (0: frees it), counting its page's slots.
  void SetPrint(uint32_t slot, uint16_t print) {
    uint16_t& f = fingerprints_[slot];
    used_[slot / slots_per_page_] += (print != 0) - (f != 0);
    f = print;
    ghosts_[slot >> 6] &= ~GhostBit(slot);  // a new row, or none
  }
  static uint64_t GhostBit(uint32_t slot) { return uint64_t{1} << (slot & 63); }
  void MarkGhost(uint32_t slot) { ghosts_[slot >> 6] |= GhostBit(slot); }
  // Sizes the fingerprints and page counts for `pages` pages, all free.
  void ClearPrints(uint32_t pages);
  // Orders (slot, row) pairs by page (slots of a page in any order).
  void SortByPage(std::vector<std::pair<uint32_t, uint32_t>>* placed) const;
  // Prefetch's listing and reads (Prefetch drops them when it throws).
  void PrefetchSlots(const uint64_t* hashes, const uint32_t* rows, size_t n);
  // A free slot of the emptier candidate page, or kNoSlot.
  uint32_t FreeSlot(uint64_t hash, uint16_t* fingerprint) const;
  Status WriteSlot(uint32_t slot, int64_t key, const char* record, uint16_t generation);
  // Lays a slot's data (key, record, generation) out at `to`.
  void FillSlot(char* to, int64_t key, const char* record, uint16_t generation) const;
  // Where slot `slot` starts in the file.
  size_t SlotOffset(uint32_t slot) const;
  // Moves every row into a file of `pages` pages (a power of two).
  Status Resize(uint32_t pages);
  // Resize's copy into `next` (open, empty, larger): the old file is read
  // once in order and the new one written about once in order, a group of
  // bucket windows (at most group_bytes_ of new pages) at a time.
  Status CopyInto(TierFile* next);
  // The pages [*begin, *begin + *width) of `bucket` in a file of `pages`
  // pages (the whole file for a bucket outside the stripe's range).
  void Window(uint32_t bucket, uint64_t pages, uint64_t* begin, uint64_t* width) const;
  // Sets the file's size in pages and the first page of each bucket's
  // window (windows_), which Place reads instead of dividing.
  void SetPages(uint32_t pages);
  // The error of a failed read, write or allocation (counted).
  Status ReadError(int err) const;
  Status WriteError(const char* what, int err) const;
  Status IoError(const char* what, int err) const;

  const std::string path_;
  const size_t record_bytes_;
  const uint32_t first_bucket_, num_buckets_;
  const size_t group_bytes_;
  // XORed into every stored id (KeyOf); a resize's file takes the same.
  uint64_t key_salt_;
  const size_t slot_bytes_;
  uint32_t slots_per_page_;
  size_t page_bytes_;
  size_t page_ram_bytes_;
  int fd_ = -1;
  uint32_t num_pages_ = 0;  // a power of two once open
  uint64_t rows_ = 0;
  // Counted by lookups that may run at once (exporters under a shared lock).
  std::atomic<uint64_t> reads_{0};
  mutable std::atomic<uint64_t> read_errors_{0};  // ReadPages runs under a shared lock
  mutable std::atomic<uint64_t> write_errors_{0};
  uint64_t layout_ = 0;
  // Rows the file opens with (Reserve raises it): few, so a table with few
  // cold rows takes little disk (4,096 made every table's 64 stripe files
  // take 32 MiB at least, and 4 GiB at dim 2,048); the file doubles as
  // rows come.
  uint64_t size_hint_ = 64;
  std::vector<uint32_t> prefetched_;    // slots read by Prefetch, sorted
  std::vector<char> prefetch_data_;     // their bytes, in that order
  std::vector<uint16_t> fingerprints_;  // per slot; 0: free
  std::vector<uint16_t> used_;          // per page: its slots in use
  // Per slot, a bit: its row was moved out of RAM in the current window
  // (MovedOutLately); all clear when a window closes. A resize carries
  // them to the rows' new slots (the window goes on).
  std::vector<uint64_t> ghosts_;
  uint64_t window_rows_ = 0;       // rows moved out in the current window
  std::vector<uint32_t> windows_;  // per bucket (and one past): its first page
};

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_DISK_TIER_H_
