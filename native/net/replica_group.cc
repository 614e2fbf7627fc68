#include "native/net/replica_group.h"

#include <algorithm>

namespace dlt {

ReplicaGroup::ReplicaGroup(std::shared_ptr<Shard> shard, ReplicatorOptions options,
                           int detach_after_ms)
    : shard_(std::move(shard)), options_(std::move(options)), detach_after_ms_(detach_after_ms) {}

ReplicaGroup::~ReplicaGroup() { Stop(); }

Status ReplicaGroup::Attach(const std::string& address) {
  Member replicator, old;
  std::vector<Member> retired;  // stopped outside mu_
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return FailedPrecondition("this shard's replication stopped");
    retired = PruneLocked();  // room, maybe
    auto it = std::find_if(members_.begin(), members_.end(),
                           [&](const Attached& m) { return m.address == address; });
    if (it == members_.end() && members_.size() >= kMaxStandbys) {
      return FailedPrecondition("a shard keeps at most " + std::to_string(kMaxStandbys) +
                                " standbys; " + AddressesLocked() + " are attached");
    }
    const uint64_t id = ++next_id_;
    ReplicatorOptions o = options_;
    o.view = [this, id](bool joining) { return ViewFor(id, joining); };
    o.on_failure = [this, id] { Leave(id); };  // whichever joins it made
    replicator = std::make_shared<Replicator>(shard_, address, std::move(o));
    // A standby attached again holds nothing of this primary's until its
    // copy: it is out of the set until then.
    LeaveLocked(address);
    if (it != members_.end()) {
      old = std::move(it->replicator);
      *it = Attached{address, id, replicator};
    } else {
      members_.push_back(Attached{address, id, replicator});
    }
  }
  if (old != nullptr) old->Stop();  // its thread may call in: not under mu_
  for (const Member& m : retired) m->Stop();
  replicator->Start();
  return OkStatus();
}

bool ReplicaGroup::Detach(const std::string& address) {
  Member gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(members_.begin(), members_.end(),
                           [&](const Attached& m) { return m.address == address; });
    if (it == members_.end()) return false;
    gone = std::move(it->replicator);
    members_.erase(it);
    LeaveLocked(address);
  }
  gone->Stop();
  return true;
}

void ReplicaGroup::Stop() {
  std::vector<Member> members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    members = MembersLocked();
    members_.clear();
    in_sync_.clear();
    ++version_;
  }
  for (const Member& member : members) member->Stop();
}

uint64_t ReplicaGroup::Applied() { return Mark(0); }

Status ReplicaGroup::Hold(int timeout_ms) {
  const uint64_t seq = Mark(1);
  return options_.sync ? WrittenWithin(seq, timeout_ms) : HeldByAll(seq, timeout_ms);
}

Status ReplicaGroup::HeldByAll(uint64_t seq, int timeout_ms) {
  const Marks marks = MarksOf(seq);
  const std::vector<Attached> members = Snapshot();
  // One deadline for all of them: a write waits at most timeout_ms in all.
  using std::chrono::milliseconds;
  const auto deadline = std::chrono::steady_clock::now() +
                        milliseconds(timeout_ms > 0 ? timeout_ms : options_.write_timeout_ms);
  Status first;
  for (const Attached& member : members) {
    const auto left =
        std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
    const Status s = member.replicator->Held(MarkOf(marks, member),
                                             static_cast<int>(std::max<int64_t>(1, left.count())));
    // Not copied afresh past it, as a sync group's in-sync standby is: an
    // async standby may be copying the tables (a standby that just came
    // back, a table a load replaced), and every admin write would then
    // restart a copy that takes longer than the timeout (so it never caught
    // up while they went on). A stalled one costs each write the timeout.
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

ReplicaGroup::Marks ReplicaGroup::MarksOf(uint64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return marks_[seq % kMarks].seq == seq ? marks_[seq % kMarks] : Marks{};
}

uint64_t ReplicaGroup::MarkOf(const Marks& marks, const Attached& member) {
  for (size_t i = 0; i < marks.count; ++i) {
    if (marks.marks[i].first == member.id) return marks.marks[i].second;
  }
  return member.replicator->Applied();
}

uint64_t ReplicaGroup::Mark(uint64_t later) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t seq = ++seq_;
  Marks& m = marks_[seq % kMarks];
  m.seq = seq;
  m.count = members_.size();
  for (size_t i = 0; i < members_.size(); ++i) {
    m.marks[i] = {members_[i].id, members_[i].replicator->Applied() + later};
  }
  return seq;
}

Status ReplicaGroup::WrittenWithin(uint64_t seq, int timeout_ms) {
  const Marks marks = MarksOf(seq);
  auto mark_of = [&](const Attached& member) { return MarkOf(marks, member); };
  if (!options_.sync) {
    for (const Attached& m : Snapshot()) {
      static_cast<void>(m.replicator->Written(mark_of(m)));  // OK at once; keeps its lag
    }
    return OkStatus();
  }
  bool waited_on_one = false;
  for (;;) {
    std::vector<Attached> waited;
    std::vector<Member> pruned;
    uint64_t version;
    bool all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return Unavailable("this shard's replication stopped");
      pruned = PruneLocked();
      version = version_;
      all = in_sync_.empty();
      for (const Attached& m : members_) {
        if (all || InSyncLocked(m.address)) {
          waited.push_back(m);
        }
      }
    }
    for (const Member& member : pruned) member->Stop();
    if (waited.empty()) {
      // No standby attached: nothing to wait for; all detached while this
      // write waited: none is known to hold it.
      if (!waited_on_one) return OkStatus();
      return Unavailable("every standby was detached before it applied the write");
    }
    waited_on_one = true;
    if (all) {
      // None holds every write yet (copying, or the last one failed): the
      // write is acknowledged once one standby applied it (the others, down
      // or failing, are not waited for); none: the first error.
      Status first;
      bool held = false;
      for (const Attached& member : waited) {
        const Status s = member.replicator->Written(mark_of(member), 0, timeout_ms);
        held |= s.ok();
        if (!s.ok() && first.ok()) first = s;
      }
      return held ? OkStatus() : first;
    }
    bool left = false;
    for (const Attached& member : waited) {
      // Each acknowledging round of the set's standbys also told the set:
      // a standby left out learns it before a write is acknowledged
      // without it.
      const Status s = member.replicator->Written(mark_of(member), version, timeout_ms);
      if (s.ok()) continue;
      if (s.code() == Code::kDeadlineExceeded) member.replicator->Reconnect();  // copies afresh
      Leave(member.id, member.joins);  // unless it joined again meanwhile
      left = true;
      break;
    }
    if (!left) return OkStatus();
  }
}

