// Tests of the native core with no TF or Python: routing and frame golden
// vectors (shared with the Python suite), table semantics, and a real
// DataServer + Client round trip on loopback. Built with the other files of
// tests/cpp by tests/test_native_cpp.py and run as
//   native_test <tests/data dir> [test name]
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "native/core/dedup.h"
#include "native/core/finite.h"
#include "native/core/initializer.h"
#include "native/core/optimizer.h"
#include "native/core/routing.h"
#include "native/core/shard.h"
#include "native/core/table.h"
#include "native/core/work_queue.h"
#include "native/net/auth_tokens.h"
#include "native/net/client.h"
#include "native/net/data_server.h"
#include "native/net/socket.h"
#include "native/net/transport.h"
#include "native/net/wire.h"
#include "tests/cpp/harness.h"

namespace dlt {
namespace {

std::vector<std::vector<std::string>> ReadRows(const std::string& name) {
  std::ifstream in(testing::g_data_dir + "/" + name);
  std::vector<std::vector<std::string>> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::vector<std::string> row;
    std::string f;
    while (fields >> f) row.push_back(f);
    rows.push_back(row);
  }
  return rows;
}

std::string Hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string Frame(wire::Opcode op, uint16_t flags, uint64_t id, const std::string& payload) {
  uint8_t header[wire::kHeaderBytes];
  wire::EncodeHeader({op, flags, id, static_cast<uint32_t>(payload.size())}, header);
  return std::string(reinterpret_cast<char*>(header), sizeof(header)) + payload;
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

TableConfig Config(const std::string& name, uint32_t dim, OptimizerKind opt) {
  TableConfig c;
  c.name = name;
  c.dim = dim;
  c.seed = 7;
  c.initializer.kind = InitializerKind::kUniform;
  c.optimizer.kind = opt;
  return c;
}

DLT_TEST(TestRoutingGolden) {
  const auto rows = ReadRows("routing_golden.txt");
  EXPECT(rows.size() >= 30);
  for (const auto& r : rows) {
    const int64_t id = std::stoll(r[0]);
    const uint64_t mix = std::stoull(r[1], nullptr, 16);
    EXPECT(Mix64(static_cast<uint64_t>(id)) == mix);
    EXPECT(BucketOf(id) == std::stoul(r[2]));
    const uint32_t counts[] = {1, 2, 3, 7};
    for (int k = 0; k < 4; ++k) EXPECT(ShardOf(id, counts[k]) == std::stoul(r[3 + k]));
  }
}

DLT_TEST(TestBucketRanges) {
  for (uint32_t n : {1u, 2u, 3u, 7u, 100u, 4096u}) {
    for (uint32_t b = 0; b < kNumBuckets; ++b) {
      const uint32_t s = ShardOfBucket(b, n);
      EXPECT(FirstBucket(s, n) <= b && b < FirstBucket(s + 1, n));
    }
    EXPECT(FirstBucket(0, n) == 0 && FirstBucket(n, n) == kNumBuckets);
  }
}

DLT_TEST(TestFramesGolden) {
  std::map<std::string, std::string> golden;
  for (const auto& r : ReadRows("frames_golden.txt")) golden[r[0]] = r[1];
  EXPECT(golden.size() == 13);
  wire::HelloRequest hello;
  hello.token = "secret";
  EXPECT(Hex(Frame(wire::Opcode::kHello, 0, 1, wire::EncodeHelloRequest(hello))) ==
         golden["hello_request"]);
  wire::HelloReply reply;
  reply.shard_index = 1;
  reply.num_shards = 3;
  reply.num_buckets = 4096;
  reply.admin_port = 7001;
  reply.max_frame_bytes = 64u << 20;
  EXPECT(Hex(Frame(wire::Opcode::kHello, 1, 1, wire::EncodeHelloReply(reply))) ==
         golden["hello_reply"]);
  const std::vector<int64_t> ids = {1, -1, INT64_MAX};
  EXPECT(Hex(Frame(wire::Opcode::kPull, 0, 2,
                   wire::EncodePullPrefix("emb", 4, 3, PullMode::kInsert) + Bytes(ids))) ==
         golden["pull_request"]);
  EXPECT(Hex(Frame(wire::Opcode::kPull, 0, 5,
                   wire::EncodePullPrefix("emb", 4, 1, PullMode::kZerosNoInsert) +
                       Bytes(std::vector<int64_t>{INT64_MIN}))) ==
         golden["pull_request_infer_zeros"]);
  uint8_t prefix[8];
  wire::EncodePullReplyPrefix(2, 2, prefix);
  EXPECT(Hex(Frame(wire::Opcode::kPull, 1, 2,
                   std::string(reinterpret_cast<char*>(prefix), 8) +
                       Bytes(std::vector<float>{0.5f, -1.0f, 2.0f, 0.25f}))) ==
         golden["pull_reply"]);
  EXPECT(Hex(Frame(
             wire::Opcode::kPush, 0, 3,
             wire::EncodePushPrefix("ctr/user1", 2, 2, 0.01f) + Bytes(std::vector<int64_t>{7, -7}) +
                 Bytes(std::vector<float>{0.5f, -0.5f, 1.0f, 2.0f}))) == golden["push_request"]);
  EXPECT(Hex(Frame(wire::Opcode::kAssign, 0, 6,
                   wire::EncodeAssignPrefix("emb", 2, 1) + Bytes(std::vector<int64_t>{5}) +
                       Bytes(std::vector<float>{1.5f, -2.0f}))) == golden["assign_request"]);
  EXPECT(Hex(Frame(wire::Opcode::kPush, 1, 3, wire::EncodePushReply(2))) == golden["push_reply"]);
  {  // a push with an id, applied once however often it is sent
    const PushId id{42, 7};
    const std::string frame =
        Frame(wire::Opcode::kPush, 0, 8,
              wire::EncodePushPrefix("emb", 2, 1, 0.5f, &id) + Bytes(std::vector<int64_t>{5}) +
                  Bytes(std::vector<float>{1.0f, -1.0f}));
    EXPECT(Hex(frame) == golden["push_request_identified"]);
    wire::TableRequest back;
    EXPECT_OK(
        wire::DecodePushRequest(reinterpret_cast<const uint8_t*>(frame.data()) + wire::kHeaderBytes,
                                frame.size() - wire::kHeaderBytes, &back));
    EXPECT(back.identified && back.push_id == id && back.num_ids == 1 && back.ids[0] == 5);
    EXPECT(back.grads[1] == -1.0f);
  }
  {  // a primary's rows for its standby (docs/replication.md)
    const int64_t row_ids[] = {5}, removed[] = {7};
    const uint32_t steps[] = {3}, touched[] = {9};
    const float values[] = {1.5f, -2.0f}, slots[] = {0.25f, 0.5f};
    wire::ReplicateRequest r;
    r.table = "emb";
    r.dim = 2;
    r.rows = 1;
    r.removed = 1;
    r.slot_floats = 2;
    r.push_clock = 42;
    r.ids = row_ids;
    r.removed_ids = removed;
    r.steps = steps;
    r.touched = touched;
    r.values = values;
    r.slots = slots;
    std::string payload(wire::ReplicateBytes(3, 2, 1, 1, 2), '\0');
    wire::EncodeReplicate(r, reinterpret_cast<uint8_t*>(&payload[0]));
    EXPECT(Hex(Frame(wire::Opcode::kReplicate, 0, 7, payload)) == golden["replicate_request"]);
    wire::ReplicateRequest back;
    EXPECT_OK(wire::DecodeReplicate(reinterpret_cast<const uint8_t*>(payload.data()),
                                    payload.size(), &back));
    EXPECT(back.table == "emb" && back.rows == 1 && back.removed == 1 && back.push_clock == 42);
    EXPECT(back.ids[0] == 5 && back.removed_ids[0] == 7 && back.steps[0] == 3);
    EXPECT(back.touched[0] == 9 && back.values[1] == -2.0f && back.slots[1] == 0.5f);
    // Counts that do not match the payload are refused, never read past it.
    EXPECT(wire::DecodeReplicate(reinterpret_cast<const uint8_t*>(payload.data()),
                                 payload.size() - 4, &back)
               .code() == Code::kInvalidArgument);
  }
  {
    // A table's admission sketch on the stream: two slices of 2 counters,
    // then two counted hashes.
    const uint32_t buckets[] = {10, 11}, added[] = {5, 0};
    const uint8_t counters[] = {1, 2, 3, 4};
    wire::StandbyTableRequest slices{
        wire::kSketchSlices, wire::EncodeSketchSlices("emb", 2, buckets, added, counters, 2)};
    EXPECT(Hex(Frame(wire::Opcode::kStandbyTable, 0, 9, wire::EncodeStandbyTable(slices))) ==
           golden["standby_sketch_slices"]);
    const uint64_t hashes[] = {0x0123456789abcdefu, 42};
    wire::StandbyTableRequest counts{wire::kSketchCounts,
                                     wire::EncodeSketchCounts("emb", hashes, 2)};
    EXPECT(Hex(Frame(wire::Opcode::kStandbyTable, 0, 10, wire::EncodeStandbyTable(counts))) ==
           golden["standby_sketch_counts"]);
    wire::SketchRequest back;
    EXPECT_OK(wire::DecodeSketch(wire::kSketchSlices, slices.config, &back));
    EXPECT(back.table == "emb" && back.slice_counters == 2 && back.slices == 2);
    EXPECT(back.counters[3] == 4 && back.entries[8] == 11);
    EXPECT_OK(wire::DecodeSketch(wire::kSketchCounts, counts.config, &back));
    EXPECT(back.num_hashes == 2 && back.hashes[8] == 42);
    // Counts that do not match the bytes are refused, never read past them.
    EXPECT(wire::DecodeSketch(wire::kSketchSlices, slices.config.substr(0, 20), &back).code() ==
           Code::kInvalidArgument);
    EXPECT(wire::DecodeSketch(wire::kSketchCounts, counts.config.substr(0, 12), &back).code() ==
           Code::kInvalidArgument);
    EXPECT(
        wire::DecodeSketch(wire::kSketchCounts, std::string("\xff\xff\0\0emb", 7), &back).code() ==
        Code::kInvalidArgument);
  }
  EXPECT(Hex(Frame(wire::Opcode::kError, 1, 4,
                   wire::EncodeError(Code::kNotFound, "no table 'x'"))) == golden["error"]);
  // A long message is cut so the Error frame fits the smallest maximum
  // frame a server may announce.
  EXPECT(wire::EncodeError(Code::kInternal, std::string(10000, 'x')).size() ==
         wire::kMinMaxFrameBytes);

  // Decoding the golden push request gives back its fields.
  std::string raw;
  const std::string& hex = golden["push_request"];
  for (size_t i = 0; i < hex.size(); i += 2)
    raw.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  wire::FrameHeader h;
  EXPECT_OK(wire::DecodeHeader(reinterpret_cast<const uint8_t*>(raw.data()), 1 << 20, &h));
  EXPECT(h.opcode == wire::Opcode::kPush && h.request_id == 3);
  std::string payload = raw.substr(wire::kHeaderBytes);
  std::vector<uint64_t> aligned((payload.size() + 7) / 8);
  std::memcpy(aligned.data(), payload.data(), payload.size());
  wire::TableRequest req;
  EXPECT_OK(wire::DecodePushRequest(reinterpret_cast<const uint8_t*>(aligned.data()),
                                    payload.size(), &req));
  EXPECT(req.table == "ctr/user1" && req.dim == 2 && req.num_ids == 2);
  EXPECT(req.ids[1] == -7 && req.grads[3] == 2.0f && req.learning_rate == 0.01f);
  // A header whose payload exceeds the limit is RESOURCE_EXHAUSTED.
  EXPECT(wire::DecodeHeader(reinterpret_cast<const uint8_t*>(raw.data()), 16, &h).code() ==
         Code::kResourceExhausted);
}

// One Deduper across runs of different sizes, as a thread's lookups use it:
// each run sees only its own ids (a new stamp empties the table untouched).
DLT_TEST(TestAHelloReplyCarriesItsLineageAndSkipsLaterParts) {
  wire::HelloReply reply;
  reply.num_shards = 2;
  reply.epoch = 3;
  reply.standbys = "b:1|c:2";
  reply.layout_epoch = 4;
  reply.layout = "a:1,d:3";
  reply.lineage = 0x1234567890abcdefULL;
  reply.max_frame_bytes = 1 << 20;
  const std::string bytes = wire::EncodeHelloReply(reply, /*topology=*/true);
  const auto decode = [](const std::string& b, wire::HelloReply* r) {
    return wire::DecodeHelloReply(reinterpret_cast<const uint8_t*>(b.data()), b.size(), r, true);
  };
  wire::HelloReply got;
  EXPECT_OK(decode(bytes, &got));
  EXPECT(got.epoch == 3 && got.standbys == "b:1|c:2" && got.layout_epoch == 4 &&
         got.layout == "a:1,d:3" && got.lineage == reply.lineage);
  // A server that predates the lineage: 0.
  EXPECT_OK(decode(bytes.substr(0, bytes.size() - 8), &got));
  EXPECT(got.layout == "a:1,d:3" && got.lineage == 0);
  // Parts of later servers after it are skipped; a part of a lineage is not.
  EXPECT_OK(decode(bytes + std::string(16, 'x'), &got));
  EXPECT(got.layout == "a:1,d:3" && got.lineage == reply.lineage);
  EXPECT(decode(bytes.substr(0, bytes.size() - 3), &got).code() == Code::kInternal);
  // A largest frame no shard has (a rogue server's 0 split calls into
  // empty frames).
  reply.max_frame_bytes = 0;
  EXPECT_ERROR_HAS(decode(wire::EncodeHelloReply(reply, true), &got), "largest frame of 0 bytes");
}

DLT_TEST(TestDeduperRunsAreIndependent) {
  dlt::Deduper dedup;
  std::vector<int64_t> unique, slot;
  std::mt19937_64 rng(5);
  for (int64_t n : {1000, 3, 0, 5000, 17, 1000}) {
    std::vector<int64_t> ids(static_cast<size_t>(n));
    for (int64_t& id : ids) id = static_cast<int64_t>(rng() % 700) - 350;
    dedup.Run(ids.data(), n, &unique, &slot);
    std::map<int64_t, int64_t> first;  // id -> index in unique
    for (size_t i = 0; i < ids.size(); ++i) {
      auto [it, added] = first.emplace(ids[i], static_cast<int64_t>(first.size()));
      EXPECT(slot[i] == it->second);
      if (added) EXPECT(unique[static_cast<size_t>(it->second)] == ids[i]);
    }
    EXPECT(unique.size() == first.size());
    for (int64_t id = -400; id < 400; ++id) {
      auto it = first.find(id);
      EXPECT(dedup.Find(id) == (it == first.end() ? -1 : it->second));
    }
  }
}

// A thread keeps one scratch per call site for batches up to kKeepScratchIds;
// a larger batch gets the caller's own, so its storage is freed with the call.
struct SiteAScratch {
  std::vector<int64_t> unique;
};
struct SiteBScratch {
  std::vector<int64_t> unique;
};
DLT_TEST(TestThreadScratchKeepsOnlyBoundedBatches) {
  SiteAScratch own_a, other_a;
  SiteAScratch& small = ThreadScratch(kKeepScratchIds, own_a);
  EXPECT(&small != &own_a);
  EXPECT(&ThreadScratch(1, other_a) == &small);  // kept across calls
  EXPECT(&ThreadScratch(kKeepScratchIds + 1, own_a) == &own_a);
  SiteBScratch own_b;
  EXPECT(static_cast<void*>(&ThreadScratch(1, own_b)) != static_cast<void*>(&small));
  SiteAScratch* elsewhere = nullptr;
  std::thread([&] {
    SiteAScratch own;
    elsewhere = &ThreadScratch(1, own);
  }).join();
  EXPECT(elsewhere != &small);  // each thread has its own
}

DLT_TEST(TestInitializerIsPureFunctionOfSeedAndId) {
  TableConfig c = Config("t", 16, OptimizerKind::kSgd);
  for (auto kind :
       {InitializerKind::kUniform, InitializerKind::kNormal, InitializerKind::kTruncatedNormal}) {
    c.initializer.kind = kind;
    Table a(c), b(c);
    std::vector<int64_t> ids = {5, 1, INT64_MIN, 99};
    std::vector<int64_t> reversed(ids.rbegin(), ids.rend());
    std::vector<float> ra(ids.size() * 16), rb(ids.size() * 16);
    EXPECT_OK(a.Pull(ids.data(), ids.size(), PullMode::kInsert, ra.data()));
    EXPECT_OK(b.Pull(reversed.data(), reversed.size(), PullMode::kInsert, rb.data()));
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT(std::memcmp(&ra[i * 16], &rb[(ids.size() - 1 - i) * 16], 64) == 0);
    }
    std::vector<float> direct(16);
    InitializeRow(c.initializer, c.seed, 5, 16, direct.data());
    EXPECT(std::memcmp(direct.data(), ra.data(), 64) == 0);
  }
}

DLT_TEST(TestTablePullModesAndPush) {
  Table t(Config("t", 4, OptimizerKind::kSgd));
  const std::vector<int64_t> ids = {10, 20, 10};
  std::vector<float> out(12);
  EXPECT_OK(t.Pull(ids.data(), 3, PullMode::kZerosNoInsert, out.data()));
  EXPECT(t.size() == 0 && out[0] == 0.0f);
  EXPECT_OK(t.Pull(ids.data(), 3, PullMode::kInitNoInsert, out.data()));
  EXPECT(t.size() == 0 && out[0] != 0.0f);
  std::vector<float> init(out);
  EXPECT_OK(t.Pull(ids.data(), 3, PullMode::kInsert, out.data()));
  EXPECT(t.size() == 2 && out == init);
  const std::vector<float> grads = {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  EXPECT_OK(t.Push(ids.data(), grads.data(), 3, 0.5f));
  EXPECT_OK(t.Pull(ids.data(), 3, PullMode::kInsert, out.data()));
  // id 10 appears twice: its gradients are summed (1 + 3) before the update.
  EXPECT(std::fabs(out[0] - (init[0] - 0.5f * 4)) < 1e-6f);
  EXPECT(std::fabs(out[4] - (init[4] - 0.5f * 2)) < 1e-6f);
  std::vector<float> bad = grads;
  bad[5] = NAN;
  EXPECT(t.Push(ids.data(), bad.data(), 3, 0.5f).code() == Code::kInvalidArgument);
  std::vector<float> after(12);
  EXPECT_OK(t.Pull(ids.data(), 3, PullMode::kInsert, after.data()));
  EXPECT(after == out);  // nothing applied
}

DLT_TEST(TestAPushSumsRepeatedIdsAndAppliesTheOthersAsSent) {
  // Keras Adagrad, whose update takes each occurrence's square: a repeated
  // id's gradients and their squares are summed in the push's order, an id
  // pushed once applies its gradient as sent; bitwise what ApplyRow makes.
  const uint32_t dim = 16;
  const TableConfig config = Config("t", dim, OptimizerKind::kKerasAdagrad);
  Table t(config);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const size_t n = 20000;
  std::vector<int64_t> ids(n);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % 15000);  // about half repeated
  std::vector<float> grads(n * dim);
  for (float& g : grads) g = uniform(rng);
  std::vector<int64_t> distinct(ids);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  const size_t width = StateFloats(dim, t.slot_floats());
  std::vector<float> made(distinct.size() * dim), state(distinct.size() * width);
  EXPECT_OK(t.Pull(distinct.data(), distinct.size(), PullMode::kInsert, made.data()));
  EXPECT_OK(t.Pull(distinct.data(), distinct.size(), PullMode::kState, state.data()));
  std::map<int64_t, size_t> at;
  for (size_t a = 0; a < distinct.size(); ++a) at[distinct[a]] = a;
  std::vector<float> sums(distinct.size() * dim, 0.0f), squares(sums.size(), 0.0f);
  std::vector<size_t> occurrences(distinct.size(), 0), first(distinct.size(), 0);
  for (size_t k = 0; k < n; ++k) {
    const size_t a = at[ids[k]];
    if (occurrences[a]++ == 0) first[a] = k;
    for (uint32_t j = 0; j < dim; ++j) {
      sums[a * dim + j] += grads[k * dim + j];
      squares[a * dim + j] += grads[k * dim + j] * grads[k * dim + j];
    }
  }
  size_t repeated = 0;
  std::vector<float> expected(state);
  for (size_t a = 0; a < distinct.size(); ++a) {
    float* row = &expected[a * width];
    uint32_t step = StepOfState(row, width);
    const bool once = occurrences[a] == 1;
    repeated += once ? 0 : 1;
    EXPECT(ApplyRow(config.optimizer, dim, 0.1f, once ? &grads[first[a] * dim] : &sums[a * dim],
                    once ? nullptr : &squares[a * dim], row, row + dim, &step));
    std::memcpy(row + width - 1, &step, sizeof(step));
  }
  EXPECT(repeated > distinct.size() / 4 && repeated < distinct.size() * 3 / 4);
  EXPECT_OK(t.Push(ids.data(), grads.data(), n, 0.1f));
  std::vector<float> after(state.size());
  EXPECT_OK(t.Pull(distinct.data(), distinct.size(), PullMode::kState, after.data()));
  EXPECT(std::memcmp(after.data(), expected.data(), sizeof(float) * after.size()) == 0);
}

DLT_TEST(TestTableGrowthAndExport) {
  Table t(Config("t", 3, OptimizerKind::kAdagrad));
  const size_t n = 200000;
  std::vector<int64_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(i * 2654435761ULL) - 7;
  std::vector<float> out(n * 3);
  EXPECT_OK(t.Pull(ids.data(), n, PullMode::kInsert, out.data()));
  EXPECT(t.size() == n);
  EXPECT(t.bytes() >= n * t.record_bytes());
  std::vector<float> again(n * 3);
  EXPECT_OK(t.Pull(ids.data(), n, PullMode::kInsert, again.data()));
  EXPECT(again == out);
  Table::Exporter ex(&t);
  std::vector<int64_t> eids(1000);
  std::vector<float> vals(3000), slots(3000);
  std::vector<uint32_t> steps(1000), buckets(1000);
  RowBuffers b{eids.data(), vals.data(), slots.data(), steps.data(), buckets.data()};
  size_t total = 0, got;
  uint32_t last_bucket = 0;
  bool sorted = true;
  while ((got = ex.Next(1000, b)) > 0) {
    for (size_t i = 0; i < got; ++i) {
      sorted = sorted && buckets[i] >= last_bucket && buckets[i] == BucketOf(eids[i]);
      last_bucket = buckets[i];
      sorted = sorted && slots[i * 3] == 0.1f;
    }
    total += got;
  }
  EXPECT(sorted);
  EXPECT(total == n);
}

DLT_TEST(TestShardConfigConflicts) {
  Shard shard(0, 1);
  bool created = false;
  EXPECT_OK(shard.CreateTable(Config("a", 4, OptimizerKind::kSgd), &created));
  EXPECT(created);
  EXPECT_OK(shard.CreateTable(Config("a", 4, OptimizerKind::kSgd), &created));
  EXPECT(!created);
  EXPECT(shard.CreateTable(Config("a", 8, OptimizerKind::kSgd), &created).code() ==
         Code::kAlreadyExists);
  EXPECT(shard.CreateTable(Config("bad name!", 8, OptimizerKind::kSgd), &created).code() ==
         Code::kInvalidArgument);
  std::shared_ptr<Table> t;
  EXPECT(shard.GetTable("zzz", &t).code() == Code::kNotFound);
}

// Keras's SGD momentum (and Nesterov) and decoupled weight decay, by hand:
// w = 1, v = 0.5, g = 2, lr = 0.1, momentum 0.9, weight_decay 0.5.
DLT_TEST(TestMomentumNesterovAndWeightDecayFollowKeras) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kMomentum;
  c.momentum = 0.9f;
  c.weight_decay = 0.5f;
  for (float nesterov : {0.0f, 1.0f}) {
    c.nesterov = nesterov;
    float w = 1.0f, v = 0.5f, g = 2.0f;
    uint32_t step = 0;
    EXPECT(ApplyRow(c, 1, 0.1f, &g, nullptr, &w, &v, &step));
    const float decayed = 1.0f - 1.0f * 0.5f * 0.1f;   // 0.95
    const float velocity = 0.5f * 0.9f - 2.0f * 0.1f;  // 0.25
    const float want = nesterov != 0 ? decayed + velocity * 0.9f - 2.0f * 0.1f : decayed + velocity;
    EXPECT(std::fabs(v - velocity) < 1e-6f);
    EXPECT(std::fabs(w - want) < 1e-6f);
    EXPECT(step == 1);
  }
  TableConfig bad = Config("m", 4, OptimizerKind::kMomentum);
  bad.optimizer.momentum = 1.5f;
  EXPECT(ValidateTableConfig(bad).code() == Code::kInvalidArgument);
  bad.optimizer.momentum = 0.5f;
  bad.optimizer.weight_decay = -1.0f;
  EXPECT(ValidateTableConfig(bad).code() == Code::kInvalidArgument);
}

