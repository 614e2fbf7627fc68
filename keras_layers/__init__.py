"""tf_dlt.layers: Keras layers backed by distributed tables.

Installed as ``tf_dlt.layers`` (never importable as ``keras_layers``). The
Embedding layer arrives with the Keras integration; nothing is exported yet.
"""

__all__: list[str] = []
