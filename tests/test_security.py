"""Security: TLS (and mutual TLS) on the gRPC control plane with
certificates the test creates, and auth tokens that never reach a log."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import tf_dlt
from tf_dlt import errors, grpc_util
from tf_dlt.tls import TlsConfig

from conftest import Cluster, wait_until


def _key_and_name(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Name]:
    return ec.generate_private_key(ec.SECP256R1()), x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[str, str]:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path / "cert.pem"), str(path / "key.pem")


def _certificate(
    subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool, server: bool = False,
) -> x509.Certificate:  # fmt: skip
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


class Pki:
    """A CA and certificates it signs, written under `root`."""

    def __init__(self, root: Path, name: str = "tf_dlt test CA") -> None:
        self.root = root
        self.key, self.name = _key_and_name(name)
        cert = _certificate(self.name, self.key, self.name, self.key, ca=True)
        self.ca, _ = _write(root / "ca", self.key, cert)

    def issue(self, common_name: str, *, server: bool) -> tuple[str, str]:
        key, subject = _key_and_name(common_name)
        cert = _certificate(subject, key, self.name, self.key, ca=False, server=server)
        return _write(self.root / common_name, key, cert)


def _exercise(client: tf_dlt.Client) -> None:
    client.create_table("secure", 4)
    client.pull("secure", np.arange(10))
    assert client.list_tables()["secure"]["rows"] == 10


def test_tls_control_plane(start_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    cert, key = pki.issue("shard", server=True)
    cluster = start_cluster(2, "--tls-cert", cert, "--tls-key", key)
    with tf_dlt.Client(cluster.addresses, tls=TlsConfig(ca=pki.ca)) as client:
        _exercise(client)
        client.save(str(tmp_path / "ck"))
    # Plaintext, or a CA that did not sign the shard's certificate: refused.
    other = Pki(tmp_path / "other", "another CA")
    for tls, says in (
        (None, "serves TLS.*speaks plaintext"),
        (TlsConfig(ca=other.ca), "CA"),
        # (A name the certificate does not hold: gRPC said only that a
        # "Hostname Verification Check failed", with no hint.)
        (TlsConfig(ca=pki.ca, server_name="elsewhere.test"), "certificate names 'elsewhere.test'"),
    ):
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("TF_DLT_TLS_CA", raising=False)
            with tf_dlt.Client(cluster.addresses, tls=tls, request_timeout=5) as client:
                with pytest.raises(errors.UnavailableError, match=says):
                    client.list_tables()
    # A TLS client meeting a plaintext shard is told so too.
    plain = start_cluster(1)
    with tf_dlt.Client(plain.addresses, tls=TlsConfig(ca=pki.ca), request_timeout=5) as client:
        with pytest.raises(errors.UnavailableError, match="without --tls-cert"):
            client.list_tables()
    # Health checks and tf-dlt stats over TLS, configured by the environment.
    admin = f"127.0.0.1:{cluster.admin_ports[0]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TF_DLT_TLS_CA", pki.ca)
        assert grpc_util.serving(admin)
    assert not grpc_util.serving(admin, timeout=2)
    out = subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "stats",
         "--pservers", ",".join(cluster.addresses), "--tls-ca", pki.ca],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0 and "secure" in out.stdout, out.stderr
    # Without TLS it fails, and adds no error on the healthy shards: its
    # fallback for standbys sent them a replica's Hello, which they refused
    # and counted as FAILED_PRECONDITION (an alert on errors fired).
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("TF_DLT_TLS_")}
    out = subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "stats",
         "--pservers", ",".join(cluster.addresses)],
        capture_output=True, text=True, timeout=120, cwd="/", env=plain_env,
    )  # fmt: skip
    assert out.returncode == 1 and "speaks plaintext" in out.stderr, out.stderr
    with tf_dlt.Client(cluster.addresses, tls=TlsConfig(ca=pki.ca)) as client:
        assert not [s["errors"] for s in client.stats() if "FAILED_PRECONDITION" in s["errors"]]


def test_mutual_tls_requires_a_client_certificate(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    pki = Pki(tmp_path / "pki")
    cert, key = pki.issue("shard", server=True)
    cluster = start_cluster(1, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki.ca)
    with tf_dlt.Client(cluster.addresses, tls=TlsConfig(ca=pki.ca), request_timeout=5) as client:
        # (The hint named TLS on one side and the CA, never the certificate.)
        with pytest.raises(errors.UnavailableError, match="this client presents no certificate"):
            client.list_tables()
    client_cert, client_key = pki.issue("trainer", server=False)
    tls = TlsConfig(ca=pki.ca, cert=client_cert, key=client_key)
    with tf_dlt.Client(cluster.addresses, tls=tls) as client:
        _exercise(client)


@pytest.mark.cluster
def test_a_standby_of_a_tls_primary_attaches_or_is_refused_at_start(tmp_path: Path) -> None:
    """A standby calls its primary's control plane as a client, with the
    TF_DLT_TLS_* settings of its environment: without them it never
    attached (logging only that a socket closed) and the shard ran with no
    standby. It is refused at start, naming what to set; given them, it
    attaches. Client certificates set without the CA are refused too (the
    client spoke plaintext), and so are settings that make no client (a
    certificate without its key), on a plaintext standby too."""
    from tf_dlt.server.local import LocalCluster

    pki = Pki(tmp_path / "pki")
    cert, key = pki.issue("shard", server=True)
    flags = ["--tls-cert", cert, "--tls-key", key]
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("TF_DLT_TLS_")}

    def refusal(*extra: str, tls: bool = True, **env: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "tf_dlt.server", "--port", "0", *(flags if tls else []),
             *extra, "--standby-of", "127.0.0.1:9"],
            capture_output=True, text=True, timeout=60, cwd="/", env={**plain_env, **env},
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        return out.stderr

    assert "set TF_DLT_TLS_CA (the CA" in refusal()
    mutual = refusal("--tls-client-ca", pki.ca, TF_DLT_TLS_CA=pki.ca)
    assert "set TF_DLT_TLS_CERT and TF_DLT_TLS_KEY" in mutual
    assert "TF_DLT_TLS_CERT set without TF_DLT_TLS_CA" in refusal(TF_DLT_TLS_CERT=cert)
    # Settings that make no client, on a plaintext standby too (its standby
    # thread met them at its first call, and ended).
    stray = refusal(tls=False, TF_DLT_TLS_SERVER_NAME="localhost")
    assert "TF_DLT_TLS_SERVER_NAME set without TF_DLT_TLS_CA" in stray
    assert "needs both cert and key" in refusal(TF_DLT_TLS_CA=pki.ca, TF_DLT_TLS_CERT=cert)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TF_DLT_TLS_CA", raising=False)
        mp.setenv("TF_DLT_TLS_SERVER_NAME", "localhost")
        with pytest.raises(ValueError, match="TF_DLT_TLS_SERVER_NAME set without TF_DLT_TLS_CA"):
            tf_dlt.Client(["127.0.0.1:9"])
    # A file that is not PEM is named as the client is made (a handshake
    # failed at its first call).
    der = tmp_path / "ca.der"
    der.write_bytes(b"0\x82\x03\x01 not PEM")
    with pytest.raises(errors.InvalidArgumentError, match=r"CA certificate .* is not PEM"):
        tf_dlt.Client(["127.0.0.1:9"], tls=TlsConfig(ca=str(der)))
    with LocalCluster(
        1, *flags, workdir=tmp_path / "cluster", replicas=2, env={"TF_DLT_TLS_CA": pki.ca}
    ) as cluster:
        with tf_dlt.Client(cluster.addresses, tls=TlsConfig(ca=pki.ca)) as client:
            wait_until(
                lambda: [s["connected"] for s in client.stats()[0]["standbys"]] == [True],
                "the standby to attach",
            )
            _exercise(client)


@pytest.mark.cluster
def test_bad_tls_flags_are_refused(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tf_dlt.server", "--port", "0", "--tls-cert", "c.pem"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert out.returncode == 2 and "--tls-cert and --tls-key go together" in out.stderr
    missing = str(tmp_path / "missing.pem")
    out = subprocess.run(
        [sys.executable, "-m", "tf_dlt.server", "--port", "0", "--tls-cert", missing,
         "--tls-key", missing],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert out.returncode == 2 and "cannot read the TLS certificate" in out.stderr


def test_auth_token_is_required_and_never_logged(start_cluster: Callable[..., Cluster]) -> None:
    token = "tok-3f9a1c-never-in-a-log"
    cluster = start_cluster(2, "--log-level", "DEBUG", token=token)
    with tf_dlt.Client(cluster.addresses, auth_token=token) as client:
        _exercise(client)
    wrong = token[::-1]
    with pytest.raises(errors.UnauthenticatedError) as caught:
        tf_dlt.Client(cluster.addresses, auth_token=wrong).list_tables()  # data plane Hello
    assert token not in str(caught.value) and wrong not in str(caught.value)
    # A client past the Hello that sends the wrong token on the control plane.
    with tf_dlt.Client(cluster.addresses, auth_token=token) as client:
        client.list_tables()
        client._token = wrong
        for _ in range(40):  # a client that retries in a loop
            with pytest.raises(errors.UnauthenticatedError):
                client.list_tables()
        client._token = token
        stats = client.stats()
    refused = sum(int(s["errors"].get("UNAUTHENTICATED", 0)) for s in stats)
    assert refused >= 41
    logs = "".join(cluster.log(i) for i in range(2))
    assert "refused a control-plane call from" in logs  # the refusal is logged...
    assert token not in logs and wrong not in logs  # ...the tokens are not
    # ...and not once a call: a line at most every 10 s (it wrote 40 here)
    lines = logs.count("refused a control-plane call from")
    assert lines <= refused // 5, (lines, refused)


def test_a_client_given_no_token_reads_the_token_file(
    start_cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the ops' clients do: a trainer pod names its mounted Secret in
    TF_DLT_AUTH_TOKEN_FILE and its code passes no token anywhere."""
    cluster = start_cluster(2, token="file-token")
    token_file = tmp_path / "token"
    token_file.write_text("  file-token\n")  # the shards drop surrounding whitespace
    monkeypatch.setenv("TF_DLT_AUTH_TOKEN_FILE", str(token_file))
    with tf_dlt.Client(cluster.addresses) as client:
        client.create_table("from_file", 4)
    from tf_dlt import ops  # the op's kernel reads the file itself

    rows = ops.lookup(ops.ClientResource(cluster.addresses), np.arange(3), "from_file", 4)
    assert rows.shape == (3, 4)
    monkeypatch.delenv("TF_DLT_AUTH_TOKEN_FILE")
    # A token read by hand with its newline, as the shards' file holds it.
    with tf_dlt.Client(cluster.addresses, auth_token=token_file.read_text()) as client:
        assert "from_file" in client.list_tables()
    # auth_token=None is no token, as "" is: the file's.
    monkeypatch.setenv("TF_DLT_AUTH_TOKEN_FILE", str(token_file))
    with tf_dlt.Client(cluster.addresses, auth_token=None) as client:
        assert "from_file" in client.list_tables()
    # The token pasted where its file's path goes is never echoed; an empty
    # file is no token.
    monkeypatch.setenv("TF_DLT_AUTH_TOKEN_FILE", "file-token")
    with pytest.raises(errors.FailedPreconditionError, match="TF_DLT_AUTH_TOKEN_FILE") as e:
        tf_dlt.Client(cluster.addresses)
    assert "file-token" not in str(e.value)
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("TF_DLT_AUTH_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(errors.FailedPreconditionError, match="names is empty"):
        tf_dlt.Client(cluster.addresses)
    monkeypatch.delenv("TF_DLT_AUTH_TOKEN_FILE")
    with pytest.raises(errors.UnauthenticatedError):
        tf_dlt.Client(cluster.addresses).list_tables()


def test_table_names_never_lead_out_of_the_storage_dir(tmp_path: Path) -> None:
    """A table name is never a path: one that climbs out ("x/../../out") is
    refused before anything is created, and a table's tier directory under
    --storage-dir is named by a counter, not by the table, so dropping it
    removes only its own files."""
    from tf_dlt import _native
    from tf_dlt.table_config import TableConfig

    storage = tmp_path / "deep" / "storage"
    storage.mkdir(parents=True)
    shard = _native.Shard(0, 1)
    shard.configure_memory(16 << 30, str(storage), 1000)  # far above this process
    for name in ("x/../../../outside", "../t", "a//b", "/abs"):
        with pytest.raises(errors.InvalidArgumentError, match="part between its '/'s"):
            shard.create_table(TableConfig(name, 4).to_dict())
        with pytest.raises(errors.InvalidArgumentError):
            TableConfig.create(name, 4)
    shard.create_table(TableConfig("a/b", 4).to_dict())
    shard.get_table("a/b").pull(np.arange(100, dtype=np.int64))
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert all(str(p).startswith("deep") for p in made), made
    tier_dirs = [p.name for p in (storage / "shard-0").iterdir() if p.is_dir()]
    assert tier_dirs and all(re.fullmatch(r"t\d+", d) for d in tier_dirs), tier_dirs
    shard.drop_table("a/b")
    del shard
    assert storage.is_dir() and not [p for p in (storage / "shard-0").iterdir() if p.is_dir()]


def test_the_disk_tier_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """Someone who may write in --storage-dir plants links where the shard
    makes a table's tier directory and its files: the tier went outside
    the storage dir and truncated the file a stripe's link named. Now the
    tier's directory and files are made afresh, never followed."""
    from tf_dlt import _native
    from tf_dlt.table_config import TableConfig

    storage, outside = tmp_path / "storage", tmp_path / "outside"
    storage.mkdir()
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious data\n")
    shard = _native.Shard(0, 1)
    shard.configure_memory(16 << 30, str(storage), 1000)  # far above this process
    (storage / "shard-0" / "t0").symlink_to(outside, target_is_directory=True)
    (outside / "stripe-00.tier").symlink_to(victim)
    shard.create_table(TableConfig("emb", 4).to_dict())
    table = shard.get_table("emb")
    ids = np.arange(20_000, dtype=np.int64)
    rows = table.pull(ids)
    assert table.demote(20_000) > 0  # the tier's files are made
    assert victim.read_text() == "precious data\n"
    assert sorted(p.name for p in outside.iterdir()) == ["stripe-00.tier", "victim.txt"]
    own = storage / "shard-0" / "t0"
    assert own.is_dir() and not own.is_symlink() and list(own.glob("stripe-*.tier"))
    np.testing.assert_array_equal(table.pull(ids), rows)
    del table, shard


def test_a_save_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """A save writes its shard file and its manifest through temporary files
    created exclusively under random names: links planted at the names a
    save used to take (<file>.tmp-<pid>, the caller choosing the save id)
    are never written through, and what they point at is unchanged."""
    import os

    from tf_dlt import _native
    from tf_dlt.checkpoint import manifest, shard_files
    from tf_dlt.table_config import TableConfig

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ck = tmp_path / "ck"
    ck.mkdir()
    shard = _native.Shard(0, 1)
    shard.create_table(TableConfig("t", 4).to_dict())
    shard.get_table("t").pull(np.arange(10, dtype=np.int64))
    save_id = manifest.new_save_id()
    name = manifest.shard_file_name(0, 1, save_id)
    for planted in (f"{name}.tmp-{os.getpid()}", f"{manifest.MANIFEST}.tmp-{os.getpid()}"):
        os.symlink(victim, ck / planted)
    part = shard_files.save_shard(str(ck), shard, save_id)
    manifest.write_manifest(str(ck), [part], save_id)
    assert victim.read_bytes() == b"precious"
    fresh = _native.Shard(0, 1)
    shard_files.load_shard(str(ck), fresh)
    assert fresh.get_table("t").size() == 10
    assert not [p for p in ck.iterdir() if ".tmp-" in p.name and not p.is_symlink()]


def test_a_load_reads_no_file_outside_the_checkpoint_and_leaks_no_digest(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A checkpoint directory under the shard's root whose shard files are
    links (to a secret outside the root, to /dev/zero), a FIFO, or a file
    whose size the manifest misstates: each load is refused at once, naming
    the file, and no error carries a digest of anything read. The shard then
    saves and loads normally."""
    import hashlib
    import json
    import os

    root = tmp_path / "root"
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cr3t-key-material" * 300)
    cluster = start_cluster(1, "--checkpoint-root", str(root))
    with cluster.client(persist_timeout=30.0) as client:
        client.create_table("t", 4)
        client.pull("t", np.arange(100))
        good = client.save(str(root / "good"))
        entry = good["files"][0]
        digests = {hashlib.sha256(secret.read_bytes()[:n]).hexdigest() for n in (1, 4096, 5700)}

        def crafted(name: str, plant: Callable[[Path], None], **fields: object) -> str:
            ck = root / name
            ck.mkdir()
            plant(ck / entry["file"])
            forged = {**good, "files": [{**entry, **fields}]}
            (ck / "MANIFEST.json").write_text(json.dumps(forged))
            return str(ck)

        size = secret.stat().st_size
        attacks = {
            crafted(
                "link", lambda p: os.symlink(secret, p),
                bytes=size, block_bytes=4096, block_sha256=["0" * 64] * -(-size // 4096),
            ): "not a regular file",
            crafted(
                "zero", lambda p: os.symlink("/dev/zero", p),
                bytes=1 << 40, block_sha256=None,
            ): "not a regular file",
            crafted("fifo", lambda p: os.mkfifo(p)): "not a regular file",
            crafted(
                "size", lambda p: p.write_bytes(secret.read_bytes()), bytes=4096,
            ): "holds 5700 bytes, the manifest says 4096",
        }  # fmt: skip
        for path, why in attacks.items():
            manifest_path = Path(path) / "MANIFEST.json"
            forged = json.loads(manifest_path.read_text())
            for f in forged["files"]:
                if f.get("block_sha256") is None:
                    f.pop("block_sha256", None)
                    f.pop("block_bytes", None)
            manifest_path.write_text(json.dumps(forged))
            with pytest.raises(errors.FailedPreconditionError, match=why) as raised:
                client.load(path)
            assert not any(d in str(raised.value) for d in digests)
            # Named as the client named it, not as the shard held it open.
            assert f"{path}/{entry['file']}" in str(raised.value), raised.value

        # A manifest alone (its file a real one, of a few KB) saying the file
        # holds 2^50 bytes of 30M rows: the load sized its table for them,
        # 3 GB touched before the file was opened and found smaller.
        # Blocks of 1 GiB, which a load keeps several of: a sparse file of a
        # few KB made it hold 3 GB.
        blocks = crafted("blocks", lambda p: p.write_bytes(secret.read_bytes()),
                         bytes=size, block_bytes=32 << 20, block_sha256=["0" * 64])  # fmt: skip
        with pytest.raises(errors.FailedPreconditionError, match="block_bytes 33554432 is outside"):
            client.load(blocks)

        def peak_mib() -> int:
            with open(f"/proc/{cluster.processes[0].pid}/status") as status:
                return next(int(ln.split()[1]) for ln in status if ln.startswith("VmHWM")) >> 10

        before = peak_mib()
        bomb = crafted("bomb", lambda p: shutil.copy(root / "good" / entry["file"], p),
                       bytes=1 << 50, block_sha256=None)  # fmt: skip
        forged = json.loads((Path(bomb) / "MANIFEST.json").read_text())
        for f in forged["files"]:
            f.pop("block_sha256", None), f.pop("block_bytes", None)
        for t in forged["tables"]:
            t["rows"] = 30_000_000
        (Path(bomb) / "MANIFEST.json").write_text(json.dumps(forged))
        with pytest.raises(errors.FailedPreconditionError, match="the manifest says 1125899906"):
            client.load(bomb)
        assert peak_mib() - before < 256, (before, peak_mib())
        (root / "manifest_link").mkdir()
        os.symlink("/dev/zero", root / "manifest_link" / "MANIFEST.json")
        with pytest.raises(errors.FailedPreconditionError, match="a link, not followed") as raised:
            client.load(str(root / "manifest_link"))
        assert "/proc/self/fd" not in str(raised.value)
        with pytest.raises(errors.InvalidArgumentError, match="File name too long"):
            client.load(str(root / ("x" * 5000)))
        # A save 2,000 directories deep was made, one mkdir a level.
        with pytest.raises(errors.InvalidArgumentError, match="65 directories deep, at most 64"):
            client.save(str(root.joinpath(*["d"] * (65 - len(root.parts) + 1))))
        assert not (root / "d").exists()
        with pytest.raises(errors.InvalidArgumentError, match="bytes: at most 4096"):
            client.save(str(root.joinpath(*["d" * 200] * 21)))
        assert not (root / ("d" * 200)).exists()
        client.save(str(root / "again"))
        client.load(str(root / "again"))
    assert cluster.stop(timeout=20) == [0]


def test_a_link_swapped_in_after_the_roots_check_redirects_no_save_or_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone who may write under a shard's checkpoint root replaces the
    checkpoint's directory by a link out of the root once the shard has
    checked the path: a save must not write out there, and a load must not
    read another checkpoint out there (another team's, say). The shard holds
    the directory it checked, so the swap redirects neither; a link already
    in place when the shard opens the path is refused."""
    import os
    import threading

    from tf_dlt.checkpoint import manifest, shard_files
    from tf_dlt.server import ShardServer, paths

    root, outside = tmp_path / "root", tmp_path / "outside"
    run = root / "run"
    run.mkdir(parents=True)
    server = ShardServer(0, 1, checkpoint_roots=[str(root)]).start()

    def swap() -> None:  # the directory the shard checked moves aside; a link takes its name
        os.rename(run, root / "checked")
        os.symlink(outside, run)

    def unswap() -> None:
        os.remove(run)
        os.rename(root / "checked", run)

    try:
        with tf_dlt.Client([server.address], persist_timeout=30.0) as client:
            client.create_table("t", 4)
            ids = np.arange(100)
            ours = client.pull("t", ids)
            # Another checkpoint of the same table outside the root.
            outside.mkdir()
            (outside / "ck").mkdir()
            client.push("t", ids, np.ones((100, 4), np.float32), 1.0)
            theirs = client.pull("t", ids)
            client.save(str(root / "theirs"))
            for name in os.listdir(root / "theirs"):
                os.rename(root / "theirs" / name, outside / "ck" / name)
            real_save = shard_files.save_shard

            def save_after_a_swap(path: str, *args: object, **kwargs: object) -> dict:  # type: ignore[type-arg]
                swap()
                return real_save(path, *args, **kwargs)  # type: ignore[arg-type]

            monkeypatch.setattr(shard_files, "save_shard", save_after_a_swap)
            with pytest.raises(errors.DltError):  # the manifest's writer finds no file there
                client.save(str(run / "new"))
            assert sorted(os.listdir(outside)) == ["ck"]  # nothing written out there
            assert [p.name.split(".")[0] for p in (root / "checked" / "new").iterdir()] == [
                "shard-00000-of-00001"
            ]
            unswap()
            monkeypatch.undo()

            # A checkpoint of ours under the root; the swap comes as its
            # manifest is read.
            client.assign("t", ids, ours)
            client.save(str(run / "ck"))
            client.assign("t", ids, np.zeros((100, 4), np.float32))
            real_read = manifest.read_manifest

            def read_after_a_swap(path: str, *args: object) -> dict:  # type: ignore[type-arg]
                # The shard's read (a thread of its server), not the client's
                # own look at the manifest before it asks the shards.
                if threading.current_thread() is not threading.main_thread():
                    if not os.path.islink(run):
                        swap()
                return real_read(path, *args)  # type: ignore[arg-type]

            monkeypatch.setattr(manifest, "read_manifest", read_after_a_swap)
            client.load(str(run / "ck"))
            np.testing.assert_array_equal(client.pull("t", ids), ours)
            assert not np.array_equal(ours, theirs)
            monkeypatch.undo()
            # The link in place when the shard checks the path: refused;
            # swapped in between the check and the opening: refused too.
            with pytest.raises(errors.PermissionDeniedError, match="outside this shard's"):
                client.load(str(run / "ck"))
            with pytest.raises(errors.PermissionDeniedError, match=f"{run} is a link"):
                paths.hold_directory(str(run / "ck"), str(run / "ck"), "Load", False)
            # A file named as the checkpoint: the caller's mistake, said so.
            named = str(root / "checked" / "ck" / "MANIFEST.json")
            with pytest.raises(errors.InvalidArgumentError, match="is a file, not a directory"):
                paths.hold_directory(named, named, "Load", False)
    finally:
        server.stop()


def test_load_from_is_held_to_the_checkpoint_roots(tmp_path: Path) -> None:
    """`--load-from` outside `--checkpoint-root` is refused at start, as
    `--follow` is (it loaded from anywhere); inside, it loads."""
    import subprocess as sp

    from tf_dlt import _native
    from tf_dlt.checkpoint import manifest, shard_files
    from tf_dlt.server import ShardServer
    from tf_dlt.table_config import TableConfig

    root, outside = tmp_path / "root", tmp_path / "outside"
    shard = _native.Shard(0, 1)
    shard.create_table(TableConfig("t", 4).to_dict())
    shard.get_table("t").pull(np.arange(10, dtype=np.int64))
    for where in (root / "ck", outside / "ck"):
        save_id = manifest.new_save_id()
        manifest.write_manifest(str(where), [shard_files.save_shard(str(where), shard, save_id)],
                                save_id)  # fmt: skip
    run = sp.run(
        [sys.executable, "-m", "tf_dlt.server", "--port", "0", "--bind", "127.0.0.1",
         "--checkpoint-root", str(root), "--load-from", str(outside / "ck")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "is outside this shard's checkpoint roots" in run.stderr, (
        run.stderr
    )
    server = ShardServer(0, 1, checkpoint_roots=[str(root)], load_from=str(root / "ck")).start()
    try:
        assert tf_dlt.Client([server.address]).list_tables()["t"]["rows"] == 10
    finally:
        server.stop()


def test_operator_mistakes_are_refused_at_start_naming_them(tmp_path: Path) -> None:
    """Found by following docs/server.md and docs/security.md as an operator:
    each of these started a shard that misbehaved later, or failed with a
    traceback or a misleading reason."""
    import socket

    def server(*flags: str, files: int = 0) -> subprocess.CompletedProcess[str]:
        # `files`: the open-file limit, soft and hard, set by a first Python
        # that then becomes the server (a preexec_fn runs Python in a fork
        # of this many-threaded process, and hung in CI).
        start = (
            "import os, resource, sys\n"
            "if int(sys.argv[1]):\n"
            "    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]),) * 2)\n"
            "os.execv(sys.executable, [sys.executable, '-m', 'tf_dlt.server', *sys.argv[2:]])"
        )
        return subprocess.run(
            [sys.executable, "-c", start, str(files), "--bind", "127.0.0.1", *flags],
            capture_output=True, text=True, timeout=120, cwd="/",
        )  # fmt: skip

    def refused(out: subprocess.CompletedProcess[str], says: str) -> None:
        assert out.returncode == 2 and says in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr

    # 70000 was taken modulo 65536 (port 4464); 0 s timeouts meant 1 ms.
    refused(server("--port", "70000"), "a port is 0-65535")
    refused(server("--port", "0", "--metrics-port", "70000"), "a port is 0-65535")
    refused(server("--port", "0", "--io-timeout", "0"), "must be > 0 seconds")
    refused(server("--port", "0", "--shard-index", "-1"), "must be >= 0")
    # Taken: a load timeout of 0, -5 or NaN expired every cluster load; a
    # grace of inf broke SIGTERM; -1 bytes printed pybind's signature dump.
    refused(server("--port", "0", "--load-timeout", "nan"), "must be > 0 seconds")
    refused(server("--port", "0", "--takeover-after", "-1"), "must be > 0 seconds")
    refused(server("--port", "0", "--idle-timeout", "nan"), "must be >= 0 seconds")
    refused(server("--port", "0", "--stop-grace", "inf"), "must be at most 2147483.647 seconds")
    refused(server("--port", "0", "--max-frame-bytes", "-1"), "must be >= 4096")
    refused(server("--port", "0", "--max-buffered-bytes", "-1"), "must be >= 1")
    refused(server("--port", "0", "--max-admin-connections", "-1"), "must be >= 0")
    # More admin connections than the open-file limit holds: the refusal
    # named neither them nor the flag.
    refused(
        server("--port", "0", "--max-admin-connections", "4096", files=4096),
        "or lower --max-unauthenticated or --max-admin-connections",
    )
    # It was taken, and the standby logged "must be host:port" forever.
    refused(server("--port", "0", "--standby-of", "nohost"), "must be host:port")
    # Index N of N owned no bucket and said "shard 2/2 serving" (counted from 1).
    refused(
        server("--port", "0", "--shard-index", "2", "--num-shards", "2"),
        "--shard-index 2 is not below --num-shards 2",
    )
    # A token no Hello can carry (the wrong file): refused, not served.
    big = tmp_path / "big-token"
    big.write_text("x" * 5000)
    refused(server("--port", "0", "--auth-token-file", str(big)), "a token has at most 4096")
    # The token pasted where its file goes is never echoed.
    refused(server("--port", "0", "--auth-token-file", "s3cr3t-TOKEN"), "No such file")
    assert "s3cr3t" not in server("--port", "0", "--auth-token-file", "s3cr3t-TOKEN").stderr
    # An empty token file (the wrong one?) is refused without its path.
    empty = tmp_path / "s3cr3t-empty"
    empty.write_text("\n")
    refused(server("--port", "0", "--auth-token-file", str(empty)), "names is empty")
    assert "s3cr3t" not in server("--port", "0", "--auth-token-file", str(empty)).stderr
    # A token no request header can carry: every control-plane call failed
    # ("Invalid metadata") after the shard started. Never echoed.
    for odd in ("t\u00f6k-s3cr3t", "line1\ns3cr3t", "tab\ts3cr3t"):
        (tmp_path / "odd").write_text(odd)
        out = server("--port", "0", "--auth-token-file", str(tmp_path / "odd"))
        refused(out, "a token is printable ASCII")
        assert "s3cr3t" not in out.stderr
    # A FIFO blocked the start for good; a device never ends.
    os.mkfifo(tmp_path / "fifo")
    for special in (str(tmp_path / "fifo"), "/dev/zero"):
        refused(server("--port", "0", "--auth-token-file", special), "not a regular file")
    # A key of another certificate: gRPC failed to bind, "in use by another process".
    pki = Pki(tmp_path / "pki")
    cert, key = pki.issue("shard", server=True)
    _, other_key = pki.issue("other", server=True)
    refused(
        server("--port", "0", "--tls-cert", cert, "--tls-key", other_key),
        "are not a certificate and its private key",
    )
    # A client CA that is not PEM: "cannot bind the admin port ... in use".
    refused(
        server("--port", "0", "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", str(big)),
        "--tls-client-ca",
    )
    # A busy metrics port is named.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        refused(server("--port", "0", "--metrics-port", port), "(--metrics-port)")
    # The command line tools: a message, not a traceback.
    for flags, says in (
        (["--auth-token-file", "s3cr3t-TOKEN"], "cannot read the auth token file"),
        (["--auth-token-file", str(empty)], "--auth-token-file names is empty"),
        (["--tls-cert", cert], "--tls-cert and --tls-key need --tls-ca"),
        # (read only at the first call, they were a ValueError traceback)
        (["--tls-ca", "/nonexistent/ca.pem"], "cannot read the TLS CA certificate"),
        (["--tls-ca", cert, "--tls-cert", cert], "needs both cert and key"),
        # (a handshake that failed, after retrying for the whole deadline)
        (["--tls-ca", str(big)], "is not PEM (no -----BEGIN line)"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "tf_dlt.tools.cli", "stats", "--pservers", "127.0.0.1:1",
             *flags],
            capture_output=True, text=True, timeout=120, cwd="/",
        )  # fmt: skip
        assert out.returncode == 1 and says in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr and "s3cr3t" not in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "launch", "--pservers", "1", "--workers",
         "1", "--", "/nonexistent/trainer"],
        capture_output=True, text=True, timeout=180, cwd="/",
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "cannot start the trainer command '/nonexistent/trainer'" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_saves_stuck_on_a_store_leave_health_checks_and_stats_answering(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A NameNode that accepts and never answers holds a Save for good
    (the HDFS client sets no deadline on it). The saves that come after it
    wait as long as their callers do, at most 2 of them, and more are
    refused naming the one that runs: none of them takes the admin plane's
    last threads, so health checks (a liveness probe restarts a shard that
    fails them, its rows lost) and Stats still answer. Before, 8 waiting
    saves took every thread and the health check timed out. The COMMIT of a
    load prepared here is never refused for them: it waits its turn."""
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc

    hung = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(hung.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    store = f"hdfs://127.0.0.1:{hung.getsockname()[1]}"
    local = tmp_path / "local"
    cluster = start_cluster(1, "--checkpoint-root", store, "--checkpoint-root", str(local))
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[0]}")
    admin = dlt_pb2_grpc.ShardAdminStub(channel)
    try:
        with cluster.client() as c:
            c.create_table("t", dim=2)
            c.save(str(local / "ck"))
        admin.Load(
            dlt_pb2.LoadRequest(
                phase=dlt_pb2.LoadRequest.PREPARE, path=str(local / "ck"), load_id="mine"
            ),
            timeout=60,
        )
        codes: list[grpc.StatusCode] = []
        details: list[str] = []

        def save(k: int) -> None:
            try:
                admin.Save(dlt_pb2.SaveRequest(path=f"{store}/ck{k}", save_id=f"s{k}"), timeout=8)
            except grpc.RpcError as e:
                codes.append(e.code())
                details.append(e.details() or "")

        savers = [threading.Thread(target=save, args=(k,)) for k in range(10)]
        for t in savers:
            t.start()
        wait_until(lambda: len(codes) >= 7, "saves past the 2 that may wait refused")
        # A later phase of a load under way is never refused for the saves
        # that wait (it waits its turn); one naming no load here is capped
        # like them (6 forged ABORTs without deadlines took every thread).
        for _ in range(6):
            with pytest.raises(grpc.RpcError) as phase:
                admin.Load(
                    dlt_pb2.LoadRequest(phase=dlt_pb2.LoadRequest.ABORT, load_id="nope"),
                    timeout=30,
                )
            assert phase.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as commit:  # waits behind the stuck save
            admin.Load(
                dlt_pb2.LoadRequest(phase=dlt_pb2.LoadRequest.COMMIT, load_id="mine"), timeout=2
            )
        assert commit.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with cluster.client() as c:
            assert c.stats()[0]["shard_index"] == 0
        for t in savers:
            t.join(60)
        assert len(codes) == 10  # the running one, its 2 waiters (deadline), 7 refused
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 7, codes
        refused = details[codes.index(grpc.StatusCode.RESOURCE_EXHAUSTED)]
        assert f"Save to {store}/ck" in refused and "has been running for" in refused

        # Waiters whose callers gave up leave (they look every 0.2 s): a new
        # save then waits (until its own caller gives up), it is not refused.
        def later_save_waits() -> bool:
            try:
                admin.Save(dlt_pb2.SaveRequest(path=f"{store}/later", save_id="l"), timeout=1)
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            return False

        wait_until(later_save_waits, "the waiters whose callers gave up to leave", timeout=20)
    finally:
        channel.close()
        cluster.stop()
        hung.close()
        for conn in accepted:
            conn.close()


def _silent_streams(port: int, method: str, streams: int) -> socket.socket:
    """A peer that opens `streams` HTTP/2 streams calling `method` on the
    admin port, sends their headers (no token) and never a message."""

    def literal(name: bytes, value: bytes) -> bytes:  # HPACK, not indexed
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        head = len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big")
        return head + payload

    headers = b"".join(
        literal(name, value)
        for name, value in (
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
            (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )  # fmt: skip
    peer = socket.create_connection(("127.0.0.1", port))
    peer.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b""))  # preface, SETTINGS
    for k in range(streams):
        peer.sendall(frame(1, 0x4, 2 * k + 1, headers))  # HEADERS, END_HEADERS only
    return peer


@pytest.mark.parametrize("token", ["", "s3cret-token-0123"], ids=["open", "token"])
def test_streams_that_never_send_a_request_hold_no_admin_thread(
    start_cluster: Callable[..., Cluster], token: str
) -> None:
    """A peer (no token needed) opens 3 connections of 20 streams each, to a
    health check, reflection and a ShardAdmin method, and sends no message.
    Health checks, Stats and Saves still answer, and SIGTERM stops the shard
    at once, not after its stop grace. Before, the admin plane's 8 threads
    each waited for one such stream's message: health checks timed out (a
    liveness probe restarts the shard, its rows lost) and SIGTERM waited out
    --stop-grace."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cluster = start_cluster(1, "--stop-grace", "600", token=token)
    methods = (
        "/grpc.health.v1.Health/Check",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/tf_dlt.v1.ShardAdmin/Stats",
    )
    peers = [_silent_streams(cluster.admin_ports[0], method, 20) for method in methods]
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[0]}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(3):
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with cluster.client() as c:
            c.create_table("t", dim=4)
            c.push("t", np.arange(5, dtype=np.int64), np.ones((5, 4), np.float32), 0.1)
            assert c.stats()[0]["shard_index"] == 0
            c.save(str(cluster.workdir / "ck"))
    finally:
        channel.close()
        assert cluster.stop(timeout=60) == [0]  # exited on its own, not killed
        for peer in peers:
            peer.close()


NEW_TRAINER_LOOKS_UP = """
import sys
import numpy as np
from tf_dlt import dlt_ops as ops
client = ops.ClientResource([sys.argv[1]], auth_token=sys.argv[2])
print(ops.lookup(client, np.arange(5), "t", 4, training=False, missing="zeros").numpy().sum())
"""


def test_idle_admin_connections_take_no_descriptor_past_their_cap(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A peer without the token opens idle TCP connections to the admin
    port. They were not counted, and gRPC kept each for 2 minutes: at the
    open-file limit (20,000 here) new trainers could not connect and saves
    failed "Too many open files". At most --max-admin-connections are kept
    (the rest closed as they come) and their descriptors are left out of
    the data plane's: a new trainer process's lookups are served and a
    client connected before saves. And a connection that never finishes
    gRPC's handshake is closed after --hello-timeout, so a new control-plane
    connection gets in while the peer still holds its ends."""
    token = "s3cret-token-0123"
    cluster = start_cluster(1, "--max-admin-connections", "16", "--hello-timeout", "2", token=token)
    pid, admin = cluster.processes[0].pid, cluster.admin_ports[0]
    with cluster.client() as before:
        before.create_table("t", dim=4)
        before.push("t", np.arange(5, dtype=np.int64), np.ones((5, 4), np.float32), 0.1)
        assert before.stats()[0]["shard_index"] == 0  # (its admin connection is made)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        idle = [socket.create_connection(("127.0.0.1", admin), timeout=10) for _ in range(200)]
        try:
            assert not _health_on_a_new_connection(admin)  # the cap is full
            assert len(os.listdir(f"/proc/{pid}/fd")) <= fds + 16 + 4
            looked_up = subprocess.run(
                [sys.executable, "-c", NEW_TRAINER_LOOKS_UP, cluster.addresses[0], token],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert looked_up.returncode == 0, looked_up.stderr[-2000:]
            assert float(looked_up.stdout.split()[-1]) != 0  # the trained rows
            before.save(str(cluster.workdir / "ck"))  # files open
            assert len(os.listdir(f"/proc/{pid}/fd")) <= fds + 16 + 4
            wait_until(lambda: _health_on_a_new_connection(admin), "a new admin connection")
        finally:
            for sock in idle:
                sock.close()


def test_health_checks_that_never_send_their_request_do_not_hold_the_cap(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Health takes no token. A peer filled --max-admin-connections once
    with connections each holding a health Check whose request never came
    (a call in progress: never idle) and kept every new control-plane
    connection out, the kubelet's probes included, for as long as it
    liked. A health call's request is awaited --hello-timeout at most; the
    connection is then idle, and closed. Health Watch streams, which stay
    open by design, held it the same way: at most a quarter of the cap
    are taken."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cluster = start_cluster(1, "--max-admin-connections", "8", "--hello-timeout", "1")
    admin = cluster.admin_ports[0]
    peers = [_silent_streams(admin, "/grpc.health.v1.Health/Check", 1) for _ in range(8)]
    try:
        assert not _health_on_a_new_connection(admin)  # the cap is full
        # (--hello-timeout for the request, then the idle close)
        wait_until(lambda: _health_on_a_new_connection(admin), "a new admin connection")
    finally:
        for peer in peers:
            peer.close()
    channels = [
        grpc.insecure_channel(f"127.0.0.1:{admin}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(8)
    ]
    try:
        watches = [
            health_pb2_grpc.HealthStub(c).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            for c in channels
        ]
        open_watches = []
        for watch in watches:
            try:
                next(watch)  # SERVING
                open_watches.append(watch)
            except grpc.RpcError as e:
                assert e.code() in (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNAVAILABLE,
                ), e
        assert len(open_watches) == 2  # 8 // 4
        wait_until(lambda: _health_on_a_new_connection(admin), "a new admin connection")
    finally:
        for c in channels:
            c.close()


def _health_on_a_new_connection(port: int) -> bool:
    """Whether a health check on a connection of its own (not one another
    channel of this process shares) is answered."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
    )
    try:
        health = health_pb2_grpc.HealthStub(channel)
        return health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def test_health_watch_streams_are_capped(start_cluster: Callable[..., Cluster]) -> None:
    """Health takes no token, and each Watch stream held its memory for as
    long as it stayed open: 5,000 held 74 MB, without bound. Past
    MAX_HEALTH_WATCHES one is refused RESOURCE_EXHAUSTED; Check answers,
    and a Watch is taken again once one closed."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tf_dlt.server.admin_server import MAX_HEALTH_WATCHES

    cluster = start_cluster(1, token="s3cret-token-0123")  # health takes none
    # Several connections: each carries at most 100 streams at once.
    channels = [grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[0]}",
                                      options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(MAX_HEALTH_WATCHES // 50 + 2)]  # fmt: skip
    watches = []
    try:
        request = health_pb2.HealthCheckRequest(service="")
        for k in range(MAX_HEALTH_WATCHES):
            watch = health_pb2_grpc.HealthStub(channels[k // 50]).Watch(request, timeout=60)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watches.append(watch)
        extra = health_pb2_grpc.HealthStub(channels[-1]).Watch(request, timeout=60)
        with pytest.raises(grpc.RpcError) as refused:
            next(extra)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        health = health_pb2_grpc.HealthStub(channels[-1])
        assert health.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        watches.pop().cancel()

        def watched() -> bool:
            try:
                next(health_pb2_grpc.HealthStub(channels[-1]).Watch(request, timeout=10))
                return True
            except grpc.RpcError:
                return False

        wait_until(watched, "a Watch once one closed")
    finally:
        for watch in watches:
            watch.cancel()
        for channel in channels:
            channel.close()


def test_a_request_past_4_mib_is_refused_from_its_length(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Health checks take a request without a token: one that says it is
    larger than 4 MiB is refused from its length prefix, so a peer with many
    streams cannot make the shard hold 64 MiB per stream (what a request
    could be before). A Save listing 16,000 tables of the longest names
    still fits."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc

    cluster = start_cluster(1)
    channel = grpc.insecure_channel(
        f"127.0.0.1:{cluster.admin_ports[0]}", options=[("grpc.max_send_message_length", -1)]
    )
    try:
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as big:
            health.Check(health_pb2.HealthCheckRequest(service="x" * (5 << 20)), timeout=30)
        assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        names = [f"{k:05d}".ljust(255, "t") for k in range(16_000)]
        admin = dlt_pb2_grpc.ShardAdminStub(channel)
        with pytest.raises(grpc.RpcError) as save:
            admin.Save(
                dlt_pb2.SaveRequest(path=str(cluster.workdir / "ck"), save_id="s", tables=names),
                timeout=30,
            )
        assert save.value.code() == grpc.StatusCode.NOT_FOUND, save.value.details()
        assert "00000" in (save.value.details() or "")
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
