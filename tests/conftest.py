"""Shared fixtures: real shard server processes on loopback (port 0, bounded
waits, every process stopped in teardown)."""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import tf_dlt
from tf_dlt import _native
from tf_dlt.checkpoint import shard_files
from tf_dlt.server.local import LocalCluster

# Shard processes the tests start import the tf_dlt this process imports:
# run from a checkout (`python -m pytest`), the checkout's, not an older
# install in site-packages (plain `pytest`, as CI runs it, imports the
# install, and so do they).
_SOURCE = Path(tf_dlt.__file__).resolve().parent.parent
if (_SOURCE / "setup.py").exists():
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(_SOURCE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


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


# Ports handed out by `free_port`: below the kernel's ephemeral range
# (32768-60999 by default), so that no socket bound to port 0 and no
# outgoing connection takes one between its check and its server's bind (a
# replica set's second member once found its port taken by the first's).
_PORTS = itertools.cycle(range(20000, 32768))
for _ in range(random.randrange(12768)):  # apart from another suite's run
    next(_PORTS)


def free_port() -> int:
    """A loopback TCP port free now, for servers that need theirs up front;
    none is handed out twice within 12,768 calls."""
    for port in itertools.islice(_PORTS, 12768):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no loopback port is free in 20000-32767")


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Returns once `predicate()` is true; AssertionError naming `what`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def freeze(process: subprocess.Popen[bytes]) -> None:
    """Stops `process` (SIGSTOP) and returns once the kernel says it is
    stopped: a signal is delivered asynchronously, and under load the
    process went on for a few more requests (a frozen standby acknowledged
    the pushes meant to find it silent)."""
    process.send_signal(signal.SIGSTOP)

    def state() -> str:
        return Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    wait_until(lambda: state() == "T", f"process {process.pid} to stop")


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


# The data-plane addresses of every cluster start_cluster started in this
# session. The ops' clients are shared by address in a process (as in a
# trainer): one that met an earlier cluster's shard at an address would
# take a new cluster's shard there for that shard restarted, its rows lost
# (DataLossError). A cluster on such a port is started again elsewhere.
_USED_ADDRESSES: set[str] = set()
_FRESH_PORT_TRIES = 5


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
        for attempt in range(_FRESH_PORT_TRIES):
            workdir = tmp_path / f"cluster{len(clusters)}-{attempt}"
            cluster = Cluster(num_shards, *extra, workdir=workdir, env=env)
            cluster.token = token
            clusters.append(cluster)
            cluster.start()
            fresh = not _USED_ADDRESSES & set(cluster.process_addresses)
            if fresh or attempt == _FRESH_PORT_TRIES - 1:
                break
            cluster.stop()  # a port an earlier cluster of the session had
        _USED_ADDRESSES.update(cluster.process_addresses)
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(params=[1, 3], ids=["1shard", "3shards"])
def cluster(request: pytest.FixtureRequest, start_cluster: Callable[..., Cluster]) -> Cluster:
    """A running cluster of 1 or 3 shard processes."""
    return start_cluster(request.param)


def two_table_model(dim: int):  # type: ignore[no-untyped-def]
    """A compiled Keras model with two distributed tables, "u" (one user id
    per example) and "i" (three item ids, averaged), Adagrad; built in a
    fresh Keras session (an earlier test's embedded "u" of another dim
    would refuse it, whichever test ran before)."""
    import keras

    from tf_dlt.layers import Embedding

    keras.backend.clear_session()
    user = keras.Input((1,), dtype="int64", name="user")
    items = keras.Input((3,), dtype="int64", name="items")
    u = keras.layers.Flatten()(
        Embedding(output_dim=dim, is_distributed=True, name="u", seed=1)(user)
    )
    i = Embedding(output_dim=dim, is_distributed=True, name="i", seed=2)(items)
    x = keras.layers.Concatenate()([u, keras.layers.GlobalAveragePooling1D()(i)])
    out = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(x))
    model = keras.Model({"user": user, "items": items}, out)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def fit_data(batches: int = 40, batch: int = 16, vocab: int = 200):  # type: ignore[no-untyped-def]
    """A tf.data set for two_table_model: `batches` batches of ids below
    `vocab`, seeded."""
    import tensorflow as tf

    rng = np.random.default_rng(5)
    n = batches * batch
    x = {
        "user": rng.integers(0, vocab, size=(n, 1)),
        "items": rng.integers(0, vocab, size=(n, 3)),
    }
    y = rng.normal(size=(n, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


FitOutcome = tuple[list[float], list[np.ndarray], dict[str, Rows]]


def fit_outcome(history, model, addresses: list[str], path: str) -> FitOutcome:  # type: ignore[no-untyped-def]
    """What a distributed fit left: its losses, the model's weights, and
    every row of its tables (saved to `path` and read back)."""
    tf_dlt.Client(addresses).save(path)
    weights = [w.copy() for w in model.get_weights()]
    return history.history["loss"], weights, staged_rows(path, len(addresses))


def assert_same_training(a: FitOutcome, b: FitOutcome) -> None:
    """The same losses and weights, and rows in both tables."""
    assert len(a[2]["u"]) > 100 and len(a[2]["i"]) > 100
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1], strict=True):
        np.testing.assert_array_equal(x, y)
