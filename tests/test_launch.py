"""`tf-dlt launch` end to end on loopback: shards + trainers start, prefixed
logs, teardown on success, on a failing trainer and on SIGINT; and the
dense-sync convergence check: 2 trainers on disjoint halves reach the quality
of 1 trainer on all of it (examples/ctr_multi_trainer.py)."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest

from tf_dlt.server import local
from tf_dlt.server.local import LocalCluster, refuse_placement
from tf_dlt.tools.launch import Launch

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ctr_multi_trainer.py"
# Held-out AUC of 2 trainers on halves vs 1 trainer on all the data.
AUC_TOLERANCE = 0.02


def _lines_until(proc: subprocess.Popen[str], prefix: str, seconds: float) -> list[str]:
    """`proc`'s output lines up to the first that starts with `prefix` (or
    its end, or `seconds`)."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith(prefix) or not line:
            break
    return lines


def _launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tf_dlt.tools.cli", "launch", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd="/"
    )  # outside the source tree: the installed package


def _shard_ports(output: str) -> list[int]:
    return [
        int(p)
        for p in re.findall(r"shards healthy \d+/\d+ \(ps-\d+ at 127\.0\.0\.1:(\d+)\)", output)
    ]


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _results(output: str) -> list[dict[str, float]]:
    return [
        json.loads(line.split("RESULT ", 1)[1])
        for line in output.splitlines()
        if "RESULT {" in line
    ]


def test_two_trainers_on_halves_match_one_trainer_on_all() -> None:
    one = _launch("--pservers", "2", "--workers", "1", "--", sys.executable, str(EXAMPLE))
    two = _launch("--pservers", "2", "--workers", "2", "--", sys.executable, str(EXAMPLE))
    for run in (one, two):
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert "[launch] exit code 0" in run.stdout
        assert re.search(r"^\[ps-1\] .*shard 1 stopped", run.stdout, re.M)
        assert all(_refused(port) for port in _shard_ports(run.stdout))
    (single,) = _results(one.stdout)
    pair = _results(two.stdout)
    assert sorted(r["worker"] for r in pair) == [0, 1]
    assert all(r["examples"] == single["examples"] / 2 for r in pair)
    print(f"AUC: 1 trainer {single['auc']:.4f}; 2 trainers {[round(r['auc'], 4) for r in pair]}")
    for r in pair:
        assert r["auc"] > single["auc"] - AUC_TOLERANCE
    assert re.search(r"^\[worker-1\] worker 1/2: ", two.stdout, re.M)


FAILING = """
import json, os, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
print("up", flush=True)
if index == 1:
    sys.exit(3)
time.sleep(120)
"""


def test_a_failing_trainer_stops_everything() -> None:
    start = time.monotonic()
    run = _launch("--pservers", "2", "--workers", "2", "--", sys.executable, "-c", FAILING)
    assert run.returncode == 1
    assert time.monotonic() - start < 60  # worker 0 (sleeping 120 s) was stopped
    assert "[launch] worker-1 failed with exit code 3: stopping everything" in run.stdout
    assert all(_refused(port) for port in _shard_ports(run.stdout))


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie nobody reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_teardown_stops_what_the_trainers_started(tmp_path: Path) -> None:
    """A trainer run by a wrapper script: the teardown's SIGTERM killed the
    script and left the python it ran running, an orphan holding the output
    pipe. Each trainer is a process group now, signalled whole."""
    trainer = tmp_path / "trainer.py"
    # Worker 1 fails; worker 0, stopped, takes a second to finish (a save)
    # and must be given it: the grace is its own, not its wrapper's.
    trainer.write_text(
        FAILING.replace('print("up"', 'print("pid", os.getpid(), "up"').replace(
            "time.sleep(120)",
            "import signal, pathlib\n"
            "def finish(*_):\n"
            "    time.sleep(1)\n"
            f"    pathlib.Path({str(tmp_path / 'saved')!r}).touch()\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, finish)\n"
            "time.sleep(120)",
        )
    )
    wrapper = tmp_path / "wrapper.sh"
    wrapper.write_text(f"#!/bin/bash\n{sys.executable} {trainer}\nexit $?\n")
    wrapper.chmod(0o755)
    run = _launch("--pservers", "1", "--workers", "2", "--grace", "10", "--", str(wrapper))
    assert run.returncode == 1, run.stdout[-3000:]
    assert (tmp_path / "saved").exists()
    pids = [int(p) for p in re.findall(r"^\[worker-\d\] pid (\d+) up", run.stdout, re.M)]
    assert len(pids) == 2, run.stdout[-3000:]
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"left running: {[p for p in pids if _running(p)]}"
        time.sleep(0.1)


