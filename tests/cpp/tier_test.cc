// Tiered storage: the disk tier file on its own, and tables whose rows move
// between RAM and disk compared with all-RAM oracle tables fed the same
// pushes, under concurrent pulls, pushes and demotions.
#include <fcntl.h>
#include <malloc.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "native/core/disk_tier.h"
#include "native/core/half.h"
#include "native/core/routing.h"
#include "native/core/shard.h"
#include "native/core/table.h"
#include "tests/cpp/harness.h"

// AddressSanitizer's (sanitizer/allocator_interface.h); null in a plain build.
extern "C" void __sanitizer_purge_allocator() __attribute__((weak));

namespace dlt {
namespace {

// The ids removed from `t` since generation `since` (the log complete).
std::vector<int64_t> Removed(const Table& t, uint32_t since) {
  std::vector<int64_t> ids;
  EXPECT_OK(t.RemovedSince(since, &ids));
  return ids;
}

// Gives the heap's free memory back to the system now: malloc_trim, and
// under AddressSanitizer (whose allocator ignores it and gives memory back
// on its own some seconds later, so a process's resident set could fall
// by what earlier tests freed in the middle of a test) its purge.
void TrimHeap() {
  malloc_trim(0);
  if (__sanitizer_purge_allocator != nullptr) __sanitizer_purge_allocator();
}

// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    char pattern[] = "/tmp/dlt-tier-XXXXXX";
    path = mkdtemp(pattern);
  }
  ~TempDir() {
    std::error_code e;
    std::filesystem::remove_all(path, e);
  }
};

TableConfig TierTable(OptimizerKind optimizer, InitializerKind init = InitializerKind::kUniform) {
  TableConfig c;
  c.name = "tiered";
  c.dim = 4;
  c.seed = 3;
  c.initializer.kind = init;
  c.optimizer.kind = optimizer;
  return c;
}

struct Row {
  std::vector<float> values, slots;
  uint32_t step;
  bool operator==(const Row& o) const {
    return values == o.values && slots == o.slots && step == o.step;
  }
};

std::map<int64_t, Row> Rows(Table* t) {
  std::map<int64_t, Row> out;
  Table::Exporter ex(t);
  const uint32_t dim = t->dim(), k = t->slot_floats();
  std::vector<int64_t> ids(300);
  std::vector<float> values(300 * dim), slots(300 * k);
  std::vector<uint32_t> steps(300), buckets(300);
  const RowBuffers b{ids.data(), values.data(), slots.data(), steps.data(), buckets.data()};
  size_t got;
  while ((got = ex.Next(300, b)) > 0) {
    for (size_t i = 0; i < got; ++i) {
      out[ids[i]] =
          Row{std::vector<float>(&values[i * dim], &values[(i + 1) * dim]),
              std::vector<float>(slots.data() + i * k, slots.data() + (i + 1) * k), steps[i]};
    }
  }
  EXPECT_OK(ex.error());
  return out;
}

// An Adagrad table of dim 4 with a disk tier in a fresh directory, its rows
// of ids i * 7919 (i < n) made by training pulls, then `out_of` / `in` of
// them (of the rows in RAM) moved to the disk tier.
struct ColdTable {
  TempDir dir;
  Table t{TierTable(OptimizerKind::kAdagrad)};
  std::vector<int64_t> ids;
  std::vector<float> out;  // a pull's rows of `ids`
  explicit ColdTable(size_t n, size_t out_of = 1, size_t in = 1) : ids(n), out(n * 4) {
    t.AttachTier(dir.path);
    for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(i * 7919);
    EXPECT_OK(t.Pull(ids.data(), n, PullMode::kInsert, out.data()));
    Status s;
    t.Demote(t.ram_rows() * out_of / in, &s);
    EXPECT_OK(s);
  }
};

DLT_TEST(TestTierFileStoresFindsGrowsAndFrees) {
  TempDir dir;
  constexpr size_t kRecord = 40;
  TierFile tier(dir.path + "/s.tier", kRecord);
  std::map<int64_t, std::string> oracle;
  std::mt19937_64 rng(1);
  std::vector<char> record(kRecord), got(kRecord);
  // Far past the first size: the file grows (and moves every row) often.
  for (int i = 0; i < 20000; ++i) {
    const auto id = static_cast<int64_t>(rng());
    for (auto& c : record) c = static_cast<char>(rng());
    EXPECT_OK(tier.Put(Mix64(static_cast<uint64_t>(id)), id, record.data(), uint16_t(i & 0xffff)));
    oracle[id] = std::string(record.begin(), record.end());
  }
  EXPECT(tier.rows() == oracle.size());
  EXPECT(tier.disk_bytes() >= oracle.size() * (kRecord + 8));
  size_t n = 0;
  std::map<int64_t, uint16_t> generations;  // as put, through every resize
  rng.seed(1);
  for (int i = 0; i < 20000; ++i) {
    const auto id = static_cast<int64_t>(rng());
    for (size_t j = 0; j < kRecord; ++j) rng();
    generations[id] = uint16_t(i & 0xffff);
  }
  for (const auto& [id, bytes] : oracle) {
    uint32_t slot;
    uint16_t generation;
    EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation));
    EXPECT(slot != TierFile::kNoSlot && std::string(got.begin(), got.end()) == bytes);
    EXPECT(generation == generations[id]);
    if (++n % 2 == 0 && slot != TierFile::kNoSlot) tier.Remove(slot);  // half go
  }
  EXPECT(tier.rows() == oracle.size() / 2);
  n = 0;
  for (const auto& [id, bytes] : oracle) {
    uint32_t slot;
    uint16_t generation;
    EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation));
    EXPECT((++n % 2 == 0) == (slot == TierFile::kNoSlot));
  }
  // Absent ids are found absent.
  for (int i = 0; i < 1000; ++i) {
    uint32_t slot;
    uint16_t generation;
    const int64_t id = -1 - i;
    EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation));
    EXPECT(slot == TierFile::kNoSlot);
  }
  const std::string path = tier.path();
  EXPECT(std::filesystem::exists(path));
}

DLT_TEST(TestATierFileChangedOutsideTheProcessIsDataLossNotWrongRows) {
  // A zeroed region of the file held slots the shard had filled: a Find of
  // an id whose slot it was (its fingerprint matched) read id 0 there, took
  // it for a fingerprint collision and answered "absent" (the row came back
  // as its initial value, and a push made it again), and a resize moved the
  // zeros as rows of id 0. Both now fail DATA_LOSS naming the file. (Ids
  // are stored XOR a salt of the file's: zeros read as an id placed
  // elsewhere, never as id 0, which hashes to page 0 and shares its
  // fingerprint with one id in 65,536, as 2,410,259 here.)
  TempDir dir;
  constexpr size_t kRecord = 40;
  TierFile tier(dir.path + "/s.tier", kRecord);
  std::vector<char> record(kRecord, 7), got(kRecord);
  std::vector<int64_t> ids;
  for (int64_t id = 977; id <= 3000 * 977; id += 977) {
    EXPECT_OK(tier.Put(Mix64(static_cast<uint64_t>(id)), id, record.data(), 1));
    ids.push_back(id);
  }
  const int fd = open(tier.path().c_str(), O_WRONLY);
  EXPECT(fd >= 0);
  const std::vector<char> zeros(tier.page_bytes() * 4, 0);
  EXPECT(pwrite(fd, zeros.data(), zeros.size(), 0) == static_cast<ssize_t>(zeros.size()));
  close(fd);
  size_t lost = 0, found = 0;
  for (const int64_t id : ids) {
    uint32_t slot;
    uint16_t generation;
    const Status s =
        tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation);
    if (s.ok()) {
      EXPECT(slot != TierFile::kNoSlot && got == record);  // never "absent"
      ++found;
      continue;
    }
    EXPECT(s.code() == Code::kDataLoss);
    EXPECT(s.message().find(tier.path()) != std::string::npos);
    ++lost;
  }
  EXPECT(lost > 0 && found > 0 && lost + found == ids.size());
  EXPECT(tier.read_errors() >= lost);
  // The file grows as more rows come: the move of its rows meets the zeros.
  const uint32_t pages = tier.pages();
  Status grown;
  for (int64_t id = 1; grown.ok() && tier.pages() == pages && id < 100000; ++id) {
    grown = tier.Put(Mix64(static_cast<uint64_t>(-id)), -id, record.data(), 1);
  }
  EXPECT(grown.code() == Code::kDataLoss);
}

DLT_TEST(TestTierFileIgnoresAReservationPastWhatAFileHolds) {
  // Asked, before its first row, for more rows than one file can hold: the
  // file opens at its usual size and takes rows (it used to refuse every
  // Put, "cannot hold"), as an open file ignores the same request.
  TempDir dir;
  constexpr size_t kRecord = 40;
  TierFile tier(dir.path + "/s.tier", kRecord);
  tier.Reserve(uint64_t{1} << 40);
  std::vector<char> record(kRecord, 7);
  EXPECT_OK(tier.Put(Mix64(5), 5, record.data(), 1));
  EXPECT(tier.rows() == 1 && tier.disk_bytes() < (size_t{1} << 30));
}

DLT_TEST(TestTierFileGhostsLastAWindow) {
  // A row moved out of RAM is a ghost until `window` more rows were moved
  // out; GhostAll (a load's end) makes every row one; a slot freed and
  // taken again holds a row that is not.
  TempDir dir;
  constexpr size_t kRecord = 40;
  TierFile tier(dir.path + "/s.tier", kRecord);
  std::vector<char> record(kRecord, 1);
  auto put = [&](int64_t id) {
    uint32_t slot;
    EXPECT_OK(tier.Put(Mix64(static_cast<uint64_t>(id)), id, record.data(), 0, &slot));
    return slot;
  };
  std::vector<uint32_t> slots;
  for (int64_t id = 0; id < 100; ++id) slots.push_back(put(id));
  EXPECT(!tier.MovedOutLately(slots[0]));  // put by a load, say
  for (int64_t id = 0; id < 10; ++id) tier.NoteMovedOut(slots[id], 10);
  EXPECT(tier.MovedOutLately(slots[0]) && tier.MovedOutLately(slots[9]));
  EXPECT(!tier.MovedOutLately(slots[10]));
  tier.NoteMovedOut(slots[10], 10);  // the 11th: a new window
  EXPECT(!tier.MovedOutLately(slots[0]) && tier.MovedOutLately(slots[10]));
  tier.GhostAll();
  for (const uint32_t slot : slots) EXPECT(tier.MovedOutLately(slot));
  tier.Remove(slots[3]);
  EXPECT(!tier.MovedOutLately(slots[3]));
}

DLT_TEST(TestTierFilePagesFollowTheBucketsInOrder) {
  // A stripe of buckets [1000, 1256): each row lies in its bucket's window
  // of pages, windows in bucket order, so rows put in bucket order (a load)
  // fill the file from front to back. The file grows (twice) on the way.
  TempDir dir;
  constexpr uint32_t kFirst = 1000, kCount = 256;
  TierFile tier(dir.path + "/s.tier", 24, kFirst, kCount);
  EXPECT_OK(tier.Open(40000));
  std::vector<std::pair<uint32_t, int64_t>> ids;  // (bucket, id)
  for (int64_t id = 0; ids.size() < 120000; ++id) {
    const uint32_t bucket = BucketOf(id);
    if (bucket >= kFirst && bucket < kFirst + kCount) ids.emplace_back(bucket, id);
  }
  std::sort(ids.begin(), ids.end());
  std::vector<char> record(24, 'r'), got(24);
  for (const auto& [bucket, id] : ids) {
    EXPECT_OK(tier.Put(Mix64(static_cast<uint64_t>(id)), id, record.data(), 0));
  }
  EXPECT(tier.rows() == ids.size() && tier.pages() > 2 * kCount);
  const uint64_t pages = tier.pages();
  for (const auto& [bucket, id] : ids) {
    uint32_t slot;
    uint16_t generation;
    EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation));
    const uint64_t page = slot / tier.slots_per_page(), b = bucket - kFirst;
    EXPECT(slot != TierFile::kNoSlot && page >= b * pages / kCount &&
           page < (b + 1) * pages / kCount);
  }
}

