"""Command line of the shard server."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from tf_dlt import _native, cluster, errors, sizes, tls
from tf_dlt.client import MAX_TIMEOUT_MS, read_token_file
from tf_dlt.server import replication
from tf_dlt.server.shard_server import ShardServer


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="tf-dlt server", description="Serve one shard of tf_dlt's distributed tables."
    )
    p.add_argument("--port", type=_port, default=7000, help="data-plane port (0: any free port)")
    p.add_argument("--admin-port", type=_port, default=0, help="gRPC control-plane port (0: any)")
    p.add_argument(
        "--shard-index",
        type=_at_least(0, _native.NUM_BUCKETS - 1),
        default=0,
        help="this shard's index",
    )
    p.add_argument(
        "--num-shards",
        type=_at_least(1, _native.NUM_BUCKETS),
        default=1,
        help=f"number of shards in the cluster (at most {_native.NUM_BUCKETS}: one bucket each)",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="start owning no bucket, to join the cluster by a re-shard (tf-dlt reshard --to "
        "... with this server's address; docs/replication.md); no --shard-index/--num-shards",
    )
    p.add_argument(
        "--bind",
        default="127.0.0.1",
        type=_bind_host,
        help="listen address of both planes (default loopback; another address needs "
        "--auth-token-file or --insecure)",
    )
    p.add_argument("--auth-token-file", help="file holding the token clients must present")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback address without a token (a private network you trust)",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=_at_least(_native.MIN_MAX_FRAME_BYTES, 2**32 - 1),
        default=_native.DEFAULT_MAX_FRAME_BYTES,
        help="largest data-plane frame payload accepted",
    )
    p.add_argument(
        "--threads",
        type=_at_least(0, 2**31 - 1),
        default=0,
        help="data-plane worker threads (default 0: one per CPU the process may use)",
    )
    p.add_argument(
        "--max-connections",
        type=_at_least(0, 2**31 - 1),
        default=0,
        help="authenticated data-plane connections at once (default 0: what ulimit -n allows)",
    )
    p.add_argument(
        "--max-unauthenticated",
        type=_at_least(1, 2**31 - 1),
        default=256,
        help="connections yet to say Hello; past it the oldest is closed",
    )
    p.add_argument(
        "--max-admin-connections",
        type=_at_least(0, 2**20),
        default=0,
        help="control-plane connections at once; past it a new one is closed (default 0: "
        "4096, or a sixteenth of the hard open-file limit where that is less)",
    )
    p.add_argument(
        "--hello-timeout",
        type=positive_seconds,
        default=5.0,
        help="seconds a connection has to say Hello",
    )
    p.add_argument(
        "--idle-timeout",
        type=_seconds_or_zero,
        default=600.0,
        help="seconds an idle authenticated connection stays open (0: forever)",
    )
    p.add_argument(
        "--io-timeout",
        type=positive_seconds,
        default=30.0,
        help="seconds for the rest of a started frame to arrive and for a reply to be taken",
    )
    p.add_argument(
        "--max-buffered-bytes",
        type=_at_least(1),
        default=1 << 30,
        help="bytes of frames and replies held over all connections (past it, connections wait)",
    )
    p.add_argument(
        "--checkpoint-root",
        action="append",
        type=_non_empty,
        default=[],
        help="where Save and Load may go: a path or URL prefix (repeat for several; "
        "memory:// only when named; default: any local path or object store)",
    )
    p.add_argument(
        "--load-timeout",
        type=positive_seconds,
        default=600.0,
        help="seconds a prepared or uncommitted cluster load is kept before it expires",
    )
    p.add_argument(
        "--sweep-interval",
        type=positive_seconds,
        default=10.0,
        help="seconds between sweeps removing rows past their table's ttl",
    )
    p.add_argument(
        "--memory-budget",
        type=_size,
        default=0,
        metavar="BYTES",
        help="resident memory this shard may use, e.g. 12GiB (default: no budget). Past it the "
        "coldest rows move to --storage-dir, or without one are evicted",
    )
    p.add_argument(
        "--storage-dir",
        type=_non_empty,  # an unset $TIER_DIR was no tier: rows past the budget evicted
        help="local SSD directory for the disk tier of rows past --memory-budget; a cache of "
        "this shard's state, emptied at start (a restart loads from a checkpoint)",
    )
    p.add_argument("--load-from", help="checkpoint to load before serving")
    p.add_argument(
        "--read-only",
        action="store_true",
        help="serve checkpoints only: pushes, saves, loads and table changes are refused",
    )
    p.add_argument(
        "--follow",
        metavar="CHECKPOINT_DIR",
        help="with --read-only: serve the newest checkpoint chain in this directory and apply "
        "every new delta as it is committed",
    )
    p.add_argument(
        "--follow-interval",
        type=positive_seconds,
        default=5.0,
        help="seconds between reads of --follow",
    )
    p.add_argument(
        "--standby-of",
        metavar="HOST:PORT",
        help="serve as the hot standby of the primary shard at this data-plane address "
        "(same --shard-index and --num-shards): take its tables and every change, and take "
        "over when it stays unreachable (docs/replication.md)",
    )
    p.add_argument(
        "--replica-set",
        metavar="HOST:PORT|HOST:PORT[|...]",
        help="this shard's processes, 2 to 5 (with --advertise naming this one): at start, "
        "follow the one that serves as its standby, or begin as the primary (loading "
        "--load-from) when no other holds a whole copy; how a restarted process rejoins "
        "(docs/replication.md)",
    )
    p.add_argument(
        "--replication",
        choices=("sync", "async"),
        default="sync",
        help="for standbys of this shard: sync acknowledges a push once every standby of the "
        "in-sync set has it; async at once (the standbys lag; tf-dlt stats says by how much)",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="this shard's data-plane address as the other processes of its shard reach it "
        "(with --standby-of, default: --bind and the bound port; needed with --replica-set)",
    )
    p.add_argument(
        "--detach-standby-after",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="a primary detaches a standby that stays down this long (the other standbys then "
        "no longer wait for it to choose who takes over); it attaches again when back",
    )
    p.add_argument(
        "--standby-timeout",
        type=positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="a sync push waits this long for a standby to apply it; past it the primary "
        "stops counting on that standby (copied afresh when it answers). Keep it below the "
        "trainers' request deadline (30 s), so a standby that hangs stalls pushes, not fails them",
    )
    p.add_argument(
        "--takeover-after",
        type=positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="with --standby-of or --replica-set: how long the primary must stay unreachable "
        "before this standby takes over",
    )
    p.add_argument(
        "--stop-grace",
        type=_seconds_or_zero,
        default=60.0,
        help="seconds SIGTERM waits for a running Save",
    )
    p.add_argument("--tls-cert", help="PEM certificate: serve the control plane over TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", help="PEM CA: require client certificates it signed (mutual TLS)"
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus metrics over HTTP on this port (0: any free port; default: off)",
    )
    p.add_argument(
        "--port-file",
        help="write 'data_port admin_port metrics_port' here once serving (for launchers; "
        "metrics_port 0 when off)",
    )
    p.add_argument(
        "--parent-pid",
        type=_at_least(0, 2**31 - 1),  # (-1 stopped the shard at once, exit 0)
        default=0,
        help="stop, as on SIGTERM, once the process PID is no longer this one's parent (it "
        "died: a launcher or LocalCluster killed with SIGKILL, or by the OOM killer); "
        "launchers pass their own",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _port(text: str) -> int:
    """A TCP port, 0-65535 (a larger number was taken modulo 65536: a typo
    served on another port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free one), got {port}")
    return port