// A table made before its optimizer was known is settled once: replaced,
// rows kept, while no push trained it; a trained one is refused.
DLT_TEST(TestAProvisionalTableIsSettledOnceWhileUntrained) {
  Shard shard(0, 1);
  bool created = false;
  EXPECT_OK(shard.CreateTable(Config("p", 4, OptimizerKind::kSgd), &created, true));
  std::shared_ptr<Table> t;
  EXPECT_OK(shard.GetTable("p", &t));
  std::vector<int64_t> ids = {1, 2, 3};
  std::vector<float> ones(12, 1.0f), out(12);
  EXPECT_OK(t->Assign(ids.data(), ones.data(), ids.size()));
  // A provisional request with another optimizer takes the table as it is.
  EXPECT_OK(shard.CreateTable(Config("p", 4, OptimizerKind::kAdam), &created, true));
  EXPECT(!created);
  EXPECT_OK(shard.CreateTable(Config("p", 4, OptimizerKind::kAdagrad), &created));
  EXPECT(created);
  EXPECT_OK(shard.GetTable("p", &t));
  EXPECT(t->config().optimizer.kind == OptimizerKind::kAdagrad && !t->provisional());
  EXPECT(t->size() == 3);
  EXPECT_OK(t->Pull(ids.data(), ids.size(), PullMode::kZerosNoInsert, out.data()));
  EXPECT(out == ones);
  // Settled: another optimizer is refused now, the same one is a no-op.
  EXPECT(shard.CreateTable(Config("p", 4, OptimizerKind::kAdam), &created).code() ==
         Code::kAlreadyExists);
  EXPECT_OK(shard.CreateTable(Config("p", 4, OptimizerKind::kAdagrad), &created));
  EXPECT(!created);
  // A provisional table that a push trained keeps its optimizer.
  EXPECT_OK(shard.CreateTable(Config("q", 4, OptimizerKind::kSgd), &created, true));
  EXPECT_OK(shard.GetTable("q", &t));
  EXPECT_OK(t->Push(ids.data(), ones.data(), ids.size(), 0.1f));
  Status refused = shard.CreateTable(Config("q", 4, OptimizerKind::kAdam), &created);
  EXPECT(refused.code() == Code::kAlreadyExists);
  EXPECT(refused.message().find("was trained") != std::string::npos);
}

