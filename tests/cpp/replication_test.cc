// The row stream (docs/replication.md): a table's change log, and a primary
// shard keeping a standby shard equal to it over real sockets on loopback,
// while trainers push from several threads.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "native/core/push_ledger.h"
#include "native/core/shard.h"
#include "native/core/table.h"
#include "native/core/table_config.h"
#include "native/core/table_stripe.h"
#include "native/net/client.h"
#include "native/net/data_server.h"
#include "native/net/frame_call.h"
#include "native/net/replica_group.h"
#include "native/net/replicator.h"
#include "native/net/socket.h"
#include "native/net/wire.h"
#include "tests/cpp/harness.h"

namespace dlt {
namespace {

using Clock = std::chrono::steady_clock;

TableConfig AdagradConfig(const std::string& name, uint32_t dim) {
  TableConfig c;
  c.name = name;
  c.dim = dim;
  c.seed = 7;
  c.initializer.kind = InitializerKind::kUniform;
  c.optimizer.kind = OptimizerKind::kAdagrad;
  return c;
}

std::string Address(const DataServer& server) {
  return "127.0.0.1:" + std::to_string(server.port());
}

// Every row of a table (both tiers), sorted by id, as bytes: values,
// slots, step and stamp.
struct Rows {
  std::vector<int64_t> ids;
  std::vector<float> values, slots;
  std::vector<uint32_t> steps, touched;
};

Rows AllRows(Table* table) {
  Rows all;
  const size_t dim = table->dim(), slot_floats = table->slot_floats();
  constexpr size_t kBatch = 4096;
  std::vector<int64_t> ids(kBatch);
  std::vector<float> values(kBatch * dim), slots(kBatch * slot_floats + 1);
  std::vector<uint32_t> steps(kBatch), touched(kBatch), buckets(kBatch);
  RowBuffers out{ids.data(),   values.data(),  slots.data(),
                 steps.data(), buckets.data(), touched.data()};
  Table::Exporter exporter(table);
  for (;;) {
    const size_t n = exporter.Next(kBatch, out);
    if (n == 0) break;
    all.ids.insert(all.ids.end(), ids.begin(), ids.begin() + n);
    all.values.insert(all.values.end(), values.begin(), values.begin() + n * dim);
    all.slots.insert(all.slots.end(), slots.begin(), slots.begin() + n * slot_floats);
    all.steps.insert(all.steps.end(), steps.begin(), steps.begin() + n);
    all.touched.insert(all.touched.end(), touched.begin(), touched.begin() + n);
  }
  EXPECT_OK(exporter.error());
  return all;
}

bool SameRows(Table* a, Table* b) {
  const Rows x = AllRows(a), y = AllRows(b);
  return x.ids == y.ids && x.steps == y.steps && x.touched == y.touched &&
         x.values.size() == y.values.size() && x.slots.size() == y.slots.size() &&
         std::memcmp(x.values.data(), y.values.data(), x.values.size() * sizeof(float)) == 0 &&
         std::memcmp(x.slots.data(), y.slots.data(), x.slots.size() * sizeof(float)) == 0;
}

std::shared_ptr<Table> TableOf(const Shard& shard, const std::string& name) {
  std::shared_ptr<Table> table;
  return shard.GetTable(name, &table).ok() ? table : nullptr;
}

// Polls `done` every few milliseconds for at most 20 s.
template <typename Fn>
bool Eventually(Fn done) {
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(20);
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

DLT_TEST(TestChangeLogNamesEveryRowWrittenOrRemoved) {
  TableConfig config = AdagradConfig("emb", 4);
  Table table(config);
  const std::vector<float> grads(4 * 4, 0.5f);
  const int64_t before[] = {100};
  EXPECT_OK(table.Push(before, grads.data(), 1, 0.1f));  // not logged: no log yet
  std::vector<int64_t> ids;
  EXPECT_OK(table.TakeChanges(&ids));
  EXPECT(ids.empty());

  table.StartChangeLog();
  const int64_t pushed[] = {3, 1, 3, 2};
  EXPECT_OK(table.Push(pushed, grads.data(), 4, 0.1f));
  const int64_t assigned[] = {4};
  EXPECT_OK(table.Assign(assigned, grads.data(), 1));
  const int64_t imported[] = {5};
  EXPECT_OK(table.Import(imported, grads.data(), nullptr, nullptr, 1));
  std::vector<float> out(4);
  const int64_t pulled[] = {6, 100};  // 6 is made (admitted on sight); 100 only read
  out.resize(8);
  EXPECT_OK(table.Pull(pulled, 2, PullMode::kInsert, out.data()));
  const int64_t erased[] = {2, 77};
  EXPECT(table.Erase(erased, 2) == 1);
  EXPECT_OK(table.TakeChanges(&ids));
  std::sort(ids.begin(), ids.end());  // each once, stripe after stripe
  EXPECT((ids == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 77}));
  EXPECT_OK(table.TakeChanges(&ids));
  EXPECT(ids.empty());

  // Rows as they are now: present ones copied, absent ones named.
  const int64_t wanted[] = {3, 2, 100, 9};
  std::vector<int64_t> row_ids(4);
  std::vector<float> values(16), slots(16);
  std::vector<uint32_t> steps(4), touched(4);
  RowBuffers rows{row_ids.data(), values.data(), slots.data(),
                  steps.data(),   nullptr,       touched.data()};
  size_t n = 0;
  std::vector<int64_t> absent;
  EXPECT_OK(table.ReadRows(wanted, 4, rows, &n, &absent));
  EXPECT(n == 2);
  std::sort(absent.begin(), absent.end());
  EXPECT((absent == std::vector<int64_t>{2, 9}));
  for (size_t i = 0; i < n; ++i) {
    std::vector<float> expected(4);
    EXPECT_OK(table.Pull(&row_ids[i], 1, PullMode::kZerosNoInsert, expected.data()));
    EXPECT(std::memcmp(expected.data(), &values[i * 4], 16) == 0);
    EXPECT(steps[i] == 1u);  // one push each (3's repeats summed in it)
  }

  // More changes than the log holds: the consumer is told to copy whole.
  const int64_t one[] = {1};
  for (int i = 0; i < 70000; ++i) EXPECT_OK(table.Push(one, grads.data(), 1, 0.0f));
  const Status overflowed = table.TakeChanges(&ids);
  EXPECT(overflowed.code() == Code::kFailedPrecondition);
  EXPECT(ids.empty());
  EXPECT_OK(table.Push(one, grads.data(), 1, 0.0f));  // the log runs on, emptied
  EXPECT_OK(table.TakeChanges(&ids));
  EXPECT((ids == std::vector<int64_t>{1}));
  table.StopChangeLog();
  EXPECT_OK(table.Push(one, grads.data(), 1, 0.0f));
  EXPECT_OK(table.TakeChanges(&ids));
  EXPECT(ids.empty());
}

// A primary and its standby, each a shard behind a data server on loopback.
struct Pair {
  std::shared_ptr<Shard> primary = std::make_shared<Shard>(0, 1);
  std::shared_ptr<Shard> standby = std::make_shared<Shard>(0, 1);
  std::unique_ptr<DataServer> primary_server, standby_server;
  std::shared_ptr<Replicator> replicator;

  explicit Pair(bool sync = true, uint64_t round_buffer_bytes = 0) {
    // As a standby's server does before it attaches: its copy's lineage is
    // the primary's, so clients take it when it takes over.
    standby->FollowEpoch(primary->epoch(), primary->lineage());
    DataServerOptions options;
    options.worker_threads = 4;
    primary_server = std::make_unique<DataServer>(primary, options);
    standby_server = std::make_unique<DataServer>(standby, options);
    standby_server->set_standby(true);
    EXPECT_OK(primary_server->Start());
    EXPECT_OK(standby_server->Start());
    ReplicatorOptions r;
    r.sync = sync;
    r.io_timeout_ms = 10000;
    r.frame_bytes = 64 << 10;  // several frames per round and per copy
    if (round_buffer_bytes) {  // frames of ~100 rows: a push's rows take several
      r.round_buffer_bytes = round_buffer_bytes;
      r.frame_bytes = 8 << 10;
    }
    replicator = std::make_shared<Replicator>(primary, Address(*standby_server), r);
  }
  // Starts replicating; writes wait for the standby from then on.
  void Replicate() {
    primary_server->set_write_listener(replicator);
    replicator->Start();
  }
  // Table "emb" (Adagrad, dim 4) on the primary, replicated and caught up.
  void ReplicateATable() {
    bool created;
    EXPECT_OK(primary->CreateTable(AdagradConfig("emb", 4), &created));
    Replicate();
    EXPECT(Eventually([&] { return replicator->status().caught_up; }));
  }
  ~Pair() {
    primary_server->set_write_listener(nullptr);
    replicator->Stop();
    primary_server->Stop();
    standby_server->Stop();
  }
};

// Pushes from one client to the shards at `addresses` until `stop`,
// counting the pushes acknowledged and the ones that failed.
void PushUntil(const std::vector<std::string>& addresses, const std::string& table, uint32_t dim,
               int thread_index, const std::atomic<bool>* stop, std::atomic<int>* acked,
               std::atomic<int>* failed) {
  Client client(addresses, ClientOptions{});
  std::mt19937_64 rng(thread_index);
  std::vector<int64_t> ids(256);
  std::vector<float> grads(ids.size() * dim);
  while (!stop->load()) {
    for (auto& id : ids) id = static_cast<int64_t>(rng() % 5000);  // repeats within and across
    for (auto& g : grads) g = static_cast<float>(static_cast<int>(rng() % 200) - 100) / 100.0f;
    if (client.Push(table, dim, ids.data(), grads.data(), ids.size(), 0.05f).ok()) {
      acked->fetch_add(1);
    } else {
      failed->fetch_add(1);
    }
  }
}

// `n` trainers (PushUntil, seeds first_seed...) pushing until Stop().
struct Trainers {
  std::atomic<bool> stop{false};
  std::atomic<int> acked{0}, failed{0};
  std::vector<std::thread> threads;

  Trainers(const std::vector<std::string>& addresses, const std::string& table, uint32_t dim, int n,
           int first_seed = 0) {
    for (int t = 0; t < n; ++t) {
      threads.emplace_back(PushUntil, addresses, table, dim, first_seed + t, &stop, &acked,
                           &failed);
    }
  }
  Trainers(const std::string& address, const std::string& table, uint32_t dim, int n,
           int first_seed = 0)
      : Trainers(std::vector<std::string>{address}, table, dim, n, first_seed) {}
  // Stops them and returns once all have; OK when no push failed.
  bool Stop() {
    stop = true;
    for (auto& t : threads) t.join();
    threads.clear();
    return failed.load() == 0;
  }
  ~Trainers() { Stop(); }
};

DLT_TEST(TestSyncStandbyHoldsEveryAcknowledgedPush) {
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 8), &created));
  // Rows from before the standby joined come with the whole copy.
  std::vector<int64_t> early(3000);
  for (size_t i = 0; i < early.size(); ++i) early[i] = static_cast<int64_t>(i) * 3;
  std::vector<float> early_grads(early.size() * 8, 0.25f);
  EXPECT_OK(
      TableOf(*pair.primary, "emb")->Push(early.data(), early_grads.data(), early.size(), 0.1f));
  // Training runs while the standby joins and catches up.
  Trainers trainers(Address(*pair.primary_server), "emb", 8, 3);
  std::atomic<int>& acked = trainers.acked;
  EXPECT(Eventually([&] { return acked.load() >= 20; }));
  EXPECT(!pair.standby_server->standby_caught_up());
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  EXPECT(pair.standby_server->standby_caught_up());  // told so on the stream
  const int at_catch_up = acked.load();
  EXPECT(Eventually([&] { return acked.load() >= at_catch_up + 100; }));
  EXPECT(trainers.Stop());
  // Every acknowledged push is on the standby already: no wait here.
  EXPECT(SameRows(TableOf(*pair.primary, "emb").get(), TableOf(*pair.standby, "emb").get()));
  EXPECT(TableOf(*pair.standby, "emb")->pushes() == TableOf(*pair.primary, "emb")->pushes());

  // A table made later, and one dropped, follow.
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("late", 4), &created));
  Client client({Address(*pair.primary_server)}, ClientOptions{});
  const int64_t ids[] = {1, 2, 3};
  const float grads[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_OK(client.Push("late", 4, ids, grads, 3, 0.1f));
  EXPECT(TableOf(*pair.standby, "late") != nullptr);
  EXPECT(SameRows(TableOf(*pair.primary, "late").get(), TableOf(*pair.standby, "late").get()));
  EXPECT_OK(pair.primary->DropTable("late"));
  EXPECT(Eventually([&] { return TableOf(*pair.standby, "late") == nullptr; }));

  // Removals reach the standby as removals.
  const int64_t gone[] = {0, 3, 6};
  EXPECT(TableOf(*pair.primary, "emb")->Erase(gone, 3) == 3);
  EXPECT(Eventually([&] {
    return SameRows(TableOf(*pair.primary, "emb").get(), TableOf(*pair.standby, "emb").get());
  }));

  // A table replaced on the primary (a load) is copied whole again.
  auto replaced = pair.primary->NewTable(AdagradConfig("emb", 8));
  EXPECT_OK(replaced->Push(ids, early_grads.data(), 3, 0.3f));
  pair.primary->InstallTables({replaced});
  EXPECT_OK(client.Push("emb", 8, ids, early_grads.data(), 3, 0.1f));
  EXPECT(TableOf(*pair.standby, "emb")->size() == 3);
  EXPECT(SameRows(TableOf(*pair.primary, "emb").get(), TableOf(*pair.standby, "emb").get()));

  // Trainers cannot use the standby; the primary takes no replication frames.
  Client at_standby({Address(*pair.standby_server)}, ClientOptions{});
  std::vector<float> out(3 * 8);
  const Status refused = at_standby.Pull("emb", 8, ids, 3, PullMode::kInsert, out.data());
  EXPECT(refused.code() == Code::kUnavailable);
  EXPECT(refused.message().find("standby") != std::string::npos);
}