DLT_TEST(TestTierFileGrowsWindowByWindowKeepingEveryRow) {
  // A resize copies a group of bucket windows at a time; rows of buckets
  // outside the stripe's range (placed anywhere in the file) and windows
  // larger than a group (one bucket, 128 KiB pages) are stored after. Every
  // row keeps its record and generation through several doublings, and the
  // slots the file's RAM says are used are those Find reaches.
  for (const uint32_t buckets : {256u, 1u}) {
    TempDir dir;
    const size_t record_bytes = buckets == 1 ? 4000 : 40;
    constexpr uint32_t kFirst = 1000;
    TierFile tier(dir.path + "/s.tier", record_bytes, kFirst, buckets);
    std::map<int64_t, std::pair<std::string, uint16_t>> oracle;
    std::mt19937_64 rng(buckets);
    const size_t rows = buckets == 1 ? 12000 : 500000;
    std::vector<uint64_t> hashes;
    std::vector<int64_t> keys;
    std::string records;
    std::vector<uint16_t> generations;
    for (int64_t id = 0; oracle.size() < rows; ++id) {
      const uint32_t bucket = BucketOf(id);
      // A few strays (one in 8 of other buckets' ids) beside the stripe's own.
      if ((bucket < kFirst || bucket >= kFirst + buckets) && id % 8 != 0) continue;
      std::string record(record_bytes, '\0');
      for (auto& c : record) c = static_cast<char>(rng());
      const auto generation = static_cast<uint16_t>(rng());
      oracle[id] = {record, generation};
      hashes.push_back(Mix64(static_cast<uint64_t>(id)));
      keys.push_back(id);
      records += record;
      generations.push_back(generation);
      if (keys.size() == 4096 || oracle.size() == rows) {  // grows the file as it goes
        EXPECT_OK(tier.PutBatch(keys.size(), hashes.data(), keys.data(), records.data(),
                                generations.data()));
        hashes.clear(), keys.clear(), records.clear(), generations.clear();
      }
    }
    // Past a group's 32 MiB of new pages: several groups, or a window
    // larger than one.
    EXPECT(tier.rows() == rows && tier.disk_bytes() > (size_t{32} << 20));
    std::vector<char> got(record_bytes);
    std::set<uint32_t> found;
    for (const auto& [id, want] : oracle) {
      uint32_t slot;
      uint16_t generation;
      EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation));
      EXPECT(slot != TierFile::kNoSlot && std::string(got.begin(), got.end()) == want.first &&
             generation == want.second);
      found.insert(slot);
    }
    size_t used = 0;
    for (uint32_t slot = 0; slot < tier.slots(); ++slot) used += tier.Used(slot);
    EXPECT(used == rows && found.size() == rows);
  }
}

DLT_TEST(TestTierFileGrowsThroughMixedGroupsWithStrays) {
  // Windows of 21 and 22 pages (48 buckets) with a resize building 21
  // pages at most: groups built in memory and groups stored row by row
  // alternate, early sizes have fewer pages than buckets (windows share
  // pages), and rows of other buckets (strays, placed anywhere) are stored
  // after every group. Every row keeps its record and generation through
  // each doubling, Put one at a time.
  TempDir dir;
  constexpr size_t kRecord = 40;
  constexpr uint32_t kFirst = 2000, kBuckets = 48;
  TierFile tier(dir.path + "/s.tier", kRecord, kFirst, kBuckets, 21 * 4096);
  std::map<int64_t, std::pair<std::string, uint16_t>> oracle;
  std::mt19937_64 rng(5);
  for (int64_t id = 0; oracle.size() < 45000; ++id) {
    const uint32_t bucket = BucketOf(id);
    if ((bucket < kFirst || bucket >= kFirst + kBuckets) && id % 64 != 0) continue;
    std::string record(kRecord, '\0');
    for (auto& c : record) c = static_cast<char>(rng());
    const auto generation = static_cast<uint16_t>(rng());
    EXPECT_OK(tier.Put(Mix64(static_cast<uint64_t>(id)), id, record.data(), generation));
    oracle[id] = {record, generation};
  }
  EXPECT(tier.pages() == 1024);
  std::vector<char> got(kRecord);
  size_t found = 0;
  for (const auto& [id, want] : oracle) {
    uint32_t slot;
    uint16_t generation;
    EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation));
    found += slot != TierFile::kNoSlot && std::string(got.begin(), got.end()) == want.first &&
             generation == want.second;
  }
  EXPECT(found == oracle.size() && tier.rows() == oracle.size());
  size_t used = 0;
  for (uint32_t slot = 0; slot < tier.slots(); ++slot) used += tier.Used(slot);
  EXPECT(used == oracle.size());
}

DLT_TEST(TestTierFileResizeThatFailsKeepsTheOldFile) {
  // A write or read failing while the file doubles (into a new file) fails
  // the Put that grew it, counted; the old file serves every row, and the
  // next Put grows the file.
  TempDir dir;
  constexpr size_t kRecord = 40;
  TierFile tier(dir.path + "/s.tier", kRecord, 0, 64);
  EXPECT_OK(tier.Open(1000));
  std::vector<char> record(kRecord, 'z'), got(kRecord);
  int64_t id = 0;
  const uint32_t pages = tier.pages();
  auto put = [&]() { return tier.Put(Mix64(static_cast<uint64_t>(id)), id, record.data(), 5); };
  // Up to the fill the next Put doubles at.
  while (uint64_t{tier.rows() + 1} * 4 <= uint64_t{pages} * tier.slots_per_page() * 3) {
    EXPECT_OK(put());
    ++id;
  }
  EXPECT(tier.pages() == pages);
  for (const bool write : {true, false}) {
    DiskFaults fault;
    (write ? fault.failing_writes : fault.failing_reads) = 1;
    fault.write_errno = ENOSPC;
    InjectDiskFaults(fault);
    const Status failed = put();
    InjectDiskFaults(DiskFaults{});
    EXPECT(!failed.ok() && tier.pages() == pages);
    EXPECT(write ? failed.code() == Code::kResourceExhausted : failed.code() == Code::kInternal);
  }
  EXPECT(tier.write_errors() == 1 && tier.read_errors() == 1);
  EXPECT(!std::filesystem::exists(tier.path() + ".resize"));
  for (int64_t i = 0; i < id; ++i) {
    uint32_t slot;
    uint16_t generation;
    EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(i)), i, got.data(), &slot, &generation));
    EXPECT(slot != TierFile::kNoSlot && got == record && generation == 5);
  }
  EXPECT_OK(put());
  EXPECT(tier.pages() == 2 * pages && tier.rows() == static_cast<uint64_t>(id) + 1);
}

DLT_TEST(TestTierFilePutBatchStoresRowsBesideOthersAndAllOrNothing) {
  // Batches in bucket order beside rows Put one at a time (their pages are
  // read before they are written again), growing the file on the way; a
  // batch whose write fails stores none of its rows.
  TempDir dir;
  constexpr size_t kRecord = 40;  // 48-byte slots: a page ends in 16 spare bytes
  TierFile tier(dir.path + "/s.tier", kRecord, 0, 512);
  std::vector<std::pair<uint32_t, int64_t>> ids;
  for (int64_t id = 0; ids.size() < 30000; ++id) {
    if (BucketOf(id) < 512) ids.emplace_back(BucketOf(id), id);
  }
  std::sort(ids.begin(), ids.end());
  std::map<int64_t, std::string> oracle;
  std::set<int64_t> alone;  // Put one at a time (generation 7; batches: 9)
  auto record_of = [](int64_t id) {
    std::string r(kRecord, '\0');
    for (size_t j = 0; j < kRecord; ++j) r[j] = static_cast<char>(id * 31 + j);
    return r;
  };
  for (size_t i = 0; i < ids.size(); i += 3) {  // every third row alone
    const int64_t id = ids[i].second;
    EXPECT_OK(tier.Put(Mix64(static_cast<uint64_t>(id)), id, record_of(id).data(), 7));
    oracle[id] = record_of(id);
    alone.insert(id);
  }
  std::vector<uint64_t> hashes;
  std::vector<int64_t> keys;
  std::string records;
  std::vector<uint16_t> generations;
  auto flush = [&]() {
    EXPECT_OK(
        tier.PutBatch(keys.size(), hashes.data(), keys.data(), records.data(), generations.data()));
    hashes.clear(), keys.clear(), records.clear(), generations.clear();
  };
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i % 3 == 0) continue;
    const int64_t id = ids[i].second;
    hashes.push_back(Mix64(static_cast<uint64_t>(id)));
    keys.push_back(id);
    records += record_of(id);
    generations.push_back(9);
    oracle[id] = record_of(id);
    if (keys.size() == 4000) flush();
  }
  flush();
  EXPECT(tier.rows() == oracle.size());
  std::vector<char> got(kRecord);
  for (const auto& [id, bytes] : oracle) {
    uint32_t slot;
    uint16_t generation;
    EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation));
    EXPECT(slot != TierFile::kNoSlot && std::string(got.begin(), got.end()) == bytes);
    EXPECT(generation == (alone.count(id) ? 7 : 9));
  }
  // A failing write: nothing of the batch is stored, the rest unchanged.
  const std::vector<int64_t> more = {-1, -2, -3, -4};
  std::vector<uint64_t> more_hashes;
  for (int64_t id : more) more_hashes.push_back(Mix64(static_cast<uint64_t>(id)));
  const std::string more_records(4 * kRecord, 'x');
  const std::vector<uint16_t> more_generations(4, 1);
  DiskFaults fail;
  fail.failing_writes = 1;
  fail.write_errno = EIO;
  InjectDiskFaults(fail);
  EXPECT(!tier.PutBatch(4, more_hashes.data(), more.data(), more_records.data(),
                        more_generations.data())
              .ok());
  InjectDiskFaults(DiskFaults{});
  EXPECT(tier.rows() == oracle.size());
  for (int64_t id : more) {
    uint32_t slot;
    uint16_t generation;
    EXPECT_OK(tier.Find(Mix64(static_cast<uint64_t>(id)), id, got.data(), &slot, &generation));
    EXPECT(slot == TierFile::kNoSlot);
  }
}

// Which of the file's pages are in the page cache (mincore of a mapping).
std::vector<bool> CachedPages(const std::string& path, size_t page_bytes) {
  const int fd = open(path.c_str(), O_RDONLY);
  const auto bytes = static_cast<size_t>(lseek(fd, 0, SEEK_END));
  void* map = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  const size_t os_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + os_page - 1) / os_page);
  EXPECT(map != MAP_FAILED && mincore(map, bytes, resident.data()) == 0);
  std::vector<bool> cached(bytes / page_bytes);
  for (size_t p = 0; p < cached.size(); ++p) cached[p] = resident[p * page_bytes / os_page] & 1;
  munmap(map, bytes);
  close(fd);
  return cached;
}

DLT_TEST(TestAdviseWritesReadsInThePagesThePutsWillWrite) {
  TempDir dir;
  constexpr size_t kRecord = 40;
  TierFile tier(dir.path + "/s.tier", kRecord);
  std::mt19937_64 rng(5);
  std::vector<char> record(kRecord, 7), got(kRecord);
  // Up to just past a doubling: the file is 3/8 full, so the puts below
  // cannot resize it.
  uint64_t grown_at = 0;
  for (int i = 0; i < 200000 && (i <= 20000 || tier.layout() == grown_at); ++i) {
    const auto id = static_cast<int64_t>(rng());
    EXPECT_OK(tier.Put(Mix64(static_cast<uint64_t>(id)), id, record.data(), 0));
    if (i == 20000) grown_at = tier.layout();
  }
  EXPECT(tier.layout() != grown_at);
  // Written back and dropped from the page cache, as a tier far larger
  // than the cache is.
  const int fd = open(tier.path().c_str(), O_RDWR);
  EXPECT(fd >= 0 && fdatasync(fd) == 0);
  EXPECT(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
  close(fd);
  const std::vector<bool> before = CachedPages(tier.path(), tier.page_bytes());
  const size_t cached_before = static_cast<size_t>(std::count(before.begin(), before.end(), true));
  if (cached_before > before.size() / 10) {  // a file system that keeps its pages (tmpfs)
    std::printf("  (skipped: %zu of %zu pages stay cached)\n", cached_before, before.size());
    return;
  }
  std::vector<int64_t> ids(64);
  std::vector<uint64_t> hashes(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int64_t>(rng());
    hashes[i] = Mix64(static_cast<uint64_t>(ids[i]));
  }
  const uint32_t layout = static_cast<uint32_t>(tier.layout());
  tier.AdviseWrites(hashes.data(), hashes.size());
  // The reads are asynchronous: wait (bounded) for them to land, and to
  // settle (it went on once half had landed: the check below, of 90%, then
  // failed now and then).
  std::vector<bool> after;
  size_t cached = 0;
  for (int tries = 0, settled = 0; tries < 500 && settled < 5; ++tries) {
    after = CachedPages(tier.path(), tier.page_bytes());
    const size_t now = static_cast<size_t>(std::count(after.begin(), after.end(), true));
    settled = now >= cached_before + ids.size() / 2 && now == cached ? settled + 1 : 0;
    cached = now;
    usleep(10000);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_OK(tier.Put(hashes[i], ids[i], record.data(), 0));
  }
  EXPECT(tier.layout() == layout);  // no resize moved the slots meanwhile
  // The page each row went to was read in by the hint (a row may take
  // another page when an earlier row of the batch filled its first).
  size_t advised = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    uint32_t slot;
    uint16_t generation;
    EXPECT_OK(tier.Find(hashes[i], ids[i], got.data(), &slot, &generation));
    EXPECT(slot != TierFile::kNoSlot);
    if (slot != TierFile::kNoSlot && after[slot / tier.slots_per_page()]) ++advised;
  }
  EXPECT(advised >= ids.size() * 9 / 10);
}

DLT_TEST(TestTierFileIsUnlinkedWithItsTier) {
  TempDir dir;
  std::string path = dir.path + "/s.tier";
  {
    TierFile tier(path, 16);
    char record[16] = {1};
    EXPECT_OK(tier.Put(Mix64(7), 7, record, 1));
    EXPECT(std::filesystem::exists(path));
  }
  EXPECT(!std::filesystem::exists(path));
}