def _bind_host(text: str) -> str:
    """A host name or IP address to listen on; an IPv6 one may be written
    in brackets (`[::1]` was bound as `[[::1]]` and refused as "in use")."""
    if text.startswith("[") and text.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(text[1:-1]))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an IPv6 address in []: {text!r}") from None
    host = text
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    if ":" in host:
        raise argparse.ArgumentTypeError(
            f"takes a host or address without a port (the ports are --port and --admin-port), "
            f"got {text!r}"
        )
    if not cluster.is_address(f"{host}:1"):
        raise argparse.ArgumentTypeError(f"not a host name or IP address: {text!r}")
    return host


def _at_least(least: int, most: int = 2**64 - 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
        return value

    return parse


# The longest time a flag may give: the native core keeps milliseconds in
# an int.
MAX_SECONDS = MAX_TIMEOUT_MS / 1000


def _seconds(text: str, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value >= 0 if zero else value > 0):  # NaN fails both
        raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else '> 0'} seconds, got {text}")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_SECONDS:.3f} seconds (24.8 days), got {text}"
        )
    return value


def positive_seconds(text: str) -> float:
    """Seconds > 0 (0 was taken as 1 ms: every frame timed out) and at most
    MAX_SECONDS; not NaN."""
    return _seconds(text, zero=False)


