"""tf_dlt.layers: Keras layers backed by distributed tables.

Installed as ``tf_dlt.layers`` (never importable as ``keras_layers``).
"""

from . import distributed_build  # noqa: F401 (ragged ids in fit under a strategy)
from .embedding import Embedding

__all__ = ["Embedding"]
