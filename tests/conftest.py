"""Shared fixtures: real shard server processes on loopback (port 0, bounded
waits, every process stopped in teardown)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import tf_dlt
from tf_dlt import _native
from tf_dlt.checkpoint import shard_files
from tf_dlt.server.local import LocalCluster


def pytest_configure(config: pytest.Config) -> None:
    # The suite tests the installed package; keras_layers must install as tf_dlt.layers.
    import importlib.util

    assert importlib.util.find_spec("tf_dlt.layers") is not None, "tf_dlt is not installed"


# Fixtures that start shard servers: a test using one is a cluster test.
_SERVER_FIXTURES = {"start_cluster", "cluster"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test by what it needs, so one kind runs alone
    (``pytest -m unit``): "cluster" for a test that starts shard servers (a
    server fixture, or marked so by hand where it starts them itself),
    "slow" as marked by hand, and "unit" for every other test."""
    for item in items:
        if _SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
        if item.get_closest_marker("cluster") is None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)


# id -> (values, slots, step, age against the table's clock)
Rows = dict[int, tuple[bytes, bytes, int, int]]


def staged_rows(path: str, num_shards: int) -> dict[str, Rows]:
    """Every row a load of `path` onto `num_shards` shards gives, read from
    the staged tables (no server involved)."""
    out: dict[str, Rows] = {}
    for index in range(num_shards):
        staged = shard_files.prepare_load(path, _native.Shard(index, num_shards))["staged"]
        for table in staged:
            rows = out.setdefault(table.name, {})
            exporter = table.exporter()
            now = table.now()
            seconds = table.config["policy"]["clock"] == "seconds"
            while (chunk := exporter.next(4096)) is not None:
                ids, values, slots, steps, _, touched = chunk
                for i in range(len(ids)):
                    age = int(touched[i]) if seconds else (now - int(touched[i])) % (1 << 32)
                    rows[int(ids[i])] = (
                        values[i].tobytes(), slots[i].tobytes(), int(steps[i]), age
                    )  # fmt: skip
    return out


def flip_byte(file: Path, fraction: float = 0.75) -> None:
    """Corrupts `file`: inverts its byte `fraction` of the way in (by
    default among a shard file's rows, past its metadata)."""
    data = bytearray(file.read_bytes())
    data[int(len(data) * fraction)] ^= 0xFF
    file.write_bytes(bytes(data))


class Cluster(LocalCluster):
    """Shard server processes started by `start_cluster`."""

    token = ""

    def client(self, **kwargs: object) -> tf_dlt.Client:
        kwargs.setdefault("auth_token", self.token)
        return tf_dlt.Client(self.addresses, **kwargs)  # type: ignore[arg-type]


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
        workdir = tmp_path / f"cluster{len(clusters)}"
        cluster = Cluster(num_shards, *extra, workdir=workdir, env=env)
        cluster.token = token
        clusters.append(cluster)
        return cluster.start()

    yield start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(params=[1, 3], ids=["1shard", "3shards"])
def cluster(request: pytest.FixtureRequest, start_cluster: Callable[..., Cluster]) -> Cluster:
    """A running cluster of 1 or 3 shard processes."""
    return start_cluster(request.param)