def _seconds_or_zero(text: str) -> float:
    """Seconds >= 0 and at most MAX_SECONDS; not NaN."""
    return _seconds(text, zero=True)


def _non_empty(text: str) -> str:
    """A path or URL: not empty (an empty --checkpoint-root was the working
    directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a path or URL, got an empty one")
    return text


def _size(text: str) -> int:
    try:
        return sizes.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def is_loopback(host: str) -> bool:
    """True when `host` (an address or name) is only reachable from this
    machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Place(logging.Filter):
    """Puts the shard this process serves now in each log line's `place`:
    `shard-<i>` (a re-shard may change it), or `no-shard` for a process
    that joins or was left out of the layout; until the server starts, the
    index it was started with. `shard` is let go once the server stopped:
    held by the logging module to the interpreter's exit, the shard outlived
    the process's own teardown (its disk tier's files stayed)."""

    def __init__(self, started_as: int) -> None:
        super().__init__()
        self.text = f"shard-{started_as}"
        self.shard: Any = None  # the server's native Shard while it serves

    def filter(self, record: logging.LogRecord) -> bool:
        shard = self.shard
        if shard is not None:
            index, count = int(shard.shard_index), int(shard.num_shards)
            self.text = f"shard-{index}" if index < count else "no-shard"
        record.place = self.text
        return True


def _peer_tls_refusal(serves_tls: bool, mutual: bool) -> str:
    """Why a replica-set member cannot call its peers' control planes with
    the TF_DLT_TLS_* settings of its environment ("" if it can): settings
    that do not make a client (a certificate without its key, a file it
    cannot read), or, behind TLS itself (its peers are too), none. Its
    standby thread met them only at its first call, and ended: the shard
    ran with no standby (said only that a socket closed)."""
    try:
        peers = replication.peer_tls()
    except errors.DltError as e:
        return e.message
    if not serves_tls:
        return ""
    missing = [] if peers is not None else [tls.ENV_CA]
    if mutual and (peers is None or not peers.cert):
        missing += [tls.ENV_CERT, tls.ENV_KEY]
    if not missing:
        return ""
    return (
        f"--tls-cert with --standby-of or --replica-set: this process calls its peers' control "
        f"planes, behind TLS as its own is, as a client: set {' and '.join(missing)} (the CA "
        "certificate that signed the peers' certificates"
        + (", and a client certificate and key it signed, for --tls-client-ca" if mutual else "")
        + "; docs/security.md)"
    )