DLT_TEST(TestDemotedRowsComeBackExactly) {
  // Adam rows demoted and promoted by pulls, pushes and assigns equal an
  // all-RAM oracle fed the same calls, values, slots and steps.
  TempDir dir;
  Table t(TierTable(OptimizerKind::kAdam));
  t.AttachTier(dir.path);
  Table oracle(TierTable(OptimizerKind::kAdam));
  std::mt19937_64 rng(2);
  std::vector<float> out(4 * 512), expect(4 * 512);
  for (int round = 0; round < 40; ++round) {
    std::vector<int64_t> ids(512);
    for (auto& id : ids) id = static_cast<int64_t>(rng() % 5000);
    EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kInsert, out.data()));
    EXPECT_OK(oracle.Pull(ids.data(), ids.size(), PullMode::kInsert, expect.data()));
    EXPECT(out == expect);
    std::vector<float> grads(ids.size() * 4);
    for (auto& g : grads) g = static_cast<float>(static_cast<int>(rng() % 200) - 100) / 64.0f;
    EXPECT_OK(t.Push(ids.data(), grads.data(), ids.size(), 0.01f));
    EXPECT_OK(oracle.Push(ids.data(), grads.data(), ids.size(), 0.01f));
    if (round % 7 == 3) {
      EXPECT_OK(t.Assign(ids.data(), grads.data(), 16));
      EXPECT_OK(oracle.Assign(ids.data(), grads.data(), 16));
    }
    Status s;
    t.Demote(t.ram_rows() * 3 / 4, &s);  // most rows go cold each round
    EXPECT_OK(s);
    EXPECT(t.size() == oracle.size());
  }
  EXPECT(t.tier_stats().disk_rows > 0 && t.tier_stats().promotions > 0);
  EXPECT(Rows(&t) == Rows(&oracle));
  // Reads that insert nothing see cold rows where they are.
  std::vector<int64_t> all;
  for (const auto& [id, row] : Rows(&oracle)) all.push_back(id);
  all.push_back(-77);  // absent
  std::vector<float> a(all.size() * 4), b(all.size() * 4);
  EXPECT_OK(t.Pull(all.data(), all.size(), PullMode::kZerosNoInsert, a.data()));
  EXPECT_OK(oracle.Pull(all.data(), all.size(), PullMode::kZerosNoInsert, b.data()));
  EXPECT(a == b);
}

DLT_TEST(TestDemotionsGiveTheRecordsMemoryBack) {
  // Rows moved to disk in a wave free their records; the stripes compact
  // (rows of high records move down, the arena above is released, the
  // index halves), so the table's bytes and the process's memory fall. An
  // export begun before finds every row where it moved; pulls and pushes
  // after it equal an all-RAM oracle fed the same calls.
  TempDir dir;
  TableConfig config = TierTable(OptimizerKind::kAdam);
  config.dim = 8;
  Table t(config);
  t.AttachTier(dir.path);
  Table oracle(config);
  constexpr size_t kRows = 300000, kBatch = 20000;
  std::vector<int64_t> ids(kRows);
  for (size_t i = 0; i < kRows; ++i) ids[i] = static_cast<int64_t>(Mix64(i + 1));
  std::vector<float> out(kBatch * 8), grads(kBatch * 8);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i % 13) / 8.0f;
  for (size_t first = 0; first < kRows; first += kBatch) {
    EXPECT_OK(t.Pull(&ids[first], kBatch, PullMode::kInsert, out.data()));
    EXPECT_OK(t.Push(&ids[first], grads.data(), kBatch, 0.01f));
    EXPECT_OK(oracle.Pull(&ids[first], kBatch, PullMode::kInsert, out.data()));
    EXPECT_OK(oracle.Push(&ids[first], grads.data(), kBatch, 0.01f));
  }
  // An export begun before the wave: its first stripe listed, a few rows out.
  std::map<int64_t, Row> exported;
  Table::Exporter ex(&t);
  std::vector<int64_t> got_ids(500);
  std::vector<float> values(500 * 8), slots(500 * t.slot_floats());
  std::vector<uint32_t> steps(500), buckets(500);
  const RowBuffers b{got_ids.data(), values.data(), slots.data(), steps.data(), buckets.data()};
  auto take = [&](size_t n) {
    const size_t got = ex.Next(n, b);
    for (size_t i = 0; i < got; ++i) {
      exported[got_ids[i]] =
          Row{std::vector<float>(&values[i * 8], &values[(i + 1) * 8]),
              std::vector<float>(&slots[i * t.slot_floats()], &slots[(i + 1) * t.slot_floats()]),
              steps[i]};
    }
    return got;
  };
  EXPECT(take(100) == 100);
  const size_t bytes = t.bytes();
  TrimHeap();
  const uint64_t resident = Shard::ResidentBytes();
  Status s;
  EXPECT(t.Demote(kRows * 3 / 4, &s) >= kRows * 3 / 4 - kStripes);
  EXPECT_OK(s);
  t.Compact();
  TrimHeap();
  const uint64_t after = Shard::ResidentBytes();
  // Records of 104 bytes (and 12-byte index slots): 300,000 rows held
  // about 40 MB; a quarter of them stays.
  EXPECT(t.bytes() < bytes / 2);
  // (Measured in the plain build only: under AddressSanitizer the freed
  // records sit in its quarantine.)
  if (!testing::kUnderAddressSanitizer) EXPECT(after + (uint64_t{15} << 20) < resident);
  while (take(500) > 0) {
  }
  EXPECT_OK(ex.error());
  EXPECT(exported == Rows(&oracle));
  // The compacted stripes serve and grow again.
  for (size_t first = 0; first < kRows; first += 3 * kBatch) {
    EXPECT_OK(t.Push(&ids[first], grads.data(), kBatch, 0.02f));
    EXPECT_OK(oracle.Push(&ids[first], grads.data(), kBatch, 0.02f));
  }
  EXPECT(Rows(&t) == Rows(&oracle));
}

DLT_TEST(TestCompactGivesBackPagesASizingFaultedInForRowsThatNeverCame) {
  // A load sizes the arena for the RAM limit as it starts (Reserve faults
  // the pages in); rows that never came, the limit fallen as the load ran,
  // left those pages with the process for good. Rows of 32 KiB, kept on
  // small pages as a budgeted shard keeps them (each stripe's last huge page
  // held 2 MiB however few rows used it).
  if (testing::kUnderAddressSanitizer) return;  // its allocator, not glibc's
  TableConfig config = TierTable(OptimizerKind::kAdagrad);
  config.dim = 4096;
  Table t(config);
  t.KeepPagesSmall();
  std::vector<int64_t> ids(kStripes * 4);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(Mix64(i + 7));
  std::vector<float> out(ids.size() * 4096);
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kInsert, out.data()));
  TrimHeap();
  const uint64_t before = Shard::ResidentBytes();
  t.Reserve(kStripes * 40, 1);  // about 40 rows a stripe: 80 MiB faulted in
  const uint64_t sized = Shard::ResidentBytes();
  EXPECT(sized > before + (uint64_t{60} << 20));
  t.Compact();
  TrimHeap();
  EXPECT(Shard::ResidentBytes() < before + (uint64_t{8} << 20));
  // The rows stay, and the stripes grow again.
  std::vector<float> again(out.size());
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kZerosNoInsert, again.data()));
  EXPECT(again == out);
  std::vector<int64_t> more(kStripes * 40);
  for (size_t i = 0; i < more.size(); ++i) more[i] = static_cast<int64_t>(Mix64(i + 99991));
  std::vector<float> rows(more.size() * 4096);
  EXPECT_OK(t.Pull(more.data(), more.size(), PullMode::kInsert, rows.data()));
  EXPECT(t.size() == ids.size() + more.size());
}

DLT_TEST(TestAPassOverColdWideRowsReadsAMegabyteAtATime) {
  // Passes over a stripe's cold rows (a save's listing, a ttl sweep, an
  // erase) read 32 pages per hold of its lock: of rows of dim 8,192 with
  // Adagrad (2 MiB pages), a 64 MiB buffer past a budgeted shard's rows.
  if (testing::kUnderAddressSanitizer) return;  // its allocator, not glibc's
  TempDir dir;
  TableConfig config = TierTable(OptimizerKind::kAdagrad);
  config.dim = 8192;
  Table t(config);
  t.AttachTier(dir.path);
  std::vector<int64_t> ids;  // all in the first stripe: 34 pages of it
  for (int64_t k = 1; ids.size() < 1100; ++k) {
    if (BucketOf(k) < kNumBuckets / kStripes) ids.push_back(k);
  }
  {
    std::vector<float> values(ids.size() * 8192, 0.5f);
    EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, nullptr, ids.size()));
  }
  Status s;
  t.Demote(t.ram_rows(), &s);
  EXPECT_OK(s);
  EXPECT(t.ram_rows() == 0);
  t.Compact();
  TrimHeap();
  const uint64_t before = Shard::ResidentBytes();
  std::ofstream("/proc/self/clear_refs") << "5";  // the peak starts again from here
  Status erased;
  EXPECT(t.EraseBuckets(0, kNumBuckets, nullptr, 0, &erased) == ids.size());
  EXPECT_OK(erased);
  std::ifstream status("/proc/self/status");
  uint64_t peak_kib = 0;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) peak_kib = std::stoull(line.substr(6));
  }
  EXPECT(peak_kib > 0);
  EXPECT((peak_kib << 10) < before + (uint64_t{16} << 20));
}

DLT_TEST(TestAPullOfManyColdRowsKeepsLittleMemoryAfterIt) {
  // Each stripe reads a pull's cold rows into a buffer of its own; one that
  // a large pull grew is freed after it, or the 64 stripes' buffers stay
  // with the process (22 MiB after one pull of a 600,000-row table), and a
  // memory budget's keeper counts them against the rows.
  if (testing::kUnderAddressSanitizer) return;  // its allocator, not glibc's
  TempDir dir;
  TableConfig config = TierTable(OptimizerKind::kAdagrad);
  config.dim = 8;
  Table t(config);
  t.AttachTier(dir.path);
  constexpr size_t kRows = 300000, kBatch = 20000;
  std::vector<int64_t> ids(kRows);
  for (size_t i = 0; i < kRows; ++i) ids[i] = static_cast<int64_t>(Mix64(i + 1));
  std::vector<float> out(kRows * 8);
  for (size_t first = 0; first < kRows; first += kBatch) {
    EXPECT_OK(t.Pull(&ids[first], kBatch, PullMode::kInsert, out.data()));
  }
  // RAM keeps about 100 rows a stripe, at its limit: the pull reads the
  // others where they are (none moves in).
  Status s;
  t.Demote(kRows - 100 * kStripes, &s);
  EXPECT_OK(s);
  t.SetRamLimit(kStripes * 64);
  const size_t cold = t.tier_stats().disk_rows;
  EXPECT(cold > kRows * 9 / 10);
  TrimHeap();
  // Heap chunks in use and mmapped ones (a large buffer is one).
  const auto in_use = [] {
    const struct mallinfo2 m = mallinfo2();
    return m.uordblks + m.hblkhd;
  };
  const size_t before = in_use();
  EXPECT_OK(t.Pull(ids.data(), kRows, PullMode::kInsert, out.data()));
  EXPECT(t.tier_stats().disk_rows == cold);
  const size_t after = in_use();
  // Slots of 90 bytes: this pull read 26 MB of them, 64 buffers of about
  // 420 KiB; those kept are 64 KiB at most.
  const size_t kept = after > before ? after - before : 0;
  if (kept >= (size_t{6} << 20)) std::printf("  kept %zu bytes after the pull\n", kept);
  EXPECT(kept < (size_t{6} << 20));
}

DLT_TEST(TestSmallDemotionsTakeColdRowsByASampledThreshold) {
  // Demotions of fewer than a sixteenth of the rows take rows at or below a
  // sampled sixteenth-coldest score, sweeping on from pass to pass: rows
  // updated five times (a tenth) are never moved while rows updated once
  // remain, and every pass moves what it was asked.
  TempDir dir;
  Table t(TierTable(OptimizerKind::kAdagrad));
  t.AttachTier(dir.path);
  constexpr size_t kRows = 200000;
  std::vector<int64_t> ids(kRows), hot;
  for (size_t i = 0; i < kRows; ++i) ids[i] = static_cast<int64_t>(Mix64(i + 7));
  std::vector<float> grads(kRows * 4, 0.25f);
  EXPECT_OK(t.Push(ids.data(), grads.data(), kRows, 0.1f));
  for (size_t i = 0; i < kRows; i += 10) hot.push_back(ids[i]);
  for (int k = 0; k < 4; ++k) EXPECT_OK(t.Push(hot.data(), grads.data(), hot.size(), 0.1f));
  for (int pass = 0; pass < 20; ++pass) {
    Status s;
    EXPECT(t.Demote(2000, &s) >= 2000);
    EXPECT_OK(s);
  }
  EXPECT(t.tier_stats().disk_rows >= 40000);
  const uint64_t promotions = t.tier_stats().promotions;
  std::vector<float> out(hot.size() * 4);
  EXPECT_OK(t.Pull(hot.data(), hot.size(), PullMode::kInsert, out.data()));
  EXPECT(t.tier_stats().promotions == promotions);  // every hot row was in RAM
}

