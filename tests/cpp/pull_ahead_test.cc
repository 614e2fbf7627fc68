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
  EXPECT(taken->done() && taken->ok() && taken->StaleIds().empty() && taken->ready());
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
  // The pipeline stopped: every waiting pull is dropped, in every table.
  ahead.Begin("emb", PullMode::kInsert, 2, a.data(), 1);
  std::shared_ptr<PulledAhead> other = ahead.Begin("other", PullMode::kInsert, 2, b.data(), 1);
  EXPECT(ahead.DropAll() == 2 && ahead.counts().dropped == 4);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, a.data(), 1) == nullptr);
  EXPECT(ahead.Pushed("other", b.data(), 1).empty() && other->StaleIds().empty());
  EXPECT(ahead.DropAll() == 0);
}

// A table two model inputs share: each batch begins two pulls of it. The
// batch's lookups take them in any order without dropping each other's; a
// lookup of the next batch drops what the batch before left.
DLT_TEST(PullAheadKeepsTheOtherPullsOfItsBatch) {
  PullAhead ahead;
  const std::vector<int64_t> u1 = {1}, i1 = {11}, u2 = {2}, i2 = {12};
  ahead.Begin("emb", PullMode::kInsert, 2, u1.data(), 1, true, 2);
  ahead.Begin("emb", PullMode::kInsert, 2, i1.data(), 1, true, 2);
  ahead.Begin("emb", PullMode::kInsert, 2, u2.data(), 1, true, 2);
  ahead.Begin("emb", PullMode::kInsert, 2, i2.data(), 1, true, 2);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, i1.data(), 1) != nullptr);  // second first
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, u1.data(), 1) != nullptr);
  EXPECT(ahead.counts().dropped == 0);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, i2.data(), 1) != nullptr);
  EXPECT(ahead.counts().dropped == 0);  // same batch: u2 still waits
  ahead.Begin("emb", PullMode::kInsert, 2, u1.data(), 1, true, 2);
  ahead.Begin("emb", PullMode::kInsert, 2, i1.data(), 1, true, 2);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, u1.data(), 1) != nullptr);  // next batch
  EXPECT(ahead.counts().dropped == 1);  // u2, left by the batch before
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, u2.data(), 1) == nullptr);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, i1.data(), 1) != nullptr);
  EXPECT(ahead.counts().taken == 5);
}

DLT_TEST(PullAheadTakesTheNewestOfTheSameIds) {
  // An older pull of the same ids was left by an input pipeline that
  // stopped (a fit that failed, a checkpoint loaded since): the lookup takes
  // the pull ahead begun for it, the newest, and drops the older one.
  PullAhead ahead;
  const std::vector<int64_t> ids = {4, 5};
  std::shared_ptr<PulledAhead> left = ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), 2);
  std::shared_ptr<PulledAhead> own = ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), 2);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, ids.data(), 2) == own);
  EXPECT(ahead.counts().taken == 1 && ahead.counts().dropped == 1);
  EXPECT(ahead.Take("emb", PullMode::kInsert, 2, ids.data(), 2) == nullptr);
  // The dropped one is no longer marked by pushes.
  EXPECT(ahead.Pushed("emb", ids.data(), 2).empty() && left->StaleIds().empty());
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

