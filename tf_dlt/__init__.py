"""tf_dlt: a distributed embedding lookup table for TensorFlow / Keras 3.

``import tf_dlt`` does not import TensorFlow: the shard server and the Python
client work without it. When TensorFlow is already imported, it registers the
Dlt> ops (so SavedModels using them load). Names are loaded on first use; ``tf_dlt.ops`` (the
TensorFlow ops) imports TensorFlow.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from tf_dlt.version import __version__

if TYPE_CHECKING:
    from tf_dlt import admission, embedded, errors, expiry, initializers, optimizers, routing, tls
    from tf_dlt import dlt_ops as ops  # noqa: F401 (exported lazily below)
    from tf_dlt.client import Client
    from tf_dlt.cluster import ClusterSpec, cluster_from_env
    from tf_dlt.keras.client_metrics import ClientMetrics
    from tf_dlt.keras.dense_sync import DenseOnShards
    from tf_dlt.keras.pull_ahead import pull_ahead
    from tf_dlt.keras.recovery import resilient_fit, wait_for_shards
    from tf_dlt.keras.row_cache import hot_row_cache
    from tf_dlt.memory_policy import MemoryPolicy
    from tf_dlt.table_config import TableConfig

_LAZY = {
    "Client": ("tf_dlt.client", "Client"),
    "ClientMetrics": ("tf_dlt.keras.client_metrics", "ClientMetrics"),
    "ClusterSpec": ("tf_dlt.cluster", "ClusterSpec"),
    "DenseOnShards": ("tf_dlt.keras.dense_sync", "DenseOnShards"),
    "MemoryPolicy": ("tf_dlt.memory_policy", "MemoryPolicy"),
    "cluster_from_env": ("tf_dlt.cluster", "cluster_from_env"),
    "TableConfig": ("tf_dlt.table_config", "TableConfig"),
    "admission": ("tf_dlt.admission", None),
    "embedded": ("tf_dlt.embedded", None),
    "errors": ("tf_dlt.errors", None),
    "expiry": ("tf_dlt.expiry", None),
    "export_saved_model": ("tf_dlt.keras.export", "export_saved_model"),
    "save": ("tf_dlt.keras.checkpoint", "save"),
    "resilient_fit": ("tf_dlt.keras.recovery", "resilient_fit"),
    "wait_for_shards": ("tf_dlt.keras.recovery", "wait_for_shards"),
    "load": ("tf_dlt.keras.checkpoint", "load"),
    "ModelCheckpoint": ("tf_dlt.keras.checkpoint", "ModelCheckpoint"),
    "ops": ("tf_dlt.dlt_ops", None),
    "pull_ahead": ("tf_dlt.keras.pull_ahead", "pull_ahead"),
    "hot_row_cache": ("tf_dlt.keras.row_cache", "hot_row_cache"),
    "initializers": ("tf_dlt.initializers", None),
    "layers": ("tf_dlt.layers", None),
    "optimizers": ("tf_dlt.optimizers", None),
    "routing": ("tf_dlt.routing", None),
    "tls": ("tf_dlt.tls", None),
    "transpile": ("tf_dlt.transpiler", "transpile"),
}

__all__ = [
    "Client",
    "ClientMetrics",
    "ClusterSpec",
    "DenseOnShards",
    "MemoryPolicy",
    "ModelCheckpoint",
    "TableConfig",
    "__version__",
    "admission",
    "cluster_from_env",
    "embedded",
    "errors",
    "expiry",
    "export_saved_model",
    "hot_row_cache",
    "initializers",
    "optimizers",
    "pull_ahead",
    "resilient_fit",
    "routing",
    "save",
    "tls",
    "transpile",
    "wait_for_shards",
]


class _SourceTree(importlib.abc.MetaPathFinder):
    """Run from a checkout (``python`` started in the repository root), the
    source tree's tf_dlt is imported: this maps tf_dlt.layers and
    tf_dlt.transpiler to their folders there, as the install does, and
    explains a native module that was not built in place."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        folder = _SOURCE_FOLDERS.get(fullname)
        if folder is not None:
            init = os.path.join(self.root, folder, "__init__.py")
            location = [os.path.dirname(init)]
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=location
            )
        if fullname in ("tf_dlt._native",):
            raise ImportError(
                f"tf_dlt is imported from its source tree ({self.root}), where the native code "
                "is not built: build it in place with `python setup.py build_ext --inplace` "
                "(scripts/setup_env.sh does), or run from outside the checkout to use the "
                "installed package"
            )
        return None


# Installed, keras_layers/ is tf_dlt.layers and transpiler/ tf_dlt.transpiler.
_SOURCE_FOLDERS = {"tf_dlt.layers": "keras_layers", "tf_dlt.transpiler": "transpiler"}
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_ROOT, "keras_layers", "__init__.py")):
    sys.meta_path.append(_SourceTree(_ROOT))

if "tensorflow" in sys.modules:
    # TensorFlow is already loaded: register the Dlt> ops now, so a SavedModel
    # that uses them loads right after `import tf_dlt`.
    importlib.import_module("tf_dlt.dlt_ops").load_library()

# The Keras objects a saved model may name (tf_dlt>Embedding, tf_dlt>DenseOnShards)
# are registered as soon as Keras is loaded, so `keras.models.load_model`
# works after `import tf_dlt` alone, whichever of the two comes first.
_KERAS_MODULES = ("tf_dlt.layers", "tf_dlt.keras.dense_sync")


def _register_keras_objects() -> None:
    for module in _KERAS_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - never break the import of Keras
            import warnings

            warnings.warn(
                f"tf_dlt could not register its Keras objects ({module}): {e}", stacklevel=2
            )


class _AfterKeras(importlib.abc.MetaPathFinder):
    """Runs _register_keras_objects once the import of Keras has finished.
    Stays on sys.meta_path until that import really runs: a mere probe
    (`importlib.util.find_spec("keras")`, as TensorFlow makes) is answered
    with a spec that is never executed."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "keras" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            exec_module(module)
            _register_keras_objects()

        loader.exec_module = exec_then_register
        return spec


if "keras" in sys.modules:
    _register_keras_objects()
else:
    sys.meta_path.insert(0, _AfterKeras())


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tf_dlt' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
