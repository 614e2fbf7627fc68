// PullAhead: which pulls ahead a lookup takes, which ids a push marks stale,
// and the rows a taken pull ahead hands back. No sockets: the puller is the
// test.
#include "native/net/pull_ahead.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "tests/cpp/harness.h"

namespace dlt {
namespace {

// Fills a pull ahead's rows with row(id) = [id, id + 0.5].
void FillRows(PulledAhead* pulled) {
  for (size_t i = 0; i < pulled->unique().size(); ++i) {
    pulled->rows()[2 * i] = static_cast<float>(pulled->unique()[i]);
    pulled->rows()[2 * i + 1] = static_cast<float>(pulled->unique()[i]) + 0.5f;
  }
}

DLT_TEST(PullAheadPullsDistinctIdsAndCopiesRowsInInputOrder) {
  PullAhead ahead;
  const std::vector<int64_t> ids = {7, 3, 7, -2, 3};
  std::shared_ptr<PulledAhead> pulled =
      ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), ids.size());
  EXPECT((pulled->unique() == std::vector<int64_t>{7, 3, -2}));
  FillRows(pulled.get());
  pulled->Finish(true);
  std::shared_ptr<PulledAhead> taken =
      ahead.Take("emb", PullMode::kInsert, 2, ids.data(), ids.size());
  EXPECT(taken == pulled);
  EXPECT(taken->done() && taken->ok() && taken->StaleIds().empty());
  std::vector<float> out(ids.size() * 2);
  taken->CopyRows(out.data());
  EXPECT((out == std::vector<float>{7, 7.5f, 3, 3.5f, 7, 7.5f, -2, -1.5f, 3, 3.5f}));
  // Taken once only.
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, ids.data(), ids.size()) == nullptr);
  EXPECT(ahead.counts().begun == 1 && ahead.counts().taken == 1 && ahead.counts().dropped == 0);
}

DLT_TEST(PullAheadTakesOnlyTheSameTableModeDimAndIds) {
  PullAhead ahead;
  const std::vector<int64_t> ids = {1, 2, 3};
  ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), ids.size());
  const std::vector<int64_t> other = {1, 2, 4};
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, other.data(), other.size()) == nullptr);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, ids.data(), 2) == nullptr);
  EXPECT(ahead.Take("other", PullMode::kInsert, 2, ids.data(), ids.size()) == nullptr);
  EXPECT(ahead.Take("emb", PullMode::kZerosNoInsert, 2, ids.data(), ids.size()) == nullptr);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 4, ids.data(), ids.size()) == nullptr);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, ids.data(), ids.size()) != nullptr);
}

DLT_TEST(PullAheadPushMarksSharedIdsStaleUntilTaken) {
  PullAhead ahead;
  const std::vector<int64_t> ids = {5, 6, 7, 6};
  std::shared_ptr<PulledAhead> pulled =
      ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), ids.size());
  FillRows(pulled.get());
  // A push to another table, and one of ids this batch lacks: nothing stale.
  const std::vector<int64_t> pushed = {6, 9, 5, 6};
  ahead.Pushed("other", pushed.data(), pushed.size());
  const std::vector<int64_t> unrelated = {1, 2};
  ahead.Pushed("emb", unrelated.data(), unrelated.size());
  EXPECT(pulled->StaleIds().empty());
  // Stale even while the pull is still in flight: it may have read the row
  // before the push landed.
  ahead.Pushed("emb", pushed.data(), pushed.size());
  EXPECT((pulled->StaleIds() == std::vector<int64_t>{5, 6}));
  EXPECT(ahead.counts().stale_rows == 2);
  pulled->Finish(true);
  std::shared_ptr<PulledAhead> taken =
      ahead.Take("emb", PullMode::kInsert, 2, ids.data(), ids.size());
  // A push after the take no longer marks it: the lookup has its rows.
  const std::vector<int64_t> later = {7};
  ahead.Pushed("emb", later.data(), later.size());
  EXPECT((taken->StaleIds() == std::vector<int64_t>{5, 6}));
  const std::vector<float> fresh = {50, 51, 60, 61};  // rows of 5 and 6
  taken->Refresh(fresh.data());
  std::vector<float> out(ids.size() * 2);
  taken->CopyRows(out.data());
  EXPECT((out == std::vector<float>{50, 51, 60, 61, 7, 7.5f, 60, 61}));
}

DLT_TEST(PullAheadWithoutRefreshKeepsRowsAsPulled) {
  PullAhead ahead;
  const std::vector<int64_t> ids = {5, 6};
  std::shared_ptr<PulledAhead> pulled =
      ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), ids.size(), /*refresh=*/false);
  FillRows(pulled.get());
  pulled->Finish(true);
  ahead.Pushed("emb", ids.data(), ids.size());
  EXPECT(pulled->StaleIds().empty() && ahead.counts().stale_rows == 0);
}

DLT_TEST(PullAheadDropsSkippedAndOverflowingPulls) {
  PullAhead ahead(2);
  const std::vector<int64_t> a = {1}, b = {2}, c = {3};
  ahead.Begin("emb", PullMode::kInsert, 2, a.data(), 1);
  ahead.Begin("emb", PullMode::kInsert, 2, b.data(), 1);
  ahead.Begin("emb", PullMode::kInsert, 2, c.data(), 1);  // drops a
  EXPECT(ahead.counts().dropped == 1);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, a.data(), 1) == nullptr);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, c.data(), 1) != nullptr);  // skips b
  EXPECT(ahead.counts().dropped == 2 && ahead.counts().taken == 1);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, b.data(), 1) == nullptr);
}

DLT_TEST(PullAheadThenRunsOnceTheRowsArrive) {
  PullAhead ahead;
  const std::vector<int64_t> ids = {1};
  std::shared_ptr<PulledAhead> pulled = ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), 1);
  int ran = 0;
  pulled->Then([&ran] { ++ran; });
  EXPECT(ran == 0 && !pulled->done());
  pulled->Finish(false);
  EXPECT(ran == 1 && pulled->done() && !pulled->ok());
  pulled->Then([&ran] { ++ran; });  // already done: runs at once
  EXPECT(ran == 2);
}

}  // namespace
}  // namespace dlt
