"""Packaging: BUILD and setup.py build the same sources in the same shape,
the build recompiles what a header edit touches, _native.pyi matches the
module, the mapped packages install under tf_dlt only, and the server and
client need no TensorFlow."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tf_dlt

import native_build

ROOT = Path(__file__).resolve().parent.parent


def _setup_list(name: str) -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{name} not found in setup.py")


def test_build_and_setup_list_the_same_sources() -> None:
    build = (ROOT / "BUILD").read_text()
    bazel_sources = set(re.findall(r'"((?:native|ops)/[^"]+\.cc)"', build))
    setup_sources = set(_setup_list("NATIVE_CORE_SOURCES"))
    setup_sources |= set(_setup_list("PYTHON_EXTENSION_SOURCES"))
    setup_sources |= set(_setup_list("TF_OPS_SOURCES"))
    assert bazel_sources == setup_sources
    on_disk = {
        str(p.relative_to(ROOT)) for d in ("native", "ops") for p in (ROOT / d).rglob("*.cc")
    }
    assert setup_sources == on_disk
    headers = {str(p.relative_to(ROOT)) for d in ("native", "ops") for p in (ROOT / d).rglob("*.h")}
    assert headers == set(re.findall(r'"((?:native|ops)/[^"]+\.h)"', build))


def _bazel_target(build: str, name: str) -> str:
    start = build.index(f'name = "{name}"')
    return build[start : build.index("\n)\n", start)]


def test_build_links_the_core_once_and_tests_every_suite_source() -> None:
    build = (ROOT / "BUILD").read_text()
    for extension in ("tf_dlt/_native.so", "tf_dlt/_dlt_ops.so"):
        target = _bazel_target(build, extension)
        assert '"tf_dlt/libdlt_core.so",' in target and '":native_core"' not in target
    assert '":native_core"' in _bazel_target(build, "tf_dlt/libdlt_core.so")
    suite = set(re.findall(r'"(tests/cpp/[^"]+)"', _bazel_target(build, "native_test")))
    assert suite == {*native_build.SUITE_SOURCES, "tests/cpp/harness.h"}
    assert set(native_build.SUITE_SOURCES) | {"tests/cpp/fuzz_shard.cc"} == {
        str(p.relative_to(ROOT)) for p in (ROOT / "tests/cpp").glob("*.cc")
    }


def _setup_module() -> Any:
    spec = importlib.util.spec_from_file_location("tf_dlt_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the build; setup() runs only as __main__
    return module


def test_a_header_edit_recompiles_exactly_what_includes_it(tmp_path: Path) -> None:
    """setup.py's per-object rebuild rule (what `pip install .` runs in the
    README's test command, reusing build/): an object is rebuilt when its
    source, a header it includes or its command changed, and only then."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    setup_py = _setup_module()
    compiler = new_compiler()
    customize_compiler(compiler)
    (tmp_path / "a.h").write_text("inline int a() { return 1; }\n")
    (tmp_path / "uses_a.cc").write_text('#include "a.h"\nint f() { return a(); }\n')
    (tmp_path / "alone.cc").write_text("int g() { return 2; }\n")
    sources = [str(tmp_path / "uses_a.cc"), str(tmp_path / "alone.cc")]
    out = str(tmp_path / "obj")

    def build(flags: list[str]) -> dict[str, int]:
        objects = setup_py.compile_objects(compiler, sources, out, [str(tmp_path)], flags, 2)
        return {Path(o).stem: os.stat(o).st_mtime_ns for o in objects}

    first = build(["-O0"])
    assert build(["-O0"]) == first  # nothing changed: nothing compiled
    later = time.time() + 5
    os.utime(tmp_path / "a.h", (later, later))
    second = build(["-O0"])
    assert second["uses_a"] != first["uses_a"] and second["alone"] == first["alone"]
    third = build(["-O1"])  # another command: everything
    assert all(third[k] != second[k] for k in third)


def test_native_stub_matches_the_module() -> None:
    """tf_dlt/_native.pyi names exactly what tf_dlt._native defines: its
    constants, functions, classes and each class's methods and properties."""
    from tf_dlt import _native

    stub = ast.parse((ROOT / "tf_dlt" / "_native.pyi").read_text())
    stubbed: dict[str, set[str]] = {}
    for node in stub.body:
        if isinstance(node, ast.FunctionDef):
            stubbed[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stubbed[node.target.id] = set()  # a constant
        elif isinstance(node, ast.ClassDef):
            stubbed[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} - {
                "__init__"
            }
    module = {n for n in dir(_native) if not n.startswith("_")}
    assert set(stubbed) == module
    for name, members in stubbed.items():
        if members or isinstance(getattr(_native, name), type):
            real = {n for n in dir(getattr(_native, name)) if not n.startswith("_")}
            assert members == real, name


def test_only_the_op_sources_include_tensorflow_headers() -> None:
    for path in (ROOT / "native").rglob("*"):
        if path.suffix in (".h", ".cc"):
            assert '#include "tensorflow/' not in path.read_text(), path


def test_mapped_packages_install_under_tf_dlt_only() -> None:
    assert importlib.util.find_spec("tf_dlt.layers") is not None
    assert importlib.util.find_spec("tf_dlt.transpiler") is not None
    code = (
        "import importlib.util as u; print(u.find_spec('keras_layers'), u.find_spec('transpiler'))"
    )
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the install's view (conftest points it at a checkout)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/", env=env
    )
    assert out.stdout.split() == ["None", "None"]