def run(args: argparse.Namespace) -> int:
    place = _Place(args.shard_index)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(place)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(place)s %(levelname)s %(message)s",
        handlers=[handler],
    )
    log = logging.getLogger("tf_dlt.server")
    token = ""
    if args.auth_token_file:
        try:
            token = read_token_file(args.auth_token_file)
        except errors.DltError as e:
            log.error("%s", e)
            return 2
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        log.error("--tls-cert and --tls-key go together (and --tls-client-ca needs them)")
        return 2
    if args.tls_cert:
        try:  # a key of another certificate made gRPC fail to bind, "in use by another process"
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                args.tls_cert, args.tls_key
            )
        except ssl.SSLError as e:
            log.error(
                "--tls-cert %s and --tls-key %s are not a certificate and its private key: %s",
                args.tls_cert, args.tls_key, e,
            )  # fmt: skip
            return 2
        except OSError as e:
            log.error("cannot read the TLS certificate or key: %s", e)
            return 2
    if args.tls_client_ca:
        try:  # a file that is not PEM made gRPC fail to bind, "in use by another process"
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_verify_locations(
                cafile=args.tls_client_ca
            )
        except (ssl.SSLError, OSError) as e:
            log.error(
                "--tls-client-ca %s holds no CA certificate in PEM: %s", args.tls_client_ca, e
            )
            return 2
    if args.standby_of or args.replica_set:
        refusal = _peer_tls_refusal(bool(args.tls_cert), args.tls_client_ca is not None)
        if refusal:
            log.error("%s", refusal)
            return 2
    if not token and not args.insecure and not is_loopback(args.bind):
        log.error(
            "refusing to serve %s without a token: anyone who reaches it could read, change and "
            "save every table. Give --auth-token-file, bind 127.0.0.1, or pass --insecure on a "
            "network you trust",
            args.bind,
        )
        return 2
    if not args.checkpoint_root and not args.read_only and not is_loopback(args.bind):
        # Only where it matters: others can reach the shard, and it saves
        # and loads (a read-only shard does neither).
        log.warning(
            "no --checkpoint-root: Save and Load may use any local path or object-store URL "
            "a client names"
        )
    server_tls = (args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    if args.join:
        if (args.shard_index, args.num_shards) != (0, 1):
            log.error("--join takes no --shard-index or --num-shards: it owns no bucket yet")
            return 2
        # Shard 1 of 1: a shard whose index is its count owns no bucket.
        args.shard_index, args.num_shards = 1, 1
    elif args.shard_index >= args.num_shards:
        # A shard index counts from 0: index N of N would own no bucket.
        log.error(
            "--shard-index %d is not below --num-shards %d: shards are numbered 0 to %d (a "
            "server that owns no bucket yet, for a re-shard to give it some, is started with "
            "--join)",
            args.shard_index, args.num_shards, args.num_shards - 1,
        )  # fmt: skip
        return 2
    try:
        server = ShardServer(
            args.shard_index,
            args.num_shards,
            bind=args.bind,
            port=args.port,
            admin_port=args.admin_port,
            auth_token=token,
            max_frame_bytes=args.max_frame_bytes,
            threads=args.threads,
            max_connections=args.max_connections,
            max_unauthenticated=args.max_unauthenticated,
            max_admin_connections=args.max_admin_connections,
            hello_timeout_s=args.hello_timeout,
            idle_timeout_s=args.idle_timeout,
            io_timeout_s=args.io_timeout,
            max_buffered_bytes=args.max_buffered_bytes,
            checkpoint_roots=args.checkpoint_root,
            load_timeout_s=args.load_timeout,
            sweep_interval_s=args.sweep_interval,
            load_from=args.load_from,
            read_only=args.read_only,
            follow=args.follow,
            follow_interval_s=args.follow_interval,
            stop_grace_s=args.stop_grace,
            metrics_port=args.metrics_port,
            tls=server_tls,
            memory_budget=args.memory_budget,
            storage_dir=args.storage_dir,
            standby_of=args.standby_of,
            replication_mode=args.replication,
            advertise=args.advertise,
            takeover_after_s=args.takeover_after,
            detach_standby_after_s=args.detach_standby_after,
            standby_timeout_s=args.standby_timeout,
            replica_set=args.replica_set.split("|") if args.replica_set else (),
        )
        place.shard = server.shard  # log lines name the shard it serves from now on
        server.start()
    except (errors.DltError, OSError, ValueError, RuntimeError) as e:
        # (RuntimeError: worker threads the system would not start)
        log.error("cannot start: %s", e)
        place.shard = None
        return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        # stop() blocks for the grace period; run it outside the handler.
        threading.Thread(target=server.stop, name="dlt-stop").start()

    # SIGHUP too (the terminal it ran in closed): it killed the shard
    # there, with no --stop-grace for a running Save. Not where it was
    # started ignoring SIGHUP (nohup, a daemonizing wrapper): the operator
    # asked it to outlive its terminal, and it did before.
    for stop_signal in _STOP_SIGNALS:
        if stop_signal == signal.SIGHUP and signal.getsignal(stop_signal) == signal.SIG_IGN:
            continue
        signal.signal(stop_signal, on_signal)
    # A file past the size limit fails its write (a disk tier or checkpoint
    # error the shard reports) instead of killing the shard.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if args.port_file:
        tmp = f"{args.port_file}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"{server.port} {server.admin_port} {server.metrics_port}\n")
            os.replace(tmp, args.port_file)
        except OSError as e:
            # Whoever waits for the file would wait for good: stop instead.
            log.error("cannot write --port-file %s: %s; stopping", args.port_file, e)
            server.stop(0)
            place.shard = None
            return 2
    try:
        code = _serve(server, args, log)
    finally:
        place.shard = None
    _exit_past_stuck_threads(code, log)
    return code


# Seconds a stopped shard waits for its other threads (a stop's own) before
# it exits without them.
_EXIT_WAIT_S = 5.0


def _exit_past_stuck_threads(code: int, log: logging.Logger) -> None:
    """Exits the process now (os._exit, after flushing the logs) when a
    thread the interpreter would wait for at exit is still running once the
    shard stopped: a Save or Load in a call to a store that does not answer
    (past --stop-grace). The shard logged "stopped", yet its process stayed
    until the call failed: 3 minutes for an S3 endpoint that froze, for as
    long as one went on sending a byte now and then."""
    from concurrent.futures import thread as executor_threads

    def waited_for() -> list[threading.Thread]:
        # Non-daemon threads, and every thread of a ThreadPoolExecutor
        # (the admin plane's calls among them), which the interpreter joins
        # at exit whatever their daemon flag.
        pooled = set(getattr(executor_threads, "_threads_queues", {}))
        return [
            t for t in threading.enumerate()
            if t is not threading.current_thread() and t.is_alive()
            and (not t.daemon or t in pooled)
        ]  # fmt: skip

    # What the interpreter's exit does first (concurrent.futures'
    # _python_exit): idle pool threads end, those in a call go on.
    queues = dict(getattr(executor_threads, "_threads_queues", {}))
    with getattr(executor_threads, "_global_shutdown_lock", threading.Lock()):
        executor_threads._shutdown = True
    for queue in queues.values():
        queue.put(None)
    deadline = time.monotonic() + _EXIT_WAIT_S
    for thread in waited_for():
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in waited_for()]
    if not stuck:
        return
    log.warning(
        "exiting with %d thread(s) still in a call that does not end (%s): a save or load "
        "to a store that stopped answering, given up", len(stuck), ", ".join(stuck[:4]),
    )  # fmt: skip
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What stops a shard as SIGTERM does.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _serve(server: ShardServer, args: argparse.Namespace, log: logging.Logger) -> int:
    """Serves until stopped (a signal, or the launcher that started it gone)."""
    orphaned = False
    while not server.wait(timeout=0.5):
        server.watch()
        if args.parent_pid and os.getppid() != args.parent_pid and not orphaned:
            orphaned = True  # reparented: the launcher that started it is gone
            log.warning("process %d that started this shard is gone: stopping", args.parent_pid)
            threading.Thread(target=server.stop, name="dlt-stop").start()
    # Stopped: a second signal (Ctrl-C, then a launcher's SIGTERM) changes
    # nothing, and must not kill the process as it exits (the interpreter
    # puts back the default action of signals it handled).
    for stop_signal in _STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_IGN)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
