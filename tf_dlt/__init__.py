"""tf_dlt: a distributed embedding lookup table for TensorFlow / Keras 3.

``import tf_dlt`` does not import TensorFlow: the shard server and the Python
client work without it. Names are loaded on first use; ``tf_dlt.ops`` (the
TensorFlow ops) imports TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tf_dlt.version import __version__

if TYPE_CHECKING:
    from tf_dlt import dlt_ops as ops  # noqa: F401 (exported lazily below)
    from tf_dlt import (
        errors,
        initializers,
        layers,  # noqa: F401
        optimizers,
        routing,
    )
    from tf_dlt.client import Client
    from tf_dlt.table_config import TableConfig

_LAZY = {
    "Client": ("tf_dlt.client", "Client"),
    "TableConfig": ("tf_dlt.table_config", "TableConfig"),
    "errors": ("tf_dlt.errors", None),
    "ops": ("tf_dlt.dlt_ops", None),
    "initializers": ("tf_dlt.initializers", None),
    "layers": ("tf_dlt.layers", None),
    "optimizers": ("tf_dlt.optimizers", None),
    "routing": ("tf_dlt.routing", None),
    "transpile": ("tf_dlt.transpiler", "transpile"),
}

__all__ = [
    "Client",
    "TableConfig",
    "__version__",
    "errors",
    "initializers",
    "optimizers",
    "routing",
    "transpile",
]


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
