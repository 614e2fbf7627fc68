// tier_probe: same cold-row workload against RocksDB, LMDB and "pagehash".
// Stand-alone measurement probe; not part of the tf_dlt build.
// Build/run: see README.md in this folder.
#include <fcntl.h>
#include <lmdb.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include <dirent.h>

#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/table.h>

static constexpr int kRec = 136;  // 8-byte header + 16 f32 row + 16 f32 Adagrad
static constexpr int kDim = 16;

// ---------------------------------------------------------------- helpers
static inline uint64_t mix64(uint64_t z) {  // splitmix64 finalizer (bijective)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
// Row index -> id. Indexes [0,N) are present; indexes >= N are guaranteed
// absent because mix64 is a bijection.
static inline uint64_t id_of(uint64_t idx) { return mix64(idx + 0x1234567ULL); }

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() { s += 0x9e3779b97f4a7c15ULL; return mix64(s); }
  uint64_t below(uint64_t n) { return (unsigned __int128)next() * n >> 64; }
  double u01() { return (next() >> 11) * 0x1.0p-53; }
};

static void make_record(uint64_t id, uint32_t ver, uint8_t* out) {
  uint64_t hdr = (uint64_t(ver) << 32) | kDim;
  memcpy(out, &hdr, 8);
  float f[2 * kDim];
  for (int i = 0; i < 2 * kDim; i++) f[i] = float(uint32_t(id) ^ uint32_t(i)) * 1e-9f;
  memcpy(out + 8, f, sizeof f);
}
static bool check_record(uint64_t id, const uint8_t* r) {
  float a, b;
  memcpy(&a, r + 8, 4);
  memcpy(&b, r + 8 + 4 * 31, 4);
  return a == float(uint32_t(id)) * 1e-9f && b == float(uint32_t(id) ^ 31u) * 1e-9f;
}

// Zipf sampler, rejection-inversion (Hoermann & Derflinger), ranks 1..n.
struct Zipf {
  double s, hx1, hn, sc;
  uint64_t n;
  static double h1(double x) { return std::fabs(x) > 1e-8 ? std::log1p(x) / x : 1 - x * (0.5 - x * (1.0 / 3 - 0.25 * x)); }
  static double h2(double x) { return std::fabs(x) > 1e-8 ? std::expm1(x) / x : 1 + x * 0.5 * (1 + x / 3 * (1 + 0.25 * x)); }
  double h(double x) const { return std::exp(-s * std::log(x)); }
  double H(double x) const { double lx = std::log(x); return h2((1 - s) * lx) * lx; }
  double Hinv(double x) const { double t = x * (1 - s); if (t < -1) t = -1; return std::exp(h1(t) * x); }
  Zipf(uint64_t n_, double s_) : s(s_), n(n_) {
    hx1 = H(1.5) - 1; hn = H(n + 0.5); sc = 2 - Hinv(H(2.5) - h(2));
  }
  uint64_t sample(Rng& r) const {
    for (;;) {
      double u = hn + r.u01() * (hx1 - hn), x = Hinv(u);
      int64_t k = int64_t(x + 0.5);
      if (k < 1) k = 1; else if (uint64_t(k) > n) k = n;
      if (k - x <= sc || u >= H(k + 0.5) - h(k)) return uint64_t(k);
    }
  }
};

static long status_kb(const char* key) {
  FILE* f = fopen("/proc/self/status", "r");
  char line[256]; long v = -1; size_t kl = strlen(key);
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, key, kl) && line[kl] == ':') { v = atol(line + kl + 1); break; }
  if (f) fclose(f);
  return v;
}
static double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double cpu_s() {
  rusage u; getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}