def test_python_started_in_the_checkout_runs_the_source_tree(tmp_path: Path) -> None:
    """`python` in the repository root imports ./tf_dlt (built in place by
    the set-up), with tf_dlt.layers and tf_dlt.transpiler mapped to their
    folders, and trains a model on the embedded tables."""
    code = (
        "import os, numpy as np, keras, tf_dlt\n"
        "from tf_dlt import _native, layers, transpiler\n"
        "assert tf_dlt.__file__.startswith(os.getcwd()), tf_dlt.__file__\n"
        "assert layers.__file__.startswith(os.path.join(os.getcwd(), 'keras_layers'))\n"
        "ids = keras.Input((2,), dtype='int64')\n"
        "emb = layers.Embedding(output_dim=4, is_distributed=True, name='from_checkout')\n"
        "m = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))\n"
        "m.compile(optimizer='adagrad', loss='mse')\n"
        "m.fit(np.arange(16).reshape(8, 2), np.ones(8), verbose=0)\n"
        "m = transpiler.transpile(m)\n"
        "assert tf_dlt.embedded.table('from_checkout').size() == 16\n"
    )
    _run_in_checkout(code)


def _run_in_checkout(code: str) -> None:
    """Runs `code` in `python` started in the repository root (no
    PYTHONPATH: the source tree as a user running from it gets it)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300, env=env)


def test_server_and_client_import_no_tensorflow() -> None:
    code = (
        "import sys, tf_dlt, tf_dlt.server, tf_dlt.server.main, tf_dlt.client, tf_dlt.errors\n"
        "tf_dlt.Client, tf_dlt.optimizers, tf_dlt.initializers\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/", timeout=120)


def test_every_public_name_resolves_after_import_tf_dlt_alone() -> None:
    """What the docs write after `import tf_dlt` alone resolves in a fresh
    process: every name of `tf_dlt.__all__` and of its lazy modules, as
    `tf_dlt.tls.TlsConfig` (docs/security.md)."""
    code = (
        "import sys, tf_dlt\n"
        "assert 'tf_dlt.tls' not in sys.modules  # first, before a name imports it\n"
        "tf_dlt.tls.TlsConfig\n"
        "for name in {*tf_dlt.__all__, *tf_dlt._LAZY}:\n"
        "    getattr(tf_dlt, name)\n"
    )
    _run_in_checkout(code)


def test_version_has_one_source() -> None:
    scope: dict[str, str] = {}
    exec((ROOT / "tf_dlt" / "version.py").read_text(), scope)
    assert tf_dlt.__version__ == scope["__version__"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", tf_dlt.__version__)


# Which parts of the package each part may import: dependencies point one
# way, from the tools and the Keras features down to the core.
_LAYERS = {
    "core": {"core", "checkpoint"},  # the client commits checkpoints
    "checkpoint": {"core", "checkpoint"},
    "server": {"core", "checkpoint", "server"},
    "layers": {"core", "layers"},
    "keras": {"core", "checkpoint", "layers", "keras"},
    "transpiler": {"core", "layers", "keras", "transpiler"},
    "tools": {"core", "checkpoint", "server", "tools"},
}
_PARTS = {
    "checkpoint": "tf_dlt/checkpoint", "server": "tf_dlt/server", "keras": "tf_dlt/keras",
    "tools": "tf_dlt/tools", "layers": "keras_layers", "transpiler": "transpiler",
}  # fmt: skip


def _part_of_module(module: str) -> str | None:
    """The part a tf_dlt module belongs to (None: not tf_dlt's)."""
    if module != "tf_dlt" and not module.startswith("tf_dlt."):
        return None
    second = module.split(".")[1] if "." in module else ""
    return second if second in _LAYERS and second != "core" else "core"


def _part_of_file(path: Path) -> str:
    rel = str(path.relative_to(ROOT))
    return next((part for part, prefix in _PARTS.items() if rel.startswith(prefix)), "core")


def test_dependencies_point_one_way() -> None:
    sources = [*(ROOT / "tf_dlt").rglob("*.py"), *(ROOT / "keras_layers").rglob("*.py"),
               *(ROOT / "transpiler").rglob("*.py")]  # fmt: skip
    wrong = []
    for path in sources:
        if "proto" in path.parts or path == ROOT / "tf_dlt" / "__init__.py":
            continue  # generated code; the package's facade names everything lazily
        part = _part_of_file(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                target = _part_of_module(name)
                if target is not None and target not in _LAYERS[part]:
                    wrong.append(f"{path.relative_to(ROOT)} ({part}) imports {name} ({target})")
    assert not wrong, "\n".join(wrong)
    # The core never imports Keras itself either.
    for path in (ROOT / "tf_dlt").glob("*.py"):
        assert "import keras" not in path.read_text(), path
