"""ShardServer: one shard's process-level lifecycle. It owns the native shard
(tables), the C++ data-plane server and the control plane (AdminServer:
ShardAdmin, grpc.health.v1, reflection), and stops them in order."""

from __future__ import annotations

import atexit
import logging
import math
import numbers
import os
import resource
import socket
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from grpc_health.v1 import health_pb2

from tf_dlt import _native, errors, sizes
from tf_dlt.checkpoint import shard_files
from tf_dlt.cluster import MAX_REPLICAS, is_address
from tf_dlt.server import follower, metrics, paths, replication, reshard, service
from tf_dlt.server.admin_server import SERVICE_NAME, AdminServer
from tf_dlt.server.follower import Follower, FollowStatus

log = logging.getLogger("tf_dlt.server")

# Health service of a follower: SERVING while it serves the newest committed
# checkpoint of its directory, NOT_SERVING while behind (it still serves).
FOLLOW_SERVICE = "tf_dlt.follow"
# Health service of every shard process: SERVING while it holds a whole copy
# of its shard's rows (`ShardServicer.holds_whole_copy`), NOT_SERVING while
# a replica set's member loads, copies its primary or learns its role. The
# readiness a rolling restart or a drain of a replica set waits for before it
# stops another process of the shard (docs/kubernetes.md); "" stays SERVING
# while the process answers (liveness).
COPY_SERVICE = "tf_dlt.copy"

# File descriptors a shard process keeps beside its connections: checkpoint
# and tier files, the admin server's own, logs. With the admin plane's
# connections they are left out of the data plane's automatic cap, so that
# neither plane can take the descriptors the other, or a save, needs.
OTHER_FDS = 256
# The admin plane's automatic connection cap: at most this, and at most a
# sixteenth of the hard open-file limit.
ADMIN_CONNECTIONS = 4096