static void dir_bytes(const std::string& d, uint64_t* apparent, uint64_t* alloc) {
  *apparent = *alloc = 0;
  DIR* dp = opendir(d.c_str()); if (!dp) return;
  while (dirent* e = readdir(dp)) {
    struct stat st; std::string p = d + "/" + e->d_name;
    if (stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode)) { *apparent += st.st_size; *alloc += uint64_t(st.st_blocks) * 512; }
  }
  closedir(dp);
}
static bool drop_caches() {
  sync();
  FILE* f = fopen("/proc/sys/vm/drop_caches", "w");
  if (!f) return false;
  bool ok = fputs("3\n", f) >= 0;
  return (fclose(f) == 0) && ok;
}
[[noreturn]] static void die(const char* m, const char* d = "") { fprintf(stderr, "FATAL %s %s\n", m, d); exit(1); }

// ---------------------------------------------------------------- engines
struct Engine {
  virtual ~Engine() {}
  virtual void put_batch(const uint64_t* ids, size_t n, uint32_t ver) = 0;
  // found[i]=1 if present; rec copies go to out (n*kRec).
  virtual void get_batch(const uint64_t* ids, size_t n, uint8_t* out, uint8_t* found) = 0;
  // churn: read+delete `pro` ids (returning records), then put `dem` ids.
  virtual void churn_batch(const uint64_t* pro, size_t np, uint8_t* out, uint8_t* found,
                           const uint64_t* dem, size_t nd, uint32_t ver) = 0;
  virtual void settle() = 0;      // make load durable / quiescent (timed separately)
  virtual void reopen_cold() = 0; // close, drop page cache, reopen
  virtual void report_mem(uint64_t n) = 0;
};

