"""Shared fixtures: real shard server processes on loopback (port 0, bounded
waits, every process stopped in teardown)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import tf_dlt

DATA = Path(__file__).parent / "data"
START_TIMEOUT_S = 60.0


def pytest_configure(config: pytest.Config) -> None:
    # The suite tests the installed package; keras_layers must install as tf_dlt.layers.
    import importlib.util

    assert importlib.util.find_spec("tf_dlt.layers") is not None, "tf_dlt is not installed"


@dataclass
class Cluster:
    """Shard server processes started by `start_cluster`."""

    addresses: list[str]
    admin_ports: list[int]
    processes: list[subprocess.Popen[bytes]]
    logs: list[Path]
    token: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    def client(self, **kwargs: object) -> tf_dlt.Client:
        kwargs.setdefault("auth_token", self.token)
        return tf_dlt.Client(self.addresses, **kwargs)  # type: ignore[arg-type]

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")


def spawn_shard(
    tmp: Path,
    index: int,
    num_shards: int,
    *extra_args: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    port_file = tmp / f"shard{index}.port"
    log = tmp / f"shard{index}.log"
    with contextlib.suppress(FileNotFoundError):
        port_file.unlink()
    cmd = [
        sys.executable, "-m", "tf_dlt.server",
        "--port", "0", "--admin-port", "0", "--bind", "127.0.0.1",
        "--shard-index", str(index), "--num-shards", str(num_shards),
        "--port-file", str(port_file), *extra_args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=log.open("wb"),
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    return proc, port_file, log


def wait_for_ports(proc: subprocess.Popen[bytes], port_file: Path, log: Path) -> tuple[int, int]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if port_file.exists():
            data, admin = port_file.read_text().split()
            return int(data), int(admin)
        if proc.poll() is not None:
            raise RuntimeError(f"shard server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    raise TimeoutError(f"shard server did not start within {START_TIMEOUT_S} s:\n{log.read_text()}")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@pytest.fixture
def start_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Factory: start_cluster(num_shards, *server_args, token="", env=None)."""
    clusters: list[Cluster] = []

    def start(
        num_shards: int, *args: str, token: str = "", env: dict[str, str] | None = None
    ) -> Cluster:
        extra = list(args)
        if token:
            token_file = tmp_path / "token"
            token_file.write_text(token)
            extra += ["--auth-token-file", str(token_file)]
        base = tmp_path / f"cluster{len(clusters)}"
        base.mkdir()
        spawned = [spawn_shard(base, i, num_shards, *extra, env=env) for i in range(num_shards)]
        cluster = Cluster([], [], [p for p, _, _ in spawned], [lg for _, _, lg in spawned], token)
        clusters.append(cluster)
        for proc, port_file, log in spawned:
            data, admin = wait_for_ports(proc, port_file, log)
            cluster.addresses.append(f"127.0.0.1:{data}")
            cluster.admin_ports.append(admin)
        return cluster

    yield start
    for cluster in clusters:
        for proc in cluster.processes:
            stop_process(proc)


@pytest.fixture(params=[1, 3], ids=["1shard", "3shards"])
def cluster(request: pytest.FixtureRequest, start_cluster: Callable[..., Cluster]) -> Cluster:
    """A running cluster of 1 or 3 shard processes."""
    return start_cluster(request.param)
