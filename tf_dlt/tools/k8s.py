"""`tf-dlt k8s`: Kubernetes manifests for one training job, generated from
the replica counts and the table size (docs/kubernetes.md):

- a headless Service and a StatefulSet of shard servers (stable names
  <name>-ps-<i>; the shard index from the pod-index label; gRPC readiness
  and liveness probes on grpc.health.v1; Prometheus port and annotations;
  memory requests sized from rows x bytes per row);
- an Indexed Job of trainers whose TF_CONFIG lists the shards and the
  trainers (each pod's index comes from JOB_COMPLETION_INDEX), with an init
  container that waits until every shard answers;
- the checkpoint location: an object-store URL (s3://, gs://, hdfs://), with
  credentials from a Secret, or a shared ReadWriteMany PersistentVolumeClaim
  mounted at the same path in shards and trainers; the shards save and load
  only there (--checkpoint-root);
- the auth token both planes require: an existing Secret
  (--auth-token-secret), or by default a new Secret with a random token
  (each run of the generator makes a new one); --insecure serves without.

    tf-dlt k8s --name ctr --image registry.example/ctr:1 --pservers 4 --workers 8 \\
        --rows 2e9 --dim 16 --optimizer adagrad --checkpoint s3://bucket/ctr \\
        -- python train.py --epochs 3 > ctr.yaml
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import IO, Any

import yaml  # type: ignore[import-untyped]

from tf_dlt.cluster import MAX_REPLICAS
from tf_dlt.server.shard_server import COPY_SERVICE
from tf_dlt.tools import capacity
from tf_dlt.tools.k8s_spec import (
    ADMIN_PORT,
    BASE_MEMORY_MIB,
    CHECKPOINT_MOUNT,
    DATA_PORT,
    METRICS_PORT,
    TIER_MOUNT,
    JobSpec,
    shard_memory,
)

# Which of a shard's processes a pod is (its StatefulSet): a selector label.
_REPLICA_LABEL = "tf-dlt/replica"

__all__ = ["ADMIN_PORT", "DATA_PORT", "METRICS_PORT", "JobSpec", "build_parser", "manifests",
           "render", "run", "shard_memory"]  # fmt: skip


def _labels(spec: JobSpec, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "tf-dlt", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": role, **spec.labels}  # fmt: skip


def _metadata(spec: JobSpec, name: str, role: str) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": _labels(spec, role)}


def _storage_env(spec: JobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """(env, volume mounts, volumes) giving a pod the checkpoint location."""
    env: list[dict[str, Any]] = [{"name": "TF_DLT_CHECKPOINT", "value": spec.checkpoint}]
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if spec.on_volume:
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT})
        claim = {"claimName": f"{spec.name}-checkpoints"}
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": claim})
    return env, mounts, volumes


def _secret_env(spec: JobSpec) -> list[dict[str, Any]]:
    return [{"secretRef": {"name": spec.credentials_secret}}] if spec.credentials_secret else []


def _token_volume(spec: JobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not spec.token_secret:
        return [], []
    return (
        [{"name": "auth-token", "mountPath": "/etc/tf-dlt", "readOnly": True}],
        [{"name": "auth-token", "secret": {"secretName": spec.token_secret}}],
    )


def token_secret(spec: JobSpec) -> dict[str, Any]:
    """The generated Secret with the auth token (key "token")."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(spec, f"{spec.name}-token", "auth"),
        "type": "Opaque",
        "stringData": {"token": spec.generated_token},
    }


def service(spec: JobSpec) -> dict[str, Any]:
    ports = [
        {"name": "data", "port": DATA_PORT, "targetPort": "data"},
        {"name": "admin", "port": ADMIN_PORT, "targetPort": "admin"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, spec.ps_service, "ps"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _labels(spec, "ps"),
            "ports": ports,
        },
    }