DLT_TEST(TestRoundsLargerThanTheirBufferSendTheRestUnderTheGate) {
  // Rounds of many frames, each batch of one frame read and sent while the
  // push gate is held, the last sent after it: the standby still holds every
  // acknowledged push.
  Pair pair(/*sync=*/true, /*round_buffer_bytes=*/8 << 10);
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 8), &created));
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  Trainers trainers(Address(*pair.primary_server), "emb", 8, 3);
  EXPECT(Eventually([&] { return trainers.acked.load() >= 60; }));
  EXPECT(trainers.Stop());
  EXPECT(pair.replicator->status().rows_sent >= TableOf(*pair.primary, "emb")->size());
  EXPECT(SameRows(TableOf(*pair.primary, "emb").get(), TableOf(*pair.standby, "emb").get()));
  EXPECT(TableOf(*pair.standby, "emb")->pushes() == TableOf(*pair.primary, "emb")->pushes());
}

DLT_TEST(TestSyncPrimaryRefusesToAcknowledgeWithoutItsStandby) {
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created));
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  Client client({Address(*pair.primary_server)}, ClientOptions{});
  const int64_t ids[] = {1, 2};
  const float grads[8] = {1, 1, 1, 1, 2, 2, 2, 2};
  EXPECT_OK(client.Push("emb", 4, ids, grads, 2, 0.1f));
  pair.standby_server->Stop();  // the standby is gone
  EXPECT(Eventually([&] {
    const Status s = client.Push("emb", 4, ids, grads, 2, 0.1f);
    return s.code() == Code::kUnavailable && s.message().find("in doubt") != std::string::npos;
  }));
  EXPECT(!pair.replicator->status().connected);
  EXPECT(!pair.replicator->status().error.empty());
}

DLT_TEST(TestAsyncStandbyConvergesAndReportsItsLag) {
  Pair pair(/*sync=*/false);
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 8), &created));
  pair.Replicate();
  Trainers trainer(Address(*pair.primary_server), "emb", 8, 1, /*first_seed=*/1);
  EXPECT(Eventually([&] { return trainer.acked.load() >= 200; }));
  EXPECT(trainer.Stop());
  EXPECT(Eventually([&] {
    return pair.replicator->status().lag_seconds == 0 &&
           SameRows(TableOf(*pair.primary, "emb").get(), TableOf(*pair.standby, "emb").get());
  }));
  EXPECT(pair.replicator->status().rows_sent > 0);
}

DLT_TEST(TestClientsFollowAStandbyThatTookOver) {
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created));
  pair.Replicate();
  Client client({Address(*pair.primary_server) + "|" + Address(*pair.standby_server)},
                ClientOptions{});
  const int64_t ids[] = {1, 2, 3};
  const float grads[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_OK(client.Push("emb", 4, ids, grads, 3, 0.1f));
  std::vector<float> before(12), after(12);
  EXPECT_OK(client.Pull("emb", 4, ids, 3, PullMode::kInsert, before.data()));

  // The primary dies; the standby takes over a little later (as its
  // server does once the primary stays unreachable).
  pair.primary_server->set_write_listener(nullptr);
  pair.replicator->Stop();
  pair.primary_server->Stop();
  std::thread take_over([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    pair.standby_server->set_standby(false);
  });
  // A pull meanwhile waits for it, and reads what the primary acknowledged.
  const Status pulled = client.Pull("emb", 4, ids, 3, PullMode::kInsert, after.data());
  take_over.join();
  EXPECT_OK(pulled);
  EXPECT(std::memcmp(before.data(), after.data(), sizeof(float) * 12) == 0);
  EXPECT_OK(client.Push("emb", 4, ids, grads, 3, 0.1f));
  EXPECT(TableOf(*pair.standby, "emb")->pushes() == 2);

  // A standby greets no trainer; a shard that is not a standby greets no
  // primary.
  Pair other;
  Client at_standby({Address(*other.standby_server)}, ClientOptions{});
  std::vector<ShardInfo> infos;
  const Status refused = at_standby.GetShardInfos(&infos);
  EXPECT(refused.code() == Code::kUnavailable);
  EXPECT(refused.message().find("standby") != std::string::npos);
  ReplicatorOptions r;
  Replicator wrong(other.primary, Address(*other.primary_server), r);  // not a standby
  wrong.Start();
  EXPECT(Eventually([&] { return wrong.status().connects > 0; }));
  EXPECT(!wrong.status().connected);
  EXPECT(wrong.status().error.find("not a standby") != std::string::npos);
  wrong.Stop();
}

// One identified push frame to `address`, by hand: its reply's status.
Status PushOnce(const std::string& address, const PushId& id, const int64_t* ids,
                const float* grads, uint32_t n, uint32_t dim) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  int fd = -1;
  DLT_RETURN_IF_ERROR(net::Connect(address, deadline, &fd));
  wire::HelloRequest hello;
  const std::string greeting = wire::EncodeHelloRequest(hello);
  std::string reply;
  Status s = net::CallFrame(fd, wire::Opcode::kHello, 1, greeting.data(), greeting.size(),
                            wire::kHelloReplyBytes, deadline, &reply);
  if (s.ok()) {
    std::string payload = wire::EncodePushPrefix("emb", dim, n, 0.1f, &id);
    payload.append(reinterpret_cast<const char*>(ids), sizeof(int64_t) * n);
    payload.append(reinterpret_cast<const char*>(grads), sizeof(float) * n * dim);
    s = net::CallFrame(fd, wire::Opcode::kPush, 2, payload.data(), payload.size(),
                       wire::kPushReplyBytes, deadline, &reply);
  }
  net::CloseFd(fd);
  return s;
}

// Frames a primary sends, by hand, on one replica connection to `address`.
struct ReplicaLink {
  int fd = -1;
  uint64_t next_id = 1;
  // `replica`: greets as a primary's replicator does (else as a trainer).
  explicit ReplicaLink(const std::string& address, bool replica = true) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    EXPECT_OK(net::Connect(address, deadline, &fd));
    const std::string hello = wire::EncodeHelloRequest(wire::HelloRequest{});
    EXPECT_OK(Call(wire::Opcode::kHello, hello, replica ? wire::kFlagReplica : 0));
  }
  ~ReplicaLink() { net::CloseFd(fd); }
  Status Call(wire::Opcode op, const std::string& payload, uint16_t flags = 0) {
    std::string reply;
    return net::CallFrame(fd, op, next_id++, payload.data(), payload.size(), 4096,
                          Clock::now() + std::chrono::seconds(10), &reply, flags);
  }
  Status Table(uint32_t action, const std::string& bytes) {
    wire::StandbyTableRequest r;
    r.action = action;
    r.config = bytes;
    return Call(wire::Opcode::kStandbyTable, wire::EncodeStandbyTable(r));
  }
  Status Rows(const std::vector<int64_t>& ids, float value) {
    const std::vector<float> values(ids.size() * 4, value), slots(ids.size() * 4, 0.1f);
    const std::vector<uint32_t> steps(ids.size(), 1), touched(ids.size(), 1);
    wire::ReplicateRequest r;
    r.table = "emb";
    r.dim = 4;
    r.slot_floats = 4;
    r.rows = static_cast<uint32_t>(ids.size());
    r.ids = ids.data();
    r.steps = steps.data();
    r.touched = touched.data();
    r.values = values.data();
    r.slots = slots.data();
    std::string payload(wire::ReplicateBytes(3, 4, ids.size(), 0, 4), '\0');
    wire::EncodeReplicate(r, reinterpret_cast<uint8_t*>(&payload[0]));
    return Call(wire::Opcode::kReplicate, payload);
  }
};

DLT_TEST(TestAStandbyTakesNoReplicationFrameOnATrainersConnection) {
  // Before any primary's replicator greeted it (a process that just
  // stepped down, whose trainers' connections are still open), a standby
  // took replication frames on any connection: a kMakeTable emptied the
  // table. Only a connection that greeted as a replica may send them.
  Pair pair;
  const std::string config = EncodeTableConfig(AdagradConfig("emb", 4));
  pair.standby_server->set_standby(false);  // serving: a trainer greets it
  ReplicaLink trainer(Address(*pair.standby_server), /*replica=*/false);
  pair.standby_server->set_standby(true);  // it steps down
  const Status s = trainer.Table(wire::kMakeTable, config);
  EXPECT(s.code() == Code::kFailedPrecondition);
  EXPECT(s.message().find("did not greet as a replica") != std::string::npos);
  EXPECT(TableOf(*pair.standby, "emb") == nullptr);
  ReplicaLink replica(Address(*pair.standby_server));
  EXPECT_OK(replica.Table(wire::kMakeTable, config));
}

DLT_TEST(TestACaughtUpStandbyAppliesARoundWholeOrNotAtAll) {
  Pair pair;
  const std::string config = EncodeTableConfig(AdagradConfig("emb", 4));
  const uint64_t epoch = 5;  // the primary's
  const std::string at_epoch(reinterpret_cast<const char*>(&epoch), sizeof(epoch));
  auto rows_of = [&] { return TableOf(*pair.standby, "emb")->size(); };
  {
    ReplicaLink link(Address(*pair.standby_server));
    EXPECT_OK(link.Table(wire::kMakeTable, config));
    EXPECT_OK(link.Rows({1, 2}, 0.5f));  // copying: applied as they come
    EXPECT(rows_of() == 2);
    EXPECT_OK(link.Table(wire::kCaughtUp, at_epoch));
    EXPECT(pair.standby_server->standby_caught_up());
    EXPECT_OK(link.Rows({3}, 0.5f));  // a round: applied at its end
    EXPECT(rows_of() == 2);
    const PushId pushed{9, 1};
    EXPECT_OK(
        link.Table(wire::kRoundEnd,
                   at_epoch + std::string(reinterpret_cast<const char*>(&pushed), sizeof(pushed))));
    EXPECT(pair.standby->epoch() == 5);
    EXPECT(rows_of() == 3);
    Status first;
    EXPECT(!pair.standby->push_ledger().Begin(pushed, &first));  // known with its rows
    EXPECT_OK(link.Rows({4}, 0.5f));  // a round the connection does not finish
  }
  {
    // The next connection copies afresh: the unfinished round is dropped,
    // never applied on top of the copy.
    ReplicaLink link(Address(*pair.standby_server));
    EXPECT_OK(link.Table(wire::kMakeTable, config));
    EXPECT(!pair.standby_server->standby_caught_up());
    EXPECT_OK(link.Rows({1}, 0.5f));
    EXPECT_OK(link.Table(wire::kCaughtUp, at_epoch));
    EXPECT(rows_of() == 1);
    EXPECT_OK(link.Rows({5}, 0.5f));
  }
  pair.standby->set_epoch(5);
  pair.standby_server->set_standby(false);  // taking over drops an unfinished round too
  EXPECT(rows_of() == 1);
  EXPECT(pair.standby->epoch() == 6);  // newer than the primary it replaces
}

DLT_TEST(TestACaughtUpStandbyKeepsATableUntilItsNewCopyIsWhole) {
  // A table its primary replaces (a load), makes or drops while the standby
  // is caught up takes its place at the end of the round that finishes the
  // copy. A primary killed during that copy left the standby holding half a
  // table and not caught up: the shard had no copy that could take over.
  Pair pair;
  const std::string emb = EncodeTableConfig(AdagradConfig("emb", 4));
  const std::string other = EncodeTableConfig(AdagradConfig("other", 4));
  const std::string fresh = EncodeTableConfig(AdagradConfig("fresh", 4));
  const uint64_t epoch = 3;
  const std::string at_epoch(reinterpret_cast<const char*>(&epoch), sizeof(epoch));
  auto rows_of = [&] { return TableOf(*pair.standby, "emb")->size(); };
  ReplicaLink link(Address(*pair.standby_server));
  EXPECT_OK(link.Table(wire::kMakeTable, emb));
  EXPECT_OK(link.Table(wire::kMakeTable, other));
  EXPECT_OK(link.Rows({1, 2}, 0.5f));
  EXPECT_OK(link.Table(wire::kCaughtUp, at_epoch));
  EXPECT(pair.standby_server->standby_caught_up() && rows_of() == 2);
  const std::shared_ptr<Table> first = TableOf(*pair.standby, "emb");

  // A round that replaces emb, makes fresh and drops other: nothing changes
  // before its end, and the standby stays caught up throughout.
  EXPECT_OK(link.Table(wire::kMakeTable, emb));
  EXPECT_OK(link.Rows({3}, 0.25f));
  EXPECT_OK(link.Table(wire::kMakeTable, fresh));
  EXPECT_OK(link.Table(wire::kDropTable, other));
  EXPECT(pair.standby_server->standby_caught_up());
  EXPECT(TableOf(*pair.standby, "emb") == first && rows_of() == 2);
  EXPECT(TableOf(*pair.standby, "fresh") == nullptr);
  EXPECT(TableOf(*pair.standby, "other") != nullptr);
  EXPECT_OK(link.Table(wire::kCaughtUp, at_epoch));
  EXPECT(rows_of() == 1 && TableOf(*pair.standby, "emb") != first);
  EXPECT(TableOf(*pair.standby, "fresh") != nullptr);
  EXPECT(TableOf(*pair.standby, "other") == nullptr);

  // A round's end on another connection installs none of what this one
  // left half done.
  EXPECT_OK(link.Table(wire::kMakeTable, emb));
  EXPECT_OK(link.Rows({8, 9}, 0.5f));
  {
    ReplicaLink other(Address(*pair.standby_server));
    EXPECT_OK(other.Table(wire::kRoundEnd, at_epoch));
  }
  EXPECT(rows_of() == 1);

  // The primary dies while it copies emb again: the copy before serves.
  EXPECT_OK(link.Table(wire::kMakeTable, emb));
  EXPECT_OK(link.Rows({4, 5, 6}, 0.75f));
  EXPECT_OK(link.Table(wire::kDropTable, fresh));
  EXPECT(pair.standby_server->standby_caught_up());
  pair.standby_server->set_standby(false);  // it takes over
  EXPECT(rows_of() == 1 && TableOf(*pair.standby, "fresh") != nullptr);
  std::vector<float> out(4);
  const int64_t three = 3;
  EXPECT_OK(TableOf(*pair.standby, "emb")->Pull(&three, 1, PullMode::kZerosNoInsert, out.data()));
  EXPECT(out[0] == 0.25f);
}

