"""What `tf-dlt k8s` generates a job from: the replica counts, the table's
size and policy, the checkpoint location and the token (`JobSpec`, checked
on creation), and how much memory a shard is to request (`shard_memory`).
The manifests themselves are built by k8s.py."""

from __future__ import annotations

import json
import math
import posixpath
import re
import secrets
from dataclasses import dataclass, field

from tf_dlt import errors
from tf_dlt.cluster import MAX_REPLICAS
from tf_dlt.routing import NUM_BUCKETS
from tf_dlt.server.paths import CheckpointRoots
from tf_dlt.table_config import MAX_DIM
from tf_dlt.tools import capacity

DATA_PORT, ADMIN_PORT, METRICS_PORT = 7000, 7001, 9100
CHECKPOINT_MOUNT = "/checkpoints"
TIER_MOUNT = "/tier"
# Requests: the table (bytes per row as tf_dlt.tools.capacity measured them) times
# `headroom` for growth and save buffers, plus the process and gRPC server.
BASE_MEMORY_MIB = 512
# More cores than any node has: a CPU request past it is a typo.
MAX_CORES = 4096


def shard_memory(spec: JobSpec) -> int:
    """Memory request of one shard in MiB: its share of the admitted rows and
    of the admission sketch; with a memory budget, the budget and the 10%
    a shard may pass it by."""
    if spec.memory_budget:
        return int(math.ceil(spec.memory_budget * 1.1 / (1 << 20)))
    table = capacity.table_bytes(
        spec.rows, spec.dim, spec.optimizer, spec.value_dtype, spec.slot_dtype,
        spec.admission_rate, spec.sketch_bytes,
    )  # fmt: skip
    return int(math.ceil(table / spec.pservers * spec.headroom / (1 << 20))) + BASE_MEMORY_MIB


# Kubernetes quantities (resource.Quantity): a positive number with an
# optional binary or decimal suffix; CPU in cores or millicores.
_MEMORY_QUANTITY = re.compile(
    r"\+?(\d+\.?\d*|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?\d+)?"
)
_CPU_QUANTITY = re.compile(r"\+?(\d+\.?\d*|\.\d+)(m|[eE][+-]?\d+)?")
# A namespace is a DNS label (RFC 1123).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# The job's name begins every object's: a Service's is a DNS-1035 label (a
# letter first), and the longest made from it, a standby set's
# "<name>-ps-r4" with the 11 characters of its controller-revision-hash
# label, must fit a label's 63.
_JOB_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
# Secrets are named by DNS subdomains (RFC 1123).
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Storage sizes below this are a unit left out ("10" is 10 bytes).
_MIN_VOLUME_BYTES = 1 << 20
_SUFFIX_BYTES = {
    "": 1, "m": 1e-3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
}  # fmt: skip


def _is_url(location: str) -> bool:
    """`location` begins with a scheme (s3://, hdfs://): a path holding
    "://" further on ("/etc/x://y") is a path."""
    return re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", location) is not None


def _quantity(flag: str, value: str, pattern: re.Pattern[str], example: str) -> float:
    """The number a Kubernetes quantity `value` holds (bytes, or cores);
    ValueError naming `flag` when it is not one, or not above 0."""
    match = pattern.fullmatch(value)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{flag} must be a positive Kubernetes quantity like {example}, got "
                         f"{value!r}")  # fmt: skip
    number, suffix = float(match.group(1)), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * 10.0 ** int(suffix[1:])
    return number * (1e-3 if suffix == "m" else _SUFFIX_BYTES.get(suffix, 1))


