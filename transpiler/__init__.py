"""tf_dlt.transpiler: rewrites Keras models onto shard servers.

Installed as ``tf_dlt.transpiler`` (never importable as ``transpiler``).
``transpile`` arrives with the Keras integration; nothing is exported yet.
"""

__all__: list[str] = []