DLT_TEST(TestARoundThatFailsToApplyLeavesTheStandbyNotCaughtUp) {
  // A round's end whose rows cannot be applied (here a NaN; on a standby,
  // say, a disk error of its tier) may leave part of it applied without its
  // pushes' ids: the standby is not caught up (it may not take over) until
  // its primary copies it afresh, and the connection closes.
  Pair pair;
  const uint64_t epoch = 1;
  const std::string at_epoch(reinterpret_cast<const char*>(&epoch), sizeof(epoch));
  ReplicaLink link(Address(*pair.standby_server));
  EXPECT_OK(link.Table(wire::kMakeTable, EncodeTableConfig(AdagradConfig("emb", 4))));
  EXPECT_OK(link.Table(wire::kCaughtUp, at_epoch));
  EXPECT(pair.standby_server->standby_caught_up());
  EXPECT_OK(link.Rows({1, 2}, NAN));
  EXPECT(link.Table(wire::kRoundEnd, at_epoch).code() == Code::kInvalidArgument);
  EXPECT(!pair.standby_server->standby_caught_up());
  EXPECT(!link.Table(wire::kRoundEnd, at_epoch).ok());  // closed
}

DLT_TEST(TestAFrameOnAConnectionOlderThanTheLatestCopyIsRefused) {
  // A primary reconnected (its first connection still open here, a frame
  // on it read late): the new connection's copy fences the old one, and the
  // copy's lanes (connections greeted after it) are served.
  Pair pair;
  const std::string config = EncodeTableConfig(AdagradConfig("emb", 4));
  ReplicaLink old_link(Address(*pair.standby_server));
  EXPECT_OK(old_link.Table(wire::kMakeTable, config));
  EXPECT_OK(old_link.Rows({1}, 0.5f));
  ReplicaLink link(Address(*pair.standby_server));
  ReplicaLink lane(Address(*pair.standby_server));
  EXPECT_OK(link.Table(wire::kMakeTable, config));  // the copy begins again
  const Status stale = old_link.Rows({2}, 9.0f);
  EXPECT(stale.code() == Code::kFailedPrecondition);
  EXPECT(stale.message().find("before the one that began its latest copy") != std::string::npos);
  EXPECT(TableOf(*pair.standby, "emb")->size() == 0);  // nothing of the old connection's
  EXPECT_OK(lane.Rows({3}, 0.5f));
  EXPECT_OK(link.Rows({4}, 0.5f));
  EXPECT(TableOf(*pair.standby, "emb")->size() == 2);
  EXPECT(!old_link.Rows({5}, 0.5f).ok());  // closed
}

DLT_TEST(TestClientsLearnStandbysAndNeverUseAnOlderCopy) {
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created));
  pair.primary_server->set_standbys(Address(*pair.standby_server));  // told in its Hello
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  Client client({Address(*pair.primary_server)}, ClientOptions{});  // the primary only
  const int64_t ids[] = {1, 2, 3};
  const float grads[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_OK(client.Push("emb", 4, ids, grads, 3, 0.1f));
  std::vector<float> before(12), after(12), fresh(12);
  EXPECT_OK(client.Pull("emb", 4, ids, 3, PullMode::kInsert, before.data()));

  pair.replicator->Stop();
  pair.primary_server->Stop();
  std::thread take_over([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    pair.standby_server->set_standby(false);
  });
  EXPECT_OK(client.Pull("emb", 4, ids, 3, PullMode::kInsert, after.data()));  // found it
  take_over.join();
  EXPECT(std::memcmp(before.data(), after.data(), sizeof(float) * 12) == 0);
  EXPECT(pair.standby->epoch() == 2);

  // The dead primary's address comes back as an empty primary (epoch 1).
  auto empty = std::make_shared<Shard>(0, 1);
  EXPECT_OK(empty->CreateTable(AdagradConfig("emb", 4), &created));
  DataServer comeback(empty, DataServerOptions{});
  EXPECT_OK(comeback.Start());
  // A client that met the new primary refuses it; a new client listing it
  // first takes the newest copy.
  Client at_comeback({Address(comeback) + "|" + Address(*pair.standby_server)}, ClientOptions{});
  EXPECT_OK(at_comeback.Pull("emb", 4, ids, 3, PullMode::kInsert, fresh.data()));
  EXPECT(std::memcmp(before.data(), fresh.data(), sizeof(float) * 12) == 0);
  std::vector<ShardInfo> infos;
  EXPECT_OK(at_comeback.GetShardInfos(&infos));
  EXPECT(infos[0].address == Address(*pair.standby_server));
  EXPECT(empty->epoch() == 1);
  comeback.Stop();
}

DLT_TEST(TestAClientFollowsAReplicaSetRestartedWholeOnlyOnceNoOldCopyServes) {
  // A client that met epoch 2 refused every older copy, so a shard whose
  // processes all restarted (a new lineage at epoch 1) was refused until
  // the trainer restarted. It now takes the new lineage once no address
  // serves the one it met (that call fails DATA_LOSS), and not while a copy
  // of that one still does.
  bool created;
  auto met = std::make_shared<Shard>(0, 1);
  EXPECT_OK(met->CreateTable(AdagradConfig("emb", 4), &created));
  met->set_epoch(2);                           // took over once
  auto stale = std::make_shared<Shard>(0, 1);  // its lineage, older: the copy it replaced
  EXPECT_OK(stale->CreateTable(AdagradConfig("emb", 4), &created));
  stale->FollowEpoch(1, met->lineage());
  auto served = std::make_unique<DataServer>(met, DataServerOptions{});
  DataServer old_copy(stale, DataServerOptions{});
  EXPECT_OK(served->Start());
  EXPECT_OK(old_copy.Start());
  const int port = served->port();
  ClientOptions o;
  o.pull_retries = 1;
  // The refused pull below retries until this deadline (the default 30 s).
  o.request_timeout_ms = 3000;
  Client client({Address(*served) + "|" + Address(old_copy)}, o);
  const int64_t ids[] = {1, 2, 3};
  std::vector<float> rows(12), fresh(12);
  EXPECT_OK(client.Pull("emb", 4, ids, 3, PullMode::kInsert, rows.data()));

  // The process at epoch 2 restarts: a new lineage at epoch 1.
  served->Stop();
  served.reset();
  auto restarted = std::make_shared<Shard>(0, 1);
  EXPECT(restarted->lineage() != met->lineage() && restarted->epoch() == 1);
  EXPECT_OK(restarted->CreateTable(AdagradConfig("emb", 4), &created));
  DataServerOptions same_port;
  same_port.port = port;
  DataServer comeback(restarted, same_port);
  EXPECT_OK(comeback.Start());
  Status s = client.Pull("emb", 4, ids, 3, PullMode::kInsert, rows.data());
  EXPECT(s.code() == Code::kUnavailable);  // a copy of the lineage met serves still
  EXPECT(s.message().find("older than epoch 2") != std::string::npos);

  old_copy.Stop();  // nothing of that lineage is left
  s = client.Pull("emb", 4, ids, 3, PullMode::kInsert, rows.data());
  EXPECT(s.code() == Code::kDataLoss);  // once, never retried: the rows met are gone
  EXPECT(s.message().find("every copy of the shard at epoch 2 is gone") != std::string::npos);
  EXPECT_OK(client.Pull("emb", 4, ids, 3, PullMode::kInsert, rows.data()));
  Client new_client({"127.0.0.1:" + std::to_string(port)}, o);
  EXPECT_OK(new_client.Pull("emb", 4, ids, 3, PullMode::kInsert, fresh.data()));
  EXPECT(rows == fresh);
  comeback.Stop();
}

DLT_TEST(TestStoppingAReplicatorDoesNotWaitForAStandbyThatHangs) {
  // A "standby" that accepts and never answers.
  int listener = -1, port = 0;
  EXPECT_OK(net::Listen("127.0.0.1", 0, 4, &listener, &port));
  auto shard = std::make_shared<Shard>(0, 1);
  ReplicatorOptions options;
  options.connect_timeout_ms = 600000;
  options.io_timeout_ms = 600000;
  Replicator replicator(shard, "127.0.0.1:" + std::to_string(port), options);
  replicator.Start();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // in its Hello
  const auto start = Clock::now();
  replicator.Stop();
  EXPECT(Clock::now() - start < std::chrono::seconds(60));  // not the 600 s timeout
  net::CloseFd(listener);
}

DLT_TEST(TestAPushSentAgainIsAppliedOnceEvenAfterATakeover) {
  Pair pair;
  pair.ReplicateATable();
  const int64_t ids[] = {1, 2, 1};
  const float grads[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const PushId id{42, 7};
  EXPECT_OK(PushOnce(Address(*pair.primary_server), id, ids, grads, 3, 4));
  const Rows once = AllRows(TableOf(*pair.primary, "emb").get());
  EXPECT_OK(PushOnce(Address(*pair.primary_server), id, ids, grads, 3, 4));  // its reply was lost
  EXPECT(TableOf(*pair.primary, "emb")->pushes() == 1);
  EXPECT(pair.primary_server->counters().repeated_pushes.load() == 1);
  EXPECT(SameRows(TableOf(*pair.primary, "emb").get(), TableOf(*pair.standby, "emb").get()));
  // The primary dies; its standby knows the push (its id came with its rows).
  pair.primary_server->set_write_listener(nullptr);
  pair.replicator->Stop();
  pair.primary_server->Stop();
  pair.standby_server->set_standby(false);
  EXPECT_OK(PushOnce(Address(*pair.standby_server), id, ids, grads, 3, 4));
  EXPECT(TableOf(*pair.standby, "emb")->pushes() == 1);
  const Rows after = AllRows(TableOf(*pair.standby, "emb").get());
  EXPECT(after.values == once.values && after.slots == once.slots && after.steps == once.steps);
  // Another push (another id) is applied.
  EXPECT_OK(PushOnce(Address(*pair.standby_server), PushId{42, 8}, ids, grads, 3, 4));
  EXPECT(TableOf(*pair.standby, "emb")->pushes() == 2);
}

DLT_TEST(TestAStandbyAttachedAfterAPushKnowsItFromTheCopy) {
  // A push applied before its standby attached (or whose id a failed round
  // took) is in the rows the standby's copy holds: the copy's round carries
  // its id, so sent again after a takeover it is not applied twice.
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created));
  const int64_t ids[] = {1, 2, 1};
  const float grads[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const PushId id{43, 1};
  EXPECT_OK(PushOnce(Address(*pair.primary_server), id, ids, grads, 3, 4));
  const Rows once = AllRows(TableOf(*pair.primary, "emb").get());
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  pair.primary_server->set_write_listener(nullptr);
  pair.replicator->Stop();
  pair.primary_server->Stop();
  pair.standby_server->set_standby(false);
  EXPECT_OK(PushOnce(Address(*pair.standby_server), id, ids, grads, 3, 4));  // its reply was lost
  EXPECT(pair.standby_server->counters().repeated_pushes.load() == 1);
  const Rows after = AllRows(TableOf(*pair.standby, "emb").get());
  EXPECT(after.values == once.values && after.slots == once.slots && after.steps == once.steps);
}

DLT_TEST(TestAStandbyThatPromisedATakeoverFencesItsOldPrimary) {
  // The standby granted another standby's takeover (its primary looked
  // gone: paused, cut off). The old primary comes back: its rounds are
  // refused, so it acknowledges no write, and once it connects again the
  // standby's Hello tells it the newer epoch: it serves no trainer.
  Pair pair;
  pair.ReplicateATable();
  const int64_t ids[] = {1, 2, 3};
  const float grads[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_OK(PushOnce(Address(*pair.primary_server), PushId{44, 1}, ids, grads, 3, 4));
  EXPECT(pair.primary->epoch() == 1 && pair.standby->epoch() == 1);
  pair.standby->Fence(pair.standby->epoch() + 1);  // a grant (tf_dlt/server/replication.py)
  const Rows held = AllRows(TableOf(*pair.standby, "emb").get());
  const Status late = PushOnce(Address(*pair.primary_server), PushId{44, 2}, ids, grads, 3, 4);
  EXPECT(late.code() == Code::kUnavailable);  // applied there, in doubt: never acknowledged
  const Rows after = AllRows(TableOf(*pair.standby, "emb").get());  // the round was dropped
  EXPECT(after.ids == held.ids && after.values == held.values && after.slots == held.slots);
  EXPECT(Eventually([&] { return pair.primary->superseded_by() == 2; }));
  const Status hello = PushOnce(Address(*pair.primary_server), PushId{44, 3}, ids, grads, 3, 4);
  EXPECT(hello.code() == Code::kUnavailable);
  EXPECT(hello.message().find("was replaced") != std::string::npos);
  // Who replaced it is named, in the refusal and in Shard::replaced_by.
  const std::string by = "its standby " + Address(*pair.standby_server) + " follows a newer";
  EXPECT(hello.message().find(by) != std::string::npos);
  EXPECT(pair.primary->replaced_by().find(by) == 0);
  // The standby that takes over itself serves newer than the epoch it
  // fenced (the one it promised may have served meanwhile).
  pair.primary_server->set_write_listener(nullptr);
  pair.replicator->Stop();
  pair.standby_server->set_standby(false);
  EXPECT(pair.standby->epoch() == 3);
  EXPECT_OK(PushOnce(Address(*pair.standby_server), PushId{44, 2}, ids, grads, 3, 4));
}

DLT_TEST(TestPushesToShardsWithStandbysGoOnAcrossATakeover) {
  // A client pushing while the primary dies: every push returns OK, and the
  // standby ends with exactly the rows of every push applied once.
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 8), &created));
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  Table oracle(AdagradConfig("emb", 8));
  Client client({Address(*pair.primary_server) + "|" + Address(*pair.standby_server)},
                ClientOptions{});
  std::mt19937_64 rng(3);
  std::vector<int64_t> ids(512);
  std::vector<float> grads(ids.size() * 8);
  std::thread kill;
  for (int step = 0; step < 60; ++step) {
    for (auto& i : ids) i = static_cast<int64_t>(rng() % 3000);
    for (auto& g : grads) g = static_cast<float>(static_cast<int>(rng() % 200) - 100) / 64.0f;
    if (step == 20) {  // the primary dies while pushes run; the standby takes over later
      kill = std::thread([&] {
        // As a process dies: its link to the standby goes with it (a push
        // applied here from now on is acknowledged to no one), then the rest.
        pair.replicator->Stop();
        pair.primary_server->Stop();
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        pair.standby_server->set_standby(false);
      });
    }
    EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.05f));
    EXPECT_OK(oracle.Push(ids.data(), grads.data(), ids.size(), 0.05f));
  }
  kill.join();
  const Rows want = AllRows(&oracle), got = AllRows(TableOf(*pair.standby, "emb").get());
  EXPECT(want.ids == got.ids && want.values == got.values && want.slots == got.slots &&
         want.steps == got.steps);
}