DLT_TEST(TestConcurrentPullsPushesAndDemotionsLoseNothing) {
  // Pushes from several threads while rows move in and out of RAM (or are
  // updated on disk, near the RAM limit; an id twice in a push is in one
  // tier, whatever the other threads do meanwhile): with
  // zero-initialized SGD rows and gradients in 1/8 steps every sum is exact
  // in any order, so the table must equal the oracle bit for bit.
  TempDir dir;
  const TableConfig config = TierTable(OptimizerKind::kSgd, InitializerKind::kZeros);
  Table t(config);
  t.AttachTier(dir.path);
  t.SetRamLimit(kStripes * 8);
  Table oracle(config);
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::thread demoter([&] {
    while (!stop.load()) {
      Status s;
      t.Demote(t.ram_rows() / 2 + 1, &s);
      if (!s.ok()) failures.fetch_add(1);
    }
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < 3; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937_64 rng(10 + w);
      std::vector<float> out(4 * 256);
      for (int round = 0; round < 150; ++round) {
        std::vector<int64_t> ids(256);
        for (auto& id : ids) id = static_cast<int64_t>(rng() % 3000);
        if (!t.Pull(ids.data(), ids.size(), PullMode::kInsert, out.data()).ok())
          failures.fetch_add(1);
        std::vector<float> grads(ids.size() * 4);
        for (auto& g : grads) g = static_cast<float>(static_cast<int>(rng() % 16) - 8) / 8.0f;
        if (!t.Push(ids.data(), grads.data(), ids.size(), 1.0f).ok()) failures.fetch_add(1);
        if (!oracle.Push(ids.data(), grads.data(), ids.size(), 1.0f).ok()) failures.fetch_add(1);
      }
    });
  }
  for (auto& w : workers) w.join();
  stop.store(true);
  demoter.join();
  EXPECT(failures.load() == 0);
  const TierStats stats = t.tier_stats();
  // Both ways a pushed cold row goes near the RAM limit (about 25k updates
  // on disk beside 125k moves into RAM in a plain build).
  EXPECT(stats.demotions > 0 && stats.promotions > 0 && stats.disk_rows > 0);
  EXPECT(stats.disk_updates > 0);
  EXPECT(stats.ram_rows + stats.disk_rows == t.size());
  const auto got = Rows(&t), want = Rows(&oracle);
  EXPECT(got.size() == want.size());
  EXPECT(got == want);
}

DLT_TEST(TestAnIdTwiceInALoadToDiskKeepsItsLastRow) {
  // Rows bound for the disk tier are batched per stripe; an id twice in one
  // import is stored once, with the row of its last occurrence.
  TempDir dir;
  Table t(TierTable(OptimizerKind::kAdagrad));
  t.AttachTier(dir.path);
  t.SetRamLimit(kStripes * 16);
  constexpr size_t kRows = 9000;
  std::vector<int64_t> ids(kRows);
  std::vector<float> values(kRows * 4);
  for (size_t i = 0; i < kRows; ++i) {
    ids[i] = static_cast<int64_t>(i % 3000) * 7919;  // each id three times
    for (int j = 0; j < 4; ++j) values[i * 4 + j] = static_cast<float>(i) + j;
  }
  EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, nullptr, kRows));
  EXPECT(t.size() == 3000 && t.tier_stats().disk_rows > 500);
  const auto rows = Rows(&t);
  EXPECT(rows.size() == 3000);
  for (size_t i = 6000; i < kRows; i += 7) {
    EXPECT(rows.at(ids[i]).values[0] == static_cast<float>(i));
  }
}

DLT_TEST(TestAnIdTwiceInAHotLoadLiesInOneTierWithItsLastRow) {
  // A hot load sends an id's first occurrence to disk (colder than the
  // floor) and its second to RAM (hotter): the RAM row wins, and the id is
  // one row, exported once, read and erased as one.
  TempDir dir;
  TableConfig config = TierTable(OptimizerKind::kAdagrad);
  config.policy.clock = static_cast<uint64_t>(ClockKind::kPushes);
  Table t(config);
  t.AttachTier(dir.path);
  t.SetPushClock(2000000);
  t.SetRamLimit(kStripes * 64);
  constexpr size_t kRows = 10000;
  std::vector<int64_t> ids(kRows + 1);
  std::vector<float> values((kRows + 1) * 4, 1.0f);
  std::vector<uint32_t> steps(kRows + 1, 0), touched(kRows + 1);
  for (size_t i = 0; i < kRows; ++i) {
    ids[i] = static_cast<int64_t>(i) * 7919 + 1;
    touched[i] = static_cast<uint32_t>(i);  // ids[0] the coldest
  }
  ids[kRows] = ids[0];  // again, as the hottest row
  touched[kRows] = 2000000;
  for (int j = 0; j < 4; ++j) values[kRows * 4 + j] = 2.0f;
  t.BeginHotLoad(100000);
  EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, steps.data(), kRows + 1, touched.data()));
  t.EndHotLoad();
  EXPECT(t.size() == kRows);
  const auto rows = Rows(&t);
  EXPECT(rows.size() == kRows && rows.at(ids[0]).values[0] == 2.0f);
  EXPECT(t.tier_stats().ram_rows + t.tier_stats().disk_rows == kRows);
  Status s;
  t.Demote(t.ram_rows(), &s);  // every row on disk: one slot of the id
  EXPECT_OK(s);
  float got[4];
  EXPECT_OK(t.Pull(&ids[0], 1, PullMode::kZerosNoInsert, got));
  EXPECT(got[0] == 2.0f);
  EXPECT(t.Erase(&ids[0], 1) == 1);
  EXPECT_OK(t.Pull(&ids[0], 1, PullMode::kZerosNoInsert, got));
  EXPECT(got[0] == 0.0f && t.size() == kRows - 1);
}

DLT_TEST(TestLoadPastTheRamLimitGoesToDiskAndPolicyCoversBothTiers) {
  TempDir dir;
  TableConfig config = TierTable(OptimizerKind::kAdagrad);
  config.policy.clock = static_cast<uint64_t>(ClockKind::kPushes);
  Table t(config);
  t.AttachTier(dir.path);
  t.SetRamLimit(kStripes * 16);
  constexpr size_t kRows = 20000;
  std::vector<int64_t> ids(kRows);
  std::vector<float> values(kRows * 4), slots(kRows * 4, 0.5f);
  std::vector<uint32_t> steps(kRows), touched(kRows);
  for (size_t i = 0; i < kRows; ++i) {
    ids[i] = static_cast<int64_t>(i) * 7919;
    for (int j = 0; j < 4; ++j) values[i * 4 + j] = static_cast<float>(i) + j;
    steps[i] = i % 2 ? 5 : 1;  // odd rows are frequent
    touched[i] = 0;
  }
  t.Reserve(kRows, 2);
  EXPECT_OK(t.Import(ids.data(), values.data(), slots.data(), steps.data(), kRows, touched.data()));
  TierStats stats = t.tier_stats();
  EXPECT(stats.ram_rows + stats.disk_rows == kRows);
  EXPECT(stats.ram_rows <= kStripes * 16 + kStripes * 17);  // the limit, plus its margin
  EXPECT(stats.disk_rows > kRows / 2);
  // Every row reads back exactly.
  const auto rows = Rows(&t);
  EXPECT(rows.size() == kRows);
  for (size_t i = 0; i < kRows; i += 997) {
    const Row& r = rows.at(ids[i]);
    EXPECT(r.values[3] == static_cast<float>(i) + 3 && r.step == steps[i]);
  }
  // Shrink by count removes rare rows in both tiers, logging them.
  t.BeginSave("base", "");
  EXPECT(t.Shrink(2, 0, t.Now()) == kRows / 2);
  EXPECT(t.size() == kRows / 2);
  EXPECT(Removed(t, 0).size() == kRows / 2);
  // max_rows across tiers.
  TableConfig capped = config;
  capped.policy.max_rows = 4096;
  Table c(capped);
  std::filesystem::create_directories(dir.path + "/c");
  c.AttachTier(dir.path + "/c");
  c.SetRamLimit(kStripes * 16);
  EXPECT_OK(c.Import(ids.data(), values.data(), slots.data(), steps.data(), kRows, touched.data()));
  EXPECT(c.size() == kRows);
  EXPECT(c.EvictAcrossTiers() > 0);
  EXPECT(c.size() <= 4096 + 4096 / 32 + kStripes);
  // The frequent rows are those kept.
  size_t frequent = 0;
  for (const auto& [id, row] : Rows(&c)) frequent += row.step == 5;
  EXPECT(frequent == c.size());
  // Erasing buckets reaches cold rows too.
  const size_t kept = c.size();
  EXPECT(c.EraseBuckets(0, kNumBuckets) == kept);
  EXPECT(c.size() == 0 && c.tier_stats().disk_rows == 0);
}

DLT_TEST(TestAHotLoadKeepsTheHottestRowsInRam) {
  // A load past the RAM limit keeps the rows touched last in RAM wherever
  // they come: with distinct stamps, and with most rows sharing one stamp
  // (the share of them at the floor's score fills RAM, no more).
  constexpr size_t kRows = 40000, kBatch = 10000, kLimit = kStripes * 64;
  std::vector<int64_t> ids(kRows);
  std::vector<float> values(kRows * 4, 0.25f);
  std::vector<uint32_t> steps(kRows, 1), distinct(kRows), shared(kRows);
  for (size_t i = 0; i < kRows; ++i) {
    ids[i] = static_cast<int64_t>(Mix64(i + 7));
    distinct[i] = static_cast<uint32_t>((i * 7919) % kRows);  // a permutation of 0..kRows-1
    shared[i] = i % 10 == 0 ? 20 : 10;
  }
  // A tiered table whose clock is past every stamp, RAM limited to kLimit.
  auto tiered = [&](const std::string& dir) {
    TableConfig config = TierTable(OptimizerKind::kSgd);
    config.policy.clock = static_cast<uint64_t>(ClockKind::kPushes);
    auto t = std::make_unique<Table>(config);
    t->AttachTier(dir);
    t->SetPushClock(kRows);
    t->SetRamLimit(kLimit);
    return t;
  };
  for (const bool ties : {false, true}) {
    const std::vector<uint32_t>& touched = ties ? shared : distinct;
    TempDir dir;
    const std::unique_ptr<Table> table = tiered(dir.path);
    Table& t = *table;
    t.BeginHotLoad(kRows);
    for (size_t first = 0; first < kRows; first += kBatch) {
      EXPECT_OK(t.Import(&ids[first], &values[first * 4], nullptr, &steps[first], kBatch,
                         &touched[first]));
    }
    t.EndHotLoad();
    const TierStats stats = t.tier_stats();
    EXPECT(stats.ram_rows + stats.disk_rows == kRows);
    EXPECT(stats.ram_rows <= kLimit + kLimit / 16 + kStripes * 16);
    EXPECT(stats.ram_rows >= kLimit * 8 / 10);
    // The hot rows: the kLimit stamped last, or the tenth stamped 20.
    std::vector<int64_t> hot;
    for (size_t i = 0; i < kRows; ++i) {
      if (ties ? touched[i] == 20 : touched[i] >= kRows - kLimit * 9 / 10) hot.push_back(ids[i]);
    }
    std::vector<float> out(hot.size() * 4);
    const uint64_t reads = t.tier_stats().disk_reads;
    EXPECT_OK(t.Pull(hot.data(), hot.size(), PullMode::kZerosNoInsert, out.data()));
    EXPECT(t.tier_stats().disk_reads - reads <= hot.size() / 50);  // (sampled, not exact)
    EXPECT(std::all_of(out.begin(), out.end(), [](float v) { return v == 0.25f; }));
  }
  // Without one, rows fill RAM as they come: the hot rows are where they
  // land.
  TempDir dir;
  const std::unique_ptr<Table> table = tiered(dir.path);
  Table& t = *table;
  EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, steps.data(), kRows, shared.data()));
  std::vector<int64_t> hot;
  for (size_t i = 0; i < kRows; i += 10) hot.push_back(ids[i]);
  std::vector<float> out(hot.size() * 4);
  EXPECT_OK(t.Pull(hot.data(), hot.size(), PullMode::kZerosNoInsert, out.data()));
  EXPECT(t.tier_stats().disk_reads > hot.size() / 2);
}

DLT_TEST(TestAFullDiskLeavesRowsInRamAndSaysSo) {
  // A file size limit stands in for a full disk: the tier cannot grow, the
  // demotion fails with RESOURCE_EXHAUSTED naming the file, and every row
  // still reads from RAM.
  TempDir dir;
  Table t(TierTable(OptimizerKind::kSgd));
  t.AttachTier(dir.path);
  std::vector<int64_t> ids(30000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  std::vector<float> before(ids.size() * 4), after(ids.size() * 4);
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kInsert, before.data()));
  struct rlimit old;
  getrlimit(RLIMIT_FSIZE, &old);
  auto previous = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit tiny = old;
  tiny.rlim_cur = 16 * 1024;  // below what the rows take (files open small)
  setrlimit(RLIMIT_FSIZE, &tiny);
  Status s;
  size_t moved = t.Demote(ids.size(), &s);
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find(".tier") != std::string::npos);
  EXPECT(moved < ids.size());
  EXPECT(t.size() == ids.size());
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kInsert, after.data()));
  EXPECT(before == after);
  // With room again, the rest can go.
  moved = t.Demote(t.ram_rows(), &s);
  EXPECT_OK(s);
  EXPECT(t.tier_stats().disk_rows > ids.size() / 2);
}

