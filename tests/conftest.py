"""Shared fixtures: real shard server processes on loopback (port 0, bounded
waits, every process stopped in teardown)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import tf_dlt
from tf_dlt.server.local import LocalCluster


def pytest_configure(config: pytest.Config) -> None:
    # The suite tests the installed package; keras_layers must install as tf_dlt.layers.
    import importlib.util

    assert importlib.util.find_spec("tf_dlt.layers") is not None, "tf_dlt is not installed"


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