// Every slice of `table`'s admission sketch: counters, then pushes since
// halving per bucket.
std::vector<uint8_t> SketchOf(const Table& table, const Shard& shard) {
  std::vector<uint8_t> all;
  std::vector<uint8_t> slice(table.sketch_slice_bytes());
  for (uint32_t b = shard.first_bucket(); b < shard.end_bucket(); ++b) {
    uint32_t added = 0;
    table.ReadSketch(b, slice.data(), &added);
    all.insert(all.end(), slice.begin(), slice.end());
    all.insert(all.end(), reinterpret_cast<uint8_t*>(&added),
               reinterpret_cast<uint8_t*>(&added) + 4);
  }
  return all;
}

DLT_TEST(TestAStandbyCarriesTheAdmissionSketch) {
  // Frequency admission: a row is made at an id's third push. Counts made
  // before the standby joined come with the whole copy, later ones with the
  // rounds (in order: the sketch's halving depends on it); after a takeover
  // the standby admits exactly what the primary would have.
  TableConfig config = AdagradConfig("emb", 4);
  config.policy.admission = static_cast<uint64_t>(AdmissionKind::kFrequency);
  config.policy.min_count = 3;
  config.policy.sketch_bytes = 1 << 18;  // small: slices halve during the test
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(config, &created));
  std::mt19937_64 rng(5);
  std::vector<int64_t> ids(300);
  std::vector<float> grads(ids.size() * 4, 0.5f);
  const auto push = [&](Table* table) {
    for (auto& id : ids) id = static_cast<int64_t>(rng() % 20000);
    EXPECT_OK(table->Push(ids.data(), grads.data(), ids.size(), 0.1f));
  };
  const auto primary_table = TableOf(*pair.primary, "emb");
  for (int i = 0; i < 40; ++i) push(primary_table.get());
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  Trainers trainer(Address(*pair.primary_server), "emb", 4, 1, /*first_seed=*/9);
  EXPECT(Eventually([&] { return trainer.acked.load() >= 50; }));
  EXPECT(trainer.Stop());
  const auto standby_table = TableOf(*pair.standby, "emb");
  // Sync: every acknowledged push (rows and counts) is on the standby.
  EXPECT(SketchOf(*standby_table, *pair.standby) == SketchOf(*primary_table, *pair.primary));
  EXPECT(SameRows(primary_table.get(), standby_table.get()));
  EXPECT(standby_table->size() > 0 && standby_table->size() < 20000);

  // The standby takes over; the same pushes on it and on the old primary
  // admit the same rows.
  pair.primary_server->set_write_listener(nullptr);
  pair.replicator->Stop();
  pair.standby_server->set_standby(false);
  for (int i = 0; i < 20; ++i) {
    for (auto& id : ids) id = static_cast<int64_t>(rng() % 20000);
    EXPECT_OK(standby_table->Push(ids.data(), grads.data(), ids.size(), 0.1f));
    EXPECT_OK(primary_table->Push(ids.data(), grads.data(), ids.size(), 0.1f));
  }
  EXPECT(SameRows(primary_table.get(), standby_table.get()));
  EXPECT(SketchOf(*standby_table, *pair.standby) == SketchOf(*primary_table, *pair.primary));
}

DLT_TEST(TestATableThatOverflowsWhileAnotherIsCopiedIsNotSentTwice) {
  // A round's take finds table "a" overflowed and "b" not; while "a" is
  // copied, "b" overflows too. What the first take found of "b" (rows and
  // sketch counts) is in b's copy then, so the round drops it: counting its
  // sketch counts again after the copy would count them twice.
  TableConfig b_config = AdagradConfig("b", 4);
  b_config.policy.admission = static_cast<uint64_t>(AdmissionKind::kFrequency);
  b_config.policy.min_count = 3;
  b_config.policy.sketch_bytes = 1 << 18;
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("a", 4), &created));
  EXPECT_OK(pair.primary->CreateTable(b_config, &created));
  const auto a = TableOf(*pair.primary, "a");
  const auto b = TableOf(*pair.primary, "b");
  const std::vector<float> grads(300 * 4, 0.5f);
  const int64_t one[] = {7};
  // More changes than a stripe's log holds.
  const auto overflow = [&](Table* table) {
    for (size_t i = 0; i < kChangeLogSlack + 10; ++i) {
      EXPECT_OK(table->Push(one, grads.data(), 1, 0.01f));
    }
  };
  std::atomic<bool> armed{false};
  std::atomic<int> b_overflowed{0};
  ReplicatorOptions r;
  r.io_timeout_ms = 10000;
  r.after_copy = [&] {
    if (!armed.exchange(false)) return;
    overflow(b.get());
    b_overflowed.fetch_add(1);
  };
  pair.replicator = std::make_shared<Replicator>(pair.primary, Address(*pair.standby_server), r);
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  const uint64_t copies = pair.replicator->status().tables_copied;
  {
    // No round takes until both tables changed.
    std::unique_lock<WriterFirstLock> gate(pair.primary->push_ledger().gate());
    overflow(a.get());
    std::mt19937_64 rng(3);
    std::vector<int64_t> ids(300);
    for (int i = 0; i < 20; ++i) {  // counted in b's sketch, some admitted
      for (auto& id : ids) id = static_cast<int64_t>(rng() % 2000);
      EXPECT_OK(b->Push(ids.data(), grads.data(), ids.size(), 0.1f));
    }
    armed = true;
  }
  EXPECT(Eventually([&] { return b_overflowed.load() == 1; }));
  EXPECT(Eventually([&] {
    return pair.replicator->status().tables_copied >= copies + 2 &&
           SameRows(a.get(), TableOf(*pair.standby, "a").get()) &&
           SameRows(b.get(), TableOf(*pair.standby, "b").get());
  }));
  EXPECT(SketchOf(*TableOf(*pair.standby, "b"), *pair.standby) == SketchOf(*b, *pair.primary));
}

DLT_TEST(TestAStandbyKnowsWhichTablesAreProvisional) {
  // A Keras layer whose model was not compiled yet makes its table
  // provisional; a standby that takes over must settle it as its primary
  // would, so it holds the flag, and learns when it clears.
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created, /*provisional=*/true));
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  EXPECT(Eventually([&] { return TableOf(*pair.standby, "emb")->provisional(); }));
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created));  // settles it
  EXPECT(!TableOf(*pair.primary, "emb")->provisional());
  EXPECT(Eventually([&] { return !TableOf(*pair.standby, "emb")->provisional(); }));
  // A table made provisional later, while replicating.
  TableConfig other = AdagradConfig("other", 4);
  EXPECT_OK(pair.primary->CreateTable(other, &created, /*provisional=*/true));
  EXPECT(Eventually([&] {
    const auto t = TableOf(*pair.standby, "other");
    return t != nullptr && t->provisional();
  }));
  // A malformed flag is refused by name.
  wire::StandbyTableRequest bad{wire::kProvisional, std::string("\x02\0\0\0emb", 7)};
  int fd = -1;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  EXPECT_OK(net::Connect(Address(*pair.standby_server), deadline, &fd));
  wire::HelloReply hello;
  EXPECT_OK(net::SayHello(fd, "", wire::kFlagReplica, 1, deadline, &hello));
  const std::string payload = wire::EncodeStandbyTable(bad);
  std::string reply;
  const Status refused = net::CallFrame(fd, wire::Opcode::kStandbyTable, 2, payload.data(),
                                        payload.size(), 64, deadline, &reply);
  EXPECT(refused.code() == Code::kInvalidArgument);
  EXPECT(refused.message().find("provisional flag") != std::string::npos);
  net::CloseFd(fd);
}

DLT_TEST(TestARoundSendsNoRowOfAPushWhoseIdItLacks) {
  // Push Q to id 1 is taken by a round; push P to id 1 comes right after
  // the take. The round must not carry P's row without P's id: a standby
  // taking over would apply P a second time when its client sends it again
  // (fails when the round reads its rows after releasing the push gate).
  std::atomic<int> armed{0};  // 1: start P at the take of Q; 2: P started
  std::atomic<bool> p_applied{false}, checked{false};
  std::function<void()> start_p;
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created));
  const int64_t one[] = {1};
  const float q_grads[4] = {1, 1, 1, 1}, p_grads[4] = {-3, 2, -1, 4};
  Table oracle(AdagradConfig("emb", 4));
  EXPECT_OK(oracle.Push(one, q_grads, 1, 0.1f));  // what the round that took Q may carry
  std::vector<float> after_q(4);
  EXPECT_OK(oracle.Pull(one, 1, PullMode::kZerosNoInsert, after_q.data()));
  // Whether the primary applied Q: a take now has it (a round may take
  // before Q is applied, with nothing of it).
  auto q_applied = [&] {
    std::vector<float> row(4);
    return TableOf(*pair.primary, "emb")->Pull(one, 1, PullMode::kZerosNoInsert, row.data()).ok() &&
           row == after_q;
  };
  ReplicatorOptions r;
  r.io_timeout_ms = 10000;
  std::vector<float> standby_after_round;  // id 1 on the standby once P's round began
  r.after_take = [&] {
    if (armed.load() == 2 && !checked.load()) {
      // The round after P's take: the one before it was applied already.
      std::vector<float> row(4);
      EXPECT_OK(TableOf(*pair.standby, "emb")->Pull(one, 1, PullMode::kZerosNoInsert, row.data()));
      standby_after_round = row;
      checked = true;
    }
    int expected = 1;
    if (armed.load() == 1 && q_applied() && armed.compare_exchange_strong(expected, 2)) {
      start_p();
      // P waits for this round to send what it took (give it the time to
      // overtake the round if it could).
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
  };
  pair.replicator = std::make_shared<Replicator>(pair.primary, Address(*pair.standby_server), r);
  pair.Replicate();
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  const std::string both = Address(*pair.primary_server) + "|" + Address(*pair.standby_server);
  Client q_client({both}, ClientOptions{}), p_client({both}, ClientOptions{});
  std::thread p_thread;
  start_p = [&] {
    p_thread = std::thread([&] {
      EXPECT_OK(p_client.Push("emb", 4, one, p_grads, 1, 0.1f));
      p_applied = true;
    });
  };
  armed = 1;
  EXPECT_OK(q_client.Push("emb", 4, one, q_grads, 1, 0.1f));
  EXPECT(Eventually([&] { return checked.load() && p_applied.load(); }));
  p_thread.join();
  EXPECT(standby_after_round == after_q);
  EXPECT(SameRows(TableOf(*pair.primary, "emb").get(), TableOf(*pair.standby, "emb").get()));
}

}  // namespace
}  // namespace dlt

namespace dlt {
namespace {

// The rows of buckets [first, end) of `table` (both tiers), sorted by id.
Rows RowsIn(Table* table, uint32_t first, uint32_t end) {
  const size_t dim = table->dim(), slot_floats = table->slot_floats();
  std::vector<int64_t> ids(1);
  std::vector<float> values(dim), slots(slot_floats + 1);
  std::vector<uint32_t> steps(1), touched(1), buckets(1);
  const RowBuffers out{ids.data(),   values.data(),  slots.data(),
                       steps.data(), buckets.data(), touched.data()};
  struct Row {
    int64_t id;
    std::vector<float> values, slots;
    uint32_t step, touched;
  };
  std::vector<Row> rows;
  Table::Exporter exporter(table);
  exporter.set_buckets(first, end);
  while (exporter.Next(1, out) == 1) {
    rows.push_back({ids[0], values, std::vector<float>(slots.begin(), slots.begin() + slot_floats),
                    steps[0], touched[0]});
  }
  EXPECT_OK(exporter.error());
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.id < b.id; });
  Rows all;
  for (const Row& r : rows) {
    all.ids.push_back(r.id);
    all.values.insert(all.values.end(), r.values.begin(), r.values.end());
    all.slots.insert(all.slots.end(), r.slots.begin(), r.slots.end());
    all.steps.push_back(r.step);
    all.touched.push_back(r.touched);
  }
  return all;
}

bool SameRows(const Rows& x, const Rows& y) {
  return x.ids == y.ids && x.steps == y.steps && x.touched == y.touched && x.values == y.values &&
         x.slots == y.slots;
}

// Rows of `a`'s buckets [first, mid) and `b`'s [mid, end), sorted by id.
Rows RowsOfTwo(Table* a, Table* b, uint32_t first, uint32_t mid, uint32_t end) {
  Rows x = RowsIn(a, first, mid);
  const Rows y = RowsIn(b, mid, end);
  x.ids.insert(x.ids.end(), y.ids.begin(), y.ids.end());
  x.values.insert(x.values.end(), y.values.begin(), y.values.end());
  x.slots.insert(x.slots.end(), y.slots.begin(), y.slots.end());
  x.steps.insert(x.steps.end(), y.steps.begin(), y.steps.end());
  x.touched.insert(x.touched.end(), y.touched.begin(), y.touched.end());
  // Sorted by id as one table's would be.
  std::vector<size_t> order(x.ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t i, size_t j) { return x.ids[i] < x.ids[j]; });
  const size_t dim = x.ids.empty() ? 0 : x.values.size() / x.ids.size();
  const size_t slot_floats = x.ids.empty() ? 0 : x.slots.size() / x.ids.size();
  Rows sorted;
  for (size_t i : order) {
    sorted.ids.push_back(x.ids[i]);
    sorted.values.insert(sorted.values.end(), x.values.begin() + i * dim,
                         x.values.begin() + (i + 1) * dim);
    sorted.slots.insert(sorted.slots.end(), x.slots.begin() + i * slot_floats,
                        x.slots.begin() + (i + 1) * slot_floats);
    sorted.steps.push_back(x.steps[i]);
    sorted.touched.push_back(x.touched[i]);
  }
  return sorted;
}

// Two shard processes of a 2-shard layout; process B prepares shard 1 of a
// 3-shard layout, fed by range streams from A and from B itself.
struct Regrow {
  std::shared_ptr<Shard> a = std::make_shared<Shard>(0, 2);
  std::shared_ptr<Shard> b = std::make_shared<Shard>(1, 2);
  std::shared_ptr<Shard> next = std::make_shared<Shard>(1, 3);
  const uint64_t round_buffer_bytes;
  std::unique_ptr<DataServer> a_server, b_server;
  std::shared_ptr<Replicator> from_a, from_b;

