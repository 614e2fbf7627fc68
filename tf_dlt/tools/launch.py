"""`tf-dlt launch`: shard servers and trainers on this machine.

    tf-dlt launch --pservers 2 --workers 2 -- python train.py --epochs 3

Starts the shard servers (`tf-dlt server` on loopback, ports picked by the
OS), waits until each answers SERVING on grpc.health.v1 (showing progress),
then starts the trainers with TF_CONFIG naming the shards and their own task
(`tf_dlt.cluster_from_env()` reads it). Every line a role prints comes out
prefixed with its name ("[ps-1]", "[worker-0]"). It stops everything when the
trainers are done, when any role fails, and on Ctrl-C or SIGTERM; it exits 0
only if every trainer exited 0 and every shard stopped cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from tf_dlt import grpc_util
from tf_dlt.cluster import MAX_REPLICAS, ClusterSpec
from tf_dlt.server.local import LocalCluster, StartInterrupted, refuse_placement
from tf_dlt.server.main import positive_seconds

_POLL_S = 0.1
# Seconds shards get to shut down cleanly (at least; --grace when longer).
_SHARD_STOP_S = 30.0
# Times a shard process that exits while another of its shard runs is
# started again (it rejoins as a standby); after that it is only reported.
_MAX_RESTARTS = 3


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Sends `signum` to the process group `proc` leads (start_new_session),
    if any of it is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def _group_left(proc: subprocess.Popen[bytes]) -> bool:
    """Whether a process of the group `proc` leads still runs (its first
    process counts until reaped)."""
    if proc.poll() is None:
        return True
    try:
        os.killpg(proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class _Printer:
    """Writes whole prefixed lines from several threads."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._lock = threading.Lock()
        self._closed = False  # guarded by _lock

    def line(self, role: str, text: str) -> None:
        """Writes one line; once the output is gone (`| head` closed its
        end) the rest are dropped, while the roles' pipes are still read:
        the thread copying a trainer's output died, the trainer blocked on
        its full pipe, and the launch waited for it for good."""
        with self._lock:
            if self._closed:
                return
            try:
                self._out.write(f"[{role}] {text.rstrip()}\n")
                self._out.flush()
            except (OSError, ValueError):  # BrokenPipeError; a closed stream
                self._closed = True
                if self._out is sys.stdout:  # nor a traceback at exit, flushing it
                    with contextlib.suppress(OSError, ValueError):
                        devnull = os.open(os.devnull, os.O_WRONLY)
                        os.dup2(devnull, sys.stdout.fileno())
                        os.close(devnull)


def _pump(stream: IO[bytes], role: str, printer: _Printer) -> None:
    for raw in iter(stream.readline, b""):
        printer.line(role, raw.decode(errors="replace"))


def _tail(path: Path, role: str, printer: _Printer, done: threading.Event) -> None:
    """Follows a log file (once it exists) until `done`, then prints what is
    left."""
    while not path.exists():
        if done.is_set():
            return
        time.sleep(_POLL_S)
    with path.open("rb") as f:
        pending = b""
        while True:
            finished = done.is_set()
            pending += f.read()
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                printer.line(role, raw.decode(errors="replace"))
            if finished:
                if pending:
                    printer.line(role, pending.decode(errors="replace"))
                return
            time.sleep(_POLL_S)