Status ReplicaGroup::Pause(bool pause) {
  std::vector<Member> members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    members = MembersLocked();
  }
  Status first;
  for (const Member& member : members) {
    const Status s = member->Pause(pause);
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

void ReplicaGroup::Follow(const std::vector<std::shared_ptr<Table>>& first,
                          const std::function<std::vector<std::shared_ptr<Table>>()>& swap) {
  std::vector<Member> members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    members = MembersLocked();
  }
  std::vector<std::shared_ptr<Table>> tables;
  FollowFrom(0, members, first, swap, &tables);
}

void ReplicaGroup::FollowFrom(size_t index, const std::vector<Member>& members,
                              const std::vector<std::shared_ptr<Table>>& first,
                              const std::function<std::vector<std::shared_ptr<Table>>()>& swap,
                              std::vector<std::shared_ptr<Table>>* tables) {
  if (index == members.size()) {
    *tables = swap();
    return;
  }
  // Each member pauses and logs `first` before the one swap, and follows
  // the tables it made after it.
  members[index]->Follow(first, [&] {
    FollowFrom(index + 1, members, first, swap, tables);
    return *tables;
  });
}

std::vector<ReplicationStatus> ReplicaGroup::statuses() const {
  std::vector<Member> members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    members = MembersLocked();
  }
  std::vector<ReplicationStatus> out;
  for (const Member& member : members) out.push_back(member->status());
  return out;
}

std::string ReplicaGroup::addresses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return AddressesLocked();
}

wire::InSyncView ReplicaGroup::view() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ViewLocked();
}

std::vector<ReplicaGroup::Attached> ReplicaGroup::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return members_;
}

std::vector<ReplicaGroup::Member> ReplicaGroup::MembersLocked() const {
  std::vector<Member> out;
  for (const Attached& m : members_) out.push_back(m.replicator);
  return out;
}

std::string ReplicaGroup::AddressesLocked() const {
  std::string out;
  for (const Attached& m : members_) out += (out.empty() ? "" : "|") + m.address;
  return out;
}

wire::InSyncView ReplicaGroup::ViewLocked() const {
  wire::InSyncView view;
  view.epoch = shard_->epoch();
  view.version = version_;
  // In attach order, which every standby told this version reads alike.
  for (const Attached& m : members_) {
    if (InSyncLocked(m.address)) {
      view.members += (view.members.empty() ? "" : "|") + m.address;
    }
  }
  return view;
}

wire::InSyncView ReplicaGroup::ViewFor(uint64_t id, bool joining) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ByIdLocked(id);
  if (joining && it != members_.end() && !InSyncLocked(it->address)) {
    in_sync_.push_back(it->address);
    ++it->joins;
    ++version_;
  }
  return ViewLocked();
}

void ReplicaGroup::Leave(uint64_t id, uint64_t joins) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ByIdLocked(id);
  if (it == members_.end()) return;
  if (joins != ~uint64_t{0} && it->joins != joins) return;  // it joined again since
  LeaveLocked(it->address);
}

std::vector<ReplicaGroup::Member> ReplicaGroup::PruneLocked() {
  std::vector<Member> pruned;
  const auto now = std::chrono::steady_clock::now();
  if (now - pruned_ < std::chrono::seconds(1)) return pruned;
  pruned_ = now;
  for (auto it = members_.begin(); it != members_.end();) {
    const ReplicationStatus s = it->replicator->status();
    // The last one stays: a primary that detached every standby would
    // acknowledge writes no standby holds.
    if (s.connected || s.down_seconds * 1000 < detach_after_ms_ || members_.size() == 1) {
      ++it;
      continue;
    }
    LeaveLocked(it->address);
    pruned.push_back(std::move(it->replicator));
    it = members_.erase(it);
  }
  return pruned;
}

std::vector<ReplicaGroup::Attached>::iterator ReplicaGroup::ByIdLocked(uint64_t id) {
  return std::find_if(members_.begin(), members_.end(),
                      [&](const Attached& m) { return m.id == id; });
}

bool ReplicaGroup::InSyncLocked(const std::string& address) const {
  return std::find(in_sync_.begin(), in_sync_.end(), address) != in_sync_.end();
}

void ReplicaGroup::LeaveLocked(const std::string& address) {
  auto in = std::find(in_sync_.begin(), in_sync_.end(), address);
  if (in == in_sync_.end()) return;
  in_sync_.erase(in);
  ++version_;
}

}  // namespace dlt