  // `workers` per shard process; rounds of the streams buffer
  // `round_buffer_bytes` (0: the default) in frames of 8 KiB when given.
  explicit Regrow(int workers = 4, uint64_t round_buffer_bytes = 0)
      : round_buffer_bytes(round_buffer_bytes) {
    DataServerOptions options;
    options.worker_threads = workers;
    a_server = std::make_unique<DataServer>(a, options);
    b_server = std::make_unique<DataServer>(b, options);
    EXPECT_OK(a_server->Start());
    EXPECT_OK(b_server->Start());
    b_server->reshard_target().Prepare(next);
    from_a = Stream(a);
    from_b = Stream(b);
  }
  std::shared_ptr<Replicator> Stream(std::shared_ptr<Shard> from) const {
    ReplicatorOptions r;
    r.range_stream = true;
    r.sync = false;
    r.io_timeout_ms = 10000;
    r.frame_bytes = 64 << 10;  // several frames per round and per copy
    if (round_buffer_bytes != 0) {
      r.round_buffer_bytes = round_buffer_bytes;
      r.frame_bytes = 8 << 10;
    }
    return std::make_shared<Replicator>(std::move(from), Address(*b_server), r);
  }
  std::vector<std::string> Addresses() const { return {Address(*a_server), Address(*b_server)}; }
  // Returns once each stream applied a round that began after now.
  bool Drained() const {
    const uint64_t a_rounds = from_a->status().rounds, b_rounds = from_b->status().rounds;
    return Eventually([&] {
      return from_a->status().rounds >= a_rounds + 2 && from_b->status().rounds >= b_rounds + 2;
    });
  }
  ~Regrow() {
    from_a->Stop();
    from_b->Stop();
    a_server->Stop();
    b_server->Stop();
  }
};

DLT_TEST(TestRangeStreamsFillTheNextLayoutsShardWhileTrainingRuns) {
  // Growing 2 -> 3 shards: the new shard 1 owns buckets [1366, 2731), of
  // which [1366, 2048) are old shard 0's and [2048, 2731) old shard 1's.
  Regrow grow;
  const uint32_t first = FirstBucket(1, 3), mid = FirstBucket(1, 2), end = FirstBucket(2, 3);
  TableConfig config = AdagradConfig("emb", 8);
  config.policy.admission = static_cast<uint64_t>(AdmissionKind::kFrequency);
  config.policy.min_count = 2;
  config.policy.sketch_bytes = 1 << 18;  // small: slices halve during the test
  bool created;
  EXPECT_OK(grow.a->CreateTable(config, &created));
  EXPECT_OK(grow.b->CreateTable(config, &created));
  // Rows from before the streams began come with their copies, and so do
  // the ids of the pushes that wrote them.
  Trainers trainers(grow.Addresses(), "emb", 8, 2);
  EXPECT(Eventually([&] { return trainers.acked.load() >= 20; }));
  int64_t moving = 0;
  while (BucketOf(moving) < first || BucketOf(moving) >= mid) ++moving;
  const PushId before{77, 0};
  const std::vector<float> grads(8, 0.5f);
  EXPECT_OK(PushOnce(Address(*grow.a_server), before, &moving, grads.data(), 1, 8));
  grow.from_a->Start();
  grow.from_b->Start();
  EXPECT(Eventually(
      [&] { return grow.from_a->status().caught_up && grow.from_b->status().caught_up; }));
  EXPECT(grow.from_a->status().first_bucket == first && grow.from_a->status().end_bucket == mid);
  EXPECT(grow.from_b->status().first_bucket == mid && grow.from_b->status().end_bucket == end);
  // A table made and one dropped while the streams run follow.
  EXPECT_OK(grow.a->CreateTable(AdagradConfig("late", 4), &created));
  EXPECT_OK(grow.b->CreateTable(AdagradConfig("late", 4), &created));
  EXPECT(Eventually([&] { return TableOf(*grow.next, "late") != nullptr; }));
  const int at_catch_up = trainers.acked.load();
  EXPECT(Eventually([&] { return trainers.acked.load() >= at_catch_up + 50; }));
  // An identified push to shard 0 of a moving bucket: its id moves too.
  const PushId push{77, 1};
  EXPECT_OK(PushOnce(Address(*grow.a_server), push, &moving, grads.data(), 1, 8));
  EXPECT_OK(grow.a->DropTable("late"));
  EXPECT_OK(grow.b->DropTable("late"));
  // Writes stop (a re-shard's switch); each stream runs a last round.
  EXPECT(trainers.Stop());
  EXPECT(grow.Drained());
  EXPECT(TableOf(*grow.next, "late") == nullptr);
  const auto a_table = TableOf(*grow.a, "emb"), b_table = TableOf(*grow.b, "emb");
  const auto next_table = TableOf(*grow.next, "emb");
  const Rows want = RowsOfTwo(a_table.get(), b_table.get(), first, mid, end);
  EXPECT(want.ids.size() > 100);
  EXPECT(SameRows(RowsIn(next_table.get(), 0, kNumBuckets), want));
  // The admission sketch of each bucket, as its old owner's.
  std::vector<uint8_t> have(next_table->sketch_slice_bytes()), had(have.size());
  for (uint32_t bucket = first; bucket < end; ++bucket) {
    uint32_t have_added = 0, had_added = 0;
    next_table->ReadSketch(bucket, have.data(), &have_added);
    (bucket < mid ? a_table : b_table)->ReadSketch(bucket, had.data(), &had_added);
    EXPECT(have == had && have_added == had_added);
  }
  EXPECT(next_table->pushes() == std::max(a_table->pushes(), b_table->pushes()));
  Status again;
  EXPECT(!grow.next->push_ledger().Begin(push, &again));  // applied once, on A
  EXPECT_OK(again);
  EXPECT(!grow.next->push_ledger().Begin(before, &again));  // with the copy
  EXPECT_OK(again);
  // The streams took only their shards' own change logs: a standby of A
  // could have run beside them.
  EXPECT(!grow.from_a->status().ended && !grow.from_b->status().ended);
}

DLT_TEST(TestAPreparedShardKeepsThePushIdsOfEverySender) {
  // Growing 2 -> 3: the new shard takes the ids of the pushes A and B
  // applied, up to kCapacity from each sender's copy. They went into one
  // ledger of kCapacity, B's pushing A's out, and the switch kept only the
  // newest kCapacity: a push A applied, sent again to the new shard after
  // the switch, was applied twice.
  DataServer server(std::make_shared<Shard>(2, 3), DataServerOptions());
  const auto next = std::make_shared<Shard>(2, 3);
  server.reshard_target().Prepare(next);
  constexpr size_t kEach = PushLedger::kCapacity;
  std::vector<PushId> from_a(kEach), from_b(kEach);
  for (size_t i = 0; i < kEach; ++i) {
    from_a[i] = PushId{1, i};
    from_b[i] = PushId{2, i};
  }
  next->push_ledger().Insert(from_a.data(), kEach);  // A's copy, then B's
  next->push_ledger().Insert(from_b.data(), kEach);
  PushLedger serving;  // the joining process's own, at the switch
  serving.Absorb(&next->push_ledger());
  auto known = [&](const PushId& id) {  // applied before (else forgotten again)
    Status first;
    if (!serving.Begin(id, &first)) return true;
    serving.Abandon(id);
    return false;
  };
  EXPECT(known(from_a.front()));  // A's oldest
  EXPECT(known(from_b.back()));
  Status first;
  EXPECT(serving.Begin(PushId{3, 0}, &first));  // a new push is applied
  serving.End(PushId{3, 0}, OkStatus());
  EXPECT(known(from_a.front()));  // room for its own too
}

DLT_TEST(TestARangeStreamToItsOwnProcessDoesNotWaitOnItsGate) {
  // B streams buckets to the shard its own process prepares, in rounds
  // larger than their buffer, while identified pushes (clients of shards
  // with standbys) take B's only worker. The stream's frames need that
  // worker: a round that held B's push gate while it sent them waited on a
  // push blocked on that gate, until the stream's io timeout failed it.
  Regrow grow(/*workers=*/1, /*round_buffer_bytes=*/8 << 10);
  bool created;
  EXPECT_OK(grow.a->CreateTable(AdagradConfig("emb", 8), &created));
  EXPECT_OK(grow.b->CreateTable(AdagradConfig("emb", 8), &created));
  grow.from_b->Start();
  EXPECT(Eventually([&] { return grow.from_b->status().caught_up; }));
  std::mt19937_64 rng(5);
  std::vector<int64_t> ids;
  while (ids.size() < 4096) {
    const auto id = static_cast<int64_t>(rng() >> 1);
    if (BucketOf(id) >= FirstBucket(1, 2)) ids.push_back(id);  // B's
  }
  const std::vector<float> grads(ids.size() * 8, 0.1f);
  const uint64_t connects = grow.from_b->status().connects;
  for (uint64_t k = 0; k < 30; ++k) {
    EXPECT_OK(PushOnce(Address(*grow.b_server), PushId{51, k}, ids.data(), grads.data(),
                       static_cast<uint32_t>(ids.size()), 8));
  }
  // No round failed (a timed-out one connects again).
  EXPECT(grow.from_b->status().connects == connects && !grow.from_b->status().ended);
  const uint64_t rounds = grow.from_b->status().rounds;
  EXPECT(Eventually([&] { return grow.from_b->status().rounds >= rounds + 2; }));
  const uint32_t mid = FirstBucket(1, 2), end = FirstBucket(2, 3);
  EXPECT(SameRows(RowsIn(TableOf(*grow.next, "emb").get(), mid, end),
                  RowsIn(TableOf(*grow.b, "emb").get(), mid, end)));
}

DLT_TEST(TestARangeStreamEndsWhenItsTargetPreparesAnotherShard) {
  Regrow grow;
  bool created;
  EXPECT_OK(grow.a->CreateTable(AdagradConfig("emb", 4), &created));
  grow.from_a->Start();
  EXPECT(Eventually([&] { return grow.from_a->status().caught_up; }));
  // The re-shard is begun again: the earlier stream's frames are refused and
  // it ends (it never copies into the new attempt's shard).
  const auto again = std::make_shared<Shard>(1, 3);
  grow.b_server->reshard_target().Prepare(again);
  const int64_t id = 3;
  const float grad[4] = {1, 1, 1, 1};
  EXPECT_OK(TableOf(*grow.a, "emb")->Push(&id, grad, 1, 0.1f));
  EXPECT(Eventually([&] { return grow.from_a->status().ended; }));
  EXPECT(grow.from_a->status().error.find("no longer prepares") != std::string::npos);
  EXPECT(TableOf(*again, "emb") == nullptr);
  // A process that prepares nothing takes no range stream.
  grow.b_server->reshard_target().Clear();
  const auto late = grow.Stream(grow.a);
  late->Start();
  EXPECT(Eventually([&] { return late->status().ended; }));
  EXPECT(late->status().error.find("prepares no shard") != std::string::npos);
  late->Stop();
}

DLT_TEST(TestAStandbyAndRangeStreamsEachHaveTheirOwnChangeLog) {
  // A shard with a standby streams a range too: both see every change.
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created));
  pair.Replicate();
  auto target = std::make_shared<Shard>(0, 1);
  DataServerOptions options;
  options.worker_threads = 2;
  DataServer target_server(std::make_shared<Shard>(0, 1), options);
  EXPECT_OK(target_server.Start());
  target_server.reshard_target().Prepare(target);
  ReplicatorOptions r;
  r.range_stream = true;
  r.sync = false;
  Replicator stream(pair.primary, Address(target_server), r);
  stream.Start();
  EXPECT(Eventually([&] { return stream.status().caught_up; }));
  Trainers trainer(Address(*pair.primary_server), "emb", 4, 2);
  EXPECT(Eventually([&] { return trainer.acked.load() >= 100; }));
  EXPECT(trainer.Stop());
  const uint64_t rounds = stream.status().rounds;
  EXPECT(Eventually([&] { return stream.status().rounds >= rounds + 2; }));
  const auto primary_table = TableOf(*pair.primary, "emb");
  EXPECT(SameRows(primary_table.get(), TableOf(*pair.standby, "emb").get()));
  EXPECT(SameRows(primary_table.get(), TableOf(*target, "emb").get()));
  stream.Stop();
  target_server.Stop();
}

// Shard processes on loopback that re-shard from one layout to another as
// a re-shard's coordinator would: prepare, stream, hold writes, drain,
// switch.
// Writes were held: returns once each stream ran two rounds more (the last
// begun after the hold), false past the Eventually bound.
bool RanTwoRoundsMore(const std::vector<std::shared_ptr<Replicator>>& streams) {
  std::vector<uint64_t> rounds;
  for (const auto& stream : streams) rounds.push_back(stream->status().rounds);
  return Eventually([&] {
    for (size_t k = 0; k < streams.size(); ++k) {
      if (streams[k]->status().rounds < rounds[k] + 2) return false;
    }
    return true;
  });
}

struct Processes {
  struct Process {
    std::shared_ptr<Shard> shard;
    std::unique_ptr<DataServer> server;
  };
  std::vector<Process> all;
  uint64_t layout_epoch = 1;