class Launch:
    """One launch: shards, then trainers, then teardown. `run()` returns the
    exit code."""

    def __init__(
        self,
        num_pservers: int,
        num_workers: int,
        command: Sequence[str],
        *,
        server_args: Sequence[str] = (),
        start_timeout: float = 60.0,
        grace: float = 10.0,
        out: IO[str] | None = None,
        replicas: int = 1,
    ) -> None:
        if num_pservers < 0 or num_workers < 1:
            raise ValueError(
                f"need --pservers >= 0 and --workers >= 1, got {num_pservers} and {num_workers}"
            )
        if not command:
            raise ValueError("no trainer command: give it after '--'")
        if not 1 <= replicas <= MAX_REPLICAS:
            raise ValueError(
                f"need --replicas 1 to {MAX_REPLICAS} (a primary and its standbys), got {replicas}"
            )
        refuse_placement(server_args)
        self.replicas = replicas
        self.num_pservers = num_pservers
        self.num_workers = num_workers
        self.command = list(command)
        self.server_args = list(server_args)
        self.start_timeout = start_timeout
        self.grace = grace
        self.printer = _Printer(out or sys.stdout)
        self.cluster: LocalCluster | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self._threads: list[threading.Thread] = []
        self._tails_done = threading.Event()
        self._stop_signal: int | None = None
        self._reported: set[int] = set()  # processes that exited with their shard alive
        self._restarts: dict[int, int] = {}  # per process: times started again
        self._start_failed = False  # a shard failed to start (reported already)

    def say(self, text: str) -> None:
        self.printer.line("launch", text)

    # Phases -----------------------------------------------------------------

    def _start_shards(self) -> list[str]:
        if self.num_pservers == 0:
            self.say(
                "no shard servers: trainers use the embedded tables"
                + (
                    f"; warning: each of the {self.num_workers} trainers has tables of its own "
                    "(they train separate models: give --pservers to share one)"
                    if self.num_workers > 1
                    else ""
                )
                + (f"; --replicas {self.replicas} is ignored" if self.replicas > 1 else "")
            )
            return []
        standbys = {1: "", 2: ", each with a hot standby"}.get(
            self.replicas, f", each with {self.replicas - 1} hot standbys"
        )
        self.say(f"starting {self.num_pservers} shard servers{standbys}")
        cluster = self.cluster = LocalCluster(
            self.num_pservers, *self.server_args, start_timeout=self.start_timeout,
            replicas=self.replicas,
        )  # fmt: skip
        cluster.interrupted = lambda: self._stop_signal is not None
        # Each shard's log from its first line, prefixed with its role (a
        # shard that fails to start says why there).
        for p in range(self.num_pservers * self.replicas):
            t = threading.Thread(
                target=_tail,
                args=(cluster.log_path(p), self._role(p), self.printer, self._tails_done),
                daemon=True,
            )
            t.start()
            self._threads.append(t)
        try:
            cluster.start()
        except StartInterrupted:
            raise
        except (RuntimeError, TimeoutError, OSError) as e:  # OSError: EMFILE, EAGAIN, ENOSPC
            # start() stopped every process it had started: only the one
            # that failed is to blame, and its log says why.
            self._start_failed = True
            failed = cluster.failed_process
            if failed is None:
                raise
            code = cluster.processes[failed].returncode
            raise RuntimeError(
                f"{self._role(failed)} exited with {code} while starting (its log above)"
                if isinstance(e, RuntimeError)
                else f"{self._role(failed)} did not start in {self.start_timeout} s"
            ) from None
        self._wait_healthy(cluster)
        return list(cluster.addresses)

    def _role(self, process: int) -> str:
        shard, replica = process % self.num_pservers, process // self.num_pservers
        return f"ps-{shard}" + (f"-standby{replica}" if replica else "")

    def _wait_healthy(self, cluster: LocalCluster) -> None:
        deadline = time.monotonic() + self.start_timeout
        healthy: set[int] = set()
        total = len(cluster.admin_ports)
        while len(healthy) < total:
            if self._stop_signal is not None:
                raise StartInterrupted("the wait for the shards was interrupted")
            for i, port in enumerate(cluster.admin_ports):
                if i not in healthy and grpc_util.serving(f"127.0.0.1:{port}", timeout=1.0):
                    healthy.add(i)
                    self.say(
                        f"shards healthy {len(healthy)}/{total} "
                        f"({self._role(i)} at {cluster.process_addresses[i]})"
                    )
            self._check_shards(cluster)
            if len(healthy) < total:
                if time.monotonic() > deadline:
                    missing = [self._role(i) for i in sorted(set(range(total)) - healthy)]
                    raise TimeoutError(f"shards {missing} not SERVING after {self.start_timeout} s")
                time.sleep(_POLL_S)

    def _check_shards(self, cluster: LocalCluster) -> None:
        """Raises when a shard has no process left. A process that exited
        while another of its shard runs (its standby takes over, or it was
        the standby) is started again, to rejoin the shard as a standby: a
        sync primary acknowledges no push without one, so a dead standby
        stopped training within the request deadline. After _MAX_RESTARTS,
        or a restart that fails, it is reported once."""
        for i, proc in enumerate(cluster.processes):
            if proc.poll() is None or i in self._reported:
                continue
            shard = i % self.num_pservers
            alive = [
                p for p in range(shard, len(cluster.processes), self.num_pservers)
                if cluster.processes[p].poll() is None
            ]  # fmt: skip
            if not alive:
                raise RuntimeError(f"{self._role(i)} exited with {proc.returncode}")
            exited = (
                f"{self._role(i)} exited with {proc.returncode}; "
                f"{', '.join(self._role(p) for p in alive)} of shard {shard} still runs"
            )
            if self._restarts.get(i, 0) < _MAX_RESTARTS and self._stop_signal is None:
                self._restarts[i] = self._restarts.get(i, 0) + 1
                self.say(f"{exited}; starting {self._role(i)} again to rejoin it as a standby")
                try:
                    cluster.restart(i)
                    continue
                except (RuntimeError, TimeoutError, OSError) as e:  # StartInterrupted, EMFILE
                    why = (str(e).splitlines() or [type(e).__name__])[0]
                    exited = f"{self._role(i)} did not start again ({why})"
                    if cluster.processes[i].poll() is None:  # started, never listened
                        cluster.kill(i)
            self._reported.add(i)
            self.say(exited)

    def _start_workers(self, pservers: list[str]) -> None:
        workers = [f"localhost:{i}" for i in range(self.num_workers)]
        for i in range(self.num_workers):
            spec = ClusterSpec(pservers, workers, "worker", i)
            env = {**os.environ, "TF_CONFIG": spec.to_env(), "PYTHONUNBUFFERED": "1"}
            try:
                # A process group of its own: the teardown reaches every
                # process the trainer started (a wrapper script's child too),
                # and Ctrl-C reaches it through the launcher only.
                proc = subprocess.Popen(
                    self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            except OSError as e:  # no such program, not executable: the run fails cleanly
                raise RuntimeError(
                    f"cannot start the trainer command {self.command[0]!r}: {e.strerror}"
                ) from None
            self.workers.append(proc)
            assert proc.stdout is not None
            t = threading.Thread(
                target=_pump, args=(proc.stdout, f"worker-{i}", self.printer), daemon=True
            )
            t.start()
            self._threads.append(t)
        self.say(f"started {self.num_workers} trainers: {' '.join(self.command)}")

    def _supervise(self) -> int:
        """Waits for the trainers; the first failure (a trainer exiting
        non-zero, a shard exiting, a signal) ends the launch."""
        while True:
            if self._stop_signal is not None:
                self.say(f"got signal {self._stop_signal}: stopping everything")
                return 128 + self._stop_signal
            codes = [w.poll() for w in self.workers]
            for i, code in enumerate(codes):
                if code not in (None, 0):
                    self.say(f"worker-{i} failed with exit code {code}: stopping everything")
                    return 1
            if all(code == 0 for code in codes):
                self.say("all trainers finished")
                return 0
            if self.cluster is not None:
                try:
                    self._check_shards(self.cluster)
                except RuntimeError as e:
                    self.say(f"{e}: stopping everything")
                    return 1
            time.sleep(_POLL_S)

    def _teardown(self) -> int:
        """Stops trainers (SIGTERM, SIGKILL after the grace) and shards;
        returns 1 if a shard did not stop cleanly, else 0."""
        # Every trainer's process group, whether its first process is still
        # there or not (what it started may be).
        for w in self.workers:
            _signal_group(w, signal.SIGTERM)
        # The grace is every process's, not only the first's (a wrapper
        # script dies at once; the trainer it ran may still be saving).
        deadline = time.monotonic() + self.grace
        while any(_group_left(w) for w in self.workers) and time.monotonic() < deadline:
            for w in self.workers:
                w.poll()  # reaps the first process once it exits
            time.sleep(_POLL_S)
        for w in self.workers:
            _signal_group(w, signal.SIGKILL)
            if w.poll() is None:
                w.kill()
            w.wait(10)
        status = 0
        if self.cluster is not None:
            codes = self.cluster.stop(timeout=max(self.grace, _SHARD_STOP_S))
            bad = [
                f"{self._role(i)}: {c}"
                for i, c in enumerate(codes)
                if c != 0 and i not in self._reported
            ]
            if bad and not self._start_failed:
                self.say(f"shards did not stop cleanly ({', '.join(bad)})")
                status = 1
        self._tails_done.set()
        for t in self._threads:
            t.join(5)
        return status

    def run(self) -> int:
        # SIGHUP too: trainers, in sessions of their own, do not get a
        # closed terminal's; the launcher stops them.
        previous = {
            s: signal.signal(s, self._on_signal)
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
        code = 1
        try:
            pservers = self._start_shards()
            if self._stop_signal is None:
                self._start_workers(pservers)
            code = self._supervise()
        except StartInterrupted:
            self._start_failed = True  # shards stopped before their handlers: no blame
            code = self._supervise()  # says which signal, and gives its code
        except (RuntimeError, TimeoutError, OSError) as e:
            self.say(f"failed: {e}")
            code = 1
        finally:
            stopped = self._teardown()
            for s, handler in previous.items():
                signal.signal(s, handler)
        code = code or stopped
        self.say(f"exit code {code}")
        return code

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_signal = signum


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--pservers", type=int, default=1, help="shard servers (0: embedded)")
    parser.add_argument("--workers", type=int, default=1, help="trainer processes")
    parser.add_argument(
        "--replicas", type=int, default=1, choices=range(1, MAX_REPLICAS + 1), metavar="R",
        help=f"processes per shard (1 to {MAX_REPLICAS}): R > 1 gives each shard R - 1 hot "
        "standbys, one of which takes over when its primary dies (docs/replication.md)",
    )  # fmt: skip
    parser.add_argument(
        "--server-arg", action="append", default=[], metavar="ARG",
        help="extra `tf-dlt server` flag for every shard (repeat; e.g. --server-arg=--threads=4)",
    )  # fmt: skip
    parser.add_argument(
        "--start-timeout", type=positive_seconds, default=60.0, help="seconds for shards"
    )
    parser.add_argument(
        "--grace", type=positive_seconds, default=10.0,
        help="seconds trainers get between SIGTERM and SIGKILL (shards: at least 30)",
    )  # fmt: skip
    parser.epilog = "The trainer command follows '--'."
    return parser


def run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    command = list(getattr(args, "trainer_command", []))
    try:
        launch = Launch(
            args.pservers, args.workers, command, server_args=args.server_arg,
            start_timeout=args.start_timeout, grace=args.grace, out=out,
            replicas=args.replicas,
        )  # fmt: skip
    except ValueError as e:
        print(f"tf-dlt launch: {e}", file=sys.stderr)
        return 2
    return launch.run()
