// The data path without TensorFlow (bench/bench_wire.py builds and runs it):
// S shard processes with T worker threads each and C client processes
// pulling and pushing through the native client, beside two baselines
// measured in the same run: a local gather of the same rows (the rows copied
// out of an in-memory array by id, as a trainer holding the table would; for
// pushes a local scatter-add of the gradients into it) and one loopback TCP
// stream carrying the same bytes. Wall time and each
// process's CPU time per call are reported (CPU is robust on a shared
// machine; wall time shows what cores to spare give).
//
//   wire_bench shard INDEX SHARDS THREADS DIM ROWS [none|sync|async [N]]
//       serves one shard of a table "t" (Adagrad, ROWS rows of ids
//       0..ROWS-1 made up front), prints "port N", serves until stdin closes;
//       with sync or async, N standbys (default 1) in its process.
//   wire_bench client ADDRS(comma) DIM IDS CALLS pull|push ROWS SEED [THREADS]
//       CALLS calls of IDS random ids in [0, ROWS); prints one JSON line.
//       THREADS: the client's exchange threads (0, the default: automatic).
//   wire_bench gather DIM IDS CALLS ROWS      the local gather baseline (pulls)
//   wire_bench scatter DIM IDS CALLS ROWS     the local scatter-add baseline (pushes)
//   wire_bench stream BYTES CALLS             the one-TCP-stream baseline
//
// Needs only a C++17 compiler: no TensorFlow, no Python (a static binary
// runs on any x86-64 Linux machine).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "native/core/shard.h"
#include "native/core/table.h"
#include "native/net/client.h"
#include "native/net/data_server.h"
#include "native/net/replica_group.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// CPU seconds (user + system) of this process so far.
double ProcessCpu() {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// CPU seconds of the calling thread so far.
double ThreadCpu() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Rows for a call's output, aligned as TensorFlow aligns its tensors (64
// bytes), so the client places them as it does for a lookup op.
struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
std::unique_ptr<float[], AlignedFree> AlignedRows(size_t floats, float fill) {
  const size_t bytes = (sizeof(float) * floats + 63) / 64 * 64;
  std::unique_ptr<float[], AlignedFree> rows(static_cast<float*>(std::aligned_alloc(64, bytes)));
  std::fill(rows.get(), rows.get() + floats, fill);
  return rows;
}

std::vector<int64_t> RandomIds(size_t n, uint64_t rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(n);
  for (auto& id : ids) id = static_cast<int64_t>(rng() % rows);
  return ids;
}

void Emit(const char* what, size_t ids, uint32_t dim, int calls, double wall, double cpu) {
  std::printf(
      "{\"case\": \"%s\", \"ids\": %zu, \"dim\": %u, \"calls\": %d, \"wall_ms_per_call\": %.4f, "
      "\"cpu_ms_per_call\": %.4f}\n",
      what, ids, dim, calls, wall * 1e3 / calls, cpu * 1e3 / calls);
  std::fflush(stdout);
}

int Shard(int argc, char** argv) {
  if (argc < 7) return 2;
  const auto index = static_cast<uint32_t>(std::atoi(argv[2]));
  const auto shards = static_cast<uint32_t>(std::atoi(argv[3]));
  const int threads = std::atoi(argv[4]);
  const auto dim = static_cast<uint32_t>(std::atoi(argv[5]));
  const uint64_t rows = std::strtoull(argv[6], nullptr, 10);
  auto shard = std::make_shared<dlt::Shard>(index, shards);
  dlt::TableConfig config;
  config.name = "t";
  config.dim = dim;
  config.optimizer.kind = dlt::OptimizerKind::kAdagrad;
  bool created = false;
  dlt::Status s = shard->CreateTable(config, &created);
  std::shared_ptr<dlt::Table> table;
  if (s.ok()) s = shard->GetTable("t", &table);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    return 1;
  }
  // This shard's rows of ids [0, rows), made up front.
  std::vector<int64_t> mine;
  for (uint64_t id = 0; id < rows; ++id) {
    if (dlt::ShardOf(static_cast<int64_t>(id), shards) == index) {
      mine.push_back(static_cast<int64_t>(id));
    }
  }
  std::vector<float> out(mine.size() * dim);
  s = table->Pull(mine.data(), mine.size(), dlt::PullMode::kInsert, out.data());
  if (!s.ok()) return 1;
  dlt::DataServerOptions options;
  options.worker_threads = threads;
  dlt::DataServer server(shard, options);
  s = server.Start();
  // With "sync" or "async": `count` standby shards (argv[8], default 1) in
  // this process, kept equal by the ReplicaGroup a serving primary keeps its
  // standbys with (docs/replication.md), each holding every row before
  // clients start. The primary's Hello names the group's standbys, so
  // clients give their pushes ids, as trainers of a shard with a standby do.
  const std::string standby_mode = argc > 7 ? argv[7] : "none";
  const size_t count = standby_mode == "none" ? 0
                       : argc > 8             ? std::strtoul(argv[8], nullptr, 10)
                                              : 1;
  if (count > dlt::ReplicaGroup::kMaxStandbys) {
    std::fprintf(stderr, "at most %zu standbys\n", dlt::ReplicaGroup::kMaxStandbys);
    return 2;
  }
  std::vector<std::unique_ptr<dlt::DataServer>> standbys;
  std::shared_ptr<dlt::ReplicaGroup> group;
  if (s.ok() && count > 0) {
    dlt::ReplicatorOptions r;
    r.sync = standby_mode == "sync";
    group = std::make_shared<dlt::ReplicaGroup>(shard, r);
    server.set_write_listener(group);
  }
  for (size_t k = 0; s.ok() && k < count; ++k) {
    standbys.push_back(
        std::make_unique<dlt::DataServer>(std::make_shared<dlt::Shard>(index, shards), options));
    standbys.back()->set_standby(true);
    s = standbys.back()->Start();
    if (s.ok()) s = group->Attach("127.0.0.1:" + std::to_string(standbys.back()->port()));
  }
  for (int i = 0; s.ok() && count > 0; ++i) {
    // Every standby caught up, and in the in-sync set sync pushes wait for.
    size_t ready = 0;
    for (const dlt::ReplicationStatus& status : group->statuses()) ready += status.caught_up;
    const std::string members = group->view().members;
    const size_t in_sync =
        members.empty() ? 0 : 1 + std::count(members.begin(), members.end(), '|');
    if (ready == count && in_sync == count) break;
    if (i == 6000) s = dlt::Unavailable("the standbys did not join the in-sync set in 60 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    return 1;
  }
  std::printf("port %d\n", server.port());
  std::fflush(stdout);
  char c;
  while (read(0, &c, 1) > 0) {
  }
  server.set_write_listener(nullptr);
  if (group) group->Stop();
  server.Stop();
  for (auto& standby : standbys) standby->Stop();
  return 0;
}

int Client(int argc, char** argv) {
  if (argc < 9) return 2;
  std::vector<std::string> addresses;
  for (const char *p = argv[2], *q; *p; p = *q ? q + 1 : q) {
    q = std::strchr(p, ',');
    if (q == nullptr) q = p + std::strlen(p);
    addresses.emplace_back(p, q);
  }
  const auto dim = static_cast<uint32_t>(std::atoi(argv[3]));
  const size_t n = std::strtoull(argv[4], nullptr, 10);
  const int calls = std::atoi(argv[5]);
  const bool pull = std::string(argv[6]) == "pull";
  const uint64_t rows = std::strtoull(argv[7], nullptr, 10);
  const uint64_t seed = std::strtoull(argv[8], nullptr, 10);
  dlt::ClientOptions options;
  if (argc > 9) options.exchange_threads = std::atoi(argv[9]);
  dlt::Client client(addresses, options);
  std::vector<std::vector<int64_t>> batches;
  for (int k = 0; k < 8; ++k) batches.push_back(RandomIds(n, rows, seed * 100 + k));
  const auto out = AlignedRows(n * dim, 0.0f), grads = AlignedRows(n * dim, 1e-3f);
  auto call = [&](int k) {
    const auto& ids = batches[k % batches.size()];
    return pull ? client.Pull("t", dim, ids.data(), n, dlt::PullMode::kInsert, out.get(), true)
                : client.Push("t", dim, ids.data(), grads.get(), n, 0.01f);
  };
  for (int k = 0; k < 3; ++k) {  // connect and warm up
    const dlt::Status s = call(k);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.message().c_str());
      return 1;
    }
  }
  const double cpu = ProcessCpu();
  const auto start = Clock::now();
  for (int k = 0; k < calls; ++k) {
    if (!call(k).ok()) return 1;
  }
  Emit(pull ? "pull" : "push", n, dim, calls, Seconds(start), ProcessCpu() - cpu);
  return 0;
}