def test_a_shard_that_fails_to_start_is_named_with_its_log() -> None:
    run = _launch(
        "--pservers", "2", "--server-arg=--load-from=/nonexistent/ck", "--", "true"
    )  # fmt: skip
    assert run.returncode == 1
    # Named by its role, its own log lines prefixed; the other shard, which
    # the failed start stopped, is not blamed.
    assert re.search(r"^\[launch\] failed: ps-\d exited with 2 while starting", run.stdout, re.M)
    assert re.search(r"^\[ps-\d\] .*cannot start: no committed checkpoint", run.stdout, re.M)
    assert "did not stop cleanly" not in run.stdout, run.stdout


def test_a_signal_while_the_shards_start_stops_the_launch(tmp_path: Path) -> None:
    """SIGTERM waited for the shards to start (a long --load-from)."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import sys, time\nif 'tf_dlt.server' in sys.orig_argv:\n    time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{slow}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_dlt.tools.cli", "launch", "--pservers", "1",
         "--start-timeout", "500", "--", "true"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/", env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    text = ""
    while "starting 1 shard servers" not in text:
        line = proc.stdout.readline()
        assert line, text
        text += line
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)  # the shard would take 600 s
    text += out
    assert proc.returncode == 128 + signal.SIGTERM, text
    assert "got signal 15" in text and "did not stop cleanly" not in text


def test_trainers_without_shard_servers_are_warned_they_train_apart() -> None:
    run = _launch("--pservers", "0", "--workers", "2", "--", sys.executable, "-c", "pass")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "each of the 2 trainers has tables of its own" in run.stdout
    alone = _launch("--pservers", "0", "--workers", "1", "--", sys.executable, "-c", "pass")
    assert alone.returncode == 0 and "tables of its own" not in alone.stdout


def _launched(pservers: int, workers: int) -> tuple[subprocess.Popen[str], list[str]]:
    """A launch whose trainers print 'up <pid>' and sleep; returns once the
    last trainer is up (or after a minute), with the lines read so far."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_dlt.tools.cli", "launch", "--pservers", str(pservers),
         "--workers", str(workers), "--", sys.executable, "-c",
         "import os, time; print('up', os.getpid(), flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/",
    )  # fmt: skip
    lines = _lines_until(proc, f"[worker-{workers - 1}] up", 60)
    return proc, lines