def _automatic_admin_connections() -> int:
    """The admin plane's connection cap for --max-admin-connections 0."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return ADMIN_CONNECTIONS
    return max(8, min(ADMIN_CONNECTIONS, hard // 16))


def _listeners(bind: str) -> int:
    """How many sockets gRPC listens on for `bind` (a host name may stand
    for an IPv4 and an IPv6 address, each with a listener and a connection
    cap of its own)."""
    try:
        found = socket.getaddrinfo(bind, 0, type=socket.SOCK_STREAM)
    except OSError:
        return 1
    return max(1, len({info[4][0] for info in found}))


def available_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU
    quota (a container's limit), at least 1."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


class ShardServer:
    """A shard server, built unstarted; `start()` binds (port 0 picks a free
    port) and `stop()` shuts down in order. Usable as a context manager.

    Args:
        shard_index: this shard's index, 0 <= shard_index < num_shards.
        num_shards: number of shards of the cluster.
        bind: address both planes listen on.
        port: data-plane port (0: any free port).
        admin_port: control-plane (gRPC) port (0: any free port).
        auth_token: when non-empty, required on both planes.
        max_frame_bytes: largest data-plane frame payload accepted.
        threads: data-plane worker threads (0: one per CPU this process may
            use).
        max_connections: authenticated data-plane connections at once (0:
            as many as the open-file limit allows).
        max_unauthenticated: connections that have not said Hello yet; a
            new one past this closes the oldest.
        max_admin_connections: control-plane connections at once; past it
            a new one is closed (0: 4,096, or a sixteenth of the hard
            open-file limit where that is less; per listening address).
            The data plane's automatic cap leaves their file descriptors
            out. One that does not finish gRPC's handshake within
            hello_timeout_s, or makes no call for 10 s, is closed.
        hello_timeout_s: a connection must say Hello within this.
        idle_timeout_s: an authenticated connection idle this long is
            closed (0: never).
        io_timeout_s: once a frame starts, the rest must arrive within this,
            and a reply must be taken within this.
        max_buffered_bytes: frames and replies held over all connections.
        load_from: checkpoint to load before serving.
        stop_grace_s: how long `stop()` lets control-plane calls (a Save)
            finish.
        metrics_port: Prometheus /metrics HTTP port (0: any free port;
            None: no metrics endpoint).
        tls: (cert, key, client CA or None) PEM files: serve the control
            plane over TLS (with a client CA: mutual TLS); None: plaintext.
        checkpoint_roots: where Save and Load may go
            (`tf_dlt.server.paths.CheckpointRoots`); empty: any local path
            or object store.
        load_timeout_s: a prepared or committed-but-unfinished cluster load
            is dropped (prepared) or made final (committed) after this.
        sweep_interval_s: how often rows past their table's ttl are
            removed (one stripe of a table at a time).
        read_only: serve checkpoints only: pushes, assignments, saves,
            loads and table changes are refused, pulls never create rows,
            nothing expires.
        follow: with `read_only`, a directory of checkpoints to follow
            (`tf_dlt.server.follower`): the newest chain, then every delta
            as it is committed.
        follow_interval_s: how often `follow` is read.
        memory_budget: bytes of resident memory this process may use (0:
            no budget), or a size as `--memory-budget` takes it ("48GiB").
            Past it the coldest rows move to `storage_dir`, or
            without one are evicted (docs/tiered_storage.md).
        storage_dir: a local SSD directory for the disk tier: a cache of
            this shard's state, emptied at start (a restart loads from a
            checkpoint).
        standby_of: the data-plane address of this shard's primary: serve
            as its hot standby (docs/replication.md), taking over when it
            stays unreachable for `takeover_after_s`.
        replication_mode: "sync" (a push is acknowledged once the standby
            has it) or "async", for standbys that attach to this shard.
        advertise: this shard's data-plane address as its primary reaches
            it (default: `address`).
        takeover_after_s: how long a standby's primary must stay
            unreachable before the standby takes over.
        detach_standby_after_s: a primary detaches a standby down this long
            (it leaves the Hello; the others stop waiting for its answer to
            choose who takes over), which attaches again when back.
        standby_timeout_s: how long a sync push waits for one standby to
            apply it before the primary stops counting on that standby (it
            leaves the in-sync set and is copied afresh); keep it below the
            clients' `request_timeout`.
        replica_set: the data-plane addresses of this shard's processes
            (2 to `tf_dlt.cluster.MAX_REPLICAS`), this one's (`advertise`)
            among them: at start it follows the one that serves, or begins
            as the primary (then loading `load_from`) when no other holds a
            whole copy (`replication.StandbyLink.choose_role`).
    """

    def __init__(
        self,
        shard_index: int = 0,
        num_shards: int = 1,
        *,
        bind: str = "127.0.0.1",
        port: int = 0,
        admin_port: int = 0,
        auth_token: str = "",
        max_frame_bytes: int = _native.DEFAULT_MAX_FRAME_BYTES,
        threads: int = 0,
        max_connections: int = 0,
        max_unauthenticated: int = 256,
        max_admin_connections: int = 0,
        hello_timeout_s: float = 5.0,
        idle_timeout_s: float = 600.0,
        io_timeout_s: float = 30.0,
        max_buffered_bytes: int = 1 << 30,
        load_from: str | None = None,
        stop_grace_s: float = 60.0,
        metrics_port: int | None = None,
        tls: tuple[str, str, str | None] | None = None,
        checkpoint_roots: Sequence[str] = (),
        load_timeout_s: float = 600.0,
        sweep_interval_s: float = 10.0,
        read_only: bool = False,
        follow: str | None = None,
        follow_interval_s: float = 5.0,
        memory_budget: int | float | str = 0,
        storage_dir: str | None = None,
        standby_of: str | None = None,
        replication_mode: str = "sync",
        advertise: str | None = None,
        takeover_after_s: float = 1.0,
        detach_standby_after_s: float = 60.0,
        standby_timeout_s: float = 10.0,
        replica_set: Sequence[str] = (),
    ) -> None:
        if not sweep_interval_s > 0:
            raise ValueError(f"sweep_interval_s must be > 0, got {sweep_interval_s}")
        if follow and not read_only:
            raise ValueError("following a checkpoint directory needs read_only")
        if follow and load_from:
            raise ValueError("give load_from or follow, not both")
        # Bytes, or a size as the flag takes it ("300MiB"); a float or a
        # string reached the native core as a raw TypeError.
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (numbers.Real, str)):
            raise ValueError(f"memory_budget must be a number of bytes, got {memory_budget!r}")
        memory_budget = sizes.parse_bytes(str(memory_budget)) if memory_budget else 0
        if storage_dir is not None and not storage_dir.strip():
            # (an unset $TIER_DIR: no tier at all, rows past the budget evicted)
            raise ValueError("storage_dir must name a directory, got an empty one (None: no tier)")
        if standby_of and not is_address(standby_of):
            # It was taken, and the standby logged "must be host:port" forever.
            raise ValueError(f"standby_of {standby_of!r} must be host:port")
        # An address its peers could not reach was taken: a replica set's
        # member stayed "joining" for good, and a standby attached under an
        # address its primary never reached (every sync push then failed).
        for what, peer in (("advertise", advertise), *(("replica_set", a) for a in replica_set)):
            if peer is not None and not is_address(peer):
                raise ValueError(
                    f"{what} {peer!r} must be host:port (an IPv6 host in []) with a port 1 to 65535"
                )
        if standby_of and (read_only or load_from):
            raise ValueError("a standby takes its primary's tables: no read_only or load_from")
        if standby_of and standby_of in _own_addresses(bind, port, advertise):
            raise ValueError(
                f"standby_of {standby_of!r} is this server's own address: a standby follows "
                "another process, its shard's primary"
            )
        if replica_set and (standby_of or read_only):
            raise ValueError("a replica set's member learns its primary: no standby_of, read_only")
        if replica_set and (
            not 2 <= len(replica_set) <= MAX_REPLICAS
            or len(set(replica_set)) != len(replica_set)
            or advertise not in replica_set
        ):
            raise ValueError(
                f"a replica set has 2 to {MAX_REPLICAS} distinct members (a primary "
                f"and its standbys), this one's address (advertise, {advertise!r}) among them, "
                f"got {list(replica_set)}"
            )
        if storage_dir and not memory_budget:
            raise ValueError(
                "a storage dir (--storage-dir) needs a memory budget (--memory-budget): rows "
                "move to disk past it"
            )
        roots = paths.CheckpointRoots(checkpoint_roots)
        if load_from:  # refused at once, before the process starts serving
            roots.check(load_from, "Load")
        self.shard = _native.Shard(shard_index, num_shards)
        self.shard.configure_memory(memory_budget, storage_dir or "")
        self._sweep_interval_ms = max(1, int(sweep_interval_s * 1000))
        self._metrics_port_requested = metrics_port
        self._metrics: Any = None
        self.metrics_port = 0
        self._bind = bind
        self._auth_token = auth_token
        self._load_from = load_from
        self._stop_grace_s = stop_grace_s
        admin_connections = max_admin_connections or _automatic_admin_connections()
        self.data_server = _native.DataServer(
            self.shard,
            bind=bind,
            port=port,
            max_connections=max_connections,
            auth_token=auth_token,
            max_frame_bytes=max_frame_bytes,
            io_timeout_ms=max(1, int(io_timeout_s * 1000)),
            worker_threads=threads or available_cpus(),
            max_unauthenticated=max_unauthenticated,
            hello_timeout_ms=max(1, int(hello_timeout_s * 1000)),
            idle_timeout_ms=int(idle_timeout_s * 1000),
            max_buffered_bytes=max_buffered_bytes,
            other_fds=OTHER_FDS + admin_connections * _listeners(bind),
        )
        self.servicer = service.ShardAdminServicer(
            self.shard,
            self.data_server,
            roots,
            load_timeout_s=load_timeout_s,
        )
        self._admin = AdminServer(
            self.servicer,
            f"[{bind}]:{admin_port}" if ":" in bind else f"{bind}:{admin_port}",
            auth_token=auth_token,
            count_error=self.servicer.count_error,
            tls_files=tls,
            max_connections=admin_connections,
            handshake_timeout_s=hello_timeout_s,
        )
        self._read_only = read_only
        self.servicer.standbys = replication.Standbys(
            self.shard, self.data_server, auth_token, replication=replication_mode,
            io_timeout_s=io_timeout_s, detach_after_s=detach_standby_after_s,
            standby_timeout_s=standby_timeout_s,
        )  # fmt: skip
        self.servicer.reshard = reshard.ReshardSteps(
            self.shard, self.data_server, auth_token, io_timeout_s=io_timeout_s,
            standbys=self.servicer.standbys,
        )  # fmt: skip
        self._standby_of = standby_of
        self._advertise = advertise
        self._takeover_after_s = takeover_after_s
        self._replica_set = list(replica_set)
        self.follower: Follower | None = None
        if follow:
            roots.check(follow, "Follow")
            self.follower = Follower(
                self.shard, follow, follow_interval_s, on_change=self._follow_changed,
                reading=self.servicer.reading,
            )  # fmt: skip
        self.admin_port = 0
        self._stopped = threading.Event()
        self._whole_copy: bool | None = None  # COPY_SERVICE's last status (_watch_copy)
        self._stopping = threading.Event()  # set as a stop begins: the copy watcher ends
        self._copy_watcher: threading.Thread | None = None
        self._stop_lock = threading.Lock()
        self._replaced_logged = 0  # the epoch watch() last logged a replacement by

    @property
    def port(self) -> int:
        """The bound data-plane port (valid after start)."""
        return int(self.data_server.port)

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self._bind in ("0.0.0.0", "::", "") else self._bind
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def watch(self) -> None:
        """Logs, once each, what the data plane learned on its own: that
        this primary was replaced by a standby that took over while it was
        paused or cut off (docs/replication.md, "Who takes over"). The
        server's main loop calls it."""
        epoch = int(self.shard.superseded_by)
        if epoch == 0 or epoch == self._replaced_logged or self._replica_set:
            return  # a replica set's member steps down and says so itself
        self._replaced_logged = epoch
        log.error(
            "this primary was replaced (%s, newer than its epoch %d): it serves no trainer and "
            "acknowledges no write from now on; stop it, or restart it as a standby of the new "
            "primary (--standby-of) to keep a second copy",
            self.shard.replaced_by, self.shard.epoch,
        )  # fmt: skip

    def _watch_copy(self) -> None:
        """Health's COPY_SERVICE from what this process holds now (set where
        it changed)."""
        whole = self.servicer.holds_whole_copy()
        if whole != self._whole_copy:
            self._whole_copy = whole
            self._admin.set_health(
                COPY_SERVICE,
                health_pb2.HealthCheckResponse.SERVING
                if whole
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )

    def _watching_copy(self) -> None:
        """A process's role and copy change on their own (a standby catches
        up, a primary is replaced): looked at twice a second until it stops."""
        while not self._stopping.wait(0.5):
            self._watch_copy()

    def _follow_changed(self, status: FollowStatus) -> None:
        self.servicer.serving = follower.describe(status)
        serving = health_pb2.HealthCheckResponse.SERVING
        self._admin.set_health(
            FOLLOW_SERVICE,
            serving if status.current else health_pb2.HealthCheckResponse.NOT_SERVING,
        )

    def _take_over(self, new_epoch: bool = True) -> None:
        """This standby's primary is gone: serve trainers from now on (one
        epoch newer than it, unless it began as the primary)."""
        self.data_server.set_standby(False, new_epoch=new_epoch)
        # Its part in a re-shard under way ends: it serves trainers at the
        # layout it has, and its primary's streams are gone.
        if self.servicer.reshard is not None:
            self.servicer.reshard.abort()
        self.servicer.read_only = None
        self.shard.start_sweeper(self._sweep_interval_ms)

    def _relocate(self, hello: dict[str, Any]) -> bool:
        """A standby or replica set member restarted with the flags of the
        layout before a re-shard (or one an undone re-shard's newer epoch
        did not reach) takes the place and layout its primary (or another
        member) serves at a newer layout: another place only while it holds
        nothing yet, the same place's newer epoch at any time. Not while it
        takes part in a re-shard: its primary may switch before it, and the
        coordinator's SWITCH moves it to the shard it prepared (taking the
        place here would serve an empty one and drop what was streamed)."""
        if hello["layout_epoch"] <= self.shard.layout_epoch:
            return False
        if self.data_server.reshard_prepared is not None:
            return False
        had = (self.shard.shard_index, self.shard.num_shards, self.shard.layout_epoch)
        try:
            self.shard.take_place(
                hello["shard_index"], hello["num_shards"], hello["layout_epoch"], hello["layout"]
            )
        except errors.FailedPreconditionError:
            return False  # it holds tables of another place
        place = (hello["shard_index"], hello["num_shards"])
        log.warning(
            "the replica set serves shard %d of %d at layout epoch %d (a re-shard since; this "
            "process had shard %d of %d at layout epoch %d): taking %s",
            *place, hello["layout_epoch"], *had,
            "that layout" if had[:2] == place else "that place",
        )  # fmt: skip
        return True

    def _load(self) -> dict[str, Any]:
        assert self._load_from is not None
        with self.servicer.reading() as allow:  # the checkpoint roots hold here too
            result = shard_files.load_shard(self._load_from, self.shard, allow)
        rows = sum(t["rows"] for t in result["tables"])
        log.info("loaded %d rows from %s in %.2f s", rows, self._load_from, result["seconds"])
        return result

    def _begin_primary(self) -> None:
        """This replica set member begins as the primary: its load, then
        trainers, at the epoch it has (it took over from nobody)."""
        if self._load_from:
            self._load()
        self._take_over(new_epoch=False)

    def _step_down(self, primary: str) -> None:
        """This replica set member served, and `primary` serves a newer copy:
        it stops serving trainers and drops its tables (the standby of
        `primary` takes that one's whole)."""
        self.data_server.set_standby(True)  # also forgets the pushes applied here
        self.servicer.read_only = f"it is a standby of {primary}"
        self.shard.stop_sweeper()
        assert self.servicer.standbys is not None
        self.servicer.standbys.close()
        tables = self.shard.tables()
        for table in tables:
            self.shard.drop_table(table.name)
        log.error(
            "stepped down to follow %s: dropped %d tables of %d rows (writes only this copy "
            "took are lost)", primary, len(tables), sum(t.size() for t in tables),
        )  # fmt: skip

    def start(self) -> ShardServer:
        """Serves: loads what it was given, binds its ports and starts its
        threads. A start that fails stops what it had started. Once: a
        server started or stopped before raises FailedPreconditionError and
        stays as it was."""
        if self in _RUNNING or self._stopped.is_set():
            raise errors.FailedPreconditionError(
                f"shard {self.shard.shard_index}'s server has started before: a server starts "
                "once (make another to serve again)"
            )
        _RUNNING.add(self)
        try:
            return self._start()
        except BaseException:
            self.stop(0)
            raise

    def _start(self) -> ShardServer:
        if self._standby_of or self._replica_set:
            self.data_server.set_standby(True)
            self.servicer.read_only = (
                f"it is a standby of {self._standby_of}"
                if self._standby_of
                else "it is learning its role in its replica set"
            )
        if self._read_only:
            self.data_server.set_read_only(True)
            self.servicer.read_only = (
                f"it follows {self.follower.status().directory}"
                if self.follower is not None
                else "it serves a checkpoint"
            )
        if self._load_from and not self._replica_set:
            result = self._load()
            if self._read_only:
                self.servicer.serving = {
                    "serving_path": self._load_from, "serving_save_id": result["save_id"]
                }  # fmt: skip
        if self.follower is not None:
            self.follower.start()
        self.admin_port = self._admin.bind()
        if self._metrics_port_requested is not None:
            self._metrics, self.metrics_port = metrics.serve(
                self.servicer, self._bind, self._metrics_port_requested
            )
        self.data_server.set_admin_port(self.admin_port)
        self.data_server.start()
        if self._standby_of or self._replica_set:
            # Rows expire on the primary; removals arrive as changes.
            self.servicer.standby_link = replication.StandbyLink(
                self._standby_of or None, self._advertise or self.address,
                self.shard.shard_index, self.shard.num_shards, self._auth_token, self._take_over,
                caught_up=lambda: bool(self.data_server.standby_caught_up),
                takeover_after_s=self._takeover_after_s, replica_set=self._replica_set,
                begin=self._begin_primary, step_down=self._step_down,
                epoch=lambda: int(self.shard.epoch),
                place=lambda: (int(self.shard.shard_index), int(self.shard.num_shards)),
                relocate=self._relocate, view=lambda: self.data_server.insync_view,
                fence=self.shard.fence, follow_epoch=self.shard.follow_epoch,
            ).start()  # fmt: skip
        elif not self._read_only:  # a read-only shard serves its checkpoint as it is
            self.shard.start_sweeper(self._sweep_interval_ms)
        self._admin.start()
        for name in ("", SERVICE_NAME):
            self._admin.set_health(name, health_pb2.HealthCheckResponse.SERVING)
        self._watch_copy()
        # (Every process: a primary started plain, whose standbys attached
        # with --standby-of, is replaced when one of them takes over.)
        self._copy_watcher = threading.Thread(
            target=self._watching_copy, name="dlt-copy-health", daemon=True
        )
        self._copy_watcher.start()
        log.info(
            "%s serving on %s: data port %d, admin port %d%s; %d worker threads, up to "
            "%d connections",
            f"shard {self.shard.shard_index}/{self.shard.num_shards}"
            if self.shard.shard_index < self.shard.num_shards
            else "joining (no bucket yet)",
            self._bind,
            self.port,
            self.admin_port,
            f", metrics port {self.metrics_port}" if self._metrics is not None else "",
            self.data_server.worker_threads,
            self.data_server.max_connections,
        )
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Reports NOT_SERVING, lets in-flight control calls (a Save) finish
        within the grace period, then lets every data-plane connection finish
        its request in hand. Idempotent."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            grace = self._stop_grace_s if grace_s is None else grace_s
            self._admin.begin_stop()
            # Ended before the shard goes: it reads the shard's state.
            self._stopping.set()
            if self._copy_watcher is not None:
                self._copy_watcher.join(5)
            if self.follower is not None:
                self.follower.stop()
            if self.servicer.standby_link is not None:
                self.servicer.standby_link.stop()
            try:
                self._admin.stop(grace)
            except Exception:  # noqa: BLE001 - the rest still stops
                log.exception("stopping the admin port failed")
            assert self.servicer.standbys is not None
            self.servicer.standbys.close()
            if self.servicer.reshard is not None:
                self.servicer.reshard.close()
            self.data_server.stop()
            self.shard.stop_sweeper()
            self.servicer.close()
            if self._metrics is not None:
                http_server, thread = self._metrics
                http_server.shutdown()
                http_server.server_close()
                thread.join(5)
            self._stopped.set()
            _RUNNING.discard(self)
            log.info("shard %d stopped", self.shard.shard_index)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until stopped; returns False on timeout."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# Servers of this process started and not stopped yet.
_RUNNING: weakref.WeakSet[ShardServer] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """A process that exits with servers still running stops them first:
    the interpreter would otherwise end their threads where they stand, and
    one ended inside a native call aborts the process (exit code 134)."""
    for server in list(_RUNNING):
        server.stop(0)


def _own_addresses(bind: str, port: int, advertise: str | None) -> set[str]:
    """Addresses that name this server for certain: the one it advertises,
    and with a fixed port, that port on the address it binds (loopback's
    names too when it binds every address or loopback)."""
    own = {advertise} if advertise else set()
    if port:
        hosts = {bind}
        if bind in ("", "0.0.0.0", "::", "127.0.0.1", "localhost"):
            hosts |= {"127.0.0.1", "localhost"}
        own |= {f"{host}:{port}" for host in hosts}
    return own