@dataclass
class JobSpec:
    """What the manifests describe; `tf-dlt k8s` fills it from its flags."""

    name: str
    image: str
    command: list[str]
    pservers: int = 2
    workers: int = 2
    # Processes per shard: 2 gives each a hot standby (docs/replication.md).
    replicas: int = 1
    rows: float = 1e8
    dim: int = 16
    optimizer: str = "adagrad"
    value_dtype: str = "float32"
    slot_dtype: str = "float32"
    admission_rate: float = 1.0
    sketch_bytes: float = 0.0
    checkpoint: str = f"{CHECKPOINT_MOUNT}/run"
    namespace: str = "default"
    headroom: float = 1.5
    shard_cpu: str = "4"  # as `tf-dlt plan --shard-cores`
    worker_cpu: str = "4"
    worker_memory: str = "8Gi"
    checkpoint_volume_size: str = "100Gi"
    storage_class: str | None = None
    credentials_secret: str | None = None
    auth_token_secret: str | None = None
    insecure: bool = False
    load_from: str | None = None
    # Tiered storage (docs/tiered_storage.md): the shards' --memory-budget
    # (bytes, 0: none) and the size of the local SSD volume of each shard's
    # disk tier ("" : no disk tier), of `tier_storage_class`.
    memory_budget: int = 0
    tier_volume_size: str = ""
    tier_storage_class: str | None = None
    # The token of the Secret generated when none is named (filled in
    # __post_init__; empty when a Secret is named or with `insecure`).
    generated_token: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _JOB_NAME.fullmatch(self.name):
            raise ValueError(
                "name must be at most 40 lower-case letters, digits and '-', beginning with a "
                f"letter and ending with a letter or digit (it begins every object's), got "
                f"{self.name!r}"
            )
        for flag, secret in (
            ("--credentials-secret", self.credentials_secret),
            ("--auth-token-secret", self.auth_token_secret),
        ):
            if secret and not (len(secret) <= 253 and _DNS_SUBDOMAIN.fullmatch(secret)):
                raise ValueError(
                    f"{flag} must name a Secret (lower-case letters, digits, '-' and '.'), got "
                    f"{secret!r}"
                )
        if not _DNS_LABEL.fullmatch(self.namespace):
            raise ValueError(
                "namespace must be lower-case letters, digits and '-' (a DNS label of at most "
                f"63 characters), got {self.namespace!r}"
            )
        if not self.image.strip() or any(c.isspace() for c in self.image):
            raise ValueError(f"image must name a container image, got {self.image!r}")
        for flag, cpu in (("--shard-cpu", self.shard_cpu), ("--worker-cpu", self.worker_cpu)):
            if _quantity(flag, cpu, _CPU_QUANTITY, "2 or 500m") > MAX_CORES:
                # (--shard-cpu 1e10 became --threads=10000000000, which the
                # shards refused at start)
                raise ValueError(f"{flag} {cpu!r} is more than {MAX_CORES} cores")
        for flag, size in (
            ("--worker-memory", self.worker_memory),
            ("--checkpoint-volume-size", self.checkpoint_volume_size),
            ("--ssd", self.tier_volume_size),
        ):
            if flag == "--ssd" and not size:
                continue
            if _quantity(flag, size, _MEMORY_QUANTITY, "100Gi") < _MIN_VOLUME_BYTES:
                raise ValueError(f"{flag} {size!r} is under 1 MiB (a unit left out? e.g. 100Gi)")
        if self.pservers < 1 or self.workers < 1:
            raise ValueError(
                f"need pservers >= 1 and workers >= 1, got {self.pservers}, {self.workers}"
            )
        if self.pservers > NUM_BUCKETS:
            raise ValueError(
                f"pservers must be at most {NUM_BUCKETS} (a shard owns at least one of the "
                f"{NUM_BUCKETS} buckets; the shards refuse more at start), got {self.pservers}"
            )
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(
                f"replicas must be 1 to {MAX_REPLICAS} (a primary and its standbys), "
                f"got {self.replicas}"
            )
        if self.optimizer not in capacity.SLOTS:
            raise ValueError(
                f"optimizer must be one of {sorted(capacity.SLOTS)}, got {self.optimizer!r}"
            )
        if not 1 <= self.dim <= MAX_DIM:
            raise ValueError(f"dim must be 1 to {MAX_DIM}, got {self.dim}")
        # (NaN fails each comparison; inf is no size)
        if not 0 <= self.rows < math.inf or not 1 <= self.headroom < math.inf:
            raise ValueError(
                f"rows must be a number >= 0 and headroom one >= 1, got {self.rows} and "
                f"{self.headroom}"
            )
        if not 0 < self.admission_rate <= 1:
            raise ValueError(f"admission_rate must be in (0, 1], got {self.admission_rate}")
        if not 0 <= self.sketch_bytes < math.inf:
            raise ValueError(f"sketch_bytes must be a number >= 0, got {self.sketch_bytes}")
        for dtype in (self.value_dtype, self.slot_dtype):
            if dtype not in capacity.DTYPE_BYTES:
                raise ValueError(
                    f"dtypes must be one of {sorted(capacity.DTYPE_BYTES)}, got {dtype!r}"
                )
        if not self.command:
            raise ValueError("no trainer command: give it after '--'")
        if self.load_from is not None and not _is_url(self.load_from):
            # As the shards resolve it ("/checkpoints/run/../old" is not under
            # a root of /checkpoints/run, whatever the string's start).
            self.load_from = posixpath.normpath(self.load_from)
        if not _is_url(self.checkpoint):
            self.checkpoint = posixpath.normpath(self.checkpoint)
        for flag, location in (("--checkpoint", self.checkpoint), ("--load-from", self.load_from)):
            if location is None:
                continue
            if any(not c.isprintable() for c in location):
                raise ValueError(f"{flag} holds a control character (a newline?): {location!r}")
            if location.startswith("file:"):
                raise ValueError(
                    f"{flag} {location!r}: give a path under {CHECKPOINT_MOUNT}/ (the shared "
                    "volume) without file://, or an object store's URL (s3://...)"
                )
            if _is_url(location):
                # One the shards take as a --checkpoint-root (they refused
                # "s3://b//run", "S3://b/run" and ".." at start).
                try:
                    CheckpointRoots([location]).check(location, "Load")
                except errors.DltError as e:
                    raise ValueError(f"{flag} {location!r}: {e}") from None
                continue
            # Shards read and write nothing else: a URL, or the shared volume
            # ("/checkpoints/../etc" is the container's /etc).
            if not location.startswith(CHECKPOINT_MOUNT + "/"):
                raise ValueError(
                    f"{flag} must be a URL (s3://...) or a path under {CHECKPOINT_MOUNT}/ "
                    f"(the shared volume), got {location!r}"
                )
            if flag == "--load-from" and not self.on_volume:
                raise ValueError(
                    f"--load-from {location!r} is on the shared volume, which only a "
                    "--checkpoint on it mounts"
                )
        if self.memory_budget < 0:
            raise ValueError(f"memory_budget must be >= 0, got {self.memory_budget}")
        if self.memory_budget and self.memory_budget < capacity.LEAST_BUDGET:
            raise ValueError(
                f"a memory budget of {self.memory_budget / 2**20:.3g} MiB is below the smallest "
                f"a shard takes, about {capacity.LEAST_BUDGET / 2**20:.0f} MiB: the shards "
                "would refuse it at start"
            )
        table = capacity.table_bytes(
            self.rows, self.dim, self.optimizer, self.value_dtype, self.slot_dtype,
            self.admission_rate, self.sketch_bytes,
        )  # fmt: skip
        if not math.isfinite(table * self.headroom):  # finite sizes, a product past floats
            raise ValueError(
                f"{self.rows:g} rows of dim {self.dim} (with a sketch of {self.sketch_bytes:g} "
                "bytes) need more memory than any cluster has: check --rows and --sketch-bytes"
            )
        if self.tier_volume_size and not self.memory_budget:
            raise ValueError("a disk tier (--ssd) needs --memory-budget: rows move to it past it")
        # Classes of volumes the job would not have, refused rather than
        # left out of the manifests unsaid.
        if self.storage_class and not self.on_volume:
            raise ValueError(
                f"--storage-class {self.storage_class!r} is the class of the shared checkpoint "
                f"volume, which a --checkpoint URL ({self.checkpoint}) does not use"
            )
        if self.tier_storage_class and not self.tier_volume_size:
            raise ValueError(
                f"--tier-storage-class {self.tier_storage_class!r} is the class of the disk tier "
                "volumes, which only --ssd makes"
            )
        if self.insecure and self.auth_token_secret:
            raise ValueError("--insecure and --auth-token-secret exclude each other")
        if not self.insecure and not self.auth_token_secret and not self.generated_token:
            self.generated_token = secrets.token_urlsafe(32)

    @property
    def token_secret(self) -> str | None:
        """The Secret holding the token (named or generated); None: insecure."""
        if self.insecure:
            return None
        return self.auth_token_secret or f"{self.name}-token"

    @property
    def shard_threads(self) -> int:
        """Worker threads of a shard: its CPU request, rounded up (a
        container sees every core of its node, not its limit)."""
        cpu = self.shard_cpu
        cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        return max(1, math.ceil(cores))

    @property
    def shard_connections(self) -> int:
        """Authenticated connections a shard accepts: each trainer holds up
        to about 32 per shard (ops' pulls and pushes, its Python client, a
        pool of idle ones), with room for restarts."""
        return max(1024, self.workers * 64)

    @property
    def on_volume(self) -> bool:
        """The checkpoint is a path on the shared volume, not a URL."""
        return not _is_url(self.checkpoint)

    @property
    def ps_service(self) -> str:
        return f"{self.name}-ps"

    @property
    def ps_host(self) -> str:
        """The headless Service's domain: a shard pod is <pod name>.<this>."""
        return f"{self.ps_service}.{self.namespace}.svc.cluster.local"

    def ps_set(self, replica: int) -> str:
        """The StatefulSet of each shard's process `replica` (its pods are
        <set>-<shard index>): the shard's first, then its standbys'."""
        return self.ps_service if replica == 0 else f"{self.ps_service}-r{replica}"

    def shard_address(self, shard: int | str) -> str:
        """A shard's data-plane address as clients list it: each process's
        ("a|b|c" with standbys); `shard` may be "$(SHARD_INDEX)"."""
        return "|".join(
            f"{self.ps_set(r)}-{shard}.{self.ps_host}:{DATA_PORT}" for r in range(self.replicas)
        )

    def ps_addresses(self) -> list[str]:
        return [self.shard_address(i) for i in range(self.pservers)]

    def tf_config(self) -> str:
        """TF_CONFIG of every trainer pod (the index comes from the Job)."""
        workers = [f"{self.name}-trainer-{i}:0" for i in range(self.workers)]
        return json.dumps(
            {"cluster": {"ps": self.ps_addresses(), "worker": workers}, "task": {"type": "worker"}}
        )