def test_sigint_stops_everything() -> None:
    proc, lines = _launched(1, 2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    text = "".join(lines) + out
    assert proc.returncode == 128 + signal.SIGINT, text
    assert "stopping everything" in text
    assert all(_refused(port) for port in _shard_ports(text))


def test_shards_stop_when_the_launcher_is_killed() -> None:
    """A launcher killed with SIGKILL (or by the OOM killer) cannot stop its
    shards: they see it gone (no longer their parent) and stop themselves,
    and a trainer left running then fails on its own. Before, they served on
    for good, holding their ports and memory."""
    proc, lines = _launched(2, 1)
    ports = _shard_ports("".join(lines))
    assert len(ports) == 2 and lines[-1].startswith("[worker-0] up"), "".join(lines)
    trainer = int(lines[-1].split()[-1])
    try:
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 30
        while not all(_refused(port) for port in ports):
            assert time.monotonic() < deadline, "the shards outlived their launcher"
            time.sleep(0.2)
    finally:
        assert proc.stdout is not None
        proc.stdout.close()
        try:
            os.kill(trainer, signal.SIGKILL)  # the trainer, left behind (its own session)
        except ProcessLookupError:
            pass


def test_bad_arguments_are_refused() -> None:
    run = _launch("--pservers", "1", "--workers", "0", "--", "true")
    assert run.returncode == 2 and "--workers >= 1" in run.stderr
    run = _launch("--pservers", "1")
    assert run.returncode == 2 and "no trainer command" in run.stderr
    # Where each shard listens and which shard it is are the launcher's: a
    # flag overriding them started shards the trainers were not told of.
    refuse_placement(["--threads=2", "--storage", "/x", "--"])  # none of them places a shard
    for flag in ("--server-arg=--shard-index=1", "--server-arg=--port", "--server-arg=--shard-ind"):
        run = _launch("--pservers", "1", flag, "--", "true")
        assert run.returncode == 2 and flag.split("=")[1] in run.stderr, run.stderr
    # A shard the cluster cannot greet on 127.0.0.1 was waited for until
    # the start timed out ("not SERVING"), its own log saying it served.
    run = _launch("--pservers", "1", "--server-arg=--bind=127.0.0.2", "--", "true")
    assert run.returncode == 2 and "reaches its shards on 127.0.0.1" in run.stderr, run.stderr
    refuse_placement(["--bind", "0.0.0.0"])  # every address: loopback too
    refuse_placement(["--bind=127.0.0.1"])


@pytest.mark.parametrize("bad", ["--pservers=x", "--grace=0", "--grace=-1", "--start-timeout=0"])
def test_usage_errors(bad: str) -> None:
    assert _launch(bad, "--", "true").returncode == 2


FAILOVER = """
import json, os, socket, time
import numpy as np
import tf_dlt
ps = json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"]
client = tf_dlt.Client(ps)
client.create_table("emb", 4, optimizer="adagrad")
ids = np.arange(1000)
for _ in range(5):
    client.push("emb", ids, np.ones((1000, 4), np.float32), 0.1)
before = client.pull("emb", ids)
print("READY", flush=True)
host, port = ps[1].split("|")[int(os.environ.get("KILLED_COPY", "0"))].rsplit(":", 1)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # until the launcher killed shard 1's primary
    with socket.socket() as s:
        if s.connect_ex((host, int(port))) != 0:
            break
    time.sleep(0.05)
same = bool(np.array_equal(client.pull("emb", ids), before))
client.push("emb", ids, np.ones((1000, 4), np.float32), 0.1)
print("RESULT " + json.dumps({"same": same}), flush=True)
"""


class _KillOnReady(io.StringIO):
    """Launch output that kills process `process` (1: shard 1's primary)
    when the trainer is ready."""

    launch: Launch | None = None
    process = 1

    def write(self, text: str) -> int:
        if "[worker-0] READY" in text and self.launch and self.launch.cluster:
            self.launch.cluster.kill(self.process)
        return super().write(text)


def test_replicas_survive_a_killed_primary() -> None:
    out = _KillOnReady()
    launch = Launch(2, 1, [sys.executable, "-c", FAILOVER], replicas=2, out=out)
    out.launch = launch
    code = launch.run()
    text = out.getvalue()
    assert code == 0, text[-4000:]
    assert "each with a hot standby" in text
    assert re.search(
        r"\[launch\] ps-1 exited with -9; ps-1-standby1 of shard 1 still runs; starting ps-1 "
        r"again to rejoin it as a standby", text
    )  # fmt: skip
    assert re.search(r"\[ps-1-standby1\] .*taking over", text)
    assert _results(text) == [{"same": True}]


def test_replicas_survive_a_killed_standby(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync primary acknowledges no push without its standby: a standby
    killed under `tf-dlt launch --replicas 2` failed training at the push
    deadline (30 s). The launcher starts it again; it rejoins and catches
    up, and the trainer's push after the kill is acknowledged."""
    monkeypatch.setenv("KILLED_COPY", "1")
    out = _KillOnReady()
    out.process = 3  # ps-1-standby1
    launch = Launch(2, 1, [sys.executable, "-c", FAILOVER], replicas=2, out=out)
    out.launch = launch
    code = launch.run()
    text = out.getvalue()
    assert code == 0, text[-4000:]
    assert "starting ps-1-standby1 again to rejoin it as a standby" in text, text[-4000:]
    assert _results(text) == [{"same": True}]


def test_a_restart_that_cannot_start_a_process_is_reported_not_raised() -> None:
    """A dead standby whose restart fails before any process starts (no file
    descriptor left: OSError from Popen) is reported, and the launcher goes
    on with the shard's primary; the OSError escaped the monitor loop and
    ended the launch."""

    class Proc:
        def __init__(self, code: int | None) -> None:
            self.returncode = code

        def poll(self) -> int | None:
            return self.returncode

    class Cluster:
        processes = [Proc(None), Proc(-9)]  # ps-0 serves; ps-0-standby1 died

        def restart(self, process: int) -> None:
            raise OSError(24, "Too many open files")

    out = io.StringIO()
    launch = Launch(1, 1, [sys.executable, "-c", "pass"], replicas=2, out=out)
    launch._check_shards(cast(LocalCluster, Cluster()))
    launch._check_shards(cast(LocalCluster, Cluster()))  # reported once
    text = out.getvalue()
    assert text.count("did not start again ([Errno 24] Too many open files)") == 1, text


CHATTY = "import time\ntime.sleep(1)\nfor i in range(200000): print('line', i)\n"


def test_launch_whose_output_is_closed_still_ends_with_its_trainer() -> None:
    """A user pipes the launcher into `head` (or `tee` that dies, a log
    shipper that goes away) and the reader closes its end after the
    launcher's first lines. Before: the pump thread of the trainer's
    output dies on BrokenPipeError ("Exception in thread ... (_pump)"), so
    nobody reads the trainer's pipe any more; the trainer blocks on its
    next print once the 64 KiB pipe buffer is full, and the launcher waits
    for it for ever (a trainer that needs a second runs for good; only a
    signal ends it, with a raw BrokenPipeError traceback). Now: the
    launcher keeps draining its roles' output (dropping what it cannot
    write) and exits when the trainer does, with a meaningful code."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_dlt.tools.cli", "launch", "--pservers", "0", "--",
         sys.executable, "-c", CHATTY],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line or line.startswith("[launch] started"):
            break
    proc.stdout.close()  # the reader went away (`| head`)
    try:
        proc.wait(60)  # the trainer alone needs about a second
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
        proc.send_signal(signal.SIGINT)  # the launcher then stops its trainer
        proc.wait(60)
    err = proc.stderr.read() if proc.stderr else ""
    assert not hung, "launch still running 60 s after its trainer could have ended:\n" + err[-2000:]


def test_launch_with_broken_stdout_returns_its_code() -> None:
    """A user runs `tf-dlt launch ... | head -3`. Before: the
    launcher's own next line raises BrokenPipeError out of Launch.run()
    (a raw traceback, from `say`, launch.py:145, called unguarded from
    run()/_supervise()), whatever the trainers did. Now:
    run() returns an exit code (the trainers' outcome), output errors are
    not fatal."""

    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            if "shards healthy" in self.getvalue() or "no shard servers" in self.getvalue():
                raise BrokenPipeError(errno.EPIPE, "Broken pipe")
            return super().write(text)

    launch = Launch(0, 1, [sys.executable, "-c", "pass"], out=Closed())
    try:
        code = launch.run()
    except BrokenPipeError as e:
        pytest.fail(f"Launch.run() raised {e!r} instead of returning an exit code")
    assert code == 0


def test_an_oserror_while_starting_shards_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An operator launches many shards and the launcher runs out of file
    descriptors (EMFILE) or processes (EAGAIN) or /tmp is full while it
    starts them. Before: LocalCluster.start stops what it started and
    re-raises the OSError; Launch._start_shards (launch.py:185) and
    Launch.run (launch.py:361) catch only RuntimeError/TimeoutError, so
    the OSError leaves `tf-dlt launch` as a raw traceback (the same error in
    a restart, and in starting a trainer, is caught and reported). What
    should happen: `[launch] failed: cannot start ps-N: Too many open
    files`, exit 1."""

    def spawn(self: local.LocalCluster, process: int, *args: object, **kw: object) -> object:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(local.LocalCluster, "_spawn", spawn)
    out = io.StringIO()
    launch = Launch(2, 1, [sys.executable, "-c", "pass"], out=out)
    try:
        code = launch.run()
    except OSError as e:
        pytest.fail(f"Launch.run() raised {e!r} instead of reporting it:\n{out.getvalue()}")
    assert code == 1 and "failed" in out.getvalue()


SAVE_ON_SIGTERM = """
import signal, sys, time, numpy as np
from tf_dlt.cluster import cluster_from_env
from tf_dlt.client import Client
c = Client(cluster_from_env().pservers)
c.create_table("t", 4)
c.pull("t", np.arange(100, dtype=np.int64))
def on_term(*_):
    try:
        c.save(sys.argv[1])
        print("SAVED", flush=True)
        sys.exit(0)
    except Exception as e:
        print("SAVE FAILED", type(e).__name__, str(e)[:200], flush=True)
        sys.exit(3)
signal.signal(signal.SIGTERM, on_term)
print("READY", flush=True)
while True:
    time.sleep(0.1)
"""


def test_ctrl_c_in_a_terminal_leaves_the_shards_to_the_trainers_save(tmp_path) -> None:
    """A user presses Ctrl-C in the terminal running `tf-dlt launch
    --pservers 2 -- python train.py`, whose trainer saves a checkpoint on
    SIGTERM (the launcher gives trainers SIGTERM and --grace for this, and
    stops the shards only after them). The terminal sends SIGINT to the
    whole foreground process group. Before: the trainers are in
    sessions of their own, but the shard servers are not
    (LocalCluster._spawn, tf_dlt/server/local.py:241, Popen without
    start_new_session): they get the SIGINT themselves and shut down at
    once ("received SIGINT, shutting down"), so when the launcher then
    sends the trainer SIGTERM its save fails with UnavailableError
    (connection refused): the final checkpoint is lost. (test_launch's
    SIGINT test signals the launcher's pid only, not its group.) What
    should happen: the shards only stop when the launcher stops them, after
    the trainers (the save succeeds)."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_dlt.tools.cli", "launch", "--pservers", "2", "--",
         sys.executable, "-c", SAVE_ON_SIGTERM, str(ckpt)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/",
        start_new_session=True,  # a terminal's foreground group, led by the launcher
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    lines = _lines_until(proc, "[worker-0] READY", 90)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: every process of the foreground group
    out, _ = proc.communicate(timeout=120)
    text = "".join(lines) + out
    assert "[worker-0] SAVED" in text, text[-3000:]