def _replica_labels(spec: JobSpec, replica: int) -> dict[str, str]:
    """A shard pod's labels: with standbys, which StatefulSet's it is (their
    selectors must not overlap)."""
    labels = _labels(spec, "ps")
    return {**labels, _REPLICA_LABEL: str(replica)} if spec.replicas > 1 else labels


def _replication(spec: JobSpec) -> tuple[list[str], list[dict[str, Any]], dict[str, Any]]:
    """(args, env, pod affinity) of a shard process with standbys: every
    process of a shard learns its role at start (--replica-set), and no two
    share a node."""
    if spec.replicas == 1:
        return [], [], {}
    args = [
        f"--replica-set={spec.shard_address('$(SHARD_INDEX)')}",
        f"--advertise=$(POD_NAME).{spec.ps_host}:{DATA_PORT}",
    ]
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    # Pods of one shard (the same pod index in each StatefulSet) repel.
    apart = {
        "labelSelector": {"matchLabels": _labels(spec, "ps")},
        "matchLabelKeys": ["apps.kubernetes.io/pod-index"],
        "topologyKey": "kubernetes.io/hostname",
    }
    affinity = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [apart]}}
    return args, env, {"affinity": affinity}


def stateful_set(spec: JobSpec, replica: int = 0) -> dict[str, Any]:
    memory = shard_memory(spec)
    env, mounts, volumes = _storage_env(spec)
    token_mounts, token_volumes = _token_volume(spec)
    env.append({
        "name": "SHARD_INDEX",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
    })  # fmt: skip
    args = [
        "server", f"--port={DATA_PORT}", f"--admin-port={ADMIN_PORT}",
        f"--metrics-port={METRICS_PORT}", "--bind=0.0.0.0", "--shard-index=$(SHARD_INDEX)",
        f"--num-shards={spec.pservers}", f"--threads={spec.shard_threads}",
        f"--max-connections={spec.shard_connections}", f"--checkpoint-root={spec.checkpoint}",
    ]  # fmt: skip
    if spec.token_secret:
        args.append("--auth-token-file=/etc/tf-dlt/token")
    else:
        args.append("--insecure")
    if spec.memory_budget:
        args.append(f"--memory-budget={spec.memory_budget}")
    if spec.tier_volume_size:
        args.append(f"--storage-dir={TIER_MOUNT}")
        mounts = [*mounts, {"name": "tier", "mountPath": TIER_MOUNT}]
    if spec.load_from:
        if not spec.load_from.startswith(spec.checkpoint.rstrip("/") + "/"):
            args.append(f"--checkpoint-root={spec.load_from}")
        args.append(f"--load-from={spec.load_from}")
    replication_args, replication_env, affinity = _replication(spec)
    args += replication_args
    env += replication_env
    probe = {"grpc": {"port": ADMIN_PORT}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = {
        "name": "shard",
        "image": spec.image,
        "command": ["tf-dlt"],
        "args": args,
        "env": env,
        "envFrom": _secret_env(spec),
        "ports": [
            {"name": "data", "containerPort": DATA_PORT},
            {"name": "admin", "containerPort": ADMIN_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        # Ready: it holds a whole copy of its shard (a replica set's member
        # loading, copying or learning its role is not), so a drain (the
        # disruption budget) or a rolling restart never stops a shard's last
        # whole copy; alive: it answers ("").
        "readinessProbe": {
            **probe,
            "grpc": {"port": ADMIN_PORT, "service": COPY_SERVICE},
            "initialDelaySeconds": 2,
        },
        # A --load-from of a large checkpoint takes minutes: liveness waits.
        "startupProbe": {**probe, "failureThreshold": 180},
        "livenessProbe": {**probe, "failureThreshold": 3},
        "resources": {
            "requests": {"cpu": spec.shard_cpu, "memory": f"{memory}Mi"},
            "limits": {"memory": f"{memory}Mi"},
        },
        "volumeMounts": mounts + token_mounts,
    }
    claims = []
    if spec.tier_volume_size:
        # Each shard's own local SSD: the disk tier is a cache of its state,
        # emptied at start, so the claim need not outlive the pod's data.
        claim: dict[str, Any] = {
            "metadata": {"name": "tier"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": spec.tier_volume_size}},
            },
        }
        if spec.tier_storage_class:
            claim["spec"]["storageClassName"] = spec.tier_storage_class
        claims.append(claim)
    # The claims go with their pods' set (deleted or scaled down): a tier
    # is emptied at start anyway, and a kept one holds its whole size.
    retention = {"whenDeleted": "Delete", "whenScaled": "Delete"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(spec, spec.ps_set(replica), "ps"),
        "spec": {
            **(
                {"volumeClaimTemplates": claims, "persistentVolumeClaimRetentionPolicy": retention}
                if claims
                else {}
            ),
            "serviceName": spec.ps_service,
            "replicas": spec.pservers,
            "podManagementPolicy": "Parallel",
            # With standbys, each StatefulSet would roll an update on its own,
            # both processes of a shard at once: pods are replaced one at a
            # time, each once the one before is ready (docs/kubernetes.md).
            **({"updateStrategy": {"type": "OnDelete"}} if spec.replicas > 1 else {}),
            "selector": {"matchLabels": _replica_labels(spec, replica)},
            "template": {
                "metadata": {
                    "labels": _replica_labels(spec, replica),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(METRICS_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    # SIGTERM lets a running Save finish (--stop-grace 60).
                    "terminationGracePeriodSeconds": 90,
                    **affinity,
                    "containers": [container],
                    "volumes": volumes + token_volumes,
                },
            },
        },
    }


def disruption_budget(spec: JobSpec) -> dict[str, Any]:
    """With standbys: a drain takes at most one shard process at a time, so
    never two of one shard."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec, spec.ps_service, "ps"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(spec, "ps")}},
    }


def trainer_job(spec: JobSpec) -> dict[str, Any]:
    env, mounts, volumes = _storage_env(spec)
    token_mounts, token_volumes = _token_volume(spec)
    env.append({"name": "TF_CONFIG", "value": spec.tf_config()})
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    if spec.token_secret:
        # Clients given no token read it (tf_dlt.Client and the ops alike).
        env.append({"name": "TF_DLT_AUTH_TOKEN_FILE", "value": "/etc/tf-dlt/token"})
    wait = (
        f"until tf-dlt stats --pservers {shlex.quote(','.join(spec.ps_addresses()))}"
        + (" --auth-token-file /etc/tf-dlt/token" if spec.token_secret else "")
        + " > /dev/null; do echo waiting for the shards; sleep 2; done"
    )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(spec, f"{spec.name}-trainer", "trainer"),
        "spec": {
            "completionMode": "Indexed",
            "completions": spec.workers,
            "parallelism": spec.workers,
            "backoffLimit": spec.workers * 2,
            "template": {
                "metadata": {"labels": _labels(spec, "trainer")},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "initContainers": [
                        {
                            "name": "wait-for-shards",
                            "image": spec.image,
                            "command": ["sh", "-c", wait],
                            "volumeMounts": token_mounts,
                        }
                    ],  # fmt: skip
                    "containers": [
                        {
                            "name": "trainer",
                            "image": spec.image,
                            "command": spec.command,
                            "env": env,
                            "envFrom": _secret_env(spec),
                            "resources": {
                                "requests": {"cpu": spec.worker_cpu, "memory": spec.worker_memory},
                                "limits": {"memory": spec.worker_memory},
                            },
                            "volumeMounts": mounts + token_mounts,
                        }
                    ],  # fmt: skip
                    "volumes": volumes + token_volumes,
                },
            },
        },
    }


def checkpoint_claim(spec: JobSpec) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": spec.checkpoint_volume_size}},
    }
    if spec.storage_class:
        claim["storageClassName"] = spec.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(spec, f"{spec.name}-checkpoints", "checkpoints"),
        "spec": claim,
    }


def manifests(spec: JobSpec) -> list[dict[str, Any]]:
    """Every object of the job, in the order to apply them."""
    out = [checkpoint_claim(spec)] if spec.on_volume else []
    if spec.generated_token:
        out.append(token_secret(spec))
    shards = [stateful_set(spec, replica) for replica in range(spec.replicas)]
    if spec.replicas > 1:
        shards.append(disruption_budget(spec))
    return out + [service(spec), *shards, trainer_job(spec)]


def render(spec: JobSpec) -> str:
    """The manifests as one YAML stream, with the sizing assumptions."""
    per_row = capacity.bytes_per_row(spec.dim, spec.optimizer, spec.value_dtype, spec.slot_dtype)
    raw = capacity.raw_record_bytes(spec.dim, spec.optimizer, spec.value_dtype, spec.slot_dtype)
    memory = shard_memory(spec)
    sets = ", ".join(f"{spec.ps_set(r)}-<i>" for r in range(1, spec.replicas))
    standbys = (
        f" each with a hot standby ({sets}, never on its node; --replica-set: a restarted "
        "process follows the one that serves),"
        if spec.replicas == 2
        else f" each with {spec.replicas - 1} hot standbys ({sets}, no two of a shard on one "
        "node; --replica-set: a restarted process follows the one that serves),"
        if spec.replicas > 2
        else ""
    )
    rows_memory = (
        f"# Shard memory: {spec.rows:.3g} ids x {spec.admission_rate:g} admitted / "
        f"{spec.pservers} shards x {per_row:.0f} B/row (dim {spec.dim}, {spec.optimizer}, "
        f"{spec.value_dtype} values, {spec.slot_dtype} slots: {raw} B header, values and slots "
        f"+ {capacity.GENERATION_BYTES} B change generation + "
        f"{capacity.index_bytes_per_row():.1f} B measured index)"
        + (f" + {spec.sketch_bytes:.3g} B sketch / {spec.pservers}" if spec.sketch_bytes else "")
    )
    head = [
        f"# tf_dlt job {spec.name!r}: {spec.pservers} shard servers,{standbys} "
        f"{spec.workers} trainers.",
        rows_memory
        + f" x{spec.headroom} headroom + {BASE_MEMORY_MIB} MiB = {memory} MiB per shard."
        if not spec.memory_budget
        else f"# Shard memory: the --memory-budget of {spec.memory_budget / 2**30:.3g} GiB and "
        f"the 10% a shard may pass it by = {memory} MiB per shard; rows past the budget "
        + (
            "live on the tier volume."
            if spec.tier_volume_size
            else "are evicted (no --ssd: no disk tier; docs/memory.md)."
        ),
        f"# Checkpoints: {spec.checkpoint}"
        + (" (shared ReadWriteMany volume)" if spec.on_volume else "")
        + "; shards save and load nowhere else.",
        f"# Data plane: {spec.shard_threads} worker threads per shard (its CPU request), up to "
        f"{spec.shard_connections} trainer connections (64 per trainer, at least 1024).",
        "# Auth: "
        + (
            f"a new random token in Secret {spec.name}-token (each run of `tf-dlt k8s` makes a "
            "new one: apply once, or pass --auth-token-secret)."
            if spec.generated_token
            else f"the token in Secret {spec.auth_token_secret}."
            if spec.auth_token_secret
            else "none (--insecure): keep the shards on a network only the job reaches."
        ),
        "# Generated by `tf-dlt k8s`; see docs/kubernetes.md.",
    ]
    body = str(yaml.safe_dump_all(manifests(spec), sort_keys=False, width=1000))
    return "\n".join(head) + "\n" + body


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    a("--name", required=True, help="job name: prefix of every object")
    a("--image", required=True, help="container image with tf_dlt and the train script")
    a("--namespace", default="default")
    a("--pservers", type=int, default=2, help="shard servers")
    a("--workers", type=int, default=2, help="trainers")
    a(
        "--replicas",
        type=int,
        default=1,
        choices=range(1, MAX_REPLICAS + 1),
        metavar="R",
        help=f"processes per shard (1 to {MAX_REPLICAS}): R > 1 gives each shard R - 1 hot "
        "standbys, each on a node of its own (docs/replication.md)",
    )
    a("--rows", type=float, default=1e8, help="expected rows over all tables (sizes the shards)")
    a("--dim", type=int, default=16, help="row dimension (the largest table's)")
    a(
        "--optimizer",
        default="adagrad",
        choices=sorted(capacity.SLOTS),
        help="server-side optimizer",
    )
    a("--headroom", type=float, default=1.5, help="memory request over the table estimate")
    a("--value-dtype", default="float32", choices=sorted(capacity.DTYPE_BYTES))
    a("--slot-dtype", default="float32", choices=sorted(capacity.DTYPE_BYTES))
    a(
        "--admission-rate",
        type=float,
        default=1.0,
        help="fraction of ids that get a row (tables with admission)",
    )
    a("--sketch-bytes", type=float, default=0.0, help="Frequency admission sketch memory")
    where = f"a path under {CHECKPOINT_MOUNT} on a shared volume"
    a(
        "--checkpoint",
        default=f"{CHECKPOINT_MOUNT}/run",
        help=f"checkpoint URL (s3://...) or {where}",
    )
    a("--checkpoint-volume-size", default="100Gi")
    a("--storage-class", help="storage class of the shared checkpoint volume")
    a("--credentials-secret", help="Secret with object-store credentials (env vars)")
    a(
        "--auth-token-secret",
        help="existing Secret with key 'token': the shards' auth token (default: generate one)",
    )
    a("--insecure", action="store_true", help="no auth token (a network only the job reaches)")
    a("--load-from", help="checkpoint the shards load before serving")
    a(
        "--memory-budget",
        type=capacity.parse_size,
        default=0,
        help="each shard's --memory-budget, e.g. 48GiB (sets its memory request)",
    )
    a("--ssd", default="", help="each shard's disk tier volume, e.g. 1600Gi (needs a budget)")
    a("--tier-storage-class", help="storage class of the disk tier volumes (local SSD)")
    a(
        "--shard-cpu",
        default="4",
        help="CPU request of a shard (its --threads): the cores `tf-dlt plan --shard-cores` "
        "sized its throughput with (4 by default there too)",
    )
    a("--worker-cpu", default="4")
    a("--worker-memory", default="8Gi")
    parser.epilog = "The trainer command follows '--'."
    return parser


def run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    try:
        spec = JobSpec(
            name=args.name, image=args.image, command=list(getattr(args, "trainer_command", [])),
            pservers=args.pservers, workers=args.workers, replicas=args.replicas,
            rows=args.rows, dim=args.dim,
            optimizer=args.optimizer, checkpoint=args.checkpoint, namespace=args.namespace,
            value_dtype=args.value_dtype, slot_dtype=args.slot_dtype,
            admission_rate=args.admission_rate, sketch_bytes=args.sketch_bytes,
            headroom=args.headroom, shard_cpu=args.shard_cpu, worker_cpu=args.worker_cpu,
            worker_memory=args.worker_memory, checkpoint_volume_size=args.checkpoint_volume_size,
            storage_class=args.storage_class, credentials_secret=args.credentials_secret,
            auth_token_secret=args.auth_token_secret, insecure=args.insecure,
            load_from=args.load_from, memory_budget=args.memory_budget,
            tier_volume_size=args.ssd, tier_storage_class=args.tier_storage_class,
        )  # fmt: skip
    except ValueError as e:
        print(f"tf-dlt k8s: {e}", file=sys.stderr)
        return 2
    (out or sys.stdout).write(render(spec))
    return 0