  // A process serving shard `index` of `count` (index == count: none yet).
  size_t Add(uint32_t index, uint32_t count) {
    DataServerOptions options;
    options.worker_threads = 3;
    Process p{std::make_shared<Shard>(index, count), nullptr};
    p.server = std::make_unique<DataServer>(p.shard, options);
    EXPECT_OK(p.server->Start());
    all.push_back(std::move(p));
    return all.size() - 1;
  }
  // Two shards with table "emb" (Adagrad, dim 8), and a process to join them.
  std::array<size_t, 3> TwoAndOneToJoin() {
    const size_t a = Add(0, 2), b = Add(1, 2), c = Add(2, 2);
    bool created;
    for (size_t p : {a, b}) {
      EXPECT_OK(all[p].shard->CreateTable(AdagradConfig("emb", 8), &created));
    }
    return {a, b, c};
  }
  std::string AddressOf(size_t process) const { return Address(*all[process].server); }
  std::vector<std::string> Addresses(const std::vector<size_t>& processes) const {
    std::vector<std::string> out;
    for (size_t p : processes) out.push_back(AddressOf(p));
    return out;
  }
  // Moves from the layout of processes `from` to that of `to` (by index).
  // `after_first_switch`: called once the first process switched, before
  // the others do (writes held throughout).
  void Reshard(const std::vector<size_t>& from, const std::vector<size_t>& to,
               const std::function<void()>& while_streaming = nullptr,
               const std::function<void()>& after_first_switch = nullptr) {
    const auto n = static_cast<uint32_t>(from.size()), count = static_cast<uint32_t>(to.size());
    std::string joined;
    for (size_t j = 0; j < to.size(); ++j) joined += (j ? "," : "") + AddressOf(to[j]);
    for (size_t p = 0; p < all.size(); ++p) {
      const auto at = std::find(to.begin(), to.end(), p);
      const auto index = static_cast<uint32_t>(at - to.begin());  // count: leaves
      all[p].server->reshard_target().Prepare(std::make_shared<Shard>(index, count));
    }
    std::vector<std::shared_ptr<Replicator>> streams;
    for (uint32_t i = 0; i < n; ++i) {
      for (uint32_t j = 0; j < count; ++j) {
        if (std::max(FirstBucket(i, n), FirstBucket(j, count)) >=
            std::min(FirstBucket(i + 1, n), FirstBucket(j + 1, count))) {
          continue;  // no bucket of old shard i is new shard j's
        }
        ReplicatorOptions r;
        r.range_stream = true;
        r.sync = false;
        r.io_timeout_ms = 10000;
        streams.push_back(std::make_shared<Replicator>(all[from[i]].shard, AddressOf(to[j]), r));
        streams.back()->Start();
      }
    }
    EXPECT(Eventually([&] {
      return std::all_of(streams.begin(), streams.end(),
                         [](const auto& s) { return s->status().caught_up; });
    }));
    if (while_streaming) while_streaming();
    for (size_t p : from) EXPECT_OK(all[p].server->HoldWrites(true));
    EXPECT(RanTwoRoundsMore(streams));
    for (const auto& stream : streams) {
      EXPECT(!stream->status().ended);
      stream->Stop();
    }
    ++layout_epoch;
    for (Process& p : all) {
      EXPECT_OK(p.server->SwitchLayout(layout_epoch, joined));
      if (after_first_switch && &p == &all.front()) after_first_switch();
    }
    for (Process& p : all) {
      EXPECT_OK(p.server->HoldWrites(false));
      p.shard->DropPreviousLayout();
    }
  }
  ~Processes() {
    for (Process& p : all) p.server->Stop();
  }
};

bool SameBytes(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// Every row's values, slots and step for ids [0, 5000) of table "emb" (dim
// 8, Adagrad), pulled through a client of `addresses`.
std::vector<float> StateOf(const std::vector<std::string>& addresses) {
  std::vector<int64_t> ids(5000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  std::vector<float> out(ids.size() * StateFloats(8, 8));
  Client client(addresses, ClientOptions{});
  EXPECT_OK(client.PullState("emb", 8, 8, ids.data(), ids.size(), out.data()));
  return out;
}

DLT_TEST(TestAReshardGrowsTwoShardsToThreeAndBackWithEveryRow) {
  Processes cluster;
  const size_t a = cluster.Add(0, 2), b = cluster.Add(1, 2);
  bool created;
  for (size_t p : {a, b}) {
    EXPECT_OK(cluster.all[p].shard->CreateTable(AdagradConfig("emb", 8), &created));
  }
  const std::vector<std::string> two = cluster.Addresses({a, b});
  {
    Trainers trainers(two, "emb", 8, 2);
    EXPECT(Eventually([&] { return trainers.acked.load() >= 40; }));
  }
  const size_t c = cluster.Add(2, 2);  // joins: owns no bucket yet
  std::vector<float> before;
  // A client of the old layout, connected before the switch.
  Client old_client(two, ClientOptions{});
  std::vector<int64_t> ids(64);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  std::vector<float> grads(ids.size() * 8, 0.1f);
  EXPECT_OK(old_client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.1f));
  cluster.Reshard({a, b}, {a, b, c}, [&] {
    // Training goes on while the ranges stream; then it stops for the switch
    // (clients that follow a switch come later).
    Trainers trainers(two, "emb", 8, 2, /*first_seed=*/5);
    EXPECT(Eventually([&] { return trainers.acked.load() >= 40; }));
    EXPECT(trainers.Stop());
    before = StateOf(two);
  });
  const std::vector<std::string> three = cluster.Addresses({a, b, c});
  EXPECT(cluster.all[c].shard->shard_index() == 2 && cluster.all[c].shard->num_shards() == 3);
  EXPECT(cluster.all[b].shard->first_bucket() == FirstBucket(1, 3));
  EXPECT(cluster.all[a].shard->layout_epoch() == 2);
  EXPECT(SameBytes(StateOf(three), before));

  // A shard refuses an id it gave away unapplied, naming the new layout...
  int64_t gone = 0;
  while (BucketOf(gone) < FirstBucket(1, 3) || BucketOf(gone) >= FirstBucket(1, 2)) ++gone;
  const std::vector<float> grad(8, 0.5f);
  const Status moved = PushOnce(three[0], PushId{5, 5}, &gone, grad.data(), 1, 8);
  EXPECT(moved.code() == Code::kAborted);
  EXPECT(moved.message().find("layout epoch 2") != std::string::npos);
  EXPECT(moved.message().find(three[2]) != std::string::npos);
  // ... and the client of the old layout learns it and routes by it.
  EXPECT_OK(old_client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.1f));
  EXPECT(old_client.layout_epoch() == 2 && old_client.num_shards() == 3);

  // Training on the new layout, then back to two shards; process c leaves.
  {
    Trainers trainers(three, "emb", 8, 2, /*first_seed=*/9);
    EXPECT(Eventually([&] { return trainers.acked.load() >= 40; }));
  }
  cluster.Reshard({a, b, c}, {a, b}, [&] { before = StateOf(three); });
  EXPECT(SameBytes(StateOf(two), before));
  EXPECT(cluster.all[c].shard->first_bucket() == cluster.all[c].shard->end_bucket());
  EXPECT(cluster.all[c].shard->Tables().empty());
  EXPECT(cluster.all[a].shard->layout_epoch() == 3);
}

DLT_TEST(TestWritesHeldForASwitchAreRefusedUnappliedAndWaitedFor) {
  Processes cluster;
  const size_t a = cluster.Add(0, 1);
  bool created;
  EXPECT_OK(cluster.all[a].shard->CreateTable(AdagradConfig("emb", 8), &created));
  Trainers trainers(cluster.AddressOf(a), "emb", 8, 2);
  EXPECT(Eventually([&] { return trainers.acked.load() >= 10; }));
  // Held: no write is being applied once HoldWrites returns, and none
  // after; clients wait and send again.
  EXPECT_OK(cluster.all[a].server->HoldWrites(true));
  const auto table = TableOf(*cluster.all[a].shard, "emb");
  const uint64_t pushes = table->pushes();
  const int acked = trainers.acked.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT(table->pushes() == pushes);
  EXPECT(trainers.acked.load() <= acked + 2);  // at most the one each had in flight
  // A refused write says why, and that it was not applied.
  const int64_t id = 1;
  const std::vector<float> grad(8, 0.5f);
  const Status refused = PushOnce(cluster.AddressOf(a), PushId{3, 3}, &id, grad.data(), 1, 8);
  EXPECT(refused.code() == Code::kAborted);
  EXPECT(refused.message().find("not applied") != std::string::npos);
  EXPECT_OK(cluster.all[a].server->HoldWrites(false));
  EXPECT(Eventually([&] { return trainers.acked.load() >= acked + 20; }));
  EXPECT(trainers.Stop());  // none failed: the held pushes went in after
  // No shard prepared: nothing to switch to.
  EXPECT(cluster.all[a].server->SwitchLayout(2, "x").code() == Code::kFailedPrecondition);
}

DLT_TEST(TestAClientWaitsForAShardThatHasNotSwitchedYet) {
  // A switch that reached one process and not yet the others (a slow
  // coordinator, or one that died until the next finishes the re-shard): a
  // client that learned the new layout from the first greets the others
  // at the layout before, and waits for them as for held writes.
  Processes cluster;
  const auto [a, b, c] = cluster.TwoAndOneToJoin();
  const std::vector<std::string> two = cluster.Addresses({a, b});
  Client client(two, ClientOptions{});
  std::vector<int64_t> ids(256);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i * 7919);
  const std::vector<float> grads(ids.size() * 8, 0.1f);
  EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.1f));
  Status pushed = Internal("not pushed");
  std::thread pusher;
  const ServerCounters& counted = cluster.all[c].server->counters();
  cluster.Reshard({a, b}, {a, b, c}, nullptr, [&] {
    const uint64_t hellos = counted.hellos.load();
    pusher = std::thread(
        [&] { pushed = client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.1f); });
    // The client learned the new layout and greeted c, which has not
    // switched yet; it waits meanwhile.
    EXPECT(Eventually([&] { return counted.hellos.load() > hellos; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  pusher.join();
  EXPECT_OK(pushed);
  EXPECT(client.layout_epoch() == 2 && client.num_shards() == 3);
}

// One trainer pushing a deterministic sequence through a client of
// `addresses` until stopped, keeping every push it sent.
struct RecordingTrainer {
  std::atomic<bool> stop{false};
  std::atomic<int> acked{0}, failed{0};
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::vector<float>> grads;
  std::string last_error;
  std::thread thread;

  // `batch` ids a push; `exchange_threads` as ClientOptions' (large pushes
  // on several threads take the client's parallel exchange).
  explicit RecordingTrainer(const std::vector<std::string>& addresses, size_t batch_ids = 256,
                            int exchange_threads = 1) {
    thread = std::thread([this, addresses, batch_ids, exchange_threads] {
      ClientOptions options;
      options.request_timeout_ms = 20000;
      options.exchange_threads = exchange_threads;
      Client client(addresses, options);
      std::mt19937_64 rng(11);
      while (!stop.load()) {
        std::vector<int64_t> batch(batch_ids);
        for (auto& id : batch) id = static_cast<int64_t>(rng() % 5000);
        std::vector<float> g(batch.size() * 8);
        for (auto& x : g) x = static_cast<float>(static_cast<int>(rng() % 200) - 100) / 100.0f;
        const Status s = client.Push("emb", 8, batch.data(), g.data(), batch.size(), 0.05f);
        ids.push_back(std::move(batch));
        grads.push_back(std::move(g));
        if (s.ok()) {
          acked.fetch_add(1);
        } else {
          last_error = s.ToString();
          failed.fetch_add(1);
        }
      }
    });
  }
  void Stop() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
  ~RecordingTrainer() { Stop(); }
  // The state of ids [0, 5000) after every push applied once, in order, to
  // one table.
  std::vector<float> Oracle() const {
    Table table(AdagradConfig("emb", 8));
    for (size_t k = 0; k < ids.size(); ++k) {
      EXPECT_OK(table.Push(ids[k].data(), grads[k].data(), ids[k].size(), 0.05f));
    }
    std::vector<int64_t> all(5000);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    std::vector<float> out(all.size() * StateFloats(8, 8));
    EXPECT_OK(table.Pull(all.data(), all.size(), PullMode::kState, out.data()));
    return out;
  }
};

DLT_TEST(TestATrainerPushesThroughAReshardWithoutAnErrorAndEveryPushOnce) {
  // Its client learns each new layout from the shards (a push refused
  // while writes are held, or by a shard that no longer owns its ids, is
  // sent again, routed anew), so training runs through 2 -> 3 -> 2.
  Processes cluster;
  const auto [a, b, c] = cluster.TwoAndOneToJoin();
  RecordingTrainer trainer(cluster.Addresses({a, b}));
  EXPECT(Eventually([&] { return trainer.acked.load() >= 20; }));
  cluster.Reshard({a, b}, {a, b, c});
  int at = trainer.acked.load();
  EXPECT(Eventually([&] { return trainer.acked.load() >= at + 20; }));
  cluster.Reshard({a, b, c}, {a, b});
  at = trainer.acked.load();
  EXPECT(Eventually([&] { return trainer.acked.load() >= at + 20; }));
  trainer.Stop();
  EXPECT(trainer.failed.load() == 0);
  if (trainer.failed.load() != 0) std::fprintf(stderr, "%s\n", trainer.last_error.c_str());
  EXPECT(SameBytes(StateOf(cluster.Addresses({a, b})), trainer.Oracle()));
}

DLT_TEST(TestLargePushesExchangedOnSeveralThreadsGoThroughAReshard) {
  // Pushes of 2.5 MB to two shards take the client's parallel exchange; the
  // frames refused while writes are held must be found and sent again.
  Processes cluster;
  const auto [a, b, c] = cluster.TwoAndOneToJoin();
  RecordingTrainer trainer(cluster.Addresses({a, b}), /*batch_ids=*/65536, /*exchange_threads=*/4);
  EXPECT(Eventually([&] { return trainer.acked.load() >= 3; }));
  cluster.Reshard({a, b}, {a, b, c});
  const int at = trainer.acked.load();
  EXPECT(Eventually([&] { return trainer.acked.load() >= at + 3; }));
  trainer.Stop();
  EXPECT(trainer.failed.load() == 0);
  if (trainer.failed.load() != 0) std::fprintf(stderr, "%s\n", trainer.last_error.c_str());
  EXPECT(SameBytes(StateOf(cluster.Addresses({a, b, c})), trainer.Oracle()));
}

DLT_TEST(TestAShardThatSwitchedGoesBackWhenAnotherCouldNot) {
  // A re-shard whose switch failed on some process: those that switched
  // serve the layout they came from again, with its rows.
  Processes cluster;
  const auto [a, b, c] = cluster.TwoAndOneToJoin();
  (void)c;
  const std::vector<std::string> two = cluster.Addresses({a, b});
  {
    Trainers trainers(two, "emb", 8, 1);
    EXPECT(Eventually([&] { return trainers.acked.load() >= 20; }));
  }
  const std::vector<float> before = StateOf(two);
  Shard& shard = *cluster.all[a].shard;
  cluster.all[a].server->reshard_target().Prepare(std::make_shared<Shard>(0, 3));
  EXPECT_OK(cluster.all[a].server->SwitchLayout(2, "x,y,z"));
  EXPECT(shard.num_shards() == 3 && shard.layout_epoch() == 2 && shard.Tables().empty());
  // Back, at an epoch newer than the one switched to (clients that learned
  // that one learn this), with the old layout's addresses; the process that
  // did not switch takes the same epoch.
  const std::string old_layout = two[0] + "," + two[1];
  EXPECT(shard.RevertLayout(3, old_layout));
  EXPECT(!cluster.all[b].shard->RevertLayout(3, old_layout));  // nothing to go back to
  for (size_t p : {a, b}) {
    const Shard& s = *cluster.all[p].shard;
    EXPECT(s.num_shards() == 2 && s.layout_epoch() == 3 && s.layout_addresses() == old_layout);
  }
  EXPECT(SameBytes(StateOf(two), before));
}

DLT_TEST(TestAClientOfAnUndoneLayoutLearnsTheOneAfterIt) {
  // A client learned the layout a re-shard switched to, and greeted the
  // processes that switched, before the joining one died and the switch
  // was undone: that one never answers, and the client routes by the
  // layout after it, which the others serve.
  Processes cluster;
  const auto [a, b, c] = cluster.TwoAndOneToJoin();
  const std::vector<std::string> two = cluster.Addresses({a, b});
  const std::vector<std::string> three = cluster.Addresses({a, b, c});
  cluster.all[c].server->Stop();
  for (size_t p : {a, b}) {
    cluster.all[p].server->reshard_target().Prepare(
        std::make_shared<Shard>(static_cast<uint32_t>(p), 3));
    EXPECT_OK(cluster.all[p].server->SwitchLayout(2, three[0] + "," + three[1] + "," + three[2]));
  }
  Client client(two, ClientOptions{});
  std::vector<int64_t> ids(64);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  const std::vector<float> grads(ids.size() * 8, 0.5f);
  const Status met = client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.1f);
  EXPECT(met.code() == Code::kUnavailable);
  EXPECT(client.layout_epoch() == 2 && client.num_shards() == 3);
  const std::string old_layout = two[0] + "," + two[1];
  for (size_t p : {a, b}) EXPECT(cluster.all[p].shard->RevertLayout(3, old_layout));
  EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.1f));
  EXPECT(client.layout_epoch() == 3 && client.num_shards() == 2);
}