DLT_TEST(TestPushesGrowRamOnlyALittleWhileTheKeeperCannotMoveRows) {
  // While the memory keeper's demotions fail (a disk error), pushes making
  // new rows go on until the RAM rows pass their limit by a quarter, then
  // wait for it, and go on once it moves rows again. They waited for
  // nothing: one error let RAM rows grow 25-fold.
  TempDir dir;
  Table t(TierTable(OptimizerKind::kAdagrad));
  t.AttachTier(dir.path);
  const uint64_t limit = 40000;
  t.SetRamLimit(limit);
  t.SetKeeperError("No space left on device (injected)");
  constexpr size_t kBatch = 1000;
  const std::vector<float> grads(kBatch * 4, 0.5f);
  std::vector<int64_t> ids(kBatch);
  int64_t next = 0;
  auto push_new = [&] {
    for (auto& id : ids) id = next++;
    return t.Push(ids.data(), grads.data(), kBatch, 0.1f);
  };
  while (t.ram_rows() <= limit + limit / 4) EXPECT_OK(push_new());
  const size_t held = t.ram_rows();
  EXPECT(held <= limit + limit / 4 + kBatch);
  std::atomic<bool> done{false};
  Status waited;
  std::thread blocked([&] {
    waited = push_new();
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT(!done && t.ram_rows() == held);  // waiting, nothing made
  t.SetKeeperError("");                   // the keeper works again
  Status s;
  t.Demote(t.ram_rows() - limit, &s);
  EXPECT_OK(s);
  blocked.join();
  EXPECT_OK(waited);
}

DLT_TEST(TestInjectedDiskFaultsFailTheirRequestAndLoseNoRow) {
  // A read error, a short read and a failing write each fail the request
  // that met them with a typed error naming the tier file, are counted in
  // the tier's stats, and leave every row (in RAM and on disk) as it was.
  ColdTable made(20000, 3, 4);
  Table& t = made.t;
  const std::vector<int64_t>& ids = made.ids;
  std::vector<float>& out = made.out;
  Status s;
  const std::map<int64_t, Row> expected = Rows(&t);
  const uint64_t cold = t.tier_stats().disk_rows;
  EXPECT(cold > ids.size() / 2);
  const std::vector<float> grads(ids.size() * 4, 0.5f);

  DiskFaults eio;
  eio.failing_reads = 1;
  InjectDiskFaults(eio);
  s = t.Pull(ids.data(), ids.size(), PullMode::kInsert, out.data());
  EXPECT(s.code() == Code::kInternal);
  EXPECT(s.message().find("Input/output error") != std::string::npos);
  EXPECT(s.message().find(".tier") != std::string::npos);
  TierStats stats = t.tier_stats();
  EXPECT(stats.disk_read_errors == 1 && stats.error == s.message());

  DiskFaults short_read;
  short_read.short_reads = 1;
  InjectDiskFaults(short_read);
  s = t.Pull(ids.data(), ids.size(), PullMode::kZerosNoInsert, out.data());
  EXPECT(s.code() == Code::kInternal);
  EXPECT(s.message().find("ends before the row") != std::string::npos);
  EXPECT(t.tier_stats().disk_read_errors == 2);

  DiskFaults full;
  full.failing_writes = 1;
  InjectDiskFaults(full);
  const size_t ram_before = t.ram_rows();
  t.Demote(t.ram_rows(), &s);
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find("No space left on device") != std::string::npos);
  EXPECT(t.tier_stats().disk_write_errors == 1);
  EXPECT(t.size() == ids.size());
  EXPECT(t.ram_rows() <= ram_before);

  DiskFaults io_write;
  io_write.failing_writes = 1;
  io_write.write_errno = EIO;
  InjectDiskFaults(io_write);
  t.Demote(t.ram_rows(), &s);
  EXPECT(s.code() == Code::kInternal);
  EXPECT(t.tier_stats().disk_write_errors == 2);

  // Faults gone: every row reads as before, from whichever tier holds it.
  InjectDiskFaults(DiskFaults{});
  EXPECT(Rows(&t) == expected);
  std::vector<float> again(ids.size() * 4), fresh(ids.size() * 4);
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kInsert, again.data()));
  Table oracle(TierTable(OptimizerKind::kAdagrad));
  EXPECT_OK(oracle.Pull(ids.data(), ids.size(), PullMode::kInsert, fresh.data()));
  EXPECT(again == fresh);
  // A push meeting a read error fails too (the stripes it finished before
  // the one it met the error in keep its update: docs/tiered_storage.md).
  t.Demote(t.ram_rows() * 3 / 4, &s);
  EXPECT_OK(s);
  InjectDiskFaults(eio);
  s = t.Push(ids.data(), grads.data(), ids.size(), 0.1f);
  EXPECT(s.code() == Code::kInternal);
  EXPECT(t.size() == ids.size() && t.tier_stats().disk_read_errors == 3);
  EXPECT_OK(t.Push(ids.data(), grads.data(), ids.size(), 0.1f));
}

DLT_TEST(TestAReadErrorLeavesPushesWaitingForTheKeeperAndClearsOnTheNextRead) {
  // A request's read error is shown until the tier next reads a row for a
  // request; it does not stop pushes waiting for the keeper (only the
  // keeper's own failure does: it could not make room).
  ColdTable made(20000, 3, 4);
  Table& t = made.t;
  const std::vector<int64_t>& ids = made.ids;
  std::vector<float>& out = made.out;
  Status s;
  DiskFaults eio;
  eio.failing_reads = 1;
  InjectDiskFaults(eio);
  EXPECT(t.Pull(ids.data(), ids.size(), PullMode::kZerosNoInsert, out.data()).code() ==
         Code::kInternal);
  InjectDiskFaults(DiskFaults{});
  EXPECT(!t.tier_stats().error.empty());
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kZerosNoInsert, out.data()));
  EXPECT(t.tier_stats().error.empty());
  // RAM far past its limit: a push waits until the rows are moved out.
  t.SetRamLimit(16 * 16);
  EXPECT(t.ram_rows() > 1000);
  std::vector<int64_t> fresh(64);
  for (size_t i = 0; i < fresh.size(); ++i) fresh[i] = static_cast<int64_t>(1000000007 + i);
  const std::vector<float> grads(fresh.size() * 4, 0.1f);
  std::atomic<bool> pushed{false};
  std::thread push([&] {
    EXPECT_OK(t.Push(fresh.data(), grads.data(), fresh.size(), 0.1f));
    pushed.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const bool waited = !pushed.load();
  t.Demote(t.ram_rows(), &s);  // the keeper's part
  EXPECT_OK(s);
  push.join();
  EXPECT(waited && pushed.load());
}

DLT_TEST(TestAnEraseThatMeetsAReadErrorSaysSoAndLeavesTheRow) {
  // A delta load's removals and a standby's round erase by id: a cold row
  // the tier could not read for is not erased, and the caller is told (it
  // used to count as done, the row left behind).
  ColdTable made(4000);
  Table& t = made.t;
  const std::vector<int64_t>& ids = made.ids;
  EXPECT(t.ram_rows() == 0);
  DiskFaults eio;
  eio.failing_reads = 1;
  InjectDiskFaults(eio);
  Status erased;
  EXPECT(t.Erase(ids.data(), ids.size(), &erased) == ids.size() - 1);
  InjectDiskFaults(DiskFaults{});
  EXPECT(erased.code() == Code::kInternal && t.size() == 1);
  erased = Status();
  EXPECT(t.Erase(ids.data(), ids.size(), &erased) == 1);
  EXPECT_OK(erased);
  EXPECT(t.size() == 0);
}

DLT_TEST(TestAPushThatMeetsAReadErrorMakesNoRow) {
  // New ids come first in the push, so each stripe makes their rows before
  // it reads a cold row; the read error fails the push, and the rows it
  // made are gone again (they used to stay, with their initial values).
  ColdTable made(4000);
  Table& t = made.t;
  EXPECT(t.ram_rows() == 0);
  std::vector<int64_t> ids(64);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(1000000007 + i);
  ids.insert(ids.end(), made.ids.begin(), made.ids.end());
  const std::vector<float> grads(ids.size() * 4, 0.1f);
  const uint64_t admitted = t.counters().admitted;
  DiskFaults eio;
  eio.failing_reads = 1;
  InjectDiskFaults(eio);
  const Status s = t.Push(ids.data(), grads.data(), ids.size(), 0.1f);
  InjectDiskFaults(DiskFaults{});
  EXPECT(s.code() == Code::kInternal);
  EXPECT(t.size() == made.ids.size());
  EXPECT(t.counters().admitted == admitted);
}

DLT_TEST(TestRemovingColdRowsKeepsTheRemovalLogWithinItsCap) {
  // A shrink of a table mostly on disk: its removals' log stops at the cap
  // (the next save is written whole) instead of holding 12 bytes of RAM per
  // removed cold row, as the same shrink all in RAM does.
  constexpr size_t kRows = 400000;
  std::vector<int64_t> ids(kRows);
  const std::vector<float> values(kRows * 4, 0.25f);
  const std::vector<uint32_t> steps(kRows, 1);
  for (size_t i = 0; i < kRows; ++i) ids[i] = static_cast<int64_t>(i) * 7919;
  TempDir dir;
  Table t(TierTable(OptimizerKind::kAdagrad));
  t.AttachTier(dir.path);
  t.SetRamLimit(kStripes * 16);
  EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, steps.data(), kRows));
  EXPECT(t.tier_stats().disk_rows > kRows * 9 / 10);
  t.MarkLoaded("base");
  const size_t fixed_before = t.ram_fixed_bytes();
  EXPECT(t.Shrink(2, 0, t.Now()) == kRows);
  EXPECT(t.size() == 0);
  std::vector<int64_t> removed;
  EXPECT(t.RemovedSince(0, &removed).code() == Code::kFailedPrecondition);
  EXPECT(t.ram_fixed_bytes() <= fixed_before);
  // The next save starts afresh and tracks removals again.
  const SaveStart start = t.BeginSave("next", "base");
  EXPECT(!start.tracked);
  EXPECT_OK(t.RemovedSince(0, &removed));
  EXPECT(removed.empty());
}

// Makes table "tiered" on `shard` (a budget of 16 MiB for rows) and pulls
// kFilledRows new ids into it, far more than 16 MiB holds at 66 bytes a
// row in RAM, with a keeper pass after each 10,000 and 20 more at the end.
constexpr size_t kFilledRows = 600000;
std::shared_ptr<Table> FillPastTheBudget(Shard* shard) {
  bool created;
  EXPECT_OK(shard->CreateTable(TierTable(OptimizerKind::kAdagrad), &created));
  std::shared_ptr<Table> t;
  EXPECT_OK(shard->GetTable("tiered", &t));
  std::vector<int64_t> ids(kFilledRows);
  std::vector<float> out(ids.size() * 4);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  for (size_t at = 0; at < ids.size(); at += 10000) {
    EXPECT_OK(t->Pull(ids.data() + at, 10000, PullMode::kInsert, out.data()));
    shard->KeepMemory();
  }
  for (int i = 0; i < 20; ++i) shard->KeepMemory();
  return t;
}

// The smallest memory budget a shard of this process honours now, as
// ConfigureMemory measures it (after a trim).
uint64_t SmallestBudget() {
  TrimHeap();
  return (Shard::ResidentBytes() + Shard::kPersistReserve + Shard::kMinRowRoom) * 10 / 9;
}

