"""Kubernetes manifests from `tf-dlt k8s`: the files under deploy/ are what
the generator prints, every object validates strictly against the
Kubernetes schemas (kubernetes-validate, from PyPI), and the objects say
what the docs promise (shard names, probes, sizing, TF_CONFIG)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import tf_dlt
from tf_dlt.tools import capacity, k8s

ROOT = Path(__file__).resolve().parent.parent
TRAIN = "python examples/ctr_multi_trainer.py --epochs 3"
EXAMPLES = {
    "ctr-volume.yaml": "--name ctr --image registry.example/ctr-train:1 --pservers 2 --workers 2 "
    "--rows 1e8 --dim 16 --optimizer adagrad --checkpoint /checkpoints/ctr "
    "--auth-token-secret ctr-token",
    "ctr-s3.yaml": "--name ctr --image registry.example/ctr-train:1 --pservers 4 --workers 8 "
    "--rows 2e9 --dim 16 --optimizer adagrad --checkpoint s3://example-bucket/ctr "
    "--credentials-secret ctr-s3 --auth-token-secret ctr-token",
    "ctr-standbys.yaml": "--name ctr --image registry.example/ctr-train:1 --pservers 2 "
    "--workers 2 --replicas 2 --rows 1e8 --dim 16 --optimizer adagrad "
    "--checkpoint s3://example-bucket/ctr --credentials-secret ctr-s3 "
    "--auth-token-secret ctr-token",
}
# The pod-index label the shard index comes from exists since 1.28.
VERSIONS = ("1.30.0", "1.37.0")


def _generate(flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "tf_dlt.tools.cli",
        "k8s",
        *shlex.split(flags),
        "--",
        *shlex.split(TRAIN),
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, cwd="/"
    )  # outside the source tree: the installed package


def _objects(text: str) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text)}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_deploy_files_are_the_generators_output_and_validate(name: str) -> None:
    out = _generate(EXAMPLES[name])
    assert out.returncode == 0, out.stderr
    assert (ROOT / "deploy" / name).read_text() == out.stdout, (
        "regenerate deploy/ (docs/kubernetes.md)"
    )
    for doc in yaml.safe_load_all(out.stdout):
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_broken_object() -> None:
    (doc,) = [
        d
        for d in yaml.safe_load_all((ROOT / "deploy" / "ctr-volume.yaml").read_text())
        if d["kind"] == "StatefulSet"
    ]
    doc["spec"]["replicaz"] = doc["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[0], strict=True)


def test_objects_match_the_replica_counts_and_sizes() -> None:
    spec = k8s.JobSpec(
        name="ctr", image="img:1", command=["python", "t.py"], pservers=4, workers=8, rows=2e9,
        dim=16, optimizer="adagrad", checkpoint="s3://b/ctr", credentials_secret="s3",
        auth_token_secret="tok",
    )  # fmt: skip
    objects = {doc["kind"]: doc for doc in k8s.manifests(spec)}
    assert "PersistentVolumeClaim" not in objects  # object store
    service, sts, job = objects["Service"], objects["StatefulSet"], objects["Job"]
    assert service["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "ctr-ps"
    assert sts["spec"]["replicas"] == 4
    shard = sts["spec"]["template"]["spec"]["containers"][0]
    assert "--num-shards=4" in shard["args"] and "--shard-index=$(SHARD_INDEX)" in shard["args"]
    assert "--auth-token-file=/etc/tf-dlt/token" in shard["args"]
    # The cores `tf-dlt plan` sized a shard's throughput with (it had 2 of its 4).
    import argparse

    plan_cores = capacity.build_parser(argparse.ArgumentParser()).get_default("shard_cores")
    assert f"--threads={plan_cores:g}" in shard["args"]
    assert shard["resources"]["requests"]["cpu"] == f"{plan_cores:g}"
    index_env = {e["name"]: e for e in shard["env"]}["SHARD_INDEX"]
    assert index_env["valueFrom"]["fieldRef"]["fieldPath"].endswith(
        "['apps.kubernetes.io/pod-index']"
    )
    for probe in ("livenessProbe", "startupProbe"):
        assert shard[probe]["grpc"] == {"port": k8s.ADMIN_PORT}  # it answers
    # Ready once it holds a whole copy of its shard (ShardServer's health).
    assert shard["readinessProbe"]["grpc"] == {"port": k8s.ADMIN_PORT, "service": "tf_dlt.copy"}
    assert "updateStrategy" not in sts["spec"]  # no standby: a rolling update
    # 2e9 rows / 4 shards x measured bytes per row (dim 16, Adagrad) x 1.5 + 512 MiB
    per_row = capacity.bytes_per_row(16, "adagrad")
    # 8 B header + 4 x 16 x (1 + 1) B values and slots, + the measured index bytes
    assert per_row == pytest.approx(
        136 + capacity.GENERATION_BYTES + capacity.index_bytes_per_row()
    )
    expected = int(-(-2e9 / 4 * per_row * 1.5 // (1 << 20))) + 512
    assert shard["resources"]["requests"]["memory"] == f"{expected}Mi"
    assert shard["envFrom"] == [{"secretRef": {"name": "s3"}}]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 8
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["python", "t.py"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["TF_DLT_CHECKPOINT"] == "s3://b/ctr"
    for index in (0, 7):
        cluster = tf_dlt.cluster_from_env(
            {"TF_CONFIG": env["TF_CONFIG"], "JOB_COMPLETION_INDEX": str(index)}
        )
        assert cluster.task_index == index and cluster.num_workers == 8
        assert cluster.pservers == [
            f"ctr-ps-{i}.ctr-ps.default.svc.cluster.local:7000" for i in range(4)
        ]
    wait = job["spec"]["template"]["spec"]["initContainers"][0]["command"][2]
    assert "tf-dlt stats --pservers " + ",".join(cluster.pservers) in wait


def test_a_volume_checkpoint_is_shared_by_shards_and_trainers() -> None:
    objects = _objects((ROOT / "deploy" / "ctr-volume.yaml").read_text())
    claim = objects["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for kind, path in (("StatefulSet", "template"), ("Job", "template")):
        pod = objects[kind]["spec"][path]["spec"]
        assert {
            "name": "checkpoints",
            "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]},
        } in pod["volumes"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "checkpoints", "mountPath": "/checkpoints"} in mounts
    annotations = objects["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(k8s.METRICS_PORT)
    assert json.loads(
        {
            e["name"]: e.get("value")
            for e in objects["Job"]["spec"]["template"]["spec"]["containers"][0]["env"]
        }["TF_CONFIG"]
    )["task"] == {"type": "worker"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--name CTR --image i", "name must be at most 40 lower-case"),
        ("--name ctr --image i --checkpoint /data/x", "a path under /checkpoints/"),
        ("--name ctr --image i --workers 0", "workers >= 1"),
        # Printed with exit 0 before, for kubectl to reject (or to size a
        # 10-byte volume): strict schema validation checks no quantity.
        ("--name ctr --image i --namespace Prod_NS", "namespace must be lower-case"),
        ("--name ctr --image i --worker-memory lots", "--worker-memory must be a positive"),
        ("--name ctr --image i --worker-cpu -1", "--worker-cpu must be a positive"),
        ("--name ctr --image i --checkpoint-volume-size 10", "is under 1 MiB"),
        ("--name ctr --image ''", "image must name a container image"),
        # A Service's name begins with a letter, labels end with one or a
        # digit, and "<name>-ps-r4-<hash>" must fit a label's 63 characters.
        ("--name ctr- --image i", "name must be at most 40"),
        ("--name 1ctr --image i", "name must be at most 40"),
        ("--name ctré --image i", "name must be at most 40"),
        (f"--name {'c' * 41} --image i", "name must be at most 40"),
        ("--name ctr --image i --credentials-secret Bad_Name", "--credentials-secret must name"),
        ("--name ctr --image i --auth-token-secret 'my token'", "--auth-token-secret must name"),
        ("--name ctr --image i --worker-memory 8", "--worker-memory '8' is under 1 MiB"),
        # NaN and inf were tracebacks; a dim no table can have one too.
        ("--name ctr --image i --rows nan", "rows must be a number >= 0"),
        ("--name ctr --image i --headroom inf", "headroom one >= 1"),
        ("--name ctr --image i --sketch-bytes nan", "sketch_bytes must be a number"),
        ("--name ctr --image i --dim 100000000", "dim must be 1 to 65536"),
        # The shards resolved this root to the container's /etc.
        ("--name ctr --image i --checkpoint /checkpoints/../etc", "a path under /checkpoints/"),
        ("--name ctr --image i --load-from relative/ctr", "--load-from must be a URL"),
        (
            "--name ctr --image i --checkpoint s3://b/ctr --load-from /checkpoints/ctr/epoch-1",
            "only a --checkpoint on it mounts",
        ),
        # Printed with exit 0 before, for shards that refused them at start
        # (pods in a crash loop), or an OverflowError traceback.
        ("--name ctr --image i --rows 1e307", "need more memory than any cluster has"),
        ("--name ctr --image i --memory-budget 100MiB", "below the smallest a shard takes"),
        ("--name ctr --image i --pservers 5000", "pservers must be at most 4096"),
        ("--name ctr --image i --checkpoint s3://bucket//run", "empty segment"),
        ("--name ctr --image i --checkpoint S3://bucket/run", "in lowercase"),
        ("--name ctr --image i --checkpoint s3://bucket/run/../x", "'.' or '..' segments"),
        # Each shard saved to its own container disk (no volume was made).
        ("--name ctr --image i --checkpoint file:///checkpoints/run", "without file://"),
        # Written into a YAML comment unescaped: the manifest did not parse.
        ("--name ctr --image i --checkpoint 's3://b/run\nx: ['", "a control character"),
        ("--name ctr --image i --shard-cpu 1e10", "more than 4096 cores"),
        # 0.5 bytes: no budget at all.
        ("--name ctr --image i --memory-budget 0.5", "under one byte"),
        # Left out of the manifests without a word: no such volume is made.
        (
            "--name ctr --image i --checkpoint s3://b/run --storage-class fast",
            "which a --checkpoint URL (s3://b/run) does not use",
        ),
        ("--name ctr --image i --tier-storage-class local-ssd", "which only --ssd makes"),
    ],
)
def test_bad_flags_are_refused(flags: str, message: str) -> None:
    out = _generate(flags)
    assert out.returncode == 2 and message in out.stderr


def test_a_load_from_path_is_given_to_the_shards_as_they_resolve_it() -> None:
    """`--load-from /checkpoints/run/../old/ckpt` began with the checkpoint
    root's string, so no root was added for it; the shards resolved it to
    /checkpoints/old/ckpt, outside their only root, and refused the load."""
    from tf_dlt.server.paths import CheckpointRoots

    spec = k8s.JobSpec(
        name="ctr", image="i", command=["x"], checkpoint="/checkpoints/run",
        load_from="/checkpoints/run/../old/ckpt",
    )  # fmt: skip
    (shard_set,) = [
        m for m in k8s.manifests(spec)
        if m["kind"] == "StatefulSet" and m["metadata"]["name"] == spec.ps_service
    ]  # fmt: skip
    args = shard_set["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--load-from=/checkpoints/old/ckpt" in args
    roots = [a.split("=", 1)[1] for a in args if a.startswith("--checkpoint-root=")]
    CheckpointRoots(roots).check("/checkpoints/old/ckpt", "Load")


def test_a_disk_tier_gets_a_volume_per_shard_that_goes_with_its_pod() -> None:
    flags = "--name ctr --image i --memory-budget 48GiB"
    plain = _generate(flags)
    assert plain.returncode == 0, plain.stderr
    # Without --ssd there is no tier: the header said rows lived on one.
    assert "rows past the budget are evicted (no --ssd" in plain.stdout
    assert "volumeClaimTemplates" not in plain.stdout
    tiered = _generate(flags + " --ssd 1600Gi --tier-storage-class local-ssd")
    assert tiered.returncode == 0, tiered.stderr
    assert "rows past the budget live on the tier volume" in tiered.stdout
    shards = _objects(tiered.stdout)["StatefulSet"]["spec"]
    (claim,) = shards["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1600Gi"
    assert claim["spec"]["storageClassName"] == "local-ssd"
    # A kept claim would hold 1600Gi after `kubectl delete -f`.
    assert shards["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete", "whenScaled": "Delete",
    }  # fmt: skip
    for doc in yaml.safe_load_all(tiered.stdout):
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_a_token_secret_is_generated_unless_one_is_named_or_insecure() -> None:
    runs = [_generate("--name ctr --image i:1") for _ in range(2)]
    tokens = []
    for out in runs:
        assert out.returncode == 0, out.stderr
        objects = _objects(out.stdout)
        secret = objects["Secret"]
        assert secret["metadata"]["name"] == "ctr-token"
        tokens.append(secret["stringData"]["token"])
        shard = objects["StatefulSet"]["spec"]["template"]["spec"]
        assert {"name": "auth-token", "secret": {"secretName": "ctr-token"}} in shard["volumes"]
        assert "--auth-token-file=/etc/tf-dlt/token" in shard["containers"][0]["args"]
        for doc in yaml.safe_load_all(out.stdout):
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    assert len(tokens[0]) >= 40 and tokens[0] != tokens[1]  # random, new on every run
    insecure = _objects(_generate("--name ctr --image i:1 --insecure").stdout)
    assert "Secret" not in insecure
    args = insecure["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--insecure" in args and not any(a.startswith("--auth-token-file") for a in args)


def test_shards_are_sized_and_bounded_for_their_trainers() -> None:
    spec = k8s.JobSpec(
        name="ctr", image="i:1", command=["t"], workers=100, shard_cpu="1500m",
        checkpoint="s3://b/run", load_from="s3://other/base",
    )  # fmt: skip
    args = k8s.stateful_set(spec)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--threads=2" in args and "--max-connections=6400" in args
    assert "--checkpoint-root=s3://b/run" in args and "--checkpoint-root=s3://other/base" in args
    small = k8s.JobSpec(name="ctr", image="i:1", command=["t"], workers=2)
    small_args = k8s.stateful_set(small)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-connections=1024" in small_args


def test_shard_memory_follows_admission_and_row_dtypes() -> None:
    job = {"name": "ctr", "image": "i", "command": ["python", "t.py"], "rows": 2e9, "pservers": 4}
    base = k8s.JobSpec(**job)
    half = k8s.JobSpec(**job, value_dtype="bfloat16", slot_dtype="bfloat16", admission_rate=0.25)
    per_row = capacity.bytes_per_row(16, "adagrad", "bfloat16", "bfloat16")
    assert per_row == pytest.approx(72 + capacity.GENERATION_BYTES + capacity.index_bytes_per_row())
    expected = int(-(-2e9 * 0.25 / 4 * per_row * 1.5 // (1 << 20))) + 512
    assert k8s.shard_memory(half) == expected < k8s.shard_memory(base)
    assert "x 0.25 admitted" in k8s.render(half) and "bfloat16 values" in k8s.render(half)
    # The admission sketch is spread over the shards: each requests its share.
    sketched = k8s.JobSpec(**job, sketch_bytes=4 * 2**30)
    assert k8s.shard_memory(sketched) - k8s.shard_memory(base) in (1536, 1537)  # 1 GiB x 1.5
    assert "sketch / 4" in k8s.render(sketched)
    with pytest.raises(ValueError, match="admission_rate"):
        k8s.JobSpec(name="ctr", image="i", command=[], admission_rate=2.0)
    with pytest.raises(ValueError, match="sketch_bytes"):
        k8s.JobSpec(name="ctr", image="i", command=[], sketch_bytes=-1)


def test_trainers_get_the_token_file_every_client_reads() -> None:
    """The train script needs no token code: trainer pods name the mounted
    Secret in TF_DLT_AUTH_TOKEN_FILE, which tf_dlt.Client and the ops read."""
    jobs = _objects(_generate(EXAMPLES["ctr-s3.yaml"]).stdout)
    (container,) = jobs["Job"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TF_DLT_AUTH_TOKEN_FILE"] == "/etc/tf-dlt/token"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/etc/tf-dlt" in mounts


def test_standbys_get_their_own_stateful_set_apart_from_their_primary() -> None:
    """--replicas 2: a second StatefulSet of the same shard indices, whose
    pods never share a node with their shard's other process, both learning
    their role at start (--replica-set); trainers list both processes."""
    objects = list(yaml.safe_load_all(_generate(EXAMPLES["ctr-standbys.yaml"]).stdout))
    sets = [d for d in objects if d["kind"] == "StatefulSet"]
    assert [s["metadata"]["name"] for s in sets] == ["ctr-ps", "ctr-ps-r1"]
    selectors = [s["spec"]["selector"]["matchLabels"] for s in sets]
    assert selectors[0] != selectors[1]  # each set owns its pods
    for sts, selector in zip(sets, selectors, strict=True):
        # Each set would roll an update on its own, both of a shard at once:
        # pods are replaced one at a time by hand (docs/kubernetes.md).
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        pod = sts["spec"]["template"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        (term,) = pod["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["matchLabelKeys"] == ["apps.kubernetes.io/pod-index"]  # same shard only
        assert "tf-dlt/replica" not in term["labelSelector"]["matchLabels"]  # both sets
        (shard,) = pod["spec"]["containers"]
        host = "ctr-ps.default.svc.cluster.local:7000"
        assert (
            f"--replica-set=ctr-ps-$(SHARD_INDEX).{host}|ctr-ps-r1-$(SHARD_INDEX).{host}"
            in shard["args"]
        )
        assert f"--advertise=$(POD_NAME).{host}" in shard["args"]
        env = {e["name"]: e for e in shard["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (budget,) = [d for d in objects if d["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["maxUnavailable"] == 1
    (job,) = [d for d in objects if d["kind"] == "Job"]
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    tf_config = {e["name"]: e.get("value") for e in trainer["env"]}["TF_CONFIG"]
    cluster = tf_dlt.cluster_from_env({"TF_CONFIG": tf_config, "JOB_COMPLETION_INDEX": "0"})
    assert cluster.pservers[1] == f"ctr-ps-1.{host}|ctr-ps-r1-1.{host}"
    wait = shlex.split(job["spec"]["template"]["spec"]["initContainers"][0]["command"][2])
    assert wait[wait.index("--pservers") + 1] == ",".join(cluster.pservers)
    # Two standbys: a set each, every process listing all three.
    three = _generate(EXAMPLES["ctr-standbys.yaml"].replace("--replicas 2", "--replicas 3"))
    sets = [d for d in yaml.safe_load_all(three.stdout) if d["kind"] == "StatefulSet"]
    assert [s["metadata"]["name"] for s in sets] == ["ctr-ps", "ctr-ps-r1", "ctr-ps-r2"]
    members = f"ctr-ps-$(SHARD_INDEX).{host}|ctr-ps-r1-$(SHARD_INDEX).{host}"
    for sts in sets:
        (shard,) = sts["spec"]["template"]["spec"]["containers"]
        assert f"--replica-set={members}|ctr-ps-r2-$(SHARD_INDEX).{host}" in shard["args"]
    assert "each with 2 hot standbys" in three.stdout
    out = _generate(EXAMPLES["ctr-standbys.yaml"].replace("--replicas 2", "--replicas 6"))
    assert out.returncode == 2 and "invalid choice: 6" in out.stderr