// The local baselines: a gather of the rows of random ids out of an array
// (pulls), or a scatter-add of gradients into it (pushes).
int Local(int argc, char** argv, bool scatter) {
  if (argc < 6) return 2;
  const auto dim = static_cast<uint32_t>(std::atoi(argv[2]));
  const size_t n = std::strtoull(argv[3], nullptr, 10);
  const int calls = std::atoi(argv[4]);
  const uint64_t rows = std::strtoull(argv[5], nullptr, 10);
  std::vector<float> table(rows * dim, 0.5f);
  const auto rows_of_call = AlignedRows(n * dim, 1e-3f);
  std::vector<std::vector<int64_t>> batches;
  for (int k = 0; k < 8; ++k) batches.push_back(RandomIds(n, rows, 7 + k));
  const double cpu = ProcessCpu();
  const auto start = Clock::now();
  for (int k = 0; k < calls; ++k) {
    const auto& ids = batches[k % batches.size()];
    for (size_t i = 0; i < n; ++i) {
      float* row = &table[static_cast<size_t>(ids[i]) * dim];
      float* mine = &rows_of_call[i * dim];
      if (scatter) {
        for (uint32_t j = 0; j < dim; ++j) row[j] -= 0.01f * mine[j];
      } else {
        std::memcpy(mine, row, sizeof(float) * dim);
      }
    }
  }
  Emit(scatter ? "local_scatter_add" : "local_gather", n, dim, calls, Seconds(start),
       ProcessCpu() - cpu);
  return rows_of_call[0] > 0 && table[0] < 1.0f ? 0 : 1;
}

