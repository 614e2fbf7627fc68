// A data-plane shard with no Python: the fuzz tests run it built with
// AddressSanitizer and UndefinedBehaviorSanitizer (tests/native_build.py).
//   fuzz_shard [max_frame_bytes=N] [hello_timeout_ms=N] [io_timeout_ms=N]
//              [max_unauthenticated=N] [max_buffered_bytes=N]
// Holds table "fuzz" (dim 4, rows 0..99 present), prints its port on one
// line, serves until SIGTERM, then stops and exits 0.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "native/core/shard.h"
#include "native/net/data_server.h"

int main(int argc, char** argv) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // before any thread starts

  dlt::DataServerOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq);
    const long long value = std::atoll(arg.substr(eq + 1).c_str());
    if (key == "max_frame_bytes") options.max_frame_bytes = static_cast<uint32_t>(value);
    if (key == "hello_timeout_ms") options.hello_timeout_ms = static_cast<int>(value);
    if (key == "io_timeout_ms") options.io_timeout_ms = static_cast<int>(value);
    if (key == "max_unauthenticated") options.max_unauthenticated = static_cast<int>(value);
    if (key == "max_buffered_bytes") options.max_buffered_bytes = static_cast<uint64_t>(value);
  }
  auto shard = std::make_shared<dlt::Shard>(0, 1);
  dlt::TableConfig config;
  config.name = "fuzz";
  config.dim = 4;
  bool created;
  dlt::Status s = shard->CreateTable(config, &created);
  std::shared_ptr<dlt::Table> table;
  if (s.ok()) s = shard->GetTable("fuzz", &table);
  std::vector<int64_t> ids(100);
  for (int64_t i = 0; i < 100; ++i) ids[i] = i;
  std::vector<float> rows(400);
  if (!table->Pull(ids.data(), ids.size(), dlt::PullMode::kInsert, rows.data()).ok()) return 1;
  dlt::DataServer server(shard, options);
  if (s.ok()) s = server.Start();
  if (!s.ok()) {
    std::fprintf(stderr, "cannot start: %s\n", s.ToString().c_str());
    return 2;
  }
  std::printf("%d\n", server.port());
  std::fflush(stdout);
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  server.Stop();
  const dlt::ServerCounters& c = server.counters();
  std::fprintf(stderr, "stopped: %llu connections accepted, %llu evicted, %llu timed out\n",
               static_cast<unsigned long long>(c.connections_accepted.load()),
               static_cast<unsigned long long>(c.connections_evicted.load()),
               static_cast<unsigned long long>(c.hello_timeouts.load() + c.io_timeouts.load() +
                                               c.idle_timeouts.load()));
  return 0;
}