DLT_TEST(TestShardBudgetDemotesAndStaleTierFilesGo) {
  TempDir dir;
  // Stale files of a shard process that is gone.
  std::filesystem::create_directories(dir.path + "/shard-0/t0-old");
  std::FILE* stale = std::fopen((dir.path + "/shard-0/t0-old/stripe-00.tier").c_str(), "w");
  std::fclose(stale);
  auto shard = std::make_shared<Shard>(0, 1);
  // The smallest budget the shard honours, and 16 MiB more for rows.
  const uint64_t least = SmallestBudget();
  EXPECT(shard->ConfigureMemory(least / 2, dir.path, 5).code() == Code::kInvalidArgument);
  // Links named as a tier's directory, or as a stale one's LOCK, lead
  // out of the storage dir: nothing is written or removed through them.
  TempDir outside;
  std::filesystem::create_directories(outside.path + "/kept");
  std::filesystem::create_directory_symlink(outside.path, dir.path + "/shard-9");
  std::filesystem::create_directories(dir.path + "/shard-8");
  std::filesystem::create_symlink(outside.path + "/LOCK", dir.path + "/shard-8/LOCK");
  EXPECT_OK(shard->ConfigureMemory(least + (16 << 20), dir.path, 5));
  EXPECT(!std::filesystem::exists(dir.path + "/shard-0/t0-old"));
  EXPECT(std::filesystem::exists(outside.path + "/kept"));
  EXPECT(!std::filesystem::exists(outside.path + "/LOCK"));
  EXPECT(std::filesystem::is_symlink(dir.path + "/shard-9"));
  // A link planted as this shard's own LOCK: named, not taken for a lock
  // another process holds.
  TempDir planted;
  std::filesystem::create_directories(planted.path + "/shard-0");
  std::filesystem::create_symlink(outside.path + "/LOCK", planted.path + "/shard-0/LOCK");
  Shard locked(0, 1);
  const Status link = locked.ConfigureMemory(uint64_t{1} << 40, planted.path, 5);
  EXPECT_ERROR_HAS(link, "LOCK is a link");
  // A link as this shard's own tier directory is refused.
  TempDir linked;
  std::filesystem::create_directory_symlink(outside.path, linked.path + "/shard-0");
  Shard pointed(0, 1);
  const Status refused = pointed.ConfigureMemory(uint64_t{1} << 40, linked.path, 5);
  EXPECT(refused.code() == Code::kInvalidArgument &&
         refused.message().find("is a link") != std::string::npos);
  EXPECT(!std::filesystem::exists(outside.path + "/LOCK"));
  const std::shared_ptr<Table> t = FillPastTheBudget(shard.get());
  const TierStats stats = t->tier_stats();
  EXPECT(stats.disk_rows > 0 && stats.demotions > 0);
  EXPECT(stats.ram_rows + stats.disk_rows == kFilledRows);
  EXPECT(stats.ram_rows * t->ram_row_bytes() <= shard->memory_status().table_target + (1 << 20));
  // Once it has demoted (made beside it, their trims made the demotion
  // uncertain under ASan): other processes of the shard (here: shard
  // objects; its standbys, given the same directory) take shard-0-2 ...
  // shard-0-5; a sixth is refused. (A budget past any process's resident
  // set: tests before this one may have left a sanitized process large.)
  std::vector<std::unique_ptr<Shard>> others;
  for (int k = 2; k <= Shard::kMaxTierDirs; ++k) {
    others.push_back(std::make_unique<Shard>(0, 1));
    EXPECT_OK(others.back()->ConfigureMemory(uint64_t{1} << 40, dir.path, 5));
    EXPECT(std::filesystem::exists(dir.path + "/shard-0-" + std::to_string(k) + "/LOCK"));
  }
  Shard sixth(0, 1);
  EXPECT(sixth.ConfigureMemory(uint64_t{1} << 40, dir.path, 5).code() == Code::kFailedPrecondition);
}

// A shard with the smallest budget it honours and 16 MiB more for rows,
// whose keeper thread passes once, at start (only a test's own passes run
// after), and its table filled past the budget (FillPastTheBudget).
struct FilledShard {
  TempDir dir;
  std::shared_ptr<Shard> shard = Configured(dir);
  std::shared_ptr<Table> t = FillPastTheBudget(shard.get());
  static std::shared_ptr<Shard> Configured(const TempDir& dir) {
    auto shard = std::make_shared<Shard>(0, 1);
    EXPECT_OK(shard->ConfigureMemory(SmallestBudget() + (16 << 20), dir.path, 3600 * 1000));
    return shard;
  }
};

// 96 MiB (within kPersistReserve) made resident, mapped so that freeing
// them (munmap) gives them back at once, as the shard's large allocations
// are.
constexpr size_t kHeld = size_t{96} << 20;
void* TakeMemory() {
  void* p = mmap(nullptr, kHeld, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT(p != MAP_FAILED);
  std::memset(p, 1, kHeld);
  return p;
}

// Gives back what the process freed (earlier tests' heap too), then lets
// `shard`'s keeper measure it: otherwise a trim during a test's passes
// could give back as much as the test takes, and hide it.
void SettleMemory(Shard* shard) {
  TrimHeap();
  for (int i = 0; i < 3; ++i) shard->KeepMemory();
}

DLT_TEST(TestMemoryASaveOrLoadLeavesBehindMovesNoRowWhileItGoes) {
  // A save's or load's buffers (and a table a load replaced) leave the
  // process over a few keeper passes after it ends: until they are gone,
  // the keeper still sizes the rows by the memory measured before it, and
  // moves none. Once they are gone, memory the process takes again counts.
  // (An in-place load of one table under a tight budget once moved every
  // RAM row of the others to disk this way.)
  FilledShard made;
  Shard* shard = made.shard.get();
  const std::shared_ptr<Table>& t = made.t;
  // What follows measures the process's resident memory, which says
  // nothing under AddressSanitizer (harness.h): there the fill alone may
  // move every row out.
  if (testing::kUnderAddressSanitizer) return;
  SettleMemory(shard);
  const uint64_t ram_rows = t->tier_stats().ram_rows;
  EXPECT(ram_rows > 0);
  // A save that begins and ends between two passes counts as seen.
  shard->SetPersisting(true);
  void* buffers = TakeMemory();
  shard->SetPersisting(false);
  for (int i = 0; i < 3; ++i) EXPECT(shard->KeepMemory() == 0);  // not yet given back
  EXPECT(t->tier_stats().ram_rows == ram_rows);
  munmap(buffers, kHeld);
  EXPECT(shard->KeepMemory() == 0);  // back as before: settled
  void* more = TakeMemory();         // memory taken outside any save or load
  size_t moved = 0;
  for (int i = 0; i < 20; ++i) moved += shard->KeepMemory();
  EXPECT(moved > 0);
  EXPECT(t->tier_stats().ram_rows < ram_rows);
  munmap(more, kHeld);
}

DLT_TEST(TestMemoryABufferFreedWhileTheKeeperMeasuresMovesNoRow) {
  // The data plane's buffers (a pooled reply) are counted within the room
  // held back for buffers, not as overhead rows give way to. One freed
  // while a pass measures is gone from the resident memory or still in
  // the count, never neither: the keeper read the count once, after the
  // resident memory, and a pooled reply let go between the two reads
  // counted as overhead (rows of a table without a tier were evicted for
  // good, once in a dozen runs of a test of large pulls).
  FilledShard made;
  Shard* shard = made.shard.get();
  const std::shared_ptr<Table>& t = made.t;
  if (testing::kUnderAddressSanitizer) return;  // measures resident memory
  void* buffer = TakeMemory();
  std::atomic<bool> release{false};
  shard->SetBufferBytes([&] {
    // A buffer pooled until `release`, then let go by the first pass that
    // asks: freed just as it measures, counted until then.
    if (!release.load() || buffer == nullptr) return buffer == nullptr ? uint64_t{0} : kHeld;
    munmap(buffer, kHeld);
    buffer = nullptr;
    return uint64_t{0};
  });
  SettleMemory(shard);
  const uint64_t ram_rows = t->tier_stats().ram_rows;
  EXPECT(ram_rows > 0);
  for (int i = 0; i < 3; ++i) EXPECT(shard->KeepMemory() == 0);  // counted as a buffer
  release = true;
  EXPECT(shard->KeepMemory() == 0);
  EXPECT(buffer == nullptr);
  for (int i = 0; i < 3; ++i) EXPECT(shard->KeepMemory() == 0);  // and gone
  EXPECT(t->tier_stats().ram_rows == ram_rows);
  shard->SetBufferBytes(nullptr);
}

DLT_TEST(TestAKeepersDiskErrorClearsOnceNothingNeedsMoving) {
  // The keeper's failure to move rows (a full disk) is shown in the tier's
  // stats while rows need moving; once RAM is back under its target (the
  // memory that pushed it over was given back), it no longer fails, and the
  // error goes, Shard::kKeeperErrorHold after the last failure (so it does
  // not come and go with each pass across the target). It stayed in
  // `tf-dlt stats` for good.
  FilledShard made;
  Shard* shard = made.shard.get();
  const std::shared_ptr<Table>& t = made.t;
  if (testing::kUnderAddressSanitizer) return;  // measures resident memory
  SettleMemory(shard);
  EXPECT(t->tier_stats().error.empty());
  DiskFaults full;
  full.failing_writes = 1 << 30;
  InjectDiskFaults(full);
  void* taken = TakeMemory();
  for (int i = 0; i < 3; ++i) shard->KeepMemory();
  EXPECT(t->tier_stats().error.find("No space left on device") != std::string::npos);
  munmap(taken, kHeld);
  for (int i = 0; i < 3; ++i) shard->KeepMemory();
  EXPECT(!t->tier_stats().error.empty());  // held a while
  std::this_thread::sleep_for(Shard::kKeeperErrorHold + std::chrono::milliseconds(100));
  shard->KeepMemory();
  InjectDiskFaults(DiskFaults{});
  EXPECT(t->tier_stats().error.empty());
}

DLT_TEST(TestMemoryTheWaitAfterASaveIsNotExtendedByTheNext) {
  // The keeper waits Shard::kSettle at most from the end of the first save
  // or load, however many end within it (a follower's deltas, a few
  // hundred ms apart): memory still held after that counts. (Takes
  // kSettle: it waits for the keeper to move rows, which a wait extended
  // by the second save would not let it do before that one's kSettle.)
  FilledShard made;
  Shard* shard = made.shard.get();
  const std::shared_ptr<Table>& t = made.t;
  if (testing::kUnderAddressSanitizer) return;  // as above
  SettleMemory(shard);
  const uint64_t ram_rows = t->tier_stats().ram_rows;
  EXPECT(ram_rows > 0);
  shard->SetPersisting(true);
  void* buffers = TakeMemory();
  EXPECT(shard->KeepMemory() == 0);
  shard->SetPersisting(false);
  const auto first_end = std::chrono::steady_clock::now();
  EXPECT(shard->KeepMemory() == 0);
  std::this_thread::sleep_for(Shard::kSettle / 2);
  shard->SetPersisting(true);  // the next one, still holding the memory
  EXPECT(shard->KeepMemory() == 0);
  shard->SetPersisting(false);
  EXPECT(shard->KeepMemory() == 0);  // within the first one's wait
  const auto second_end = std::chrono::steady_clock::now();
  // Passes until one moves rows: never before the first one's wait is
  // over, and well before the second's would be.
  const auto by = second_end + Shard::kSettle - Shard::kSettle / 4;
  size_t moved = 0;
  auto first_move = by;
  while (moved == 0 && std::chrono::steady_clock::now() < by) {
    const auto pass = std::chrono::steady_clock::now();
    moved = shard->KeepMemory();
    if (moved == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } else {
      first_move = pass;
    }
  }
  EXPECT(moved > 0);
  EXPECT(first_move >= first_end + Shard::kSettle - std::chrono::milliseconds(50));
  for (int i = 0; i < 20; ++i) moved += shard->KeepMemory();
  EXPECT(t->tier_stats().ram_rows < ram_rows);
  munmap(buffers, kHeld);
}

DLT_TEST(TestAPullThatMakesNoRowReadsTheValuesAMadeRowHolds) {
  // A 16-bit table's initial values as a pull that makes no row returns
  // them (serving's "init", an unadmitted id read as "initial", a tiered
  // shard at its RAM limit) and as the row made for the id holds them:
  // one rounding, the same values. (Unrounded, bfloat16 rows differed by
  // up to 5e-4, so a trainer's forward pass used values no row held.)
  for (const uint64_t dtype : {uint64_t{1}, uint64_t{2}}) {  // bfloat16, float16
    TableConfig config = TierTable(OptimizerKind::kAdagrad, InitializerKind::kTruncatedNormal);
    config.dim = 8;
    config.initializer.stddev = 0.3f;
    config.policy.value_dtype = dtype;
    constexpr size_t kIds = 512;
    std::vector<int64_t> ids(kIds);
    for (size_t i = 0; i < kIds; ++i) ids[i] = static_cast<int64_t>(i * 7919 + 3);
    const size_t floats = kIds * config.dim;
    Table made(config);
    std::vector<float> held(floats), read(floats);
    EXPECT_OK(made.Pull(ids.data(), kIds, PullMode::kInsert, held.data()));
    EXPECT(made.size() == kIds);
    EXPECT_OK(made.Pull(ids.data(), kIds, PullMode::kZerosNoInsert, read.data()));
    EXPECT(read == held);  // what the rows hold
    Table fresh(config);
    EXPECT_OK(fresh.Pull(ids.data(), kIds, PullMode::kInitNoInsert, read.data()));
    EXPECT(fresh.size() == 0 && read == held);
    TableConfig admitting = config;
    admitting.policy.admission = static_cast<uint64_t>(AdmissionKind::kFrequency);
    admitting.policy.min_count = 3;
    admitting.policy.sketch_bytes = 1 << 20;
    admitting.policy.unadmitted = static_cast<uint64_t>(UnadmittedValue::kInitial);
    Table unadmitted(admitting);
    EXPECT_OK(unadmitted.Pull(ids.data(), kIds, PullMode::kInsert, read.data()));
    EXPECT(unadmitted.size() == 0 && read == held);
    // A tiered table whose RAM is full: a training pull leaves new rows to
    // their push and returns their initial values.
    TempDir dir;
    Table tiered(config);
    tiered.AttachTier(dir.path);
    tiered.SetRamLimit(kStripes * 2);
    std::vector<int64_t> filler(kStripes * 16);
    for (size_t i = 0; i < filler.size(); ++i) filler[i] = -1 - static_cast<int64_t>(i);
    std::vector<float> scratch(filler.size() * config.dim);
    EXPECT_OK(tiered.Pull(filler.data(), filler.size(), PullMode::kInsert, scratch.data()));
    const size_t before = tiered.size();
    EXPECT_OK(tiered.Pull(ids.data(), kIds, PullMode::kInsert, read.data()));
    EXPECT(tiered.size() < before + kIds);  // some made no row
    EXPECT(read == held);
  }
}

DLT_TEST(TestStoredImportEqualsFloatImportOnBothTiers) {
  // 16-bit rows imported as stored (a checkpoint's, not widened first) make
  // the same table as the same rows imported as floats, in RAM and on disk
  // alike; a stored NaN or infinity is refused, naming its row.
  for (const uint64_t dtype : {uint64_t{1}, uint64_t{2}}) {  // bfloat16, float16
    TempDir dir;
    TableConfig config = TierTable(OptimizerKind::kAdagrad);
    config.policy.value_dtype = dtype;
    config.policy.slot_dtype = dtype;
    Table stored(config), floats(config);
    for (Table* t : {&stored, &floats}) {
      const std::string path = dir.path + (t == &stored ? "/a" : "/b");
      std::filesystem::create_directories(path);
      t->AttachTier(path);
      t->SetRamLimit(kStripes * 8);  // most rows go to disk
    }
    constexpr size_t kRows = 5000;
    const uint32_t dim = config.dim, k = stored.slot_floats();
    std::vector<int64_t> ids(kRows);
    std::vector<uint32_t> steps(kRows);
    std::vector<float> values(kRows * dim), slots(kRows * k);
    std::mt19937_64 rng(5);
    for (size_t i = 0; i < kRows; ++i) {
      ids[i] = static_cast<int64_t>(rng());
      steps[i] = static_cast<uint32_t>(i % 7);
    }
    for (auto& v : values) v = static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 64;
    for (auto& v : slots) v = static_cast<float>(rng() % 1000) / 32;
    // The 16-bit rows, and the floats they widen to.
    std::vector<uint16_t> values16(values.size()), slots16(slots.size());
    StoreValues(values.data(), dtype, false, 0, static_cast<uint32_t>(values.size()),
                values16.data());
    StoreValues(slots.data(), dtype, false, 0, static_cast<uint32_t>(slots.size()), slots16.data());
    LoadValues(values16.data(), dtype, static_cast<uint32_t>(values.size()), values.data());
    LoadValues(slots16.data(), dtype, static_cast<uint32_t>(slots.size()), slots.data());
    EXPECT_OK(
        stored.ImportStored(ids.data(), values16.data(), slots16.data(), steps.data(), kRows));
    EXPECT_OK(floats.Import(ids.data(), values.data(), slots.data(), steps.data(), kRows));
    EXPECT(stored.tier_stats().disk_rows > kRows / 2);
    EXPECT(Rows(&stored) == Rows(&floats));
    // Without slots: fresh ones, as a float import makes them.
    const std::vector<int64_t> more = {-1, -2, -3};
    EXPECT_OK(stored.ImportStored(more.data(), values16.data(), nullptr, nullptr, 3, nullptr));
    EXPECT_OK(floats.Import(more.data(), values.data(), nullptr, nullptr, 3));
    EXPECT(Rows(&stored) == Rows(&floats));
    // A non-finite stored value (all-ones exponent) in row 1.
    std::vector<uint16_t> bad(values16.begin(), values16.begin() + 2 * dim);
    bad[dim + 2] = dtype == 1 ? 0x7fc0 : 0x7e00;  // NaN
    const std::vector<int64_t> two = {7, 8};
    const Status s = stored.ImportStored(two.data(), bad.data(), nullptr, nullptr, 2, nullptr);
    EXPECT(s.code() == Code::kInvalidArgument);
    EXPECT(s.message().find("row 1 (id 8)") != std::string::npos);
    EXPECT(stored.size() == kRows + 3);
  }
}

}  // namespace
DLT_TEST(TestALoadLeavesRamRowsTheKeeperKeeps) {
  // Reserve takes the tier's fingerprints out of the RAM rows' limit as the
  // memory keeper counts them once the rows are in (at their doubled size
  // from 2/3 of the fill that doubles the files), so a load that fills RAM
  // to the limit is not followed by a wave of demotions. Cold rows 3, 4 and
  // 5 times the limit: each stripe's file at 64 pages (one per bucket of
  // its window, the least a file settles at), filled 0.41, 0.55 and 0.71.
  // (Few rows: a sanitized process keeps what it frees a while, and the
  // shard budget test before measures the process.)
  constexpr uint64_t kLimit = kStripes * 1024;
  std::vector<int64_t> ids;
  std::vector<float> values;
  for (const uint64_t rows : {kLimit * 4, kLimit * 5, kLimit * 6}) {
    TempDir dir;
    Table t(TierTable(OptimizerKind::kSgd));
    t.AttachTier(dir.path);
    t.SetRamLimit(kLimit);
    const size_t row = t.ram_row_bytes();      // (as Reserve counts a row)
    const size_t fixed = t.ram_fixed_bytes();  // (the change log's, before the tier's)
    const size_t room = kLimit * row;          // what the limit gave the rows
    t.Reserve(rows, 1);
    ids.resize(rows);
    values.assign(rows * 4, 0.5f);
    for (uint64_t i = 0; i < rows; ++i) ids[i] = static_cast<int64_t>(Mix64(i + 3));
    EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, nullptr, rows));
    const size_t kept = t.ram_limit() * row + (t.ram_fixed_bytes() - fixed);
    EXPECT(kept <= room + room / 50);
    EXPECT(t.tier_stats().ram_rows + t.tier_stats().disk_rows == rows);
  }
}