DLT_TEST(TestAClientOfAReplacedShardRoutesByTheLayoutThatReplacedIt) {
  // A re-shard of the same count moves shard 2 to another process, and the
  // one it left stops. A client that greeted all three before (idle since)
  // meets the stopped one: the others kept their places, so nothing but
  // their layout epoch tells it the layout changed. It routes by the new
  // one, every push applied once.
  Processes cluster;
  const size_t a = cluster.Add(0, 3), b = cluster.Add(1, 3), c = cluster.Add(2, 3);
  bool created;
  for (size_t p : {a, b, c}) {
    EXPECT_OK(cluster.all[p].shard->CreateTable(AdagradConfig("emb", 8), &created));
  }
  std::vector<int64_t> ids(5000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  const std::vector<float> grads(ids.size() * 8, 0.25f);
  Client client(cluster.Addresses({a, b, c}), ClientOptions{});
  EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.05f));
  const size_t d = cluster.Add(3, 3);  // owns no bucket yet
  cluster.Reshard({a, b, c}, {a, b, d});
  cluster.all[c].server->Stop();
  EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.05f));
  EXPECT(client.layout_epoch() == 2 && client.num_shards() == 3);
  Table oracle(AdagradConfig("emb", 8));
  for (int k = 0; k < 2; ++k) EXPECT_OK(oracle.Push(ids.data(), grads.data(), ids.size(), 0.05f));
  std::vector<float> want(ids.size() * StateFloats(8, 8));
  EXPECT_OK(oracle.Pull(ids.data(), ids.size(), PullMode::kState, want.data()));
  EXPECT(SameBytes(StateOf(cluster.Addresses({a, b, d})), want));
}

DLT_TEST(TestAProcessHoldingNoTableTakesTheLayoutsPlace) {
  // A standby restarted with the flags of the layout before a re-shard.
  Shard restarted(0, 2);
  EXPECT_OK(restarted.TakePlace(1, 3, 2, "a,b,c"));
  EXPECT(restarted.shard_index() == 1 && restarted.num_shards() == 3);
  EXPECT(restarted.first_bucket() == FirstBucket(1, 3) && restarted.layout_epoch() == 2);
  EXPECT(restarted.layout_addresses() == "a,b,c" && !restarted.has_previous_layout());
  EXPECT(restarted.TakePlace(0, 0, 3, "").code() == Code::kInvalidArgument);
  bool created;
  EXPECT_OK(restarted.CreateTable(AdagradConfig("emb", 8), &created));
  const Status held = restarted.TakePlace(0, 2, 3, "a,b");
  EXPECT(held.code() == Code::kFailedPrecondition);
  EXPECT(restarted.shard_index() == 1 && restarted.layout_epoch() == 2);
  // The same place at a newer layout epoch (an undone re-shard's), tables
  // and all.
  EXPECT_OK(restarted.TakePlace(1, 3, 4, "a,b,c"));
  EXPECT(restarted.layout_epoch() == 4 && restarted.Tables().size() == 1);
}

DLT_TEST(TestAStandbyFollowsItsPrimaryThroughASwitchWithoutACopy) {
  // Shard 0 of 1 and its sync standby grow to 2 shards with a process that
  // joins: the standby takes the same range streams as its primary and
  // switches with it, and the primary's replication goes on from the
  // tables it switched to, copying nothing. A switch undone first (another
  // process could not switch) goes back the same way.
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 8), &created));
  pair.Replicate();
  const std::string primary = Address(*pair.primary_server);
  {
    Trainers trainers(primary, "emb", 8, 2);
    EXPECT(Eventually([&] { return trainers.acked.load() >= 20; }));
  }
  EXPECT(Eventually([&] { return pair.replicator->status().caught_up; }));
  const uint64_t copies = pair.replicator->status().tables_copied;
  DataServerOptions options;
  options.worker_threads = 3;
  auto joiner = std::make_shared<Shard>(1, 1);  // owns no bucket yet
  DataServer joiner_server(joiner, options);
  EXPECT_OK(joiner_server.Start());
  DataServer* servers[] = {pair.primary_server.get(), pair.standby_server.get(), &joiner_server};
  const std::string layout =
      primary + "|" + Address(*pair.standby_server) + "," + Address(joiner_server);
  auto switch_to_two = [&](bool undo) {
    for (int k = 0; k < 3; ++k) {
      servers[k]->reshard_target().Prepare(std::make_shared<Shard>(k < 2 ? 0 : 1, 2));
    }
    std::vector<std::shared_ptr<Replicator>> streams;
    for (DataServer* to : servers) {
      ReplicatorOptions r;
      r.range_stream = true;
      r.io_timeout_ms = 10000;
      streams.push_back(std::make_shared<Replicator>(pair.primary, Address(*to), r));
      streams.back()->Start();
    }
    {
      Trainers trainers(primary, "emb", 8, 2, /*first_seed=*/3);
      EXPECT(Eventually([&] {
        return trainers.acked.load() >= 20 &&
               std::all_of(streams.begin(), streams.end(),
                           [](const auto& s) { return s->status().caught_up; });
      }));
    }
    EXPECT_OK(pair.primary_server->HoldWrites(true));
    EXPECT_OK(pair.replicator->Pause(true));
    EXPECT(RanTwoRoundsMore(streams));
    for (const auto& stream : streams) stream->Stop();
    for (DataServer* server : servers) EXPECT_OK(server->SwitchLayout(undo ? 2 : 4, layout));
    if (undo) {
      for (DataServer* server : servers) EXPECT(server->RevertLayout(3, primary));
      for (DataServer* server : servers) server->reshard_target().Clear();
    }
    EXPECT_OK(pair.replicator->Pause(false));
    EXPECT_OK(pair.primary_server->HoldWrites(false));
    for (Shard* shard : {pair.primary.get(), pair.standby.get(), joiner.get()}) {
      shard->DropPreviousLayout();
    }
  };
  auto standby_equals_primary = [&] {
    return Eventually([&] {
      return SameRows(TableOf(*pair.primary, "emb").get(), TableOf(*pair.standby, "emb").get());
    });
  };
  switch_to_two(/*undo=*/true);
  EXPECT(pair.primary->num_shards() == 1 && pair.standby->num_shards() == 1);
  {
    Trainers trainers(primary, "emb", 8, 2, /*first_seed=*/5);
    EXPECT(Eventually([&] { return trainers.acked.load() >= 20; }));
    EXPECT(trainers.Stop());
  }
  EXPECT(standby_equals_primary());
  EXPECT(pair.replicator->status().tables_copied == copies);

  switch_to_two(/*undo=*/false);
  EXPECT(pair.standby->shard_index() == 0 && pair.standby->num_shards() == 2);
  EXPECT(pair.standby->layout_epoch() == 4 && pair.primary->layout_epoch() == 4);
  {
    Trainers trainers(std::vector<std::string>{primary, Address(joiner_server)}, "emb", 8, 2,
                      /*first_seed=*/7);
    EXPECT(Eventually([&] { return trainers.acked.load() >= 20; }));
    EXPECT(trainers.Stop());
  }
  EXPECT(standby_equals_primary());
  EXPECT(pair.replicator->status().tables_copied == copies);
  EXPECT(pair.replicator->status().error.empty());
  joiner_server.Stop();
}

// A primary and several standbys, kept by a ReplicaGroup.
struct Group {
  std::shared_ptr<Shard> primary = std::make_shared<Shard>(0, 1);
  std::vector<std::shared_ptr<Shard>> standbys;
  std::unique_ptr<DataServer> primary_server;
  std::vector<std::unique_ptr<DataServer>> standby_servers;
  std::shared_ptr<ReplicaGroup> group;

  explicit Group(int n, int detach_after_ms = 60000, int write_timeout_ms = 10000,
                 uint64_t standby_buffer_bytes = 0, bool sync = true) {
    DataServerOptions options;
    options.worker_threads = 4;
    primary_server = std::make_unique<DataServer>(primary, options);
    if (standby_buffer_bytes != 0) options.max_buffered_bytes = standby_buffer_bytes;
    EXPECT_OK(primary_server->Start());
    ReplicatorOptions r;
    r.io_timeout_ms = 10000;
    r.connect_timeout_ms = 600000;  // a standby that never answers is not down
    r.write_timeout_ms = write_timeout_ms;
    r.sync = sync;
    group = std::make_shared<ReplicaGroup>(primary, r, detach_after_ms);
    primary_server->set_write_listener(group);
    for (int i = 0; i < n; ++i) {
      standbys.push_back(std::make_shared<Shard>(0, 1));
      standby_servers.push_back(std::make_unique<DataServer>(standbys.back(), options));
      standby_servers.back()->set_standby(true);
      EXPECT_OK(standby_servers.back()->Start());
      EXPECT_OK(group->Attach(Address(*standby_servers.back())));
    }
  }
  std::string Member(int i) const { return Address(*standby_servers[i]); }
  bool AllCaughtUp() const {
    const std::vector<ReplicationStatus> all = group->statuses();
    return std::all_of(all.begin(), all.end(), [](const auto& s) { return s.caught_up; });
  }
  ~Group() {
    primary_server->set_write_listener(nullptr);
    group->Stop();
    primary_server->Stop();
    for (auto& server : standby_servers) server->Stop();
  }
};

DLT_TEST(TestAGroupKeepsEveryStandbyEqualAndTellsEachTheInSyncSet) {
  Group g(2);
  bool created;
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("emb", 8), &created));
  Trainers trainers(Address(*g.primary_server), "emb", 8, 3);
  EXPECT(Eventually([&] { return g.AllCaughtUp() && trainers.acked.load() >= 50; }));
  EXPECT(trainers.Stop());
  for (const auto& standby : g.standbys) {
    EXPECT(SameRows(TableOf(*g.primary, "emb").get(), TableOf(*standby, "emb").get()));
  }
  // Both copied whole: both in the set, which each was told (in attach
  // order), the primary's epoch with it.
  const wire::InSyncView view = g.group->view();
  EXPECT(view.members == g.Member(0) + "|" + g.Member(1));
  EXPECT(view.epoch == g.primary->epoch() && view.version >= 2);
  for (const auto& server : g.standby_servers) {
    EXPECT(Eventually([&] {
      const wire::InSyncView told = server->insync_view();
      return told.version == view.version && told.members == view.members &&
             told.epoch == view.epoch;
    }));
  }
  EXPECT(g.group->addresses() == view.members);
  EXPECT(!g.group->Detach("127.0.0.1:1"));
}

// A caught-up standby drops a table at its round's end: a round that drops
// one and carries nothing else must end too, or the drop's Hold returned
// with the table still on the standby (a takeover then served it again,
// with its old rows). Async groups hold the admin plane's writes as sync
// ones do (Hold returned at once: a load was undone by a takeover).
void TableChangesAreHeldUntilEveryStandbyHasThem(bool sync) {
  Group g(2, 60000, 10000, 0, sync);
  bool created;
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("emb", 8), &created));
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("gone", 8), &created));
  EXPECT(Eventually([&] { return g.AllCaughtUp(); }));
  EXPECT(Eventually([&] { return TableOf(*g.standbys[0], "gone") != nullptr; }));
  for (int i = 0; i < 20; ++i) {
    const std::string name = "gone" + std::to_string(i);
    EXPECT_OK(g.primary->CreateTable(AdagradConfig(name, 8), &created));
    EXPECT_OK(g.group->Hold(10000));
    for (const auto& standby : g.standbys) EXPECT(TableOf(*standby, name) != nullptr);
    EXPECT_OK(g.primary->DropTable(name));
    EXPECT_OK(g.group->Hold(10000));
    for (const auto& standby : g.standbys) EXPECT(TableOf(*standby, name) == nullptr);
  }
  // A standby down: sync, it leaves the in-sync set and the other holds
  // the write; async, Hold says it is not held by every standby (the
  // primary acknowledges it all the same).
  g.standby_servers[1]->Stop();
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("late", 8), &created));
  const Status held = g.group->Hold(2000);
  EXPECT(held.ok() == sync);
  EXPECT(TableOf(*g.standbys[0], "late") != nullptr);
}

DLT_TEST(TestATableDropIsHeldUntilEveryStandbyDroppedIt) {
  TableChangesAreHeldUntilEveryStandbyHasThem(/*sync=*/true);
}

DLT_TEST(TestAnAsyncGroupHoldsTableChangesUntilEveryStandbyHasThem) {
  TableChangesAreHeldUntilEveryStandbyHasThem(/*sync=*/false);
}

