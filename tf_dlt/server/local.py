"""LocalCluster: shard server processes on this machine, on loopback with
ports picked by the OS. Used by the examples, the benchmarks and the tests;
every wait is bounded and `stop()` ends every process."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tf_dlt.cluster import MAX_REPLICAS


def _check_replicas(replicas: int) -> None:
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(
            f"replicas must be 1 to {MAX_REPLICAS} (a primary and its standbys), got {replicas}"
        )


# The flags a LocalCluster gives each process itself (where it listens,
# which shard it is, which processes it replicates with).
PLACEMENT_FLAGS = (
    "--port", "--admin-port", "--shard-index", "--num-shards", "--port-file", "--parent-pid",
    "--join", "--standby-of", "--replica-set", "--advertise",
)  # fmt: skip


# --bind addresses on which a shard answers 127.0.0.1.
_LOOPBACK_REACHED = ("127.0.0.1", "0.0.0.0", "localhost")


# `tf-dlt server` flags that name a local file or directory (or a URL).
_PATH_FLAGS = (
    "--auth-token-file", "--checkpoint-root", "--storage-dir", "--load-from", "--follow",
    "--tls-cert", "--tls-key", "--tls-client-ca",
)  # fmt: skip


def absolute_paths(server_args: Sequence[str]) -> list[str]:
    """`server_args` with each relative path of a flag that names one made
    absolute against this process's working directory: the shards run in
    the cluster's own (a temporary folder by default), where a relative
    `--storage-dir` put the disk tier, deleted with the cluster. URLs stay."""

    def absolute(value: str) -> str:
        return value if not value or "://" in value else os.path.abspath(value)

    out: list[str] = []
    value_of = ""
    for arg in server_args:
        if value_of:
            out.append(absolute(arg))
            value_of = ""
            continue
        flag, eq, value = arg.partition("=")
        if flag in _PATH_FLAGS and eq:
            out.append(f"{flag}={absolute(value)}")
        else:
            out.append(arg)
            value_of = arg if arg in _PATH_FLAGS else ""
    return out


def refuse_placement(server_args: Sequence[str]) -> None:
    """ValueError naming a flag of `server_args` that would override how the
    cluster places its processes (the shards then served other places than
    their clients were given, and the trainers failed later, unclearly)."""
    from tf_dlt.server.main import build_parser

    known = set(build_parser()._option_string_actions)
    given = sorted({
        name
        for name in (a.split("=", 1)[0] for a in server_args if a.startswith("--") and a != "--")
        # (or a prefix of one, which the server's parser takes for it)
        if name in PLACEMENT_FLAGS
        or (name not in known and any(f.startswith(name) for f in PLACEMENT_FLAGS))
    })  # fmt: skip
    if given:
        raise ValueError(
            f"{', '.join(given)}: the local cluster sets each process's ports, shard and "
            "standbys itself; give `tf-dlt server` flags other than "
            f"{', '.join(PLACEMENT_FLAGS)}"
        )
    # The cluster greets its shards and hands trainers 127.0.0.1:<port>: a
    # shard listening elsewhere was waited for until the start timed out.
    only_bind = argparse.ArgumentParser(add_help=False)
    only_bind.add_argument("--bind", default="127.0.0.1")
    bind = only_bind.parse_known_args(list(server_args))[0].bind
    if bind not in _LOOPBACK_REACHED:
        raise ValueError(
            f"--bind {bind}: the local cluster reaches its shards on 127.0.0.1; give --bind "
            "127.0.0.1 (the default) or 0.0.0.0 (every address, loopback included)"
        )


class StartInterrupted(RuntimeError):
    """LocalCluster.start gave up: its `interrupted` said so."""


class LocalCluster:
    """`num_shards` shard servers (`python -m tf_dlt.server`) on 127.0.0.1.

    Args:
        num_shards: shards to start.
        server_args: extra `tf-dlt server` flags for every shard (relative
            paths in them are the caller's, made absolute).
        workdir: where port files and logs go (default: a temporary folder).
        env: extra environment variables of the processes.
        start_timeout: seconds each shard gets to start serving.
        replicas: processes per shard, 1 to `tf_dlt.cluster.MAX_REPLICAS`:
            its primary and its hot standbys (`--standby-of`,
            docs/replication.md). Process p serves shard p % num_shards
            (p < num_shards: the primaries); a shard's address lists its
            primary, then its standbys ("a|b|c"). A
            restarted process rejoins its shard (`--replica-set`): it follows
            the one that serves, or begins as the primary.
    """

    def __init__(
        self,
        num_shards: int,
        *server_args: str,
        workdir: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 60.0,
        replicas: int = 1,
    ) -> None:
        _check_replicas(replicas)
        refuse_placement(server_args)
        self.num_shards = num_shards
        self.replicas = replicas
        self._args = absolute_paths(server_args)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="tf_dlt-cluster-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self._env = {**os.environ, **(env or {})}
        self._timeout = start_timeout
        self.processes: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []  # per shard: "primary|standby|..."
        self.process_addresses: list[str] = []  # per process
        self._extra: list[list[str]] = []  # per process: its own flags (--standby-of)
        # Per process: its shard's processes ("primary|standby"), as it
        # rejoins them when restarted.
        self._replica_sets: list[str] = []
        self.admin_ports: list[int] = []  # per process
        # Prometheus ports (0 where a shard serves no metrics: --metrics-port).
        self.metrics_ports: list[int] = []
        self._stopped = False
        # The process whose start failed (LocalCluster.start raised), if any.
        self.failed_process: int | None = None
        # Asked while waiting for a process to start: True gives up the
        # start (raises StartInterrupted), as a launcher's signal does.
        self.interrupted: Callable[[], bool] = lambda: False

    def _name(self, process: int) -> str:
        if process >= self.num_shards * self.replicas:
            return f"joined{process - self.num_shards * self.replicas}"
        shard, replica = process % self.num_shards, process // self.num_shards
        return f"shard{shard}" + (f".standby{replica}" if replica else "")

    def log_path(self, process: int) -> Path:
        return self.workdir / f"{self._name(process)}.log"

    def log(self, process: int) -> str:
        return self.log_path(process).read_text(errors="replace")

    def start(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            # Primaries first: each standby names its primary's address.
            for replica in range(self.replicas):
                first = len(self.processes)
                for shard in range(self.num_shards):
                    extra = ["--standby-of", self.process_addresses[shard]] if replica else []
                    self._extra.append(extra)
                    self.processes.append(self._spawn(first + shard, extra))
                for p in range(first, first + self.num_shards):
                    data, admin, metrics_port = self._wait_for_ports(p, self.processes[p])
                    self.process_addresses.append(f"127.0.0.1:{data}")
                    self.admin_ports.append(admin)
                    self.metrics_ports.append(metrics_port)
        except BaseException:
            self.stop()
            raise
        self.addresses = [
            "|".join(self.process_addresses[shard :: self.num_shards])
            for shard in range(self.num_shards)
        ]
        self._replica_sets = [
            self.addresses[p % self.num_shards] for p in range(len(self.processes))
        ]
        return self

    def join(self, replicas: int = 1) -> str:
        """Starts one more shard's processes, owning no bucket (`tf-dlt
        server --join`; with `replicas` R > 1, R - 1 standbys of it too), to
        join the cluster by a re-shard (`tf_dlt.Client.reshard`); returns its
        address (`primary|standby|...`)."""
        if self._stopped:
            raise RuntimeError("the cluster was stopped")
        _check_replicas(replicas)
        joined: list[str] = []
        for replica in range(replicas):
            extra = ["--join", *(["--standby-of", joined[0]] if replica else [])]
            process = len(self.processes)
            self._extra.append(extra)
            self.processes.append(self._spawn(process, extra))
            data, admin, metrics_port = self._wait_for_ports(process, self.processes[process])
            self.process_addresses.append(f"127.0.0.1:{data}")
            self.admin_ports.append(admin)
            self.metrics_ports.append(metrics_port)
            joined.append(self.process_addresses[-1])
        self._replica_sets += ["|".join(joined)] * replicas
        return self._replica_sets[-1]

    def _port_file(self, process: int) -> Path:
        return self.workdir / f"{self._name(process)}.port"

    def _spawn(
        self, process: int, extra: Sequence[str] = (), data_port: int = 0, admin_port: int = 0
    ) -> subprocess.Popen[bytes]:
        """Starts process `process` (ports 0: any free ones)."""
        self._port_file(process).unlink(missing_ok=True)
        ports = ["--port", str(data_port), "--admin-port", str(admin_port)]
        place = [] if "--join" in extra else [
            "--shard-index", str(process % self.num_shards), "--num-shards", str(self.num_shards),
        ]  # fmt: skip
        cmd = [
            sys.executable, "-m", "tf_dlt.server", *ports, "--bind", "127.0.0.1", *place,
            "--port-file", str(self._port_file(process)), "--parent-pid", str(os.getpid()),
            *self._args, *extra,
        ]  # fmt: skip
        with self.log_path(process).open("ab") as log:
            # A session of its own: a terminal's Ctrl-C (SIGINT to the whole
            # foreground group) stopped the shards at once, before the
            # trainers' saves on the launcher's SIGTERM (--parent-pid stops
            # them when this process dies).
            return subprocess.Popen(
                cmd, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=log, env=self._env,
                start_new_session=True,
            )  # fmt: skip

    def kill(self, process: int) -> None:
        """SIGKILL to process `process` (a crash: nothing is flushed or saved)."""
        self.processes[process].kill()
        self.processes[process].wait(30)

    def restart(
        self, process: int, *server_args: str, rejoin: bool = True, same_admin_port: bool = True
    ) -> None:
        """Starts process `process` again on the same ports (as a Kubernetes
        pod keeps its name), with extra flags (e.g. "--load-from", path);
        waits until it listens. A process of a shard with a standby rejoins
        it (`--replica-set`: a standby of the one that serves, or the
        primary); any other, or any with `rejoin=False`, keeps the flags it
        was first started with. `same_admin_port` False: the admin port is
        any free one (as `tf-dlt server --port P` run again chooses)."""
        if self._stopped:
            raise RuntimeError("the cluster was stopped")
        if self.processes[process].poll() is None:
            raise RuntimeError(f"process {process} is still running")
        data = int(self.process_addresses[process].rsplit(":", 1)[1])
        own = self._extra[process]
        if "|" in self._replica_sets[process] and rejoin:
            # Whichever role it had, it learns it again (and, after a
            # re-shard, its place: it was started with the one before).
            joining = ["--join"] if "--join" in own else []
            own = [*joining, "--replica-set", self._replica_sets[process],
                   "--advertise", self.process_addresses[process]]  # fmt: skip
        extra = [*own, *absolute_paths(server_args)]
        admin = self.admin_ports[process] if same_admin_port else 0
        self.processes[process] = self._spawn(process, extra, data, admin)
        _, self.admin_ports[process], self.metrics_ports[process] = self._wait_for_ports(
            process, self.processes[process]
        )  # (a metrics port 0 is any free one again)

    def _wait_for_ports(self, process: int, proc: subprocess.Popen[bytes]) -> tuple[int, int, int]:
        port_file = self._port_file(process)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if port_file.exists():
                data, admin, metrics_port = port_file.read_text().split()
                return int(data), int(admin), int(metrics_port)
            if proc.poll() is not None:
                self.failed_process = process
                raise RuntimeError(
                    f"{self._name(process)} exited with {proc.returncode}:\n{self.log(process)}"
                )
            if self.interrupted():
                raise StartInterrupted(f"the start of {self._name(process)} was interrupted")
            time.sleep(0.05)
        self.failed_process = process
        raise TimeoutError(
            f"{self._name(process)} did not start in {self._timeout} s:\n{self.log(process)}"
        )

    def stop(self, timeout: float = 20.0) -> list[int | None]:
        """SIGTERM to every shard, SIGKILL to any still running after
        `timeout`; returns the exit codes."""
        self._stopped = True
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return [proc.returncode for proc in self.processes]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
