"""Hot standbys of a shard server (docs/replication.md).

A primary keeps its standby equal to it with a native `Replicator` (the row
stream): `Standbys` holds it, made when a standby asks (AttachStandby).

A standby (`tf-dlt server --standby-of HOST:PORT`) greets only its primary
and answers trainers UNAVAILABLE. `StandbyLink` asks the primary to replicate
to it, watches the primary, and when the primary stays unreachable for
`takeover_after_s` after this standby caught up, takes over: it greets
trainers from then on (clients that list it after the primary, `a|b`, move
to it) and refuses its old primary's frames, which fences that primary.

A member of a replica set (`tf-dlt server --replica-set A|B`, as Kubernetes
restarts a pod under its old name) learns its role first (`choose_role`):
it follows the member that serves, waits while the other member holds a
whole copy that is about to take over, and otherwise begins as the
primary."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import grpc

from tf_dlt import _native, errors, grpc_util, tls
from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc
from tf_dlt.server.repeated import Repeated

log = logging.getLogger("tf_dlt.server")

REPLICATION_MODES = ("sync", "async")
# How often a standby checks that its primary still replicates to it.
_CHECK_INTERVAL_S = 2.0
# How often a member of a replica set looks at the others while it learns
# its role, and how long a member other than the first waits for the others
# to answer before it begins as the primary on its own.
_SURVEY_INTERVAL_S = 0.5
# A greeting's timeout ends a hair before this process's clock says that
# much passed since it was sent (the native wait rounds down to whole
# milliseconds): unreachable time within this much of `--takeover-after`
# counts as reaching it, else a silent primary now and then took one more
# greeting to pass over.
_TIMEOUT_SLACK_S = 0.05
BEGIN_ALONE_AFTER_S = 10.0
# How long a primary's greeting of a standby that attaches may take (the
# standby's AttachStandby waits 10 s).
_GREET_STANDBY_MS = 3000
# What a survey of the replica set found (besides a member to follow).
_WAIT, _BEGIN, _ALONE = "wait", "begin", "alone"
# What an election found (besides a member to follow).
_TAKE = "take"
# How long a standby that granted another's claim to take over does not
# take over itself.
PROMISE_S = 5.0


class Standbys:
    """A primary's standbys (at most MAX_REPLICAS - 1) and the native
    `ReplicaGroup` that keeps them: a standby that attaches again replaces
    its own replicator, and its copy begins afresh."""

    def __init__(
        self,
        shard: _native.Shard,
        data_server: _native.DataServer,
        auth_token: str = "",
        replication: str = "sync",
        io_timeout_s: float = 30.0,
        detach_after_s: float = 60.0,
        standby_timeout_s: float = 10.0,
    ) -> None:
        if replication not in REPLICATION_MODES:
            raise ValueError(f"replication must be sync or async, got {replication!r}")
        if not standby_timeout_s > 0:
            raise ValueError(f"the standby timeout must be positive, got {standby_timeout_s}")
        self._shard = shard
        self._data_server = data_server
        self._auth_token = auth_token
        self.replication = replication
        self._io_timeout_ms = max(1, int(io_timeout_s * 1000))
        self._detach_after_ms = max(1, int(detach_after_s * 1000))
        self._write_timeout_ms = max(1, int(standby_timeout_s * 1000))
        self._lock = threading.Lock()
        self._group: _native.ReplicaGroup | None = None  # guarded by _lock

    def attach(self, address: str, shard_index: int, num_shards: int) -> None:
        """Replicates to the standby at `address` from now on, once it
        answers this primary's greeting as a standby."""
        self._check_place(shard_index, num_shards)
        self._greet_standby(address)
        with self._lock:
            if self._group is None:
                self._group = _native.ReplicaGroup(
                    self._shard, auth_token=self._auth_token,
                    sync=self.replication == "sync", io_timeout_ms=self._io_timeout_ms,
                    detach_after_ms=self._detach_after_ms, write_timeout_ms=self._write_timeout_ms,
                )  # fmt: skip
                self._data_server.set_replica_group(self._group)
            self._group.attach(address)  # clients learn it from the Hello
        log.info("replicating (%s) to standby %s", self.replication, address)

    def detach(self, address: str, shard_index: int, num_shards: int) -> None:
        """Stops replicating to the standby at `address`, which stops and
        takes over no more (AttachStandbyRequest.leaving): at once, and even
        the last one, whose writes then wait for no standby. A standby down
        is detached after --detach-standby-after instead, never the last:
        it may take over."""
        self._check_place(shard_index, num_shards)
        with self._lock:
            group = self._group
            # The group stays, with no member: its in-sync set's version
            # only grows while this process serves (a new group's began at
            # 0 again, so a standby left out of the old one, holding an old
            # view of a higher version, outranked one of the new group that
            # held every write, and took over). Writes wait for no member.
            if group is None or not group.detach(address):
                return
            alone = not group.addresses()
        log.warning(
            "standby %s stops: no longer replicating to it%s",
            address,
            " (no standby left: writes are acknowledged by this copy alone)" if alone else "",
        )

    def _greet_standby(self, address: str) -> None:
        """Refuses a standby this primary cannot replicate to: one its
        greeting does not reach, or that takes its token not, or that is
        no standby (this primary itself: a standby advertising the
        primary's address). Attached, each made every sync write fail "in
        doubt" for as long as it ran (the last standby is never detached)."""
        try:
            _native.hello(address, self._auth_token, timeout_ms=_GREET_STANDBY_MS, replica=True)
        except errors.UnauthenticatedError as e:
            raise errors.FailedPreconditionError(
                f"this primary cannot greet standby {address} with its auth token ({e}): give "
                "the primary and its standbys the same --auth-token-file"
            ) from None
        except errors.FailedPreconditionError as e:
            raise errors.FailedPreconditionError(
                f"{address} does not answer as a standby ({e}): a standby's --advertise names "
                "the standby as its primary reaches it, not the primary"
            ) from None
        except errors.DltError as e:
            raise errors.UnavailableError(
                f"this primary cannot reach standby {address} ({e}): a standby's --advertise "
                "names it as its primary reaches it"
            ) from None

    def _check_place(self, shard_index: int, num_shards: int) -> None:
        """FailedPreconditionError unless a standby of shard `shard_index`
        of `num_shards` may follow this primary."""
        if (shard_index, num_shards) != (self._shard.shard_index, self._shard.num_shards):
            raise errors.FailedPreconditionError(
                f"a standby of shard {shard_index} of {num_shards} cannot follow shard "
                f"{self._shard.shard_index} of {self._shard.num_shards}"
            )
        if self._data_server.standby:
            raise errors.FailedPreconditionError(
                f"shard {self._shard.shard_index} here is itself a standby: attach to its primary"
            )

    def pause(self, pause: bool) -> None:
        """A live re-shard's switch (writes held): pauses the streams once
        the standbys hold every write, or resumes them."""
        with self._lock:
            if self._group is not None:
                self._group.pause(pause)

    def hold(self, timeout_s: float | None = None) -> None:
        """Returns once the standbys a write waits on hold every table as it
        is now (a load's, a table made or dropped: the admin plane's writes),
        waiting at most `timeout_s` for each (None: the standby timeout); at
        once with no standby. UnavailableError or DeadlineExceededError when
        they do not. In async mode too (every standby attached waited for):
        a load acknowledged before its standby held it was served no more
        once that standby took over (`ShardService` acknowledges it all the
        same when they fail to: a standby down fails no async write)."""
        with self._lock:
            group = self._group
        if group is not None:
            timeout_ms = self._write_timeout_ms if timeout_s is None else int(timeout_s * 1000)
            group.hold(timeout_ms=max(1, timeout_ms))

    def statuses(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._group.statuses() if self._group is not None else []

    def view(self) -> dict[str, Any]:
        """The in-sync set the standbys were told (`_native.ReplicaGroup`)."""
        with self._lock:
            if self._group is None:
                return {"epoch": self._shard.epoch, "version": 0, "members": ""}
            return self._group.view()

    def close(self) -> None:
        with self._lock:
            group, self._group = self._group, None
            self._data_server.set_replica_group(None)
        if group is not None:
            group.stop()


class StandbyLink:
    """A standby's link to its primary: attaches, watches, takes over.

    Args:
        primary: the primary's data-plane address; None for a member of
            `replica_set`, which learns it first.
        advertise: this standby's data-plane address as the primary reaches it.
        shard_index, num_shards: this shard's.
        auth_token: the cluster's token (both planes).
        take_over: called once, when this standby takes over.
        caught_up: whether this standby holds every table its primary had
            (the primary says so on the stream after its copies).
        takeover_after_s: how long the primary must stay unreachable.
        probe_interval_s: how often the primary is checked.
        replica_set: every member's data-plane address, `advertise` among
            them, in the order they are to begin as primary.
        begin: called once when this member begins as the primary (no other
            member serves or holds a whole copy).
        step_down: called with another member's address when this member,
            serving, finds that one serving a newer copy: stop serving
            trainers; this link then makes it that member's standby.
        epoch: this copy's epoch (`_native.Shard.epoch`).
        place: this shard's index and count now (a live re-shard moves a
            standby with its primary); default: `shard_index`, `num_shards`.
        relocate: called with the Hello of a member or the primary: one
            at a newer layout (this process was restarted with the flags of
            the layout before a re-shard) gives this process, while it holds
            nothing yet, its place and layout; True when it did.
        view: the in-sync set this standby's primary told it last
            (`_native.DataServer.insync_view`): with several standbys only
            one in the newest set any of them knows takes over.
        fence: fences the primary this standby followed when it grants
            another's takeover (`_native.Shard.fence`, with its epoch + 1).
        follow_epoch: holds the epoch and lineage of the primary it
            attaches to (`_native.Shard.follow_epoch`).
    """

    def __init__(
        self,
        primary: str | None,
        advertise: str,
        shard_index: int,
        num_shards: int,
        auth_token: str,
        take_over: Callable[[], None],
        caught_up: Callable[[], bool],
        takeover_after_s: float = 1.0,
        probe_interval_s: float = 0.2,
        replica_set: Sequence[str] = (),
        begin: Callable[[], None] | None = None,
        step_down: Callable[[str], None] | None = None,
        epoch: Callable[[], int] | None = None,
        place: Callable[[], tuple[int, int]] | None = None,
        relocate: Callable[[dict[str, Any]], bool] | None = None,
        view: Callable[[], dict[str, Any]] | None = None,
        fence: Callable[[int], None] | None = None,
        follow_epoch: Callable[[int, int], None] | None = None,
    ) -> None:
        if (primary is None and not replica_set) or (
            replica_set
            and (advertise not in replica_set or begin is None or step_down is None or not epoch)
        ):
            raise ValueError(
                f"a member of a replica set needs its own address among {list(replica_set)} "
                f"(got {advertise!r}) and what to do to begin as primary"
            )
        self.primary = primary
        self._advertise = advertise
        # This shard's place now (a re-shard moves it: `place`).
        self._place = place or (lambda: (shard_index, num_shards))
        self._relocate = relocate
        self._token = auth_token
        self._take_over = take_over
        self._caught_up = caught_up
        self._takeover_after_s = takeover_after_s
        # Each greeting of the primary waits half the takeover time (at most
        # 1 s): a takeover follows two greetings at least that went
        # unanswered, never one slow answer.
        self._greeting_ms = max(50, int(1000 * min(1.0, takeover_after_s / 2)))
        self._probe_interval_s = probe_interval_s
        self._replica_set = list(replica_set)
        self._begin = begin
        self._step_down = step_down
        self._epoch = epoch or (lambda: 0)
        self._view = view or (lambda: {"epoch": 0, "version": 0, "members": ""})
        # Epoch fencing (`_native.Shard.fence`, `follow_epoch`).
        self._fence = fence or (lambda epoch: None)
        self._follow_epoch = follow_epoch or (lambda epoch, lineage: None)
        # The standbys its primary's last Hello named; guarded by _lock.
        self._hello_peers: set[str] = set()
        # (candidate, until): this standby granted that one's claim (or, a
        # candidate itself, claims): it does not take over meanwhile.
        self._promise: tuple[str, float] | None = None
        self._waiting_for = ""  # why it last did not take over (logged once)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlt-standby", daemon=True)
        self._admin: str | None = None
        self._incarnation = 0  # the primary process's, when this standby attached
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self.took_over = False
        self.began = False
        self._beginning = False  # begin() runs (a load): others wait
        self.takeovers = 0
        self.error = ""
        self._repeated = Repeated(log)  # the link's thread's repeating complaints

    def caught_up(self) -> bool:
        """A standby holds every table its primary had (it may take over)."""
        return self._caught_up()

    @property
    def role(self) -> str:
        """The role: "joining" (a replica set member learning it),
        "beginning" (one loading to begin as the primary), "standby", or
        "primary" (it took over, or began as the primary)."""
        if self.took_over or self.began:
            return "primary"
        if self._beginning:
            return "beginning"
        return "standby" if self.primary is not None else "joining"

    def start(self) -> StandbyLink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._leave()
        self._close_channel()

    def _leave(self) -> None:
        """As this standby stops (it takes over no more: its link's thread
        ended), tells its primary to stop replicating here at once, so the
        primary's writes do not wait for it until it comes back (the last
        standby) or the standby timeout (another). Best effort: a primary
        that does not hear it waits as for a standby down."""
        if self.role != "standby" or not self._incarnation or self._admin is None:
            return  # it serves, never attached, or is between primaries
        index, count = self._place()
        request = dlt_pb2.AttachStandbyRequest(
            address=self._advertise, shard_index=index, num_shards=count, leaving=True
        )
        try:
            self._call("AttachStandby", request, timeout=2)
        except grpc.RpcError as e:
            # It stops too (a launch's end: its server cancels the call), or died.
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                log.info(
                    "could not reach %s as this standby stops (it stops too, or is cut off: it "
                    "then detaches this standby as one down)", self.primary,
                )  # fmt: skip
            else:
                log.warning(
                    "could not tell %s that this standby stops: %s: %s",
                    self.primary, e.code().name, e.details(),
                )  # fmt: skip
            return
        except Exception as e:  # noqa: BLE001 - best effort: the stop goes on
            log.warning("could not tell %s that this standby stops: %s", self.primary, e)
            return
        log.info("told %s that this standby stops", self.primary)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def _greet(self, address: str, replica: bool = False) -> dict[str, Any]:
        """One Hello to `address`; INVALID_ARGUMENT when it serves another
        shard."""
        info = _native.hello(address, self._token, timeout_ms=1000, replica=replica)
        if self._relocate is not None and self.role != "primary":
            self._relocate(info)  # restarted with the layout before a re-shard
        if not self._same_place(info):
            index, count = self._place()
            raise errors.InvalidArgumentError(
                f"{address} is shard {info['shard_index']} of {info['num_shards']}; this "
                f"standby is shard {index} of {count}"
            )
        return info

    def _admin_address(self) -> str:
        """The primary's admin address, from its Hello."""
        assert self.primary is not None
        info = self._greet(self.primary)
        return grpc_util.admin_address(self.primary, info["admin_port"])

    def _call(self, method: str, request: Any, timeout: float) -> Any:
        if self._stub is None:
            assert self._admin is not None
            self._channel = _peer_channel(self._admin)
            self._stub = dlt_pb2_grpc.ShardAdminStub(self._channel)
        return getattr(self._stub, method)(
            request, timeout=timeout, metadata=grpc_util.bearer(self._token)
        )

    def _find_admin(self) -> None:
        """Points the control-plane channel at the primary's admin port as
        its Hello says now (a restarted primary may have another)."""
        admin = self._admin_address()
        if admin != self._admin:
            self._close_channel()
            self._admin = admin

    def _attach(self) -> None:
        self._find_admin()
        index, count = self._place()
        # This standby chose the primary: it takes its rounds, and no older
        # primary's (a replaced one that comes back, docs/replication.md).
        # While it promised another standby the takeover it follows only that
        # one: the primary it fenced may wake before that one serves.
        assert self.primary is not None
        promised = self.promised_to()
        if promised and promised not in (self._advertise, self.primary):
            raise errors.UnavailableError(
                f"it promised {promised} to let it take over: it follows no other primary "
                "until that one serves or the promise ends"
            )
        info = _native.hello(self.primary, self._token, timeout_ms=5000)
        self._follow_epoch(int(info["epoch"]), int(info["lineage"]))
        self._heard_peers(info)
        reply = self._call(
            "AttachStandby",
            dlt_pb2.AttachStandbyRequest(
                address=self._advertise, shard_index=index, num_shards=count
            ),
            timeout=10,
        )
        self._incarnation = reply.incarnation
        self.error = ""
        log.info("standby of %s (%s replication)", self.primary, reply.replication)

    def _alive(self) -> bool:
        """True when the primary greets (a dead process refuses at once)."""
        assert self.primary is not None
        try:
            info = _native.hello(self.primary, self._token, timeout_ms=self._greeting_ms)
        except errors.DltError as e:
            self.error = str(e)
            return False
        self._heard_peers(info)
        return True

    def _heard_peers(self, info: dict[str, Any]) -> None:
        """The standbys the primary's Hello `info` names are this one's peers
        now (one the primary detached is no peer any more). Taken when this
        standby attaches too: the primary may die before the first probe,
        and a standby that knew no peer never found the one that took over."""
        with self._lock:
            self._hello_peers = {a for a in info["standbys"].split("|") if a}

    def _check(self) -> bool:
        """True when the primary is gone: it restarted (a new process at
        its address holds none of its rows) after this standby caught up,
        or another standby of the shard took over. Attaches again when the
        primary no longer replicates here for another reason."""
        self._find_admin()
        stats = self._call("Stats", dlt_pb2.StatsRequest(), timeout=5)
        if any(s.address == self._advertise for s in stats.standbys):
            return False
        restarted = stats.incarnation != self._incarnation
        if restarted and self._caught_up():
            return True  # never copy an empty restart over the rows held here
        if self._serving_peer() is not None:
            return True  # another standby took over: follow it
        attached = {s.address for s in stats.standbys}  # the restart's own
        if restarted and self._peer_holds_copy(attached):
            return False  # that one takes over; this one follows it then
        self._attach()
        return False

    def _survey(self) -> str:
        """Looks at every other member once: the address of the one serving
        trainers (the newest epoch's), or _WAIT (another member holds a whole
        copy and takes over soon, or one that comes first is learning its
        role too), _BEGIN (the others answer but hold no whole copy), _ALONE
        (none answers)."""
        rank = self._replica_set.index(self._advertise)
        # (epoch, -order, address): the newest copy, the earliest member of
        # those at the same epoch (as _watch_members breaks the tie).
        serving: list[tuple[int, int, str]] = []
        verdict = _ALONE
        earlier_silent = False  # a member before this one in the list did not answer
        for order, member in enumerate(self._replica_set):
            if member == self._advertise:
                continue
            try:
                serving.append((self._greet(member)["epoch"], -order, member))
                continue
            except (errors.InvalidArgumentError, errors.UnauthenticatedError):
                raise
            except errors.DltError:
                pass  # a standby, a member learning its role, or no process
            try:
                info = self._greet(member, replica=True)
                stats = member_stats(member, info["admin_port"], self._token)
            except (errors.InvalidArgumentError, errors.UnauthenticatedError):
                raise
            except errors.FailedPreconditionError:
                # "not a standby": it serves trainers (its first Hello failed
                # for another reason, or it began since).
                serving.append((0, -order, member))
                continue
            except (errors.DltError, grpc.RpcError, OSError) as e:
                self.error = f"{member}: {e}"  # no process, or no answer
                earlier_silent |= order < rank
                continue
            if stats.role == "primary":
                # It began (or took over) between the two greetings: it serves.
                serving.append((int(stats.epoch), -order, member))
                continue
            if (
                (stats.role == "standby" and stats.caught_up)
                or stats.role == "beginning"
                or (stats.role == "joining" and order < rank)
            ):
                verdict = _WAIT
            elif verdict == _ALONE:
                verdict = _BEGIN  # a standby of a dead primary without a whole copy
        if serving:
            return max(serving)[2]
        # One that comes first and does not answer may be starting: begin
        # only after waiting for it (BEGIN_ALONE_AFTER_S), as when alone.
        return _ALONE if verdict == _BEGIN and earlier_silent else verdict

    def choose_role(self) -> bool:
        """Learns this replica set member's role: follows the member that
        serves (True), or begins as the primary (False, `begin` called).
        The first member begins when no other holds a whole copy, or none
        answered in 3 surveys; any other also when none has answered for
        BEGIN_ALONE_AFTER_S. A begin that fails (its load) is logged and
        tried again. Returns False when stopped first."""
        first = self._replica_set.index(self._advertise) == 0
        alone_since = time.monotonic()
        alone_surveys = 0
        while not self._stop.is_set():
            try:
                found = self._survey()
            except errors.DltError as e:  # a member of another shard, a wrong token
                self.error = str(e)
                self._repeated.log(
                    "survey", logging.ERROR, "replica set %s: %s", "|".join(self._replica_set), e
                )
                self._stop.wait(_SURVEY_INTERVAL_S * 10)
                continue
            now = time.monotonic()
            if found not in (_WAIT, _BEGIN, _ALONE):
                self.primary = found
                log.info("replica set: %s serves; following it", found)
                return True
            if found != _ALONE:
                alone_since, alone_surveys = now, 0
            else:
                alone_surveys += 1
            if found == _BEGIN or (
                found == _ALONE
                and ((first and alone_surveys >= 3) or now - alone_since >= BEGIN_ALONE_AFTER_S)
            ):
                log.warning(
                    "replica set: no other member serves or holds a whole copy; beginning as "
                    "the primary"
                )
                assert self._begin is not None
                self._beginning = True
                try:
                    self._begin()
                except Exception as e:  # noqa: BLE001 - a failed load: logged, tried again
                    self.error = f"beginning as the primary: {e}"
                    log.error("replica set: %s; trying again", self.error)
                    self._stop.wait(_SURVEY_INTERVAL_S * 10)
                    continue
                finally:
                    self._beginning = False
                self.began = True
                return False
            self._stop.wait(_SURVEY_INTERVAL_S)
        return False

    def _run(self) -> None:
        follow = self.primary is not None or self.choose_role()
        while not self._stop.is_set():
            if follow and not self._follow():
                return  # stopped
            if not self._replica_set:
                return  # a --standby-of standby that took over
            newer = self._watch_members()
            if newer is None:
                return  # stopped
            self._follow_instead(newer)
            follow = True

    def _follow(self) -> bool:
        """Keeps this standby attached to its primary until it takes over
        (True) or is stopped (False); follows another standby of the shard
        instead once that one took over."""
        while not self._stop.is_set():
            self._admin = None
            failures = 0
            while not self._stop.is_set() and self._admin is None:
                try:
                    self._attach()
                except (errors.DltError, grpc.RpcError, OSError) as e:
                    self.error = f"attaching to {self.primary}: {e}"
                    self._repeated.log(
                        "attach", logging.WARNING,
                        "standby: %s; trying again (if another process of this shard serves "
                        "now, a standby follows it when started with --standby-of its address, "
                        "or when every process has --replica-set: docs/replication.md)",
                        self.error,
                    )  # fmt: skip
                    self._admin = None
                    failures += 1
                    if failures % 6 == 0:  # it died or stepped down: another may serve
                        serving = self._serving_peer()
                        if serving is not None and serving != self.primary:
                            log.warning("standby: %s serves now: following it", serving)
                            self.primary = serving
                    self._stop.wait(0.5)
            outcome = self._watch_primary()
            if outcome is None:
                return False  # stopped
            if outcome == _TAKE:
                return True
            log.warning("standby: %s took over from %s: following it", outcome, self.primary)
            self.primary = outcome
        return False

    def _watch_primary(self) -> str | None:
        """Watches the primary until it is gone: _TAKE once this standby
        took over, the address of another standby that took over (to
        follow), None when stopped."""
        unreachable_since: float | None = None
        checked = 0.0
        while not self._stop.wait(self._probe_interval_s):
            now = time.monotonic()  # when it was asked
            if self._alive():
                unreachable_since = None
                if now - checked < _CHECK_INTERVAL_S:
                    continue
                checked = now
                try:
                    restarted = self._check()
                except (errors.DltError, grpc.RpcError, OSError) as e:
                    self.error = f"asking {self.primary}: {e}"
                    restarted = False
                if not restarted:
                    continue
                why = f"primary {self.primary} restarted with none of its rows"
            else:
                # Unreachable since the first greeting it did not answer was
                # sent, counted to the end of this one: a silent primary is
                # taken over after its second greeting times out (~1.2 s),
                # not its third (~2.3 s before).
                unreachable_since = unreachable_since or now
                now = time.monotonic()
                slack = min(_TIMEOUT_SLACK_S, self._takeover_after_s / 10)
                if now - unreachable_since < self._takeover_after_s - slack:
                    continue
                why = f"primary {self.primary} unreachable for {now - unreachable_since:.1f} s"
            if not self._caught_up():
                # It cannot take over; another standby may have.
                serving = self._serving_peer()
                if serving is not None:
                    return serving
                self._repeated.log(
                    "not caught up", logging.ERROR,
                    "%s, but this standby had not caught up with it: not taking over (%s)",
                    why, self.error,
                )  # fmt: skip
                continue
            outcome = self._elect()
            if outcome == _TAKE:
                self._take_over_now(why)
            if outcome is not None:
                return outcome
        return None

    def _peer_view(self, peer: str) -> tuple[str, Any, int] | None:
        """What another standby or member of this shard is: ("serves", its
        Hello, admin port) when it serves trainers, ("standby", its Stats,
        admin port) when it follows, ("other", its Hello, admin port) when it
        is another shard's now (a re-shard moved it), None when it does not
        answer."""
        try:
            info = _native.hello(peer, self._token, timeout_ms=1000)
            kind = "serves" if self._same_place(info) else "other"
            return kind, info, info["admin_port"]
        except errors.DltError:
            pass  # a standby (or one learning its role), or no process
        try:
            info = _native.hello(peer, self._token, timeout_ms=1000, replica=True)
            if not self._same_place(info):
                return "other", info, info["admin_port"]
            stats = member_stats(peer, info["admin_port"], self._token)
            return "standby", stats, info["admin_port"]
        except (errors.DltError, grpc.RpcError, OSError):
            return None

    def _same_place(self, info: dict[str, Any]) -> bool:
        return (info["shard_index"], info["num_shards"]) == self._place()

    def known_peers(self) -> list[str]:
        """The shard's other processes (Stats `peers`): the standbys its primary's last
        Hello named, the in-sync set the primary told this standby (which
        may be the only news of one that attached just before the primary
        died), and a replica set's members."""
        told = {m for m in self._view()["members"].split("|") if m}
        with self._lock:
            peers = self._hello_peers | told | set(self._replica_set)
        return sorted(peers - {self._advertise, self.primary or ""})

    def _first_peer(
        self, test: Callable[[str, Any], bool], besides: Collection[str] = ()
    ) -> str | None:
        """The first known peer (not among `besides`) whose `_peer_view`
        (kind, Hello or Stats) passes `test`."""
        for peer in self.known_peers():
            if peer in besides:
                continue
            found = self._peer_view(peer)
            if found is not None and test(found[0], found[1]):
                return peer
        return None

    def _serving_peer(self) -> str | None:
        """Another process of this shard that serves trainers at a newer
        epoch than this standby's primary (it took over), if any."""
        epoch = self._epoch()
        return self._first_peer(lambda kind, what: kind == "serves" and what["epoch"] > epoch)

    def _peer_holds_copy(self, besides: set[str]) -> bool:
        """Another standby of this shard, not among `besides` (those follow
        a restart: their copy is the restart's), holds a whole copy (it may
        take over)."""
        found = self._first_peer(lambda kind, what: kind == "standby" and what.caught_up, besides)
        return found is not None

    def _elect(self) -> str | None:
        """This standby's primary is gone and it is caught up: who takes
        over (docs/replication.md, "Several standbys"). _TAKE when this one
        is to, now (every other standby that answers granted its claim);
        the address of another that took over already (a newer epoch), to
        follow; None to wait and ask again (another is to take over, an
        in-sync standby does not answer, or a claim was refused).

        Every standby this one knows (and those their answers name) must
        answer: one that does not might know a newer in-sync set leaving
        this one out (a primary detaches a standby down for
        --detach-standby-after, so a standby long dead stops counting). The
        newest in-sync set among the answers names the standbys holding
        every acknowledged write; the first of them that is caught up takes
        over."""
        epoch = self._epoch()
        mine = self._view()
        views = {self._advertise: (mine["epoch"], mine["version"], mine["members"])}
        answered: dict[str, tuple[Any, int]] = {}
        asked: set[str] = set()
        silent: list[str] = []
        pending = self.known_peers()
        while pending:
            peer = pending.pop()
            asked.add(peer)
            found = self._peer_view(peer)
            if found is None:
                silent.append(peer)
                continue
            kind, what, admin_port = found
            if kind == "serves" and what["epoch"] > epoch:
                return peer  # it took over already
            if kind != "standby":
                continue  # an older copy (a primary come back empty), or another shard's
            answered[peer] = (what, admin_port)
            views[peer] = (what.insync_epoch, what.insync_version, "|".join(what.insync))
            named = set(what.peers) | set(what.insync)
            skip = asked | set(pending) | {self._advertise, self.primary or ""}
            pending += sorted(named - skip)
        if silent:
            return self._waiting(
                f"standby {', '.join(sorted(silent))} of this shard does not answer (it may "
                "hold writes this one lacks)"
            )
        newest = max(views.values(), key=lambda v: (v[0], v[1]))
        members = [m for m in newest[2].split("|") if m] or [self._advertise]
        if self._advertise not in members:
            return self._waiting(
                f"the newest in-sync set (epoch {newest[0]}, version {newest[1]}: "
                f"{'|'.join(members)}) leaves this standby out: another holds writes it lacks"
            )
        able = [
            m for m in members
            if m == self._advertise
            or (m in answered and answered[m][0].role == "standby" and answered[m][0].caught_up)
        ]  # fmt: skip
        if able[0] != self._advertise:
            return self._waiting(f"{able[0]} comes first in the in-sync set: it takes over")
        now = time.monotonic()
        with self._lock:
            if self._promise is not None and self._promise[1] > now:
                if self._promise[0] != self._advertise:
                    return self._waiting(f"it promised {self._promise[0]} to let it take over")
            self._promise = (self._advertise, now + PROMISE_S)
        index, count = self._place()
        for peer, (_, admin_port) in answered.items():
            request = dlt_pb2.ClaimTakeoverRequest(
                candidate=self._advertise, shard_index=index, num_shards=count,
                insync_epoch=newest[0], insync_version=newest[1],
            )  # fmt: skip
            try:
                admin = grpc_util.admin_address(peer, admin_port)
                with _peer_channel(admin) as channel:
                    reply = dlt_pb2_grpc.ShardAdminStub(channel).ClaimTakeover(
                        request, timeout=5, metadata=grpc_util.bearer(self._token)
                    )
            except (errors.DltError, grpc.RpcError, OSError) as e:
                reply = dlt_pb2.ClaimTakeoverResponse(granted=False, reason=str(e))
            if not reply.granted:
                with self._lock:
                    self._promise = None
                return self._waiting(f"{peer} refused: {reply.reason}")
        return _TAKE

    def view(self) -> dict[str, Any]:
        """The in-sync set this standby's primary told it last."""
        return self._view()

    def promised_to(self) -> str:
        """The standby this one granted a claim to take over, while the
        promise holds ("" : none; its own address while it claims)."""
        with self._lock:
            promise = self._promise
        return promise[0] if promise is not None and promise[1] > time.monotonic() else ""

    def _waiting(self, why: str) -> str | None:
        """Logs why this standby does not take over (once per reason); None."""
        if why != self._waiting_for:
            log.warning("primary %s is gone; not taking over: %s", self.primary, why)
        self._waiting_for = self.error = why
        return None

    def grant(self, candidate: str, place: tuple[int, int], insync: tuple[int, int]) -> str:
        """Another standby of this shard claims to take over: "" when this
        one grants it (and does not take over itself for PROMISE_S), else
        why not. `insync`: the newest in-sync set's (epoch, version) that
        the candidate knows."""
        if place != self._place():
            return f"this process is shard {self._place()[0]} of {self._place()[1]}"
        if self.role == "primary":
            return f"this member serves the shard (epoch {self._epoch()})"
        now = time.monotonic()
        with self._lock:
            promise = self._promise
        if promise is not None and promise[1] > now and promise[0] != candidate:
            return f"it promised {promise[0]}"
        if self.primary is not None and not self._primary_gone():
            return f"its primary {self.primary} still answers here"
        mine = self._view()
        members = [m for m in mine["members"].split("|") if m]
        if (mine["epoch"], mine["version"]) > insync and candidate not in members:
            return (
                f"its in-sync set (epoch {mine['epoch']}, version {mine['version']}: "
                f"{mine['members']}) is newer and leaves {candidate} out"
            )
        with self._lock:
            if self._promise is not None and self._promise[1] > now:
                if self._promise[0] != candidate:
                    return f"it promised {self._promise[0]}"
            self._promise = (candidate, now + PROMISE_S)
        # The primary it followed is fenced: this standby takes no round of
        # it again and tells it, when it connects, that a newer one may serve.
        self._fence(self._epoch() + 1)
        return ""

    def _primary_gone(self) -> bool:
        """The primary does not answer here, or is a new process (restarted
        with none of its rows)."""
        assert self.primary is not None
        try:
            info = _native.hello(self.primary, self._token, timeout_ms=1000)
            if not self._incarnation:
                return False  # never attached: it answers, that is all this one knows
            stats = member_stats(self.primary, info["admin_port"], self._token)
        except (errors.DltError, grpc.RpcError, OSError):
            return True
        return bool(stats.incarnation != self._incarnation)

    def _watch_members(self) -> str | None:
        """While this replica set member serves: the address of another
        member found serving a newer copy (a higher epoch, or the same epoch
        and earlier in the list: two members that both began), which this
        one must follow instead; None when stopped."""
        me = self._replica_set.index(self._advertise)
        while not self._stop.wait(_CHECK_INTERVAL_S):
            epoch = self._epoch()
            for order, member in enumerate(self._replica_set):
                if member == self._advertise:
                    continue
                try:
                    theirs = int(self._greet(member)["epoch"])
                except errors.DltError:
                    continue  # a standby, one learning its role, or no process
                if theirs > epoch or (theirs == epoch and order < me):
                    why = (
                        f"epoch {theirs}, newer than this copy's {epoch}"
                        if theirs > epoch
                        else f"epoch {theirs} as this copy does, and comes first in the set"
                    )
                    log.error("replica set: %s serves %s: following it", member, why)
                    return member
        return None

    def _follow_instead(self, primary: str) -> None:
        """Stops serving trainers and becomes the standby of `primary` (its
        tables replace this copy's)."""
        assert self._step_down is not None
        self.primary = primary
        self.took_over = self.began = False  # a standby's answers from now on
        self._step_down(primary)

    def _take_over_now(self, why: str) -> None:
        log.warning("%s: taking over", why)
        self._take_over()
        self.takeovers += 1
        self.took_over = True  # serving now
        self._close_channel()


def peer_tls() -> tls.TlsConfig | None:
    """The TLS this process calls its peers' control planes with: the
    environment's (TF_DLT_TLS_*), every file read. Settings that make no
    client (a certificate without its key, a file it cannot read) raise
    FailedPreconditionError naming them: checked as a replica-set member
    starts (tf_dlt.server.main), and at each call, which the standby's loops
    report and retry (a ValueError ended its thread)."""
    try:
        secure = tls.TlsConfig.from_env()
        if secure is not None:
            secure.channel_credentials()
    except ValueError as e:
        raise errors.FailedPreconditionError(
            f"the TLS this process calls its peers with (TF_DLT_TLS_*): {e}"
        ) from None
    return secure


def _peer_channel(admin: str) -> grpc.Channel:
    """A channel to a peer's control plane, over peer_tls()."""
    return tls.channel(admin, peer_tls())


def member_stats(
    address: str, admin_port: int, token: str, secure: tls.TlsConfig | None = None
) -> Any:
    """Stats of the shard server whose data plane is at `address`, over
    `secure` (None: the TLS the environment names, as a Client's)."""
    admin = grpc_util.admin_address(address, admin_port)
    with tls.channel(admin, secure) if secure else _peer_channel(admin) as channel:
        return dlt_pb2_grpc.ShardAdminStub(channel).Stats(
            dlt_pb2.StatsRequest(), timeout=5, metadata=grpc_util.bearer(token)
        )


def describe(
    shard: _native.Shard, standbys: Standbys | None, link: StandbyLink | None
) -> dict[str, Any]:
    """What Stats and the metrics report of replication."""
    if link is not None and link.role != "primary":
        return {
            "role": link.role,
            "standby_of": link.primary or "",
            "standbys": [],
            "epoch": shard.epoch,
            "caught_up": link.caught_up(),
            "insync": link.view(),
            "promised_to": link.promised_to(),
            "peers": link.known_peers(),
            "standby_error": link.error,
        }
    return {
        "epoch": shard.epoch,
        # A primary that met a standby of a newer one serves no trainer.
        "role": "replaced" if shard.superseded_by else "primary",
        "standby_of": "",
        "replication": standbys.replication if standbys is not None else "",
        "standbys": standbys.statuses() if standbys is not None else [],
        "takeovers": link.takeovers if link is not None else 0,
        "insync": standbys.view() if standbys is not None else {},
    }