DLT_TEST(TestClientServerRoundTrip) {
  auto shard = std::make_shared<Shard>(0, 1);
  bool created;
  EXPECT_OK(shard->CreateTable(Config("emb", 8, OptimizerKind::kSgd), &created));
  DataServerOptions o;
  o.bind = "127.0.0.1";
  o.auth_token = "tok";
  o.max_frame_bytes = 4096;  // forces the client to split batches
  DataServer server(shard, o);
  EXPECT_OK(server.Start());
  const std::string address = "127.0.0.1:" + std::to_string(server.port());
  ClientOptions co;
  co.auth_token = "tok";
  Client client({address}, co);
  std::vector<int64_t> ids(1000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i) * 31 - 500;
  std::vector<float> remote(ids.size() * 8), local(ids.size() * 8);
  EXPECT_OK(client.Pull("emb", 8, ids.data(), ids.size(), PullMode::kInsert, remote.data()));
  std::shared_ptr<Table> t;
  EXPECT_OK(shard->GetTable("emb", &t));
  EXPECT_OK(t->Pull(ids.data(), ids.size(), PullMode::kInsert, local.data()));
  EXPECT(remote == local);
  std::vector<float> grads(ids.size() * 8, 1.0f);
  EXPECT_OK(client.Push("emb", 8, ids.data(), grads.data(), ids.size(), 0.25f));
  EXPECT_OK(client.Pull("emb", 8, ids.data(), ids.size(), PullMode::kInsert, remote.data()));
  EXPECT(std::fabs(remote[0] - (local[0] - 0.25f)) < 1e-6f);
  EXPECT(server.counters().pulls.load() > 2);  // split into several frames

  Status s = client.Pull("nope", 8, ids.data(), 4, PullMode::kInsert, remote.data());
  EXPECT(s.code() == Code::kNotFound);
  EXPECT(s.message().find("shard 0 (" + address + ") Pull") != std::string::npos);
  s = client.Pull("emb", 4, ids.data(), 4, PullMode::kInsert, remote.data());
  EXPECT(s.code() == Code::kInvalidArgument);

  ClientOptions wrong;
  wrong.auth_token = "nope";
  Client intruder({address}, wrong);
  EXPECT(intruder.Pull("emb", 8, ids.data(), 4, PullMode::kInsert, remote.data()).code() ==
         Code::kUnauthenticated);
  server.Stop();
  ClientOptions quick;
  quick.connect_timeout_ms = 1000;
  Client late({address}, quick);
  EXPECT(late.Pull("emb", 8, ids.data(), 4, PullMode::kInsert, remote.data()).code() ==
         Code::kUnavailable);
}

