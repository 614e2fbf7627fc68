"""Builds the C++ test programs of tests/cpp against the native core with
g++, plain or with AddressSanitizer and UndefinedBehaviorSanitizer. Objects
are cached by content under tests/cpp/build/, so only what changed is
rebuilt; two compilers run at once. The benchmarks' C++ programs are built
here too ("optimized": setup.py's flags).

Only the sanitized flavor and static binaries compile the native core
themselves (the sanitizers must instrument it; a static binary carries it).
The others link the core users run, tf_dlt/libdlt_core.so as
`setup.py build_ext --inplace` built it, and refuse one older than the
core's sources."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "tests/cpp/build"
FLAGS = ["-std=c++17", "-g", "-pthread", "-Wall", "-Werror", f"-I{ROOT}"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer"]  # fmt: skip
# How sanitized programs run: any report fails them.
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}
# The C++ suite's own sources (BUILD's cc_test lists the same).
SUITE_SOURCES = [
    "tests/cpp/harness.cc",
    "tests/cpp/native_test.cc",
    "tests/cpp/data_plane_test.cc",
    "tests/cpp/pull_ahead_test.cc",
    "tests/cpp/push_queue_test.cc",
    "tests/cpp/row_cache_test.cc",
    "tests/cpp/memory_policy_test.cc",
    "tests/cpp/tier_test.cc",
    "tests/cpp/replication_test.cc",
]


def setup_list(name: str) -> list[str]:
    """The strings of the list literal `name` in setup.py."""
    text = (ROOT / "setup.py").read_text()
    block = text[text.index(f"{name} = [") :]
    return re.findall(r'"([^"]+)"', block[: block.index("]")])


# "optimized" (benchmarks): the flags setup.py builds the native core with,
# what users run (at -O2 this compiler leaves the table core's checks
# unvectorized).
FLAVORS = {
    "plain": ["-O1"],
    "optimized": setup_list("NATIVE_FLAGS"),
    "sanitized": ["-O1", *SANITIZE],
}


def _headers_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "native").rglob("*.h"), *(ROOT / "tests/cpp").glob("*.h")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _compile(source: Path, flavor: str, headers: str) -> Path:
    flags = " ".join([*FLAGS, *FLAVORS[flavor]])
    key = hashlib.sha256(source.read_bytes() + headers.encode() + flags.encode()).hexdigest()
    obj = BUILD / f"{source.stem}-{flavor}-{key[:16]}.o"
    if not obj.exists():
        tmp = obj.with_suffix(f".o.partial-{os.getpid()}")  # builds may run at once
        cmd = ["g++", *FLAGS, *FLAVORS[flavor], "-c", str(source), "-o", str(tmp)]
        subprocess.run(cmd, check=True, timeout=900)
        tmp.rename(obj)
    return obj


CORE_LIBRARY = ROOT / "tf_dlt/libdlt_core.so"


def shipped_core() -> Path:
    """tf_dlt/libdlt_core.so, refused when a source or header of the core
    changed after it was built."""
    sources = [p for p in (ROOT / "native").rglob("*.[ch]*") if "python" not in p.parts]
    newest = max(sources, key=lambda p: p.stat().st_mtime)
    if not CORE_LIBRARY.exists() or newest.stat().st_mtime > CORE_LIBRARY.stat().st_mtime:
        raise RuntimeError(
            f"{CORE_LIBRARY} is missing or older than {newest.relative_to(ROOT)}: "
            "build it again with `.venv/bin/python setup.py build_ext --inplace`"
        )
    return CORE_LIBRARY


def build(
    program: str, flavor: str = "plain", sources: Sequence[Path] = (), static: bool = False
) -> Path:
    """Builds `program` from the native core (no Python bindings) and its own
    `sources`; by default those of tests/cpp: "native_test" (the C++ suite)
    or "fuzz_shard" (a data-plane shard with no Python). `flavor`: "plain",
    "optimized" (benchmarks) or "sanitized". `static`: linked with -static
    (a binary to copy to another x86-64 Linux machine). Unless sanitized or
    static, the core is the shipped library (`shipped_core`)."""
    BUILD.mkdir(parents=True, exist_ok=True)
    compiled = flavor == "sanitized" or static
    core = [s for s in sorted((ROOT / "native").rglob("*.cc")) if "python" not in s.parts]
    library: list[str] = []
    if not compiled:
        shipped = shipped_core()
        core = []
        library = [f"-L{shipped.parent}", "-ldlt_core", f"-Wl,-rpath,{shipped.parent}"]
    cpp = ROOT / "tests/cpp"
    own = list(sources) or (
        [ROOT / source for source in SUITE_SOURCES]
        if program == "native_test"
        else [cpp / f"{program}.cc"]
    )
    headers = _headers_digest()
    with ThreadPoolExecutor(2) as pool:
        objects = list(pool.map(lambda s: _compile(s, flavor, headers), core + own))
    names = "".join(o.name for o in objects) + "".join(library)
    if library:  # relinked when the library is rebuilt
        names += str(CORE_LIBRARY.stat().st_mtime_ns)
    key = hashlib.sha256(names.encode()).hexdigest()
    binary = BUILD / f"{program}-{flavor}{'-static' if static else ''}-{key[:16]}"
    if not binary.exists():
        partial = f"{binary}.partial-{os.getpid()}"  # builds may run at once
        link = ["g++", *FLAGS, *FLAVORS[flavor], *map(str, objects), *library, "-o", partial]
        subprocess.run([*link, *(["-static"] if static else [])], check=True, timeout=300)
        Path(partial).rename(binary)
    return binary