// --- RocksDB
struct RocksEngine : Engine {
  std::string dir; rocksdb::DB* db = nullptr; rocksdb::Options o;
  std::shared_ptr<rocksdb::Cache> cache;
  rocksdb::WriteOptions wo; rocksdb::ReadOptions ro;
  explicit RocksEngine(const std::string& d) : dir(d) {
    o.create_if_missing = true;
    o.compression = rocksdb::kNoCompression;
    o.bottommost_compression = rocksdb::kDisableCompressionOption;
    rocksdb::BlockBasedTableOptions t;
    cache = rocksdb::NewLRUCache(64 << 20);
    t.block_cache = cache;
    t.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
    o.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
    wo.disableWAL = true;
    open();
  }
  void open() { auto s = rocksdb::DB::Open(o, dir, &db); if (!s.ok()) die("rocksdb open", s.ToString().c_str()); }
  ~RocksEngine() { delete db; }
  static void key(uint64_t id, char* k) { for (int i = 0; i < 8; i++) k[i] = char(id >> (56 - 8 * i)); }
  void put_batch(const uint64_t* ids, size_t n, uint32_t ver) override {
    rocksdb::WriteBatch b; char k[8]; uint8_t r[kRec];
    for (size_t i = 0; i < n; i++) { key(ids[i], k); make_record(ids[i], ver, r); b.Put(rocksdb::Slice(k, 8), rocksdb::Slice((char*)r, kRec)); }
    auto s = db->Write(wo, &b); if (!s.ok()) die("rocksdb write", s.ToString().c_str());
  }
  void get_batch(const uint64_t* ids, size_t n, uint8_t* out, uint8_t* found) override {
    std::vector<char> kb(8 * n); std::vector<rocksdb::Slice> ks(n);
    std::vector<rocksdb::PinnableSlice> vs(n); std::vector<rocksdb::Status> st(n);
    for (size_t i = 0; i < n; i++) { key(ids[i], &kb[8 * i]); ks[i] = rocksdb::Slice(&kb[8 * i], 8); }
    db->MultiGet(ro, db->DefaultColumnFamily(), n, ks.data(), vs.data(), st.data());
    for (size_t i = 0; i < n; i++) {
      found[i] = st[i].ok() && vs[i].size() == kRec;
      if (found[i]) memcpy(out + i * kRec, vs[i].data(), kRec);
    }
  }
  void churn_batch(const uint64_t* pro, size_t np, uint8_t* out, uint8_t* found,
                   const uint64_t* dem, size_t nd, uint32_t ver) override {
    get_batch(pro, np, out, found);
    rocksdb::WriteBatch b; char k[8]; uint8_t r[kRec];
    for (size_t i = 0; i < np; i++) { key(pro[i], k); b.Delete(rocksdb::Slice(k, 8)); }
    for (size_t i = 0; i < nd; i++) { key(dem[i], k); make_record(dem[i], ver, r); b.Put(rocksdb::Slice(k, 8), rocksdb::Slice((char*)r, kRec)); }
    auto s = db->Write(wo, &b); if (!s.ok()) die("rocksdb write", s.ToString().c_str());
  }
  uint64_t prop(const char* p) { uint64_t v = 0; db->GetIntProperty(p, &v); return v; }
  void settle() override {
    rocksdb::FlushOptions f; f.wait = true; db->Flush(f);
    while (prop("rocksdb.compaction-pending") || prop("rocksdb.num-running-compactions") || prop("rocksdb.num-running-flushes"))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  void reopen_cold() override {
    delete db; db = nullptr;
    cache->EraseUnRefEntries();
    if (!drop_caches()) printf("note: drop_caches failed\n");
    open();
  }
  void report_mem(uint64_t n) override {
    uint64_t tr = prop("rocksdb.estimate-table-readers-mem"), bc = cache->GetUsage(),
             mt = prop("rocksdb.cur-size-all-mem-tables");
    printf("MEM rocksdb table_readers=%lu block_cache=%lu memtables=%lu -> %.2f B/row (readers+cache), %.2f B/row (readers only)\n",
           (unsigned long)tr, (unsigned long)bc, (unsigned long)mt, double(tr + bc) / n, double(tr) / n);
    std::string lv; db->GetProperty("rocksdb.levelstats", &lv); printf("%s", lv.c_str());
    printf("MEMROW rocksdb_struct %.2f\n", double(tr + bc) / n);
  }
};

// --- LMDB
struct LmdbEngine : Engine {
  std::string dir; MDB_env* env = nullptr; MDB_dbi dbi; unsigned extra;
  // extra = MDB_NORDAHEAD for the supplementary "lmdb_nordahead" variant.
  LmdbEngine(const std::string& d, unsigned x) : dir(d), extra(x) { open(); }
  void chk(int rc, const char* w) { if (rc) die(w, mdb_strerror(rc)); }
  void open() {
    chk(mdb_env_create(&env), "env_create");
    chk(mdb_env_set_mapsize(env, size_t(64) << 30), "mapsize");
    chk(mdb_env_open(env, dir.c_str(), MDB_NOSYNC | MDB_NOMETASYNC | extra, 0644), "env_open");
    MDB_txn* t; chk(mdb_txn_begin(env, nullptr, 0, &t), "txn");
    chk(mdb_dbi_open(t, nullptr, MDB_INTEGERKEY, &dbi), "dbi_open");
    chk(mdb_txn_commit(t), "commit");
  }
  void close() { mdb_env_close(env); env = nullptr; }
  ~LmdbEngine() { if (env) close(); }
  void put_in(MDB_txn* t, uint64_t id, uint32_t ver) {
    uint8_t r[kRec]; make_record(id, ver, r);
    MDB_val k{8, &id}, v{kRec, r};
    chk(mdb_put(t, dbi, &k, &v, 0), "put");
  }
  void put_batch(const uint64_t* ids, size_t n, uint32_t ver) override {
    MDB_txn* t; chk(mdb_txn_begin(env, nullptr, 0, &t), "txn");
    for (size_t i = 0; i < n; i++) put_in(t, ids[i], ver);
    chk(mdb_txn_commit(t), "commit");
  }
  void get_in(MDB_txn* t, const uint64_t* ids, size_t n, uint8_t* out, uint8_t* found) {
    for (size_t i = 0; i < n; i++) {
      uint64_t id = ids[i]; MDB_val k{8, &id}, v;
      int rc = mdb_get(t, dbi, &k, &v);
      found[i] = rc == 0 && v.mv_size == kRec;
      if (found[i]) memcpy(out + i * kRec, v.mv_data, kRec);
    }
  }
  void get_batch(const uint64_t* ids, size_t n, uint8_t* out, uint8_t* found) override {
    MDB_txn* t; chk(mdb_txn_begin(env, nullptr, MDB_RDONLY, &t), "txn");
    get_in(t, ids, n, out, found);
    mdb_txn_abort(t);
  }
  void churn_batch(const uint64_t* pro, size_t np, uint8_t* out, uint8_t* found,
                   const uint64_t* dem, size_t nd, uint32_t ver) override {
    MDB_txn* t; chk(mdb_txn_begin(env, nullptr, 0, &t), "txn");
    get_in(t, pro, np, out, found);
    for (size_t i = 0; i < np; i++) { uint64_t id = pro[i]; MDB_val k{8, &id}; mdb_del(t, dbi, &k, nullptr); }
    for (size_t i = 0; i < nd; i++) put_in(t, dem[i], ver);
    chk(mdb_txn_commit(t), "commit");
  }
  void settle() override { chk(mdb_env_sync(env, 1), "sync"); }
  void reopen_cold() override { close(); if (!drop_caches()) printf("note: drop_caches failed\n"); open(); }
  void report_mem(uint64_t n) override {
    MDB_stat st; MDB_envinfo ei; mdb_env_stat(env, &st); mdb_env_info(env, &ei);
    printf("MEM lmdb depth=%u branch_pages=%zu leaf_pages=%zu overflow=%zu last_pgno=%zu psize=%u\n", st.ms_depth,
           st.ms_branch_pages, st.ms_leaf_pages, st.ms_overflow_pages, ei.me_last_pgno, st.ms_psize);
    printf("MEMROW lmdb_branch_pages %.2f\n", double(st.ms_branch_pages) * st.ms_psize / n);
  }
};

// --- pagehash: fixed-size pages, two-choice placement, RAM fingerprints.
struct PageHashEngine : Engine {
  std::string path; int fd = -1;
  uint32_t slot_bytes = 8 + kRec, page_bytes, slots, npages;
  std::vector<uint16_t> fp;     // npages*slots, 0 = empty
  std::vector<uint8_t> cnt;     // live slots per page (<= 255)
  uint64_t overflow = 0;
  PageHashEngine(const std::string& d, uint64_t n) : path(d + "/pages.dat") {
    page_bytes = std::max<uint32_t>(4096, (32 * slot_bytes + 4095) / 4096 * 4096);
    slots = page_bytes / slot_bytes;
    npages = uint32_t((n + uint64_t(slots * 0.75) - 1) / uint64_t(slots * 0.75));
    if (npages < 2) npages = 2;
    fp.assign(size_t(npages) * slots, 0); cnt.assign(npages, 0);
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) die("open", path.c_str());
    if (ftruncate(fd, off_t(npages) * page_bytes)) die("ftruncate");
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    printf("pagehash: page=%u B, slots/page=%u, pages=%u, file=%.1f MiB, target fill 75%%\n", page_bytes, slots, npages,
           double(npages) * page_bytes / (1 << 20));
  }
  ~PageHashEngine() { if (fd >= 0) ::close(fd); }
  struct Loc { uint32_t p[2]; uint16_t f; };
  Loc loc(uint64_t id) const {
    uint64_t h = mix64(id ^ 0x5bd1e9955bd1e995ULL), g = mix64(h);
    Loc l;
    l.p[0] = uint32_t((uint64_t(uint32_t(h)) * npages) >> 32);
    l.p[1] = uint32_t((uint64_t(uint32_t(h >> 32)) * npages) >> 32);
    if (l.p[1] == l.p[0]) l.p[1] = (l.p[0] + 1) % npages;
    l.f = uint16_t(g % 65535 + 1);  // never 0
    return l;
  }
  off_t off(size_t slot) const { return off_t(slot / slots) * page_bytes + off_t(slot % slots) * slot_bytes; }
  // Returns global slot index or -1; copies record to rec if given.
  int64_t find(uint64_t id, const Loc& l, uint8_t* rec) {
    uint8_t buf[8 + kRec];
    for (int c = 0; c < 2; c++) {
      size_t base = size_t(l.p[c]) * slots; const uint16_t* f = &fp[base];
      for (uint32_t s = 0; s < slots; s++) {
        if (f[s] != l.f) continue;
        if (pread(fd, buf, slot_bytes, off(base + s)) != ssize_t(slot_bytes)) die("pread");
        uint64_t k; memcpy(&k, buf, 8);
        if (k == id) { if (rec) memcpy(rec, buf + 8, kRec); return int64_t(base + s); }
      }
    }
    return -1;
  }
  void put(uint64_t id, uint32_t ver) {
    Loc l = loc(id); uint8_t buf[8 + kRec];
    memcpy(buf, &id, 8); make_record(id, ver, buf + 8);
    int64_t slot = find(id, l, nullptr);  // upsert; preads only on a fingerprint hit
    if (slot < 0) {
      uint32_t p = cnt[l.p[0]] <= cnt[l.p[1]] ? l.p[0] : l.p[1];
      if (cnt[p] >= slots) { overflow++; return; }
      size_t base = size_t(p) * slots; uint32_t s = 0;
      while (fp[base + s]) s++;
      slot = int64_t(base + s); fp[slot] = l.f; cnt[p]++;
    }
    if (pwrite(fd, buf, slot_bytes, off(slot)) != ssize_t(slot_bytes)) die("pwrite");
  }
  void put_batch(const uint64_t* ids, size_t n, uint32_t ver) override { for (size_t i = 0; i < n; i++) put(ids[i], ver); }
  void get_batch(const uint64_t* ids, size_t n, uint8_t* out, uint8_t* found) override {
    for (size_t i = 0; i < n; i++) found[i] = find(ids[i], loc(ids[i]), out + i * kRec) >= 0;
  }
  void churn_batch(const uint64_t* pro, size_t np, uint8_t* out, uint8_t* found,
                   const uint64_t* dem, size_t nd, uint32_t ver) override {
    for (size_t i = 0; i < np; i++) {
      int64_t s = find(pro[i], loc(pro[i]), out + i * kRec);
      found[i] = s >= 0;
      if (s >= 0) { fp[s] = 0; cnt[s / slots]--; }  // delete = RAM only
    }
    for (size_t i = 0; i < nd; i++) put(dem[i], ver);
  }
  void settle() override { fdatasync(fd); }
  void reopen_cold() override {
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    if (!drop_caches()) printf("note: drop_caches failed (fadvise DONTNEED only)\n");
    fd = ::open(path.c_str(), O_RDWR);
    if (fd < 0) die("reopen");
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  }
  void report_mem(uint64_t n) override {
    double b = double(fp.size()) * 2 + cnt.size();
    printf("MEM pagehash fingerprints=%zu B counts=%zu B -> %.2f B/row; overflow(rejected inserts)=%lu\n", fp.size() * 2,
           cnt.size(), b / n, (unsigned long)overflow);
    size_t maxc = 0; for (auto c : cnt) maxc = std::max<size_t>(maxc, c);
    printf("pagehash max page fill %zu/%u\n", maxc, slots);
    printf("MEMROW pagehash_struct %.2f\n", b / n);
  }
};