DLT_TEST(TestStalledServerHitsDeadline) {
  int fd = -1, port = 0;
  EXPECT_OK(net::Listen("127.0.0.1", 0, 4, &fd, &port));  // accepts, never answers
  ClientOptions o;
  o.connect_timeout_ms = 300;
  o.request_timeout_ms = 300;
  Client client({"127.0.0.1:" + std::to_string(port)}, o);
  std::vector<int64_t> ids = {1};
  std::vector<float> out(4);
  const Status s = client.Pull("emb", 4, ids.data(), 1, PullMode::kInsert, out.data());
  EXPECT(s.code() == Code::kUnavailable);  // Hello never answered: unreachable shard
  EXPECT(s.message().find("shard 0 (127.0.0.1:") != std::string::npos);
  net::CloseFd(fd);
}

int ThreadCount() {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  while (struct dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

// A closure that drops the last reference to the queue's owner destroys the
// queue on one of its own workers. That worker used to go back to the freed
// queue's mutex when the closure returned: a use-after-free that left the
// thread blocked on freed memory for good. Now it exits.
DLT_TEST(TestWorkQueueDestroyedByItsOwnTask) {
  const int threads_before = ThreadCount();
  for (int round = 0; round < 20; ++round) {
    auto* queue = new WorkQueue(2);
    std::atomic<bool> deleted{false};
    queue->Schedule([&] {
      delete queue;
      deleted.store(true);
    });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!deleted.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT(deleted.load());
  }
  // Every detached worker returns through its loop and exits.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (ThreadCount() > threads_before && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT(ThreadCount() == threads_before);
  std::atomic<int> ran{0};
  {
    WorkQueue queue(3);
    for (int i = 0; i < 100; ++i) queue.Schedule([&] { ran.fetch_add(1); });
  }  // drains
  EXPECT(ran.load() == 100);
}

// dim 2^31-2 makes a Push row 2^33 bytes; times 2^31 ids that is 2^64,
// which wrapped to 0 and let a payload of just the fixed part through.
DLT_TEST(TestDecoderRejectsSizesThatWouldWrap) {
  const uint32_t dim = (1u << 31) - 2, ids = 1u << 31;
  const std::string push = wire::EncodePushPrefix("emb", dim, ids, 0.5f);
  wire::TableRequest r;
  Status s =
      wire::DecodePushRequest(reinterpret_cast<const uint8_t*>(push.data()), push.size(), &r);
  EXPECT(s.code() == Code::kInvalidArgument);
  EXPECT(s.message().find("exceeds the maximum of 65536") != std::string::npos);
  const std::string assign = wire::EncodeAssignPrefix("emb", dim, ids);
  EXPECT(
      wire::DecodeAssignRequest(reinterpret_cast<const uint8_t*>(assign.data()), assign.size(), &r)
          .code() == Code::kInvalidArgument);
  // The largest dim still decodes when the payload holds what it says.
  std::string ok = wire::EncodePushPrefix("emb", kMaxDim, 1, 0.5f);
  ok.append(8 + 4 * size_t{kMaxDim}, '\0');
  EXPECT_OK(wire::DecodePushRequest(reinterpret_cast<const uint8_t*>(ok.data()), ok.size(), &r));
  // One id short of what the counts imply: refused (by division, no product).
  ok.resize(ok.size() - 1);
  EXPECT(
      wire::DecodePushRequest(reinterpret_cast<const uint8_t*>(ok.data()), ok.size(), &r).code() ==
      Code::kInvalidArgument);
}

// The growth test of a stripe index was 32-bit: (2^30 + 1) * 4 wrapped to 4
// and the index stopped growing at 2^30 records.
DLT_TEST(TestIndexKeepsGrowingPast2To30Records) {
  EXPECT(IndexMustGrow(uint64_t{1} << 30, uint64_t{1} << 30));
  EXPECT(IndexMustGrow(uint64_t{3} << 30, uint64_t{1} << 32));
  EXPECT(!IndexMustGrow((uint64_t{3} << 30) - 2, uint64_t{1} << 32));
  EXPECT(IndexMustGrow(12, 16) && !IndexMustGrow(11, 16));
}

DLT_TEST(TestImportRejectsNonFiniteRows) {
  Table t(Config("t", 2, OptimizerKind::kAdagrad));
  const std::vector<int64_t> ids = {1, 2};
  std::vector<float> values = {1, 2, 3, NAN};
  std::vector<float> slots = {0.1f, 0.1f, 0.1f, 0.1f};
  const std::vector<uint32_t> steps = {3, 4};
  Status s = t.Import(ids.data(), values.data(), slots.data(), steps.data(), 2);
  EXPECT(s.code() == Code::kInvalidArgument && s.message().find("id 2") != std::string::npos);
  values[3] = 4;
  slots[0] = INFINITY;
  s = t.Import(ids.data(), values.data(), slots.data(), steps.data(), 2);
  EXPECT(s.code() == Code::kInvalidArgument && s.message().find("slots") != std::string::npos);
  EXPECT(t.size() == 0);  // nothing imported
  slots[0] = 0.5f;
  EXPECT_OK(t.Import(ids.data(), values.data(), slots.data(), steps.data(), 2));
  EXPECT(t.size() == 2);
}

DLT_TEST(TestAPushThatWouldOverflowARowLeavesItAsItWas) {
  Table t(Config("t", 2, OptimizerKind::kAdagrad));
  std::vector<int64_t> ids(1000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  std::vector<float> before(ids.size() * 2), after(ids.size() * 2);
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kInsert, before.data()));
  // Too large for any optimizer's state: refused before anything.
  std::vector<float> grads(ids.size() * 2, 1.0f);
  grads[7] = 1e20f;
  Status s = t.Push(ids.data(), grads.data(), ids.size(), 0.1f);
  EXPECT(s.code() == Code::kInvalidArgument && s.message().find("id 3") != std::string::npos);
  // Each gradient in range, their sum over one id repeated not.
  const std::vector<int64_t> same(4, 5);
  const std::vector<float> big(4 * 2, 1e18f);
  s = t.Push(same.data(), big.data(), same.size(), 0.1f);
  EXPECT(s.code() == Code::kInvalidArgument &&
         s.message().find("id 5, repeated in the push, sum past") != std::string::npos);
  EXPECT_OK(t.Pull(ids.data(), ids.size(), PullMode::kInitNoInsert, after.data()));
  EXPECT(before == after);
  // Each push in range, the state they grow past float32: the push that
  // would overflow leaves the row as the one before left it.
  const int64_t six = 6;
  std::vector<float> last(2), now(2);
  s = OkStatus();
  for (int i = 0; i < 1000 && s.ok(); ++i) {
    EXPECT_OK(t.Pull(&six, 1, PullMode::kInitNoInsert, last.data()));
    s = t.Push(&six, big.data(), 1, 0.1f);
  }
  EXPECT(s.code() == Code::kInvalidArgument &&
         s.message().find("id 6 would make its row non-finite") != std::string::npos);
  EXPECT_OK(t.Pull(&six, 1, PullMode::kInitNoInsert, now.data()));
  EXPECT(last == now);
  // A refused id the table had no row for gets none (an id beside it in
  // the push does): the push left it as it was, absent.
  const std::vector<int64_t> fresh = {5000, 5000, 5000, 5000, 5001};
  std::vector<float> fresh_grads(big);
  fresh_grads.insert(fresh_grads.end(), {0.5f, 0.5f});
  const size_t rows = t.size();
  const uint64_t admitted = t.counters().admitted;
  s = t.Push(fresh.data(), fresh_grads.data(), fresh.size(), 0.1f);
  EXPECT(s.code() == Code::kInvalidArgument &&
         s.message().find("id 5000, repeated in the push, sum past") != std::string::npos);
  EXPECT(t.size() == rows + 1);
  EXPECT(t.counters().admitted == admitted + 1);
  EXPECT(CheckGradients(ids.data(), grads.data(), 1, 2, 1e37f, "", "").code() ==
         Code::kInvalidArgument);  // 1 x 1e37 past kMaxStep
  EXPECT_OK(CheckGradients(ids.data(), grads.data(), 1, 2, 0.1f, "", ""));
}

DLT_TEST(TestTableConfigEncodingRoundTrips) {
  TableConfig c = Config("a/b.c-d_e", 24, OptimizerKind::kFtrl);
  c.seed = 18446744073709551615ull;
  c.initializer.kind = InitializerKind::kTruncatedNormal;
  c.initializer.mean = 0.25f;
  c.initializer.stddev = 0.1f;
  c.optimizer.l1 = 1e-3f;
  c.optimizer.learning_rate_power = -0.75f;
  c.policy.admission = static_cast<uint64_t>(AdmissionKind::kFrequency);
  c.policy.min_count = 3;
  c.policy.sketch_bytes = 1 << 20;
  c.policy.ttl = 86400;
  c.policy.clock = static_cast<uint64_t>(ClockKind::kSeconds);
  c.policy.value_dtype = static_cast<uint64_t>(StorageDtype::kBfloat16);
  c.policy.probability = 0.25f;
  EXPECT_OK(ValidateTableConfig(c));
  TableConfig back;
  EXPECT_OK(DecodeTableConfig(EncodeTableConfig(c), &back));
  EXPECT(SameTable(c, back));
  EXPECT(EncodeTableConfig(back) == EncodeTableConfig(c));
  EXPECT(DecodeTableConfig("name=x dim=4 colour=blue", &back).code() == Code::kInvalidArgument);
  EXPECT(DecodeTableConfig("name=x dim=four", &back).code() == Code::kInvalidArgument);
  EXPECT(DecodeTableConfig("optimizer=rmsprop", &back).code() == Code::kInvalidArgument);
  EXPECT(DecodeTableConfig("optimizer.epsilon=", &back).code() == Code::kInvalidArgument);
  EXPECT(DecodeTableConfig("policy.eviction=fifo", &back).code() == Code::kInvalidArgument);
  EXPECT(DecodeTableConfig("policy.max_rows=-1", &back).code() == Code::kInvalidArgument);
  TableConfig bad = c;
  bad.policy.min_count = 256;
  EXPECT(ValidateTableConfig(bad).code() == Code::kInvalidArgument);
  bad = c;
  bad.policy.sketch_bytes = 1000;
  EXPECT(ValidateTableConfig(bad).code() == Code::kInvalidArgument);
  bad = c;
  bad.policy.max_rows = 4095;  // some stripe would get no row at all
  EXPECT(ValidateTableConfig(bad).code() == Code::kInvalidArgument);
  InitializerKind ik;
  OptimizerKind ok;
  EXPECT(ParseInitializerKind("truncated_normal", &ik) && ik == InitializerKind::kTruncatedNormal);
  EXPECT(ParseOptimizerKind("adam", &ok) && ok == OptimizerKind::kAdam);
  EXPECT(!ParseOptimizerKind("Adam", &ok));
}

DLT_TEST(TestTableNamesAreNeverPathsThatLeadElsewhere) {
  for (const char* good : {"emb", "user/ftrl", "a.b/c-d_e", "..a", "a.."}) {
    EXPECT_OK(ValidateTableName(good));
  }
  for (const char* bad : {"x/../../../outside", "..", ".", "/abs", "a/", "a//b", "./a", "a/./b"}) {
    EXPECT(ValidateTableName(bad).code() == Code::kInvalidArgument);
  }
}

DLT_TEST(TestEmbeddedTransportServesTheProcessShard) {
  // Tables made in the process's embedded shard are what every embedded
  // transport serves, each of them the same rows.
  bool created = false;
  EXPECT_OK(EmbeddedShard()->CreateTable(Config("emb", 4, OptimizerKind::kAdagrad), &created));
  EXPECT(created && EmbeddedShard() == EmbeddedShard());
  auto embedded = EmbeddedTransport(), other = EmbeddedTransport();
  EXPECT(embedded->embedded());
  const std::vector<int64_t> ids = {3, 1, 2};
  std::vector<float> rows(12), grads(12, 1.0f), again(12);
  EXPECT_OK(
      embedded->Pull("emb", 4, ids.data(), 3, PullMode::kInsert, rows.data(), false, nullptr));
  EXPECT_OK(embedded->Push("emb", 4, ids.data(), grads.data(), 3, 0.1f));
  EXPECT_OK(
      other->Pull("emb", 4, ids.data(), 3, PullMode::kZerosNoInsert, again.data(), false, nullptr));
  std::shared_ptr<Table> table;
  EXPECT_OK(EmbeddedShard()->GetTable("emb", &table));
  std::vector<float> direct(12);
  EXPECT_OK(table->Pull(ids.data(), 3, PullMode::kZerosNoInsert, direct.data()));
  EXPECT(again == direct && again != rows && table->size() == 3);
  EXPECT(embedded->Pull("emb", 8, ids.data(), 3, PullMode::kInsert, rows.data(), false, nullptr)
             .code() == Code::kInvalidArgument);
  EXPECT(embedded->Pull("nope", 4, ids.data(), 3, PullMode::kInsert, rows.data(), false, nullptr)
             .code() == Code::kNotFound);
  EXPECT_OK(EmbeddedShard()->DropTable("emb"));
  EXPECT(
      other->Pull("emb", 4, ids.data(), 3, PullMode::kZerosNoInsert, again.data(), false, nullptr)
          .code() == Code::kNotFound);
  auto tcp = TcpTransport({"127.0.0.1:1"}, ClientOptions());
  EXPECT(!tcp->embedded());
}

}  // namespace
}  // namespace dlt

