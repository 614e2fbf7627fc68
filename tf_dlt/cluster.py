"""The cluster a trainer runs in, from a TF_CONFIG-style environment variable,
so the same train.py runs alone, under `tf-dlt launch` and on Kubernetes.

    TF_CONFIG='{"cluster": {"ps": ["ps-0:7000", "ps-1:7000"],
                            "worker": ["trainer-0:0", "trainer-1:0"]},
                "task": {"type": "worker", "index": 1}}'

Job "ps" lists the shard servers' data-plane addresses in shard order (a
shard's hot standbys after its primary, "ps-0:7000|ps-0-standby:7000"); job
"worker" lists the trainers (only their number and order matter: trainers
listen on nothing). Worker 0 is the chief. Without TF_CONFIG a process is the
only trainer of the embedded tables. A task without "index" takes it from
JOB_COMPLETION_INDEX (set by Kubernetes in the pods of an Indexed Job), so
one pod template serves every trainer.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

ENV = "TF_CONFIG"
# Processes a shard may have ("a|b|c"): its primary and up to four hot
# standbys (docs/replication.md; each standby takes one of the primary's
# 16 row streams, which a live re-shard's range streams share).
MAX_REPLICAS = 5
INDEX_ENV = "JOB_COMPLETION_INDEX"
_JOBS = ("ps", "worker")
# A host name or IPv4 address (is_address).
_HOST = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class ClusterSpec:
    """Where the shards are and which trainer this process is.

    Attributes:
        pservers: shard servers' data-plane addresses, in shard order; empty
            means the embedded tables of this process.
        workers: the trainers' entries (their count and order).
        task_type: "worker" or "ps".
        task_index: this process' index within its job.
    """

    pservers: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=lambda: ["localhost:0"])
    task_type: str = "worker"
    task_index: int = 0

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def is_chief(self) -> bool:
        """True for worker 0: it initialises shared state and saves."""
        return self.task_type == "worker" and self.task_index == 0

    @property
    def embedded(self) -> bool:
        return not self.pservers

    def to_env(self) -> str:
        """The TF_CONFIG value describing this spec."""
        cluster: dict[str, list[str]] = {"worker": list(self.workers)}
        if self.pservers:
            cluster["ps"] = list(self.pservers)
        task = {"type": self.task_type, "index": self.task_index}
        return json.dumps({"cluster": cluster, "task": task})


def _fail(problem: str) -> ValueError:
    return ValueError(f"{ENV}: {problem}")


def is_address(a: str, port_zero: bool = False) -> bool:
    """Whether `a` is host:port (a port 1 to 65535, or 0 with `port_zero`: a
    trainer's, which listens on nothing; an IPv6 host in []): a host name or
    IPv4 address of letters, digits, '.', '-' and '_' only (a space, a comma
    or a bare IPv6 address's colons named a host no call could reach)."""
    host, _, port = a.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
    elif not _HOST.fullmatch(host):
        return False
    return is_count(port) and (1 - port_zero) <= int(port) <= 65535


def is_count(text: str) -> bool:
    """Whether `text` is a non-negative int in ASCII digits (str.isdigit
    takes '²' and Arabic-Indic digits, which int() then refuses or reads)."""
    return text.isascii() and text.isdigit()


def parse(text: str, default_index: int | None = None) -> ClusterSpec:
    """Parses a TF_CONFIG value; errors name the field that is wrong. A task
    without "index" gets `default_index` (an Indexed Job's), else index 0
    when its job has one member; with several it is refused (each trainer
    would take itself for worker 0, the chief)."""
    try:
        config: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(f"not JSON ({e})") from None
    if not isinstance(config, dict):
        raise _fail(f"must be a JSON object, got {type(config).__name__}")
    cluster = config.get("cluster", {})
    if not isinstance(cluster, dict):
        raise _fail('"cluster" must be an object of job name -> list of addresses')
    unknown = sorted(set(cluster) - set(_JOBS) - {"chief", "evaluator"})
    if unknown:
        raise _fail(f"unknown jobs {unknown}; tf_dlt uses {list(_JOBS)}")
    jobs: dict[str, list[str]] = {}
    for job in _JOBS:
        entries = cluster.get(job, [])
        trainers = job == "worker"  # listen on nothing: port 0 is theirs to give
        if not isinstance(entries, list) or not all(
            isinstance(a, str) and all(is_address(p, port_zero=trainers) for p in a.split("|"))
            for a in entries
        ):
            raise _fail(
                f'job "{job}" must be a list of "host:port" strings (a shard\'s standbys after '
                f'its primary: "host:port|host:port"), got {entries!r}'
            )
        jobs[job] = entries
    if "chief" in cluster:
        raise _fail('job "chief" is not used: worker 0 is the chief; list it under "worker"')
    task = config.get("task", {"type": "worker"})
    if not isinstance(task, dict):
        raise _fail('"task" must be an object {"type": ..., "index": ...}')
    task_type = task.get("type", "worker")
    if task_type not in _JOBS:
        raise _fail(f"task type must be one of {list(_JOBS)}, got {task_type!r}")
    members = jobs[task_type] or (["localhost:0"] if task_type == "worker" else [])
    index = task.get("index")
    if index is None:  # absent, or null
        index = default_index
    if index is None:
        if len(members) > 1:
            raise _fail(
                f'no task index, and job "{task_type}" has {len(members)} entries: give the '
                f'task\'s "index" (or {INDEX_ENV}, which an Indexed Job sets); without one every '
                "process would be task 0"
            )
        index = 0
    if isinstance(index, bool) or not isinstance(index, int):
        raise _fail(f"task index must be an int, got {index!r}")
    if not 0 <= index < len(members):
        raise _fail(f'task index {index} is outside job "{task_type}" ({len(members)} entries)')
    return ClusterSpec(
        pservers=jobs["ps"],
        workers=jobs["worker"] or ["localhost:0"],
        task_type=task_type,
        task_index=index,
    )


def cluster_from_env(environ: dict[str, str] | None = None) -> ClusterSpec:
    """This process' cluster from TF_CONFIG (a single embedded trainer when
    it is unset or empty)."""
    env = os.environ if environ is None else environ
    text = env.get(ENV, "").strip()
    if not text:
        return ClusterSpec()
    index = env.get(INDEX_ENV)
    if index is not None and not is_count(index):
        raise _fail(f"{INDEX_ENV} must be a non-negative int, got {index!r}")
    return parse(text, int(index) if index is not None else None)
