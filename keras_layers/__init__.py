"""tf_dlt.layers: Keras layers backed by distributed tables.

Installed as ``tf_dlt.layers`` (never importable as ``keras_layers``).
"""

from .embedding import Embedding

__all__ = ["Embedding"]