int Stream(int argc, char** argv) {
  if (argc < 4) return 2;
  const size_t bytes = std::strtoull(argv[2], nullptr, 10);
  const int calls = std::atoi(argv[3]);
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return 1;
  }
  double send_cpu = 0;  // the sender's thread, over the measured calls
  std::thread sender([&] {
    const int fd = accept(listener, nullptr, nullptr);
    std::vector<char> data(bytes, 'x');
    char go;
    double measured_from = 0;
    for (int k = 0; k < calls + 1; ++k) {  // a request byte, then the reply's bytes
      if (read(fd, &go, 1) != 1) break;
      if (k == 1) measured_from = ThreadCpu();
      for (size_t sent = 0; sent < bytes;) {
        const ssize_t w = write(fd, data.data() + sent, bytes - sent);
        if (w <= 0) return;
        sent += static_cast<size_t>(w);
      }
    }
    send_cpu = ThreadCpu() - measured_from;
    close(fd);
  });
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 1;
  std::vector<char> in(bytes);
  auto exchange = [&] {
    const char go = 'g';
    if (write(fd, &go, 1) != 1) return false;
    for (size_t got = 0; got < bytes;) {
      const ssize_t r = read(fd, in.data() + got, bytes - got);
      if (r <= 0) return false;
      got += static_cast<size_t>(r);
    }
    return true;
  };
  if (!exchange()) return 1;  // warm up
  const double cpu = ProcessCpu(), receive_cpu = ThreadCpu();
  const auto start = Clock::now();
  for (int k = 0; k < calls; ++k) {
    if (!exchange()) return 1;
  }
  const double wall = Seconds(start), total = ProcessCpu() - cpu;
  const double received = ThreadCpu() - receive_cpu;
  close(fd);
  sender.join();
  close(listener);
  // Both ends' CPU (they run in this process), and each end's: what any
  // server must spend to send (a pull's reply) or receive (a push's
  // gradients) these bytes over TCP, beside the local baseline.
  std::printf(
      "{\"case\": \"tcp_stream\", \"bytes\": %zu, \"calls\": %d, \"wall_ms_per_call\": %.4f, "
      "\"cpu_ms_per_call\": %.4f, \"send_cpu_ms_per_call\": %.4f, "
      "\"receive_cpu_ms_per_call\": %.4f}\n",
      bytes, calls, wall * 1e3 / calls, total * 1e3 / calls, send_cpu * 1e3 / calls,
      received * 1e3 / calls);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int rc = 2;
  if (mode == "shard") rc = Shard(argc, argv);
  if (mode == "client") rc = Client(argc, argv);
  if (mode == "gather" || mode == "scatter") rc = Local(argc, argv, mode == "scatter");
  if (mode == "stream") rc = Stream(argc, argv);
  if (rc == 2) {
    std::fprintf(
        stderr,
        "usage: wire_bench shard INDEX SHARDS THREADS DIM ROWS [none|sync|async [N]] | client "
        "ADDRS DIM IDS "
        "CALLS pull|push ROWS SEED [THREADS] | gather|scatter DIM IDS CALLS ROWS | stream BYTES "
        "CALLS\n");
  }
  return rc;
}