DLT_TEST(PullAheadRefreshesStaleIdsAheadOfTheLookup) {
  PullAhead ahead;
  const std::vector<int64_t> ids = {5, 6, 7, 6};
  std::shared_ptr<PulledAhead> pulled =
      ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), ids.size());
  FillRows(pulled.get());
  const std::vector<int64_t> pushed = {6, 5};
  // Unfinished: marked, nothing to refresh yet (the puller refreshes once done).
  EXPECT((ahead.Pushed("emb", pushed.data(), pushed.size()) ==
          std::vector<std::shared_ptr<PulledAhead>>{pulled}));
  EXPECT(pulled->BeginRefresh().empty());
  pulled->Finish(true);
  EXPECT((pulled->BeginRefresh() == std::vector<int64_t>{5, 6}));
  EXPECT(pulled->StaleIds().empty());      // unmarked while refreshing,
  EXPECT(!pulled->ready());                // and not to be copied yet
  EXPECT(pulled->BeginRefresh().empty());  // one refresh at a time
  // A push lands during the refresh: 7 is next; then a lookup takes the pull
  // and waits for the refresh to end.
  const std::vector<int64_t> later = {7};
  EXPECT((ahead.Pushed("emb", later.data(), later.size()) ==
          std::vector<std::shared_ptr<PulledAhead>>{pulled}));
  std::shared_ptr<PulledAhead> taken =
      ahead.Take("emb", PullMode::kInsert, 2, ids.data(), ids.size());
  int ran = 0;
  taken->Then([&ran] { ++ran; });
  EXPECT(ran == 0);
  const std::vector<float> fresh = {50, 51, 60, 61};  // rows of 5 and 6
  // Taken: the refresh stops; 7 is left stale for the lookup to pull.
  EXPECT(pulled->RefreshDone(fresh.data()).empty());
  EXPECT(ran == 1);
  EXPECT((taken->StaleIds() == std::vector<int64_t>{7}) && !taken->ready());
  std::vector<float> out(ids.size() * 2);
  taken->CopyRows(out.data());
  EXPECT((out == std::vector<float>{50, 51, 60, 61, 7, 7.5f, 60, 61}));
}

DLT_TEST(PullAheadRefreshGoesOnWithIdsMarkedMeanwhileAndRemarksOnFailure) {
  PullAhead ahead;
  const std::vector<int64_t> ids = {1, 2, 3};
  std::shared_ptr<PulledAhead> pulled =
      ahead.Begin("emb", PullMode::kInsert, 2, ids.data(), ids.size());
  FillRows(pulled.get());
  pulled->Finish(true);
  const std::vector<int64_t> first = {1}, second = {1, 3};
  ahead.Pushed("emb", first.data(), first.size());
  EXPECT((pulled->BeginRefresh() == std::vector<int64_t>{1}));
  ahead.Pushed("emb", second.data(), second.size());  // 1 again, and 3
  const std::vector<float> one = {10, 11};
  EXPECT((pulled->RefreshDone(one.data()) == std::vector<int64_t>{1, 3}));
  // That pull fails: both are stale again, and the refresh ends.
  EXPECT(pulled->RefreshDone(nullptr).empty());
  EXPECT((pulled->StaleIds() == std::vector<int64_t>{1, 3}));
  int ran = 0;
  pulled->Then([&ran] { ++ran; });  // not refreshing: at once
  EXPECT(ran == 1);
  // A failed pull ahead is never refreshed.
  std::shared_ptr<PulledAhead> failed =
      ahead.Begin("emb", PullMode::kInsert, 2, first.data(), first.size());
  failed->Finish(false);
  ahead.Pushed("emb", first.data(), first.size());
  EXPECT(failed->BeginRefresh().empty());
}

DLT_TEST(PullAheadPushReturnsEveryPullItMarked) {
  PullAhead ahead;
  const std::vector<int64_t> a = {1, 2}, b = {2, 3};
  std::shared_ptr<PulledAhead> first = ahead.Begin("emb", PullMode::kInsert, 2, a.data(), 2);
  std::shared_ptr<PulledAhead> second = ahead.Begin("emb", PullMode::kInsert, 2, b.data(), 2);
  using Pulls = std::vector<std::shared_ptr<PulledAhead>>;
  const std::vector<int64_t> three = {3}, two = {2}, nine = {9};
  EXPECT((ahead.Pushed("emb", three.data(), 1) == Pulls{second}));
  EXPECT((ahead.Pushed("emb", two.data(), 1) == Pulls{first, second}));
  EXPECT(ahead.Pushed("emb", three.data(), 1).empty());  // marked already
  EXPECT(ahead.Pushed("emb", nine.data(), 1).empty());
  EXPECT(ahead.Pushed("other", two.data(), 1).empty());
}

}  // namespace
}  // namespace dlt