DLT_TEST(TestATokenFileIsARegularFileOfPrintableAscii) {
  // As the Python client reads one: what a served SavedModel's lookups read
  // from TF_DLT_AUTH_TOKEN_FILE. A FIFO blocked there, /dev/zero never ended.
  using dlt::ReadTokenFile;
  using dlt::Status;
  char dir_template[] = "/tmp/dlt-token-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  auto file = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name, std::ios::binary) << text;
    return dir + "/" + name;
  };
  std::string token;
  EXPECT_OK(ReadTokenFile(file("good", "  s3cr3t token\n"), "VAR", &token));
  EXPECT(token == "s3cr3t token");
  const std::string fifo = dir + "/fifo";
  EXPECT(mkfifo(fifo.c_str(), 0600) == 0);
  const std::pair<std::string, const char*> refused[] = {
      {file("empty", "\n"), "is empty"},
      {file("utf8", "t\xc3\xb6k"), "printable ASCII"},
      {file("lines", "a\nb"), "printable ASCII"},
      {file("long", std::string(5000, 'x')), "at most 4096"},
      {fifo, "not a regular file"},
      {"/dev/zero", "not a regular file"},
      {dir + "/missing", "No such file"},
      // open() would have read the good file named before the NUL
      {file("good", "t") + std::string(1, '\0') + "x", "holds a NUL byte"},
  };
  for (const auto& [path, says] : refused) {
    std::string got = "unchanged";
    const Status s = ReadTokenFile(path, "VAR", &got);
    EXPECT_ERROR_HAS(s, says);
    EXPECT(s.message().find("VAR") != std::string::npos && got == "unchanged");
    EXPECT(s.message().find(dir) == std::string::npos);  // never the path
  }
  // The rule a token given as text meets too (tf_dlt.Client's auth_token).
  EXPECT_OK(dlt::CheckToken("s3cr3t token", "the token"));
  EXPECT_ERROR_HAS(dlt::CheckToken("a\tb", "the token"), "the token holds a character");
  EXPECT_ERROR_HAS(dlt::CheckToken(std::string(4097, 'x'), "the token"), "at most 4096");
  std::filesystem::remove_all(dir);
}

