"""A trainer thread for the benchmarks that break or move shards under
training (bench_failover.py, bench_reshard.py): it takes steps (a pull and a
push of a batch of ids) until stopped, times each, and applies the same
pushes once each to a local table, the oracle the shards' rows must equal."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

import tf_dlt
from tf_dlt import _native
from tf_dlt.table_config import TableConfig


class StepTrainer:
    """Steps on table "emb" of `config` through `client`, batches drawn by
    `batch(rng)`; an exception ends it and is kept in `failures`."""

    def __init__(
        self,
        client: tf_dlt.Client,
        config: TableConfig,
        batch: Callable[[np.random.Generator], np.ndarray],
    ) -> None:
        self.oracle = _native.Table(config.to_dict())
        self.steps: list[tuple[float, float]] = []  # (start, seconds) of each step
        self.failures: list[BaseException] = []
        self.ids_per_step = 0
        self._client, self._batch, self._dim = client, batch, config.dim
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        rng = np.random.default_rng(1)
        try:
            while not self._stop.is_set():
                ids = self._batch(rng)
                self.ids_per_step = len(ids)
                grads = rng.normal(size=(len(ids), self._dim)).astype(np.float32)
                start = time.monotonic()
                self._client.pull("emb", ids)
                self._client.push("emb", ids, grads, 0.05)
                self.steps.append((start, time.monotonic() - start))
                self.oracle.push(ids, grads, 0.05)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.failures.append(e)

    def start(self) -> StepTrainer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def longest(self, begin: float, end: float) -> float:
        """The longest step that overlapped [begin, end)."""
        return max((s for t, s in self.steps if t < end and t + s >= begin), default=0.0)

    def rows_per_s(self, begin: float, end: float) -> float:
        """Rows pulled and pushed per second by the steps begun in [begin, end)."""
        inside = sum(1 for t, _ in self.steps if begin <= t < end)
        return 2 * self.ids_per_step * inside / max(end - begin, 1e-9)

    def rows_differing(self, ids: np.ndarray) -> int:
        """Rows of `ids` whose values differ from the oracle's."""
        pulled = self._client.pull("emb", ids, training=False)
        return int((pulled != self.oracle.pull(ids)).any(axis=1).sum())