DLT_TEST(TestNearTheRamLimitOnlyRowsAboveTheKeepersCutMoveIn) {
  // Near its RAM limit a table takes a cold row back into RAM only when it
  // scores above the coldest row the memory keeper weighed moving out, or
  // was moved out within the current window (1,024 rows a stripe here: a
  // ghost, which LRU would have kept); the others are read and updated on
  // disk. Every row equals an all-RAM oracle fed the same calls, an id
  // thrice in a push included.
  TempDir dir;
  const TableConfig config = TierTable(OptimizerKind::kAdagrad);
  Table t(config);
  t.AttachTier(dir.path);
  Table oracle(config);
  constexpr uint64_t kLimit = kStripes * 256;
  constexpr size_t kOld = kLimit * 2, kNew = kLimit * 4;
  std::vector<int64_t> ids(kOld + kNew);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(Mix64(i + 11));
  const std::vector<int64_t> old(ids.begin(), ids.begin() + kOld);
  std::vector<float> grads(ids.size() * 4);
  std::mt19937_64 rng(4);
  for (auto& g : grads) g = static_cast<float>(static_cast<int>(rng() % 64) - 32) / 16.0f;
  auto push = [&](const std::vector<int64_t>& batch) {
    EXPECT_OK(t.Push(batch.data(), grads.data(), batch.size(), 0.1f));
    EXPECT_OK(oracle.Push(batch.data(), grads.data(), batch.size(), 0.1f));
  };
  // The old rows are moved out, then newer ones (over a window a stripe:
  // the old ones are ghosts no more); the cut is the newer rows' stamp.
  push(old);
  Status s;
  EXPECT(t.Demote(t.ram_rows(), &s) == kOld);
  push(std::vector<int64_t>(ids.begin() + kOld, ids.end()));
  EXPECT(t.Demote(t.ram_rows(), &s) == kNew);
  EXPECT_OK(s);
  t.SetRamLimit(kLimit);
  // While RAM has room, pushed cold rows move in whatever their score.
  push(std::vector<int64_t>(old.begin(), old.begin() + kLimit - kLimit / 16));
  const TierStats before = t.tier_stats();
  EXPECT(before.promotions == kLimit - kLimit / 16 && before.disk_updates == 0);
  // Old rows untouched since, pulled and pushed: read and updated on disk.
  std::vector<int64_t> once(old.begin() + kOld / 2, old.begin() + kOld / 2 + 2000);
  once.push_back(once[5]);
  once.push_back(once[5]);
  std::vector<float> got(once.size() * 4), want(once.size() * 4);
  EXPECT_OK(t.Pull(once.data(), once.size(), PullMode::kInsert, got.data()));
  EXPECT_OK(oracle.Pull(once.data(), once.size(), PullMode::kInsert, want.data()));
  EXPECT(got == want);
  push(once);
  const TierStats after = t.tier_stats();
  EXPECT(after.promotions == before.promotions);
  EXPECT(after.disk_updates == 2000);
  EXPECT(after.ram_rows == before.ram_rows);
  // Touched since the cut, they move in on their next push.
  push(std::vector<int64_t>(once.begin(), once.begin() + 500));
  EXPECT(t.tier_stats().promotions == after.promotions + 500);
  EXPECT(t.tier_stats().disk_updates == 2000);
  EXPECT(Rows(&t) == Rows(&oracle));

  // Ghosts: rows moved out in the current window move back in on their
  // first touch, as LRU would have kept them.
  TempDir dir2;
  Table u(config);
  u.AttachTier(dir2.path);
  push(old);  // (on t and the oracle too: harmless)
  EXPECT_OK(u.Push(old.data(), grads.data(), kOld, 0.1f));
  EXPECT(u.Demote(u.ram_rows(), &s) == kOld);  // under a window a stripe
  u.SetRamLimit(kLimit);
  const std::vector<int64_t> fresh(ids.begin() + kOld, ids.begin() + kOld + kLimit - kLimit / 16);
  EXPECT_OK(u.Push(fresh.data(), grads.data(), fresh.size(), 0.1f));  // RAM near its limit
  const uint64_t promoted = u.tier_stats().promotions;
  std::vector<float> out(1000 * 4);
  EXPECT_OK(u.Pull(old.data(), 1000, PullMode::kInsert, out.data()));
  EXPECT(u.tier_stats().promotions == promoted + 1000);
}

