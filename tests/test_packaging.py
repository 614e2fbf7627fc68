"""Packaging: BUILD and setup.py build the same sources, the mapped packages
install under tf_dlt only, and the server and client need no TensorFlow."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import tf_dlt

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
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.split() == ["None", "None"]


def test_server_and_client_import_no_tensorflow() -> None:
    code = (
        "import sys, tf_dlt, tf_dlt.server, tf_dlt.server.main, tf_dlt.client, tf_dlt.errors\n"
        "tf_dlt.Client, tf_dlt.optimizers, tf_dlt.initializers\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/", timeout=120)


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