DLT_TEST(TestALoadedSavedModelsClientHasTheTokenSetForTheNameItWasSavedUnder) {
  // TensorFlow's loader renames a loaded shared_name "<name>_load_<uid>[_<uid>]":
  // the client of a SavedModel loaded in the process that trained it found no
  // token under that name and failed UNAUTHENTICATED.
  EXPECT(dlt::SavedClientName("dlt_client_3_load_17") == "dlt_client_3");
  EXPECT(dlt::SavedClientName("dlt_client_3_load_17_42") == "dlt_client_3");
  for (const char* kept : {"dlt_client_3", "a_load_", "a_load_x", "a_load_1_", "a_load__1"}) {
    EXPECT(dlt::SavedClientName(kept) == kept);
  }
  dlt::SetClientToken("saved_client", "s3cr3t");
  EXPECT(dlt::ClientToken("saved_client_load_5_6") == "s3cr3t");
  EXPECT(dlt::ClientToken("other_client_load_5").empty());
  dlt::SetClientToken("saved_client_load_5_6", "its own");  // set for the loaded name: that one
  EXPECT(dlt::ClientToken("saved_client_load_5_6") == "its own");
  dlt::SetClientToken("saved_client", "");
  dlt::SetClientToken("saved_client_load_5_6", "");
}