DLT_TEST(TestAStateInsertPullMovesColdRowsInOrReadsThemOnDisk) {
  // A trainer's state pull of cold rows: with RAM to spare they move in and
  // their state is read; with RAM full they are read on disk and come back
  // with their values and kNoState (as a plain training pull reads them).
  TempDir dir;
  const TableConfig config = TierTable(OptimizerKind::kAdagrad);
  Table t(config), oracle(config);
  t.AttachTier(dir.path);
  std::vector<int64_t> ids(2000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(Mix64(i + 5));
  std::vector<float> grads(ids.size() * 4);
  std::mt19937_64 rng(9);
  for (auto& g : grads) g = static_cast<float>(static_cast<int>(rng() % 64) - 32) / 16.0f;
  EXPECT_OK(t.Push(ids.data(), grads.data(), ids.size(), 0.1f));
  EXPECT_OK(oracle.Push(ids.data(), grads.data(), ids.size(), 0.1f));
  Status s;
  EXPECT(t.Demote(t.ram_rows(), &s) == ids.size());
  EXPECT_OK(s);
  const uint32_t width = StateFloats(config.dim, t.slot_floats());
  std::vector<float> want(ids.size() * width);
  EXPECT_OK(oracle.Pull(ids.data(), ids.size(), PullMode::kState, want.data()));

  std::vector<float> got(1000 * width);
  EXPECT_OK(t.Pull(ids.data(), 1000, PullMode::kState, got.data()));  // RAM only
  for (size_t k = 0; k < 1000; ++k) EXPECT(StepOfState(&got[k * width], width) == kNoState);
  EXPECT_OK(t.Pull(ids.data(), 1000, PullMode::kStateInsert, got.data()));
  EXPECT(got == std::vector<float>(want.begin(), want.begin() + 1000 * width));
  EXPECT(t.tier_stats().promotions == 1000);

  // RAM full (the stripes hold more than 16 rows each, over a limit of 1):
  // the other 1,000 stay on disk and read their values.
  std::vector<int64_t> hot(kStripes * 32);
  for (size_t i = 0; i < hot.size(); ++i) hot[i] = static_cast<int64_t>(Mix64(i + 100000));
  const std::vector<float> hot_grads(hot.size() * 4, 0.5f);
  EXPECT_OK(t.Push(hot.data(), hot_grads.data(), hot.size(), 0.1f));
  t.SetRamLimit(1);
  EXPECT_OK(t.Pull(ids.data() + 1000, 1000, PullMode::kStateInsert, got.data()));
  EXPECT(t.tier_stats().promotions == 1000);
  std::vector<float> values(1000 * 4);
  EXPECT_OK(oracle.Pull(ids.data() + 1000, 1000, PullMode::kInsert, values.data()));
  for (size_t k = 0; k < 1000; ++k) {
    EXPECT(StepOfState(&got[k * width], width) == kNoState);
    EXPECT(std::equal(&got[k * width], &got[k * width] + 4, &values[k * 4]));
  }
}

DLT_TEST(TestAFullDiskFailsAnUpdateOnDiskAndLeavesTheRow) {
  // A push that updates a cold row where it lies and meets a full disk
  // fails with RESOURCE_EXHAUSTED, counts the write error and leaves that
  // row, and every other row of its stripe, as it was; once the disk takes
  // writes, the same push applies once.
  TempDir dir;
  const TableConfig config = TierTable(OptimizerKind::kAdagrad);
  Table t(config);
  t.AttachTier(dir.path);
  Table oracle(config);
  constexpr uint64_t kLimit = kStripes * 256;
  constexpr size_t kOld = kLimit * 2, kNew = kLimit * 4;
  std::vector<int64_t> ids(kOld + kNew);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(Mix64(i + 23));
  std::vector<float> grads(ids.size() * 4, 0.5f);
  auto push = [&](const int64_t* batch, size_t n) {
    EXPECT_OK(t.Push(batch, grads.data(), n, 0.1f));
    EXPECT_OK(oracle.Push(batch, grads.data(), n, 0.1f));
  };
  // As in the test before: old rows on disk, no longer ghosts, below the
  // cut; RAM at 15/16 of its limit.
  push(ids.data(), kOld);
  Status s;
  t.Demote(t.ram_rows(), &s);
  push(ids.data() + kOld, kNew);
  t.Demote(t.ram_rows(), &s);
  EXPECT_OK(s);
  t.SetRamLimit(kLimit);
  push(ids.data(), kLimit - kLimit / 16);
  const int64_t cold = ids[kOld / 2];
  std::vector<float> before(4), after(4);
  EXPECT_OK(t.Pull(&cold, 1, PullMode::kZerosNoInsert, before.data()));
  DiskFaults full;
  full.failing_writes = 1;
  InjectDiskFaults(full);
  s = t.Push(&cold, grads.data(), 1, 0.1f);
  InjectDiskFaults(DiskFaults{});
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find("No space left on device") != std::string::npos);
  const TierStats stats = t.tier_stats();
  EXPECT(stats.disk_write_errors == 1 && stats.disk_updates == 0 && stats.error == s.message());
  EXPECT_OK(t.Pull(&cold, 1, PullMode::kZerosNoInsert, after.data()));
  EXPECT(after == before);
  push(&cold, 1);
  EXPECT(t.tier_stats().disk_updates == 1);
  EXPECT(Rows(&t) == Rows(&oracle));

  // A push of a RAM row and two cold rows of one stripe whose second disk
  // write fails: the first cold row is put back and the RAM row was never
  // touched, so a retry applies the push once.
  const uint32_t stripe = t.StripeOfBucket(BucketOf(cold));
  std::vector<int64_t> mixed;
  for (size_t i = 0; i < kLimit - kLimit / 16 && mixed.empty(); ++i) {
    if (t.StripeOfBucket(BucketOf(ids[i])) == stripe) mixed.push_back(ids[i]);  // in RAM
  }
  for (size_t i = kLimit; i < kOld && mixed.size() < 3; ++i) {
    if (ids[i] != cold && t.StripeOfBucket(BucketOf(ids[i])) == stripe) mixed.push_back(ids[i]);
  }
  EXPECT(mixed.size() == 3);
  DiskFaults second;
  second.passing_writes = 1;
  second.failing_writes = 1;
  InjectDiskFaults(second);
  s = t.Push(mixed.data(), grads.data(), mixed.size(), 0.1f);
  InjectDiskFaults(DiskFaults{});
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find("none of the push's rows in this stripe") != std::string::npos);
  EXPECT(t.tier_stats().disk_updates == 1 && t.tier_stats().error == s.message());
  EXPECT(Rows(&t) == Rows(&oracle));
  push(mixed.data(), mixed.size());
  EXPECT(t.tier_stats().disk_updates == 3);
  EXPECT(Rows(&t) == Rows(&oracle));
}

DLT_TEST(TestAnImportOverARowOnDiskThatFailsHalfWayLeavesTheRowWhole) {
  // An import (a load past the RAM limit) of a row whose copy lies on disk
  // rewrites it where it lies. A slot across a 4 KiB boundary is written
  // in two; when the second write fails, the import fails with
  // RESOURCE_EXHAUSTED and the row is put back as it was, not left with
  // its new values and its old slots (or half a value). Every other row,
  // in RAM or on disk, is as it was; a retry imports the row.
  // (Rows of dim 16 make tier pages of 8 KiB, some slots across their middle.)
  TempDir dir;
  TableConfig config = TierTable(OptimizerKind::kAdagrad, InitializerKind::kZeros);
  constexpr uint32_t kDim = 16;
  config.dim = kDim;
  Table t(config);
  t.AttachTier(dir.path);
  constexpr size_t kCold = 4096, kWarm = kStripes * 64;
  std::vector<int64_t> cold(kCold), warm(kWarm);
  for (size_t i = 0; i < kCold; ++i) cold[i] = static_cast<int64_t>(Mix64(i + 101));
  for (size_t i = 0; i < kWarm; ++i) warm[i] = static_cast<int64_t>(Mix64(i + 900001));
  std::vector<float> ones(kCold * kDim, 1.0f), twos(kWarm * kDim, 2.0f);
  const std::vector<uint32_t> steps(kCold, 7);
  EXPECT_OK(t.Import(cold.data(), ones.data(), nullptr, steps.data(), kCold));
  Status s;
  t.Demote(t.ram_rows(), &s);  // every row on disk
  EXPECT_OK(s);
  EXPECT_OK(t.Import(warm.data(), twos.data(), nullptr, nullptr, kWarm));
  t.SetRamLimit(1);  // every stripe's RAM full: imports go to disk
  std::map<int64_t, Row> expected = Rows(&t);
  const std::vector<float> threes(kDim, 3.0f);
  size_t failed = 0;
  for (size_t i = 0; i < kCold && failed == 0; ++i) {
    DiskFaults second;
    second.passing_writes = 1;
    second.failing_writes = 1;
    InjectDiskFaults(second);
    s = t.Import(&cold[i], threes.data(), nullptr, nullptr, 1);
    InjectDiskFaults(DiskFaults{});
    if (s.ok()) {
      expected[cold[i]].values = threes;
      expected[cold[i]].step = 0;
      continue;
    }
    ++failed;
    EXPECT(s.code() == Code::kResourceExhausted);
    EXPECT(s.message().find("No space left on device") != std::string::npos);
    EXPECT(s.message().find("left as it was") != std::string::npos);
    EXPECT(t.tier_stats().error == s.message());
    EXPECT(Rows(&t) == expected);  // the row as it was, every other too
    EXPECT_OK(t.Import(&cold[i], threes.data(), nullptr, nullptr, 1));
    expected[cold[i]].values = threes;
    expected[cold[i]].step = 0;
  }
  EXPECT(failed == 1);  // some slot lies across a 4 KiB boundary
  EXPECT(t.ram_rows() == kWarm && t.size() == kCold + kWarm);
  EXPECT(Rows(&t) == expected);
}

DLT_TEST(TestEraseBucketsLeavesNoRowAPullMovesInMeanwhile) {
  // A follower applies a table held whole in place: its rows not in the
  // file go (EraseBuckets) while pulls serve. A pull that moves a cold row
  // of those buckets into RAM between the erase's RAM pass and its pass
  // over the cold rows must not let the row survive.
  TempDir dir;
  const TableConfig config = TierTable(OptimizerKind::kSgd, InitializerKind::kZeros);
  Table t(config);
  t.AttachTier(dir.path);
  constexpr size_t kRows = 20000;
  std::vector<int64_t> ids(kRows);
  std::vector<float> values(kRows * 4, 1.0f);
  for (size_t i = 0; i < kRows; ++i) ids[i] = static_cast<int64_t>(i) * 7919 + 5;
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    std::mt19937_64 rng(7);
    std::vector<int64_t> some(64);
    std::vector<float> out(64 * 4);
    while (!stop.load()) {
      for (auto& id : some) id = ids[rng() % kRows];
      (void)t.Pull(some.data(), some.size(), PullMode::kZerosNoInsert, out.data());
    }
  });
  size_t survived = 0;
  for (int round = 0; round < 20 && survived == 0; ++round) {
    EXPECT_OK(t.Import(ids.data(), values.data(), nullptr, nullptr, kRows));
    Status s;
    t.Demote(t.ram_rows(), &s);  // every row on disk
    EXPECT_OK(s);
    Status erased;
    t.EraseBuckets(0, kNumBuckets, nullptr, 0, &erased);
    EXPECT_OK(erased);
    survived = t.size();
  }
  stop.store(true);
  reader.join();
  EXPECT(survived == 0);
}

// A tiered LRU table of dim 32 over max_rows of kQuota a stripe (its clock
// at 1,000 pushes) holding about 5,000 cold rows a stripe, touched at 900.
struct EvictionTable {
  static constexpr size_t kQuota = 5200;
  TempDir dir;
  Table t{Config()};
  int64_t next = 1;
  static TableConfig Config() {
    TableConfig config = TierTable(OptimizerKind::kAdagrad, InitializerKind::kZeros);
    config.dim = 32;
    config.policy.eviction = static_cast<uint64_t>(EvictionKind::kLru);
    config.policy.clock = static_cast<uint64_t>(ClockKind::kPushes);
    config.policy.max_rows = kQuota * kStripes;
    return config;
  }
  EvictionTable() {
    t.AttachTier(dir.path);
    t.SetPushClock(1000);
    Import(kStripes * 5000, 900);
    Status s;
    t.Demote(t.ram_rows(), &s);
    EXPECT_OK(s);
  }
  // `n` new rows (into RAM) touched at `touched`; their ids.
  std::vector<int64_t> Import(size_t n, uint32_t touched) {
    std::vector<int64_t> ids(n);
    for (auto& id : ids) id = (next++) * 7919;
    Import(ids, touched);
    return ids;
  }
  void Import(const std::vector<int64_t>& ids, uint32_t touched) {
    const size_t n = ids.size();
    std::vector<float> values(n * 32, 0.5f), slots(n * 32, 0.1f);
    std::vector<uint32_t> steps(n, 1), stamps(n, touched);
    EXPECT_OK(t.Import(ids.data(), values.data(), slots.data(), steps.data(), n, stamps.data()));
  }
};

DLT_TEST(TestEvictionAcrossTiersKeepsARowPushedWhileItRuns) {
  // Eviction over both tiers scores a stripe's RAM rows, reads its cold
  // rows a batch of pages at a time, then removes the lowest scoring: a row
  // pushed in between is the hottest row (LRU) and must stay.
  EvictionTable e;
  Table& t = e.t;
  // Rows to push while the eviction runs: the coldest (touched at 0), so
  // the first a stripe's eviction picks.
  const std::vector<int64_t> hot = e.Import(kStripes * 10, 0);
  const std::vector<float> grads(hot.size() * 32, 0.01f);
  std::vector<float> out(hot.size() * 32);
  size_t lost = 0;
  for (int round = 0; round < 20 && lost == 0; ++round) {
    // About 1,000 RAM rows a stripe touched at 500 (the victims with the
    // hot rows, each stripe past its quota); the hot rows cold again.
    e.Import(kStripes * 1000, 500);
    e.Import(hot, 0);
    const size_t before = t.size();
    std::atomic<bool> done{false};
    std::thread pusher([&] {
      // Once the first stripe's rows go, the next stripe's are being
      // weighed: push every hot row (one removed already comes back).
      while (t.size() == before && !done.load()) {
      }
      EXPECT_OK(t.Push(hot.data(), grads.data(), hot.size(), 0.1f));
    });
    EXPECT(t.EvictAcrossTiers() > 0);
    done.store(true);
    pusher.join();
    EXPECT_OK(t.Pull(hot.data(), hot.size(), PullMode::kZerosNoInsert, out.data()));
    for (size_t i = 0; i < hot.size(); ++i) lost += out[i * 32] == 0.0f;
  }
  EXPECT(lost == 0);
}

DLT_TEST(TestEvictionAcrossTiersTakesAsManyRowsAsAskedWhileRowsMove) {
  // Rows the memory keeper moves to disk during the eviction's pass over a
  // stripe (weighed in RAM, then read again from disk; or in a tier file
  // that doubled between two batches of pages) are removed once each and
  // the stripe still goes down to its quota less the slack.
  EvictionTable e;
  Table& t = e.t;
  constexpr size_t kQuota = EvictionTable::kQuota;
  bool exact = true;
  for (int round = 0; round < 10 && exact; ++round) {
    e.Import(kStripes * 1000, 500);  // each stripe past its quota
    std::atomic<bool> done{false};
    std::thread demoter([&] {
      Status s;
      while (!done.load() && s.ok()) t.Demote(kStripes * 4, &s);
      EXPECT_OK(s);
    });
    EXPECT(t.EvictAcrossTiers() > 0);
    done.store(true);
    demoter.join();
    exact = t.size() == kStripes * (kQuota - kQuota / 32);
    if (!exact)
      std::printf("round %d: %zu rows, not %zu\n", round, t.size(),
                  kStripes * (kQuota - kQuota / 32));
  }
  EXPECT(exact);
}

}  // namespace dlt