// ---------------------------------------------------------------- driver
struct Phase { double t0, c0; };
static Phase begin() { return {now_s(), cpu_s()}; }
static void end(const char* eng, const char* name, const Phase& p, uint64_t ops, uint64_t bad) {
  double dt = now_s() - p.t0, dc = cpu_s() - p.c0;
  printf("RESULT engine=%s phase=%s ops=%lu sec=%.3f rows_per_s=%.0f cpu_s=%.2f errors=%lu rss_mb=%.1f\n", eng, name,
         (unsigned long)ops, dt, ops / dt, dc, (unsigned long)bad, status_kb("VmRSS") / 1024.0);
  fflush(stdout);
}

int main(int argc, char** argv) {
  std::string engine, dir; uint64_t N = 10000000, reads = 2000000, cold_reads = 200000, churn = 1000000, misses = 1000000;
  bool cold = true;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i]; auto v = [&](const char* p) { return a.rfind(p, 0) == 0 ? a.substr(strlen(p)) : std::string(); };
    if (!v("--engine=").empty()) engine = v("--engine=");
    else if (!v("--dir=").empty()) dir = v("--dir=");
    else if (!v("--n=").empty()) N = std::stoull(v("--n="));
    else if (!v("--reads=").empty()) reads = std::stoull(v("--reads="));
    else if (!v("--cold_reads=").empty()) cold_reads = std::stoull(v("--cold_reads="));
    else if (!v("--churn=").empty()) churn = std::stoull(v("--churn="));
    else if (!v("--misses=").empty()) misses = std::stoull(v("--misses="));
    else if (a == "--no_cold") cold = false;
    else die("unknown flag", a.c_str());
  }
  if (engine.empty() || dir.empty()) die("usage: probe --engine=rocksdb|lmdb|lmdb_nordahead|pagehash --dir=DIR [--n=10000000] [--reads=] [--cold_reads=] [--churn=] [--misses=] [--no_cold]");
  mkdir(dir.c_str(), 0755);
  const size_t kLoadB = 65536, kB = 4096;

  // Workload state allocated (and touched) before the engine, so RSS growth is the engine's.
  std::vector<uint32_t> perm(N), live(N);
  for (uint64_t i = 0; i < N; i++) perm[i] = live[i] = uint32_t(i);
  { Rng r(7); for (uint64_t i = N - 1; i > 0; i--) std::swap(perm[i], perm[r.below(i + 1)]); }
  uint64_t nlive = N;
  std::vector<uint64_t> ids(kLoadB), dem; std::vector<uint8_t> out(kLoadB * kRec), found(kLoadB);
  dem.reserve(kB);
  Zipf zipf(N, 1.05);
  long rss0 = status_kb("VmRSS"), anon0 = status_kb("RssAnon"), file0 = status_kb("RssFile");
  printf("engine=%s N=%lu dir=%s baseline VmRSS=%ld kB\n", engine.c_str(), (unsigned long)N, dir.c_str(), rss0);

  std::unique_ptr<Engine> e;
  if (engine == "rocksdb") e.reset(new RocksEngine(dir));
  else if (engine == "lmdb") e.reset(new LmdbEngine(dir, 0));
  else if (engine == "lmdb_nordahead") e.reset(new LmdbEngine(dir, MDB_NORDAHEAD));
  else if (engine == "pagehash") e.reset(new PageHashEngine(dir, N));
  else die("unknown engine", engine.c_str());
  const char* en = engine.c_str();

  // load (ids are random int64; row order 0..N-1 is random in id space)
  Phase p = begin();
  for (uint64_t i = 0; i < N; i += kLoadB) {
    size_t n = std::min<uint64_t>(kLoadB, N - i);
    for (size_t j = 0; j < n; j++) ids[j] = id_of(i + j);
    e->put_batch(ids.data(), n, 1);
  }
  end(en, "load", p, N, 0);
  Phase ps = begin(); e->settle(); end(en, "settle(flush/compact/sync)", ps, N, 0);
  end(en, "load+settle", p, N, 0);

  auto read_phase = [&](const char* name, uint64_t nops, bool zipfian, uint64_t seed) {
    Rng r(seed); uint64_t bad = 0; Phase q = begin();
    for (uint64_t i = 0; i < nops; i += kB) {
      size_t n = std::min<uint64_t>(kB, nops - i);
      for (size_t j = 0; j < n; j++) {
        uint64_t idx = zipfian ? perm[zipf.sample(r) - 1] : live[r.below(nlive)];
        ids[j] = id_of(idx);
      }
      e->get_batch(ids.data(), n, out.data(), found.data());
      for (size_t j = 0; j < n; j++) bad += !found[j] || !check_record(ids[j], &out[j * kRec]);
    }
    end(en, name, q, nops, bad);
  };
  read_phase("read_uniform", reads, false, 11);
  read_phase("read_zipf", reads, true, 12);
  long rss1 = status_kb("VmRSS"), anon1 = status_kb("RssAnon"), file1 = status_kb("RssFile");
  printf("RSSGROWTH after load+warm reads: VmRSS +%ld kB (anon +%ld kB, file +%ld kB) -> %.2f B/row (anon %.2f, file %.2f)\n",
         rss1 - rss0, anon1 - anon0, file1 - file0, (rss1 - rss0) * 1024.0 / N, (anon1 - anon0) * 1024.0 / N,
         (file1 - file0) * 1024.0 / N);
  printf("MEMROW rss_growth %.2f\nMEMROW anon_growth %.2f\n", (rss1 - rss0) * 1024.0 / N, (anon1 - anon0) * 1024.0 / N);
  e->report_mem(N);

  // churn: per batch, promote kB random live rows (read + delete), then demote the kB rows
  // promoted in the previous batch (pool seeded untimed).
  {
    Rng r(13); std::vector<uint64_t> pro(kB);
    auto take = [&]() { uint64_t j = r.below(nlive); uint32_t idx = live[j]; live[j] = live[--nlive]; return idx; };
    dem.clear();
    for (size_t j = 0; j < kB; j++) dem.push_back(take());
    { std::vector<uint64_t> did(kB); for (size_t j = 0; j < kB; j++) did[j] = id_of(dem[j]);
      e->churn_batch(did.data(), kB, out.data(), found.data(), nullptr, 0, 2); }
    uint64_t bad = 0; Phase q = begin();
    std::vector<uint64_t> proidx(kB), demid(kB);
    for (uint64_t i = 0; i < churn; i += kB) {
      size_t n = std::min<uint64_t>(kB, churn - i);
      for (size_t j = 0; j < n; j++) { proidx[j] = take(); pro[j] = id_of(proidx[j]); }
      for (size_t j = 0; j < n; j++) demid[j] = id_of(dem[j]);
      e->churn_batch(pro.data(), n, out.data(), found.data(), demid.data(), n, 2);
      for (size_t j = 0; j < n; j++) { bad += !found[j] || !check_record(pro[j], &out[j * kRec]); live[nlive++] = uint32_t(dem[j]); }
      // leftover (if n < size of pool) stays in pool
      std::vector<uint64_t> rest(dem.begin() + n, dem.end());
      dem.assign(rest.begin(), rest.end());
      dem.insert(dem.end(), proidx.begin(), proidx.begin() + n);
    }
    end(en, "churn(promote+demote)", q, churn, bad);
    std::vector<uint64_t> did(dem.size()); for (size_t j = 0; j < dem.size(); j++) { did[j] = id_of(dem[j]); live[nlive++] = uint32_t(dem[j]); }
    e->churn_batch(nullptr, 0, out.data(), found.data(), did.data(), did.size(), 2);  // untimed: restore all N
  }
  // miss: ids of indexes >= N are absent
  {
    Rng r(14); uint64_t bad = 0; Phase q = begin();
    for (uint64_t i = 0; i < misses; i += kB) {
      size_t n = std::min<uint64_t>(kB, misses - i);
      for (size_t j = 0; j < n; j++) ids[j] = id_of(N + 1 + r.below(uint64_t(1) << 40));
      e->get_batch(ids.data(), n, out.data(), found.data());
      for (size_t j = 0; j < n; j++) bad += found[j];
    }
    end(en, "miss", q, misses, bad);
  }
  if (cold) {
    e->settle(); e->reopen_cold(); read_phase("read_uniform_cold", cold_reads, false, 21);
    e->reopen_cold(); read_phase("read_zipf_cold", cold_reads, true, 22);
  }
  uint64_t ap, al; dir_bytes(dir, &ap, &al);
  printf("DISK apparent=%lu allocated=%lu -> %.1f B/row (apparent), %.1f B/row (allocated)\n", (unsigned long)ap,
         (unsigned long)al, double(ap) / N, double(al) / N);
  printf("MEMROW disk_apparent %.1f\nMEMROW disk_alloc %.1f\n", double(ap) / N, double(al) / N);
  printf("PEAK VmHWM=%ld kB VmRSS_end=%ld kB\n", status_kb("VmHWM"), status_kb("VmRSS"));
  e.reset();
  return 0;
}