DLT_TEST(TestAStandbyThatFailsLeavesTheSetBeforeAWriteIsAcknowledgedWithoutIt) {
  Group g(2);
  bool created;
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("emb", 8), &created));
  Client client({Address(*g.primary_server)}, ClientOptions{});
  const int64_t ids[] = {1, 2, 3};
  const std::vector<float> grads(3 * 8, 0.5f);
  EXPECT_OK(client.Push("emb", 8, ids, grads.data(), 3, 0.1f));
  EXPECT(Eventually([&] { return g.AllCaughtUp(); }));
  const uint64_t both = g.group->view().version;

  // One standby dies: the next write is acknowledged by the other alone,
  // and only once that one was told the set without the dead one.
  g.standby_servers[1]->Stop();
  EXPECT_OK(client.Push("emb", 8, ids, grads.data(), 3, 0.1f));
  const wire::InSyncView view = g.group->view();
  EXPECT(view.members == g.Member(0) && view.version > both);
  const wire::InSyncView told = g.standby_servers[0]->insync_view();
  EXPECT(told.members == g.Member(0) && told.version == view.version);
  EXPECT(SameRows(TableOf(*g.primary, "emb").get(), TableOf(*g.standbys[0], "emb").get()));
  // The dead one's copy stays as it was: it knows no newer set than the
  // one that named both.
  EXPECT(g.standby_servers[1]->insync_view().version <= both);

  // The last one dies too: no write is acknowledged that no standby holds.
  g.standby_servers[0]->Stop();
  ClientOptions brief;
  brief.request_timeout_ms = 2000;  // it sends the push again until then
  Client impatient({Address(*g.primary_server)}, brief);
  EXPECT_ERROR_HAS(impatient.Push("emb", 8, ids, grads.data(), 3, 0.1f),
                   "did not acknowledge it (in doubt)");
  EXPECT(g.group->view().members.empty());
}

DLT_TEST(TestAGroupDetachesAStandbyDownTooLongAndTheHelloForgetsIt) {
  Group g(2, /*detach_after_ms=*/200);
  bool created;
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("emb", 8), &created));
  Client client({Address(*g.primary_server)}, ClientOptions{});
  const int64_t ids[] = {1, 2, 3};
  const std::vector<float> grads(3 * 8, 0.5f);
  EXPECT(Eventually([&] { return g.AllCaughtUp(); }));
  auto hello_standbys = [&] {
    wire::HelloReply reply;
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    int fd = -1;
    EXPECT_OK(net::Connect(Address(*g.primary_server), deadline, &fd));
    EXPECT_OK(net::SayHello(fd, "", wire::kFlagTopology, 1, deadline, &reply));
    net::CloseFd(fd);
    return reply.standbys;
  };
  EXPECT(hello_standbys() == g.Member(0) + "|" + g.Member(1));
  g.standby_servers[1]->Stop();
  // Writes go on (the other holds them); once the dead one was down past
  // the limit, the next write's wait detaches it.
  EXPECT(Eventually([&] {
    EXPECT_OK(client.Push("emb", 8, ids, grads.data(), 3, 0.1f));
    return g.group->addresses() == g.Member(0);
  }));
  EXPECT(hello_standbys() == g.Member(0));
  EXPECT(g.group->view().members == g.Member(0));
  // The last one dies too: no write is acknowledged that no standby holds.
  g.standby_servers[0]->Stop();
  ClientOptions brief;
  brief.request_timeout_ms = 2000;
  Client impatient({Address(*g.primary_server)}, brief);
  EXPECT(!impatient.Push("emb", 8, ids, grads.data(), 3, 0.1f).ok());
}

DLT_TEST(TestAPushPastTheStandbyTimeoutIsSentAgainAndAppliedOnce) {
  // A standby that accepts and never answers (a paused process): a push
  // waits for it past the standby timeout, is answered UNAVAILABLE (in
  // doubt), and its client sends it again under its id until the request
  // deadline; the primary applies it once.
  int listener = -1, port = 0;
  EXPECT_OK(net::Listen("127.0.0.1", 0, 4, &listener, &port));
  Group g(0, /*detach_after_ms=*/60000, /*write_timeout_ms=*/300);
  EXPECT_OK(g.group->Attach("127.0.0.1:" + std::to_string(port)));
  bool created;
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("emb", 8), &created));
  ClientOptions brief;
  brief.request_timeout_ms = 2000;
  brief.connect_timeout_ms = 300;
  Client client({Address(*g.primary_server)}, brief);  // learns the standby: identified pushes
  const int64_t ids[] = {1, 2, 3};
  const std::vector<float> grads(3 * 8, 0.5f);
  const Status doubt = client.Push("emb", 8, ids, grads.data(), 3, 0.1f);
  // The last attempt's answer (in doubt) or the request deadline, which
  // may end that attempt first.
  EXPECT((doubt.code() == Code::kUnavailable &&
          doubt.message().find("did not acknowledge it (in doubt)") != std::string::npos) ||
         doubt.code() == Code::kDeadlineExceeded);
  EXPECT(g.primary_server->counters().repeated_pushes.load() >= 2);
  EXPECT(TableOf(*g.primary, "emb")->pushes() == 1);
  g.group->Stop();
  net::CloseFd(listener);
}

DLT_TEST(TestAStandbyDropsARoundPastItsBufferAndIsCopiedAfresh) {
  // A round larger than the standby may hold until its end is neither held
  // nor applied in part: dropped, and its primary copies every table
  // afresh. The push in it, sent again under its id, is applied once.
  Group g(1, /*detach_after_ms=*/60000, /*write_timeout_ms=*/10000,
          /*standby_buffer_bytes=*/256 << 10);
  bool created;
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("emb", 8), &created));
  // The round that copies the new table has ended (the standby installs it
  // at the end): a push before it would be copied with the table, not sent
  // as one round of changes.
  EXPECT(Eventually([&] { return TableOf(*g.standbys[0], "emb") != nullptr && g.AllCaughtUp(); }));
  const uint64_t copies = g.group->statuses().front().tables_copied;
  Client client({Address(*g.primary_server)}, ClientOptions{});
  std::vector<int64_t> ids(20000);  // rows and slots of 20,000 ids: ~1.4 MB
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  const std::vector<float> grads(ids.size() * 8, 0.5f);
  EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.1f));
  EXPECT(g.standby_servers[0]->counters().standby_rounds_dropped.load() >= 1);
  EXPECT(g.group->statuses().front().tables_copied > copies);
  EXPECT(TableOf(*g.primary, "emb")->pushes() == 1);
  EXPECT(SameRows(TableOf(*g.primary, "emb").get(), TableOf(*g.standbys[0], "emb").get()));
  // Rounds within the buffer are held to their end as before.
  const uint64_t dropped = g.standby_servers[0]->counters().standby_rounds_dropped.load();
  EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), 100, 0.1f));
  EXPECT(SameRows(TableOf(*g.primary, "emb").get(), TableOf(*g.standbys[0], "emb").get()));
  EXPECT(g.standby_servers[0]->counters().standby_rounds_dropped.load() == dropped);
  EXPECT(g.standby_servers[0]->standby_caught_up());
}

DLT_TEST(TestAClientLearnsAStandbyThatAttachedAfterItsHello) {
  // A trainer that lists the primary alone and greeted it before its
  // standby attached learns the standby at its next greeting (a shard is
  // greeted again every regreet_ms), so a takeover would find it.
  Group g(0);
  bool created;
  EXPECT_OK(g.primary->CreateTable(AdagradConfig("emb", 8), &created));
  ClientOptions options;
  options.regreet_ms = 100;
  Client client({Address(*g.primary_server)}, options);
  const int64_t ids[] = {1, 2, 3};
  const std::vector<float> grads(3 * 8, 0.5f);
  EXPECT_OK(client.Push("emb", 8, ids, grads.data(), 3, 0.1f));
  auto replicas = [&] {
    std::vector<ShardInfo> infos;
    EXPECT_OK(client.GetShardInfos(&infos));
    return infos.empty() ? std::string() : infos[0].replicas;
  };
  EXPECT(replicas() == Address(*g.primary_server));
  auto standby = std::make_shared<Shard>(0, 1);
  DataServer standby_server(standby, DataServerOptions{});
  standby_server.set_standby(true);
  EXPECT_OK(standby_server.Start());
  EXPECT_OK(g.group->Attach(Address(standby_server)));
  EXPECT(Eventually([&] {
    EXPECT_OK(client.Push("emb", 8, ids, grads.data(), 3, 0.1f));  // on pooled connections
    return replicas() == Address(*g.primary_server) + "|" + Address(standby_server);
  }));
  g.group->Stop();
  standby_server.Stop();
}

DLT_TEST(TestAMemberInAnotherPlaceDoesNotHideOneThatGreets) {
  // The first address of a shard answers as another shard (a member
  // restarted with stale flags): the next one, which greets in its place,
  // is used; a client with no other address is told what is wrong.
  auto elsewhere = std::make_shared<Shard>(1, 2);
  auto good = std::make_shared<Shard>(0, 1);
  bool created;
  EXPECT_OK(good->CreateTable(AdagradConfig("emb", 8), &created));
  DataServer elsewhere_server(elsewhere, DataServerOptions{});
  DataServer good_server(good, DataServerOptions{});
  EXPECT_OK(elsewhere_server.Start());
  EXPECT_OK(good_server.Start());
  const int64_t ids[] = {1, 2, 3};
  const std::vector<float> grads(3 * 8, 0.5f);
  Client both({Address(elsewhere_server) + "|" + Address(good_server)}, ClientOptions{});
  EXPECT_OK(both.Push("emb", 8, ids, grads.data(), 3, 0.1f));
  EXPECT(TableOf(*good, "emb")->pushes() == 1);
  Client alone({Address(elsewhere_server)}, ClientOptions{});
  const Status refused = alone.Push("emb", 8, ids, grads.data(), 3, 0.1f);
  EXPECT(refused.code() == Code::kFailedPrecondition);
  EXPECT(refused.message().find("shard-index order") != std::string::npos);
  elsewhere_server.Stop();
  good_server.Stop();
}

DLT_TEST(TestAGroupRefusesAStandbyPastItsLimit) {
  std::shared_ptr<Shard> shard = std::make_shared<Shard>(0, 1);
  ReplicaGroup group(shard, ReplicatorOptions{});
  for (size_t i = 0; i < ReplicaGroup::kMaxStandbys; ++i) {
    EXPECT_OK(group.Attach("127.0.0.1:" + std::to_string(1 + i)));  // nobody: they retry
  }
  EXPECT_OK(group.Attach("127.0.0.1:1"));  // attached again: replaces its replicator
  const Status refused = group.Attach("127.0.0.1:99");
  EXPECT(refused.code() == Code::kFailedPrecondition);
  EXPECT(refused.message().find("at most") != std::string::npos);
  EXPECT(group.Detach("127.0.0.1:2"));
  EXPECT_OK(group.Attach("127.0.0.1:99"));
  group.Stop();
}

DLT_TEST(TestATableDroppedWhileTheStandbyWasAwayIsDroppedThereByTheNextCopy) {
  // The primary drops a table while its connection to the standby is lost
  // (a network blip, a standby paused past the I/O timeout). The next
  // connection copies every table the primary holds, and the standby must
  // hold no other: before, it kept the dropped table with its old rows, and
  // served it once it took over (a table dropped and made again came back
  // with those rows).
  Pair pair;
  bool created;
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("emb", 4), &created));
  EXPECT_OK(pair.primary->CreateTable(AdagradConfig("gone", 4), &created));
  const int64_t ids[] = {1, 2, 3};
  const float grads[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_OK(TableOf(*pair.primary, "gone")->Push(ids, grads, 3, 0.1f));
  std::atomic<bool> cut{false};
  Replicator* self = nullptr;
  ReplicatorOptions r;
  r.io_timeout_ms = 10000;
  r.after_take = [&] {
    if (!cut.exchange(false)) return;
    // Dropped here as the connection is lost: the round that would tell
    // the standby fails, and the next connection copies afresh.
    EXPECT_OK(pair.primary->DropTable("gone"));
    self->Reconnect();
  };
  auto replicator = std::make_shared<Replicator>(pair.primary, Address(*pair.standby_server), r);
  self = replicator.get();
  replicator->Start();
  EXPECT(Eventually([&] { return replicator->status().caught_up; }));
  EXPECT(TableOf(*pair.standby, "gone") != nullptr);
  const uint64_t connects = replicator->status().connects;
  cut = true;
  EXPECT(Eventually([&] {
    const ReplicationStatus s = replicator->status();
    return !cut.load() && s.connects > connects && s.caught_up;
  }));
  EXPECT(pair.standby_server->standby_caught_up());
  EXPECT(TableOf(*pair.primary, "gone") == nullptr);
  EXPECT(TableOf(*pair.standby, "emb") != nullptr);
  EXPECT(TableOf(*pair.standby, "gone") == nullptr);
  replicator->Stop();
}

DLT_TEST(TestAStreamWhoseStandbyIsDownKeepsABoundedListOfPushIds) {
  // An async primary whose only standby is down (it is never detached, the
  // last one) goes on acknowledging pushes; its stream takes no round, so
  // the ids End records for it were kept, 16 bytes a push, without bound.
  std::shared_ptr<Shard> shard = std::make_shared<Shard>(0, 1);
  ReplicatorOptions r;
  r.sync = false;
  r.connect_timeout_ms = 50;
  Replicator replicator(shard, "127.0.0.1:1", r);  // nobody listens there
  replicator.Start();
  PushLedger& ledger = shard->push_ledger();
  const size_t pushes = 3 * PushLedger::kCapacity;
  for (size_t i = 0; i < pushes; ++i) {
    const PushId id{7, i};
    Status first;
    EXPECT(ledger.Begin(id, &first));
    ledger.End(id, OkStatus());
  }
  EXPECT(!replicator.status().connected);
  // What its first round would take (it never connects: this test takes it).
  std::vector<PushId> kept;
  {
    std::unique_lock<WriterFirstLock> gate(ledger.gate());
    ledger.TakeApplied(0, &kept);
  }
  EXPECT(kept.size() <= 2 * PushLedger::kCapacity);
  EXPECT(kept.size() >= PushLedger::kCapacity);
  EXPECT(!kept.empty() && kept.back() == (PushId{7, pushes - 1}));
  replicator.Stop();
}

}  // namespace
}  // namespace dlt
